"""What the Triton kernels share: a launch as data, the wrappers' input checks, and reading
8-bit KV caches.

A launch is a ``Launch`` (kernel, grid, arguments, compile options): each wrapper builds one
with its ``*_launch`` function and runs it, and ``aot.py`` compiles the same launches for GPU
targets ahead of time, so what is compiled in the tests is what the runners launch.

Compile options every launch states (``Launch.kwargs``):

- ``enable_fp_fusion``: whether the GPU compiler may contract a multiply and an add into one
  FMA. Off for the attention kernels: a prefill tile with the causal mask and one without it
  must round a key's score the same way, or a row's bits would depend on where its query tile
  starts (chunking, cache hits); with fusion off, every multiply and add rounds as written, as
  under the interpreter. On for the rest, whose every row runs the same instructions.
- ``do_not_specialize`` (on the kernels): integer arguments that change from step to step (row
  counts, block-table widths, partition counts) are not specialised on (``== 1``, ``% 16``),
  so no step compiles a new variant while serving.

8-bit caches (``inference/kv_quant.py``) are passed as their bytes (uint8): int8 values
bitcast back, fp8 e4m3 decoded by ``e4m3_to_float`` (exact, and the same on every target:
sm_80 has no fp8 conversion).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from inference import kv_quant

MIN_DOT = 16  # tl.dot's smallest M, N and K for 16-bit inputs on a GPU
LAUNCHES: Counter[str] = Counter()  # kernel launches per entry point (tests, benchmarks)


class Launch(NamedTuple):
    """One kernel launch: ``kernel[grid](*args, **kwargs)``; kwargs hold the constexprs and
    the compile options (num_warps, num_stages, enable_fp_fusion)."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of a K/V cache pair, or ValueError."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    nb, bs, kvh, d = k_cache.shape
    if kv_quant.is_kv8(k_cache.dtype):
        for c in (k_cache, v_cache):
            sc, inv = kv_quant.scales_of(c)
            if sc.shape != (kvh, d) or not sc.is_contiguous() or not inv.is_contiguous():
                raise ValueError(f"an 8-bit cache's scales must be [{kvh}, {d}], contiguous")
    check_block_size(bs)
    return nb, bs, kvh, d


def check_block_size(block_size: int) -> None:
    """Keys are read a whole block at a time by ``tl.dot``, which takes at least 16."""
    if block_size < MIN_DOT or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two >= {MIN_DOT} for the Triton kernels, "
            f"got {block_size}"
        )


def check_int(t: torch.Tensor, name: str, dim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-d int32/int64 tensor, got {t.dtype} {t.dim()}-d")


def check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    rows: str,
) -> tuple[int, int, int, torch.Tensor]:
    """Shapes, strides and dtypes shared by both attention entry points; returns
    (block_size, num_kv_heads, head_dim, out)."""
    _, bs, kvh, d = check_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % kvh:
        raise ValueError(
            f"q must be [{rows}, num_heads, {d}] with num_heads a multiple of {kvh}, "
            f"got {tuple(q.shape)}"
        )
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim")
    if q.dtype != k_cache.dtype and not kv_quant.is_kv8(k_cache.dtype):
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    check_int(block_tables, "block_tables", 2)
    check_int(seq_lens, "seq_lens", 1)
    if block_tables.shape[0] != seq_lens.numel():
        raise ValueError("block_tables needs one row per sequence")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)}, contiguous in head_dim")
    return bs, kvh, d, out


def kv8_args(k_cache: torch.Tensor, v_cache: torch.Tensor, inverse: bool = False):
    """(KV8 code, K cache, V cache, K scales, V scales) as the kernels take them: the code is
    0 for a 16/32-bit cache (the caches stand in for the scales, never read), 1 for int8, 2 for
    fp8, an 8-bit cache passed as its bytes (uint8); ``inverse``: the reciprocal scales (the
    store's)."""
    code = kv_quant.FORMAT_CODE.get(k_cache.dtype, 0)
    if not code:
        return 0, k_cache, v_cache, k_cache, v_cache
    i = 1 if inverse else 0
    k_sc, v_sc = kv_quant.scales_of(k_cache)[i], kv_quant.scales_of(v_cache)[i]
    return code, kv_quant.raw(k_cache), kv_quant.raw(v_cache), k_sc, v_sc


@triton.jit
def e4m3_to_float(bits):
    """fp8 e4m3 bytes (uint8) as float32, exactly: the byte's exponent and mantissa placed in
    an fp16 (exponent bias 15 against e4m3's 7, subnormals included), times 2^8."""
    b = bits.to(tl.uint16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def head_scales(k_scale_ptr, v_scale_ptr, kvh, d, d_mask, D: tl.constexpr,
                BLOCK_D: tl.constexpr, KV8: tl.constexpr):  # fmt: skip
    """KV head kvh's K and V scales [BLOCK_D] (an 8-bit cache's; zeros, never read, else)."""
    if KV8 != 0:
        k_sc = tl.load(k_scale_ptr + kvh * D + d, mask=d_mask, other=0.0)
        v_sc = tl.load(v_scale_ptr + kvh * D + d, mask=d_mask, other=0.0)
    else:
        k_sc = tl.zeros([BLOCK_D], dtype=tl.float32)
        v_sc = k_sc
    return k_sc, v_sc


@triton.jit
def dequantize(x, scale, KV8: tl.constexpr, out_ty: tl.constexpr):
    """A block [keys, D] of the cache as out_ty: 16/32-bit as it is, 8-bit bytes times their
    channels' scales [D] (exact: powers of two)."""
    if KV8 == 0:  # one return: Triton compiles what follows a return in a constexpr branch
        out = x
    elif KV8 == 2:
        out = (e4m3_to_float(x) * scale[None, :]).to(out_ty)
    else:
        out = (x.to(tl.int8, bitcast=True).to(tl.float32) * scale[None, :]).to(out_ty)
    return out
