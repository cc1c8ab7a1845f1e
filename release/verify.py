"""`./ninfer release verify DIR [--manifest-sha256 H] [--require-ready]`.

Checks a release directory as an auditor would, trusting nothing in it but the manifest (and
the manifest only as far as --manifest-sha256 pins it):
- every file is a plain file inside DIR, listed in SHA256SUMS and in the manifest, with the
  sha256 both state; nothing unlisted, no symlinks, no paths leaving DIR;
- each lane's engine bundle matches its digest and its own file table; its OCI image layout's
  blobs, manifest and config digests are the ones the manifest binds; both SBOMs pass their
  validators (spdx-tools; the CycloneDX JSON schema);
- each resolved profile binds a loopback host and a fixed port, with no remote model source;
- each lane's lock installs the JAX that exported its bundle, for its image's Python;
- compatibility.json states the released profiles' lanes, cards and contexts;
- no released document names a private path or a placeholder;
- each lane's status follows from its receipt: a lane without one, or with one made on
  synthetic weights or for another bundle or profile, is a candidate. --require-ready fails
  unless every lane is ready, naming each blocker.
Every failure is printed as `FAIL <file>: <check>: <detail>`; exit 0 when none, else 1.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path, PurePosixPath

from release import manifest as M

# A released document must not leak the machine it was built on or promise what is not there.
PRIVATE = re.compile(r"(/home/|/root/|/work/|/tmp/|/Users/|\\Users\\|file:/|"
                     r"\b(?:TODO|TBD|FIXME|XXX|PENDING|PLACEHOLDER)\b)")
DOCUMENT_SUFFIXES = (".json", ".lock", ".toml", ".txt", ".md")


class Report:
    def __init__(self):
        self.failures: list[str] = []

    def fail(self, file: str, check: str, detail: str) -> None:
        self.failures.append(f"FAIL {file}: {check}: {detail}")


def _safe(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and "\\" not in rel


def _read_json(root: Path, rel: str, r: Report):
    try:
        return json.loads((root / rel).read_bytes())
    except (OSError, ValueError) as e:
        r.fail(rel, "parse", f"not readable JSON ({type(e).__name__}: {e})")
        return None


def check_files(root: Path, doc: dict, r: Report) -> set[str]:
    """SHA256SUMS and the manifest's file table against what is on disk; returns the files
    whose bytes were verified."""
    try:
        on_disk = set(M.listing(root))
    except ValueError as e:
        r.fail(str(e).split(":", 1)[0], "plain files", str(e).split(": ", 1)[-1])
        on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and not p.is_symlink()}
    sums: dict[str, str] = {}
    try:
        for n, line in enumerate((root / "SHA256SUMS").read_text().splitlines(), 1):
            digest, sep, rel = line.partition("  ")
            if not sep or len(digest) != 64 or not _safe(rel):
                r.fail("SHA256SUMS", "format", f"line {n} is not `sha256  relative/path`")
                continue
            sums[rel] = digest
    except (OSError, UnicodeDecodeError) as e:
        r.fail("SHA256SUMS", "present", str(e))
    listed = dict(doc.get("files", {}))
    for rel in sorted(listed):
        if not _safe(rel):
            r.fail("manifest.json", "files", f"{rel!r} leaves the release directory")
    for rel in sorted(on_disk - set(sums) - {"SHA256SUMS"}):
        r.fail(rel, "listed", "not in SHA256SUMS (unlisted files are refused)")
    for rel in sorted(on_disk - set(listed) - {"SHA256SUMS", "manifest.json"}):
        r.fail(rel, "listed", "not in the manifest's file table")
    verified = set()
    for rel in sorted(set(sums) | set(listed)):
        if rel not in on_disk:
            r.fail(rel, "present", "listed but missing")
            continue
        actual = M.sha256_file(root / rel)
        bad = False
        if rel in sums and sums[rel] != actual:
            r.fail(rel, "sha256", f"{actual} but SHA256SUMS says {sums[rel]}")
            bad = True
        if rel in listed and listed[rel] != actual:
            r.fail(rel, "sha256", f"{actual} but the manifest says {listed[rel]}")
            bad = True
        if not bad:
            verified.add(rel)
    return verified


def check_documents(root: Path, verified: set[str], r: Report) -> None:
    for rel in sorted(verified):
        if not rel.endswith(DOCUMENT_SUFFIXES) and rel != "SHA256SUMS":
            continue
        text = (root / rel).read_text(errors="replace")
        m = PRIVATE.search(text)
        if m:
            r.fail(rel, "no private paths or placeholders", f"contains {m.group(0)!r}")


def check_lane(root: Path, name: str, e: dict, r: Report) -> list[str]:
    """One lane's parts; returns its blockers as recomputed here."""
    from release.bundle import open_bundle
    from release.oci import verify_layout
    from sbom.cyclonedx import validate_cyclonedx
    from sbom.spdx import validate_spdx

    prof_rel = e["profile"]["path"]
    prof = _read_json(root, prof_rel, r)
    if prof is not None:
        for problem in M.profile_problems(prof):
            r.fail(prof_rel, "fail-closed profile", problem)
        if prof.get("profile_sha256") != e["profile"]["profile_sha256"]:
            r.fail(prof_rel, "profile hash", "differs from the manifest's")
    b = e["bundle"]
    if (root / b["path"]).is_file():
        if M.sha256_file(root / b["path"]) != b["sha256"]:
            r.fail(b["path"], "bundle digest", "differs from the manifest's")
        else:
            try:
                open_bundle(root / b["path"], expect_lane=name)
            except Exception as ex:  # the bundle's own check names the file inside it
                r.fail(b["path"], "bundle contents", str(ex))
    lock_rel = f"locks/{e.get('lock')}"
    if (root / lock_rel).is_file():
        for problem in M.lock_problems(root / lock_rel, b.get("jax")):
            r.fail(lock_rel, "lock runs the bundle", problem)
    else:
        r.fail(lock_rel, "lane lock", f"lane {name} names {e.get('lock')!r}, not in locks/")
    oci = e["oci"]
    for problem in verify_layout(root / oci["path"]):
        r.fail(oci["path"], "OCI layout", problem)
    index = _read_json(root, f"{oci['path']}/index.json", r)
    if index is not None:
        digests = [m.get("digest") for m in index.get("manifests", [])]
        if digests != [oci["manifest"]]:
            r.fail(f"{oci['path']}/index.json", "OCI manifest digest",
                   f"{digests} but the release manifest binds {oci['manifest']}")
        man = _read_json(root, f"{oci['path']}/blobs/sha256/{oci['manifest'].split(':')[-1]}",
                         r) if digests == [oci["manifest"]] else None
        if man is not None:
            if man.get("config", {}).get("digest") != oci["config"]:
                r.fail(oci["path"], "OCI config digest", "differs from the release manifest's")
            if [x.get("digest") for x in man.get("layers", [])] != list(oci["layers"]):
                r.fail(oci["path"], "OCI layer digests", "differ from the release manifest's")
    for kind, validate in (("spdx", validate_spdx), ("cyclonedx", validate_cyclonedx)):
        rel = e["sboms"][kind]
        if (root / rel).is_file():
            for problem in validate(root / rel):
                r.fail(rel, f"{kind} validation", problem)
    receipt = None
    if e.get("receipt"):
        rel = e["receipt"]["path"]
        if (root / rel).is_file() and M.sha256_file(root / rel) != e["receipt"]["sha256"]:
            r.fail(rel, "receipt digest", "differs from the manifest's")
        receipt = _read_json(root, rel, r) if (root / rel).is_file() else None
        receipt = receipt if isinstance(receipt, dict) else {}
    blockers = M.receipt_blockers(name, receipt, b["sha256"], e["profile"]["profile_sha256"],
                                  e.get("model", {}).get("sha256"))
    if e.get("model", {}).get("sha256") is None:
        blockers.append(f"lane {name}: its model artifact is not pinned (model_sha256)")
    want = "candidate" if blockers else "ready"
    if e.get("status") != want:
        r.fail("manifest.json", "lane status", f"lane {name} says {e.get('status')!r}, its "
               f"receipt makes it {want!r}" + "".join(f"; {b}" for b in blockers))
    return blockers


