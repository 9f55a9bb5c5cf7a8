"""Fused element-wise steps for the GPU, one program per token: fewer kernels a layer than
torch's operations (rotary embedding, the K/V store and SiLU-mul are one launch each instead of
several), and each row computed from its own inputs alone (batch-invariant).

- ``rotary_store``: rotary embedding of the query and key heads in place in the qkv rows, and
  each token's key and value heads stored in its cache slot (slot -1: not stored; 8-bit caches
  quantized with their scales, as ``kv_store.store_kv`` does).
- ``silu_mul``: ``silu(gate) * up`` of each row of the gate/up product.

The residual add with RMSNorm is ``invariant.add_rms_norm`` (one row per program too).

On a GPU the compiler contracts multiplies and adds into FMAs here and ``tl.exp`` and ``/`` are
its fast approximations (``ex2.approx``, ``div.full``): a row's bits differ from torch's by a
rounding or so, and are the same whatever else the step holds, which is the promise that
matters (a cache hit never changes an answer). Under the interpreter they round as written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference.kernels.triton.common import Launch, kv8_args
from inference.kernels.triton.kv_store import quantize


@triton.jit
def _rotary_store_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_inv_ptr,  # 8-bit caches: [KVH, D] reciprocal scales
    v_inv_ptr,
    stride_t,
    NH: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= NH + KVH
    BLOCK_KV: tl.constexpr,  # >= KVH
    BLOCK_HALF: tl.constexpr,  # >= D // 2
    KV8: tl.constexpr,
):
    t = tl.program_id(0)
    HALF = D // 2
    row = qkv_ptr + t * stride_t
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    m = (h < NH + KVH) & (i < HALF)
    x1 = tl.load(row + h * D + i, mask=m, other=0.0)
    x2 = tl.load(row + h * D + HALF + i, mask=m, other=0.0)
    c1 = tl.load(cos_ptr + pos * D + i, mask=i < HALF, other=0.0)
    c2 = tl.load(cos_ptr + pos * D + HALF + i, mask=i < HALF, other=0.0)
    s1 = tl.load(sin_ptr + pos * D + i, mask=i < HALF, other=0.0)
    s2 = tl.load(sin_ptr + pos * D + HALF + i, mask=i < HALF, other=0.0)
    o1 = (x1 * c1 - x2 * s1).to(x1.dtype)
    o2 = (x2 * c2 + x1 * s2).to(x1.dtype)
    tl.store(row + h * D + i, o1, mask=m)
    tl.store(row + h * D + HALF + i, o2, mask=m)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        # the key heads: rows NH .. NH + KVH of the rotated ones
        km = m & (h >= NH)
        kdst = slot * (KVH * D) + (h - NH) * D + i
        if KV8 != 0:
            inv1 = tl.load(k_inv_ptr + (h - NH) * D + i, mask=km, other=1.0)
            inv2 = tl.load(k_inv_ptr + (h - NH) * D + HALF + i, mask=km, other=1.0)
            tl.store(k_cache_ptr + kdst, quantize(o1.to(tl.float32), inv1, KV8), mask=km)
            tl.store(k_cache_ptr + kdst + HALF, quantize(o2.to(tl.float32), inv2, KV8), mask=km)
        else:
            tl.store(k_cache_ptr + kdst, o1.to(k_cache_ptr.dtype.element_ty), mask=km)
            tl.store(k_cache_ptr + kdst + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=km)
        vh = tl.arange(0, BLOCK_KV)[:, None]
        d = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        vm = (vh < KVH) & (d < D)
        v = tl.load(row + (NH + KVH) * D + vh * D + d, mask=vm, other=0.0)
        vdst = slot * (KVH * D) + vh * D + d
        if KV8 != 0:
            vinv = tl.load(v_inv_ptr + vh * D + d, mask=vm, other=1.0)
            tl.store(v_cache_ptr + vdst, quantize(v.to(tl.float32), vinv, KV8), mask=vm)
        else:
            tl.store(v_cache_ptr + vdst, v.to(v_cache_ptr.dtype.element_ty), mask=vm)


def rotary_store_launch(
    qkv: torch.Tensor,  # [N, (heads + 2 kv heads) * d], rows dense in their last dimension
    positions: torch.Tensor,  # [N] int64
    cos: torch.Tensor,  # [max positions, d], qkv's dtype
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    slots: torch.Tensor,  # [N] int64, -1: not stored
    k_cache: torch.Tensor,  # [blocks, block_size, kv heads, d]
    v_cache: torch.Tensor,
) -> Launch | None:
    """``rotary_store``'s launch, its inputs checked; None for no rows."""
    n, d = qkv.shape[0], cos.shape[1]
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"rotary_store: qkv {tuple(qkv.shape)} for {num_heads} heads of {d}")
    if not n:
        return None
    kv8, kc, vc, k_inv, v_inv = kv8_args(k_cache, v_cache, inverse=True)
    args = (qkv, positions, cos, sin, slots, kc, vc, k_inv, v_inv, qkv.stride(0))
    kwargs = dict(
        NH=num_heads,
        KVH=num_kv_heads,
        D=d,
        BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        KV8=kv8,
        enable_fp_fusion=True,
    )
    return Launch(_rotary_store_kernel, (n,), args, kwargs)


def rotary_store(qkv, positions, cos, sin, num_heads, num_kv_heads, slots, k_cache, v_cache):
    """Rotate q and k in place and store k and v (module docstring); returns q [N, heads, d]."""
    launch = rotary_store_launch(
        qkv, positions, cos, sin, num_heads, num_kv_heads, slots, k_cache, v_cache
    )
    if launch is not None:
        launch()
    n, d = qkv.shape[0], cos.shape[1]
    return qkv[:, : num_heads * d].view(n, num_heads, d)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, INTER, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < INTER
    g = tl.load(gu_ptr + r * stride_g + c, mask=m, other=0.0)
    u = tl.load(gu_ptr + r * stride_g + INTER + c, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu in float32, rounded to g's dtype
    tl.store(out_ptr + r * stride_o + c, act * u, mask=m)


def silu_mul_launch(gu: torch.Tensor, inter: int) -> tuple[torch.Tensor, Launch | None]:
    """The output [N, inter] and the launch of ``silu_mul`` (None for no rows)."""
    n = gu.shape[0]
    out = torch.empty((n, inter), dtype=gu.dtype, device=gu.device)
    if not n:
        return out, None
    block = min(1024, triton.next_power_of_2(inter))
    args = (gu, out, gu.stride(0), out.stride(0), inter)
    grid = (n, triton.cdiv(inter, block))
    return out, Launch(_silu_mul_kernel, grid, args, dict(BLOCK=block, enable_fp_fusion=True))


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gu[:, :inter]) * gu[:, inter:]`` (the ops table's ``silu_mul``)."""
    out, launch = silu_mul_launch(gu, inter)
    if launch is not None:
        launch()
    return out
