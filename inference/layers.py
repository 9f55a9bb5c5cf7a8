"""Batch-invariant building blocks: linear, RMSNorm, rotary embedding.

Why ``linear`` works in row slabs: CPU matrix kernels (torch 2.13, oneDNN/MKL) pick their
kernel, and with it the accumulation order, by the number of rows. On a CPU with native bf16, a
bf16 product gives bit-identical rows for calls of 2 to 32 rows but switches kernels above 32;
a call of one row may take a matrix-vector path of its own (measured on AMD Zen 4: the down
projection's rows differ at one row, rarely, where a sum cancels); in float32 calls of up to
11 rows differ from larger ones. So every product runs in slabs of ``LINEAR_ROW_SLAB`` rows, and
a call, or a last slab, of fewer rows than the shape's ``min_rows`` is padded to ``min_rows``:
each row's result is then independent of how many rows share the call (prefill chunking,
decode batching). ``min_rows`` is measured once per weight shape and dtype
(``_min_invariant_rows``) with inputs whose sums cancel, where any change of summation order
shows after rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.config import ModelConfig

LINEAR_ROW_SLAB = 32
_MIN_ROWS: dict[tuple, int] = {}  # (dtype, in, out, packed, slab) -> smallest invariant call


def _mkldnn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def _cancelling_probe(out_features: int, in_features: int, rows: int, dtype, seed: int):
    """A weight whose two halves are equal and inputs whose halves cancel (``a`` then ``-a + d``
    with large ``a``): every output is small against its partial sums, so two summation orders
    give different rounded results."""
    gen = torch.Generator().manual_seed(seed)
    half = in_features // 2
    r = torch.randn(out_features, in_features - half, generator=gen)
    w = torch.cat([r[:, :half], r], dim=1).to(dtype)
    scale = torch.exp2(torch.randint(8, 16, (rows, half), generator=gen).float())
    a = (torch.randn(rows, half, generator=gen) * scale).to(dtype).float()
    d = torch.randn(rows, in_features - half, generator=gen)
    tail = -torch.cat([a, a.new_zeros(rows, in_features - 2 * half)], dim=1) + d
    return w, torch.cat([a, tail], dim=1).to(dtype)


class Linear:
    """y = x @ w.T (+ b) with batch-invariant rows.

    On CPU in bf16 the weight is packed once into oneDNN's blocked layout (F.linear would
    repack it on every call, which dominates decode); products run in slabs of
    ``row_slab`` rows, calls of fewer than ``min_rows`` rows padded. The packed path gives the
    same bits as F.linear.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        row_slab: int | None = LINEAR_ROW_SLAB,
    ):
        self.weight = weight  # [out, in]
        self.bias = bias
        self.row_slab = row_slab
        self.out_features = weight.shape[0]
        self._packed = None
        if (
            weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and _mkldnn_packing_available()
        ):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.min_rows = 1  # calls of fewer rows are padded to this many (module docstring)
        if row_slab is not None and weight.device.type == "cpu":
            self.min_rows = self._min_invariant_rows()

    @torch.inference_mode()
    def _min_invariant_rows(self) -> int:
        """The fewest rows from which every call of up to ``row_slab`` rows gives each row the
        same bits as a full slab, at the start or the end of the call, for this weight's
        shape and dtype (measured once per shape; ``row_slab`` when no smaller count is)."""
        w, slab = self.weight, self.row_slab
        key = (w.dtype, w.shape[1], w.shape[0], self._packed is not None, slab)
        if key not in _MIN_ROWS:
            agree = [True] * (slab + 1)
            for seed in (0, 1):  # rows at the start of a call, then at its end
                pw, x = _cancelling_probe(w.shape[0], w.shape[1], slab, w.dtype, seed)
                packed = None
                if self._packed is not None:
                    packed = torch.ops.mkldnn._reorder_linear_weight(pw, None)

                def product(v, pw=pw, packed=packed):
                    if packed is not None:
                        return torch.ops.mkldnn._linear_pointwise(v, packed, None, "none", [], "")
                    return F.linear(v, pw)

                full = product(x)
                for m in range(1, slab):
                    part = slice(0, m) if seed == 0 else slice(slab - m, slab)
                    agree[m] = agree[m] and torch.equal(product(x[part]), full[part])
            m0 = slab
            while m0 > 1 and agree[m0 - 1]:
                m0 -= 1
            _MIN_ROWS[key] = m0
        return _MIN_ROWS[key]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMSNorm computed in float32, as Llama's reference does."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * torch.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin per position, precomputed in float32 and cast to the compute dtype."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        inv = rope_inv_freq(cfg)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, d]
        self.cos = emb.cos().to(dtype).to(device)
        self.sin = emb.sin().to(dtype).to(device)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of ``positions`` [N], shaped to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [N, heads, d]; ``cos_sin`` from ``gather(positions)`` of its N rows."""
        cos, sin = cos_sin
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        # (x * cos + rotate_half(x) * sin), with rotate_half(x) = [-x2, x1]
        out[..., :half] = x1 * cos[..., :half] - x2 * sin[..., :half]
        out[..., half:] = x2 * cos[..., half:] + x1 * sin[..., half:]
        return out
