"""CycloneDX 1.6 JSON for one lane's release, built and checked with cyclonedx-python-lib.

metadata.component is the lane (`ninfer-<lane>`, bom-ref `lane:<lane>`). Components: every lock
distribution (purl, SHA-256 of each admitted file, bom-ref = purl), the lane's files (type file,
SHA-1 + SHA-256, bom-ref `file:<path>`), the model (type machine-learning-model, SHA-256 when
pinned, bom-ref `model:<name>`) and the OMP client's npm packages (purl, SHA-512 from the lock
integrity, bom-ref = purl). The lane depends on its dists, files and model; each npm package on
the packages it resolves to. The serial number is a uuid5 of the inventory's content hash and
the timestamp is `inv.created`, so the bytes depend on the inventory only.
"""
from __future__ import annotations

import functools
import json
import uuid
from pathlib import Path

from cyclonedx.model import ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, \
    Property, XsUri
from cyclonedx.model.bom import Bom, BomMetaData
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.output.json import JsonV1Dot6
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from packageurl import PackageURL

from sbom.inventory import Inventory

# uuid5 namespace for serial numbers: uuid5(NAMESPACE_URL, the fixed SPDX namespace base)
SERIAL_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://ninfer.invalid/spdx")


class CycloneDxError(ValueError):
    pass


def _props(**values: str) -> list[Property]:
    return [Property(name=f"ninfer:{k}", value=v) for k, v in sorted(values.items())]


def serial_number(inv: Inventory) -> uuid.UUID:
    return uuid.uuid5(SERIAL_NAMESPACE, f"{inv.lane}/{inv.version}/{inv.content_hash()}")


def build_bom(inv: Inventory) -> Bom:
    """The cyclonedx-python-lib model of the lane's SBOM (not yet validated)."""
    lane = Component(type=ComponentType.APPLICATION, name=f"ninfer-{inv.lane}", version=inv.version,
                     bom_ref=f"lane:{inv.lane}", description=f"ninfer inference appliance, lane {inv.lane}")
    bom = Bom(serial_number=serial_number(inv),
              metadata=BomMetaData(component=lane, timestamp=inv.created_dt))
    lane_deps = []
    for d in inv.dists:
        c = Component(type=ComponentType.LIBRARY, name=d.name, version=d.version, bom_ref=d.purl,
                      purl=PackageURL.from_string(d.purl),
                      hashes=[HashType(alg=HashAlgorithm.SHA_256, content=h) for h in sorted(d.hashes)],
                      properties=_props(marker=d.marker) if d.marker else None)
        bom.components.add(c)
        lane_deps.append(c)
    for f in inv.files:
        c = Component(type=ComponentType.FILE, name=f.path, bom_ref=f"file:{f.path}",
                      hashes=[HashType(alg=HashAlgorithm.SHA_1, content=f.sha1),
                              HashType(alg=HashAlgorithm.SHA_256, content=f.sha256)],
                      properties=_props(kind=f.kind))
        bom.components.add(c)
        lane_deps.append(c)
    m = inv.model
    refs = ([ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(m.source))]
            if m.source.startswith(("https://", "http://")) else None)
    model = Component(type=ComponentType.MACHINE_LEARNING_MODEL, name=m.name, bom_ref=f"model:{m.name}",
                      hashes=[HashType(alg=HashAlgorithm.SHA_256, content=m.sha256)] if m.sha256 else None,
                      external_references=refs,
                      properties=_props(**{"model:preset": m.preset, "model:weights": m.weights,
                                           "model:source": m.source,
                                           "model:sha256": m.sha256 or "not pinned"}))
    bom.components.add(model)
    lane_deps.append(model)
    bom.register_dependency(lane, lane_deps)

    npm = {}
    for p in inv.npm:
        digest = p.sha512
        props = {"npm:integrity": p.integrity or "none in lock"}
        if p.client:
            props["omp-client"] = "true"
        refs = ([ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(p.resolved))]
                if p.resolved else None)
        npm[p.key] = c = Component(
            type=ComponentType.APPLICATION if p.client else ComponentType.LIBRARY,
            name=p.name.rsplit("/", 1)[-1], group=p.name.rsplit("/", 1)[0] if "/" in p.name else None,
            version=p.version, bom_ref=p.purl, purl=PackageURL.from_string(p.purl),
            hashes=[HashType(alg=HashAlgorithm.SHA_512, content=digest)] if digest else None,
            external_references=refs, properties=_props(**props))
        bom.components.add(c)
    for p in inv.npm:
        bom.register_dependency(npm[p.key], [npm[t] for t in p.depends if t in npm])
    return bom


