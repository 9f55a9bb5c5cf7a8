"""Batch-invariant building blocks: linear, RMSNorm, rotary embedding.

Why ``linear`` works in row slabs: CPU matrix kernels (torch 2.13, oneDNN/MKL) pick their
kernel, and with it the accumulation order, by the number of rows. On a CPU with native bf16
(AVX512-BF16), a bf16 product gives bit-identical rows for any call of at most 32 rows but
switches kernels above that; on CPUs without it, and in float32, a call of 1 to 15 rows takes a
matrix-vector path whose sums differ from those of a larger call. So every product runs in slabs
of ``LINEAR_ROW_SLAB`` rows, and, where a probe of the weight's shape (``_small_calls_agree``)
shows that short calls disagree with full slabs, the last slab is padded to full size: each row's
result is then independent of how many rows share the call (prefill chunking, decode batching).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.config import ModelConfig

LINEAR_ROW_SLAB = 32
_AGREE: dict[tuple, bool] = {}  # (dtype, in, out, packed) -> short calls match full slabs


def _mkldnn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class Linear:
    """y = x @ w.T (+ b) with batch-invariant rows.

    On CPU in bf16 the weight is packed once into oneDNN's blocked layout (F.linear would
    repack it on every call, which dominates decode); products run in slabs of
    ``row_slab`` rows. The packed path gives the same bits as F.linear.
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
        self.pad = False  # pad the last slab to full size (see the module docstring)
        if row_slab is not None and weight.device.type == "cpu":
            self.pad = not self._small_calls_agree()

    @torch.inference_mode()
    def _small_calls_agree(self) -> bool:
        """Whether rows computed in calls of fewer than ``row_slab`` rows are bit-identical to
        the same rows inside a full slab, for this weight's shape and dtype (measured once per
        shape)."""
        w = self.weight
        key = (w.dtype, w.shape[1], w.shape[0], self._packed is not None)
        if key not in _AGREE:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(self.row_slab, w.shape[1], generator=gen).to(w.dtype)
            full = self._product(x)
            _AGREE[key] = all(
                torch.equal(self._product(x[:m]), full[:m])
                for m in (1, 2, 3, 5, 8, 15, self.row_slab - 1)
            )
        return _AGREE[key]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] -> [N, out]."""
        n = x.shape[0]
        slab = self.row_slab
        if slab is None or n == slab or (n < slab and not self.pad):
            return self._product(x)
        if self.pad and n % slab:
            x = torch.cat([x, x.new_zeros(slab - n % slab, x.shape[1])])
        out = x.new_empty(x.shape[0], self.out_features)
        for i in range(0, x.shape[0], slab):
            out[i : i + slab] = self._product(x[i : i + slab])
        return out[:n]


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
