"""The torch model against transformers' LlamaForCausalLM on tiny random configs (fp32)."""

import random

import pytest
import torch

from inference.attention.metadata import AttentionMetadata
from inference.kernels.cpu import elementwise as cpu_elementwise
from inference.kernels.cpu import linear as cpu_linear
from inference.kernels.cpu.linear_layer import (
    LINEAR_MAX_SLAB,
    LINEAR_ROW_SLAB,
    CPULinear,
    _cancelling_probe,
)
from inference.model.config import ModelConfig
from inference.model.llama import LlamaModel
from inference.runner.cpu_runner import cpu_ops


def _hf_tiny(num_heads, num_kv_heads, qwen2=False, seed=0):
    torch.manual_seed(seed)
    if qwen2:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(
            vocab_size=320,
            hidden_size=96,
            intermediate_size=136,
            num_hidden_layers=2,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=512,
            rope_theta=1e6,
            tie_word_embeddings=False,
        )
        model = Qwen2ForCausalLM(cfg).eval()
        for name, p in model.named_parameters():  # make the qkv biases matter
            if name.endswith("bias"):
                p.data.normal_(0, 0.5)
        return cfg, model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=96,
        intermediate_size=136,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=96 // num_heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    return cfg, LlamaForCausalLM(cfg).eval()


def _ours(cfg, model, dtype=torch.float32):
    config = ModelConfig.from_dict(cfg.to_dict())
    ours = LlamaModel(config, dtype, cpu_ops(dtype, dtype, "torch", config.hidden_size))
    ours.load_state_dict(model.state_dict())
    return ours


def _run_chunks(ours, ids, chunks, block_size=16, seed=0):
    """Prefill ``ids`` in the given chunk lengths over a shuffled block table."""
    cfg = ours.cfg
    nblk = -(-len(ids) // block_size)
    table = list(range(nblk + 3))
    random.Random(seed).shuffle(table)
    table = table[:nblk]
    shape = (nblk + 3, block_size, cfg.num_kv_heads, cfg.head_dim)
    kv = [
        (torch.full(shape, 7.0, dtype=ours.dtype), torch.full(shape, 7.0, dtype=ours.dtype))
        for _ in range(cfg.num_layers)
    ]
    outs, pos = [], 0
    for n in chunks:
        meta = AttentionMetadata.build([table], [pos + n], [n], block_size)
        outs.append(
            ours.forward(
                torch.tensor(ids[pos : pos + n]),
                torch.arange(pos, pos + n),
                meta,
                kv,
                torch.arange(n),
            )
        )
        pos += n
    return torch.cat(outs)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])  # GQA ratio 1 and 3
@pytest.mark.parametrize("length", [37, 101])
def test_logits_match_transformers_fp32(heads, kv_heads, length):
    cfg, hf = _hf_tiny(heads, kv_heads)
    ours = _ours(cfg, hf)
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    whole = _run_chunks(ours, ids.tolist(), [length])
    assert _rel(whole, ref) < 1e-4
    chunked = _run_chunks(ours, ids.tolist(), [length // 3, 1, length - length // 3 - 1])
    assert _rel(chunked, ref) < 1e-4


def test_qwen2_qkv_bias_matches_transformers():
    cfg, hf = _hf_tiny(6, 2, qwen2=True)
    ours = _ours(cfg, hf)
    assert ours.layers[0].qkv.bias is not None
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    assert _rel(_run_chunks(ours, ids.tolist(), [45]), ref) < 1e-4


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    hf = LlamaForCausalLM(cfg).eval()
    ours = _ours(cfg, hf)
    assert ours.cfg.rope_scaling is not None
    ids = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    assert _rel(_run_chunks(ours, ids.tolist(), [150]), ref) < 1e-4


def test_bf16_rows_are_chunking_invariant():
    """The same prompt in different chunkings gives bitwise equal logits in bf16."""
    cfg, hf = _hf_tiny(6, 2, seed=5)
    ours = _ours(cfg, hf, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (203,), generator=torch.Generator().manual_seed(6))
    ids = ids.tolist()
    whole = _run_chunks(ours, ids, [203])
    for chunks in ([100, 103], [16, 1, 186], [64, 64, 64, 11], [202, 1]):
        got = _run_chunks(ours, ids, chunks, seed=len(chunks))
        assert torch.equal(got, whole), chunks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (3072, 576)])
