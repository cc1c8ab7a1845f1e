"""`encrypted_content` of reasoning items: the thinking's exact token ids, sealed for one principal.

When a request asks for `include: ["reasoning.encrypted_content"]`, each reasoning item carries

    "ninfer-rs1." + base64url(nonce[12] || AES-256-GCM(key, nonce, payload, aad))

where payload is the JSON `{"ids": [...]}` of the token ids the model produced for the reasoning
(through `</think>`), key is the server's reasoning key (32 random bytes in
`<state>/secrets/reasoning.key`, 0600, created on first use) and aad binds the blob to the
principal: another principal's blob, or a tampered one, does not open. A client that echoes the
item without its text (only `encrypted_content`) still gives the server the exact tokens, so the
transcript renders as the model wrote it.
"""
from __future__ import annotations

import base64
import json
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PREFIX = "ninfer-rs1."
_AAD = b"ninfer/reasoning/v1\0"


class ReasoningSeal:
    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError("the reasoning key must be 32 bytes")
        self._aead = AESGCM(key)

    @classmethod
    def from_state_dir(cls, state_dir: Path) -> "ReasoningSeal":
        """The key in <state>/secrets/reasoning.key: created 0600 on first use, refused when
        its mode is looser or its size wrong."""
        from server.checkpoints.tags import state_secret

        return cls(state_secret(state_dir, "reasoning.key"))

    def seal(self, principal: str, ids: list[int]) -> str:
        nonce = secrets.token_bytes(12)
        blob = self._aead.encrypt(nonce, json.dumps({"ids": list(ids)}).encode(),
                                  _AAD + principal.encode())
        return PREFIX + base64.urlsafe_b64encode(nonce + blob).decode().rstrip("=")

    def open(self, principal: str, sealed) -> list[int] | None:
        """The token ids, or None for anything that is not a valid blob of this principal."""
        if not isinstance(sealed, str) or not sealed.startswith(PREFIX):
            return None
        body = sealed[len(PREFIX):]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            plain = self._aead.decrypt(raw[:12], raw[12:], _AAD + principal.encode())
            ids = json.loads(plain)["ids"]
        except (ValueError, InvalidTag, KeyError, TypeError):
            return None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return None
        return ids
