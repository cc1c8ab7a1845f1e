"""The server phases of `./ninfer qualify`, each with its pass rule fixed here. A phase returns
its measurements (a dict) when its rule holds and raises PhaseFailure, naming the rule and the
figure, when it does not; `NotApplicable` says why a phase does not apply to the lane.

    retrieval      a value planted at >= 90% depth of a prompt of >= max(8,192, a quarter of the
                   context) tokens (the full context on a GPU lane) is reproduced exactly
    decode         one greedy sequence's decode rate (C1); gated only on a GPU lane
    speculative    the drafts' acceptance when the lane's [speculative] is on
    restart        after the managed stop and a start, the session restored from its checkpoint
                   gives the same next 32 token ids (fewer where the model stops by itself)
                   as another principal computing the same two turns from a cold prefill (its
                   first turn from the root, no state)
    rollback       rollback to the previous instance and back again, each side restoring the
                   session from its checkpoint, every stored response intact
    protected      files 0600 and directories 0700 under the state and run directories, no
                   key in any log, the server listening on loopback only
    multisession   24 fresh sessions sharing a system turn: none falls back to a full prefill
"""
from __future__ import annotations

import os
import shutil
import socket
import stat
import statistics
from pathlib import Path

from lanes.qualify_lane import LaneUnderTest, PhaseFailure, fed

# A GPU lane's C1 decode floor in tokens/s: three quarters of what the README measured on it.
GPU_DECODE_FLOOR = {"h200": 97.0}
RETRIEVAL_MIN_TOKENS, RETRIEVAL_MIN_DEPTH = 8192, 0.90
RESTART_TOKENS, FRESH_SESSIONS = 32, 24
SECRET = "7294-QUILL-38"


class NotApplicable(Exception):
    pass


def _filler(i: int) -> str:
    nodes = ("parser", "index", "planner", "cache", "socket", "ledger", "kernel", "router")
    return (f"Log {i:05d}: the {nodes[i % 8]} on node {i * 37 % 211} finished batch "
            f"{i * 13 % 997} in {i * 7 % 89} ms.\n")


