"""The headline measurement through real server processes: after a restart, TTFT of a long
session restored from its durable checkpoint vs the same transcript re-prefilled cold, and
restart-to-ready (process start -> the server answers a generation) cold and with the persistent
JAX compilation cache warm.

    # on one H200 (everything, artifact included, in one command; ~17 GB artifact in --work-dir)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 bench/restore_27b.py \
        --work-dir /tmp/r27 --out restore_27b.json
    # the same script end to end on a CPU with the tiny shapes and a short transcript
    .venv/bin/python bench/restore_27b.py --preset tiny --tokens 2048 --prefill-chunk 256 \
        --plan reference --work-dir /tmp/r27cpu --out /tmp/r27cpu.json

Phases: (a) a synthetic-weight `.ninfer` artifact of the preset (bench/synth_artifact.py; kept
between runs, with its sha256 in a sidecar JSON); a lane profile TOML written into the work
dir, its [plan] table --plan's preset (engine/plan.py; default h200) with --set's fields. (b)
server 1 on a fresh state dir (cold compilation cache): restart-to-ready. (c) owner sends the
transcript (one user message of ~--tokens tokens) with a prompt_cache_key; the checkpoint is
flushed (POST /v1/ninfer/checkpoints waits for the save); graceful stop (SIGTERM) and its stop
report. (d) server 2 on the same state dir: restart-to-ready warm. (e) owner continues with a
short turn (previous_response_id): TTFT restored (request log: path `disk-restored`, the
restore's bytes and seconds). (e2) one more streamed greedy turn of --decode-tokens: decode
tokens/s at the client (first delta to last) and by the engine's request log. (f) another
principal sends the same transcript + answer + turn: TTFT of a cold re-prefill
(--skip-reprefill leaves it out). (g) table + JSON (--out).

The bench process never imports JAX (the servers own the GPU). Startup phases are taken from
the servers' `startup phases:` line (server/cli.py): boot, artifact open / copy to device /
verification (overlapped) / stacking, engine init (KV pool), compile, constraint tables,
checkpoint attach.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.plan_args import add_plan_args, make_plan, parse_overrides  # noqa: E402
from tests.serverproc import start_server  # noqa: E402

OWNER, COLD, PROBE = ("nk-owner-0123456789abcdef", "nk-cold-0123456789abcdef",
                      "nk-probe-0123456789abcdef")
SESSION = "restore-bench"
TURN = "Continue: summarise the last three steps in one line."

T_START = time.monotonic()


class OutOfTime(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- the transcript ---------------------------------------------------------------------------
_WORDS = ("parse tree vector merge cache queue graph token shard index lambda socket buffer "
          "thread kernel branch commit review patch schema table route handler config result "
          "error retry stream batch layer model weight tensor page state save restore").split()
_FILES = ("server/app.py engine/engine.py engine/runtime/memory.py tests/test_store.py "
          "lanes/profile.py bench/restore.py docs/checkpoints.md").split()


def _line(rng, i: int) -> str:
    k = int(rng.integers(0, 4))
    w = " ".join(rng.choice(_WORDS, int(rng.integers(4, 10))))
    f = _FILES[int(rng.integers(0, len(_FILES)))]
    if k == 0:
        return f"$ grep -n {rng.choice(_WORDS)} {f}  # step {i}"
    if k == 1:
        return f"{f}:{int(rng.integers(1, 900))}:    {rng.choice(_WORDS)}_{i} = {w.replace(' ', '_')}()"
    if k == 2:
        return f"assistant: I will {w} in {f} and rerun the tests ({i})."
    return f"tool result {i}: {int(rng.integers(0, 99))} passed, {w}"


def transcript(tokenizer, n_tokens: int, seed: int = 7) -> tuple[str, int]:
    """Agent-session-like text (shell commands, file lines, tool results) of exactly about
    n_tokens tokens under `tokenizer` (within a line): the longest run of the seed's lines
    whose text has at most n_tokens tokens; returns (text, its token count). The cut is found
    by bisection (~15 encodes of the whole text; popping a line at a time took ~280, a minute
    of the device's time before anything was measured)."""
    rng = np.random.default_rng(seed)
    sample = "\n".join(_line(rng, j) for j in range(200))
    per_line = len(tokenizer.encode(sample)) / 200
    rng = np.random.default_rng(seed)
    lines = [_line(rng, j) for j in range(int(n_tokens / per_line * 0.98))]

    def count(n_lines: int) -> int:
        return len(tokenizer.encode("\n".join(lines[:n_lines])))

    while count(len(lines)) <= n_tokens:  # grow past the target, then bisect back to it
        i = len(lines)
        lines += [_line(rng, i + j) for j in range(max(1, int(0.02 * len(lines))))]
    lo, hi = 1, len(lines)  # count(hi) > n_tokens; lo: at most n_tokens (one line is)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= n_tokens:
            lo = mid
        else:
            hi = mid
    text = "\n".join(lines[:lo])
    return text, len(tokenizer.encode(text))


# ---- HTTP -------------------------------------------------------------------------------------
def post_stream(srv, key: str, body: dict, timeout: float) -> dict:
    """A streamed /v1/responses request; returns {response, client_ttft_s, client_total_s,
    deltas (the stream's delta events), client_stream_s (its first delta to its last)}."""
    t0 = time.monotonic()
    first = None
    last = None
    deltas, t_last = 0, None
    with httpx.stream("POST", srv.api_url + "/responses", json={**body, "stream": True},
                      timeout=httpx.Timeout(timeout, connect=10),
                      headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if str(ev.get("type", "")).endswith(".delta"):
                t_last = time.monotonic() - t0
                deltas += 1
                if first is None:
                    first = t_last
            if ev.get("type") in ("response.completed", "response.incomplete",
                                  "response.failed"):
                last = ev["response"]
    if last is None:
        raise RuntimeError("the stream ended without a response")
    return {"response": last, "client_ttft_s": None if first is None else round(first, 3),
            "client_total_s": round(time.monotonic() - t0, 3), "deltas": deltas,
            "client_stream_s": None if first is None else round(t_last - first, 3)}


def continue_session(srv, model_id: str, previous_id: str, max_tokens: int,
                     timeout: float) -> dict:
    """The owner's next streamed, greedy turn of the session after `previous_id`."""
    return post_stream(srv, OWNER, {"model": model_id, "input": TURN,
                                    "previous_response_id": previous_id,
                                    "max_output_tokens": max_tokens, "temperature": 0,
                                    "prompt_cache_key": SESSION}, timeout)


def post_json(srv, key: str, path: str, body: dict, timeout: float) -> dict:
    r = httpx.post(srv.api_url + path, json=body, timeout=timeout,
                   headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return r.json()


def records(state: Path) -> list[dict]:
    p = state / "logs" / "requests.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def phases_of(srv) -> dict | None:
    for line in srv.log:
        if "startup phases:" in line:
            return json.loads(line.split("startup phases:", 1)[1])
    return None


# ---- one server lifetime ----------------------------------------------------------------------
def start_and_probe(state: Path, extra: list[str], timeout: float, model_id: str | None):
    """Start a server; returns (srv, {health_s, generate_s, phases, ...}) timed from Popen."""
    t0 = time.monotonic()
    srv = start_server(state, *extra, timeout=timeout, principal="owner")
    t_health = time.monotonic() - t0
    if model_id is None:
        model_id = post_json_get(srv, PROBE, "/models")["data"][0]["id"]
    probe = post_stream(srv, PROBE, {"model": model_id, "input": "Hi", "max_output_tokens": 1,
                                     "temperature": 0, "store": False}, timeout)
    t_gen = time.monotonic() - t0
    info = {"ready_health_s": round(t_health, 3), "ready_generate_s": round(t_gen, 3),
            "probe_ttft_s": probe["client_ttft_s"], "startup_phases": phases_of(srv),
            "model_id": model_id}
    return srv, info


def post_json_get(srv, key: str, path: str) -> dict:
    r = httpx.get(srv.api_url + path, timeout=30, headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return r.json()


def stop_server(srv, timeout: float = 120.0) -> dict:
    t0 = time.monotonic()
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()
    return {"stop_s": round(time.monotonic() - t0, 3), "returncode": srv.proc.returncode}


def done_record(state: Path, request_id: str) -> dict:
    for _ in range(50):
        for r in records(state):
            if r.get("event") in ("request_done", "request_error") and \
                    r.get("request_id") == request_id:
                return r
        time.sleep(0.1)
    return {}


# ---- the page cache ----------------------------------------------------------------------------
def evict_page_cache(paths: list[Path]) -> dict:
    """Take every file under `paths` out of the page cache, as a reboot would: the kernel's
    drop_caches where this process may write it (root), and posix_fadvise(DONTNEED) on each
    file either way (clean pages of a file nobody maps leave the cache). Returns what was done."""
    files, nbytes = [], 0
    for root in paths:
        for f in ([root] if root.is_file() else sorted(x for x in root.rglob("*") if x.is_file())):
            files.append(f)
    os.sync()
    dropped = None
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        dropped = True
    except OSError as e:
        dropped = f"{type(e).__name__}: {e}"
    advised = 0
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            nbytes += os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += 1
        finally:
            os.close(fd)
    return {"drop_caches": dropped, "fadvise_dontneed_files": advised, "bytes": nbytes}


# ---- artifact and profile ---------------------------------------------------------------------
def ensure_artifact(work: Path, preset: str, fmt: str, timeout: float) -> dict:
    art = work / "models" / f"{preset}-{fmt}.ninfer"
    side = art.with_suffix(".json")
    if art.exists() and side.exists():
        info = json.loads(side.read_text())
        if info.get("bytes") == art.stat().st_size:
            log(f"artifact present: {art} ({info['bytes'] / 1e9:.2f} GB, sha256 "
                f"{info['sha256'][:16]}...), reused")
            return {**info, "reused": True}
    art.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing the synthetic artifact {art} ...")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(REPO / "bench" / "synth_artifact.py"), "--out",
                          str(art), "--preset", preset, "--format", fmt, "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if out.returncode != 0:
        raise RuntimeError(f"synth_artifact failed:\n{out.stderr[-3000:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    info["process_s"] = round(time.monotonic() - t0, 3)
    side.write_text(json.dumps(info, indent=1) + "\n")
    log(f"artifact written: {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.1f}s "
        f"(process {info['process_s']:.1f}s), sha256 {info['sha256']}")
    return {**info, "reused": False}


def write_profile(work: Path, art: dict, a) -> tuple[Path, dict]:
    context = -(-(a.tokens + a.room) // 64) * 64
    prof = {
        "name": f"bench-{a.preset}", "device": a.device, "model": art["path"],
        "model_preset": a.preset,
        "model_sha256": art["sha256"], "compute_dtype": a.compute, "kv_dtype": a.kv,
        "context_tokens": context, "max_concurrency": a.concurrency,
        "prefill_chunk": a.prefill_chunk, "max_output_tokens": 4096, "max_queue": 4,
        "queue_timeout_s": 900.0, "kv_capacity_tokens": context * a.concurrency,
        "state_slots": a.state_slots, "host_state_bytes": 0, "host": "127.0.0.1",
        "port": 18089,
    }
    # the lane's kernel plan: a [plan] table (its preset and the fields --set gives)
    plan = {"preset": a.plan, **{k: v for k, v in parse_overrides(a.set).items()
                                 if v is not None}}  # TOML has no null

    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    path = work / "bench-lane.toml"
    path.write_text("# written by bench/restore_27b.py\n" +
                    "".join(f"{k} = {val(v)}\n" for k, v in prof.items()) +
                    "\n[plan]\n" + "".join(f"{k} = {val(v)}\n" for k, v in plan.items()))
    return path, {**prof, "plan": plan}


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,"
                              "noheader"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ---- main -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", default="/tmp/ninfer-restore-bench")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--preset", default="qwen3.8-27b")
    ap.add_argument("--format", default="int4_g64", choices=("int4_g64", "bf16"))
    ap.add_argument("--tokens", type=int, default=131072, help="transcript tokens")
    ap.add_argument("--room", type=int, default=4096,
                    help="context beyond the transcript (template, answer, turn)")
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=256,
                    help="phase (e2): one more streamed, greedy turn of this many tokens after "
                         "the restore, timed at the client and by the engine (0: skip)")
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    add_plan_args(ap, "h200", "the servers' lane profile names")
    ap.add_argument("--compute", default="bfloat16")
    ap.add_argument("--kv", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="max_concurrency (>1 pads every prefill step to that many rows)")
    ap.add_argument("--state-slots", type=int, default=4)
    ap.add_argument("--device", default=None, help="profile device label (default: gpu/cpu)")
    ap.add_argument("--checkpoint-quota", default="40G")
    ap.add_argument("--skip-reprefill", action="store_true",
                    help="skip phase (f), the cold re-prefill by another principal (a cheaper "
                         "re-measurement of restart-to-ready and the restore)")
    ap.add_argument("--cold-disk", action=argparse.BooleanOptionalAction, default=True,
                    help="take the state directory and the artifact out of the page cache "
                         "before server 2 starts (its start and restore read from the disk), "
                         "then start server 3 with them cached: the same restore warm")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="give up (and stop the servers) past this many seconds")
    a = ap.parse_args(argv)
    make_plan(a.plan, parse_overrides(a.set))  # a plan that does not fit: a usage error now
    deadline = T_START + a.budget_s
    gpu = gpu_name()
    a.device = a.device or ("gpu" if gpu else "cpu")

    def left(margin: float = 5.0) -> float:
        s = deadline - time.monotonic() - margin
        if s <= 0:
            raise OutOfTime(f"over the {a.budget_s:.0f}s budget")
        return s

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "gpu": gpu,
                    "python": platform.python_version()},
        "jax": _version("jax"), "jaxlib": _version("jaxlib"),
        "env": {k: os.environ[k] for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_PLATFORMS",
                                          "XLA_FLAGS") if k in os.environ},
        "args": vars(a),
    }
    srv = None
    try:
        free = shutil.disk_usage(work).free
        log(f"work dir {work}: {free / 1e9:.1f} GB free")
        result["artifact"] = art = ensure_artifact(work, a.preset, a.format, left())
        profile_path, prof = write_profile(work, art, a)
        result["profile"] = {**prof, "path": str(profile_path)}

        from engine.text.tokenizer import Tokenizer, build_qwen35_tokenizer_json

        tok = Tokenizer(build_qwen35_tokenizer_json())
        t0 = time.monotonic()
        text, n_text = transcript(tok, a.tokens - 64)  # leave room for the chat template
        result["transcript"] = {"tokens": n_text, "chars": len(text),
                                "build_s": round(time.monotonic() - t0, 3)}
        log(f"transcript: {n_text} tokens, {len(text)} chars")

        state = work / "state"
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(parents=True, mode=0o700)
        (state / "keys").write_text(f"owner {OWNER}\ncold {COLD}\nprobe {PROBE}\n")
        (state / "keys").chmod(0o600)
        os.environ.pop("NINFER_JAX_CACHE", None)  # the cache lives in the state dir: cold at first
        os.environ.setdefault("SANIC_RESPONSE_TIMEOUT", "3600")
        extra = ["--lane", str(profile_path), "--checkpoints", "on", "--checkpoint-autosave",
                 "on", "--checkpoint-quota", a.checkpoint_quota]

        # (b) server 1: cold start
        log("server 1: starting (cold compilation cache)")
        srv, s1 = start_and_probe(state, extra, left(), None)
        model_id = s1["model_id"]
        result["server1"] = s1
        log(f"server 1 ready: health {s1['ready_health_s']}s, generate {s1['ready_generate_s']}s;"
            f" phases {s1['startup_phases']}")

        # (c) the long session, checkpointed, then a graceful stop
        log(f"owner: the {n_text}-token transcript (prompt_cache_key {SESSION!r})")
        first = post_stream(srv, OWNER, {"model": model_id, "input": text,
                                         "max_output_tokens": a.max_output, "temperature": 0,
                                         "prompt_cache_key": SESSION}, left())
        r1 = first["response"]
        d1 = done_record(state, r1["id"])
        log(f"  first prefill: ttft {d1.get('ttft_s')}s (client {first['client_ttft_s']}s), "
            f"prompt {r1['usage']['input_tokens']} tokens")
        t0 = time.monotonic()
        saved = post_json(srv, OWNER, "/ninfer/checkpoints", {"prompt_cache_key": SESSION},
                          left())
        flush_s = time.monotonic() - t0
        log(f"  checkpoint flush: {flush_s:.1f}s -> {json.dumps(saved)[:300]}")
        stop1 = stop_server(srv, min(left(), 180))
        srv = None
        report = state / "stop_report.json"
        result["session"] = {
            "prompt_tokens": r1["usage"]["input_tokens"],
            "first_prefill": {"ttft_s": d1.get("ttft_s"), "client_ttft_s": first["client_ttft_s"],
                              "prefill_s": d1.get("prefill_s"), "path": d1.get("path"),
                              "computed_tokens": d1.get("computed_tokens")},
            "flush": {"seconds": round(flush_s, 3), "response": saved},
            "stop": stop1,
            "stop_report": json.loads(report.read_text()) if report.exists() else None,
        }
        saves = [r for r in records(state) if r["event"] == "checkpoint_saved"]
        result["session"]["checkpoint_saves"] = saves
        log(f"server 1 stopped in {stop1['stop_s']}s; saves: "
            f"{[(s.get('written_bytes'), s.get('seconds')) for s in saves]}")

        # (d) server 2: warm compilation cache; with --cold-disk, every file out of the page cache
        if a.cold_disk:
            result["evicted"] = evict_page_cache([state, Path(art["path"])])
            log(f"page cache: {result['evicted']}")
        log("server 2: starting (same state dir, compilation cache warm"
            f"{', cold disk' if a.cold_disk else ''})")
        srv, s2 = start_and_probe(state, extra, left(), model_id)
        result["server2"] = s2
        log(f"server 2 ready: health {s2['ready_health_s']}s, generate {s2['ready_generate_s']}s;"
            f" phases {s2['startup_phases']}")

        # (e) continue the session: restored from disk
        n_before = len(records(state))
        second = continue_session(srv, model_id, r1["id"], a.max_output, left())
        r2 = second["response"]
        d2 = done_record(state, r2["id"])
        restores = [r for r in records(state)[n_before:] if r["event"] == "checkpoint_restore"]
        log(f"  restored turn: ttft {d2.get('ttft_s')}s (client {second['client_ttft_s']}s), "
            f"path {d2.get('path')}, computed {d2.get('computed_tokens')} tokens; "
            f"restore {[(x.get('state'), x.get('read_bytes'), x.get('seconds')) for x in restores]}")
        # (e2) decode as a client sees it: one more turn of the session, streamed, greedy
        decode = None
        if a.decode_tokens:
            third = continue_session(srv, model_id, r2["id"], a.decode_tokens, left())
            d3 = done_record(state, third["response"]["id"])
            n_out = third["response"]["usage"]["output_tokens"]
            decode = {"output_tokens": n_out, "finish_reason": d3.get("finish_reason"),
                      "engine_decode_s": d3.get("decode_s"),
                      "engine_decode_tokens_per_s": d3.get("decode_tokens_per_s"),
                      "prompt_tokens": d3.get("prompt_tokens"), "path": d3.get("path"),
                      "client_ttft_s": third["client_ttft_s"], "deltas": third["deltas"],
                      "client_stream_s": third["client_stream_s"],
                      "client_tokens_per_s": (round((n_out - 1) / third["client_stream_s"], 2)
                                              if third["client_stream_s"] else None)}
            log(f"  decode turn: {n_out} tokens ({d3.get('finish_reason')}), engine "
                f"{d3.get('decode_tokens_per_s')} tok/s, client {decode['client_tokens_per_s']}"
                f" tok/s over {third['deltas']} deltas")
        result["decode"] = decode
        post_json(srv, OWNER, "/ninfer/checkpoints", {"prompt_cache_key": SESSION}, left())

        # (f) the same transcript, another principal: cold re-prefill
        cold, dc = {"client_ttft_s": None}, {}
        if a.skip_reprefill:
            log("  cold re-prefill: skipped (--skip-reprefill)")
        else:
            cold = post_stream(srv, COLD, {"model": model_id, "max_output_tokens": a.max_output,
                                           "temperature": 0, "input": [
                                               {"role": "user", "content": text},
                                               {"role": "assistant",
                                                "content": r1["output_text"]},
                                               {"role": "user", "content": TURN}]}, left())
            dc = done_record(state, cold["response"]["id"])
            log(f"  cold re-prefill: ttft {dc.get('ttft_s')}s (client {cold['client_ttft_s']}s), "
                f"path {dc.get('path')}, computed {dc.get('computed_tokens')} tokens")
        stop2 = stop_server(srv, min(left(0), 120))
        srv = None
        warm = None
        if a.cold_disk:  # (g) server 3: the same restore with every file in the page cache
            last = third["response"] if a.decode_tokens else r2
            for f in [Path(art["path"])] + sorted(x for x in state.rglob("*") if x.is_file()):
                with open(f, "rb") as fh:  # what a server that just ran leaves cached
                    while fh.read(1 << 24):
                        pass
            log("server 3: starting (everything in the page cache)")
            srv, s3 = start_and_probe(state, extra, left(), model_id)
            n_before = len(records(state))
            fourth = continue_session(srv, model_id, last["id"], a.max_output, left())
            d4 = done_record(state, fourth["response"]["id"])
            rs3 = next((x for x in records(state)[n_before:]
                        if x["event"] == "checkpoint_restore" and x.get("state") == "available"),
                       {})
            s3["stop"] = stop_server(srv, min(left(0), 120))
            srv = None
            warm = {"server3": s3, "ttft_s": d4.get("ttft_s"), "path": d4.get("path"),
                    "client_ttft_s": fourth["client_ttft_s"],
                    "restore_bytes": rs3.get("read_bytes"), "restore_s": rs3.get("seconds")}
            log(f"  warm restore: ttft {warm['ttft_s']}s, path {warm['path']}, "
                f"restore {warm['restore_bytes']} B in {warm['restore_s']}s; ready "
                f"{s3['ready_generate_s']}s")
            result["warm"] = warm
        rs = next((x for x in restores if x.get("state") == "available"), {})
        result["restored"] = {"ttft_s": d2.get("ttft_s"), "client_ttft_s": second["client_ttft_s"],
                              "path": d2.get("path"), "checkpoint": d2.get("checkpoint"),
                              "prompt_tokens": d2.get("prompt_tokens"),
                              "cached_tokens": d2.get("cached_tokens"),
                              "computed_tokens": d2.get("computed_tokens"),
                              "restore_events": restores,
                              "restore_bytes": rs.get("read_bytes"),
                              "restore_s": rs.get("seconds")}
        result["cold"] = {"ttft_s": dc.get("ttft_s"), "client_ttft_s": cold["client_ttft_s"],
                          "path": dc.get("path"), "prompt_tokens": dc.get("prompt_tokens"),
                          "computed_tokens": dc.get("computed_tokens"),
                          "prefill_s": dc.get("prefill_s")}
        result["server2"]["stop"] = stop2
        ttft_r, ttft_c = d2.get("ttft_s"), dc.get("ttft_s")
        result["summary"] = {
            "prompt_tokens": r1["usage"]["input_tokens"],
            "ttft_restored_s": ttft_r, "ttft_cold_reprefill_s": ttft_c,
            "ratio_reprefill_over_restore": (round(ttft_c / ttft_r, 2)
                                             if ttft_r and ttft_c else None),
            "restore_path": d2.get("path"),
            "decode_client_tokens_per_s": (decode or {}).get("client_tokens_per_s"),
            "decode_engine_tokens_per_s": (decode or {}).get("engine_decode_tokens_per_s"),
            "restore_bytes": rs.get("read_bytes"), "restore_s": rs.get("seconds"),
            "restart_to_ready_cold_s": s1["ready_generate_s"],
            "restart_to_ready_warm_s": (warm["server3"] if warm else s2)["ready_generate_s"],
            "restart_to_ready_cold_disk_s": s2["ready_generate_s"] if a.cold_disk else None,
            "disk": "cold (server 2), page cache (server 3)" if a.cold_disk else "page cache",
            "ttft_restored_warm_s": (warm or {}).get("ttft_s"),
            "restore_warm_s": (warm or {}).get("restore_s"),
            "ratio_reprefill_over_restore_warm": (
                round(ttft_c / warm["ttft_s"], 2) if warm and warm.get("ttft_s") and ttft_c
                else None),
            "health_ready_cold_s": s1["ready_health_s"],
            "health_ready_warm_s": s2["ready_health_s"],
            "compile_cold_s": (s1["startup_phases"] or {}).get("compile_s"),
            "compile_warm_s": (s2["startup_phases"] or {}).get("compile_s"),
            "load_warm_s": (s2["startup_phases"] or {}).get("load_s"),
            "artifact_write_s": art.get("seconds") if not art.get("reused") else None,
            "total_s": round(time.monotonic() - T_START, 1),
        }
        ok = d2.get("path") == "disk-restored"
        result["ok"] = ok
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        log(f"FAILED: {result['error']}")
        if srv is not None:
            result["server_log_tail"] = "".join(srv.log[-60:])
        ok = False
    finally:
        if srv is not None:
            stop_server(srv, 30)
    if "summary" in result:
        print_table(result["summary"])
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        log(f"wrote {a.out}")
    return 0 if ok else 1