@functools.lru_cache(maxsize=1)
def _validator() -> JsonStrictValidator:
    return JsonStrictValidator(SchemaVersion.V1_6)


def _schema_problems(text: str) -> list[str]:
    errors = _validator().validate_str(text, all_errors=True)
    out = []
    for e in errors or ():
        inner = e.data
        where = "/".join(str(x) for x in getattr(inner, "absolute_path", ())) or "(root)"
        out.append(f"schema: at {where}: {getattr(inner, 'message', inner)}")
    return out


_HEX_LEN = {"SHA-1": 40, "SHA-256": 64, "SHA-384": 96, "SHA-512": 128}


def _hash_length_problems(data: dict) -> list[str]:
    """The schema admits any of five hex lengths for every algorithm; a hash's length must
    also match its algorithm."""
    out = []
    for i, comp in enumerate([data.get("metadata", {}).get("component") or {}]
                             + list(data.get("components") or [])):
        for h in comp.get("hashes") or ():
            want = _HEX_LEN.get(h.get("alg"))
            if want and len(h.get("content", "")) != want:
                out.append(f"component {comp.get('bom-ref', i)}: {h['alg']} hash has "
                           f"{len(h.get('content', ''))} hex digits, not {want}")
    return out


def cyclonedx_document(inv: Inventory) -> bytes:
    """The lane's CycloneDX 1.6 JSON, checked against the 1.6 schema (strict); CycloneDxError
    lists the problems."""
    bom = build_bom(inv)
    bom.validate()  # the library's own model checks (dependency graph, bom-refs)
    text = JsonV1Dot6(bom).output_as_string(indent=2)
    problems = _schema_problems(text)
    if problems:
        raise CycloneDxError("CycloneDX document invalid:\n" + "\n".join(problems))
    return text.encode() + b"\n"


def validate_cyclonedx(path: Path | str) -> list[str]:
    """Problems with a CycloneDX 1.6 JSON file (empty when valid): unreadable or non-JSON text,
    a specVersion other than 1.6, every strict-schema error, and what the library reports when
    it reads the document back. Never raises."""
    try:
        text = Path(path).read_bytes().decode()
        data = json.loads(text)
    except (OSError, ValueError) as e:
        return [f"{path}: not a readable JSON file: {e}"]
    if not isinstance(data, dict):
        return [f"{path}: top level is not a JSON object"]
    if data.get("bomFormat") != "CycloneDX" or data.get("specVersion") != "1.6":
        return [f"{path}: not CycloneDX 1.6 (bomFormat {data.get('bomFormat')!r}, "
                f"specVersion {data.get('specVersion')!r})"]
    try:
        problems = [f"{path}: {m}" for m in _schema_problems(text)]
    except Exception as e:
        return [f"{path}: schema validation failed: {type(e).__name__}: {e}"]
    if problems:
        return problems
    problems = _hash_length_problems(data)
    if problems:
        return [f"{path}: {m}" for m in problems]
    try:
        bom = Bom.from_json(data)  # type: ignore[attr-defined]
        bom.validate()
    except Exception as e:
        return [f"{path}: cyclonedx-python-lib cannot read it: {type(e).__name__}: {e}"]
    return []
