"""The values the response store keeps: records, history entries, token-id blobs and the
content hash that matches an echoed output item to the stored one."""
from __future__ import annotations

import hashlib
import json
import secrets
import sys
import time
from array import array
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResponseRecord:
    """One stored response. `output_token_ids[i]` are the ids the model produced for
    `output_items[i]` (None where none are known)."""
    id: str
    principal: str
    model: str
    status: str
    input_items: list[dict]
    output_items: list[dict]
    output_token_ids: list[list[int] | None]
    created_at: float = field(default_factory=time.time)
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    instructions: str | None = None
    params: dict = field(default_factory=dict)
    usage: dict | None = None
    prompt_tokens: int = 0
    # The prompt's token ids: all of them, or (extends_parent) only those after the parent's
    # token sequence. None when unknown.
    prompt_token_ids: list[int] | None = None
    extends_parent: bool = False


@dataclass(frozen=True)
class HistoryEntry:
    """One item of a rebuilt conversation; `token_ids` only for output items."""
    response_id: str
    kind: str  # "input" | "output"
    item: dict
    token_ids: list[int] | None


# ---- encodings ---------------------------------------------------------------------------------
def pack_token_ids(ids) -> bytes:
    """Token ids -> little-endian int32 bytes. Raises ValueError outside the int32 range."""
    try:
        a = array("i", ids)
    except OverflowError as e:
        raise ValueError(f"token id out of int32 range: {e}") from None
    if a.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte int
        raise RuntimeError("array('i') is not 32 bits on this platform")
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def unpack_token_ids(blob: bytes) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tolist()


def compact_json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _texts(parts) -> list:
    if isinstance(parts, str):
        return [parts]
    if not isinstance(parts, list):
        return []
    return [p.get("text", p.get("refusal")) if isinstance(p, dict) else p for p in parts]


def item_content_hash(item: dict) -> str:
    """A hash of what an output item says, blind to what clients change when they echo it:
    ids, status, annotations, logprobs and content-part type names are left out. A `message`
    is (role, texts), a `function_call` (call_id, name, arguments), a `reasoning` item its
    `encrypted_content` when it has one, else its summary and content texts; any other type is
    its JSON without `id` and `status`."""
    kind = item.get("type", "message")
    if kind == "message":
        canon = {"type": kind, "role": item.get("role"), "text": _texts(item.get("content"))}
    elif kind == "function_call":
        canon = {"type": kind, "call_id": item.get("call_id"), "name": item.get("name"),
                 "arguments": item.get("arguments")}
    elif kind == "reasoning" and isinstance(item.get("encrypted_content"), str):
        # the sealed token ids say it all; clients may echo it without the texts
        canon = {"type": kind, "encrypted_content": item["encrypted_content"]}
    elif kind == "reasoning":
        canon = {"type": kind, "summary": _texts(item.get("summary")),
                 "content": _texts(item.get("content"))}
    else:
        canon = {k: v for k, v in item.items() if k not in ("id", "status")}
    digest = hashlib.sha256(json.dumps(canon, sort_keys=True, ensure_ascii=False,
                                       separators=(",", ":")).encode()).hexdigest()
    return f"sha256:{digest}"


def input_item_ids(items: list[dict]) -> list[str]:
    """The listing id of each input item: its own `id` when it has a unique one, else a new
    one (clients send function_call and message items without ids)."""
    seen, out = set(), []
    for item in items:
        own = item.get("id") if isinstance(item, dict) else None
        if not isinstance(own, str) or not own or own in seen:
            own = f"item_{secrets.token_hex(16)}"
        seen.add(own)
        out.append(own)
    return out