def test_linear_rows_do_not_depend_on_the_call_size(dtype, out_f, in_f):
    """Every call of 1 to 300 rows gives each row the bits of a 300-row call, on inputs whose
    sums cancel (where any change of summation order shows after rounding; another seed than
    the probe's): in float32 through linear.c and in bf16 through linear_amx.c or linear.c
    (no slabs) where they are built, else in bf16 with the slab the probe chose (32 to 128
    rows) and its padding."""
    w, x = _cancelling_probe(out_f, in_f, 300, dtype, seed=7)
    lin = CPULinear(w, None, LINEAR_ROW_SLAB, LINEAR_MAX_SLAB)
    kernel = (
        cpu_linear.linear_f32_panel()
        if dtype == torch.float32
        else cpu_linear.linear_bf16_amx_available() or cpu_linear.linear_bf16_panel()
    )
    if kernel:
        assert lin.row_slab is None and lin.min_rows == 1
        sizes = list(range(1, 40)) + [95, 96, 97, 191, 192, 193, 255, 299]
    else:
        assert lin.row_slab in (32, 64, 128) and 1 <= lin.min_rows <= lin.row_slab
        sizes = list(range(1, 2 * lin.row_slab + 3)) + [255, 256, 257, 299]
    full = lin(x)
    for n in sizes:
        for part in (slice(0, n), slice(300 - n, 300)):
            got = lin(x[part])
            assert torch.equal(got, full[part]), (n, part, lin.row_slab, lin.min_rows)


@pytest.mark.skipif(not cpu_linear.linear_f32_panel(), reason="linear.c is not built here")
@pytest.mark.parametrize("out_f,in_f,bias", [(50, 70, True), (1000, 576, False), (33, 1536, True)])
def test_linear_f32_kernel_against_float64(out_f, in_f, bias):
    """linear.c's products, bias included, against float64 within float32 rounding of a
    sequential sum, for odd feature counts (partial panels), rows that span its row blocks and
    strided inputs; equal bits for a row alone and in the call."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(out_f, in_f, generator=gen)
    b = torch.randn(out_f, generator=gen) if bias else None
    wide = torch.randn(200, in_f + 9, generator=gen)
    x = wide[:, 3 : 3 + in_f]  # rows strided
    lin = CPULinear(w, b)
    got = lin(x)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    bound = 4 * in_f * 2**-24 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((got.double() - ref).abs() <= bound).all()
    for r in (0, 95, 96, 199):
        assert torch.equal(lin(x[r : r + 1]), got[r : r + 1])
    assert lin(x[:0]).shape == (0, out_f)


def _ggml_weight(kind: str, out_f: int, in_f: int, seed: int) -> torch.Tensor:
    """A float32 weight as llama.cpp's loader leaves it: random values quantized to ``kind``
    (Q4_1 or Q8_0) by the gguf package, then expanded to float32 the way the import does."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    kind_id = getattr(GGMLQuantizationType, kind)
    w = np.random.default_rng(seed).standard_normal((out_f, in_f)).astype(np.float32) * 0.05
    return torch.from_numpy(quants.dequantize(quants.quantize(w, kind_id), kind_id).copy())


