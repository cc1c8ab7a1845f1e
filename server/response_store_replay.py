"""Exact replay reads of the response store: the stored token ids of an output item a client
echoed back, found by its id or by its content hash (`item_content_hash`), each row checked
against its hash. A mixin of `ResponseStore` (server/response_store.py), which owns `_conn` and
`_lock`."""
from __future__ import annotations

from server.response_store_values import check
from server.response_store_values import item_content_hash, unpack_token_ids


class ReplayReads:
    def _stored_tokens(self, principal: str, where: str, args: tuple) -> list[int] | None:
        """The newest live match's token ids among the principal's output items."""
        with self._lock:
            row = self._conn.execute(
                "SELECT o.* FROM output_items o JOIN responses r ON r.id = o.response_id"
                " JOIN principals p ON p.id = r.principal_id WHERE p.name = ? AND"
                f" r.deleted_at IS NULL AND o.token_ids IS NOT NULL AND {where}"
                " ORDER BY r.created_at DESC, r.rowid DESC LIMIT 1", (principal, *args)).fetchone()
        if row is None:
            return None
        check("output_items", row)
        return unpack_token_ids(row["token_ids"])

    def responses_with_output(self, principal: str, item: dict, limit: int = 4) -> list[str]:
        """Ids of the principal's live responses that produced an output item saying what
        `item` says (by `item_content_hash`), newest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT r.id FROM output_items o JOIN responses r ON r.id = o.response_id"
                " JOIN principals p ON p.id = r.principal_id WHERE p.name = ? AND"
                " r.deleted_at IS NULL AND o.content_hash = ?"
                " ORDER BY r.created_at DESC, r.rowid DESC LIMIT ?",
                (principal, item_content_hash(item), limit)).fetchall()
        return [r[0] for r in rows]

    def token_ids_for_item(self, principal: str, *, item_id: str | None = None,
                           content_hash: str | None = None) -> list[int] | None:
        """Exact replay: the token ids stored for an output item of one of the principal's live
        responses, found by item id or by `item_content_hash`; the newest match wins."""
        if (item_id is None) == (content_hash is None):
            raise ValueError("give exactly one of item_id and content_hash")
        if item_id is not None:
            return self._stored_tokens(principal, "o.item_id = ?", (item_id,))
        return self._stored_tokens(principal, "o.content_hash = ?", (content_hash,))

    def replay_token_ids(self, principal: str, item: dict) -> list[int] | None:
        """The stored token ids for an output item a client echoed back: by its id when the
        stored item under that id says the same thing, else by its content hash. None means
        the item must be tokenized from its text."""
        digest = item_content_hash(item)
        own = item.get("id")
        if isinstance(own, str):
            ids = self._stored_tokens(principal, "o.item_id = ? AND o.content_hash = ?",
                                      (own, digest))
            if ids is not None:
                return ids
        return self._stored_tokens(principal, "o.content_hash = ?", (digest,))
