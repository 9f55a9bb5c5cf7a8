"""Small GGUF models written by the tests with the ``gguf`` library: random weights in any
tensor type, and a real tokenizer layout (the default model's byte-level BPE cut to its first
2,048 tokens, or a SentencePiece vocabulary learned from the sample manual)."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from inference.model.gguf_file import read_gguf
from inference.model.model_import import DEFAULT_GGUF_MEMBER, models_dir

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_MANUAL = ROOT / "app" / "samples" / "tarx-manual.md"

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# every tensor type the importer reads; the 2-D weights of a model are all of one of these
TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

# block bytes, and each float16 scale field: (offset, low, high) of its random magnitude, so
# that weights come out around 0.02-0.05 whatever the format
_BLOCK_SCALES = {
    "Q4_0": [(0, 0.002, 0.006)],
    "Q4_1": [(0, 0.002, 0.005), (2, -0.04, -0.01)],
    "Q5_0": [(0, 0.001, 0.003)],
    "Q5_1": [(0, 0.001, 0.003), (2, -0.04, -0.01)],
    "Q8_0": [(0, 0.0001, 0.0004)],
    "Q2_K": [(80, 0.001, 0.003), (82, 0.0005, 0.002)],
    "Q3_K": [(108, 0.0002, 0.0004)],
    "Q4_K": [(0, 0.00003, 0.00006), (2, 0.0001, 0.0004)],
    "Q5_K": [(0, 0.00002, 0.00004), (2, 0.0001, 0.0004)],
    "Q6_K": [(208, 0.000005, 0.00001)],
}

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN3_TEMPLATE = CHATML_TEMPLATE + (
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model
    pre: str | None
    tokens: list[str]
    types: list[int]
    merges: list[str] | None
    scores: list[float] | None
    bos: int
    eos: int
    template: str


def bpe_vocab(pre: str, size: int = 2048, family: str = "qwen2") -> Vocab:
    """The default model's byte-level BPE, its first ``size`` tokens and the merges among
    them (ChatML control tokens included); for ``llama``, Llama 3's header tokens added and its
    template; for ``qwen3``, its <think> tokens (user-defined, as Qwen3's GGUFs mark them) and
    a template that writes them."""
    g = read_gguf(models_dir() / "gguf" / DEFAULT_GGUF_MEMBER.split("/")[-1])
    tokens = g.get("tokenizer.ggml.tokens")[:size]
    types = g.get("tokenizer.ggml.token_type")[:size]
    keep = set(tokens)
    merges = []
    for m in g.get("tokenizer.ggml.merges"):
        a, b = m.split(" ", 1)
        if a in keep and b in keep and a + b in keep:
            merges.append(m)
    if family == "llama":
        header = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        n = len(tokens)
        return Vocab(
            "gpt2", pre, tokens + header, types + [3] * 4, merges, None, n, n + 3, LLAMA3_TEMPLATE
        )
    if family == "qwen3":
        tokens, types = tokens + ["<think>", "</think>"], types + [4, 4]
        return Vocab("gpt2", pre, tokens, types, merges, None, 1, 2, QWEN3_TEMPLATE)
    return Vocab("gpt2", pre, tokens, types, merges, None, 1, 2, CHATML_TEMPLATE)


def spm_vocab(size: int = 1500, inst_tokens: bool = True) -> Vocab:
    """A SentencePiece BPE vocabulary (Llama 2 / Mistral 7B layout: <unk> <s> </s>, byte
    pieces <0x00>..<0xFF>, then pieces with scores) learned from the sample manual: every
    character, and the frequent words with every prefix of each, scored so that shorter
    pieces merge first."""
    text = SAMPLE_MANUAL.read_text()
    words = collections.Counter("\u2581" + w for w in re.findall(r"[A-Za-z]+", text))
    tokens = ["<unk>", "<s>", "</s>"] + (["[INST]", "[/INST]"] if inst_tokens else [])
    types = [2, 3, 3] + ([3, 3] if inst_tokens else [])
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces: dict[str, float] = {}
    for ch in sorted(set(text.replace(" ", "\u2581")) | {"\u2581"}):
        if ch != "\n":
            pieces[ch] = -1.0
    for word, _ in words.most_common():
        for end in range(2, len(word) + 1):
            piece = word[:end]
            if piece not in pieces:
                pieces[piece] = -float(end) - len(pieces) / 1e5
        if len(pieces) + len(tokens) >= size:
            break
    for piece, _score in sorted(pieces.items(), key=lambda kv: -kv[1]):
        tokens.append(piece)
        types.append(1)
    first = len(tokens) - len(pieces)
    scores = [0.0] * first + [pieces[t] for t in tokens[first:]]
    return Vocab("llama", "default", tokens, types, None, scores, 1, 2, MISTRAL_TEMPLATE)


def _random_blocks(rng, kind: str, rows: int, cols: int) -> np.ndarray:
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rows * cols // block_values
    raw = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    for at, lo, hi in _BLOCK_SCALES[kind]:
        scale = rng.uniform(lo, hi, size=blocks).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, cols // block_values * block_bytes)


def _weight(w: gguf.GGUFWriter, rng, name: str, rows: int, cols: int, kind: str) -> None:
    if kind in _BLOCK_SCALES:
        raw = _random_blocks(rng, kind, rows, cols)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        return
    values = rng.normal(0.0, 0.03, size=(rows, cols)).astype(np.float32)
    if kind == "F32":
        w.add_tensor(name, values)
    elif kind == "F16":
        w.add_tensor(name, values.astype(np.float16))
    else:  # BF16: the high half of each float32
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
        w.add_tensor(name, bits.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)


def write_model(
    path: Path,
    family: str,
    kind: str,
    *,
    hidden: int = 256,
    ffn: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    vocab: Vocab | None = None,
    context: int = 4096,
    tied: bool = False,
    extra: dict | None = None,
    arch: str | None = None,
) -> Path:
    """A GGUF model of ``family`` with its 2-D weights in ``kind`` (norms, biases F32).

    Mistral is written as llama.cpp writes Mistral 7B: architecture ``llama`` (``arch``
    overrides it) with a SentencePiece vocabulary and the [INST] template. Qwen3's heads are
    128 wide, as in every Qwen3 model (and as transformers assumes for a Qwen3 GGUF)."""
    rng = np.random.default_rng(seed)
    if vocab is None:
        vocab = spm_vocab() if family == "mistral" else bpe_vocab(_PRE[family], family=family)
    head_dim = 128 if family == "qwen3" else hidden // heads
    arch = arch or ("llama" if family == "mistral" else family)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{family}-{kind}")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if family in ("llama", "mistral") else 1e6)
    w.add_rope_dimension_count(head_dim)
    if family == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(len(vocab.tokens))
    w.add_tokenizer_model(vocab.model)
    if vocab.pre:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_chat_template(vocab.template)
    for key, value in (extra or {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    v = len(vocab.tokens)
    _weight(w, rng, "token_embd.weight", v, hidden, kind)
    w.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
    if not tied:
        _weight(w, rng, "output.weight", v, hidden, kind)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        _weight(w, rng, p + "attn_q.weight", heads * head_dim, hidden, kind)
        _weight(w, rng, p + "attn_k.weight", kv_heads * head_dim, hidden, kind)
        _weight(w, rng, p + "attn_v.weight", kv_heads * head_dim, hidden, kind)
        if family == "qwen2":
            for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                bias = rng.normal(0.0, 0.5, n * head_dim).astype(np.float32)
                w.add_tensor(p + f"attn_{x}.bias", bias)
        if family == "qwen3":
            for x in "qk":
                norm = rng.uniform(0.5, 1.5, head_dim).astype(np.float32)
                w.add_tensor(p + f"attn_{x}_norm.weight", norm)
        _weight(w, rng, p + "attn_output.weight", hidden, heads * head_dim, kind)
        _weight(w, rng, p + "ffn_gate.weight", ffn, hidden, kind)
        _weight(w, rng, p + "ffn_up.weight", ffn, hidden, kind)
        _weight(w, rng, p + "ffn_down.weight", hidden, ffn, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "mistral": "default"}
