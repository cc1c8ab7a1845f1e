"""The release's binding documents: the resolved profiles, compatibility.json, manifest.json and
SHA256SUMS. Every document is canonical JSON (sorted keys, two-space indent, one trailing
newline), so two builds of the same inputs write the same bytes."""
from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from pathlib import Path

FORMAT = "ninfer-release/1"
RECEIPT_FORMAT = "ninfer-receipt/1"
# The OMP client versions: the pinned one that every OMP test runs, and those tried and refused.
OMP_PACKAGE = "@oh-my-pi/pi-coding-agent"
OMP_REFUSED = {"18.3.4": "its dependency tree does not install: one of its own packages at that "
                         "version is unpublished"}
LOOPBACK_NAMES = ("localhost",)


def dumps(doc) -> bytes:
    return (json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def file_digest(path: Path, algo: str = "sha256") -> str:
    """The hex digest of a file (hashlib reads it in blocks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algo).hexdigest()


def sha256_file(path: Path) -> str:
    return file_digest(path, "sha256")


def sha1_file(path: Path) -> str:
    return file_digest(path, "sha1")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha1_bytes(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


IMAGE_PYTHON = "3.11"  # the lanes' image base's python (release/image.py: bookworm's 3.11)
_LOCK_PYTHON = re.compile(r"^# \S+\.lock: Python (\d+\.\d+)", re.M)


def lock_problems(lock: Path, bundle_jax: str) -> list[str]:
    """Why a lane's lock cannot run its bundle in its image: the lock installs another JAX than
    the one that exported the bundle's forwards (a bundle is refused by any other), or names
    another Python than the image's base."""
    from release.lock import pins

    out = []
    jax = pins(lock).get("jax")
    if jax != bundle_jax:
        out.append(f"{lock.name} installs jax {jax} but the bundle's forwards were exported "
                   f"with jax {bundle_jax}")
    m = _LOCK_PYTHON.search(Path(lock).read_text())
    if not m or m.group(1) != IMAGE_PYTHON:
        out.append(f"{lock.name} is for Python {m.group(1) if m else '(unstated)'} but the "
                   f"image's base runs Python {IMAGE_PYTHON}")
    return out


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolved_profile(profile) -> dict:
    """The profile as the release states it: every field, the plan spelled out, its canonical
    hash. A model not yet converted and pinned (`model_sha256 = "PENDING"` in the TOML) is
    stated as null and becomes a blocker of the lane."""
    d = profile.to_dict()
    if d.get("model_sha256") == "PENDING":
        d["model_sha256"] = None
    return {"format": "ninfer-profile/1", "profile": d,
            "profile_sha256": profile.canonical_hash()}


def profile_problems(doc: dict) -> list[str]:
    """What a resolved profile must hold to be released: loopback host, a fixed port, no
    remote model source, a pinned or explicitly missing model hash."""
    p = doc.get("profile", {})
    out = []
    if not is_loopback(str(p.get("host", ""))):
        out.append(f"host {p.get('host')!r} is not a loopback address")
    if not isinstance(p.get("port"), int) or not 0 < p["port"] < 65536:
        out.append("port is not a fixed port number")
    model = str(p.get("model", ""))
    if "://" in model:
        out.append(f"model {model!r} is fetched from elsewhere (no remote model sources)")
    sha = p.get("model_sha256")
    if sha is not None and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha)):
        out.append("model_sha256 is neither a sha256 nor null")
    return out


def lane_card(profile) -> dict | None:
    card = profile.table("card") if profile.card else None
    return dict(sorted(card.items())) if card else None


def checkpoint_fingerprint(profile, jax_version: str, platform: str, cuda_ops: str | None
                           ) -> dict:
    """The fields of a lane's runtime fingerprint (server/checkpoints/fingerprint.py) that the
    release fixes: a checkpoint restores only where all of them (and the weights) are equal."""
    from server.checkpoints.fingerprint import SCHEMA, engine_build_id

    return {"checkpoint_schema": SCHEMA, "engine_build": engine_build_id(),
            "jax": jax_version, "platform": platform, "profile_sha256": profile.canonical_hash(),
            "plan": profile.plan.to_dict(), "cuda_ops": cuda_ops,
            "model_sha256": resolved_profile(profile)["profile"]["model_sha256"],
            "speculative": None}