def verify(root: Path, manifest_sha256: str | None = None, require_ready: bool = False
           ) -> list[str]:
    r = Report()
    if not root.is_dir():
        return [f"FAIL {root}: present: not a directory"]
    if manifest_sha256 is not None and (root / "manifest.json").is_file():
        actual = M.sha256_file(root / "manifest.json")
        if actual != manifest_sha256.lower():
            r.fail("manifest.json", "--manifest-sha256", f"{actual}, expected {manifest_sha256}")
    doc = _read_json(root, "manifest.json", r)
    if not isinstance(doc, dict) or doc.get("format") != M.FORMAT:
        if doc is not None:
            r.fail("manifest.json", "format", f"not {M.FORMAT}")
        return r.failures
    verified = check_files(root, doc, r)
    check_documents(root, verified, r)
    profiles, blockers = {}, []
    for name, e in sorted(doc.get("lanes", {}).items()):
        try:
            blockers += check_lane(root, name, e, r)
        except (KeyError, TypeError) as ex:
            r.fail("manifest.json", "lane entry", f"lane {name}: missing {ex}")
            continue
        prof = _read_json(root, e["profile"]["path"], r) if (
            root / e["profile"]["path"]).is_file() else None
        if prof is not None:
            profiles[name] = prof
    c = doc.get("compatibility", {})
    compat = _read_json(root, c.get("path", "compatibility.json"), r)
    if compat is not None:
        for problem in M.compatibility_problems(compat, profiles):
            r.fail(c.get("path", "compatibility.json"), "consistent with the profiles", problem)
    status = "candidate" if blockers or doc.get("source", {}).get("dirty") else "ready"
    if doc.get("status") != status:
        r.fail("manifest.json", "status", f"says {doc.get('status')!r}, the lanes make it "
               f"{status!r}")
    if require_ready:
        for b in blockers:
            r.fail("manifest.json", "--require-ready", b)
        if doc.get("source", {}).get("dirty"):
            r.fail("manifest.json", "--require-ready", "built from a tree with changes")
    return r.failures


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ninfer release verify")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--manifest-sha256", help="the manifest's sha256, as published")
    ap.add_argument("--require-ready", action="store_true",
                    help="fail unless every lane is qualified (a receipt on real weights)")
    args = ap.parse_args(argv)
    failures = verify(args.dir, args.manifest_sha256, args.require_ready)
    for line in failures:
        print(line)
    if failures:
        print(f"release verify: {len(failures)} failure(s) in {args.dir}", file=sys.stderr)
        return 1
    doc = json.loads((args.dir / "manifest.json").read_bytes())
    lanes = ", ".join(f"{n} {e['status']}" for n, e in sorted(doc["lanes"].items()))
    print(f"release {doc['version']} verified ({doc['status']}): {lanes}")
    return 0
