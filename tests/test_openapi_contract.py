"""docs/openapi.yaml against the real server: the document describes exactly the served routes,
and real answers (JSON bodies, SSE events, errors) validate against its schemas."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from tests.serverproc import start_server

DOC = yaml.safe_load((Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml")
                     .read_text())
METHODS = {"get", "post", "delete", "put", "patch"}


def schema_for(path: str, method: str, status: int, ctype: str = "application/json") -> dict:
    resp = DOC["paths"][path][method]["responses"][str(status)]
    if "$ref" in resp:
        resp = DOC["components"]["responses"][resp["$ref"].rsplit("/", 1)[1]]
    return {**resp["content"][ctype]["schema"], "components": DOC["components"]}


def validate(instance, path: str, method: str, status: int, ctype="application/json"):
    schema = schema_for(path, method, status, ctype)
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)


def request_schema(path: str) -> dict:
    body = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return {**body, "components": DOC["components"]}


def test_the_document_is_valid_json_schema():
    for name, schema in DOC["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
    assert DOC["openapi"].startswith("3.1")


def test_every_served_route_is_documented_and_nothing_else():
    from server.app import create_app
    from server.auth import KeyRing
    from server.runtime import Runtime

    app = create_app(Runtime(keys=KeyRing(()), max_output_tokens=1, context_tokens=2),
                     name="openapi_contract")
    served = set()
    for route in app.router.routes:
        path = "/" + re.sub(r"<([a-z_]+)(:[a-z]+)?>", r"{\1}", route.path.strip("/"))
        for method in route.methods:
            if method.lower() in METHODS:
                served.add((method.lower(), path))
    documented = {(m, p) for p, ops in DOC["paths"].items() for m in ops if m in METHODS}
    assert served == documented


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("openapi")
    (d / "models").symlink_to(embedded_models_dir)
    srv = start_server(d)
    yield srv
    srv.stop()


def test_real_answers_validate(server):
    auth = {"Authorization": f"Bearer {server.key}"}
    c = httpx.Client(base_url=server.base_url, headers=auth, timeout=120)
    r = httpx.get(server.base_url + "/health")
    validate(r.json(), "/health", "get", r.status_code)
    validate(httpx.get(server.base_url + "/v1/models").json(), "/v1/models", "get", 401)
    validate(c.get("/v1/models").json(), "/v1/models", "get", 200)
    validate(c.get("/v1/ninfer/status").json(), "/v1/ninfer/status", "get", 200)
    assert c.get("/metrics").status_code == 200

    body = {"model": "tiny", "input": [{"role": "user", "content": "Hi"}],
            "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0,
            "prompt_cache_key": "contract", "tools": [
                {"type": "function", "name": "read", "parameters": {"type": "object"}}],
            "reasoning": {"effort": "low", "summary": "auto"}}
    jsonschema.validate(body, request_schema("/v1/responses"))
    r = c.post("/v1/responses", json=body)
    validate(r.json(), "/v1/responses", "post", 200)
    rid = r.json()["id"]
    validate(c.post("/v1/responses/input_tokens", json=body).json(),
             "/v1/responses/input_tokens", "post", 200)
    validate(c.get(f"/v1/responses/{rid}").json(), "/v1/responses/{response_id}", "get", 200)
    validate(c.get(f"/v1/responses/{rid}/input_items", params={"limit": 1}).json(),
             "/v1/responses/{response_id}/input_items", "get", 200)
    validate(c.post(f"/v1/responses/{rid}/cancel").json(),
             "/v1/responses/{response_id}/cancel", "post", 200)

    with c.stream("POST", "/v1/responses", json={**body, "stream": True,
                                                 "previous_response_id": rid}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created"
    for ev in events:
        validate(ev, "/v1/responses", "post", 200, "text/event-stream")

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    jsonschema.validate(chat, request_schema("/v1/chat/completions"))
    validate(c.post("/v1/chat/completions", json=chat).json(), "/v1/chat/completions", "post",
             200)
    with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        validate(json.loads(line), "/v1/chat/completions", "post", 200, "text/event-stream")

    deleted = c.delete(f"/v1/responses/{rid}")
    validate(deleted.json(), "/v1/responses/{response_id}", "delete", 200)
    validate(c.get(f"/v1/responses/{rid}").json(), "/v1/responses/{response_id}", "get", 404)
    validate(c.delete("/v1/ninfer/sessions/contract").json(), "/v1/ninfer/sessions/{key}",
             "delete", 200)


@pytest.mark.parametrize("body, status", [
    ("not json", 400),
    ({"model": "tiny"}, 400),
    ({"model": "tiny", "input": "x", "bogus": 1}, 400),
    ({"model": "tiny", "input": "x", "temperature": 9}, 400),
    ({"model": "other", "input": "x"}, 404),
    ({"model": "tiny", "input": "x", "previous_response_id": "resp_missing"}, 400),
    ({"model": "tiny", "input": [{"type": "computer_call_output"}]}, 400),
])
def test_errors_validate(server, body, status):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.api_url + "/responses", timeout=60,
                   headers={"Authorization": f"Bearer {server.key}"}, **kw)
    assert r.status_code == status, r.text
    validate(r.json(), "/v1/responses", "post", status)