def omp_versions(package_lock: Path) -> dict:
    lock = json.loads(package_lock.read_text())
    deps = lock.get("packages", {}).get("", {}).get("dependencies", {})
    tested = deps.get(OMP_PACKAGE)
    return {"package": OMP_PACKAGE, "tested": [tested] if tested else [],
            "refused": dict(sorted(OMP_REFUSED.items()))}


def compatibility(lanes: dict, omp: dict) -> dict:
    """lanes: name -> {card, context_tokens, weights, kv_dtype, fingerprint}."""
    out = {"format": "ninfer-compatibility/1", "omp": omp, "lanes": {},
           "checkpoints": "a session checkpoint restores only into a runtime whose fingerprint "
                          "equals the one it was written under; any other is kept, not "
                          "restored, and the restore names the fields that differ"}
    for name, lane in sorted(lanes.items()):
        fp = lane["fingerprint"]
        out["lanes"][name] = {
            "card": lane["card"], "context_tokens": lane["context_tokens"],
            "weights": lane["weights"], "kv_dtype": lane["kv_dtype"],
            "checkpoint_fingerprint": fp,
            "checkpoint_fingerprint_sha256": hashlib.sha256(
                json.dumps(fp, sort_keys=True, separators=(",", ":")).encode()).hexdigest()}
    return out


def compatibility_problems(doc: dict, profiles: dict[str, dict]) -> list[str]:
    """compatibility.json against the released profiles: the same lanes, and for each the
    card, context, weights and KV dtype the profile states."""
    out = []
    lanes = doc.get("lanes", {})
    if set(lanes) != set(profiles):
        out.append(f"lanes {sorted(lanes)} differ from the released profiles {sorted(profiles)}")
    for name in sorted(set(lanes) & set(profiles)):
        p, c = profiles[name]["profile"], lanes[name]
        card = dict(sorted(p["card"].items())) if p.get("card") else None
        for key, want in (("card", card), ("context_tokens", p["context_tokens"]),
                          ("weights", p["weights"]), ("kv_dtype", p["kv_dtype"])):
            if c.get(key) != want:
                out.append(f"lane {name}: {key} {c.get(key)!r} but the profile says {want!r}")
        fp = c.get("checkpoint_fingerprint", {})
        if fp.get("profile_sha256") != profiles[name].get("profile_sha256"):
            out.append(f"lane {name}: the checkpoint fingerprint names another profile")
    return out


def receipt_blockers(lane: str, receipt: dict | None, bundle_sha256: str,
                     profile_sha256: str, model_sha256: str | None = None) -> list[str]:
    """Why a lane with this receipt (or none) is not ready; each names the receipt field."""
    if receipt is None:
        return [f"lane {lane}: no qualification receipt (qualification/{lane}.json)"]
    out = []

    def field(name: str, why: str, got) -> None:
        out.append(f"lane {lane}: {why} (receipt field {name}: {got!r})")

    if receipt.get("format") != RECEIPT_FORMAT:
        field("format", "not a qualification receipt", receipt.get("format"))
    if receipt.get("lane") != lane:
        field("lane", f"the receipt is for lane {receipt.get('lane')!r}", receipt.get("lane"))
    if receipt.get("bundle_sha256") != bundle_sha256:
        field("bundle_sha256", "the receipt qualified another bundle",
              receipt.get("bundle_sha256"))
    if receipt.get("profile_sha256") != profile_sha256:
        field("profile_sha256", "the receipt qualified another profile",
              receipt.get("profile_sha256"))
    model = receipt.get("model")
    got_model = model.get("sha256") if isinstance(model, dict) else None
    if model_sha256 is not None and got_model != model_sha256:
        field("model.sha256", "the receipt qualified another model", got_model)
    if receipt.get("verdict") != "pass":
        field("verdict", f"the receipt's verdict is {receipt.get('verdict')!r}",
              receipt.get("verdict"))
    if receipt.get("synthetic_weights") is not False:
        field("synthetic_weights", "qualified on synthetic weights (or does not say)",
              receipt.get("synthetic_weights"))
    return out


def listing(root: Path) -> list[str]:
    """Every regular file below root (relative, sorted); symlinks and other kinds raise."""
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            raise ValueError(f"{p.relative_to(root)}: a symlink (releases hold plain files only)")
        if p.is_file():
            out.append(p.relative_to(root).as_posix())
        elif not p.is_dir():
            raise ValueError(f"{p.relative_to(root)}: not a plain file")
    return out


def sums(root: Path, files: list[str]) -> bytes:
    return "".join(f"{sha256_file(root / f)}  {f}\n" for f in sorted(files)).encode()
