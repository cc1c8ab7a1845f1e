"""The checkpointer: when to save, how to restore, and the stop report.

The checkpointer sees the engine through its checkpoint interface only
(engine/runtime/checkpoint_port.py): the hooks the engine is built with (`engine_hooks`) and
`Engine.checkpoint`. Saves run on one saver thread fed by a bounded queue: the HTTP layer only
enqueues (a stream never waits for a save). A save asks the engine thread to export the session
head's state (device reads happen between steps, only new pages are read), then hashes and
publishes it off the engine thread. Triggers: a completed stored response (`after_response`,
when autosave is on), an explicit request (`save`), the runtime evicting a session head that
is not on disk yet (`before_evict`, on the engine thread), and a graceful stop (`shutdown`).

Restore is lazy: the first request of a session in this process (or after its state was
evicted) calls `restore_for`, which installs the newest compatible, verified generation whose
tokens the prompt extends; the engine then reports the path `disk-restored`. Anything else
(missing, incompatible, corrupt) is a miss with a logged reason, and the request recomputes.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from server.checkpoints.checkpoint_store import CheckpointStore
from server.checkpoints.publish import SaveInput, SaveResult
from server.checkpoints.tags import session_namespace

EXPORT_TIMEOUT_S = 120.0


@dataclass
class Head:
    """The newest response of a session in this process and whether it is on disk."""
    response_id: str | None
    tokens: np.ndarray
    key: str
    saved: bool = False


class Checkpointer:
    """Built before the engine (whose hooks it gives, `engine_hooks`), attached to it once the
    engine and its runtime fingerprint exist (`attach`)."""

    def __init__(self, store: CheckpointStore, *, log=None, autosave: bool = True,
                 queue_size: int = 64):
        self.store, self.autosave = store, autosave
        self.fingerprint: dict | None = None
        self._log_fn = log
        self.engine = None
        self._digests = None
        self.arena = None  # engine/runtime/staging.StagingArena, once attached with one
        self._heads: dict[tuple[str, str], Head] = {}
        self._resident: set[tuple[str, str]] = set()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._mu = threading.Lock()
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="ninfer-checkpoints", daemon=True)
        self.draining = False
        self.counts = dict.fromkeys(("saved", "refused", "skipped", "restored", "misses"), 0)

    def engine_hooks(self):
        """The hooks to build the engine with: a session head about to be evicted is saved."""
        from engine.runtime.checkpoint_port import EngineHooks

        return EngineHooks(before_evict=self._before_evict)

    def attach(self, engine, fingerprint: dict, staging_bytes: int = 0) -> None:
        """Start checkpointing `engine` (built with `engine_hooks`) under `fingerprint`.
        `staging_bytes` (the lane's checkpoint_staging_bytes): host memory that restores
        stream through (engine/runtime/staging.py), faulted in now on a thread; 0 stages
        each restore whole in fresh memory."""
        from engine.runtime.checkpoint_io import PageDigests
        from engine.runtime.staging import StagingArena
        from server.checkpoints.files import aligned_bytes

        self.fingerprint = fingerprint
        self.engine, self._digests = engine, PageDigests()
        if staging_bytes > 0:
            self.arena = StagingArena(staging_bytes, aligned_bytes).start()
        self._thread.start()

    def _log(self, event: str, **fields) -> None:
        if self._log_fn is not None:
            try:
                self._log_fn(event, **fields)
            except (OSError, ValueError) as e:  # a log problem never fails a save or a request
                print(f"ninfer: checkpoint log: {type(e).__name__}", file=sys.stderr)

    # ---- triggers -------------------------------------------------------------------------
    def after_response(self, principal: str, session: str | None, response_id: str,
                       tokens) -> None:
        """A stored response finished; `tokens` is what its state follows. Never blocks."""
        if session is None:
            return
        head = self._set_head(principal, session, response_id, tokens)
        if self.autosave:
            self._enqueue(("save", principal, session, head, None))

    def save(self, principal: str, session: str | None = None, timeout: float = 120.0) -> list:
        """Save now (one session, or every session of `principal`); waits for the results."""
        with self._mu:
            keys = [k for k in self._heads if k[0] == principal and session in (None, k[1])]
        futs = []
        for p, s in keys:
            fut: Future = Future()
            self._jobs.put(("save", p, s, self._heads[(p, s)], fut), timeout=timeout)
            futs.append((s, fut))
        return [dict(session=s, **f.result(timeout=timeout)) for s, f in futs]

    def save_all(self, timeout: float = 120.0) -> list[dict]:
        """Every session head not on disk yet, saved now (graceful stop, `ctl save`)."""
        with self._mu:
            todo = list(self._heads.items())
        futs = []
        for (p, s), head in todo:
            fut: Future = Future()
            if head.saved:
                fut.set_result({"status": "already_saved", "generation": None})
            else:
                self._jobs.put(("save", p, s, head, fut), timeout=timeout)
            futs.append(((p, s), fut))
        out = []
        for (p, s), f in futs:
            try:
                r = f.result(timeout=timeout)
            except Exception as e:  # a timeout or an engine failure: reported, not raised
                r = {"status": "refused", "reason": type(e).__name__}
            out.append({"session": session_namespace(p, s)[:16], **r})
        return out

    def _before_evict(self, snap) -> None:
        # Engine thread, before the runtime drops `snap`: a session head not on disk is saved.
        k = (snap.principal, snap.session)
        head = self._heads.get(k)
        if head is None or head.key != snap.key:
            return
        self._resident.discard(k)
        if head.saved:
            return
        exp = self.engine.checkpoint.export(snap, self._digests, session=snap.session)
        self._enqueue(("save_export", snap.principal, snap.session, head, exp))

    # ---- restore --------------------------------------------------------------------------
    def accept_import(self, principal: str, session: str) -> bool:
        """Before an import publishes (principal, session): False while this process holds
        the session's state (its own turns would race the import); else forget an earlier
        miss, so the next request loads what the import wrote."""
        k = (principal, session)
        with self._mu:
            if k in self._heads:
                return False
            self._resident.discard(k)
            return True

    def restore_for(self, principal: str, session: str | None, prompt_ids) -> str | None:
        """Before a request of (principal, session) is submitted: install its checkpoint if
        this process does not hold the session's state. Returns the reason logged with the
        request (None when the state is resident). Blocking: call it off the event loop."""
        if session is None or self.engine is None:
            return None
        k = (principal, session)
        if k in self._resident:
            return None
        with self._mu:
            lock = self._locks.setdefault(k, threading.Lock())
        with lock:
            if k in self._resident:
                return None
            t0 = time.monotonic()
            res = self.store.load(principal, session, self.fingerprint, prompt_ids,
                                  page_layout=self._page_layout())
            self._resident.add(k)
            ns = session_namespace(principal, session)[:16]
            if res.state != "available":
                self.counts["misses"] += 1
                self._log("checkpoint_restore", session_ns=ns, state=res.state,
                          reason=res.reason, generation=res.generation,
                          **({"differs": res.differs} if res.differs else {}))
                return res.reason
            stages = dict(res.timings or {})
            try:
                snap = self._install(principal, session, res, stages)
            except BaseException:  # not resident: the next request tries again
                self._resident.discard(k)
                raise
            reason = "restored" if snap is not None else "no_room"
            if snap is None:  # running sequences hold the room: a later request retries
                self._resident.discard(k)
            if snap is not None:
                self.counts["restored"] += 1
                with self._mu:
                    self._heads[k] = Head(res.head_response_id, res.tokens, snap.key, True)
            self._log("checkpoint_restore", session_ns=ns, state=res.state, reason=reason,
                      generation=res.generation, restored_tokens=int(res.tokens.shape[0]),
                      read_bytes=res.bytes_read, seconds=round(time.monotonic() - t0, 6),
                      staging="arena" if hasattr(res.staged, "reservation") else "whole",
                      stages={k: round(v, 4) for k, v in stages.items()})
            return reason

    def _page_layout(self):
        """Pages are read straight into the engine's staging layout (no host copy on the
        engine thread), laid out by the engine's page spec in page-aligned memory (so the
        store reads them with O_DIRECT): streamed through the staging arena where there is
        one, else the whole session in fresh memory."""
        from engine.runtime.checkpoint_io import StagedPages
        from server.checkpoints.files import aligned_bytes

        spec = self.engine.checkpoint.page_spec
        whole = StagedPages.layout(spec, aligned_bytes)
        if self.arena is None:
            return whole
        return self.arena.layout(spec, whole, self.engine.checkpoint)

    def _install(self, principal, session, res, stages: dict):
        """Install a verified load on the engine thread; `stages` receives the transfer's
        remaining start (to_device_s) and the engine's scatter and install (import_s)."""
        port = self.engine.checkpoint
        conv, rec = port.state_layout.from_bytes(res.state_bytes)
        pages = res.pages
        t = time.monotonic()
        if res.staged is not None:  # transferred here: the engine thread only scatters
            pages = res.staged.to_device()
        stages["to_device_s"] = time.monotonic() - t
        t = time.monotonic()
        fut = port.install(principal, session, res.tokens, pages, conv, rec, self._digests,
                           res.page_digests)
        snap = fut.result(timeout=EXPORT_TIMEOUT_S)
        stages["import_s"] = time.monotonic() - t
        return snap

    # ---- deletions ------------------------------------------------------------------------
    def purge(self, principal: str, session: str) -> int:
        with self._mu:
            self._heads.pop((principal, session), None)
        self._resident.discard((principal, session))
        return self.store.purge(principal, session)

    def response_deleted(self, principal: str, session: str | None, response_id: str) -> int:
        if session is None:
            return 0
        with self._mu:
            head = self._heads.get((principal, session))
            if head is not None and head.response_id == response_id:
                del self._heads[(principal, session)]
        return self.store.drop_response(principal, session, response_id)

    # ---- the saver thread -----------------------------------------------------------------
    def _enqueue(self, job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:  # a later save or the stop covers it
            self.counts["skipped"] += 1
            self._log("checkpoint_skipped", reason="queue_full")

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut = job[4] if job[0] == "save" else None
            try:
                result = self._save_job(*job)
            except Exception as e:  # never kill the saver; report
                result = {"status": "refused", "reason": type(e).__name__}
            if fut is not None:
                fut.set_result(result)

    def _save_job(self, kind, principal, session, head: Head, extra) -> dict:
        port = self.engine.checkpoint
        if kind == "save" and head.saved:
            return {"status": "already_saved", "generation": None}
        exp = extra if kind == "save_export" else None
        for attempt in range(2):
            if exp is None:
                digests = self._digests if attempt == 0 else None
                exp = port.export_stored(principal, head.key, digests,
                                         session=session).result(timeout=EXPORT_TIMEOUT_S)
                if exp is None:
                    return {"status": "nothing_to_save", "generation": None}
            t0 = time.monotonic()
            image = port.state_layout.to_bytes(exp.conv, exp.rec)  # no copies, no join
            inp = SaveInput(exp.tokens, exp.page_size, exp.pages, exp.digests, image,
                            head.response_id)
            live = frozenset(session_namespace(p, s) for p, s in list(self._resident))
            res: SaveResult = self.store.save(principal, session, inp, self.fingerprint,
                                              live=live)
            if res.status == "refused" and res.reason == "page_missing" and attempt == 0:
                exp = None  # a page we thought was on disk is not: export every page again
                continue
            break
        ns = session_namespace(principal, session)[:16]
        if res.status == "saved":
            head.saved = True
            self.counts["saved"] += 1
            self._log("checkpoint_saved", session_ns=ns, generation=res.generation,
                      trigger=kind, frontier_tokens=int(exp.num_tokens),
                      written_bytes=res.bytes_written, pages_written=res.pages_written,
                      pages_reused=res.pages_reused, evicted=len(res.evicted),
                      seconds=round(time.monotonic() - t0, 6))
        else:
            self.counts["refused"] += 1
            self._log("checkpoint_refused", session_ns=ns, reason=res.reason, trigger=kind)
        return res.to_dict()

    def _set_head(self, principal, session, response_id, tokens) -> Head:
        from engine.runtime.memory import token_key

        tokens = np.asarray(tokens, np.int32)
        head = Head(response_id, tokens, token_key(principal, tokens))
        with self._mu:
            self._heads[(principal, session)] = head
        self._resident.add((principal, session))
        return head

    # ---- stop and status --------------------------------------------------------------------
    def shutdown(self, timeout: float = 60.0) -> dict:
        """Save every live session head, drain the queue, stop the saver; the stop report."""
        t0 = time.monotonic()
        results = self.save_all(timeout=timeout) if self.engine is not None else []
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=timeout)
        report = {"saved": [r for r in results if r["status"] == "saved"],
                  "already_saved": [r for r in results if r["status"] == "already_saved"],
                  "nothing_to_save": [r for r in results if r["status"] == "nothing_to_save"],
                  "refused": [r for r in results if r["status"] == "refused"],
                  "seconds": round(time.monotonic() - t0, 3)}
        return report

    def status(self) -> dict:
        return {"autosave": self.autosave, "draining": self.draining,
                "queued": self._jobs.qsize(), "sessions": len(self._heads),
                "unsaved": sum(1 for h in list(self._heads.values()) if not h.saved),
                **self.counts, "store": self.store.stats()}