def print_table(s: dict) -> None:
    rows = [
        ("prompt tokens", s["prompt_tokens"]),
        ("disk", s["disk"]),
        ("TTFT restored from disk (s)", s["ttft_restored_s"]),
        ("  restore path", s["restore_path"]),
        ("  restore bytes / s", f"{s['restore_bytes']} / {s['restore_s']}"),
        ("TTFT restored, page cache (s)", s["ttft_restored_warm_s"]),
        ("  restore s, page cache", s["restore_warm_s"]),
        ("TTFT cold re-prefill (s)", s["ttft_cold_reprefill_s"]),
        ("ratio re-prefill / restore", s["ratio_reprefill_over_restore"]),
        ("ratio re-prefill / restore, page cache", s["ratio_reprefill_over_restore_warm"]),
        ("restart-to-ready cold cache (s)", s["restart_to_ready_cold_s"]),
        ("  of which compile (s)", s["compile_cold_s"]),
        ("restart-to-ready warm cache, cold disk (s)", s["restart_to_ready_cold_disk_s"]),
        ("restart-to-ready warm cache, page cache (s)", s["restart_to_ready_warm_s"]),
        ("  of which compile / load (s)", f"{s['compile_warm_s']} / {s['load_warm_s']}"),
        ("artifact write (s)", s["artifact_write_s"]),
        ("whole run (s)", s["total_s"]),
    ]
    w = max(len(r[0]) for r in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
