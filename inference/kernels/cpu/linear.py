"""The linear kernels: ``csrc/linear.c`` (float32 panels, a GGUF weight's Q4_1/Q8_0 blocks
kept as such, and bf16 panels on AVX512-BF16) and ``csrc/linear_amx.c`` (bf16 on the AMX tile
unit). Each output is one chain of products over the inputs in a fixed order, so a row's bits
never depend on the other rows of the call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess

import torch

from inference.kernels.cpu.build import CSRC, KernelBuildError, build, kernels_enabled

log = logging.getLogger("docqa.engine")

LINEAR_SOURCE = CSRC / "linear.c"
AMX_SOURCE = CSRC / "linear_amx.c"


@functools.cache
def linear_library() -> ctypes.CDLL:
    """The compiled float32 and bf16 linear kernels (built on first use); raises
    KernelBuildError."""
    lib = ctypes.CDLL(str(build(LINEAR_SOURCE)))
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name in ("docqa_linear_f32", "docqa_linear_bf16"):
        getattr(lib, name).argtypes = [p, i, i64, p, i, i, p, p, i64, p, i]
        getattr(lib, name).restype = i
    for name in ("docqa_linear_f32_panel", "docqa_linear_bf16_panel"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = i
    lib.docqa_pack_f32_bytes.argtypes = [i, i, i]
    lib.docqa_pack_f32_bytes.restype = i64
    lib.docqa_pack_f32.argtypes = [p, i, i, i, p, i]
    lib.docqa_pack_f32.restype = i
    lib.docqa_pack_f32_format.argtypes = [p]
    lib.docqa_pack_f32_format.restype = i
    return lib


def _panel(name: str) -> int:
    if not kernels_enabled():
        return 0
    try:
        return getattr(linear_library(), name)()
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("CPU linear kernel unavailable, using torch's: %s", e)
        return 0


@functools.cache
def linear_f32_panel() -> int:
    """Output features per packed panel of the float32 linear kernel; 0 where it is not built
    (no C compiler, no FMA vectors on this CPU, or DOCQA_CPU_KERNELS=0)."""
    return _panel("docqa_linear_f32_panel")


@functools.cache
def linear_bf16_panel() -> int:
    """Output features per packed panel of the bf16 linear kernel (linear.c on AVX512-BF16);
    0 where it is not built (no C compiler, no AVX512-BF16, or DOCQA_CPU_KERNELS=0)."""
    return _panel("docqa_linear_bf16_panel")


LINEAR_ROW_BLOCK, LINEAR_K_BLOCK = 96, 384  # linear.c's ROW_BLOCK and K_BLOCK
LINEAR_PANEL = 16  # linear.c's PANEL (output features per panel, float32 and bf16)


# linear.c's float32 weight formats (docqa_pack_f32): plain panels, and the llama.cpp block
# forms a weight may be exactly made of (0.75 and 1.125 bytes a weight instead of 4)
WEIGHT_FORMATS = {0: "float32", 1: "q4_1", 2: "q8_0"}


def quantized_weights_enabled() -> bool:
    """Whether float32 weights that are exactly Q4_1 or Q8_0 blocks are kept in that form
    (``DOCQA_QUANTIZED_WEIGHTS=0`` keeps plain float32 panels; the results are the same)."""
    return os.environ.get("DOCQA_QUANTIZED_WEIGHTS", "1") != "0"


def pack_linear_f32(weight: torch.Tensor, quantized: bool | None = None) -> torch.Tensor:
    """[out, in] float32 -> linear.c's packed weight (a 64-byte header, then panels of P
    features; features past out zero), as uint8. With ``quantized`` (default:
    ``quantized_weights_enabled()``) a weight whose every block of 32 inputs of a feature is
    exactly a Q4_1 block, else exactly a Q8_0 block, is kept in that form: linear.c expands
    it to the same float32 values, so products are bitwise those of the plain panels."""
    lib = linear_library()
    w = weight.detach().contiguous()
    assert w.dtype == torch.float32 and w.dim() == 2
    n, k = w.shape
    if quantized is None:
        quantized = quantized_weights_enabled()
    for fmt in (1, 2, 0) if quantized else (0,):
        size = lib.docqa_pack_f32_bytes(n, k, fmt)
        if size < 0:
            continue
        out = torch.empty(size, dtype=torch.uint8)
        threads = torch.get_num_threads()
        if lib.docqa_pack_f32(w.data_ptr(), n, k, fmt, out.data_ptr(), threads) == 0:
            return out
    raise ValueError(f"linear kernel: cannot pack a weight of shape {tuple(w.shape)}")


def weight_format(packed: torch.Tensor) -> str:
    """The format of a pack_linear_f32 weight: "float32", "q4_1" or "q8_0"."""
    return WEIGHT_FORMATS[linear_library().docqa_pack_f32_format(packed.data_ptr())]


def pack_linear_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 (in even) -> panels [ceil(out / P), in / 2, P] int32 (linear.c): each
    element a pair of consecutive inputs of one feature, the even one in the low half;
    features past out zero."""
    assert weight.shape[1] % 2 == 0, "the bf16 kernel takes inputs in pairs"
    return _pack_panels(weight.contiguous().view(torch.int32), linear_bf16_panel())


