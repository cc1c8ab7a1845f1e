"""The real Oh My Pi client (pinned in tests/omp) against the real server, over real sockets.

A recording proxy sits between OMP and the server so that each test can check what OMP sent, not
only that it finished; it passes everything through unchanged. The server runs the cpu lane's own
model, the trained `tiny-chat`, whose replies end on their own (`response.completed`, which OMP
reports as stopReason "stop"), so OMP's stateful path runs as it would against any model.
"""
from __future__ import annotations

import json
import re

import pytest

from lanes.profile import load_profile
from lanes.qualify_omp import TOOL_FILE
from tests.omp_client import (OMP_VERSION, OmpClient, Provider, last_assistant,
                              omp_install)  # noqa: F401  (omp_install: a fixture)
from tests.recording_http import RecordingServer, closed_port
from tests.serverproc import start_server

pytestmark = pytest.mark.usefixtures("omp_install")

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
# OMP 18.2.3's built-in tools, in the order it sends them.
OMP_TOOLS = ["read", "bash", "edit", "eval", "glob", "grep", "task", "hub", "todo", "web_search",
             "write"]
# A short system prompt keeps the CPU prefill to a few hundred tokens; the default one is
# ~18 KB (test_default_system_prompt_turn, slow tier).
SHORT_SYSTEM = ("--system-prompt", "You are a terse coding agent.")
# The session tests count OMP's requests: without tools, a reply of the trained model can never
# become a tool call that OMP would answer with one more request.
NO_TOOLS = ("--no-tools",)
MODEL = "tiny-chat"  # the cpu lane's model
# How OMP reports the server's terminal event.
STOP_REASON = {"response.incomplete": "length", "response.completed": "stop"}


@pytest.fixture(scope="module")
def server(shared_state_dir):
    srv = start_server(shared_state_dir, model=None)  # the lane's own model: tiny-chat
    yield srv
    assert srv.stop() in (0, -15), "".join(srv.log)


@pytest.fixture
def proxy(server):
    p = RecordingServer(upstream=server.base_url)
    yield p
    p.stop()


