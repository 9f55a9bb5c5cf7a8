"""Writing K/V into the paged cache: ``store_kv`` scatters each new token's key and value heads
into its slot (slot -1: not stored), and ``quantize`` turns them into an 8-bit cache's bytes.

8-bit caches (``inference/kv_quant.py``) are written with each channel's reciprocal scale:
int8 rounds half to even and clamps to +-127; fp8 e4m3 clamps to +-448 and rounds to the
nearest even, its bits written out by hand (``e4m3_bits``), so every target and the
interpreter give torch's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference.kernels.triton.common import (
    LAUNCHES,
    Launch,
    check_cache,
    check_int,
    kv8_args,
    pow2,
)


@triton.jit
def e4m3_bits(v):
    """float32 v (|v| <= 448) as fp8 e4m3 bits, nearest even, subnormals kept: the bit steps
    of torch's conversion (csrc/elementwise.c has the same), written out so that every
    backend of Triton, its interpreter included, gives the same bits."""
    u = v.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    u = u ^ sign
    odd = (u >> 20) & 1
    normal = (u - (120 << 23) + 0x7FFFF + odd) >> 20
    magic = 141 << 23  # 2^14: adding it rounds a subnormal's bits into place
    f = u.to(tl.float32, bitcast=True) + 16384.0
    sub = f.to(tl.uint32, bitcast=True) - magic
    bits = tl.where(u < (121 << 23), sub, normal) | (sign >> 24)
    return (bits & 0xFF).to(tl.uint8)


@triton.jit
def quantize(x, inv, KV8: tl.constexpr):
    """float32 x times its reciprocal scales as the cache's byte (uint8: int8 values or fp8
    e4m3 bits; the cache is passed as its bytes, ``common.kv8_args``)."""
    v = x * inv  # exact: inv is a power of two
    if KV8 == 1:  # int8: round half to even by the float32 magic number, then clamp
        v = (v + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        q = e4m3_bits(tl.minimum(tl.maximum(v, -448.0), 448.0))
    return q


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_inv_ptr,  # 8-bit caches: [KVH, D] reciprocal scales
    v_inv_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < KVH) & (d < D)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        dst = slot * (KVH * D) + h * D + d
        if KV8 != 0:
            k_inv = tl.load(k_inv_ptr + h * D + d, mask=mask, other=1.0)
            v_inv = tl.load(v_inv_ptr + h * D + d, mask=mask, other=1.0)
            tl.store(k_cache_ptr + dst, quantize(k.to(tl.float32), k_inv, KV8), mask=mask)
            tl.store(v_cache_ptr + dst, quantize(v.to(tl.float32), v_inv, KV8), mask=mask)
        else:
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_launch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
) -> Launch | None:
    """``store_kv``'s launch, its inputs checked; None when there is nothing to store."""
    nb, bs, kvh, d = check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != (kvh, d):
        raise ValueError(
            f"key and value must be [num_tokens, {kvh}, {d}], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in head_dim")
    check_int(slot_mapping, "slot_mapping", 1)
    if slot_mapping.numel() != key.shape[0]:
        raise ValueError("slot_mapping needs one slot per token")
    n = key.shape[0]
    if n == 0:
        return None
    kv8, kc, vc, k_inv, v_inv = kv8_args(k_cache, v_cache, inverse=True)
    args = (key, value, kc, vc, slot_mapping, k_inv, v_inv)
    args += (key.stride(0), key.stride(1), value.stride(0), value.stride(1))
    kwargs = dict(KVH=kvh, D=d, BLOCK_H=pow2(kvh), BLOCK_D=pow2(d), KV8=kv8, enable_fp_fusion=True)
    return Launch(_store_kv_kernel, (n,), args, kwargs)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write each token's key and value heads into its slot (``store_kv_launch``)."""
    launch = store_kv_launch(key, value, k_cache, v_cache, slot_mapping)
    if launch is not None:
        LAUNCHES["store_kv"] += 1
        launch()
