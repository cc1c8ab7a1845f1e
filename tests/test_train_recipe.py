"""The training recipe's parts (engine/train/train_tiny_chat.py) on a small model: the loss taken
at the supervised positions only equals the loss over full logits, copying rows are what they
say (at the start of a row and after long filler), the fresh start is in the ranges it
claims, a word's two forms are paired, and a tool request after a date and a directory still
calls with the request's own path."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from engine.io.tiny import tiny_tensors
from engine.model import model as M
from engine.model.cache import init_cache
from engine.model.config import TEST_SMALL
from engine.text.tokenizer import Tokenizer
from engine.train import batches as B
from engine.train import train_tiny_chat as T


def _full_loss(params, cfg, toks, mask, lengths, n_bg):
    """The loss before `supervised`: every position's logits, masked afterwards."""
    logits, _, _ = M.forward(params, cfg, toks, init_cache(cfg, *toks.shape), lengths=lengths)
    logits = logits.at[..., -1].add(math.log(n_bg))
    tgt = jnp.concatenate([toks[:, 1:], toks[:, :1]], axis=1)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tgt[..., None], -1)[..., 0]
    return (nll * mask).sum() / mask.sum()


def test_the_supervised_loss_equals_the_full_logits_loss():
    cfg = TEST_SMALL
    params = M.stack_params({n: np.asarray(a, np.float32) for n, a in tiny_tensors(cfg)}, cfg)
    rng = np.random.default_rng(5)
    toks = rng.integers(0, cfg.vocab_size - 1, (3, 40)).astype(np.int32)
    lengths = np.array([40, 31, 17], np.int32)
    mask = (rng.random((3, 40)) < 0.3).astype(np.float32)
    mask[np.arange(40)[None, :] >= lengths[:, None] - 1] = 0.0
    nxt = np.concatenate([toks[:, 1:], toks[:, :1]], axis=1)
    idx, tgt, w = B.supervised(mask, nxt, cap=40)
    assert w.sum() == mask.sum() and (tgt[w > 0] == nxt[mask > 0]).all()
    task = np.zeros((3,), np.int32)
    batch = tuple(jnp.asarray(a) for a in (toks, idx, tgt, w, lengths, task))
    got, per_task = T.loss_fn(params, cfg, [batch], 1000.0)
    want = _full_loss(params, cfg, jnp.asarray(toks), jnp.asarray(mask), jnp.asarray(lengths),
                      1000.0)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    rows, counts, _ = per_task[0]
    np.testing.assert_array_equal(np.asarray(counts), mask.sum(1))
    # a cap below a row's supervised count keeps its first positions only
    idx2, _, w2 = B.supervised(mask, nxt, cap=2)
    assert (w2.sum(1) == np.minimum(mask.sum(1), 2)).all()
    assert (idx2[w2 > 0] == np.concatenate([np.flatnonzero(m)[:2] for m in mask])).all()


def test_copying_rows_repeat_a_span_from_a_small_alphabet():
    pool = np.arange(1000, 3000, dtype=np.int32)
    toks, mask, lengths, task = B.repeat_batch(np.random.default_rng(1), pool, sep=198, rows=6)
    n = B.SPAN
    assert toks.shape == (6, 2 * n + 1) and (lengths == 2 * n + 1).all()
    assert (toks[:, n] == 198).all() and (toks[:, :n] == toks[:, n + 1:]).all()
    assert all(len(set(r[:n])) <= B.ALPHABET and set(r[:n]) <= set(pool) for r in toks)
    # the loss predicts exactly the second copy
    assert (mask[:, n:2 * n] == 1).all() and mask.sum() == 6 * n
    assert (task == B.ALL_TASKS.index("repeat")).all()