@pytest.fixture
def make_client(tmp_path):
    made: list[OmpClient] = []

    def make(providers, **kw) -> OmpClient:
        made.append(OmpClient(tmp_path / f"omp{len(made)}", providers, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def assert_nothing_left_loopback(client: OmpClient) -> None:
    """OMP may ask its HTTPS proxy for tunnels (it looks up remote model catalogs at startup),
    but the proxy refuses them: no request with content ever left the machine."""
    assert all(r.method == "CONNECT" for r in client.egress.requests), client.egress.requests


def assert_responses_request(req, key: str, *, instructions: str | None = None) -> dict:
    assert (req.method, req.path) == ("POST", "/v1/responses")
    assert req.headers["Authorization"] == f"Bearer {key}"
    assert req.headers["User-Agent"] == f"omp/{OMP_VERSION}"
    body = req.json()
    assert set(body) == {"model", "input", "instructions", "stream", "prompt_cache_key", "store",
                         "max_output_tokens", "tools"}, sorted(body)
    assert body["model"] == MODEL and body["stream"] is True and body["store"] is False
    assert body["max_output_tokens"] == 16
    assert UUID.match(body["prompt_cache_key"])
    if instructions is not None:
        assert body["instructions"].startswith(instructions)
    assert [t["name"] for t in body["tools"]] == OMP_TOOLS
    assert all(t["type"] == "function" and t["parameters"]["type"] == "object"
               for t in body["tools"])
    return body


def user_texts(item: dict) -> list[str]:
    assert item["role"] == "user"
    assert all(part["type"] == "input_text" for part in item["content"])
    return [part["text"] for part in item["content"]]


def test_print_mode_turn_reaches_the_server(server, proxy, make_client):
    omp = make_client([Provider("ninfer", proxy.api_url, server.key, model=MODEL)])
    result = omp.run_print("Say hello.", *SHORT_SYSTEM, "--mode", "json")
    assert result.returncode == 0, result.describe()

    assert len(proxy.requests) == 1, [(r.method, r.path) for r in proxy.requests]
    req = proxy.requests[0]
    body = assert_responses_request(req, server.key, instructions=SHORT_SYSTEM[1])
    (item,) = body["input"]
    assert user_texts(item)[-1] == "Say hello."  # after OMP's <system-reminder> (date, cwd)

    frames = result.frames()
    assert frames[0]["type"] == "session" and body["prompt_cache_key"] == frames[0]["id"]
    events = req.events()
    assert req.status == 200 and events[0]["type"] == "response.created"
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    reply = last_assistant(frames)
    assert reply["stopReason"] == STOP_REASON[events[-1]["type"]]
    assert [c["text"] for c in reply["content"]] == [streamed]
    assert reply["usage"]["output"] == events[-1]["response"]["usage"]["output_tokens"]
    assert_nothing_left_loopback(omp)


def test_rpc_mode_runs_two_turns_in_one_process(server, proxy, make_client):
    omp = make_client([Provider("ninfer", proxy.api_url, server.key, model=MODEL)])
    with omp.rpc(*SHORT_SYSTEM) as rpc:
        rpc.wait_for("ready", timeout=30)
        first = rpc.prompt("Say hello.")
        second = rpc.prompt("Now say goodbye.")
    assert rpc.proc.returncode == 0, "".join(rpc.stderr)
    for frames in (first, second):
        assert last_assistant(frames)["stopReason"] in STOP_REASON.values()

    assert len(proxy.requests) == 2
    one, two = (assert_responses_request(r, server.key) for r in proxy.requests)
    assert one["prompt_cache_key"] == two["prompt_cache_key"]
    # Stateless (no PI_OPENAI_STATEFUL): the whole transcript again. OMP keeps a reply that
    # completed and drops one that ended incomplete.
    assert "previous_response_id" not in two
    assert two["input"][0] == one["input"][0]
    kept = [i for i in two["input"] if i.get("role") == "assistant"]
    assert len(kept) == (last_assistant(first)["stopReason"] == "stop"), two["input"]
    assert user_texts(two["input"][-1]) == ["Now say goodbye."]
    assert_nothing_left_loopback(omp)


def test_stateful_omp_second_turn_continues_the_stored_chain(server, make_client):
    """With PI_OPENAI_STATEFUL=1 and a completed first turn, OMP's second turn names the first
    response and sends only the new message, which the server serves from the stored state."""
    proxy = RecordingServer(upstream=server.base_url)
    try:
        omp = make_client([Provider("ninfer", proxy.api_url, server.key, model=MODEL,
                                    max_tokens=64)], stateful=True)
        with omp.rpc(*SHORT_SYSTEM, *NO_TOOLS) as rpc:
            rpc.wait_for("ready", timeout=30)
            first = rpc.prompt("Say hello.")
            second = rpc.prompt("Now say goodbye.")
    finally:
        proxy.stop()
    assert last_assistant(first)["stopReason"] == "stop"
    assert last_assistant(second)["stopReason"] == "stop", last_assistant(second)

    one, chained, *rest = proxy.requests
    first_body = one.json()
    first_id = one.events()[0]["response"]["id"]
    assert first_body["store"] is True and "previous_response_id" not in first_body
    body = chained.json()
    assert body["previous_response_id"] == first_id and body["store"] is True
    assert [user_texts(i) for i in body["input"]] == [["Now say goodbye."]]
    assert body["instructions"] == first_body["instructions"]  # re-sent every turn
    assert body["prompt_cache_key"] == first_body["prompt_cache_key"]
    # The server keeps the chain: OMP's second request continues it, and the engine computes
    # only the new turn (the first turn's prompt and output come from the stored state).
    assert chained.status == 200 and rest == [], chained.answer[:300]
    first_usage = one.events()[-1]["response"]["usage"]
    usage = chained.events()[-1]["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= \
        first_usage["input_tokens"] + first_usage["output_tokens"] - 1


def test_a_new_omp_process_resumes_the_session_from_the_cache(server, make_client):
    """`omp --continue` in a new process resends the whole transcript (without
    previous_response_id); the server matches the echoed items to its stored chain and serves
    the resumed turn from the cached state."""
    proxy = RecordingServer(upstream=server.base_url)
    try:
        omp = make_client([Provider("ninfer", proxy.api_url, server.key, model=MODEL,
                                    max_tokens=64)], stateful=True)
        with omp.rpc(*SHORT_SYSTEM, *NO_TOOLS) as rpc:
            rpc.wait_for("ready", timeout=30)
            rpc.prompt("Say hello.")
            rpc.prompt("Now say goodbye.")
        with omp.rpc(*SHORT_SYSTEM, *NO_TOOLS, "--continue") as rpc:
            rpc.wait_for("ready", timeout=30)
            resumed = rpc.prompt("One more thing.")
    finally:
        proxy.stop()
    assert last_assistant(resumed)["stopReason"] == "stop", last_assistant(resumed)
    one, two, three = proxy.requests
    body = three.json()
    assert "previous_response_id" not in body
    assert body["prompt_cache_key"] == one.json()["prompt_cache_key"]
    roles = [(i.get("type", "message"), i.get("role")) for i in body["input"]]
    assert roles == [("message", "user"), ("message", "assistant")] * 2 + [("message", "user")]
    assert user_texts(body["input"][-1])[-1].endswith("One more thing.")
    before = two.events()[-1]["response"]["usage"]
    usage = three.events()[-1]["response"]["usage"]
    cached = usage["input_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * before["input_tokens"], (cached, before)
    assert cached >= before["input_tokens"] + before["output_tokens"] - 1
    rid = three.events()[0]["response"]["id"]
    log = [json.loads(x) for x in (server.state_dir / "logs" / "requests.jsonl").read_text()
           .splitlines()]
    done = [e for e in log if e["event"] == "request_done" and e.get("request_id") == rid]
    assert done and done[0]["path"] in ("continuation", "fork"), done
    assert done[0]["cached_tokens"] == cached


def test_omp_runs_a_tool_the_model_called_and_chains_its_output(server, make_client,
                                                                 tmp_path):
    """The model calls OMP's own `read` tool; OMP runs it and sends the function_call_output
    chained by previous_response_id, and the turn completes on its own. Nothing is rewritten
    or forced: OMP offers the cpu lane's agent_tools (read and bash), the prompt tiny-chat
    was trained in, and sends no temperature, so tiny-chat samples with its artifact's
    default (greedy; at temperature 1 its copy of the path went wrong in about half the
    turns); OMP's tool reads the file for real, and the turn after it ends with the model's
    own stop."""
    tools = load_profile("cpu").agent_tools
    proxy = RecordingServer(upstream=server.base_url)
    try:
        omp = make_client([Provider("ninfer", proxy.api_url, server.key, model=MODEL,
                                    max_tokens=64)], stateful=True)
        (omp.workdir / TOOL_FILE).write_text("The night train leaves at 23:10.\n")
        with omp.rpc(*SHORT_SYSTEM, "--tools", ",".join(tools)) as rpc:
            rpc.wait_for("ready", timeout=30)
            frames = rpc.prompt(f"Read the file {TOOL_FILE} and tell me when the train leaves.")
    finally:
        proxy.stop()
    first, second, *rest = proxy.requests
    out = [e["item"] for e in first.events() if e["type"] == "response.output_item.done"]
    calls = [i for i in out if i["type"] == "function_call"]
    assert calls and calls[0]["name"] == "read", out
    assert json.loads(calls[0]["arguments"])["path"] == TOOL_FILE, calls
    assert "tool_choice" not in first.json() and "temperature" not in first.json()
    body = second.json()
    assert body["previous_response_id"] == first.events()[0]["response"]["id"]
    outputs = [i for i in body["input"] if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [calls[0]["call_id"]]
    assert second.status == 200
    usage = second.events()[-1]["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0
    tool_results = [f for f in frames if f.get("type") == "tool_execution_end"]
    assert tool_results and tool_results[0]["toolName"] == "read", \
        [f.get("type") for f in frames]
    assert last_assistant(frames)["stopReason"] == "stop"
    assert rest == [] or all(r.json().get("previous_response_id") for r in rest)


@pytest.mark.parametrize("down", [
    "port closed",
    "answers 503",
])
def test_fail_closed_when_the_server_is_down(down, make_client):
    """Retry and model fallback off: a dead server fails the turn and nothing goes to another
    provider, even one named as the fallback."""
    primary = None if down == "port closed" else RecordingServer(status=503, retry_after=0)
    decoy = RecordingServer()
    try:
        url = f"http://127.0.0.1:{closed_port()}/v1" if primary is None else primary.api_url
        omp = make_client([Provider("ninfer", url, "nk-unused"),
                           Provider("decoy", decoy.api_url, "decoy-key")],
                          fallback_chain=["decoy/tiny"])
        result = omp.run_print("Say hello.", *SHORT_SYSTEM, "--mode", "json")
    finally:
        decoy.stop()
        if primary is not None:
            primary.stop()
    assert result.returncode not in (0, None), result.describe()
    reply = last_assistant(result.frames())
    assert reply["stopReason"] == "error" and reply["provider"] == "ninfer"
    assert ("ECONNREFUSED" if primary is None else "503") in reply["errorMessage"]
    assert decoy.requests == []
    if primary is not None:  # OMP's transport retries 5xx itself, whatever retry.enabled says
        assert [r.path for r in primary.requests] == ["/v1/responses"] * 6
    assert_nothing_left_loopback(omp)


@pytest.mark.parametrize("down", [
    pytest.param("port closed", marks=pytest.mark.slow),  # 2 x 15 s of OMP's own backoff
    "answers 503",
])
def test_fallback_enabled_does_reach_the_decoy(down, make_client):
    """The control for the test above: with OMP's default retry and fallback on, the same setup
    sends the prompt to the decoy, so an empty decoy record above means something."""
    primary = None if down == "port closed" else RecordingServer(status=503, retry_after=0)
    decoy = RecordingServer(retry_after=0)
    try:
        url = f"http://127.0.0.1:{closed_port()}/v1" if primary is None else primary.api_url
        omp = make_client([Provider("ninfer", url, "nk-unused"),
                           Provider("decoy", decoy.api_url, "decoy-key")],
                          fallback_chain=["decoy/tiny"],
                          retry={"enabled": True, "modelFallback": True, "maxRetries": 1})
        result = omp.run_print("Say hello.", *SHORT_SYSTEM, "--mode", "json", timeout=120)
    finally:
        decoy.stop()
        if primary is not None:
            primary.stop()
    assert result.returncode not in (0, None), result.describe()
    assert decoy.requests, result.describe()
    body = decoy.requests[0].json()
    assert body["model"] == "tiny" and user_texts(body["input"][0])[-1] == "Say hello."


@pytest.mark.slow
def test_default_system_prompt_turn(server, proxy, make_client):
    """OMP as shipped: its own ~18 KB system prompt (about 4.6K tokens of CPU prefill)."""
    omp = make_client([Provider("ninfer", proxy.api_url, server.key, model=MODEL)])
    result = omp.run_print("Say hello.", "--mode", "json", timeout=600)
    assert result.returncode == 0, result.describe()
    (req,) = proxy.requests
    body = assert_responses_request(req, server.key)
    assert len(body["instructions"]) > 10_000
    # tiny-chat ends its reply itself, under OMP's whole prompt too
    assert last_assistant(result.frames())["stopReason"] == "stop"


@pytest.mark.slow
def test_newest_installable_omp_version(server, proxy, make_client, tmp_path):
    """The newest OMP release above the pin that installs unmodified talks to the server as the
    pinned one does; each newer release that does not install is recorded with npm's reason
    (tests/omp_versions.py; the last survey is docs/benchmarks/omp_versions.json)."""
    from dataclasses import asdict

    from tests import omp_versions

    record = omp_versions.survey(tmp_path / "npm")
    print(json.dumps(record, indent=1))
    # The control: the method resolves the pinned version, so a newer one's failure is its own.
    assert record["control"]["ok"], record
    assert all(a["ok"] or a["reason"] for a in record["tried"]), record
    newest = record["newest_resolving"]
    if newest is None:  # every newer release fails to resolve: the pin is the newest that installs
        assert all(not a["ok"] for a in record["tried"]), record
        return
    attempt, modules = omp_versions.install(newest, tmp_path / "install")
    assert attempt.ok, asdict(attempt)
    omp = make_client([Provider("ninfer", proxy.api_url, server.key, model=MODEL)],
                      modules=modules)
    result = omp.run_print("Say hello.", *SHORT_SYSTEM, "--mode", "json")
    assert result.returncode == 0, result.describe()
    (req,) = proxy.requests
    assert (req.method, req.path, req.status) == ("POST", "/v1/responses", 200)
    assert req.headers["User-Agent"] == f"omp/{newest}"
    body = req.json()
    assert body["model"] == MODEL and body["stream"] is True
    assert user_texts(body["input"][-1])[-1] == "Say hello."
    events = req.events()
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    reply = last_assistant(result.frames())
    assert reply["stopReason"] == STOP_REASON[events[-1]["type"]] == "stop"
    assert [c["text"] for c in reply["content"]] == [streamed]
    assert_nothing_left_loopback(omp)
