"""The decoder layers of a step in one call to compiled code (``csrc/forward.c``).

The model's Python layer loop calls nine kernels a layer: 270 calls a step for SmolLM2, each
wrapped in argument checks, views, allocations and ctypes conversions (csrc/README.md, "The
layer loop", has what that cost). ``CPUForward`` hands the same calls, with the same arguments
in the same order, to one C loop over the layers: the results are the same bits
(tests/test_cpu_forward.py compares the two paths), and what is left in Python per step is
filling one small struct.

It takes the model only where every part has a compiled kernel: activations and KV caches in
bf16 or float32, linear layers packed for linear.c (or linear_amx.c), the fused element-wise
steps, and the CPU attention backend with a kernel for the shape. Elsewhere ``build`` returns
None and the model keeps its Python loop.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from inference import kv_quant
from inference.attention.metadata import AttentionMetadata
from inference.kernels.cpu import attention as attention_kernels
from inference.kernels.cpu import elementwise, linear
from inference.kernels.cpu.build import CSRC, KernelBuildError, build

log = logging.getLogger("docqa.engine")

SOURCE = CSRC / "forward.c"
_p, _i32, _i64, _f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _ModelDesc(ctypes.Structure):
    _fields_ = [
        ("linear", _p),
        ("add_rms_norm", _p),
        ("silu_mul", _p),
        ("rotary_store", _p),
        ("attention", _p),
        ("amx", _i32),
        ("bf16", _i32),
        ("num_layers", _i32),
        ("hidden", _i32),
        ("num_heads", _i32),
        ("num_kv_heads", _i32),
        ("head_dim", _i32),
        ("inter", _i32),
        ("block_size", _i32),
        ("eps", _f),
        ("scale", _f),
        ("kv_format", _i32),
    ]


class _LayerDesc(ctypes.Structure):
    _fields_ = [
        (name, _p)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "o_proj",
            "gate_up",
            "down",
            "qkv_bias",
            "k_cache",
            "v_cache",
            "k_scale",
            "v_scale",
            "k_inv",
            "v_inv",
        )
    ]


class _StepDesc(ctypes.Structure):
    _fields_ = [
        ("rows", _i32),
        ("num_threads", _i32),
        *[(name, _p) for name in ("h", "x", "qkv", "attn", "o", "gu", "act", "delta")],
        ("part", _p),
        ("attn_f32", _p),
        ("positions", _p),
        ("slots", _p),
        ("cos", _p),
        ("sin", _p),
        ("num_tokens", _i32),
        ("num_groups", _i32),
        ("table_stride", _i64),
        *[
            (name, _p)
            for name in (
                "q_rows",
                "q_start",
                "out_start",
                "group_start",
                "group_shared",
                "tables",
                "ctx",
            )
        ],
    ]


@functools.cache
def forward_library() -> ctypes.CDLL | None:
    """The compiled layer loop, or None where it does not build."""
    try:
        lib = ctypes.CDLL(str(build(SOURCE)))
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("compiled layer loop unavailable, the layers run from Python: %s", e)
        return None
    fn = lib.docqa_forward_layers
    fn.argtypes = [
        ctypes.POINTER(_ModelDesc),
        ctypes.POINTER(_LayerDesc),
        ctypes.POINTER(_StepDesc),
    ]
    fn.restype = ctypes.c_int
    return lib


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


_CALLS = (
    "input RMSNorm",
    "qkv product",
    "rotary embedding and K/V store",
    "attention",
    "output product",
    "post-attention RMSNorm",
    "gate/up product",
    "SiLU times up",
    "down product",
)


def layers_compile_here(dtype: torch.dtype, kv_dtype: torch.dtype, cfg, block_size: int) -> bool:
    """Whether this CPU has a compiled kernel for every part of a layer of ``cfg``'s shapes in
    these dtypes (the products' packed panels, the element-wise steps, attention over a pool of
    ``kv_dtype`` and ``block_size``): where it has, ``CPUForward.build`` takes a model of that
    shape whose products it packed, and the layers run in one call a step. The tests ask this,
    never which CPU they run on."""
    if dtype not in (torch.bfloat16, torch.float32) or cfg.hidden_size % 16:
        return False
    if kv_dtype != dtype and not kv_quant.is_kv8(kv_dtype):
        return False
    if elementwise.elementwise_library() is None or forward_library() is None:
        return False
    heads, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if dtype == torch.bfloat16:
        return attention_kernels.bf16_kernel_supports(dtype, kv_dtype, heads, kvh, d) and bool(
            linear.linear_bf16_panel() or linear.linear_bf16_amx_available()
        )
    return attention_kernels.decode_kernel_supports(
        dtype, kv_dtype, heads, kvh, d, block_size
    ) and bool(linear.linear_f32_panel())


class CPUForward:
    """The layer loop of one model over one KV pool, in C, with the CPU attention backend
    ``backend`` planning each step's work groups. ``run`` does what the model's Python layer
    loop does: it updates ``h`` in place and returns the last layer's MLP output (not yet
    added). Its buffers are kept between steps (grown when a step has more rows), so it must
    be used from one thread at a time, as the engine's step loop does.

    It reads the model's weights through their addresses and holds none of the model's
    objects: the model holds it (``LlamaModel.layer_loop``), and a reference back would keep
    a deleted model alive until a garbage collection."""

    def __init__(self, model, kv_caches, backend, amx: bool):
        cfg = model.cfg
        self.cfg = cfg
        self.dtype = model.dtype
        self.backend = backend
        self.bf16 = model.dtype == torch.bfloat16
        # float32 attention on its register-tiled path plans units of up to 48 query rows
        self.tiled = not self.bf16 and attention_kernels.decode_attention_tiled(
            model.dtype, kv_caches[0][0].dtype, cfg.head_dim
        )
        el = elementwise.elementwise_library()
        suffix = "bf16" if self.bf16 else "f32"
        if amx:
            product = linear.amx_library().docqa_linear_bf16_amx
        else:
            product = getattr(linear.linear_library(), f"docqa_linear_{suffix}")
        attn_lib = attention_kernels.decode_attention_library()
        attention = attn_lib.docqa_attention_bf16 if self.bf16 else attn_lib.docqa_decode_attention
        rotary = getattr(el, f"docqa_rotary_store_{suffix}")
        kv_dtype = kv_caches[0][0].dtype
        kv_format = kv_quant.FORMAT_CODE.get(kv_dtype, 0)
        if kv_format:  # 8-bit caches
            attention = (
                attn_lib.docqa_attention_bf16_kv8
                if self.bf16
                else attn_lib.docqa_decode_attention_kv8
            )
            rotary = getattr(el, f"docqa_rotary_store_{suffix}_kv8")
        block_size = kv_caches[0][0].shape[1]
        self.desc = _ModelDesc(
            linear=_address(product),
            add_rms_norm=_address(getattr(el, f"docqa_add_rms_norm_{suffix}")),
            silu_mul=_address(getattr(el, f"docqa_silu_mul_{suffix}")),
            rotary_store=_address(rotary),
            attention=_address(attention),
            amx=int(amx),
            bf16=int(self.bf16),
            num_layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            inter=cfg.intermediate_size,
            block_size=block_size,
            eps=cfg.rms_norm_eps,
            scale=model.scale,
            kv_format=kv_format,
        )
        layers = (_LayerDesc * cfg.num_layers)()
        for d, lw, (k_cache, v_cache) in zip(layers, model.layers, kv_caches, strict=True):
            d.input_norm = lw.input_norm.data_ptr()
            d.post_norm = lw.post_norm.data_ptr()
            for name in ("qkv", "o_proj", "gate_up", "down"):
                setattr(d, name, getattr(lw, name).compiled()[1].data_ptr())
            bias = lw.qkv.compiled()[2]
            d.qkv_bias = None if bias is None else bias.data_ptr()
            d.k_cache, d.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            if kv_format:
                (ks, ki), (vs, vi) = kv_quant.scales_of(k_cache), kv_quant.scales_of(v_cache)
                d.k_scale, d.k_inv = ks.data_ptr(), ki.data_ptr()
                d.v_scale, d.v_inv = vs.data_ptr(), vi.data_ptr()
        self.layers = layers
        self.step = _StepDesc()
        # linear.c's partial sums, for products whose terms exceed its K_BLOCK: a row block of
        # the widest such product's padded outputs (linear_amx.c needs none)
        self.part_floats = 0
        if not amx:
            first = model.layers[0]  # every layer has the same shapes
            for lin in (first.qkv, first.o_proj, first.gate_up, first.down):
                terms = lin.in_features // 2 if self.bf16 else lin.in_features
                self.part_floats = max(
                    self.part_floats,
                    linear.linear_part_floats(linear.LINEAR_ROW_BLOCK, lin.out_features, terms),
                )
        self.widths = {  # the step's buffers: [rows, width] each
            "x": cfg.hidden_size,
            "qkv": (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
            "attn": cfg.num_heads * cfg.head_dim,
            "o": cfg.hidden_size,
            "gu": 2 * cfg.intermediate_size,
            "act": cfg.intermediate_size,
            "delta": cfg.hidden_size,
        }
        self.capacity = 0  # rows the kept buffers hold
        self.buffers: dict[str, torch.Tensor] = {}
        # what no step changes: the partial-sum scratch and the rotary tables
        self.part = torch.empty(max(self.part_floats, 1), dtype=torch.float32)
        self.step.part = self.part.data_ptr()
        self.step.cos = model.rotary.cos.data_ptr()
        self.step.sin = model.rotary.sin.data_ptr()

    @classmethod
    def build(cls, model, kv_caches, backend) -> CPUForward | None:
        """A CPUForward for the model over these caches (CPU tensors) with this attention
        backend, or None where a part has no compiled kernel (the model then runs its Python
        loop)."""
        cfg = model.cfg
        dtype = model.dtype
        if getattr(backend, "name", None) != "cpu" or not backend.plain_store or not kv_caches:
            return None
        k_cache = kv_caches[0][0]
        kv_dtype = k_cache.dtype  # the compute dtype's, or 8-bit
        if not layers_compile_here(dtype, kv_dtype, cfg, k_cache.shape[1]):
            return None
        if any(t.dtype != kv_dtype or not t.is_contiguous() for pair in kv_caches for t in pair):
            return None
        kinds = set()
        for lw in model.layers:
            for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
                kernel = lin.compiled()
                if kernel is None:
                    return None
                if kernel[2] is not None and lin is not lw.qkv:
                    return None  # only the qkv product may have a bias (Qwen2)
                kinds.add(kernel[0])
        if kinds == {"f32"} and dtype == torch.float32:
            return cls(model, kv_caches, backend, amx=False)
        if kinds == {"bf16"} and dtype == torch.bfloat16:
            return cls(model, kv_caches, backend, amx=False)
        if kinds == {"amx"} and dtype == torch.bfloat16:
            return cls(model, kv_caches, backend, amx=True)
        return None

    def _reserve(self, rows: int) -> None:
        """Buffers for at least ``rows`` rows, kept between steps; the step struct points at
        them (a step's rows start at each buffer's first element)."""
        if rows <= self.capacity:
            return
        self.capacity = max(rows, 2 * self.capacity)
        self.buffers = {
            name: torch.empty(self.capacity * w, dtype=self.dtype)
            for name, w in self.widths.items()
        }
        if not self.bf16:
            self.buffers["attn_f32"] = torch.empty(
                self.capacity * self.widths["attn"], dtype=torch.float32
            )
        for name, buf in self.buffers.items():
            setattr(self.step, name, buf.data_ptr())

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """``h`` [rows, hidden] (contiguous) through every layer, in place; returns the last
        layer's MLP output [rows, hidden] (a view of a kept buffer: valid until the next
        step)."""
        cfg = self.cfg
        rows = h.shape[0]
        backend = self.backend
        group = cfg.num_heads // cfg.num_kv_heads
        plan = backend.plan(meta, h.device, self.desc.block_size, group, self.bf16, self.tiled)
        self._reserve(rows)
        q_start = backend.offsets(meta, plan.q_rows, self.widths["qkv"])
        out_start = backend.offsets(meta, plan.q_rows, self.widths["attn"])
        s = self.step
        s.rows = rows
        s.num_threads = torch.get_num_threads()
        s.h = h.data_ptr()
        s.positions = positions.data_ptr()
        s.slots = meta.slot_mapping.data_ptr()
        s.num_tokens = plan.q_rows.shape[0]
        s.num_groups = plan.group_shared.shape[0]
        s.table_stride = plan.tables.stride(0)
        s.q_rows = plan.q_rows.data_ptr()
        s.q_start = q_start.data_ptr()
        s.out_start = out_start.data_ptr()
        s.group_start = plan.group_start.data_ptr()
        s.group_shared = plan.group_shared.data_ptr()
        s.tables = plan.tables.data_ptr()
        s.ctx = plan.ctx.data_ptr()
        rc = forward_library().docqa_forward_layers(self.desc, self.layers, s)
        if rc != 0:
            layer, call = divmod(rc - 1, 16)
            raise ValueError(
                f"layer {layer}: the {_CALLS[call]} kernel refused its sizes ({rows} rows)"
            )
        hidden = self.widths["delta"]
        return self.buffers["delta"][: rows * hidden].view(rows, hidden)
