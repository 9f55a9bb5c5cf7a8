"""The Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Plain tensors and functions, one file: embeddings -> [RMSNorm -> GQA attention with rotary ->
residual -> RMSNorm -> SwiGLU -> residual] x L -> RMSNorm -> tied or separate LM head.
q/k/v and gate/up projections are fused into one product each.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from inference import cpu_kernels
from inference.attention import AttentionMetadata, TorchBackend
from inference.config import ModelConfig, dtype_name
from inference.cpu_forward import CPUForward, kv_key
from inference.errors import ModelError
from inference.layers import LINEAR_MAX_SLAB, LINEAR_ROW_SLAB, Linear, RotaryTable, rms_norm


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [(heads + 2 * kv_heads) * d, H], bias for Qwen2
    o_proj: Linear  # [H, heads * d]
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # [2 * I, H]
    down: Linear  # [H, I]


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{model_dir} holds no .safetensors weights")
    return files


def file_sha256(path: Path) -> str:
    """sha256 of a file, cached beside it by size and mtime (weights are large)."""
    st = path.stat()
    sidecar = path.with_name(path.name + ".sha256")
    key = f"{st.st_size}:{st.st_mtime_ns}"
    if sidecar.is_file():
        parts = sidecar.read_text().split()
        if len(parts) == 2 and parts[0] == key:
            return parts[1]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    with contextlib.suppress(OSError):
        sidecar.write_text(f"{key} {digest}\n")
    return digest


def model_fingerprint(
    model_dir: Path,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    block_size: int,
    random_seed: int | None = None,
) -> bytes:
    """Content hash of a model as the prefix cache sees it (CONTRACTS.md, "Prefix hashing").

    Hashes config.json, each weight file's sha256 and tokenizer.json, plus the compute dtype,
    KV dtype and block size; never paths.
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    if random_seed is not None:
        h.update(f"random-weights:{random_seed}".encode())
    else:
        for f in _weight_files(model_dir):
            h.update(bytes.fromhex(file_sha256(f)))
    tok = model_dir / "tokenizer.json"
    if tok.is_file():
        h.update(tok.read_bytes())
    h.update(f"{dtype_name(dtype)}|{dtype_name(kv_dtype)}|{block_size}".encode())
    return h.digest()


