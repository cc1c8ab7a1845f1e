"""Sending fuzz cases (tests/fuzz_api.py) to a real server and holding each answer to the
properties: no 5xx, errors in the OpenAI format, streams that end with their terminal event, and
a live server after each batch. `Fuzzer.summary()` gives the counts a results file records."""
from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time
import urllib.parse
from collections import Counter

import httpx
import jsonschema

from tests.fuzz_api import ERROR_SCHEMA, PREV, Case

_TERMINAL = {"response.completed", "response.incomplete"}
_VALIDATOR = jsonschema.Draft202012Validator(ERROR_SCHEMA)


def _substitute(case: Case, stored: list[str], sessions: dict, rng: random.Random) -> Case:
    """Put an id this run stored where the case says PREV (or drop the field when none is);
    a request continuing it names the parent's session, as a client's would."""
    if PREV not in case.path and (case.body is None or PREV.encode() not in case.body):
        return case
    rid = rng.choice(stored) if stored else None
    path = case.path.replace(PREV, rid or "resp_unknown")
    body = case.body
    if body is not None and PREV.encode() in body:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser
            value = None
        if isinstance(value, dict) and value.get("previous_response_id") == PREV:
            if rid is None:
                value.pop("previous_response_id")
            else:
                value["previous_response_id"] = rid
                value["prompt_cache_key"] = sessions.get(rid)
                if value["prompt_cache_key"] is None:
                    value.pop("prompt_cache_key")
            body = json.dumps(value).encode()
        else:
            body = body.replace(PREV.encode(), (rid or "resp_unknown").encode())
    return Case(case.klass, case.method, path, body, case.ctype, case.auth, case.detail)


def problems(case: Case, status: int, ctype: str, text: str) -> list[str]:
    """What is wrong with this answer to `case` (empty: nothing)."""
    out = []
    if status >= 500:
        out.append(f"{status} from the server")
    if status >= 400:
        try:
            _VALIDATOR.validate(json.loads(text))
        except (ValueError, jsonschema.ValidationError) as e:
            out.append(f"{status} not in the OpenAI error format: {str(e)[:200]}")
    elif "text/event-stream" in ctype:
        if case.path.endswith("/chat/completions"):
            if not text.rstrip().endswith("data: [DONE]"):
                out.append("chat stream without data: [DONE]")
        else:
            events = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: ")]
            if not events or events[-1].get("type") not in _TERMINAL:
                out.append(f"stream ended with {events[-1].get('type') if events else None}")
    return out


class Fuzzer:
    """Sends cases to the server at `base_url` with key `key`, `workers` at a time."""

    def __init__(self, base_url: str, key: str, workers: int = 4, seed: int = 0):
        self.base_url, self.key, self.workers = base_url, key, workers
        self.client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=workers))
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.stored: list[str] = []         # ids of responses the server acknowledged storing
        self.sessions: dict[str, str | None] = {}  # id -> its prompt_cache_key
        self.cases = Counter()              # class -> cases run
        self.details = Counter()            # class/detail -> cases run
        self.statuses = Counter()           # class -> {status: n}, flattened "class status"
        self.valid_2xx = 0                  # valid cases answered 2xx and complete
        self.ok_2xx = 0                     # any case answered 2xx and complete
        self.failures: list[dict] = []
        self.valid_refused = Counter()      # "status code param" of valid cases refused
        self.refused_sample: list[str] = []
        self.batches = 0
        self.seconds = 0.0

    def send(self, case: Case) -> None:
        with self.lock:
            case = _substitute(case, self.stored, self.sessions, self.rng)
        headers = {"Content-Type": case.ctype} if case.ctype else {}
        if case.auth:
            headers["Authorization"] = f"Bearer {self.key}"
        try:
            r = self.client.request(case.method, self.base_url + case.path,
                                    content=case.body, headers=headers)
            status, ctype, text = r.status_code, r.headers.get("content-type", ""), r.text
        except httpx.HTTPError as e:  # a dropped connection is a failure too
            status, ctype, text = 599, "", f"{type(e).__name__}: {e}"
        try:
            bad = problems(case, status, ctype, text)
        except Exception as e:  # noqa: BLE001  (the checker's own failure is one too)
            bad = [f"the checker raised {type(e).__name__}: {e}"]
        with self.lock:
            self.cases[case.klass] += 1
            self.details[f"{case.klass}/{case.detail}"] += 1
            self.statuses[f"{case.klass} {status}"] += 1
            if bad:
                self.failures.append({"case": case.klass, "detail": case.detail,
                                      "method": case.method, "path": case.path[:200],
                                      "body": (case.body or b"")[:400].decode("utf-8",
                                                                              "replace"),
                                      "status": status, "problems": bad,
                                      "answer": text[:400]})
                return
            if case.klass == "valid" and status >= 400:
                try:
                    err = json.loads(text)["error"]
                    self.valid_refused[f"{status} {err['code']} {err['param']}"] += 1
                    self.refused_sample.append(err["message"][:200])
                except (ValueError, KeyError, TypeError):
                    self.valid_refused[str(status)] += 1
            if case.method == "DELETE" and status == 200:  # a response, or a session, purged
                gone = urllib.parse.unquote(case.path.rsplit("/", 1)[1])
                self.stored = [i for i in self.stored if i != gone
                               and self.sessions.get(i) != gone]
            if 200 <= status < 300:
                self.ok_2xx += 1
                self.valid_2xx += case.klass == "valid"
                self._remember(case, ctype, text)

    def _remember(self, case: Case, ctype: str, text: str) -> None:
        if case.method != "POST" or case.path != "/v1/responses":
            return
        try:
            body = json.loads(case.body)
            if "text/event-stream" in ctype:
                last = [json.loads(line[6:]) for line in text.splitlines()
                        if line.startswith("data: ")][-1]
                resp = last["response"]
            else:
                resp = json.loads(text)
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            return
        if body.get("store", True) and resp.get("store") is not False:
            self.stored.append(resp["id"])
            self.sessions[resp["id"]] = resp.get("prompt_cache_key")

    def batch(self, cases: list[Case]) -> None:
        """Send `cases` concurrently, then check the server still answers `/health`."""
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            list(pool.map(self.send, cases))
        self.seconds += time.monotonic() - t0
        self.batches += 1
        r = self.client.get(self.base_url + "/health")
        assert r.status_code == 200, f"the server is not live after batch {self.batches}: " \
                                     f"{r.status_code} {r.text}"

    def summary(self) -> dict:
        total = sum(self.cases.values())
        return {"cases": total, "batches": self.batches, "classes": dict(self.cases),
                "details": dict(sorted(self.details.items())),
                "statuses": dict(sorted(self.statuses.items())),
                "valid_2xx": self.valid_2xx, "all_2xx": self.ok_2xx,
                "valid_2xx_fraction": round(self.valid_2xx / max(total, 1), 4),
                "fivexx": sum(n for k, n in self.statuses.items()
                              if int(k.rsplit(" ", 1)[1]) >= 500),
                "valid_refused": dict(self.valid_refused.most_common()),
                "failures": len(self.failures), "stored_responses": len(self.stored),
                "seconds": round(self.seconds, 1)}

    def close(self) -> None:
        self.client.close()
