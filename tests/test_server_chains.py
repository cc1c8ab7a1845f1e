"""Stateful Responses flows over a real socket with the OpenAI SDK: chains, forks, rollback,
delete, input items, principal isolation, and chains that survive a restart."""
from __future__ import annotations

import time

import openai
import pytest

from tests.serverproc import start_server


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory, embedded_models_dir):
    d = tmp_path_factory.mktemp("chains")
    (d / "models").symlink_to(embedded_models_dir)  # reuse the generated model
    keys = d / "keys"
    # alice is an admin: she reads the engine's memory in /v1/ninfer/status
    keys.write_text("alice nk-alice-0123456789abcdef admin\nbob nk-bob-0123456789abcdef00\n")
    keys.chmod(0o600)
    return d


@pytest.fixture(scope="module")
def server(state_dir):
    srv = start_server(state_dir)
    yield srv
    srv.stop()


def client(server, who="alice"):
    return openai.OpenAI(base_url=server.api_url, api_key=f"nk-{who}-0123456789abcdef" +
                         ("00" if who == "bob" else ""), max_retries=0)


def ask(c, text, prev=None, **kw):
    return c.responses.create(model="tiny", input=text, previous_response_id=prev,
                              instructions="Answer briefly.", temperature=0,
                              max_output_tokens=12, prompt_cache_key="session-a", **kw)


def expected_cached(r):
    # the stored state follows prompt + outputs (minus the unfed last token when cut short)
    return r.usage.input_tokens + r.usage.output_tokens - (r.status == "incomplete")


def test_chain_fork_rollback_and_usage(server):
    a = client(server)
    r1 = ask(a, "Name a sorting algorithm.")
    assert a.responses.retrieve(r1.id).output_text == r1.output_text
    r2 = ask(a, "Why that one?", prev=r1.id)
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens_details.cached_tokens == expected_cached(r1)
    assert r2.usage.input_tokens > expected_cached(r1)
    # a fork: another continuation of r1
    r2b = ask(a, "Name another.", prev=r1.id)
    assert r2b.usage.input_tokens_details.cached_tokens == expected_cached(r1)
    # streaming continuation of the newest response
    events = list(a.responses.create(model="tiny", input="More.", previous_response_id=r2.id,
                                     instructions="Answer briefly.", temperature=0,
                                     max_output_tokens=8, prompt_cache_key="session-a",
                                     stream=True))
    done = events[-1].response
    assert done.usage.input_tokens_details.cached_tokens == expected_cached(r2)
    # rollback: continue the oldest response again
    r1c = ask(a, "Name a third.", prev=r1.id)
    assert r1c.usage.input_tokens_details.cached_tokens == expected_cached(r1)


def test_changed_instructions_recompute_from_the_stored_transcript(server):
    a = client(server)
    r1 = ask(a, "Hello there.")
    r2 = a.responses.create(model="tiny", input="Go on.", previous_response_id=r1.id,
                            instructions="Answer at length.", temperature=0,
                            max_output_tokens=4, prompt_cache_key="session-a")
    assert r2.status in ("completed", "incomplete")
    assert r2.usage.input_tokens_details.cached_tokens < expected_cached(r1)


def test_delete_does_not_cascade(server):
    a = client(server)
    r1 = ask(a, "First.")
    r2 = ask(a, "Second.", prev=r1.id)
    r3 = ask(a, "Third.", prev=r2.id)
    deleted = a.responses.delete(r2.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r2.id)
    with pytest.raises(openai.BadRequestError) as e:
        ask(a, "Again.", prev=r2.id)
    assert e.value.body["code"] == "previous_response_not_found"
    r4 = ask(a, "Fourth.", prev=r3.id)  # the deleted response's descendant still continues
    assert r4.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        a.responses.delete(r2.id)


def test_input_items_paging(server):
    a = client(server)
    r = a.responses.create(model="tiny", max_output_tokens=2, temperature=0, input=[
        {"role": "user", "content": f"message {i}"} for i in range(5)])
    page = a.responses.input_items.list(r.id, limit=2, order="asc")
    assert [x.content[0].text if not isinstance(x.content, str) else x.content
            for x in page.data] == ["message 0", "message 1"] and page.has_more
    rest = a.responses.input_items.list(r.id, limit=10, order="asc", after=page.last_id)
    assert len(rest.data) == 3 and not rest.has_more
    desc = a.responses.input_items.list(r.id)
    assert len(desc.data) == 5 and desc.first_id == rest.last_id


def test_principals_are_isolated(server):
    a, b = client(server, "alice"), client(server, "bob")
    r = ask(a, "Private question.")
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.create(model="tiny", input="x", previous_response_id=r.id,
                           max_output_tokens=2)
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    assert a.responses.retrieve(r.id).id == r.id
    # continuing from another session of the same principal is refused like an absent id
    with pytest.raises(openai.BadRequestError):
        a.responses.create(model="tiny", input="x", previous_response_id=r.id,
                           prompt_cache_key="session-b", max_output_tokens=2)


