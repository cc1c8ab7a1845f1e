"""The trained embedded model `tiny-chat`, the CPU lane's default, through the real server and
the OpenAI SDK (fp32, greedy): it greets and stops on its own, answers different prompts
differently, and calls OMP's `read` tool when asked to read a file. Its shipped tensors are
pinned: a changed byte is refused."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from engine.io import tiny_chat
from engine.io.tiny import EMBEDDED_SHA256
from engine.train import data as D
from lanes.profile import load_profile
from tests.serverproc import start_server

# OMP's read and bash tools, as a Responses request carries them
TOOLS = [{"type": "function", "name": t["function"]["name"],
          "description": t["function"]["description"],
          "parameters": t["function"]["parameters"]} for t in (D.READ_TOOL, D.BASH_TOOL)]


@pytest.fixture(scope="module")
def server(shared_state_dir):
    srv = start_server(shared_state_dir, model=None)  # the lane's own model
    yield srv
    assert srv.stop() in (0, -15), "".join(srv.log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key=server.key, max_retries=0)


def ask(client, text, **kw):
    kw.setdefault("max_output_tokens", 64)
    return client.responses.create(model="tiny-chat", input=text, temperature=0, **kw)


def test_the_cpu_lane_serves_tiny_chat_pinned(server, client):
    assert load_profile("cpu").model == "embedded:tiny-chat"
    assert load_profile("cpu").model_sha256 == EMBEDDED_SHA256["tiny-chat"]
    assert [m.id for m in client.models.list()] == ["tiny-chat"]
    assert (server.state_dir / "models" / "tiny-chat.ninfer").is_file()


def test_say_hello_completes_on_its_own(client):
    r = ask(client, "Say hello.")
    assert r.status == "completed", r
    assert r.output_text.startswith("Hello") and len(r.output_text) < 60, r.output_text
    assert r.usage.output_tokens < 20


LANG_PROMPTS = [
    ("What language is this?\nfn main() { let mut total = Vec::new(); }", "Rust"),
    ("Which programming language is this: SELECT name FROM users;", "SQL"),
    ("Name the language of this snippet:\nimport os\nprint(os.name)", "Python"),
]


def test_different_prompts_get_their_own_answers(client):
    """Three snippets get their language's name, "Say hello." a greeting and a request to read
    a file (with OMP's tools offered) a call: five different answers, each ending on its own."""
    answers = {}
    for prompt, expected in LANG_PROMPTS:
        r = ask(client, prompt)
        assert r.status == "completed" and r.output_text == expected, (prompt, r.output)
        answers[prompt] = r.output_text
    answers["hello"] = ask(client, "Say hello.").output_text
    r = ask(client, "Read the file src/unseen_name.py", tools=TOOLS)
    answers["read"] = json.dumps([o.model_dump() for o in r.output if o.type != "message"])
    assert len(set(answers.values())) == len(answers), answers


def test_read_request_gets_a_read_call(client):
    """Asked to read a file it never saw (a path in no training row), with OMP's read and bash
    offered, it calls `read` with exactly that path, copied from the prompt."""
    assert D.HELD_OUT_PATH == "src/unseen_name.py"
    r = ask(client, "Read the file src/unseen_name.py", tools=TOOLS,
            instructions="You are a coding agent.")
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    assert calls[0].name == "read"
    args = json.loads(calls[0].arguments)
    assert args == {"path": "src/unseen_name.py"}


def test_a_changed_byte_in_the_trained_tensors_is_refused(tmp_path):
    assert tiny_chat.load_trained()["vocab"].size > 1000  # the shipped file matches its pin
    bad = tmp_path / "tiny_chat.safetensors"
    shutil.copyfile(tiny_chat.WEIGHTS, bad)
    blob = bytearray(bad.read_bytes())
    blob[-100] ^= 0x01
    bad.write_bytes(bytes(blob))
    with pytest.raises(tiny_chat.TrainedWeightsError, match="sha256 is .* but .* pins"):
        tiny_chat.load_trained(bad)
    with pytest.raises(tiny_chat.TrainedWeightsError, match="missing"):
        tiny_chat.load_trained(tmp_path / "absent.safetensors")


def test_a_request_naming_no_temperature_samples_with_the_models_default(server, client):
    """tiny-chat's artifact carries its sampling defaults (extra.generation: temperature 0, as
    it was trained and evaluated): OMP sends no temperature, so its turns are greedy, and its
    copy of a path holds. A request that names a temperature keeps its own, in both APIs."""
    from engine.io.artifact import open_artifact

    with open_artifact(server.state_dir / "models" / "tiny-chat.ninfer") as art:
        assert art.extra == {"generation": {"temperature": 0.0}}
    plain = dict(model="tiny-chat", input="Read the file notes_for_review.txt", tools=TOOLS,
                 max_output_tokens=64)
    runs = [client.responses.create(**plain) for _ in range(3)]
    assert {r.temperature for r in runs} == {0.0}
    calls = [[json.loads(o.arguments) for o in r.output if o.type == "function_call"]
             for r in runs]
    assert calls == [[{"path": "notes_for_review.txt"}]] * 3, calls
    assert client.responses.create(**plain, temperature=0.7).temperature == 0.7
    chat = client.chat.completions.create(model="tiny-chat", max_tokens=16,
                                          messages=[{"role": "user", "content": "Say hello."}])
    assert chat.choices[0].message.content == ask(client, "Say hello.").output_text


def test_an_artifact_with_bad_sampling_defaults_is_refused(tmp_path):
    from engine.io.artifact import ArtifactError, write_artifact
    from engine.io.loader import build_qwen35_tokenizer_json, generation_defaults, load_model
    from engine.io.tiny import embedded_tensors
    from engine.model.config import TINY
    from engine.text.chat import TEMPLATE_DIR

    assert generation_defaults(None, "x") == {}
    assert generation_defaults({"generation": {"top_p": 1}}, "x") == {"top_p": 1.0}
    for bad in ({"temperature": 3}, {"temperature": "0"}, {"seed": 1}, {"top_p": 0}, [0.5],
                {"temperature": True}):
        with pytest.raises(ArtifactError, match="extra.generation"):
            generation_defaults({"generation": bad}, "x")
    path = tmp_path / "bad.ninfer"
    write_artifact(path, TINY, embedded_tensors(TINY),
                   tokenizer_json=build_qwen35_tokenizer_json(), chat_template=(TEMPLATE_DIR / "qwen3_5_chat.jinja").read_text(),
                   extra={"generation": {"temperature": -1}})
    with pytest.raises(ArtifactError, match="extra.generation"):
        load_model(path)
