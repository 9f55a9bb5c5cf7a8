"""The table of operations a model's forward runs, chosen once per device and mode.

A model reads every operation of its forward from one ``ModelOps``: a new device, or a mode
such as a batch-invariant one, is a new table, not branches in the model. The runners build
the tables (``inference/runner``); ``torch_ops`` is the device-neutral table of torch's
operations around a given attention backend, and its parts are what other tables fall back to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from inference.attention.metadata import AttentionMetadata
from inference.model.layers import RotaryTable, TorchLinear, rms_norm

# (qkv [N, (heads + 2 kv heads) * d], positions [N], rotary table, heads, kv heads, metadata,
# k_cache, v_cache) -> q [N, heads, d]: rotary embedding of q and k, then K and V stored
RotaryStore = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        RotaryTable,
        int,
        int,
        AttentionMetadata,
        torch.Tensor,
        torch.Tensor,
    ],
    torch.Tensor,
]


@dataclass(frozen=True)
class ModelOps:
    """One device's (and mode's) operations for the model's forward pass."""

    # where the weights and activations live
    device: torch.device
    # (weight [out, in], bias [out] or None, lm_head) -> a layer ``x [N, in] -> [N, out]``;
    # ``lm_head`` marks the output layer (one row per sequence)
    linear: Callable[[torch.Tensor, torch.Tensor | None, bool], Any]
    # (h [N, H], delta [N, H] or None, weight [H], eps) -> RMSNorm of each row of ``h +=
    # delta``: h is updated in place, the normed rows are returned
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], torch.Tensor]
    rotary_store: RotaryStore
    # the attention backend: ``attention(q, k_cache, v_cache, meta, scale) -> [N, heads, d]``
    attention: Any
    # (gate_up [N, 2I], I) -> silu(gate) * up [N, I]
    silu_mul: Callable[[torch.Tensor, int], torch.Tensor]
    # (model, kv_caches) -> the whole layer stack in one call (``run(h, positions, meta)``,
    # returning the last layer's MLP output), or None; None here: the device has none
    layer_loop: Callable[[Any, list], Any] | None = None
    # what decides the KV bits besides the weights and dtypes (device, attention, fused
    # steps): part of the model fingerprint, so KV computed one way is never served to an
    # engine computing another
    name: str = ""
    # a table's variant for one device (a batch-invariant one, say); in the fingerprint too
    mode: str = "default"


def torch_add_rms_norm(h, delta, weight, eps):
    if delta is not None:
        h.add_(delta)
    return rms_norm(h, weight, eps)


def torch_silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    return F.silu(gu[:, :inter]) * gu[:, inter:]


def rotate_then_store(backend) -> RotaryStore:
    """Rotary embedding through ``RotaryTable.apply``, then the backend's ``store_kv``."""

    def rotary_store(qkv, positions, rotary, num_heads, num_kv_heads, meta, k_cache, v_cache):
        n, d = qkv.shape[0], rotary.cos.shape[1]
        cos_sin = meta.scratch.get("rotary")
        if cos_sin is None:  # once per step, shared by every layer
            cos_sin = meta.scratch["rotary"] = rotary.gather(positions)
        qk_heads = num_heads + num_kv_heads
        qk = rotary.apply(qkv[:, : qk_heads * d].view(n, qk_heads, d), cos_sin)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, qk_heads * d :].view(n, num_kv_heads, d)
        backend.store_kv(k, v, k_cache, v_cache, meta)
        return q

    return rotary_store


def torch_ops(device: torch.device, backend, name: str = "") -> ModelOps:
    """torch's operations on ``device`` around the attention ``backend``."""
    return ModelOps(
        device=torch.device(device),
        linear=lambda weight, bias, lm_head: TorchLinear(weight, bias),
        add_rms_norm=torch_add_rms_norm,
        rotary_store=rotate_then_store(backend),
        attention=backend,
        silu_mul=torch_silu_mul,
        name=name or f"{torch.device(device).type}|attention={backend.name}|torch",
    )
