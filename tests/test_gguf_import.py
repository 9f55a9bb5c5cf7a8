"""GGUF import for Llama, Mistral, Qwen2 and Qwen3 in every supported tensor type, checked
against transformers' own GGUF loader: synthetic models (random weights, a real tokenizer
layout) written with the ``gguf`` library, imported, and compared logit for logit, token for
token; then served through /v1/ask."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf_synth import FAMILIES, SAMPLE_MANUAL, TENSOR_TYPES, _random_blocks, write_model

from inference.attention.metadata import AttentionMetadata
from inference.engine.sampling_params import SamplingParams
from inference.errors import ModelError
from inference.llm import LLM
from inference.model.config import ModelConfig, RopeScaling
from inference.model.gguf_quants import TYPE_IDS, dequantize
from inference.model.layers import rope_inv_freq
from inference.model.llama import LlamaModel
from inference.model.model_import import import_gguf
from inference.model.tokenizer import TextTokenizer
from inference.runner.cpu_runner import cpu_ops

TEXT = SAMPLE_MANUAL.read_text()[:900]


@pytest.mark.parametrize("kind", [k for k in TENSOR_TYPES if k not in ("F32", "F16", "BF16")])
def test_every_block_format_dequantizes_as_the_gguf_library_does(kind):
    rng = np.random.default_rng(3)
    raw = _random_blocks(rng, kind, 8, 512)
    ours = dequantize(raw.reshape(-1), TYPE_IDS[kind])
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(-1)
    assert ours.dtype == np.float32 and ours.size == 8 * 512
    assert np.array_equal(ours, theirs.astype(np.float32))


def _hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _our_logits(model_dir, ids):
    cfg = ModelConfig.from_file(model_dir)
    ops = cpu_ops(torch.float32, torch.float32, "torch", cfg.hidden_size)
    ours = LlamaModel.from_pretrained(model_dir, torch.float32, ops)
    n, nblk = len(ids), -(-len(ids) // 16)
    shape = (nblk, 16, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build([list(range(nblk))[::-1]], [n], [n], 16)
    return ours.forward(torch.tensor(ids), torch.arange(n), meta, kv, torch.arange(n))


@pytest.mark.parametrize("kind", TENSOR_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_import_agrees_with_transformers_gguf_loader(tmp_path, default_model_dir, family, kind):
    path = write_model(tmp_path / f"{family}-{kind}.gguf", family, kind, seed=len(kind))
    out = import_gguf(path, tmp_path / "model")
    hf, hf_tok = _hf(path)
    config = json.loads((out / "config.json").read_text())
    # Mistral 7B's GGUFs say llama: its SentencePiece vocabulary and [INST] turns set it apart
    assert config["model_type"] == ("llama" if family == "mistral" else family)
    assert config["gguf_tensor_types"][kind] > 0

    # the tokenizer: the same ids as transformers' build of the GGUF vocabulary
    # (a SentencePiece vocabulary encodes a segment as it is: the space transformers puts before
    # a text, the prompt layout writes where a turn starts)
    tok = TextTokenizer(out)
    ids = tok.encode((" " if tok.prefix_space else "") + TEXT)
    assert ids == hf_tok(TEXT, add_special_tokens=False).input_ids
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)

    # the logits of every position, within float32 tolerance
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = _our_logits(out, ids)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-5, rel

    # greedy tokens through the engine (its own kernels, paged cache, sampler) as transformers
    # decodes them; a step whose two best logits are closer than float32 noise ends the check
    prompt = ids[:200]
    llm = LLM(out, dtype="float32", kv_cache_gib=0.02)
    mine = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=12, temperature=0)
    )[0].token_ids
    with torch.no_grad():
        seq = torch.tensor([prompt + mine])
        logits = hf(seq).logits[0, len(prompt) - 1 : -1].float()
    for step, token in enumerate(mine):
        top2 = logits[step].topk(2).values
        if float(top2[0] - top2[1]) < 1e-4:
            break
        assert token == int(logits[step].argmax()), (step, mine)


def test_a_mistral_architecture_file_imports_as_the_llama_one(tmp_path, default_model_dir):
    """GGUFs of Mistral 7B say ``llama``; a file that says ``mistral`` is the same model."""
    a = import_gguf(write_model(tmp_path / "a.gguf", "mistral", "Q4_K"), tmp_path / "a")
    b = write_model(tmp_path / "b.gguf", "mistral", "Q4_K", arch="mistral")
    b = import_gguf(b, tmp_path / "b")
    ids = TextTokenizer(a).encode(" " + TEXT)
    assert TextTokenizer(b).encode(" " + TEXT) == ids
    assert torch.equal(_our_logits(a, ids), _our_logits(b, ids))
    assert json.loads((b / "config.json").read_text())["model_type"] == "mistral"


def test_llama3_rope_frequency_factors_give_llama3_scaling(tmp_path, default_model_dir):
    """Llama 3.1/3.2 GGUFs carry their rope scaling as ``rope_freqs`` (a divisor per
    frequency), computed by llama.cpp from factor 8, low 1, high 4, 8,192 original tokens."""
    head_dim, theta = 64, 500000.0
    scaling = RopeScaling(8.0, 1.0, 4.0, 8192)
    base = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim))
    factors = []
    for freq in base:
        wavelen = 2 * np.pi / freq
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    path = tmp_path / "l3.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_rope_freq_base(theta)
    w.add_context_length(131072)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.normal(0, 0.02, (3, 256)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    for name, shape in [
        ("attn_norm", (256,)),
        ("ffn_norm", (256,)),
        ("attn_q", (256, 256)),
        ("attn_k", (256, 256)),
        ("attn_v", (256, 256)),
        ("attn_output", (256, 256)),
        ("ffn_gate", (256, 256)),
        ("ffn_up", (256, 256)),
        ("ffn_down", (256, 256)),
    ]:
        w.add_tensor(f"blk.0.{name}.weight", rng.normal(0, 0.02, shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = ModelConfig.from_file(import_gguf(path, tmp_path / "l3"))
    assert cfg.rope_freq_factors is not None and cfg.max_position_embeddings == 131072
    from dataclasses import replace

    want = rope_inv_freq(replace(cfg, rope_freq_factors=None, rope_scaling=scaling))
    got = rope_inv_freq(cfg)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)


def test_an_unsupported_architecture_is_refused_in_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "models" / "g"
    with pytest.raises(ModelError, match="architecture 'gemma2' is not supported") as e:
        import_gguf(path, out)
    assert "llama, mistral, qwen2, qwen3" in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and not out.with_name("g.importing").exists()
    # the command line says it on one line of stderr and exits non-zero
    r = subprocess.run(
        [sys.executable, "-m", "app.cli", "model", "import", "--gguf", str(path)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "DOCQA_HOME": str(tmp_path / "home")},
    )
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "'gemma2' is not supported" in lines[0], r.stderr
    assert not (tmp_path / "home" / "models").exists() or not any(
        (tmp_path / "home" / "models").iterdir()
    )


@pytest.mark.parametrize(
    "family, kind", [("llama", "Q4_K"), ("mistral", "Q6_K"), ("qwen2", "Q8_0"), ("qwen3", "Q5_K")]
)
def test_an_imported_model_is_listed_and_serves_answers_by_name(
    tmp_path, default_model_dir, family, kind
):
    """``docqa model import --gguf`` into $DOCQA_HOME, ``model list``, ``serve --model NAME``;
    /v1/models and /v1/engine name it; /v1/ask answers, and a second question reads the
    manual's prefix from the cache."""
    import os

    from svc_helpers import Server

    from inference.model.model_import import docqa_home

    home = tmp_path / "home"
    home.mkdir()
    (home / "kernels").symlink_to(docqa_home() / "kernels", target_is_directory=True)
    env = {**os.environ, "DOCQA_HOME": str(home)}
    path = write_model(tmp_path / f"{family}-{kind}.gguf", family, kind, context=2048)
    cli = [sys.executable, "-m", "app.cli", "model"]
    r = subprocess.run([*cli, "import", "--gguf", str(path)], env=env, capture_output=True)
    assert r.returncode == 0, r.stderr
    assert f"{kind} tensors: " in r.stderr.decode()  # the import's choice per tensor type
    listed = json.loads(
        subprocess.run([*cli, "list", "--json"], env=env, capture_output=True).stdout
    )
    name, model_type = path.stem, "llama" if family == "mistral" else family
    assert [(m["name"], m["family"], m["quantization"], m["window"]) for m in listed] == [
        (name, model_type, kind, 2048)
    ]
    assert listed[0]["parameters"] > 1_000_000 and listed[0]["kv_bytes_per_token"] > 0

    srv = Server(tmp_path, f"sqlite:///{tmp_path / 'docqa.db'}", args=("--model", name), name=name)
    srv.extra_env["DOCQA_HOME"] = str(home)
    srv.start()
    try:
        api = srv.client()
        card = api.get("/v1/models").json()["data"][0]
        assert (card["id"], card["family"], card["quantization"]) == (name, model_type, kind)
        engine = api.get("/v1/engine").json()
        assert (engine["model"], engine["model_family"], engine["quantization"]) == (
            name,
            model_type,
            kind,
        )
        text = SAMPLE_MANUAL.read_text()[:3000]
        m = api.post("/v1/manuals", json={"title": "tarx", "text": text})
        assert m.status_code == 201, m.text
        answers = []
        for q in ("Which option compresses the archive?", "How do I list an archive?"):
            r = api.post(
                "/v1/ask", json={"manual_id": m.json()["id"], "question": q, "max_tokens": 6}
            )
            assert r.status_code == 200, r.text
            answers.append(r.json())
        assert all(a["usage"]["completion_tokens"] >= 1 for a in answers)
        assert answers[1]["usage"]["cached_tokens"] >= m.json()["tokens"] - 16
    finally:
        srv.stop()


