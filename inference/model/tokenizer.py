"""Tokenizer: built from GGUF vocabularies, loaded from tokenizer.json.

User text (manuals, questions, history) is always encoded with special-token parsing off: a
manual that contains ``<|im_end|>`` yields ordinary text tokens. Control tokens of a prompt are
placed by id (``special_id``), never by parsing text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from inference.errors import ModelError

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte
_CONTROL = 3
_USER_DEFINED = 4

# GPT-2 style split used by byte-level BPE models.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama-bpe (Llama 3) split: digits in groups of at most three.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 split: like Llama 3's, but every digit on its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken split.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's tokenizer.ggml.pre names -> the split their merges were learned on
_PRE_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# llama.cpp pre-tokenizers that split every digit on its own before the GPT-2 split.
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE; SentencePiece BPE


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two
    pieces of the vocabulary, the merges into higher-scoring pieces first (SentencePiece's BPE
    applies the best-scoring merge first); among equal scores, longer left pieces first, then
    vocabulary order."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for rank, (piece, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                key = (-score, -len(left), -len(right), rank, vocab[left], vocab[right])
                found.append((key, left, right))
    found.sort(key=lambda f: f[0])
    return [(left, right) for _, left, right in found]


def _special_added(tok: Tokenizer, tokens, token_types) -> list[AddedToken]:
    """Control tokens (special) and user-defined ones (plain), added in id order so each keeps
    its vocabulary id; they are matched whole in text."""
    types = list(token_types) if token_types is not None else [1] * len(tokens)
    added = [
        AddedToken(t, special=ty == _CONTROL, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return added


def build_tokenizer_from_gguf_fields(
    *,
    tokens,
    merges,
    token_types,
    pre,
    model_kind,
    bos_id,
    eos_id,
    chat_template,
    max_length,
    scores=None,
    unk_id=None,
    add_space_prefix=None,
) -> tuple[str, dict]:
    """Return (tokenizer.json text, tokenizer_config dict) for a GGUF vocabulary: byte-level
    BPE (``gpt2``: Llama 3, Qwen, SmolLM, Mistral's tekken) or SentencePiece BPE (``llama``:
    Llama 2, Mistral 7B, TinyLlama) with byte fallback."""
    if model_kind not in TOKENIZER_MODELS:
        raise ModelError(
            f"GGUF tokenizer model {model_kind!r} is not supported "
            f"(supported: {', '.join(TOKENIZER_MODELS)})"
        )
    prefix_space = False
    if model_kind == "gpt2":
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
    else:
        if scores is None:
            raise ModelError("a SentencePiece GGUF vocabulary without tokenizer.ggml.scores")
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = (
            [tuple(m.split(" ", 1)) for m in merges]
            if merges
            else sentencepiece_merges(tokens, scores)
        )
        unk = tokens[unk_id if unk_id is not None else 0]
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
        )
        # llama.cpp writes a space before the text (add_space_prefix, on unless the file says
        # off); segments here are encoded as they are (``never``) and the prompt layout puts
        # that space where a turn's text starts (prompts/layout.py), so a segment in the middle
        # of a turn gets no stray space
        prefix_space = add_space_prefix is None or bool(add_space_prefix)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="never", split=False
        )
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix_space:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(steps)
    added = _special_added(tok, tokens, token_types)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos_id],
        "eos_token": tokens[eos_id],
        "unk_token": tokens[unk_id if unk_id is not None else 0],
        "model_max_length": max_length,
        "add_bos_token": False,
        "add_prefix_space": prefix_space,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [a.content for a in added if a.special],
        "chat_template": chat_template,
        "gguf_pre_tokenizer": pre,
        "gguf_tokenizer_model": model_kind,
    }
    return tok.to_str(), config


class TextTokenizer:
    """tokenizer.json + tokenizer_config.json of a model directory."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{model_dir} has no tokenizer.json")
        raw = path.read_bytes()
        self.fingerprint = hashlib.sha256(raw).digest()
        self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        self._tok.encode_special_tokens = True  # user text never yields control tokens
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str = self.config.get("chat_template") or ""
        # SentencePiece vocabularies mark a word's leading space on the word ("\u2581the") and
        # want one before a turn's text; the prompt layout writes it (this encodes as it is)
        self.prefix_space = bool(self.config.get("add_prefix_space", False))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of plain text; special-token strings inside it stay ordinary text."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each plain text (encoded in parallel)."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [len(e.ids) for e in encs]

    def cut_offsets(self, text: str, n: int) -> list[int]:
        """Character offsets that cut ``text`` into runs of at most ``n`` tokens, at token
        starts."""
        offsets = self._tok.encode(text, add_special_tokens=False).offsets
        return [offsets[i][0] for i in range(n, len(offsets), n)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_str(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def _config_token(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v

    @property
    def eos_token_id(self) -> int | None:
        t = self._config_token("eos_token")
        return self.special_id(t) if t else None

    @property
    def bos_token_id(self) -> int | None:
        t = self._config_token("bos_token")
        return self.special_id(t) if t else None
