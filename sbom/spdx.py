"""SPDX 2.3 JSON for one lane's release, built and checked with spdx-tools.

The document DESCRIBES the lane package (`ninfer-<lane>`) and the OMP client package. The lane
package CONTAINS the lane's files (SHA1 + SHA256 each, as SPDX 2.3 requires) and DEPENDS_ON
every distribution of its lock (purl, SHA256 of each admitted wheel/sdist) and the model package
(SHA256 when pinned). Each npm package carries its lock integrity as a SHA512 checksum and its
purl, and DEPENDS_ON the packages it resolves to. The namespace is NAMESPACE_BASE followed by
lane, version and the inventory's content hash; no other host name appears.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path

from spdx_tools.spdx.model import (
    Actor, ActorType, Checksum, ChecksumAlgorithm, CreationInfo, Document, ExternalPackageRef,
    ExternalPackageRefCategory, File, FileType, Package, PackagePurpose, PackageVerificationCode,
    Relationship, RelationshipType, SpdxNoAssertion,
)
from spdx_tools.spdx.parser.error import SPDXParsingError
from spdx_tools.spdx.parser.jsonlikedict.json_like_dict_parser import JsonLikeDictParser
from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document
from spdx_tools.spdx.writer.json.json_writer import write_document_to_stream

from sbom.inventory import Inventory

NAMESPACE_BASE = "https://ninfer.invalid/spdx"  # fixed; .invalid never resolves (RFC 2606)
_FILE_TYPES = {"cuda-op": [FileType.BINARY], "engine-bundle": [FileType.ARCHIVE]}


class SpdxError(ValueError):
    pass


def _ident(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", label).strip("-")


class _Ids:
    """SPDX ids from readable labels; a label that sanitizes to a taken id gets a -2, -3 ..."""

    def __init__(self):
        self.taken: set[str] = set()

    def __call__(self, label: str) -> str:
        base = f"SPDXRef-{_ident(label)}"
        ident, n = base, 1
        while ident in self.taken:
            n += 1
            ident = f"{base}-{n}"
        self.taken.add(ident)
        return ident


def _purl_ref(purl: str) -> ExternalPackageRef:
    return ExternalPackageRef(ExternalPackageRefCategory.PACKAGE_MANAGER, "purl", purl)


def _url_or_noassertion(value: str):
    return value if value.startswith(("https://", "http://")) else SpdxNoAssertion()


def verification_code(sha1s: list[str]) -> str:
    """SPDX package verification code: sha1 of the files' sorted sha1 hex digests, concatenated."""
    return hashlib.sha1("".join(sorted(sha1s)).encode()).hexdigest()


