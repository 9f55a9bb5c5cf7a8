"""The model's device-neutral building blocks: RMSNorm, rotary embedding, and a plain linear
layer (torch's product; the CPU's batch-invariant one is ``kernels.cpu.linear_layer``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.model.config import ModelConfig


class TorchLinear:
    """y = x @ w.T (+ b) through ``F.linear``."""

    kind = "torch"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] -> [N, out]."""
        return F.linear(x, self.weight, self.bias)

    def compiled(self) -> None:
        """No compiled CPU kernel runs this layer."""
        return None

    def storage(self) -> tuple[str, int]:
        """How the weight is held, and its bytes."""
        w = self.weight
        return str(w.dtype).removeprefix("torch."), w.numel() * w.element_size()

    def held_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMSNorm computed in float32, as Llama's reference does."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_freq_factors is not None:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
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
