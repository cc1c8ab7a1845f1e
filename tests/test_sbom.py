"""SPDX 2.3 and CycloneDX 1.6 SBOMs of a lane (sbom/): built from this repository's own
requirements.lock and OMP package-lock, validated by spdx-tools and cyclonedx-python-lib,
byte-identical across builds and processes, and rejected when edited or truncated."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from release.lockfile import Dist, parse
from sbom.__main__ import main as sbom_main
from sbom.cyclonedx import CycloneDxError, cyclonedx_document, serial_number, validate_cyclonedx
from sbom.inventory import FileEntry, Inventory, InventoryError, ModelIdentity, inventory_for_lane
from sbom.spdx import NAMESPACE_BASE, SpdxError, build_document, spdx_document, validate_spdx

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
NPM_LOCK = REPO / "tests" / "omp" / "package-lock.json"
CREATED = "2026-12-01T10:00:00Z"
TINY_SHA = "26c34d35bd3da7440bc410de28004d05509c57c57b1f20d9ef7eff275696b19c"  # lanes/profiles/cpu.toml


def make_files(root: Path) -> None:
    """Stand-in release files with real bytes: a CUDA op library and an engine bundle."""
    (root / "cuda").mkdir(parents=True, exist_ok=True)
    (root / "cuda" / "ninfer_ops_sm_120.so").write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    (root / "engine-bundle.tar").write_bytes(b"bundle" * 1000)


def make_inventory(root: Path, model_sha: str | None = TINY_SHA):
    files = [FileEntry.from_path(root / "engine-bundle.tar", "engine-bundle.tar", "engine-bundle"),
             FileEntry.from_path(root / "cuda" / "ninfer_ops_sm_120.so", "cuda/ninfer_ops_sm_120.so",
                                 "cuda-op")]
    model = ModelIdentity("tiny", "tiny", "float32", model_sha, "embedded:tiny")
    return inventory_for_lane("cpu", LOCK, files, model, CREATED, "0.16.0", package_lock_path=NPM_LOCK)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("lane")
    make_files(root)
    inv = make_inventory(root)
    spdx, cdx = spdx_document(inv), cyclonedx_document(inv)
    (root / "sbom.spdx.json").write_bytes(spdx)
    (root / "sbom.cdx.json").write_bytes(cdx)
    return root, inv, spdx, cdx


def test_both_validate(built):
    root, _, spdx, cdx = built
    assert validate_spdx(root / "sbom.spdx.json") == []
    assert validate_cyclonedx(root / "sbom.cdx.json") == []
    doc = json.loads(spdx)
    assert doc["spdxVersion"] == "SPDX-2.3"
    assert doc["documentNamespace"].startswith(NAMESPACE_BASE + "/cpu-0.16.0-")
    assert doc["creationInfo"]["created"] == CREATED
    bom = json.loads(cdx)
    assert bom["specVersion"] == "1.6"
    assert bom["metadata"]["timestamp"].startswith("2026-12-01T10:00:00")
    assert bom["metadata"]["component"]["bom-ref"] == "lane:cpu"


def test_bytes_identical_across_builds_and_processes(built):
    root, _, spdx, cdx = built
    inv2 = make_inventory(root)
    assert spdx_document(inv2) == spdx
    assert cyclonedx_document(inv2) == cdx
    out = root / "sub"
    env = dict(os.environ, PYTHONHASHSEED="12345")  # a different set/dict hash order
    env.pop("SOURCE_DATE_EPOCH", None)
    subprocess.run([sys.executable, "-m", "sbom", "build", "--lane", "cpu", "--version", "0.16.0",
                    "--lock", str(LOCK), "--npm-lock", str(NPM_LOCK), "--created", CREATED,
                    "--file", f"{root / 'cuda/ninfer_ops_sm_120.so'}:cuda/ninfer_ops_sm_120.so:cuda-op",
                    "--file", f"{root / 'engine-bundle.tar'}:engine-bundle.tar:engine-bundle",
                    "--model", f"tiny,tiny,float32,{TINY_SHA},embedded:tiny", "--out", str(out)],
                   check=True, cwd=str(REPO), env=env, timeout=120)
    assert (out / "sbom.spdx.json").read_bytes() == spdx
    assert (out / "sbom.cdx.json").read_bytes() == cdx
    for blob in (spdx, cdx):
        assert str(root).encode() not in blob and str(REPO).encode() not in blob


def test_identifiers_follow_content(built):
    root, _, spdx, cdx = built
    other = make_inventory(root, model_sha="0" * 64)
    namespace = build_document(other).creation_info.document_namespace
    assert namespace.startswith(NAMESPACE_BASE + "/cpu-0.16.0-")
    assert namespace != json.loads(spdx)["documentNamespace"]
    assert serial_number(other).urn != json.loads(cdx)["serialNumber"]
    assert serial_number(make_inventory(root)).urn == json.loads(cdx)["serialNumber"]


def test_every_lock_dist_appears(built):
    _, _, spdx, cdx = built
    dists = parse(LOCK)
    assert len(dists) > 20
    packages = {(p["name"], p.get("versionInfo")): p for p in json.loads(spdx)["packages"]}
    components = {c["bom-ref"]: c for c in json.loads(cdx)["components"]}
    lane_deps = next(d["dependsOn"] for d in json.loads(cdx)["dependencies"] if d["ref"] == "lane:cpu")
    for d in dists:
        p = packages[(d.name, d.version)]
        assert [r["referenceLocator"] for r in p["externalRefs"]] == [f"pkg:pypi/{d.name}@{d.version}"]
        assert {c["checksumValue"] for c in p["checksums"] if c["algorithm"] == "SHA256"} == set(d.hashes)
        c = components[f"pkg:pypi/{d.name}@{d.version}"]
        assert c["version"] == d.version and c["purl"] == f"pkg:pypi/{d.name}@{d.version}"
        assert {h["content"] for h in c["hashes"] if h["alg"] == "SHA-256"} == set(d.hashes)
        assert c["bom-ref"] in lane_deps


def test_files_and_model(built):
    root, inv, spdx, cdx = built
    doc = json.loads(spdx)
    files = {f["fileName"]: f for f in doc["files"]}
    so = files["./cuda/ninfer_ops_sm_120.so"]
    algos = {c["algorithm"]: c["checksumValue"] for c in so["checksums"]}
    assert algos["SHA256"] == inv.files[0 if inv.files[0].kind == "cuda-op" else 1].sha256
    assert set(algos) == {"SHA1", "SHA256"} and so["fileTypes"] == ["BINARY"]
    contains = {(r["spdxElementId"], r["relatedSpdxElement"]) for r in doc["relationships"]
                if r["relationshipType"] == "CONTAINS"}
    assert (("SPDXRef-Package-ninfer-cpu", so["SPDXID"]) in contains) and len(contains) == 2
    model = next(p for p in doc["packages"] if p["name"] == "tiny")
    assert model["checksums"] == [{"algorithm": "SHA256", "checksumValue": TINY_SHA}]
    ml = next(c for c in json.loads(cdx)["components"] if c["type"] == "machine-learning-model")
    assert ml["hashes"] == [{"alg": "SHA-256", "content": TINY_SHA}]


def test_omp_client_and_npm_packages(built):
    _, _, spdx, cdx = built
    lock = json.loads(NPM_LOCK.read_text())["packages"]
    meta = lock["node_modules/@oh-my-pi/pi-coding-agent"]
    want_hex = base64.b64decode(meta["integrity"].split("-", 1)[1]).hex()
    doc = json.loads(spdx)
    client = next(p for p in doc["packages"] if p["name"] == "@oh-my-pi/pi-coding-agent")
    assert client["versionInfo"] == "18.2.3"
    assert client["checksums"] == [{"algorithm": "SHA512", "checksumValue": want_hex}]
    assert client["externalRefs"][0]["referenceLocator"] == "pkg:npm/%40oh-my-pi/pi-coding-agent@18.2.3"
    assert meta["integrity"] in client["comment"]
    assert {"spdxElementId": "SPDXRef-DOCUMENT", "relatedSpdxElement": client["SPDXID"],
            "relationshipType": "DESCRIBES"} in doc["relationships"]
    comps = {c["bom-ref"]: c for c in json.loads(cdx)["components"]}
    c = comps["pkg:npm/%40oh-my-pi/pi-coding-agent@18.2.3"]
    assert c["hashes"] == [{"alg": "SHA-512", "content": want_hex}]
    assert {"name": "ninfer:omp-client", "value": "true"} in c["properties"]
    deps = next(d["dependsOn"] for d in json.loads(cdx)["dependencies"] if d["ref"] == c["bom-ref"])
    assert "pkg:npm/%40oh-my-pi/pi-ai@18.2.3" in deps
    # every installed package of the lock is in both documents
    spdx_npm = {(p["name"], p.get("versionInfo")) for p in doc["packages"]}
    for key, m in lock.items():
        if key:
            name = m.get("name") or key.rsplit("node_modules/", 1)[1]
            assert (name, m["version"]) in spdx_npm, key
            purl = "pkg:npm/" + name.replace("@", "%40", 1) + "@" + m["version"]
            assert purl in comps, key


def _edited(src: Path, dst: Path, edit) -> Path:
    data = json.loads(src.read_text())
    edit(data)
    dst.write_text(json.dumps(data, indent=2))
    return dst


def test_edited_spdx_fails(built, tmp_path):
    root = built[0]
    src = root / "sbom.spdx.json"
    no_name = _edited(src, tmp_path / "a.json", lambda d: d["packages"][0].pop("name"))
    problems = validate_spdx(no_name)
    assert problems and any("name" in p for p in problems), problems

    def bad_sum(d):
        d["files"][0]["checksums"][0]["checksumValue"] = "not-hex"
    problems = validate_spdx(_edited(src, tmp_path / "b.json", bad_sum))
    assert problems and any("checksum" in p.lower() or "SHA1" in p for p in problems), problems

    def dangling(d):
        d["relationships"][0]["relatedSpdxElement"] = "SPDXRef-nothing"
    problems = validate_spdx(_edited(src, tmp_path / "c.json", dangling))
    assert any("SPDXRef-nothing" in p for p in problems), problems


def test_edited_cyclonedx_fails(built, tmp_path):
    root = built[0]
    src = root / "sbom.cdx.json"
    no_name = _edited(src, tmp_path / "a.json", lambda d: d["components"][0].pop("name"))
    problems = validate_cyclonedx(no_name)
    assert problems and any("name" in p for p in problems), problems

    def bad_hash(d):
        d["components"][0]["hashes"][0]["content"] = "zz"
    problems = validate_cyclonedx(_edited(src, tmp_path / "b.json", bad_hash))
    assert problems and any("zz" in p or "hashes" in p for p in problems), problems

    def old_spec(d):
        d["specVersion"] = "1.4"
    assert "not CycloneDX 1.6" in validate_cyclonedx(_edited(src, tmp_path / "c.json", old_spec))[0]


def test_truncated_and_missing_files_fail(built, tmp_path):
    root = built[0]
    for name, check in (("sbom.spdx.json", validate_spdx), ("sbom.cdx.json", validate_cyclonedx)):
        blob = (root / name).read_bytes()
        cut = tmp_path / name
        cut.write_bytes(blob[: len(blob) // 2])
        problems = check(cut)
        assert len(problems) == 1 and "not a readable JSON file" in problems[0], problems
        cut.write_bytes(b"[]")
        assert "not a JSON object" in check(cut)[0]
        assert "not a readable JSON file" in check(tmp_path / "absent.json")[0]


def test_inventory_rejects_bad_entries():
    with pytest.raises(InventoryError):
        FileEntry("/abs/x.so", "0" * 64, "0" * 40, "cuda-op")
    with pytest.raises(InventoryError):
        FileEntry("x.so", "0" * 63, "0" * 40, "cuda-op")
    with pytest.raises(InventoryError):
        ModelIdentity("m", "p", "int4", "PENDING", "x")
    with pytest.raises(InventoryError):
        inventory_for_lane("cpu", LOCK, [], ModelIdentity("m", "p", "w", None, "s"),
                           "2026-12-01T10:00:00", "0.16.0")  # no UTC offset


def test_cyclonedx_hash_length_must_match_algorithm(built, tmp_path):
    def short(d):  # 40 hex digits pass the 1.6 schema's pattern, but are no SHA-256
        c = next(c for c in d["components"] if c["bom-ref"].startswith("pkg:pypi/"))
        c["hashes"][0]["content"] = "ab" * 20
    problems = validate_cyclonedx(_edited(built[0] / "sbom.cdx.json", tmp_path / "h.json", short))
    assert problems and "SHA-256 hash has 40 hex digits, not 64" in problems[0], problems


def test_validate_cli(built, tmp_path, capsys):
    root = built[0]
    ok = [str(root / "sbom.spdx.json")]  # the valid CycloneDX file: test_both_validate
    assert sbom_main(["validate", *ok]) == 0
    cut = tmp_path / "cut.cdx.json"
    cut.write_bytes((root / "sbom.cdx.json").read_bytes()[:1000])
    assert sbom_main(["validate", *ok, str(cut)]) == 1
    out = capsys.readouterr().out
    assert f"{cut}: not a readable JSON file" in out and f"{ok[0]}: ok" in out


def test_writers_refuse_an_invalid_document():
    # the lock parser admits only hex sha256s; a hand-built Dist can carry anything
    inv = Inventory("cpu", "0.16.0", CREATED, [Dist("bad", "1.0", ("not-a-sha256",))], [],
                    ModelIdentity("m", "p", "w", None, "s"), ())
    with pytest.raises(SpdxError, match="SPDXRef-Package-pypi-bad-1.0.*64 lowercase hex"):
        spdx_document(inv)
    with pytest.raises(CycloneDxError, match="not-a-sha256"):
        cyclonedx_document(inv)