def build_document(inv: Inventory) -> Document:
    """The spdx-tools model of the lane's SBOM (not yet validated)."""
    ids = _Ids()
    doc_id = "SPDXRef-DOCUMENT"
    ids.taken.add(doc_id)
    namespace = f"{NAMESPACE_BASE}/{_ident(inv.lane)}-{_ident(inv.version)}-{inv.content_hash()}"
    info = CreationInfo(
        spdx_version="SPDX-2.3", spdx_id=doc_id, name=f"ninfer-{inv.lane}-{inv.version}",
        document_namespace=namespace, creators=[Actor(ActorType.TOOL, f"ninfer-release-{inv.version}")],
        created=inv.created_dt.replace(tzinfo=None),
        document_comment=f"ninfer release {inv.version}, lane {inv.lane}")
    packages, files, rels = [], [], []

    lane_id = ids(f"Package-ninfer-{inv.lane}")
    file_ids = []
    for f in inv.files:
        fid = ids(f"File-{f.path}")
        file_ids.append(fid)
        files.append(File(name=f"./{f.path}", spdx_id=fid,
                          checksums=[Checksum(ChecksumAlgorithm.SHA1, f.sha1),
                                     Checksum(ChecksumAlgorithm.SHA256, f.sha256)],
                          file_types=_FILE_TYPES.get(f.kind, [FileType.OTHER]),
                          comment=f"kind: {f.kind}"))
    packages.append(Package(
        spdx_id=lane_id, name=f"ninfer-{inv.lane}", version=inv.version,
        download_location=SpdxNoAssertion(), files_analyzed=bool(inv.files),
        verification_code=(PackageVerificationCode(verification_code([f.sha1 for f in inv.files]))
                           if inv.files else None),
        primary_package_purpose=PackagePurpose.APPLICATION,
        summary=f"ninfer inference appliance, lane {inv.lane}"))
    rels.append(Relationship(doc_id, RelationshipType.DESCRIBES, lane_id))
    rels.extend(Relationship(lane_id, RelationshipType.CONTAINS, fid) for fid in file_ids)

    m = inv.model
    model_id = ids(f"Package-model-{m.name}")
    packages.append(Package(
        spdx_id=model_id, name=m.name, download_location=_url_or_noassertion(m.source),
        files_analyzed=False, source_info=f"source: {m.source}",
        checksums=[Checksum(ChecksumAlgorithm.SHA256, m.sha256)] if m.sha256 else [],
        primary_package_purpose=PackagePurpose.OTHER,
        comment=f"model: preset={m.preset}; weights={m.weights}; "
                f"sha256={m.sha256 or 'not pinned'}"))
    rels.append(Relationship(lane_id, RelationshipType.DEPENDS_ON, model_id))

    for d in inv.dists:
        did = ids(f"Package-pypi-{d.name}-{d.version}")
        packages.append(Package(
            spdx_id=did, name=d.name, version=d.version, download_location=SpdxNoAssertion(),
            files_analyzed=False,
            checksums=[Checksum(ChecksumAlgorithm.SHA256, h) for h in sorted(d.hashes)],
            external_references=[_purl_ref(d.purl)], primary_package_purpose=PackagePurpose.LIBRARY,
            comment=f"environment marker: {d.marker}" if d.marker else None))
        rels.append(Relationship(lane_id, RelationshipType.DEPENDS_ON, did))

    npm_ids = {}
    for p in inv.npm:
        npm_ids[p.key] = pid = ids(f"Package-npm-{p.name}-{p.version}")
        digest = p.sha512
        packages.append(Package(
            spdx_id=pid, name=p.name, version=p.version,
            download_location=_url_or_noassertion(p.resolved), files_analyzed=False,
            checksums=[Checksum(ChecksumAlgorithm.SHA512, digest)] if digest else [],
            external_references=[_purl_ref(p.purl)],
            primary_package_purpose=PackagePurpose.APPLICATION if p.client else PackagePurpose.LIBRARY,
            comment=("the OMP client (Oh My Pi coding agent) this release is qualified with; "
                     if p.client else "") + f"npm integrity: {p.integrity or 'none in lock'}"))
        if p.client:
            rels.append(Relationship(doc_id, RelationshipType.DESCRIBES, pid))
    for p in inv.npm:
        rels.extend(Relationship(npm_ids[p.key], RelationshipType.DEPENDS_ON, npm_ids[t])
                    for t in p.depends if t in npm_ids)
    return Document(info, packages=packages, files=files, relationships=rels)


def _messages(validation) -> list[str]:
    """'<element type> <id or parent id>: <message>' for each spdx-tools ValidationMessage."""
    out = []
    for v in validation:
        kind = v.context.element_type.name.lower() if v.context.element_type else "document"
        where = v.context.spdx_id or (f"in {v.context.parent_id}" if v.context.parent_id else "")
        out.append(f"{kind} {where}: {v.validation_message}".replace(" :", ":"))
    return out


def spdx_document(inv: Inventory) -> bytes:
    """The lane's SPDX 2.3 JSON, validated by spdx-tools; SpdxError lists the problems."""
    document = build_document(inv)
    problems = _messages(validate_full_spdx_document(document))
    if problems:
        raise SpdxError("SPDX document invalid:\n" + "\n".join(problems))
    out = io.StringIO()
    write_document_to_stream(document, out, validate=False)
    return out.getvalue().encode() + b"\n"


def validate_spdx(path: Path | str) -> list[str]:
    """Problems with an SPDX 2.3 JSON file (empty when valid): unreadable or non-JSON text,
    parse errors, and every message of spdx-tools' full-document validator. Never raises."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        return [f"{path}: not a readable JSON file: {e}"]
    if not isinstance(data, dict):
        return [f"{path}: top level is not a JSON object"]
    try:
        document = JsonLikeDictParser().parse(data)
    except SPDXParsingError as e:
        return [f"{path}: SPDX parse error: {m}" for m in e.get_messages()] or [f"{path}: SPDX parse error"]
    except Exception as e:  # the parser raises assorted errors on malformed input
        return [f"{path}: SPDX parse error: {type(e).__name__}: {e}"]
    problems = []
    if document.creation_info.spdx_version != "SPDX-2.3":
        problems.append(f"{path}: spdxVersion is {document.creation_info.spdx_version}, not SPDX-2.3")
    try:
        problems += [f"{path}: {m}" for m in _messages(validate_full_spdx_document(document))]
    except Exception as e:
        problems.append(f"{path}: SPDX validation failed: {type(e).__name__}: {e}")
    return problems
