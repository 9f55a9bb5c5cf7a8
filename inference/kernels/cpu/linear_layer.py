"""CPULinear: a linear layer on the CPU whose rows are batch-invariant.

Float32 weights go through ``csrc/linear.c`` (where it builds), bf16 ones through
``linear_amx.c`` on a CPU with AMX and through linear.c's bf16 kernel on one with AVX512-BF16:
their rows are invariant by construction, and need neither slabs nor padding.

Elsewhere torch's products run, and CPU matrix kernels (oneDNN/MKL) pick their kernel, and with
it the accumulation order, by the number of rows (csrc/README.md, "Row slabs" has the
measurements). There every product runs in slabs of a fixed number of rows, and a call, or a
last slab, of fewer rows than the shape's ``min_rows`` is padded to ``min_rows``: each row's
result is then independent of how many rows share the call (prefill chunking, decode
batching). Both are measured once per weight shape and dtype (``_probe``), with inputs whose
sums cancel, where any change of summation order shows after rounding: the slab is the largest
of ``max_slab``, its halves, down to ``row_slab``, whose calls agree from as few rows as those
of ``row_slab`` do (larger slabs run prefill faster).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from inference.kernels.cpu import linear as kernels
from inference.kernels.cpu.build import machine_file

LINEAR_ROW_SLAB = 32  # the slab every CPU keeps rows invariant in (fewest rows measured)
LINEAR_MAX_SLAB = 128  # the largest slab tried for a model's layers
_PROBES: dict[str, int] = {}  # probe key -> min_rows (or more than its floor)


def _probe_file() -> Path:
    """Where probe results persist between processes: they depend on torch, the CPU and the
    thread count only (the key says which), and cost about a second per model to measure."""
    return machine_file("linear-rows")


def _load_probes() -> None:
    with contextlib.suppress(OSError, ValueError):
        for k, v in json.loads(_probe_file().read_text()).items():
            _PROBES.setdefault(k, int(v))


def _save_probes() -> None:
    """Merge this process's results into the file (a temporary name, then a rename)."""
    path = _probe_file()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {}
        with contextlib.suppress(OSError, ValueError):
            merged = json.loads(path.read_text())
        merged.update(_PROBES)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".linear-rows-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, indent=0, sort_keys=True)
        os.replace(tmp, path)


