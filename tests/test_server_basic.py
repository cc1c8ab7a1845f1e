"""The walking skeleton end to end: the real server on a loopback socket, the OpenAI SDK."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import httpx
import openai
import pytest

from tests.serverproc import REPO, start_server


@pytest.fixture(scope="module")
def server(shared_state_dir):
    srv = start_server(shared_state_dir)
    yield srv
    assert srv.stop() in (0, -15), "".join(srv.log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key=server.key, max_retries=0)


def test_key_file_is_private(server):
    mode = stat.S_IMODE((server.state_dir / "keys").stat().st_mode)
    assert mode == 0o600


def test_health_is_public_and_reveals_nothing(server):
    r = httpx.get(server.base_url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nk-wrong-key-000000000000"},
                                     {"Authorization": "Basic abc"}])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/responses"),
                                         ("GET", "/v1/nothing-here")])
def test_requests_without_a_valid_key_get_401(server, headers, method, path):
    r = httpx.request(method, server.base_url + path, headers=headers, json={})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert server.key not in r.text


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny"]


def test_non_streaming_response(client):
    r = client.responses.create(model="tiny", input="Write a haiku about GPUs.",
                                temperature=0, max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 5
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == r.output[0].content[0].text and r.output_text
    if r.status == "incomplete":
        assert r.usage.output_tokens == 24
        assert r.incomplete_details.reason == "max_output_tokens"


def test_streaming_matches_non_streaming_under_greedy(client):
    kwargs = dict(model="tiny", instructions="You are terse.",
                  input=[{"role": "user", "content": [{"type": "input_text",
                                                       "text": "List three prime numbers."}]}],
                  temperature=0, max_output_tokens=20)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id


def test_start_and_streamed_responses_leave_no_error_or_warning_in_the_log(server, client):
    """The server's log from its start through a streamed response of each API holds no
    error, warning or traceback (Sanic logs an ERROR when a route that streamed also returns
    its response, and a DeprecationWarning for a listener that takes the loop)."""
    import time

    events = list(client.responses.create(model="tiny", input="Count to three.", stream=True,
                                          temperature=0, max_output_tokens=8))
    assert events[-1].type in ("response.completed", "response.incomplete")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count to three."}], stream=True,
        temperature=0, max_tokens=8))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    time.sleep(0.5)  # the log reaches `server.log` through a reader thread
    bad = [line for line in server.log
           if any(w in line for w in ("ERROR", "Warning", "WARNING", "Traceback"))]
    assert not bad, bad


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=[], max_output_tokens=4)
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", temperature=7)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-4o", input="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert e.value.body["code"] == "unsupported_content"


def test_malformed_json_body(server):
    r = httpx.post(server.api_url + "/responses", content=b"{not json",
                   headers={"Authorization": f"Bearer {server.key}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def _serve_expect_refusal(tmp_path, *args) -> str:
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--state-dir",
                        str(tmp_path), *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ))
    assert r.returncode != 0
    return r.stderr


def test_refuses_non_loopback_host(tmp_path):
    err = _serve_expect_refusal(tmp_path, "--host", "0.0.0.0", "--port", "0")
    assert "only loopback" in err


def test_refuses_key_file_readable_by_others(tmp_path):
    kf = tmp_path / "keys"
    kf.write_text("default nk-0123456789abcdef0123\n")
    kf.chmod(0o644)
    err = _serve_expect_refusal(tmp_path, "--port", "0", "--key-file", str(kf))
    assert "chmod 600" in err


def test_second_session_reuses_the_shared_system_prefix(client):
    instructions = "You are a meticulous coding agent working in a large repository. " * 30
    first = client.responses.create(model="tiny", instructions=instructions, input="List files.",
                                    temperature=0, max_output_tokens=4)
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = client.responses.create(model="tiny", instructions=instructions,
                                     input="Open the README.", temperature=0,
                                     max_output_tokens=4)
    cached = second.usage.input_tokens_details.cached_tokens
    assert 300 < cached < second.usage.input_tokens


def test_metrics_and_request_log_without_text_or_keys(server, client):
    secret_prompt = "zebra-unicorn-canary prompt text"
    client.responses.create(model="tiny", input=secret_prompt, temperature=0,
                            max_output_tokens=3, prompt_cache_key="canary-session-key")
    assert httpx.get(server.base_url + "/metrics").status_code == 401
    r = httpx.get(server.base_url + "/metrics",
                  headers={"Authorization": f"Bearer {server.key}"})
    assert r.status_code == 200
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    done = sum(v for (n, lab), v in samples.items() if n == "ninfer_requests_total"
               and dict(lab).get("outcome") in ("completed", "incomplete"))
    assert done >= 1
    assert samples[("ninfer_kv_used_bytes", ())] >= 0
    assert samples[("ninfer_output_tokens_total", ())] >= 3
    log = (server.state_dir / "logs" / "requests.jsonl").read_text()
    events = [__import__("json").loads(line)["event"] for line in log.splitlines()]
    assert "server_start" in events and "request_done" in events and "request_rejected" in events
    for needle in (secret_prompt, "canary-session-key", server.key):
        assert needle not in log
