"""A storage failure under a request, answered in the API's error format and reported.

The response database (SQLite) and the checkpoint files fail in three ways a client and an
operator must tell apart: the disk is full (507 `storage_full`), an I/O error (500
`storage_io_error`), or stored bytes that are not what was written (500 `storage_corrupt`).
Each answer names the store and the reason; each is also reported on stderr and counted in
`ninfer_storage_errors_total{store, kind}` (`Observability.on_storage_fault`). A failed write
leaves nothing half-written: the database's transaction rolls back, and a checkpoint
generation is published by one rename or not at all.
"""
from __future__ import annotations

import errno

from server.errors import APIError
from server.response_store_values import fault_kind

_OS_KINDS = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EIO: "io", errno.EROFS: "io",
             errno.EACCES: "io", errno.EPERM: "io", errno.ENOTEMPTY: "io"}
_ANSWERS = {"full": (507, "storage_full", "its disk is full"),
            "io": (500, "storage_io_error", "an I/O error"),
            "corrupt": (500, "storage_corrupt", "stored data failed its integrity check")}
_STORES = {"responses": "the response store", "checkpoints": "the checkpoint store"}


def kind_of(store: str, exc: BaseException) -> str | None:
    if store == "responses":
        return fault_kind(exc)
    if isinstance(exc, OSError):
        return _OS_KINDS.get(exc.errno, "io")
    return None


def storage_error(obs, store: str, exc: BaseException, doing: str,
                  outcome: str = "") -> APIError | None:
    """The API error for `exc` raised by `store` while `doing` something (reported once), or
    None when `exc` is no storage failure. `outcome` says what that left (for the client)."""
    kind = kind_of(store, exc)
    if kind is None:
        return None
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    obs.on_storage_fault(store, kind, f"{doing}: {type(exc).__name__}: {detail}")
    status, code, why = _ANSWERS[kind]
    message = f"{doing} failed: {_STORES[store]} reports {why} ({detail})."
    if outcome:
        message += " " + outcome
    return APIError(status, message, type="server_error", code=code)