def test_chains_survive_a_restart(state_dir):
    # Checkpoints off: the chain must resolve from the response store alone (with them on, the
    # state is restored from disk instead: tests/test_checkpoint_server.py).
    first = start_server(state_dir, "--checkpoints", "off")
    try:
        a = client(first)
        r1 = ask(a, "Remember this.")
        r2 = ask(a, "And this.", prev=r1.id)
        # Widths JAX's persistent cache supplied are compiled afresh and stored in the
        # background (ExecStore.save_in_background): wait until the store holds them all.
        widths = first.startup_phases()["exec_loaded"] + first.startup_phases()[
            "exec_compiled"]
        deadline, log = time.monotonic() + 300, state_dir / "logs" / "requests.jsonl"
        while len(list((state_dir / "executables").glob("[0-9a-f]*.exe"))) < widths:
            unsaved = [line for line in log.read_text().splitlines()
                       if '"executable_unsaved"' in line]
            assert not unsaved and time.monotonic() < deadline, unsaved or "not stored"
            time.sleep(0.2)
    finally:
        first.stop()
    second = start_server(state_dir, "--checkpoints", "off")
    try:
        # the restart traced nothing: every width's executable came from the first start's
        # store (engine/runtime/exec_store.py)
        phases = second.startup_phases()
        assert phases["exec_compiled"] == 0 and phases["exec_loaded"] == widths >= 2
        a = client(second)
        assert a.responses.retrieve(r2.id).output_text == r2.output_text
        r3 = ask(a, "Still there?", prev=r2.id)
        assert r3.status in ("completed", "incomplete")
        # the engine state was lost with the process and not checkpointed: recomputed
        assert r3.usage.input_tokens_details.cached_tokens == 0
        assert r3.usage.input_tokens > expected_cached(r2)
    finally:
        second.stop()


def test_retention_limit_applies_at_start(tmp_path, embedded_models_dir):
    (tmp_path / "models").symlink_to(embedded_models_dir)
    (tmp_path / "keys").write_text("alice nk-alice-0123456789abcdef\n")
    (tmp_path / "keys").chmod(0o600)
    first = start_server(tmp_path)
    try:
        a = client(first)
        old, new = ask(a, "One."), ask(a, "Two.")
    finally:
        first.stop()
    second = start_server(tmp_path, "--retain-responses", "1")
    try:
        a = client(second)
        assert a.responses.retrieve(new.id).id == new.id
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(old.id)
    finally:
        second.stop()
    assert "retention removed 1 stored responses" in "".join(second.log)


def test_status_input_tokens_and_session_purge(server):
    import httpx

    a = client(server)
    headers = {"Authorization": f"Bearer {a.api_key}"}
    st = httpx.get(server.api_url + "/ninfer/status", headers=headers).json()
    assert len(st["model"]["artifact_sha256"]) == 64 and st["lane"]["name"] == "cpu"
    from lanes.profile import load_profile

    assert st["lane"]["profile_sha256"] == load_profile("cpu").canonical_hash()
    from engine.plan import CPU

    # the effective kernel plan: the cpu lane's cpu preset, every field, its digest
    assert st["plan"]["preset"] == "cpu" and st["plan"]["digest"] == CPU.digest()
    assert {k: st["plan"][k] for k in CPU.to_dict()} == CPU.to_dict()
    body = {"model": "tiny", "input": "Count the tokens.", "instructions": "Answer briefly.",
            "max_output_tokens": 2}
    n = httpx.post(server.api_url + "/responses/input_tokens", json=body,
                   headers=headers).json()["input_tokens"]
    r1 = a.responses.create(**body, prompt_cache_key="purge-me", temperature=0)
    assert r1.usage.input_tokens == n
    r2 = a.responses.create(model="tiny", input="More.", previous_response_id=r1.id,
                            instructions="Answer briefly.", max_output_tokens=2,
                            prompt_cache_key="purge-me", temperature=0)
    before = httpx.get(server.api_url + "/ninfer/status", headers=headers).json()
    r = httpx.delete(server.api_url + "/ninfer/sessions/purge-me", headers=headers)
    assert r.status_code == 200 and r.json()["responses"] == 2
    for rid in (r1.id, r2.id):
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(rid)
    with pytest.raises(openai.BadRequestError):
        a.responses.create(model="tiny", input="x", previous_response_id=r2.id,
                           max_output_tokens=2, prompt_cache_key="purge-me")
    after = httpx.get(server.api_url + "/ninfer/status", headers=headers).json()
    assert after["memory"]["snapshots"] < before["memory"]["snapshots"]
    assert httpx.delete(server.api_url + "/ninfer/sessions/purge-me",
                        headers=headers).status_code == 404


def test_resent_transcript_continues_the_stored_state(server):
    """A client resuming a session sends the whole transcript without previous_response_id:
    the echoed items match a stored chain, so only the new turn is computed."""
    a = client(server)
    r1 = ask(a, "Name a color.")
    r2 = ask(a, "Another one?", prev=r1.id)
    echo = lambda r: {"type": "message", "role": "assistant",  # noqa: E731
                      "content": [{"type": "output_text", "text": r.output_text,
                                   "annotations": []}]}
    transcript = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
                  echo(r1), {"role": "user", "content": "Another one?"}, echo(r2),
                  {"role": "user", "content": "And a third?"}]
    r3 = a.responses.create(model="tiny", input=transcript, instructions="Answer briefly.",
                            temperature=0, max_output_tokens=12, prompt_cache_key="session-a")
    assert r3.previous_response_id is None  # what the client sent
    assert r3.usage.input_tokens_details.cached_tokens == expected_cached(r2)
    # the same transcript with an edited echo is not a replay: it is rendered afresh
    transcript[1]["content"][0]["text"] += " (edited)"
    r4 = a.responses.create(model="tiny", input=transcript, instructions="Answer briefly.",
                            temperature=0, max_output_tokens=4, prompt_cache_key="session-a")
    assert r4.usage.input_tokens_details.cached_tokens < expected_cached(r1)