def _pack_panels(weight: torch.Tensor, panel: int) -> torch.Tensor:
    n, k = weight.shape
    panels = -(-n // panel)
    padded = weight.new_zeros(panels * panel, k)
    padded[:n] = weight
    return padded.view(panels, panel, k).transpose(1, 2).contiguous()


def linear_f32(
    x: torch.Tensor,  # [m, in] float32, rows dense (may be strided)
    packed: torch.Tensor,  # pack_linear_f32(weight)
    out_features: int,
    bias: torch.Tensor | None = None,  # [out] float32, contiguous
) -> torch.Tensor:
    """x @ weight.T (+ bias), each output one fused multiply-add chain over the inputs in
    order: a row's bits never depend on the other rows of the call (``docqa_linear_f32``)."""
    assert x.dtype == torch.float32 and packed.dtype == torch.uint8
    k = x.shape[1]
    return _panel_linear("docqa_linear_f32", x, packed, k, k, out_features, bias)


def linear_bf16(
    x: torch.Tensor,  # [m, in] bf16, rows dense (may be strided)
    packed: torch.Tensor,  # pack_linear_bf16(weight)
    out_features: int,
    bias: torch.Tensor | None = None,  # [out] float32, contiguous
) -> torch.Tensor:
    """x @ weight.T (+ bias) in bf16, each output one float32 chain of vdpbf16ps terms over
    the input pairs in order, rounded once: a row's bits never depend on the other rows of the
    call (``docqa_linear_bf16``)."""
    assert x.dtype == torch.bfloat16
    pairs = packed.shape[1]
    return _panel_linear("docqa_linear_bf16", x, packed, 2 * pairs, pairs, out_features, bias)


def linear_part_floats(rows: int, out_features: int, terms: int) -> int:
    """Floats of linear.c's partial sums for ``rows`` rows (0 when it needs none): ``terms`` is
    the inputs a feature sums (their pairs in bf16)."""
    if terms <= LINEAR_K_BLOCK or rows == 0:
        return 0
    return min(rows, LINEAR_ROW_BLOCK) * -(-out_features // LINEAR_PANEL) * LINEAR_PANEL


def _panel_linear(name, x, packed, k, terms, out_features, bias) -> torch.Tensor:
    """``name``'s product of x [m, k] with ``packed``, whose outputs each sum ``terms`` terms."""
    assert x.dim() == 2 and x.shape[1] == k and packed.is_contiguous()
    m = x.shape[0]
    if x.stride(1) != 1 or x.stride(0) < k:
        x = x.contiguous()
    y = x.new_empty(m, out_features)
    part = None
    floats = linear_part_floats(m, out_features, terms)
    if floats:
        part = torch.empty(floats, dtype=torch.float32)
    rc = getattr(linear_library(), name)(
        x.data_ptr(),
        m,
        x.stride(0),
        packed.data_ptr(),
        out_features,
        k,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out_features,
        None if part is None else part.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"linear kernel: bad sizes {tuple(x.shape)} x {out_features}")
    return y


@functools.cache
def amx_library() -> ctypes.CDLL:
    """The compiled bf16 AMX linear kernel (built on first use); raises KernelBuildError."""
    lib = ctypes.CDLL(str(build(AMX_SOURCE)))
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn = lib.docqa_linear_bf16_amx
    fn.argtypes = [p, i, i64, p, i, i, p, p, i64, i]
    fn.restype = i
    for name in ("docqa_amx_init", "docqa_linear_bf16_amx_available"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = i
    # the tile state is asked for once, on load: a tile instruction without it is SIGILL
    lib.amx = bool(lib.docqa_linear_bf16_amx_available()) and lib.docqa_amx_init() == 0
    return lib


@functools.cache
def linear_bf16_amx_available() -> bool:
    """Whether bf16 linear layers run on the AMX tile unit here: a CPU with AMX-BF16, a build
    that has it, and the operating system's leave to use the tile state."""
    if not kernels_enabled():
        return False
    try:
        lib = amx_library()
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("AMX linear kernel unavailable, using oneDNN's: %s", e)
        return False
    if lib.docqa_linear_bf16_amx_available() and not lib.amx:
        log.warning("the kernel refused AMX tile state to this process: using oneDNN's linears")
    return lib.amx


def pack_linear_bf16_amx(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 (in a multiple of 32) -> tiles [ceil(out / 16), in / 32, 16, 16, 2]
    (linear_amx.c): tile (nb, kb) row p holds, for feature j, inputs 32 kb + 2p and
    32 kb + 2p + 1 of feature 16 nb + j; features past out zero."""
    n, k = weight.shape
    assert k % 32 == 0, "the AMX kernel takes inputs in whole blocks of 32"
    nb = -(-n // 16)
    padded = weight.new_zeros(nb * 16, k)
    padded[:n] = weight
    return padded.view(nb, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def linear_bf16_amx(
    x: torch.Tensor,  # [m, in] bf16, rows dense (may be strided)
    packed: torch.Tensor,  # pack_linear_bf16_amx(weight)
    out_features: int,
    bias: torch.Tensor | None = None,  # [out] float32, contiguous
) -> torch.Tensor:
    """x @ weight.T (+ bias) in bf16 on the tile unit, each output summed over the inputs in
    blocks of 32 in order: a row's bits never depend on the other rows of the call."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2
    lib = amx_library()
    if not lib.amx:
        raise RuntimeError("no AMX tile state in this process (linear_bf16_amx_available)")
    m, k = x.shape
    if x.stride(1) != 1 or x.stride(0) < k:
        x = x.contiguous()
    assert packed.shape[1] * 32 == k and packed.is_contiguous()
    assert packed.shape[0] * 16 >= out_features
    y = x.new_empty(m, out_features)
    rc = lib.docqa_linear_bf16_amx(
        x.data_ptr(),
        m,
        x.stride(0),
        packed.data_ptr(),
        out_features,
        k,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out_features,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"AMX linear kernel: bad sizes {tuple(x.shape)} x {out_features}")
    return y