def test_a_vocabulary_without_inst_tokens_spells_the_turns_in_text(tmp_path, default_model_dir):
    """Mistral 7B v0.1/v0.2 and Llama 2 have no [INST] token: the prompt spells it, as their
    template does, and the model answers."""
    from gguf_synth import spm_vocab

    from prompts import PromptBuilder

    vocab = spm_vocab(inst_tokens=False)
    path = write_model(tmp_path / "m.gguf", "mistral", "Q8_0", vocab=vocab)
    out = import_gguf(path, tmp_path / "m")
    tok = TextTokenizer(out)
    assert tok.special_id("[INST]") is None
    built = PromptBuilder(tok).build(TEXT, "Which option compresses the archive?")
    text = tok.decode(built.token_ids, skip_special_tokens=False)
    assert text.startswith("<s> [INST] You are docqa") and text.endswith("archive? [/INST]")
    llm = LLM(out, dtype="float32", kv_cache_gib=0.02)
    answer = llm.generate(
        prompt_token_ids=[built.token_ids], sampling_params=SamplingParams(max_tokens=4)
    )[0]
    assert len(answer.token_ids) >= 1


@pytest.mark.parametrize(
    "family, opening, closing",
    [
        ("llama", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>", "<|eot_id|>"),
        ("qwen3", "<|im_start|>system", "<think>\n\n</think>\n\n"),
        ("mistral", "<s>[INST] You are docqa", "[/INST]"),
    ],
)
def test_prompts_follow_the_imported_template(
    tmp_path, default_model_dir, family, opening, closing
):
    """The chat layout comes from the GGUF's template: Llama 3 headers, ChatML with Qwen3's
    empty <think> block before the answer, Mistral's [INST] turns."""
    from prompts import PromptBuilder

    out = import_gguf(write_model(tmp_path / "m.gguf", family, "Q8_0"), tmp_path / "m")
    tok = TextTokenizer(out)
    built = PromptBuilder(tok).build(TEXT, "Which option compresses the archive?")
    text = tok.decode(built.token_ids, skip_special_tokens=False)
    assert text.startswith(opening), text[:80]
    if family == "llama":
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert built.token_ids.count(tok.special_id("<|eot_id|>")) == 2
    else:
        assert text.endswith(closing), text[-80:]


def test_an_unsupported_tensor_type_is_refused_in_one_line_and_writes_nothing(tmp_path):
    """Q8_1 (llama.cpp's intermediate type, never a model's) names itself and the types read."""
    path = tmp_path / "q81.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    q81 = np.zeros((4, 40), np.uint8)  # 4 rows of one 32-value Q8_1 block
    w.add_tensor("token_embd.weight", q81, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out"
    with pytest.raises(ModelError, match="tensor type Q8_1 is not supported") as e:
        import_gguf(path, out)
    assert "Q4_K" in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and not out.with_name("out.importing").exists()