@functools.cache
def _mkldnn_packing_available() -> bool:
    """oneDNN packs bf16 weights only where the CPU has the instructions for it (AVX512BW/VL/DQ
    or AVX-NE-CONVERT); elsewhere bf16 products go through F.linear."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def _cancelling_probe(out_features: int, in_features: int, rows: int, dtype, seed: int):
    """A weight whose two halves are equal and inputs whose halves cancel (``a`` then ``-a + d``
    with large ``a``): every output is small against its partial sums, so two summation orders
    give different rounded results."""
    return _cancelling_weight(out_features, in_features, dtype), _cancelling_input(
        rows, in_features, dtype, seed
    )


def _cancelling_weight(out_features: int, in_features: int, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    half = in_features // 2
    r = torch.randn(out_features, in_features - half, generator=gen).to(dtype)
    return torch.cat([r[:, :half], r], dim=1)


def _cancelling_input(rows: int, in_features: int, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1 + seed)
    half = in_features // 2
    scale = torch.exp2(torch.randint(8, 16, (rows, half), generator=gen).float())
    a = (torch.randn(rows, half, generator=gen) * scale).to(dtype).float()
    d = torch.randn(rows, in_features - half, generator=gen)
    tail = -torch.cat([a, a.new_zeros(rows, in_features - 2 * half)], dim=1) + d
    return torch.cat([a, tail], dim=1).to(dtype)


class CPULinear:
    """y = x @ w.T (+ b) on the CPU with batch-invariant rows.

    In float32 the weight is packed once into linear.c's panels, in bf16 on a CPU with
    AMX into linear_amx.c's tiles, and in bf16 on one with AVX512-BF16 into linear.c's panels
    of input pairs (rows invariant by construction at any call size: ``row_slab`` is then
    None). Other CPUs pack bf16 weights once into oneDNN's blocked layout
    where the CPU supports that (F.linear would repack it on every call, which dominates
    decode); products run in slabs of ``row_slab`` rows (or, with ``max_slab``, the largest
    measured slab up to it), calls of fewer than ``min_rows`` rows padded. The oneDNN path
    gives the same bits as F.linear.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        row_slab: int | None = LINEAR_ROW_SLAB,
        max_slab: int | None = None,
    ):
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self._packed = None
        self._panels = None  # the float32 kernel's packed weight (kernels.linear_f32)
        self._tiles = None  # the AMX kernel's packed weight (kernels.linear_bf16_amx)
        self._bf16_panels = None  # linear.c's bf16 packed weight (kernels.linear_bf16)
        self._bias_f32 = None
        bf16 = weight.dtype == torch.bfloat16
        if weight.dtype == torch.float32 and kernels.linear_f32_panel():
            self._panels = kernels.pack_linear_f32(weight)
        elif bf16 and weight.shape[1] % 32 == 0 and kernels.linear_bf16_amx_available():
            self._tiles = kernels.pack_linear_bf16_amx(weight)
        elif bf16 and weight.shape[1] % 2 == 0 and kernels.linear_bf16_panel():
            self._bf16_panels = kernels.pack_linear_bf16(weight)
        if (self._tiles is not None or self._bf16_panels is not None) and bias is not None:
            self._bias_f32 = bias.float().contiguous()
        if self._panels is not None or self._tiles is not None or self._bf16_panels is not None:
            self.weight = None  # the packed copy replaces it (not held twice)
            self.row_slab = None  # invariant by construction: no slabs, no padding
            self.min_rows = 1
            return
        if bf16 and _mkldnn_packing_available():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.row_slab = row_slab
        self.min_rows = 1  # calls of fewer rows are padded to this many (module docstring)
        if row_slab is not None:
            self.min_rows = self._probe(row_slab, row_slab)
            slab = max_slab or row_slab
            while slab > row_slab:
                if self._probe(slab, self.min_rows) <= self.min_rows:
                    self.row_slab = slab
                    break
                slab //= 2

    def compiled(self) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
        """The compiled kernel this layer's products run in, as the compiled layer loop
        (``kernels.cpu.forward``) calls it: (``"f32"`` for linear.c's float32 panels, ``"bf16"`` for
        its bf16 panels, ``"amx"`` for linear_amx.c's tiles; the packed weight; the bias as
        that kernel takes it, float32), or None where the products are torch's."""
        if self._panels is not None:
            return "f32", self._panels, self.bias
        if self._bf16_panels is not None:
            return "bf16", self._bf16_panels, self._bias_f32
        if self._tiles is not None:
            return "amx", self._tiles, self._bias_f32
        return None

    @property
    def kind(self) -> str:
        """Which product runs (``f32``, ``bf16``, ``amx``, ``onednn`` or ``torch``): each gives
        its own bits, so it is part of the model's fingerprint."""
        compiled = self.compiled()
        if compiled is not None:
            return compiled[0]
        return "onednn" if self._packed is not None else "torch"

    def storage(self) -> tuple[str, int]:
        """How the weight is held for the products, and its bytes: ``q4_1`` / ``q8_0`` (linear.c's
        block forms of a GGUF weight), else the dtype's name (``float32``, ``bfloat16``)."""
        if self._panels is not None:
            return kernels.weight_format(self._panels), self._panels.numel()
        held = next(
            t for t in (self._tiles, self._bf16_panels, self._packed, self.weight) if t is not None
        )
        kind = "bfloat16" if self.weight is None else str(self.weight.dtype).removeprefix("torch.")
        return kind, held.numel() * held.element_size()

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors this layer keeps (for the model's weight bytes)."""
        held = (
            self.weight,
            self._panels,
            self._tiles,
            self._bf16_panels,
            self._packed,
            self.bias,
            self._bias_f32,
        )
        return [t for t in held if t is not None]

    @torch.inference_mode()
    def _probe(self, slab: int, floor: int) -> int:
        """The fewest rows from which every call of up to ``slab`` rows gives each row the
        bits of a full slab, at the start or the end of the call, for this weight's shape and
        dtype (measured once per shape). Sizes are tried from ``slab - 1`` down, and the probe
        stops at the first that disagrees above ``floor`` (the slab is then of no use)."""
        w = self.weight
        key = (
            f"{w.dtype}|{w.shape[1]}|{w.shape[0]}|packed={self._packed is not None}"
            f"|slab={slab}|floor={floor}|threads={torch.get_num_threads()}"
        )
        if key not in _PROBES:
            _load_probes()
        if key in _PROBES:
            return _PROBES[key]
        min_rows = 1
        pw = _cancelling_weight(w.shape[0], w.shape[1], w.dtype)
        packed = None
        if self._packed is not None:
            packed = torch.ops.mkldnn._reorder_linear_weight(pw, None)

        def product(v):
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(v, packed, None, "none", [], "")
            return F.linear(v, pw)

        for seed in (0, 1):  # rows at the start of a call, then at its end
            x = _cancelling_input(slab, w.shape[1], w.dtype, seed)
            full = product(x)
            for m in range(slab - 1, 0, -1):
                part = slice(0, m) if seed == 0 else slice(slab - m, slab)
                if not torch.equal(product(x[part]), full[part]):
                    min_rows = max(min_rows, m + 1)
                    break
                if m < min_rows:
                    break
            if min_rows > floor:
                break
        _PROBES[key] = min_rows
        _save_probes()
        return min_rows

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:
            return kernels.linear_f32(x, self._panels, self.out_features, self.bias)
        if self._tiles is not None:
            return kernels.linear_bf16_amx(x, self._tiles, self.out_features, self._bias_f32)
        if self._bf16_panels is not None:
            return kernels.linear_bf16(x, self._bf16_panels, self.out_features, self._bias_f32)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n >= self.min_rows:
            return self._product(x)
        x = torch.cat([x, x.new_zeros(self.min_rows - n, x.shape[1])])
        return self._product(x)[:n]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] -> [N, out]."""
        n = x.shape[0]
        slab = self.row_slab
        if slab is None or n <= slab:
            return self._padded(x)
        out = x.new_empty(n, self.out_features)
        for i in range(0, n, slab):
            out[i : i + slab] = self._padded(x[i : i + slab])
        return out
