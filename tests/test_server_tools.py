"""Tool calls, tool_choice and JSON outputs through the real server and the OpenAI SDK, on the
tool-happy test model (`embedded:tiny-tools`, which starts tool calls by itself)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serverproc import start_server
from tests.test_constrain_engine import POINT, TINY_TOOLS_SHA256, TOOLS

REPO_PROFILE = "lanes/profiles/cpu.toml"
N = 6  # turns per property


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_models_dir):
    from pathlib import Path

    d = tmp_path_factory.mktemp("tools")
    (d / "models").symlink_to(embedded_models_dir)
    text = (Path(__file__).resolve().parent.parent / REPO_PROFILE).read_text()
    import re
    text = re.sub(r'model = "embedded:[a-z-]+"', 'model = "embedded:tiny-tools"', text)
    text = text.replace('name = "cpu"', 'name = "cpu-tools-test"')
    text = re.sub(r'model_sha256 = "[0-9a-f]+"', f'model_sha256 = "{TINY_TOOLS_SHA256}"', text)
    profile = d / "cpu-tools.toml"
    profile.write_text(text)
    srv = start_server(d, "--lane", str(profile), model=None)  # the profile's tiny-tools
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key=server.key, max_retries=0)


def ask(client, i, **kw):
    kw.setdefault("max_output_tokens", 48)
    return client.responses.create(
        model="tiny-tools", instructions="You are a coding agent.", tools=TOOLS,
        input=f"Task {i}: look at file number {i} and report.", temperature=1, extra_body={"seed": 1000 + i},
        prompt_cache_key=f"tools-{i}", **kw)


def started_a_call(r) -> bool:
    return any(o.type == "function_call" for o in r.output) or "<tool_call>" in r.output_text


def test_unconstrained_the_model_starts_calls_and_none_prevents_them(client):
    auto = [ask(client, i) for i in range(N)]
    assert sum(map(started_a_call, auto)) > N // 2, [r.output_text[:80] for r in auto]
    none = [ask(client, i, tool_choice="none") for i in range(N)]
    assert not any(map(started_a_call, none)), [r.output_text[:80] for r in none]
    assert all(r.tool_choice == "none" for r in none)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "grep"}])
def test_required_and_named_calls_validate(client, choice):
    for i in range(N):
        r = ask(client, i, tool_choice=choice, max_output_tokens=64)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and calls, (r.status, r.output)
        for call in calls:
            if isinstance(choice, dict):
                assert call.name == choice["name"]
            schema = next(t["parameters"] for t in TOOLS if t["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), schema)
            assert call.call_id.startswith("call_") and call.status == "completed"


def test_parallel_tool_calls_false_allows_one_call(client):
    for i in range(3):
        r = ask(client, i, tool_choice="required", parallel_tool_calls=False,
                max_output_tokens=64)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1, r.output
        assert r.parallel_tool_calls is False
        assert client.responses.retrieve(r.id).parallel_tool_calls is False


def test_json_schema_outputs_complete_and_validate(client):
    for i in range(N):
        for strict in (True, False):
            r = client.responses.create(
                model="tiny-tools", input=f"Point {i} as JSON.", temperature=1, extra_body={"seed": i},
                max_output_tokens=40, text={"format": {"type": "json_schema", "name": "point",
                                                       "schema": POINT, "strict": strict}})
            assert r.status == "completed", r.output_text
            jsonschema.validate(json.loads(r.output_text), POINT)
    bad = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        bad.responses.create(model="tiny-tools", input="x", tools=TOOLS,
                             tool_choice={"type": "function", "name": "nope"})
    assert e.value.body["param"] == "tool_choice.name"


def test_sdk_round_trips_a_call_and_its_output(client):
    stream = client.responses.create(
        model="tiny-tools", instructions="You are a coding agent.", tools=TOOLS,
        input="Read README.md.", tool_choice={"type": "function", "name": "read"},
        temperature=0, max_output_tokens=96, prompt_cache_key="round-trip", stream=True)
    events = list(stream)
    first = events[-1].response
    (call,) = [o for o in first.output if o.type == "function_call"][:1]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == call.arguments and done[0].arguments == call.arguments
    assert done[0].name == "read"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    second = client.responses.create(
        model="tiny-tools", instructions="You are a coding agent.", tools=TOOLS,
        previous_response_id=first.id, prompt_cache_key="round-trip", temperature=0,
        tool_choice="none", max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "# ninfer\nA local inference appliance."}])
    assert second.status in ("completed", "incomplete")
    assert not any(o.type == "function_call" for o in second.output)
    used = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= used - 1
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]