class LlamaModel:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.embed: torch.Tensor | None = None
        self.lm_head: Linear | None = None
        self.final_norm: torch.Tensor | None = None
        self.layers: list[LayerWeights] = []
        self.rotary = RotaryTable(cfg, cfg.max_position_embeddings, dtype, self.device)
        self.scale = cfg.head_dim**-0.5
        self.attn_backend = TorchBackend()  # the engine sets the configured backend
        # oneDNN's bf16 rows are batch-invariant in slabs of 32 (calls padded to a measured
        # fewest rows) on every CPU measured, of up to 128 on some (layers.py: measured per
        # shape); the compiled kernels (linear.c, linear_amx.c) are invariant without slabs
        # and Linear ignores the slab for them; on CUDA slabs would only cost speed. The LM
        # head sees one row per sequence, so it keeps 32.
        cpu_bf16 = dtype == torch.bfloat16 and self.device.type == "cpu"
        self.row_slab = LINEAR_ROW_SLAB if cpu_bf16 else None
        # the layer loop in one compiled call where every part has a kernel (cpu_forward.py);
        # False keeps the Python loop (the same bits: tests compare the two)
        self.compiled_layers = True
        self._compiled: CPUForward | None = None
        self._compiled_key: tuple | None = None

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, model_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> LlamaModel:
        model_dir = Path(model_dir)
        cfg = ModelConfig.from_file(model_dir)
        model = cls(cfg, dtype, device)
        tensors: dict[str, torch.Tensor] = {}
        for f in _weight_files(model_dir):
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensors[name] = sf.get_tensor(name)
        model.load_state_dict(tensors)
        return model

    @classmethod
    def random(
        cls, model_dir: Path, dtype: torch.dtype, device: torch.device | str, seed: int = 0
    ) -> LlamaModel:
        """Random weights of the shape config.json describes, made on the device (benchmarks
        of large shapes without weight files)."""
        cfg = ModelConfig.from_file(Path(model_dir))
        model = cls(cfg, dtype, device)
        gen = torch.Generator(device=model.device).manual_seed(seed)
        h, d = cfg.hidden_size, cfg.head_dim
        shapes = {
            "model.embed_tokens.weight": (cfg.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
                    p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
                    p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
                    p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
                    p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                    p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                    p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
                }
            )
        sd = {}
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                sd[name] = torch.ones(shape, dtype=dtype, device=model.device)
            else:
                t = torch.empty(shape, dtype=dtype, device=model.device)
                sd[name] = t.normal_(0.0, 0.02, generator=gen)
        model.load_state_dict(sd)
        return model

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take Hugging Face Llama parameter names; fuse q/k/v and gate/up."""
        cfg = self.cfg

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ModelError(f"weights lack {name}")
            return sd[name].to(self.dtype).to(self.device).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return take(name) if name in sd else None

        slab = self.row_slab
        big = LINEAR_MAX_SLAB if slab else None
        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
            self.lm_head = Linear(self.embed, None, slab)
        else:
            self.lm_head = Linear(take("lm_head.weight"), None, slab)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat(
                [
                    take(p + "self_attn.q_proj.weight"),
                    take(p + "self_attn.k_proj.weight"),
                    take(p + "self_attn.v_proj.weight"),
                ]
            )
            bias = None
            if opt(p + "self_attn.q_proj.bias") is not None:
                bias = torch.cat(
                    [
                        take(p + "self_attn.q_proj.bias"),
                        take(p + "self_attn.k_proj.bias"),
                        take(p + "self_attn.v_proj.bias"),
                    ]
                )
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=Linear(qkv.contiguous(), bias, slab, big),
                    o_proj=Linear(take(p + "self_attn.o_proj.weight"), None, slab, big),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=Linear(
                        torch.cat(
                            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                        ).contiguous(),
                        None,
                        slab,
                        big,
                    ),
                    down=Linear(take(p + "mlp.down_proj.weight"), None, slab, big),
                )
            )

    def linear_storage(self) -> dict[str, int]:
        """Bytes of the linear layers' weights by how they are held (``Linear.storage``)."""
        out: dict[str, int] = {}
        lins = [self.lm_head]
        for lw in self.layers:
            lins += [lw.qkv, lw.o_proj, lw.gate_up, lw.down]
        for lin in lins:
            kind, size = lin.storage()
            out[kind] = out.get(kind, 0) + size
        return out

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, *self.lm_head.held_tensors(), self.final_norm]
        for lw in self.layers:
            tensors += [lw.input_norm, lw.post_norm]
            for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
                tensors += lin.held_tensors()
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    # -- forward ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64, new tokens of all sequences, concatenated
        positions: torch.Tensor,  # [N] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        logits_indices: torch.Tensor,  # [R] rows of N whose next-token logits are wanted
    ) -> torch.Tensor:  # [R, vocab] float32
        cfg = self.cfg
        h = self.embed[input_ids]  # [N, H]
        qd = cfg.num_heads * cfg.head_dim
        n = h.shape[0]
        eps = cfg.rms_norm_eps
        inter = cfg.intermediate_size
        if cpu_kernels.fused_elementwise_supports(h):
            return self._forward_fused(h, positions, meta, kv_caches, logits_indices)
        cos_sin = self.rotary.gather(positions)  # once per step, shared by every layer
        for lw, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, lw.input_norm, eps)
            q = self._rotate_and_store(lw.qkv(x), cos_sin, meta, k_cache, v_cache)
            attn = self.attn_backend.attention(q, k_cache, v_cache, meta, self.scale)
            h = h + lw.o_proj(attn.reshape(n, qd))
            x = rms_norm(h, lw.post_norm, eps)
            gu = lw.gate_up(x)  # [N, 2I]
            h = h + lw.down(F.silu(gu[:, :inter]) * gu[:, inter:])
        h = rms_norm(h[logits_indices], self.final_norm, eps)
        return self.lm_head(h).float()

    def _rotate_and_store(self, qkv, cos_sin, meta, k_cache, v_cache) -> torch.Tensor:
        """Rotary embedding of q and k (one [N, heads + kv heads, d] view of qkv), k and v
        into the cache; returns q."""
        cfg = self.cfg
        n, d = qkv.shape[0], cfg.head_dim
        qk_heads = cfg.num_heads + cfg.num_kv_heads
        qk = self.rotary.apply(qkv[:, : qk_heads * d].view(n, qk_heads, d), cos_sin)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, qk_heads * d :].view(n, cfg.num_kv_heads, d)
        self.attn_backend.store_kv(k, v, k_cache, v_cache, meta)
        return q

    def compiled_layer_loop(self, kv_caches) -> CPUForward | None:
        """The compiled layer loop over these caches (built once per pool and attention
        backend, its library on first use), or None where the Python loop runs."""
        key = (self.compiled_layers, id(self.attn_backend), kv_key(kv_caches))
        if key != self._compiled_key:
            self._compiled = CPUForward.build(self, kv_caches) if self.compiled_layers else None
            self._compiled_key = key
        return self._compiled

    def _forward_fused(self, h, positions, meta, kv_caches, logits_indices) -> torch.Tensor:
        """``forward`` on the CPU (bf16 or float32) with the element-wise steps fused
        (``cpu_kernels.add_rms_norm``, ``silu_mul``, ``rotary_store``): each residual add goes
        into the next RMSNorm's pass, h is updated in place, and rotary embedding and the
        cache store are one pass over the qkv rows (caches in the compute dtype). Where every
        part has a kernel the layers run in one compiled call (``cpu_forward.CPUForward``: the
        same calls, the same bits), else from Python (``_fused_layers``)."""
        h = h.contiguous()
        compiled = self.compiled_layer_loop(kv_caches) if h.shape[0] else None
        if compiled is not None:
            delta = compiled.run(h, positions, meta)
        else:
            delta = self._fused_layers(h, positions, meta, kv_caches)
        h = h[logits_indices] + delta[logits_indices]
        h = cpu_kernels.add_rms_norm(h, None, self.final_norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()

    def _fused_layers(self, h, positions, meta, kv_caches) -> torch.Tensor:
        """The layers of ``_forward_fused`` from Python, one kernel call at a time: h is
        updated in place; returns the last layer's MLP output (not yet added to h)."""
        cfg = self.cfg
        eps, inter = cfg.rms_norm_eps, cfg.intermediate_size
        qd = cfg.num_heads * cfg.head_dim
        n = h.shape[0]
        delta = None  # the last layer's MLP output, not yet added to h
        cos_sin = None  # gathered once where the torch rotary path runs (a cache in another
        # dtype, or a backend that stores K/V itself)
        for lw, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = cpu_kernels.add_rms_norm(h, delta, lw.input_norm, eps)
            qkv = lw.qkv(x)
            if k_cache.dtype == qkv.dtype and n and self.attn_backend.plain_store:
                cpu_kernels.rotary_store(
                    qkv,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    positions,
                    self.rotary.cos,
                    self.rotary.sin,
                    meta.slot_mapping,
                    k_cache,
                    v_cache,
                )
                q = qkv[:, :qd].view(n, cfg.num_heads, cfg.head_dim)
            else:
                if cos_sin is None:
                    cos_sin = self.rotary.gather(positions)
                q = self._rotate_and_store(qkv, cos_sin, meta, k_cache, v_cache)
            attn = self.attn_backend.attention(q, k_cache, v_cache, meta, self.scale)
            x = cpu_kernels.add_rms_norm(h, lw.o_proj(attn.reshape(n, qd)), lw.post_norm, eps)
            delta = lw.down(cpu_kernels.silu_mul(lw.gate_up(x), inter))
        return delta
