"""Batch-invariant products and norms for the GPU: a row's result never depends on how many rows
are computed with it.

A vendor product picks its tiling, and whether to split the reduction over K, by the number of
rows, so the same row's output changes with the batch: a cache hit (fewer prompt rows), another
request in the step or another chunking then change the logits. These kernels fix the order:

- ``linear``: ``y = x @ w.T (+ b)`` by a persistent kernel (one program per multiprocessor,
  walking the output tiles), one tile configuration per dtype (``LINEAR_CONFIGS``, pinned) and
  no split-K: each output element is the sum over K in tiles of ``BLOCK_K``, in order, by the
  same instruction shape whatever the number of rows (rows past the input's read zeros and are
  not stored).
- ``add_rms_norm``: the residual add and RMSNorm, one row per program, its sum of squares over
  the row in one fixed order.

On a GPU ``1 / tl.sqrt`` is the fast square root and division (``sqrt.approx``,
``div.full``): a norm's bits differ from torch's by a rounding or so, and are the same for a
row whatever the batch. On a machine without a GPU they run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference.device import parallel_units
from inference.kernels.triton.common import Launch
from inference.model.layers import TorchLinear

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) per dtype width: 16-bit in the shape of
# Triton's matmul tutorial's Hopper configuration; fp32 (checks) smaller
LINEAR_CONFIGS = {"16": (128, 128, 64, 8, 8, 3), "32": (64, 64, 32, 8, 4, 2)}


def _num_programs(device: torch.device, tiles: int) -> int:
    """One program per multiprocessor (the interpreter: a few), none idle."""
    return max(1, min(tiles, parallel_units(device)))


@triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    NUM_PROGRAMS,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(pid, tiles_m * tiles_n, NUM_PROGRAMS):
        # grouped order (GROUP_M row tiles share each column tile's weights in cache); which
        # program computes a tile never changes its sums
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        tm = first_m + (tile % (GROUP_M * tiles_n)) % size_m
        tn = (tile % (GROUP_M * tiles_n)) // size_m
        rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                w_ptr + rn[None, :] * stride_wn + rk[:, None],
                mask=(rn[None, :] < N) & (rk[:, None] < K),
                other=0.0,
            )
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


def linear_launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, Launch | None]:
    """The output [M, N] and the launch of ``linear`` (None for no rows)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("linear: x and weight must be contiguous in their last dimension")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y, None
    bm, bn, bk, gm, warps, stages = LINEAR_CONFIGS["32" if x.dtype == torch.float32 else "16"]
    tiles = -(-m // bm) * -(-n // bn)
    programs = _num_programs(x.device, tiles)
    args = (x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0),
            weight.stride(0), y.stride(0), programs)  # fmt: skip
    kwargs = dict(
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=gm,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
        enable_fp_fusion=True,
    )
    return y, Launch(_linear_kernel, (programs,), args, kwargs)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x`` [M, K] (rows dense) times ``weight`` [N, K] transposed, plus ``bias`` [N]: [M, N]
    in x's dtype, each row's bits independent of M (module docstring)."""
    y, launch = linear_launch(x, weight, bias)
    if launch is not None:
        launch()
    return y


class InvariantLinear(TorchLinear):
    """A linear layer through ``linear`` (``layers.TorchLinear``'s interface and storage)."""

    kind = "triton-invariant"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.contiguous(), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x if x.stride(-1) == 1 else x.contiguous(), self.weight, self.bias)


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    d_ptr,
    w_ptr,
    out_ptr,
    stride_h,
    stride_d,
    stride_o,
    H,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        h = h + tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    x = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * inv).to(h.dtype)  # rounded to the activations' dtype, then weighted
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, w * normed, mask=mask)


def add_rms_norm_launch(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, Launch | None]:
    """The output and the launch of ``add_rms_norm`` (None for no rows)."""
    n, width = h.shape
    out = torch.empty_like(h)
    if n == 0:
        return out, None
    args = (h, delta if delta is not None else h, weight, out, h.stride(0),
            delta.stride(0) if delta is not None else 0, out.stride(0), width, eps)  # fmt: skip
    kwargs = dict(
        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(width), enable_fp_fusion=True
    )
    return out, Launch(_add_rms_norm_kernel, (n,), args, kwargs)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``h += delta`` (in place), then each row's RMSNorm times ``weight``: one row per program
    (the ops table's ``add_rms_norm``)."""
    out, launch = add_rms_norm_launch(h, delta, weight, eps)
    if launch is not None:
        launch()
    return out
