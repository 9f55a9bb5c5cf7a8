"""8-bit KV caches: ``int8`` and ``float8_e4m3fn`` (fp8) with fixed per-channel scales.

A K or V element ``x`` is stored as ``q = Q(x / s)`` and read as ``q * s``, with
- ``Q``: for int8, round to nearest even and clamp to [-127, 127]; for fp8 e4m3, clamp to
  [-448, 448] and round to the nearest fp8 value (ties to even);
- ``s``: one float32 scale per (layer, K or V, KV head, channel), a power of two, fixed when
  the engine starts (``calibrate``) and never changed while it runs.

Why fixed scales and not scales per block or per token: a block is written a token at a time
(decode) or in chunks of any size (prefill), and a scale that depends on what a block holds
would make a token's stored bits depend on how its prompt was chunked, so a cache hit could
change an answer. With fixed scales a token's bytes depend on that token's K/V alone: cached
blocks, copied slots and blocks read back from Redis hold the bits computing them would give.
Fixed scales also keep the pool at exactly one byte per element (the scales are a table of
``layers x 2 x kv_heads x head_dim`` floats, not per token).

Why powers of two: ``q * s`` is then exact in bfloat16 (int8 has at most 8 significant bits, fp8
four), so the kernels dequantize a round of keys into bf16 without rounding, and the torch
reference, the C kernels and the Triton kernels read the same values.

The scales come from a calibration pass: the model's own K/V over a fixed text
(``CALIBRATION_TEXT``) in the compute dtype, the largest magnitude of each channel (for K, of
the two channels that rotary embedding mixes) times a headroom, rounded up to a power of two.
Values beyond the calibrated range saturate; the headroom (``HEADROOM``) keeps that rare.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

INT8 = torch.int8
FP8 = torch.float8_e4m3fn
KV8_DTYPES = (INT8, FP8)
# the names a user may give for an 8-bit KV cache
KV8_NAMES = {"int8": INT8, "fp8": FP8, "fp8_e4m3": FP8, "float8_e4m3fn": FP8}
QMAX = {INT8: 127.0, FP8: 448.0}
# the kernels' code of each KV format (csrc: 0 = the compute dtype's 16/32 bits)
FORMAT_CODE = {INT8: 1, FP8: 2}
# calibrated magnitude x HEADROOM maps to QMAX (before rounding the scale up to a power of two):
# fp8 keeps its relative precision at any magnitude, so room costs it nothing but range at the
# bottom; int8's resolution is range / 127, so its room is smaller
HEADROOM = {INT8: 1.5, FP8: 16.0}

CALIBRATION_TEXT = (
    "You answer questions about the manual below. Use only the manual; if it does not say, "
    "say so.\n\n"
    "# Installation and first start\n\n"
    "1. Unpack the archive into a directory of your choice, for example /opt/tool.\n"
    "2. Run `tool init --config /etc/tool.conf` to write a default configuration file.\n"
    "3. Start the service with `systemctl start tool`; it listens on port 8080 by default.\n\n"
    "## Options\n\n"
    "| Option | Default | Meaning |\n|---|---|---|\n"
    "| --threads N | 4 | worker threads |\n| --timeout S | 30 | seconds before a request fails |\n"
    "| -v, --verbose | off | log every request |\n\n"
    "Warning: never remove the lock file while the service runs. Error E42 means the disk is "
    "full; free at least 2 GB and restart. The battery lasts 10 hours; charge it with the "
    "supplied 65 W adapter. Press and hold the power button for 5 seconds to reset.\n\n"
    "Question: How do I change the port, and what does error E42 mean?\n"
    "Answer: Set `port = 9090` in /etc/tool.conf and restart the service. E42 means the disk "
    "is full."
)


def is_kv8(dtype: torch.dtype) -> bool:
    return dtype in KV8_DTYPES


def parse_kv_dtype(name: str | torch.dtype) -> torch.dtype | None:
    """An 8-bit KV dtype by any of its names, else None (the caller parses the rest)."""
    if isinstance(name, torch.dtype):
        return name if is_kv8(name) else None
    return KV8_NAMES.get(str(name).replace("torch.", "").lower())


def pow2_scales(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales (powers of two) that map ``amax * HEADROOM`` to at most QMAX."""
    need = amax.float().clamp_min(1e-6) * HEADROOM[dtype] / QMAX[dtype]
    return torch.exp2(torch.ceil(torch.log2(need)))


def quantize(x: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [..., kv_heads, head_dim] to ``dtype`` with the reciprocals of its scales
    [kv_heads, head_dim] (module docstring)."""
    v = x.float() * inv_scale
    if dtype == INT8:
        return torch.round(v).clamp_(-127.0, 127.0).to(INT8)
    return v.clamp_(-448.0, 448.0).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` [..., kv_heads, head_dim] read with its scales, in ``dtype`` (exact: module
    docstring)."""
    return (q.float() * scale).to(dtype)


def raw(cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache's bytes as uint8 (indexing and copies of fp8 tensors go through it)."""
    return cache.view(torch.uint8) if is_kv8(cache.dtype) else cache


@dataclass(frozen=True)
class KVScales:
    """One engine's fixed scales: ``scale[layer, 0 | 1 (K | V), kv_head, channel]``."""

    dtype: torch.dtype
    scale: torch.Tensor  # float32, powers of two
    inv: torch.Tensor  # 1 / scale (exact)

    @classmethod
    def from_amax(cls, amax: torch.Tensor, dtype: torch.dtype) -> KVScales:
        """Scales from each channel's calibrated magnitude ``amax[layer, k|v, head, dim]``:
        a K channel and its rotary partner (``dim`` and ``dim +- head_dim / 2``) share the
        larger of the two."""
        amax = amax.float().clone()
        half = amax.shape[-1] // 2
        k = amax[:, 0]
        pair = torch.maximum(k[..., :half], k[..., half:])
        amax[:, 0] = torch.cat([pair, pair], dim=-1)
        scale = pow2_scales(amax, dtype).contiguous()
        return cls(dtype, scale, (1.0 / scale).contiguous())

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (K, V) scales, each [kv_heads, head_dim]."""
        return self.scale[i, 0], self.scale[i, 1]

    def digest(self) -> str:
        """What the prefix-cache fingerprint hashes of these scales."""
        h = hashlib.sha256(str(self.dtype).encode())
        h.update(self.scale.numpy().tobytes())
        return h.hexdigest()

    def log_range(self) -> str:
        e = torch.log2(self.scale)
        return f"2^{int(e.min())}..2^{int(e.max())}"


def attach(cache: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor) -> None:
    """Give an 8-bit cache tensor its layer's scales [kv_heads, head_dim] (read by the store
    and the attention backends: ``scales_of``)."""
    cache.kv_scale = scale.to(cache.device)
    cache.kv_inv_scale = inv.to(cache.device)


def scales_of(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit cache's (scale, 1 / scale), each [kv_heads, head_dim]."""
    try:
        return cache.kv_scale, cache.kv_inv_scale
    except AttributeError:
        raise ValueError("an 8-bit KV cache without its scales (kv_quant.attach)") from None


def amax_of_cache(cache: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The largest magnitude of each (KV head, channel) over a cache's first ``num_slots``
    slots: [kv_heads, head_dim] float32."""
    nb, bs, kvh, d = cache.shape
    return cache.reshape(nb * bs, kvh, d)[:num_slots].float().abs().amax(dim=0)
