"""The fused element-wise steps of ``csrc/elementwise.c`` (bf16 and float32): residual add
with RMSNorm, SiLU times up, rotary embedding with the K/V store, and greedy tokens. Each row
is computed from its own inputs alone.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from inference import kv_quant
from inference.kernels.cpu.build import CSRC, KernelBuildError, build, kernels_enabled

log = logging.getLogger("docqa.engine")

ELEMENTWISE_SOURCE = CSRC / "elementwise.c"


@functools.cache
def elementwise_library() -> ctypes.CDLL | None:
    """The compiled fused element-wise steps (bf16 and float32), or None where they do not
    build."""
    if not kernels_enabled():
        return None
    try:
        lib = ctypes.CDLL(str(build(ELEMENTWISE_SOURCE)))
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("fused element-wise kernels unavailable, using torch's: %s", e)
        return None
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for suffix in ("bf16", "f32"):
        fn = getattr(lib, f"docqa_add_rms_norm_{suffix}")
        fn.argtypes, fn.restype = [p, i64, p, i64, p, p, i64, i, i, f, i], i
        fn = getattr(lib, f"docqa_silu_mul_{suffix}")
        fn.argtypes, fn.restype = [p, i64, i, i, p, i64, i], i
        fn = getattr(lib, f"docqa_rotary_store_{suffix}")
        fn.argtypes, fn.restype = [p, i64, i, i, i, i, p, p, p, p, p, p, i], i
    for suffix in ("bf16", "f32"):
        fn = getattr(lib, f"docqa_rotary_store_{suffix}_kv8")
        fn.argtypes, fn.restype = [p, i64, i, i, i, i, p, p, p, p, p, p, p, p, i, i], i
    lib.docqa_argmax_f32.argtypes, lib.docqa_argmax_f32.restype = [p, i, i, i64, p, i], i
    return lib


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's ``torch.argmax`` (the first of equal maxima, the first NaN where a row has
    one) for float32 logits on the CPU, through elementwise.c where it builds, else torch's."""
    lib = elementwise_library()
    if (
        lib is None
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[1] == 0
        or x.stride(1) != 1
    ):
        return torch.argmax(x, dim=-1).tolist()
    m, n = x.shape
    out = torch.empty(m, dtype=torch.int64)
    rc = lib.docqa_argmax_f32(
        x.data_ptr(), m, n, x.stride(0) if m > 1 else n, out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"argmax kernel: bad sizes {tuple(x.shape)}")
    return out.tolist()


_ELEMENTWISE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@functools.cache
def _elementwise(name: str, dtype: torch.dtype):
    """The compiled step ``name`` for ``dtype`` (looked up once: it is called every layer)."""
    return getattr(elementwise_library(), f"docqa_{name}_{_ELEMENTWISE_SUFFIX[dtype]}")


def fused_elementwise_supports(dtype: torch.dtype, hidden_size: int) -> bool:
    """Whether ``add_rms_norm``, ``silu_mul`` and ``rotary_store`` take activations of this
    dtype and width here (bf16 or float32, a multiple of 16 wide)."""
    return (
        dtype in _ELEMENTWISE_SUFFIX and hidden_size % 16 == 0 and elementwise_library() is not None
    )


def add_rms_norm(
    h: torch.Tensor,  # [n, d] bf16 or float32, the residual stream: updated in place with delta
    delta: torch.Tensor | None,  # [n, d], h's dtype
    weight: torch.Tensor,  # [d], h's dtype
    eps: float,
) -> torch.Tensor:
    """``h += delta`` (in bf16 rounded to bf16), then RMSNorm of each row of h with
    ``weight``, as ``layers.rms_norm`` computes it; one pass per row."""
    n, d = h.shape
    if delta is not None:
        assert delta.shape == h.shape and delta.dtype == h.dtype and delta.stride(1) == 1
    assert weight.dtype == h.dtype
    w = weight.contiguous()
    x = h.new_empty(n, d)
    rc = _elementwise("add_rms_norm", h.dtype)(
        h.data_ptr(),
        h.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        w.data_ptr(),
        x.data_ptr(),
        d,
        n,
        d,
        eps,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"add_rms_norm: bad shape {tuple(h.shape)}")
    return x


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """[n, 2 * inter] bf16 or float32 (gate, then up) -> silu(gate) * up, [n, inter] (in bf16
    rounded once)."""
    n = gu.shape[0]
    assert gu.shape[1] == 2 * inter and gu.stride(1) == 1
    out = gu.new_empty(n, inter)
    rc = _elementwise("silu_mul", gu.dtype)(
        gu.data_ptr(), gu.stride(0), n, inter, out.data_ptr(), inter, torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"silu_mul: bad shape {tuple(gu.shape)}")
    return out


def rotary_store(
    qkv: torch.Tensor,  # [n, (heads + 2 kv heads) * d] bf16 or float32, rows dense: q and k
    # rotated in place
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,  # [n] int64
    cos: torch.Tensor,  # [max positions, d], qkv's dtype
    sin: torch.Tensor,
    slots: torch.Tensor,  # [n] int64, the token's cache slot (block * block_size + offset), -1 none
    k_cache: torch.Tensor,  # [blocks, block_size, kv heads, d], qkv's dtype or 8-bit (bf16 qkv)
    v_cache: torch.Tensor,
) -> None:
    """Rotary embedding of the query and key heads in place, then each token's key and value
    heads stored in its cache slot: one pass per token. An 8-bit cache (``kv_quant``) stores
    them quantized with its layer's scales."""
    n = qkv.shape[0]
    d = cos.shape[1]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d
    assert cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and positions.dtype == slots.dtype == torch.int64
    assert cos.dtype == sin.dtype == qkv.dtype and k_cache.dtype == v_cache.dtype
    args = [
        qkv.data_ptr(),
        qkv.stride(0),
        n,
        num_heads,
        num_kv_heads,
        d,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
    ]
    if kv_quant.is_kv8(k_cache.dtype):
        k_inv, v_inv = kv_quant.scales_of(k_cache)[1], kv_quant.scales_of(v_cache)[1]
        fn = getattr(
            elementwise_library(), f"docqa_rotary_store_{_ELEMENTWISE_SUFFIX[qkv.dtype]}_kv8"
        )
        args += [k_inv.data_ptr(), v_inv.data_ptr(), kv_quant.FORMAT_CODE[k_cache.dtype]]
    else:
        assert k_cache.dtype == qkv.dtype
        fn = _elementwise("rotary_store", qkv.dtype)
    rc = fn(*args, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"rotary_store: bad shape {tuple(qkv.shape)}")