@pytest.mark.skipif(not cpu_linear.linear_f32_panel(), reason="linear.c is not built here")
@pytest.mark.parametrize(
    "kind,out_f,in_f",
    [("Q4_1", 37, 800), ("Q4_1", 960, 576), ("Q8_0", 50, 1536), ("Q8_0", 16, 32), ("Q4_0", 40, 96)],
)
def test_quantized_weights_give_the_float32_panels_bits(kind, out_f, in_f):
    """A weight made of Q4_1 or Q8_0 blocks is packed in that form (a quarter or less of the
    bytes; Q4_0 blocks as Q8_0 ones) and gives, at every call size, strided rows and a bias
    included, the bits of the same weight in plain float32 panels; one value off its block's
    grid keeps it in float32."""
    w = _ggml_weight(kind, out_f, in_f, seed=5)
    bias = torch.randn(out_f, generator=torch.Generator().manual_seed(6))
    packed = cpu_linear.pack_linear_f32(w, quantized=True)
    plain = cpu_linear.pack_linear_f32(w, quantized=False)
    held = "q8_0" if kind == "Q4_0" else kind.lower()
    assert cpu_linear.weight_format(packed) == held
    assert cpu_linear.weight_format(plain) == "float32"
    assert packed.numel() * (3 if held == "q4_1" else 2) < plain.numel()
    wide = torch.randn(200, in_f + 5, generator=torch.Generator().manual_seed(7))
    x = wide[:, 2 : 2 + in_f]  # rows strided
    for n in [*range(1, 18), 28, 95, 96, 97, 200]:
        for b in (None, bias):
            got = cpu_linear.linear_f32(x[:n], packed, out_f, b)
            assert torch.equal(got, cpu_linear.linear_f32(x[:n], plain, out_f, b)), (n, b)
    off = w.clone()
    off[out_f // 2, in_f // 3] = torch.nextafter(off[out_f // 2, in_f // 3], torch.tensor(1.0))
    assert cpu_linear.weight_format(cpu_linear.pack_linear_f32(off, quantized=True)) == "float32"
    zero = w.clone()
    zero[out_f - 1, :32] = 0.0  # a block of zeros is d = 0
    assert cpu_linear.weight_format(cpu_linear.pack_linear_f32(zero, quantized=True)) == held
    zero[out_f - 1, 7] = -0.0  # whose expansion would be +0.0
    assert cpu_linear.weight_format(cpu_linear.pack_linear_f32(zero, quantized=True)) == "float32"
    with pytest.raises(ValueError, match="bad sizes"):
        cpu_linear.linear_f32(x[:3, : in_f - 1], packed, out_f)


@pytest.mark.parametrize("kernel", ["amx", "avx512"])
@pytest.mark.parametrize(
    "out_f,in_f,bias", [(50, 64, True), (1000, 576, False), (33, 1536, True), (16, 32, False)]
)
def test_linear_bf16_kernels_against_float64(kernel, out_f, in_f, bias):
    """The bf16 linear kernels' products (linear_amx.c on the tile unit, linear.c on
    AVX512-BF16), bias included, against float64 within one bf16 rounding plus float32
    summation, for feature counts short of whole panels or tiles, row counts short of whole
    register tiles (the AMX tail copied to a padded tile) and strided inputs; equal bits for
    a row alone, for a row in a call of any size, and for the call's rows in a reversed
    order."""
    if kernel == "amx" and not cpu_linear.linear_bf16_amx_available():
        pytest.skip("no AMX-BF16 tile unit here")
    if kernel == "avx512" and not cpu_linear.linear_bf16_panel():
        pytest.skip("linear.c's bf16 kernel is not built here (no AVX512-BF16)")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(out_f, in_f, generator=gen).bfloat16()
    b = torch.randn(out_f, generator=gen).bfloat16() if bias else None
    wide = torch.randn(101, in_f + 9, generator=gen).bfloat16()
    x = wide[:, 3 : 3 + in_f]  # rows strided
    if kernel == "amx":
        lin = CPULinear(w, b)
        assert lin._tiles is not None and lin.weight is None
    else:
        packed = cpu_linear.pack_linear_bf16(w)
        bias32 = None if b is None else b.float()

        def lin(v):
            return cpu_linear.linear_bf16(v, packed, out_f, bias32)

    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (101, out_f)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    mag = x.double().abs() @ w.double().abs().T
    bound = 2**-8 * ref.abs() + 4 * in_f * 2**-24 * mag + 1e-30
    assert ((got.double() - ref).abs() <= bound).all()
    for r in (0, 7, 8, 15, 16, 31, 32, 47, 100):
        assert torch.equal(lin(x[r : r + 1]), got[r : r + 1])
    for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 97, 100):
        assert torch.equal(lin(x[101 - n :]), got[101 - n :])
    assert torch.equal(lin(x.flip(0)), got.flip(0))
    assert lin(x[:0]).shape == (0, out_f)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units in the last place."""
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


@pytest.mark.skipif(
    cpu_elementwise.elementwise_library() is None,
    reason="the element-wise kernels do not build here",
)
def test_fused_elementwise_steps_match_torch_and_keep_rows_apart():
    """add_rms_norm in bf16 adds the residual with torch's rounding (the same bits) and
    normalizes within one bf16 step of layers.rms_norm; silu_mul within one step of
    torch's silu(gate) * up; a row alone gets the bits it gets in the call."""
    from inference.model.layers import rms_norm

    gen = torch.Generator().manual_seed(11)
    n, d, inter = 37, 576, 1536
    h = (torch.randn(n, d, generator=gen) * 3).bfloat16()
    delta = torch.randn(n, d, generator=gen).bfloat16()
    w = (torch.rand(d, generator=gen) + 0.5).bfloat16()
    h_ref = h + delta
    x_ref = rms_norm(h_ref, w, 1e-5)
    h_ours = h.clone()
    x = cpu_elementwise.add_rms_norm(h_ours, delta, w, 1e-5)
    assert torch.equal(h_ours, h_ref)
    assert _ulps_apart(x, x_ref) <= 1
    assert torch.equal(cpu_elementwise.add_rms_norm(h_ref.clone(), None, w, 1e-5), x)
    for r in (0, 17, 36):
        one = h[r : r + 1].clone()
        assert torch.equal(
            cpu_elementwise.add_rms_norm(one, delta[r : r + 1], w, 1e-5), x[r : r + 1]
        )

    gu = (torch.randn(n, 2 * inter, generator=gen) * 4).bfloat16()
    gu[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 60.0, -60.0, 100.0, -100.0])
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    got = cpu_elementwise.silu_mul(gu, inter)
    assert _ulps_apart(got, ref) <= 1
    assert torch.equal(cpu_elementwise.silu_mul(gu[5:6], inter), got[5:6])


