"""Observability: Prometheus metrics (server/observability.py) and the JSONL request log
(server/observability.py). The log must never hold prompt/output text or keys."""
from __future__ import annotations

import inspect
import json
import os
import re
import stat
import threading
from datetime import datetime

import prometheus_client
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from engine.engine import DoneEvent
from server import observability as request_log
from server.observability import (EVENTS, OUTCOMES, Metrics, Observability, RequestLog,
                                  engine_stats, principal_digest, session_digest)

MODEL = "tiny"


def scrape(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the text exposition, parsed by the client."""
    body, ctype = metrics.render()
    assert ctype.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def done(reason="stop", prompt=100, cached=60, output=10, path="continuation", queue_s=0.01,
         prefill_s=0.2, decode_s=0.5, error=None) -> DoneEvent:
    return DoneEvent(reason, prompt, output, queue_s=queue_s, prefill_s=prefill_s,
                     decode_s=decode_s, error=error, cached_tokens=cached, path=path)


# ---- metrics ----------------------------------------------------------------------------------
def test_counts_move_by_the_right_amounts():
    m = Metrics()
    obs = Observability(m, model=MODEL)
    before = scrape(m)
    assert all(value(before, "ninfer_requests_total", outcome=o) == 0 for o in OUTCOMES)

    t = obs.new_request("alice")
    obs.on_request_start(t, session="sess-1", prompt_tokens=100)
    t.mark_first_token()
    obs.on_request_done(t, done("stop", 100, 60, 10, "continuation", decode_s=0.5))
    obs.on_request_done(obs.new_request("alice"), done("length", 50, 0, 5, "root", decode_s=0.4))
    obs.on_request_done(obs.new_request("bob"), done("error", 20, 0, 0, "root",
                                                     error="MemoryError"))
    # Never admitted: a queue timeout, and a cancellation while waiting (zero prefill/decode).
    obs.on_request_done(obs.new_request("bob"), done("queue_timeout", 70, 0, 0, "root",
                                                     queue_s=120, prefill_s=0, decode_s=0))
    obs.on_request_done(obs.new_request("bob"), done("cancelled", 30, 0, 0, "root", queue_s=1,
                                                     prefill_s=0, decode_s=0))
    for status, code in [(401, "invalid_api_key"), (429, "server_overloaded"),
                         (400, "context_length_exceeded"), (404, "model_not_found"),
                         (503, "model_loading"), (500, "server_error")]:
        obs.on_request_rejected(obs.new_request(None), status, code)

    s = scrape(m)
    expect = {"completed": 1, "incomplete": 1, "error": 2, "rejected_queue_timeout": 1,
              "cancelled": 1, "unauthorized": 1, "rejected_overloaded": 1, "bad_request": 2,
              "rejected_loading": 1}
    for o in OUTCOMES:
        assert value(s, "ninfer_requests_total", outcome=o) == expect.get(o, 0), o
    assert value(s, "ninfer_prompt_tokens_total") == 100 + 50 + 20
    assert value(s, "ninfer_cached_tokens_total") == 60
    assert value(s, "ninfer_computed_prompt_tokens_total") == 40 + 50 + 20
    assert value(s, "ninfer_output_tokens_total") == 15
    assert value(s, "ninfer_requests_by_path_total", path="continuation") == 1
    assert value(s, "ninfer_requests_by_path_total", path="root") == 2
    assert value(s, "ninfer_requests_by_path_total", path="fork") == 0
    assert value(s, "ninfer_queue_wait_seconds_count") == 5
    assert value(s, "ninfer_queue_wait_seconds_bucket", le="+Inf") == 5
    assert value(s, "ninfer_ttft_seconds_count") == 1  # only the trace that saw a first token
    # stop after 10 tokens: 10 decode steps in 0.5 s; length at 5 tokens: 4 steps in 0.4 s.
    assert value(s, "ninfer_decode_seconds_per_token_count") == 2
    assert value(s, "ninfer_decode_seconds_per_token_sum") == pytest.approx(0.05 + 0.1)
    assert value(s, "ninfer_request_seconds_count") == 5


def test_checkpoint_events_move_their_metrics(tmp_path):
    m = Metrics()
    obs = Observability(m, RequestLog(tmp_path / "requests.jsonl"))
    before = scrape(m)
    assert value(before, "ninfer_checkpoint_saves_total", outcome="saved") == 0
    obs.on_event("checkpoint_saved", session_ns="ab" * 8, generation="g1", trigger="save",
                 frontier_tokens=640, written_bytes=4096, pages_written=1, pages_reused=9,
                 evicted=0, seconds=0.2)
    obs.on_event("checkpoint_refused", session_ns="ab" * 8, reason="quota", trigger="save")
    obs.on_event("checkpoint_restore", session_ns="ab" * 8, state="available",
                 reason="restored", generation="g1", restored_tokens=640, read_bytes=8192,
                 seconds=1.5)
    obs.on_event("checkpoint_restore", session_ns="cd" * 8, state="corrupt",
                 reason="hash_mismatch", generation="g2")
    obs.on_event("checkpoint_restore", session_ns="ef" * 8, state="missing",
                 reason="no_checkpoint", generation=None)
    after = scrape(m)
    assert value(after, "ninfer_checkpoint_saves_total", outcome="saved") == 1
    assert value(after, "ninfer_checkpoint_saves_total", outcome="refused") == 1
    assert value(after, "ninfer_checkpoint_save_bytes_total") == 4096
    assert value(after, "ninfer_checkpoint_save_seconds_count") == 1
    for outcome, n in (("restored", 1), ("corrupt", 1), ("missing", 1), ("no_room", 0),
                       ("incompatible", 0)):
        assert value(after, "ninfer_checkpoint_restores_total", outcome=outcome) == n
    assert value(after, "ninfer_checkpoint_restore_bytes_total") == 8192
    assert value(after, "ninfer_checkpoint_restore_seconds_bucket", le="2.0") == 1
    assert value(after, "ninfer_checkpoint_restore_seconds_bucket", le="1.0") == 0
    lines = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines].count("checkpoint_restore") == 3  # still logged


def test_a_trace_finishes_once():
    m = Metrics()
    obs = Observability(m)
    t = obs.new_request("alice")
    assert obs.on_request_done(t, done())
    # A catch-all handler reporting the same request again changes nothing.
    assert not obs.on_request_rejected(t, 400, "bad")
    assert not obs.on_request_error(t)
    assert not obs.on_request_abandoned(t)
    s = scrape(m)
    assert sum(value(s, "ninfer_requests_total", outcome=o) for o in OUTCOMES) == 1


def test_registries_are_private():
    a, b = Metrics(), Metrics()  # would raise "Duplicated timeseries" on a shared registry
    Observability(a).on_request_rejected(Observability(a).new_request(None), 429)
    assert value(scrape(a), "ninfer_requests_total", outcome="rejected_overloaded") == 1
    assert value(scrape(b), "ninfer_requests_total", outcome="rejected_overloaded") == 0
    assert prometheus_client.REGISTRY.get_sample_value("ninfer_requests_total",
                                                       {"outcome": "rejected_overloaded"}) is None


def _stats(used_pages=3, device_images=1, running=1, waiting=0):
    page_bytes = 1024
    return {"kv": {"pages_total": 16, "pages_used": used_pages, "pages_free": 16 - used_pages,
                   "pages_shared": 1, "page_size_tokens": 64, "page_bytes": page_bytes,
                   "kv_bytes_total": 16 * page_bytes, "kv_bytes_used": used_pages * page_bytes},
            "states": {"image_bytes": 100, "device_slots": 4, "device_images": device_images,
                       "device_bytes": 100 * device_images, "device_reserved_bytes": 400,
                       "host_images": 2, "host_bytes": 200, "host_bytes_limit": 1000,
                       "pinned_images": 0, "stores": 5, "restores": 2, "spills": 1,
                       "fetches": 0, "evictions": 1, "drops": 0},
            "snapshots": 3, "evictions": 1, "running": running, "waiting": waiting}


def test_pool_gauges_are_read_at_scrape_time():
    current = {"stats": _stats()}
    m = Metrics(stats=lambda: current["stats"])
    s = scrape(m)
    assert value(s, "ninfer_kv_capacity_bytes") == 16 * 1024
    assert value(s, "ninfer_kv_used_bytes") == 3 * 1024
    assert value(s, "ninfer_kv_pages", state="free") == 13
    assert value(s, "ninfer_kv_pages", state="shared") == 1
    assert value(s, "ninfer_state_images", tier="device") == 1
    assert value(s, "ninfer_state_bytes", tier="host") == 200
    assert value(s, "ninfer_state_capacity_bytes", tier="host") == 1000
    assert value(s, "ninfer_state_moves_total", op="stores") == 5
    assert value(s, "ninfer_snapshots") == 3
    assert value(s, "ninfer_snapshot_evictions_total") == 1
    assert value(s, "ninfer_sequences", state="running") == 1

    current["stats"] = _stats(used_pages=9, device_images=4, running=2, waiting=5)
    s = scrape(m)
    assert value(s, "ninfer_kv_used_bytes") == 9 * 1024
    assert value(s, "ninfer_kv_pages", state="used") == 9
    assert value(s, "ninfer_state_images", tier="device") == 4
    assert value(s, "ninfer_sequences", state="waiting") == 5

    current["stats"] = None  # the model is loading: no pool gauges, the rest still scrapes
    s = scrape(m)
    assert not any(name.startswith("ninfer_kv_") for name, _ in s)
    assert ("ninfer_requests_total", (("outcome", "completed"),)) in s


@pytest.mark.parametrize("bad", [RuntimeError("dictionary changed size during iteration"),
                                 {"kv": {"pages_used": 1}}, {"states": 7}])
def test_a_bad_stats_read_never_fails_a_scrape(bad):
    def stats():
        if isinstance(bad, Exception):
            raise bad
        return bad
    s = scrape(Metrics(stats=stats))
    assert not any(name.startswith(("ninfer_kv_", "ninfer_state_")) for name, _ in s)


def test_pool_gauges_from_a_real_memory():
    import jax.numpy as jnp

    from engine.model.config import TEST_SMALL
    from engine.runtime.memory import Memory

    mem = Memory(TEST_SMALL, batch=1, context_tokens=128, capacity_tokens=128,
                 kv_dtype=jnp.float32, conv_dtype=jnp.float32, state_slots=1,
                 host_state_bytes=0)

    class FakeEngine:  # what engine_stats reads from an Engine: its stats()
        def stats(self):
            return {**mem.stats(), "running": 0, "waiting": 2}

    s = scrape(Metrics(stats=lambda: engine_stats(FakeEngine())))
    kv = mem.stats()["kv"]
    assert value(s, "ninfer_kv_capacity_bytes") == kv["kv_bytes_total"] > 0
    assert value(s, "ninfer_kv_pages", state="free") == kv["pages_total"]
    assert value(s, "ninfer_state_images", tier="device") == 0
    assert value(s, "ninfer_sequences", state="waiting") == 2
    assert engine_stats(None) is None


# ---- the request log --------------------------------------------------------------------------
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
IDENTITY = ("request_id", "principal", "session", "model")
REQUIRED = {
    "server_start": ("pid", "lane", "host", "port", "model"),
    "request_start": IDENTITY + ("stream", "prompt_tokens", "max_output_tokens"),
    "request_rejected": IDENTITY + ("outcome", "status", "code", "total_s"),
    "request_done": IDENTITY + ("outcome", "finish_reason", "prompt_tokens", "cached_tokens",
                                "computed_tokens", "output_tokens", "path", "queue_s", "ttft_s",
                                "prefill_s", "decode_s", "total_s", "decode_tokens_per_s",
                                "speculative"),
    "request_error": IDENTITY + ("outcome", "status", "code", "error_type"),
}


def test_log_lines_are_json_with_the_required_fields(tmp_path):
    path = tmp_path / "requests.jsonl"
    with RequestLog(path) as log:
        obs = Observability(Metrics(), log)
        obs.on_server_start(lane="cpu", host="127.0.0.1", port=18089, model=MODEL,
                            model_sha256="ab" * 32)
        t = obs.new_request("alice", request_id="resp_0123")
        obs.on_request_start(t, session="my-session-key", stream=True, prompt_tokens=100,
                             max_output_tokens=64)
        t.mark_first_token()
        obs.on_request_done(t, done())
        obs.on_request_rejected(obs.new_request("alice"), 429, "server_overloaded")
        obs.on_request_error(obs.new_request("bob"), error_type="KeyError")
        obs.on_request_done(obs.new_request("bob"), done("error", error="MemoryError"))
    recs = read_lines(path)
    assert [r["event"] for r in recs] == ["server_start", "request_start", "request_done",
                                          "request_rejected", "request_error", "request_error"]
    for r in recs:
        assert RFC3339_UTC.match(r["ts"]) and datetime.fromisoformat(r["ts"].replace("Z", "+00:00"))
        assert r["event"] in EVENTS
        missing = [f for f in REQUIRED[r["event"]] if f not in r]
        assert not missing, (r["event"], missing)
        assert r["model"] == MODEL
    start, fin = recs[1], recs[2]
    assert start["request_id"] == fin["request_id"] == "resp_0123"
    assert start["principal"] == fin["principal"] == principal_digest("alice")
    assert re.fullmatch(r"p-[0-9a-f]{16}", fin["principal"])
    assert fin["session"] == session_digest("alice", "my-session-key") != \
        session_digest("bob", "my-session-key")
    assert (fin["prompt_tokens"], fin["cached_tokens"], fin["computed_tokens"],
            fin["output_tokens"], fin["path"]) == (100, 60, 40, 10, "continuation")
    assert fin["speculative"] is None and fin["outcome"] == "completed"
    assert fin["decode_tokens_per_s"] == pytest.approx(20.0)
    assert recs[5]["error_type"] == "MemoryError"
    text = path.read_text()
    assert "alice" not in text and "my-session-key" not in text


_units = sorted(request_log._UNITS)


@settings(max_examples=200, deadline=None)
@given(word=st.sampled_from(sorted(request_log._FORBIDDEN)),
       prefix=st.from_regex(r"[a-z0-9]{0,6}", fullmatch=True),
       suffix=st.from_regex(r"[a-z0-9]{0,6}", fullmatch=True).filter(lambda x: x not in _units),
       sep=st.sampled_from(["_", "-", ".", ""]),
       value=st.one_of(st.text(max_size=20), st.integers(), st.none()))
def test_forbidden_field_names_raise(tmp_path_factory, word, prefix, suffix, sep, value):
    parts = [p for p in (prefix, word, suffix) if p]
    name = sep.join(parts)
    if sep == "" and len(parts) > 1:
        name = "_".join(parts)  # run-together words are one part: not what this test probes
    log = RequestLog(tmp_path_factory.mktemp("log") / "r.jsonl")
    with pytest.raises(ValueError):
        log.write("request_done", **{name: value})
    with pytest.raises(ValueError):  # nested, as inside a stats object
        log.write("request_done", speculative={name: value})
    log.close()
    assert log.path.read_text() == ""


@pytest.mark.parametrize("fields", [{"prompt_tokens": "a b c"}, {"output_tokens": True},
                                    {"code": "x" * 201}, {"error_type": b"bytes"},
                                    {"ts": "2020-01-01T00:00:00Z"}, {"event": "x"}])
def test_other_unsafe_fields_raise(tmp_path, fields):
    with RequestLog(tmp_path / "r.jsonl") as log, pytest.raises(ValueError):
        log.write("request_done", **fields)
    with RequestLog(tmp_path / "r.jsonl") as log, pytest.raises(ValueError):
        log.write("not_an_event", request_id="r")


def test_no_public_method_takes_text_or_a_key():
    """The text-free guarantee starts at the API: no parameter can carry prompt/output/keys."""
    checked = 0
    for cls in (Observability, RequestLog, Metrics):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_") and name != "__init__":
                continue
            for p in inspect.signature(fn).parameters:
                if p in ("self", "fields", "info"):
                    continue  # **kwargs go through the field check
                parts = p.split("_")
                assert not set(parts) & request_log._FORBIDDEN or \
                    parts[-1] in request_log._UNITS, f"{cls.__name__}.{name}({p})"
                checked += 1
    assert checked > 10


@settings(max_examples=60, deadline=None)
@given(principal=st.text(min_size=12, max_size=80), session=st.text(min_size=12, max_size=300))
def test_user_strings_reach_the_log_only_as_digests(tmp_path_factory, principal, session):
    """The only client/operator strings the API accepts are the principal and the session key:
    arbitrary text there (a prompt pasted as a cache key) appears only as a digest. A string
    that the log's own structure already holds (Hypothesis draws strings from the code's
    constants, such as a field name) cannot be told apart from it and is not drawn."""
    def write(principal, session):
        path = tmp_path_factory.mktemp("log") / "r.jsonl"
        with RequestLog(path) as log:
            obs = Observability(Metrics(), log, model=MODEL)
            t = obs.new_request(principal)
            obs.on_request_start(t, session=session, prompt_tokens=3)
            obs.on_request_done(t, done())
            obs.on_request_rejected(obs.new_request(principal), 429)
        return path

    def forms(s):
        return (s, json.dumps(s)[1:-1], json.dumps(s, ensure_ascii=False)[1:-1])
    skeleton = write("p" * 12, "s" * 12).read_bytes().decode()
    assume(not any(f in skeleton for s in (principal, session) for f in forms(s)))
    path = write(principal, session)
    raw = path.read_bytes().decode()
    for s in (principal, session):
        for form in forms(s):
            assert form not in raw
    recs = read_lines(path)
    assert recs[1]["session"] == session_digest(principal, session)


# ---- files: rotation, concurrency, modes -------------------------------------------------------
@pytest.mark.parametrize("backups", [0, 1, 3])
def test_rotation_keeps_at_most_k_files_and_loses_no_line(tmp_path, backups):
    path = tmp_path / "r.jsonl"
    with RequestLog(path, max_bytes=2000, backups=backups) as log:
        for n in range(600):
            log.write("request_done", request_id=f"resp_{n:06d}", n=n)
    files = sorted(tmp_path.iterdir())
    assert len(files) <= backups + 1 and path in files
    assert all(f.stat().st_size <= 2000 for f in files)
    kept = _ordered(path, backups)
    # The retained lines are exactly the newest ones, in order, each whole: no gap, no repeat.
    assert kept == list(range(600 - len(kept), 600)) and len(kept) > 0


def _ordered(path, backups) -> list[int]:
    chain = [path.with_name(f"{path.name}.{i}") for i in range(backups, 0, -1)] + [path]
    return [r["n"] for f in chain if f.exists() for r in read_lines(f)]


def test_rotation_with_room_keeps_every_line(tmp_path):
    path = tmp_path / "r.jsonl"
    with RequestLog(path, max_bytes=1500, backups=1000) as log:
        for n in range(400):
            log.write("request_done", request_id=f"resp_{n:06d}", n=n)
    assert len(list(tmp_path.iterdir())) > 10
    assert _ordered(path, 1000) == list(range(400))


def test_concurrent_writes_give_whole_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    threads, per = 8, 400
    log = RequestLog(path, max_bytes=64 << 10, backups=1000)
    barrier = threading.Barrier(threads)

    def writer(k):
        barrier.wait()
        for i in range(per):
            log.write("request_done", request_id=f"resp_{k}_{i}", thread=k, i=i,
                      pad="x" * (i % 150))

    ts = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    log.close()
    seen = []
    for f in tmp_path.iterdir():
        data = f.read_text()
        assert data.endswith("\n")
        seen += [(r["thread"], r["i"]) for r in map(json.loads, data.splitlines())]
    assert sorted(seen) == [(k, i) for k in range(threads) for i in range(per)]
    for k in range(threads):  # each thread's lines keep their order
        assert [i for t, i in (x for x in _ordered_pairs(path) if x[0] == k)] == list(range(per))


def _ordered_pairs(path):
    rotated = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -int(p.suffix[1:]))
    return [(r["thread"], r["i"]) for f in rotated + [path] for r in read_lines(f)]


def test_files_are_0600_and_symlinks_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("")
    os.chmod(path, 0o644)
    old = os.umask(0)
    try:
        with RequestLog(path, max_bytes=300, backups=2) as log:
            for n in range(20):
                log.write("request_done", request_id=f"resp_{n}", n=n)
    finally:
        os.umask(old)
    files = list(tmp_path.iterdir())
    assert len(files) == 3
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(OSError):
        RequestLog(link)
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_a_log_io_error_never_fails_a_request(tmp_path, monkeypatch):
    m = Metrics()
    log = RequestLog(tmp_path / "r.jsonl")
    obs = Observability(m, log)

    def enospc(fd, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(request_log.os, "write", enospc)
    assert obs.on_request_done(obs.new_request("alice"), done())
    s = scrape(m)
    assert value(s, "ninfer_log_write_errors_total") == 1
    assert value(s, "ninfer_requests_total", outcome="completed") == 1
    log.close()
