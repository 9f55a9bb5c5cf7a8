"""The Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Plain tensors and functions: embeddings -> [RMSNorm -> GQA attention with rotary -> residual
-> RMSNorm -> SwiGLU -> residual] x L -> RMSNorm -> tied or separate LM head (Qwen3: an RMSNorm
over each head of q and k before the rotation). q/k/v and gate/up projections are fused into
one product each. Every operation comes from the model's
``ModelOps`` table (``inference/model/ops.py``), chosen once per device and mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from inference.attention.metadata import AttentionMetadata
from inference.errors import ModelError
from inference.model.config import ModelConfig
from inference.model.layers import RotaryTable
from inference.model.loader import load_weights, random_weights
from inference.model.ops import ModelOps


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: object  # linear [(heads + 2 * kv_heads) * d, H], bias for Qwen2
    o_proj: object  # linear [H, heads * d]
    post_norm: torch.Tensor  # [H]
    gate_up: object  # linear [2 * I, H]
    down: object  # linear [H, I]
    q_norm: torch.Tensor | None = None  # [d] Qwen3
    k_norm: torch.Tensor | None = None  # [d] Qwen3


class LlamaModel:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: ModelOps):
        self.cfg = cfg
        self.dtype = dtype
        self.ops = ops
        self.device = ops.device
        self.embed: torch.Tensor | None = None
        self.lm_head = None
        self.final_norm: torch.Tensor | None = None
        self.layers: list[LayerWeights] = []
        self.rotary = RotaryTable(cfg, cfg.max_position_embeddings, dtype, self.device)
        self.scale = cfg.head_dim**-0.5
        # the layer stack in one call where the ops table has one (the same bits as the layer
        # loop below: tests compare the two); False keeps the loop
        self.compiled_layers = True
        self._loop = None
        self._loop_key: tuple | None = None

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype, ops: ModelOps) -> LlamaModel:
        model = cls(ModelConfig.from_file(Path(model_dir)), dtype, ops)
        model.load_state_dict(load_weights(model_dir, dtype))
        return model

    @classmethod
    def random(cls, model_dir: Path, dtype: torch.dtype, ops: ModelOps, seed: int = 0):
        """Random weights of the shape config.json describes (benchmarks of large shapes
        without weight files)."""
        model = cls(ModelConfig.from_file(Path(model_dir)), dtype, ops)
        model.load_state_dict(random_weights(model.cfg, dtype, model.device, seed))
        return model

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take Hugging Face Llama parameter names; fuse q/k/v and gate/up."""
        cfg = self.cfg
        linear = self.ops.linear

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ModelError(f"weights lack {name}")
            return sd[name].to(self.dtype).to(self.device).contiguous()

        def fused(*names: str) -> torch.Tensor:
            return torch.cat([take(n) for n in names]).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
            self.lm_head = linear(self.embed, None, True)
        else:
            self.lm_head = linear(take("lm_head.weight"), None, True)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
            bias = None
            if attn[0] + ".bias" in sd:
                bias = fused(*(a + ".bias" for a in attn))
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=linear(fused(*(a + ".weight" for a in attn)), bias, False),
                    o_proj=linear(take(p + "self_attn.o_proj.weight"), None, False),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=linear(
                        fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), None, False
                    ),
                    down=linear(take(p + "mlp.down_proj.weight"), None, False),
                    q_norm=take(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
                    k_norm=take(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
                )
            )

    def linears(self) -> list:
        out = [self.lm_head]
        for lw in self.layers:
            out += [lw.qkv, lw.o_proj, lw.gate_up, lw.down]
        return out

    def linear_storage(self) -> dict[str, int]:
        """Bytes of the linear layers' weights by how they are held (each layer's
        ``storage()``)."""
        out: dict[str, int] = {}
        for lin in self.linears():
            kind, size = lin.storage()
            out[kind] = out.get(kind, 0) + size
        return out

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.final_norm]
        for lw in self.layers:
            tensors += [lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm]
        for lin in self.linears():
            tensors += lin.held_tensors()
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def compute_signature(self) -> str:
        """What computes this model's KV bits besides its weights and dtypes: the ops table's
        name and mode, and the kernels of its linear layers (part of the model fingerprint)."""
        kinds = sorted({lin.kind for lin in self.linears()})
        return f"{self.ops.name}|mode={self.ops.mode}|linear={','.join(kinds)}"

    # -- forward ------------------------------------------------------------------------------
    def layer_loop(self, kv_caches):
        """The ops table's compiled layer stack over these caches (built once per pool), or
        None where the layer loop runs from Python."""
        if self.ops.layer_loop is None or not self.compiled_layers or self.cfg.qk_norm:
            return None
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if key != self._loop_key:
            self._loop = self.ops.layer_loop(self, kv_caches)
            self._loop_key = key
        return self._loop

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64, new tokens of all sequences, concatenated
        positions: torch.Tensor,  # [N] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        logits_indices: torch.Tensor,  # [R] rows of N whose next-token logits are wanted
    ) -> torch.Tensor:  # [R, vocab] float32
        h = self.embed[input_ids]  # [N, H], updated in place layer by layer
        loop = self.layer_loop(kv_caches) if h.shape[0] else None
        if loop is not None:
            delta = loop.run(h, positions, meta)
        else:
            delta = self._layers(h, positions, meta, kv_caches)
        h = h[logits_indices]
        if delta is not None:
            h = h + delta[logits_indices]
        h = self.ops.add_rms_norm(h, None, self.final_norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()

    def _qk_norm(self, qkv: torch.Tensor, lw: LayerWeights) -> None:
        """Qwen3: RMSNorm over each head of q and k, in place in the fused projection's output
        (in float32, scaled by the weight after the cast back, as transformers does)."""
        cfg = self.cfg
        n, d = qkv.shape[0], cfg.head_dim
        qd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
        for part, w in ((qkv[:, :qd], lw.q_norm), (qkv[:, qd : qd + kd], lw.k_norm)):
            x = part.reshape(n, -1, d).float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
            part.copy_((w * x.to(qkv.dtype)).reshape(n, -1))

    def _layers(self, h, positions, meta, kv_caches) -> torch.Tensor | None:
        """Every decoder layer, one op at a time: h is updated in place; returns the last
        layer's MLP output (not yet added to h)."""
        cfg, ops = self.cfg, self.ops
        eps, inter = cfg.rms_norm_eps, cfg.intermediate_size
        n, qd = h.shape[0], cfg.num_heads * cfg.head_dim
        delta = None
        for lw, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = ops.add_rms_norm(h, delta, lw.input_norm, eps)
            qkv = lw.qkv(x)
            if lw.q_norm is not None:
                self._qk_norm(qkv, lw)
            q = ops.rotary_store(
                qkv, positions, self.rotary, cfg.num_heads, cfg.num_kv_heads, meta, k_cache, v_cache
            )
            attn = ops.attention.attention(q, k_cache, v_cache, meta, self.scale)
            x = ops.add_rms_norm(h, lw.o_proj(attn.reshape(n, qd)), lw.post_norm, eps)
            delta = lw.down(ops.silu_mul(lw.gate_up(x), inter))
        return delta