def _rotary_config() -> ModelConfig:
    """A one-layer config with 3 query heads and 1 KV head of 32 dims, 256 positions."""
    return ModelConfig(
        vocab_size=32,
        hidden_size=96,
        intermediate_size=64,
        num_layers=1,
        num_heads=3,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )


@pytest.mark.skipif(
    cpu_elementwise.elementwise_library() is None,
    reason="the element-wise kernels do not build here",
)
def test_fused_rotary_and_store_match_torch():
    """rotary_store in bf16 rotates query and key heads at least as close to float64 as
    RotaryTable.apply (which rounds after each product and sum; the kernel rounds once), and
    within one bf16 step of the float64 result; stores each token's
    rotated key and its value in its slot, leaves other slots and values untouched, and skips
    tokens whose slot is -1."""
    cfg = _rotary_config()
    from inference.model.layers import RotaryTable

    rot = RotaryTable(cfg, 256, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    n, heads, kvh, d = 9, 3, 1, 32
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=gen).bfloat16()
    positions = torch.tensor([0, 1, 2, 50, 51, 200, 7, 8, 255])
    slots = torch.tensor([3, 4, 5, -1, 17, 30, 0, 1, 31])
    k_cache = torch.zeros(4, 8, kvh, d, dtype=torch.bfloat16)
    v_cache = torch.zeros(4, 8, kvh, d, dtype=torch.bfloat16)
    ref = rot.apply(qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d), rot.gather(positions))
    got = qkv.clone()
    cpu_elementwise.rotary_store(
        got, heads, kvh, positions, rot.cos, rot.sin, slots, k_cache, v_cache
    )
    x = qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d).double()
    c = rot.cos[positions].double().unsqueeze(1)
    s_ = rot.sin[positions].double().unsqueeze(1)
    exact = x * c + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * s_
    ours = got[:, : (heads + kvh) * d].reshape(n, heads + kvh, d).double()
    assert (ours - exact).abs().max() <= (ref.double() - exact).abs().max()
    assert ((ours - exact).abs() <= 2**-8 * exact.abs() + 1e-30).all()
    assert torch.equal(got[:, (heads + kvh) * d :], qkv[:, (heads + kvh) * d :])
    flat_k, flat_v = k_cache.view(32, kvh * d), v_cache.view(32, kvh * d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], got[t, heads * d : (heads + kvh) * d])
            assert torch.equal(flat_v[s], qkv[t, (heads + kvh) * d :])
    untouched = [s for s in range(32) if s not in slots.tolist()]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.skipif(
    cpu_elementwise.elementwise_library() is None,
    reason="the element-wise kernels do not build here",
)
def test_fused_elementwise_steps_in_float32_match_torch_and_keep_rows_apart():
    """In float32: add_rms_norm adds the residual exactly as torch does and normalizes within
    a few units in the last place of layers.rms_norm, silu_mul of F.silu(g) * u, rotary_store
    of RotaryTable.apply, with the rotated keys and the values in their slots; a row alone
    gets the bits it gets in a call of many."""
    from inference.model.layers import RotaryTable, rms_norm

    gen = torch.Generator().manual_seed(12)
    n, d, inter = 37, 576, 1536
    h = torch.randn(n, d, generator=gen) * 3
    delta = torch.randn(n, d, generator=gen)
    w = torch.rand(d, generator=gen) + 0.5
    h_ref = h + delta
    h_ours = h.clone()
    x = cpu_elementwise.add_rms_norm(h_ours, delta, w, 1e-5)
    assert torch.equal(h_ours, h_ref)
    torch.testing.assert_close(x, rms_norm(h_ref, w, 1e-5), rtol=4e-7, atol=0)
    assert torch.equal(cpu_elementwise.add_rms_norm(h_ref.clone(), None, w, 1e-5), x)
    for r in (0, 17, 36):
        one = h[r : r + 1].clone()
        assert torch.equal(
            cpu_elementwise.add_rms_norm(one, delta[r : r + 1], w, 1e-5), x[r : r + 1]
        )

    gu = torch.randn(n, 2 * inter, generator=gen) * 4
    gu[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 60.0, -60.0, 100.0, -100.0])
    got = cpu_elementwise.silu_mul(gu, inter)
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-30)
    assert torch.equal(cpu_elementwise.silu_mul(gu[5:6], inter), got[5:6])
    odd = torch.randn(3, 2 * 13, generator=gen) * 4  # a row's last elements past whole vectors
    torch.testing.assert_close(
        cpu_elementwise.silu_mul(odd, 13),
        torch.nn.functional.silu(odd[:, :13]) * odd[:, 13:],
        rtol=1e-6,
        atol=1e-30,
    )

    cfg = _rotary_config()
    rot = RotaryTable(cfg, 256, torch.float32)
    heads, kvh, hd = 3, 1, 32
    qkv = torch.randn(9, (heads + 2 * kvh) * hd, generator=gen)
    positions = torch.tensor([0, 1, 2, 50, 51, 200, 7, 8, 255])
    slots = torch.tensor([3, 4, 5, -1, 17, 30, 0, 1, 31])
    k_cache = torch.zeros(4, 8, kvh, hd)
    v_cache = torch.zeros(4, 8, kvh, hd)
    qk = (heads + kvh) * hd
    ref = rot.apply(qkv[:, :qk].view(9, heads + kvh, hd), rot.gather(positions))
    got = qkv.clone()
    cpu_elementwise.rotary_store(
        got, heads, kvh, positions, rot.cos, rot.sin, slots, k_cache, v_cache
    )
    torch.testing.assert_close(got[:, :qk].view(9, heads + kvh, hd), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[:, qk:], qkv[:, qk:])
    flat_k, flat_v = k_cache.view(32, kvh * hd), v_cache.view(32, kvh * hd)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], got[t, heads * hd : qk])
            assert torch.equal(flat_v[s], qkv[t, qk:])
    untouched = [s for s in range(32) if s not in slots.tolist()]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    one = qkv[5:6].clone()
    cpu_elementwise.rotary_store(
        one, heads, kvh, positions[5:6], rot.cos, rot.sin, torch.tensor([-1]), k_cache, v_cache
    )
    assert torch.equal(one, got[5:6])