def retrieval_text(n: int) -> tuple[str, str]:
    """(the filler before the planted line, the whole prompt) for n filler lines: the vault code
    at ~95% depth (after the first n - max(2, n // 20) lines), the question at the end."""
    after = max(2, n // 20) if n else 0
    head = "".join(_filler(i) for i in range(n - after))
    planted = f"Note: the vault code is {SECRET}. Keep it.\n"
    question = "\nWhat is the vault code? Answer with the code only."
    return head, head + planted + "".join(_filler(i) for i in range(n - after, n)) + question


def retrieval(lane: LaneUnderTest, profile) -> dict:
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.qwen35()
    want = (profile.context_tokens - 512 if profile.gpu
            else max(RETRIEVAL_MIN_TOKENS, profile.context_tokens // 4))
    line_tokens = len(tok.encode(_filler(1000)))
    head, text = retrieval_text(want // line_tokens + 8)
    r = lane.respond({"input": text, "max_output_tokens": 24, "temperature": 0,
                      "prompt_cache_key": "qualify-retrieval"})
    total = r["usage"]["input_tokens"]
    depth = len(tok.encode(head)) / total  # template tokens before it only add depth
    answer = "".join(c.get("text", "") for item in r["output"] if item["type"] == "message"
                     for c in item["content"])
    rec = lane.done(r["id"])
    out = {"prompt_tokens": total, "planted_depth": round(depth, 4), "value": SECRET,
           "answer": answer[:80], "prefill_s": rec.get("prefill_s")}
    if total < want - 64 or depth < RETRIEVAL_MIN_DEPTH:
        raise PhaseFailure(f"the prompt did not meet the rule: {total} tokens (want >= "
                           f"{want}), planted at depth {depth:.3f} (want >= 0.90)")
    if SECRET not in answer:
        raise PhaseFailure(f"the planted value {SECRET!r} was not reproduced; the answer was "
                           f"{answer[:80]!r}", out)
    return out


def decode(lane: LaneUnderTest, profile) -> dict:
    r = lane.respond({"input": "Write a long story about a lighthouse keeper.",
                      "max_output_tokens": 128, "temperature": 0,
                      "prompt_cache_key": "qualify-decode"})
    rec = lane.done(r["id"])
    rate = rec.get("decode_tokens_per_s")
    out = {"output_tokens": rec["output_tokens"], "decode_tokens_per_s": rate,
           "ttft_s": rec.get("ttft_s"), "gated": profile.gpu}
    if profile.gpu:
        floor = GPU_DECODE_FLOOR.get(profile.name)
        out["floor_tokens_per_s"] = floor
        if floor is None:
            raise PhaseFailure(f"no C1 decode floor is fixed for GPU lane {profile.name}", out)
        if rate is None or rate < floor:
            raise PhaseFailure(f"C1 decode {rate} tokens/s is below the floor of {floor}", out)
    elif rate is None:
        raise PhaseFailure("the request decoded nothing to time", out)
    return out


def speculative(lane: LaneUnderTest, profile) -> dict:
    spec = profile.table("speculative") if profile.speculative else {}
    if spec.get("method", "off") == "off":
        raise NotApplicable("the lane's [speculative] method is off")
    code = "".join(f"def f{i}(x):\n    return x * {i} + {i}\n\n" for i in range(40))
    r = lane.respond({"input": "Repeat this code exactly:\n" + code, "max_output_tokens": 128,
                      "temperature": 0, "prompt_cache_key": "qualify-speculative"})
    s = lane.done(r["id"]).get("speculative") or {}
    drafted, accepted = sum(s.get("drafted", [])), sum(s.get("accepted", []))
    if not drafted:
        raise PhaseFailure("speculation is on but nothing was drafted", {"speculative": s})
    return {"method": spec["method"], "draft_tokens": spec.get("draft_tokens"),
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 4)}


PROMPT = "Review these entries:\n" + "".join(_filler(i) for i in range(60))


def _two_turns(lane: LaneUnderTest, principal: str, session: str, between=None):
    r1 = lane.respond({"input": PROMPT, "max_output_tokens": 8, "temperature": 0,
                       "prompt_cache_key": session}, principal)
    if between is not None:
        between(r1)
    r2 = lane.respond({"input": "Continue.", "previous_response_id": r1["id"],
                       "max_output_tokens": RESTART_TOKENS, "temperature": 0,
                       "prompt_cache_key": session}, principal)
    return r1, r2


def restart(lane: LaneUnderTest, profile) -> dict:
    import json

    times = {}

    def bounce(r1):
        times["stop_s"] = round(lane.stop(), 3)
        times["start_s"] = round(lane.start(), 3)

    r1, r2 = _two_turns(lane, "default", "qualify-restart", between=bounce)
    rec = lane.done(r2["id"])
    report = json.loads((lane.state / "stop_report.json").read_text())
    ref1, ref2 = _two_turns(lane, "qualify-reference", "qualify-restart")
    got, want = lane.output_ids(r2["id"]), lane.output_ids(ref2["id"])
    out = {**times, "path": rec["path"], "cached_tokens": rec["cached_tokens"],
           "expected_cached_tokens": fed(r1), "compared_tokens": len(want),
           "stop_report": {k: len(report.get(k, [])) for k in
                           ("saved", "already_saved", "nothing_to_save", "refused")},
           "restore_s": next((x.get("seconds") for x in reversed(lane.log("checkpoint_restore"))
                              if x.get("reason") == "restored"), None)}
    if rec["path"] != "disk-restored" or rec["cached_tokens"] != fed(r1):
        raise PhaseFailure(f"the session was not restored from its checkpoint: path "
                           f"{rec['path']}, {rec['cached_tokens']} cached tokens of {fed(r1)}",
                           out)
    out["reference_paths"] = [lane.done(ref1["id"])["path"], lane.done(ref2["id"])["path"]]
    if out["reference_paths"][0] != "root":
        raise PhaseFailure(f"the reference's first turn was not computed cold (path "
                           f"{out['reference_paths'][0]})", out)
    if lane.output_ids(r1["id"]) != lane.output_ids(ref1["id"]):
        raise PhaseFailure("the first turn differs between the two principals", out)
    # the cold computation's tokens up to RESTART_TOKENS, or fewer where the model ended its
    # answer by itself (a trained model stops): the restored session must give exactly those
    out["reference_stopped"] = len(want) < RESTART_TOKENS
    if not want or got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     min(len(got), len(want)))
        raise PhaseFailure(f"after the restart the next {len(got)} token ids differ from the "
                           f"cold computation's {len(want)} (first at {first})", out)
    return out


def product_copy(tree: Path, path: str, edit) -> Path:
    """A copy of this tree's product files in `tree`, with `path`'s text replaced by
    `edit(text)`."""
    from lanes.instance import PRODUCT_DIRS, REPO

    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
    for name in PRODUCT_DIRS:
        shutil.copytree(REPO / name, tree / name, ignore=skip)
    for p in [REPO / "ninfer", *REPO.glob("requirements*.lock")]:
        shutil.copy2(p, tree / p.name)
    (tree / path).write_text(edit((tree / path).read_text()))
    return tree


def pack_tree(tree: Path, out: Path) -> tuple[str, Path]:
    """`ninfer lane pack` run by the tree's own code: (instance id, its directory)."""
    import subprocess

    from lanes.qualify_lane import PY

    r = subprocess.run([PY, "-m", "server.cli", "lane", "pack", "--out", str(out)], cwd=tree,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise PhaseFailure(f"packing {tree.name} failed: {r.stderr[-400:]}")
    iid, path = r.stdout.split()
    return iid, Path(path)


def _variant(tmp: Path) -> Path:
    """This tree's product with one comment added: another instance of the same engine (its
    checkpoint fingerprint is this one's), packed under tmp/packs."""
    tree = product_copy(tmp / "variant", "lanes/__init__.py",
                        lambda t: t + "# the rollback partner of a qualification\n")
    return pack_tree(tree, tmp / "packs")[1]


def rollback(lane: LaneUnderTest, profile, tmp: Path) -> dict:
    first = lane.status()["current"]
    partner = _variant(tmp)
    session = "qualify-rollback"
    r = lane.respond({"input": PROMPT, "max_output_tokens": 4, "temperature": 0,
                      "prompt_cache_key": session})
    chain, steps = [r], []
    for what, args in (("install", ("install", "--from", partner)),
                       ("rollback", ("rollback",)), ("rollback", ("rollback",)),
                       ("rollback", ("rollback",))):
        lane.command(*args)
        st = lane.refresh()
        nxt = lane.respond({"input": f"Step {len(chain)}.", "previous_response_id": chain[-1]["id"],
                            "max_output_tokens": 4, "temperature": 0,
                            "prompt_cache_key": session})
        rec = lane.done(nxt["id"])
        steps.append({"command": what, "current": st["current"][:16], "path": rec["path"],
                      "cached_tokens": rec["cached_tokens"]})
        if rec["path"] != "disk-restored" or rec["cached_tokens"] != fed(chain[-1]):
            raise PhaseFailure(f"after `lane {what}` to {st['current'][:16]} the session was "
                               f"not restored (path {rec['path']})", {"steps": steps})
        chain.append(nxt)
    for resp in chain:
        code, got = lane.call("GET", f"/v1/responses/{resp['id']}")
        if code != 200 or got.get("output") != resp["output"]:
            raise PhaseFailure(f"response {resp['id']} is not intact after the rollbacks",
                               {"steps": steps})
    if lane.status()["current"] != first:
        raise PhaseFailure("the qualified instance is not current after the rollbacks")
    return {"steps": steps, "responses_intact": len(chain)}


def _listening(pid: int) -> list[str]:
    """The addresses `pid` listens on (TCP, from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, port = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            out.append(f"{addr}:{int(port, 16)}")
    return out


def protected(lane: LaneUnderTest, profile) -> dict:
    import ipaddress

    problems, checked = [], 0
    for top in (lane.state,):
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    continue
                checked += 1
                mode = stat.S_IMODE(st.st_mode)
                if mode & 0o077:
                    problems.append(f"{p.relative_to(lane.root)} is {mode:04o}")
    keys = [line.split()[1] for line in (lane.state / "keys").read_text().splitlines()
            if len(line.split()) >= 2]
    logs = [p for p in (lane.root / "run").rglob("*") if p.is_file()]
    logs += [p for p in (lane.state / "logs").rglob("*") if p.is_file()]
    for p in logs:
        data = p.read_bytes()
        if any(k.encode() in data for k in keys):
            problems.append(f"{p.relative_to(lane.root)} holds a bearer key")
    addrs = _listening(lane.server_pid())
    for a in addrs:
        host = a.rsplit(":", 1)[0]
        if not ipaddress.ip_address(host).is_loopback:
            problems.append(f"the server listens on {a}")
    out = {"paths_checked": checked, "logs_scanned": len(logs), "listening": addrs}
    if not addrs:
        problems.append("the server listens on nothing that /proc shows")
    if problems:
        raise PhaseFailure("; ".join(problems[:8]), out)
    return out


SYSTEM = ("You are the reviewer of a build farm. " + "".join(_filler(i) for i in range(30)))


def multisession(lane: LaneUnderTest, profile) -> dict:
    warm = lane.respond({"instructions": SYSTEM, "input": "Ready?", "max_output_tokens": 2,
                         "temperature": 0, "prompt_cache_key": "qualify-warm"})
    paths, ttfts = [], []
    for i in range(FRESH_SESSIONS):
        r = lane.respond({"instructions": SYSTEM, "input": f"Which batch of node {i} was slow?",
                          "max_output_tokens": 2, "temperature": 0,
                          "prompt_cache_key": f"qualify-fresh-{i}"})
        rec = lane.done(r["id"])
        paths.append(rec["path"])
        ttfts.append(rec["ttft_s"])
    roots = sum(p == "root" for p in paths)
    out = {"sessions": FRESH_SESSIONS, "root_fallbacks": roots,
           "paths": dict(sorted((p, paths.count(p)) for p in set(paths))),
           "median_ttft_s": round(statistics.median(ttfts), 4),
           "warm_path": lane.done(warm["id"])["path"]}
    if roots:
        raise PhaseFailure(f"{roots} of {FRESH_SESSIONS} fresh sessions fell back to a full "
                           f"prefill", out)
    return out