def test_late_copying_rows_copy_a_span_after_long_filler():
    """Phase 8's long copying rows: filler of thousands of tokens, then span, newline, span,
    the loss on the second span only; the phases before it draw none."""
    pool = np.arange(1000, 3000, dtype=np.int32)
    tk = Tokenizer.qwen35()
    rng = np.random.default_rng(2)
    late = 0
    for _ in range(12):
        toks, mask, lengths, task = B.make_batch(rng, tk, "long", 8, pool)
        if task[0] != B.ALL_TASKS.index("late_repeat"):
            continue
        late += 1
        n, row = B.SPAN, toks[0, :lengths[0]]
        first, second = row[-2 * n - 1:-n - 1], row[-n:]
        assert (first == second).all() and set(first) <= set(pool) and row[-n - 1] == 198
        assert lengths[0] - 2 * n - 1 >= 16384 // 8 and lengths[0] <= 16384
        assert np.flatnonzero(mask[0]).tolist() == list(range(lengths[0] - n - 1,
                                                              lengths[0] - 1))
    assert late >= 1
    rng = np.random.default_rng(2)
    assert all(B.make_batch(rng, tk, "long", 5, pool)[3][0] != B.ALL_TASKS.index("late_repeat")
               for _ in range(12))


def test_a_reminder_before_the_request_leaves_the_call_on_the_requested_path():
    """Phase 7 puts a date and a working directory before half the requests (as OMP does); the
    read call's path is the one the request names, never the reminder's values, and the phases
    before it draw no reminder."""
    import re

    from engine.train import data as D

    rng = np.random.default_rng(5)
    seen = 0
    for _ in range(40):
        prompt, completion = D.chat_sample(rng, "read", remind=1.0)
        user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        date = re.search(r"20\d\d-\d\d-\d\d", user)
        path = re.search(r"<parameter=path>\n(.*)\n</parameter>", completion).group(1)
        assert date and user.index(date.group()) < user.index(path)  # the reminder comes first
        assert user.count(path) == 1 and date.group() not in path
        seen += 1
    assert seen == 40
    assert "20" not in D.chat_sample(np.random.default_rng(5), "greet")[0].split("user")[-1]
    assert B.REMIND.get(5, 0.0) == 0.0 and B.REMIND[7] > 0


def test_the_fresh_start_and_the_space_pairs():
    g = np.random.default_rng(0)
    a = np.exp(T._fresh("layers.0.linear_attn.A_log", (1000,), g))
    assert a.min() >= 1.0 and a.max() <= 16.0
    dt = np.log1p(np.exp(T._fresh("layers.0.linear_attn.dt_bias", (1000,), g)))
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    assert (T._fresh("layers.0.linear_attn.norm", (32,), g) == 1).all()
    assert (T._fresh("layers.0.input_layernorm", (32,), g) == 0).all()
    assert abs(T._fresh("layers.0.mlp.up_proj", (256, 256), g).std() - T.LAYER_STD) < 2e-3
    tk = Tokenizer.qwen35()
    vocab = np.array(sorted({*tk.encode(" test"), *tk.encode("test"), *tk.encode(" src"),
                             *tk.encode("src"), *tk.encode(" main")}), np.int64)
    pairs = {(tk.decode([int(vocab[s])]), tk.decode([int(vocab[b])]))
             for s, b in T.space_pairs(tk, vocab)}
    assert pairs == {(" test", "test"), (" src", "src")}  # "main" is not in this vocabulary