@pytest.mark.skipif(
    cpu_elementwise.elementwise_library() is None,
    reason="the element-wise kernels do not build here",
)
def test_argmax_rows_gives_torch_argmax():
    """The engine's greedy tokens (``cpu_elementwise.argmax_rows``, elementwise.c) are
    ``torch.argmax``'s for every row: the first of tied maxima (0.0 and -0.0 tied), the first
    NaN in a row that holds one, index 0 in a row of -inf, ties and NaNs in the vector part and
    in the tail past the last 16 values, strided rows, and row counts from 0 to 33."""
    gen = torch.Generator().manual_seed(11)
    for n in (1, 5, 16, 17, 31, 32, 100, 49152):
        for m in (0, 1, 2, 7, 33):
            wide = torch.randn(m, n + 7, generator=gen)
            x = wide[:, 3 : 3 + n]  # rows strided
            if m and n > 1:
                x[0, n // 3] = x[0, n - 1] = 1e4  # a tie: the first wins
                x[1 % m, :] = float("-inf")
                x[m - 1, n - 1] = float("nan")  # a NaN in the tail
                if m > 2:
                    x[2, n // 2] = float("nan")  # two NaNs: the first wins
                    x[2, n - 1] = float("nan")
                if m > 3:
                    x[3, :] = -1.0
                    x[3, n // 2] = -0.0
                    x[3, n - 1] = 0.0  # -0.0 and 0.0 tie: the first wins
            assert cpu_elementwise.argmax_rows(x) == torch.argmax(x, dim=-1).tolist(), (m, n)
