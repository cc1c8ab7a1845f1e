"""Our Qwen3.5-format chat template, rendered by engine.text.chat, must equal transformers' rendering."""
from __future__ import annotations

import json

import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from engine.text.chat import (ChatTemplateError, default_chat_template, load_chat_template,
                              render_chat)

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file — UTF-8 text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
]

PLAIN = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a joke."}]},
]

AGENT = [
    {"role": "system", "content": "You are a coding agent.\n"},
    {"role": "user", "content": "Look at a.py and run the tests."},
    {"role": "assistant", "content": "", "reasoning_content": "Read first, then run.",
     "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py", "limit": 50}}},
         {"id": "c2", "type": "function",
          "function": {"name": "bash", "arguments": {"command": "pytest -q\necho 'done'", "env": {"A": [1, True, None]}}}},
     ]},
    {"role": "tool", "tool_call_id": "c1", "content": "print('hi')\n"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "1 passed"}]},
    {"role": "assistant", "content": "Both done.", "reasoning_content": "\nAll good.\n"},
    {"role": "user", "content": "Now delete b.py"},
    {"role": "assistant", "content": "I will remove it.", "reasoning": "Use bash.",
     "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "rm b.py"}}}]},
    {"role": "tool", "content": "", "tool_call_id": None},
]

CASES = {
    "plain": (PLAIN, None, {}),
    "plain_no_generation_prompt": (PLAIN, None, {"add_generation_prompt": False}),
    "system_and_tools": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "ls"}], TOOLS, {}),
    "tools_without_system": ([{"role": "user", "content": "ls"}], TOOLS, {}),
    "agent": (AGENT, TOOLS, {}),
    "agent_preserve_thinking": (AGENT, TOOLS, {"preserve_thinking": True}),
    "agent_preserve_thinking_off": (AGENT, TOOLS, {"preserve_thinking": False}),
    "agent_thinking_off": (AGENT, TOOLS, {"enable_thinking": False}),
    "agent_thinking_on": (AGENT, TOOLS, {"enable_thinking": True}),
    "think_inside_content": ([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "<think>\nplan\n</think>\n\nanswer"}], None,
                             {"add_generation_prompt": False}),
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    # apply_chat_template(tokenize=False) never touches the vocabulary: a one-token BPE is enough
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0}, merges=[]))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.chat_template = default_chat_template()
    return tok


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_equals_transformers(hf_tokenizer, name):
    messages, tools, kwargs = CASES[name]
    kwargs = {"add_generation_prompt": True, **kwargs}
    ours = render_chat(default_chat_template(), messages, tools=tools, **kwargs)
    theirs = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert ours == theirs


def test_small_case_exact_text():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "", "reasoning_content": "R2",
         "tool_calls": [{"function": {"name": "f", "arguments": {"x": "1", "y": 2}}},
                        {"function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
    ]
    common = (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
    )
    rest = (
        "A1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nR2\n</think>\n\n"
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n2\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>"
        "<|im_end|>\n"
    )
    template = default_chat_template()
    assert render_chat(template, messages) == common + rest + "<|im_start|>assistant\n<think>\n"
    assert render_chat(template, messages, enable_thinking=False) == (
        common + rest + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render_chat(template, messages, add_generation_prompt=False, preserve_thinking=True) == (
        common + "<think>\nR1\n</think>\n\n" + rest
    )


def test_generated_turn_rerenders_identically():
    """What the model generates after the prompt, re-rendered as history, gives back the same text:
    the condition for reusing a session's cached prefix on the next turn."""
    template = default_chat_template()
    messages = [{"role": "user", "content": "Q"}]
    prompt = render_chat(template, messages, tools=TOOLS)
    generated = "R\n</think>\n\nOK.\n\n<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n" \
                "</function>\n</tool_call><|im_end|>\n"
    turn = {"role": "assistant", "content": "OK.", "reasoning_content": "R",
            "tool_calls": [{"function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}]}
    history = render_chat(template, messages + [turn], tools=TOOLS, add_generation_prompt=False)
    assert history == prompt + generated


def test_template_refusals():
    template = default_chat_template()
    with pytest.raises(ChatTemplateError, match="first message"):
        render_chat(template, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="text only"):
        render_chat(template, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatTemplateError, match="mapping"):
        render_chat(template, [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])
    with pytest.raises(ChatTemplateError, match="No messages"):
        render_chat(template, [])


def test_sandbox_namespace_rejects_underscore_names():
    with pytest.raises(Exception, match="underscore"):
        render_chat("{% set ns = namespace(_x=1) %}{{ ns._x }}", [{"role": "user", "content": "a"}])


def test_load_chat_template(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(tmp_path) == "D"
    assert load_chat_template(tmp_path, name="tool_use") == "T"
    with pytest.raises(ChatTemplateError):
        load_chat_template(tmp_path, name="rag")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "S"}))
    assert load_chat_template(tmp_path) == "S"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"