def test_client_rows_render_as_the_server_renders_the_clients_request(tmp_path, tiny_model):
    """Phase 9 renders tool rows in a captured client's own system text and tools: up to the
    user's words the prompt is what the server renders for that client's request, the
    reminder is the client's form, and the call's path is the request's."""
    import json
    import re

    from engine.train import data as D
    from server.chains import render_full
    from server.request_model import parse_response_request

    tools = [{"type": "function", "name": n, "description": f"The {n} tool: {n} things.",
              "parameters": {"type": "object", "properties": {
                  "i": {"type": "string", "description": "intent"},
                  "path": {"type": "string"}}, "required": ["path", "i"]}}
             for n in ("read", "bash", "find")]
    body = {"model": "tiny", "instructions": "You are an agent.\n\n<rules>\n- act\n</rules>",
            "tools": tools, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": D.reminder(np.random.default_rng(1), 0)},
                {"type": "input_text", "text": "Read the file a_b.txt"}]}]}
    req = parse_response_request(body)
    ids = render_full(tiny_model, list(req.messages), req).ids
    capture = tmp_path / "client.json"  # what bench/lab/omp_tool_prompt.py capture writes
    capture.write_text(json.dumps({"ids": ids, "client": {
        "system": req.messages[0]["content"], "tools": list(req.template_tools)}}))
    client = B.load_client(capture)
    assert client["tokens"] == len(ids)
    served = tiny_model.tokenizer.decode(ids)
    served_head = served.split("<|im_start|>user\n")[0]
    rng = np.random.default_rng(3)
    reminded = 0
    for _ in range(20):
        prompt, completion = D.chat_sample(rng, "read", client=client)
        assert prompt.split("<|im_start|>user\n")[0] == served_head
        user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        path = re.search(r"<parameter=path>\n(.*)\n</parameter>", completion).group(1)
        assert user.count(path) == 1 and not completion.startswith("\n</think>")
        reminded += user.startswith("<system-reminder>\nToday: ")
    assert 10 <= reminded < 20  # the client's reminder before most requests, not all
    B.CLIENTS[:] = [client]
    try:
        toks, mask, _, _ = B.make_batch(np.random.default_rng(0), Tokenizer.qwen35(), "tools",
                                        9, np.arange(100, 200, dtype=np.int32))
        assert toks.shape == B.CLIENT_TOOLS and mask.sum() > 0
    finally:
        B.CLIENTS.clear()



def test_client_rows_redraw_the_machine_description():
    """A capture holds one machine's <workstation> lines (kernel, distribution, CPU,
    terminal); phase 9's client rows redraw them, so the model sees other machines' values
    there and everything else of the client's text unchanged."""
    system = ("Be terse.\n\n<workstation>\n- OS: linux 6.18.44-fc-v1272\n- Distro: Linux\n"
              "- Kernel: #1 SMP PREEMPT_DYNAMIC @0\n- Arch: x64\n- CPU: Intel(R) Xeon(R) "
              "Processor @ 2.80GHz\n- Terminal: dumb\n- Model: ninfer/tiny\n</workstation>\n"
              "Tail text.")
    rng = np.random.default_rng(5)
    drawn = [B.workstation(rng, system) for _ in range(40)]
    keep = lambda s: [ln for ln in s.splitlines()  # noqa: E731
                      if not ln.startswith(tuple(f"- {k}: " for k in B.MACHINE))]
    assert all(keep(d) == keep(system) for d in drawn)
    cpus = {ln for d in drawn for ln in d.splitlines() if ln.startswith("- CPU: ")}
    oses = {ln for d in drawn for ln in d.splitlines() if ln.startswith("- OS: linux 6.")}
    assert len(cpus) == len(B.MACHINE["CPU"][1]) and len(oses) > 20
    B.CLIENTS[:] = [{"system": system, "tools": [], "tokens": 100}]
    try:
        c = B._client(np.random.default_rng(0), 9, 2304) or B._client(
            np.random.default_rng(1), 9, 2304)
        assert c is not None and keep(c["system"]) == keep(system)
    finally:
        B.CLIENTS.clear()


def test_untrained_ids_embed_to_zero_when_served():
    """Training holds the row that every untrained id shares at zero (train_tiny_chat drops
    its gradient); the served tensors give every untrained id a zero embedding, so a prompt
    full of ids training never saw (an agent's tool texts) reads as it did in training."""
    from engine.io import tiny_chat
    from engine.io.tiny import tiny_tensors
    from engine.model.config import TINY

    t = tiny_chat.load_trained()
    emb = next(a for n, a in tiny_chat.trained_tensors(tiny_tensors(TINY))
               if n == "embed_tokens").astype(np.float32)
    untrained = np.setdiff1d(np.arange(emb.shape[0]), t["vocab"])
    assert len(untrained) > 0 and not emb[untrained].any()
    assert np.abs(emb[t["vocab"]]).sum(1).min() > 0
