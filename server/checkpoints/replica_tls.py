"""Mutual TLS between pinned certificates for the replica service.

Each side (the replica and every host that pushes or pulls) has its own key and self-signed
certificate, made once by `./ninfer checkpoints replica cert` into a directory (0700; the key
0600). The owner gives each side the other's certificate file and its sha256 fingerprint (of
the DER bytes, printed by `cert`). A peer certificate is used only when its file's fingerprint
is the pinned one, and it is the only certificate trusted for that peer: the client trusts
nothing but the replica's certificate, the replica nothing but the pinned clients' (and checks
the presented certificate's fingerprint again on every call). An unpinned or wrong peer fails
the TLS handshake; no connection is ever made without TLS.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

KEY_NAME, CERT_NAME = "replica.key", "replica.crt"
NAME = "ninfer-replica"  # the certificates' subject and DNS name, checked by the client
_OPTIONS = [("grpc.ssl_target_name_override", NAME),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20)]


class PinError(ValueError):
    """A certificate or key refused; the message names the file."""


def fingerprint(pem: bytes) -> str:
    """The sha256 of a PEM certificate's DER bytes, lower-case hex."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    cert = x509.load_pem_x509_certificate(pem)
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def make_cert(out_dir: Path, days: int = 3650) -> dict:
    """A new EC P-256 key (0600) and self-signed certificate in `out_dir` (0700); never
    overwrites. Returns the paths and the certificate's fingerprint."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out_dir = Path(out_dir)
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_path, cert_path = out_dir / KEY_NAME, out_dir / CERT_NAME
    for p in (key_path, cert_path):
        if p.exists() or p.is_symlink():
            raise FileExistsError(f"{p} exists; a replica certificate is never overwritten")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, False, False,
                                         False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    _write_private(cert_path, pem)
    os.chmod(cert_path, 0o644)  # the certificate is public; the key stays 0600
    return {"key": str(key_path), "cert": str(cert_path), "sha256": fingerprint(pem)}


@dataclass
class Identity:
    """This side's key and certificate, and the pinned peer certificates it trusts."""
    key: bytes
    cert: bytes
    peers: bytes            # the pinned peers' PEM certificates, concatenated
    pins: frozenset         # their fingerprints


def _normal_pin(pin: str) -> str:
    p = pin.strip().lower().replace(":", "")
    if len(p) != 64 or any(c not in "0123456789abcdef" for c in p):
        raise PinError(f"--pin {pin!r} is not a sha256 fingerprint (64 hex digits)")
    return p


def load_identity(cert_dir: Path, peer_certs: list, pins: list) -> Identity:
    """This side's key and certificate from `cert_dir`, and the peer certificates, each of
    which must have one of the pinned fingerprints (PinError naming the file otherwise)."""
    cert_dir = Path(cert_dir)
    key_path, cert_path = cert_dir / KEY_NAME, cert_dir / CERT_NAME
    for p in (key_path, cert_path):
        if not p.is_file():
            raise PinError(f"no {p.name} in {cert_dir} (create it with "
                           "`./ninfer checkpoints replica cert`)")
    if os.stat(key_path).st_mode & 0o077:
        raise PinError(f"{key_path} is readable by others (chmod 600 it)")
    if not peer_certs or not pins:
        raise PinError("give the peer's certificate (--peer-cert FILE) and its pinned "
                       "fingerprint (--pin SHA256): an unpinned peer is never trusted")
    pinned = frozenset(_normal_pin(p) for p in pins)
    pems = []
    for f in peer_certs:
        try:
            pem = Path(f).read_bytes()
            fp = fingerprint(pem)
        except (OSError, ValueError) as e:
            raise PinError(f"peer certificate {f}: unreadable ({e})") from None
        if fp not in pinned:
            raise PinError(f"peer certificate {f} has sha256 {fp}, which is not pinned "
                           "(--pin): refused")
        pems.append(pem)
    return Identity(key_path.read_bytes(), cert_path.read_bytes(), b"".join(pems), pinned)


def server_credentials(ident: Identity):
    import grpc

    return grpc.ssl_server_credentials([(ident.key, ident.cert)],
                                       root_certificates=ident.peers,
                                       require_client_auth=True)


def channel(address: str, ident: Identity):
    """A TLS channel to the replica at `address` that trusts only the pinned certificate."""
    import grpc

    creds = grpc.ssl_channel_credentials(root_certificates=ident.peers,
                                         private_key=ident.key, certificate_chain=ident.cert)
    return grpc.secure_channel(address, creds, options=_OPTIONS)


def server_options() -> list:
    return _OPTIONS[1:]


def peer_pinned(context, pins: frozenset) -> str | None:
    """The calling peer's fingerprint when it is pinned, else None (the handshake already
    required a trusted certificate; this checks the exact one)."""
    pems = context.auth_context().get("x509_pem_cert") or []
    if not pems:
        return None
    fp = fingerprint(pems[0])
    return fp if fp in pins else None


def unreachable(address: str, err) -> str:
    """A clear message for a failed connection (most often a refused handshake)."""
    return (f"replica {address} unreachable or the TLS handshake failed: its certificate is "
            "not the pinned one (--peer-cert/--pin), or it does not pin this side's "
            f"certificate ({err.details() if hasattr(err, 'details') else err})")
