"""CPU kernels compiled from ``inference/csrc`` on first use.

The C sources are built with the machine's C compiler (``$CC``, else ``cc``/``gcc``) for the
CPU they run on (``-march=native``) and kept under ``$DOCQA_HOME/kernels``, keyed by the source
(and the headers beside it), the flags and the CPU, so a change of any of them builds anew and
replicas that start together share one build (written to a temporary name, then renamed).
Without a compiler the engine runs its torch paths instead (``kernels_available`` says which).

OpenMP: the library links ``libgomp.so.1``, the runtime torch's CPU build already loaded, so
its threads are torch's threads; each call runs on ``torch.get_num_threads()`` of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from inference.model_import import docqa_home

log = logging.getLogger("docqa.engine")

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
LINEAR_SOURCE = Path(__file__).parent / "csrc" / "linear.c"
AMX_SOURCE = Path(__file__).parent / "csrc" / "linear_amx.c"
ELEMENTWISE_SOURCE = Path(__file__).parent / "csrc" / "elementwise.c"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# the kernel's limits (decode_attention.c): head_dim a multiple of 32 up to 256, at most 16
# query heads per KV head; blocks of more than 64 tokens (128) are left to the torch path, the
# kernel's tests covering 8 to 32
MAX_DIM, MAX_GROUP, MAX_BLOCK = 256, 16, 64


class KernelBuildError(RuntimeError):
    pass


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return shutil.which("cc") or shutil.which("gcc")


@functools.cache
def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_id() -> str:
    """What -march=native depends on: the CPU's model name and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def machine_file(stem: str, *key: str) -> Path:
    """Where a measurement of this machine is kept between processes: a JSON file under
    ``$DOCQA_HOME/kernels`` (beside the builds), named by ``stem`` and a hash of torch's
    version, the CPU (``cpu_id``) and whatever else the measurement depends on (``key``)."""
    h = hashlib.sha256("|".join((torch.__version__, cpu_id(), *key)).encode()).hexdigest()
    return docqa_home() / "kernels" / f"{stem}-{h[:16]}.json"


# builds in flight in this process, by output: a second caller waits for the first's
_building: dict[Path, concurrent.futures.Future] = {}
_building_lock = threading.Lock()
_prebuilt: set[Path] = set()  # the kernel directories prebuild has started on


def build(src: Path) -> Path:
    """The shared library of ``src`` for this CPU, built on first use (module docstring);
    raises KernelBuildError. A build this process already runs (``prebuild``) is waited for,
    not started again."""
    cc = _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler (set CC, or install gcc)")
    h = hashlib.sha256()
    headers = [p.read_bytes() for p in sorted(src.parent.glob("*.h"))]  # what sources include
    for part in (src.read_bytes(), *headers, " ".join(CFLAGS).encode(), cpu_id().encode()):
        h.update(part)
    h.update(cc.encode())
    out_dir = docqa_home() / "kernels"
    out = out_dir / f"{src.stem}-{h.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    with _building_lock:
        running = _building.get(out)
        if running is None:
            mine = _building[out] = concurrent.futures.Future()
    if running is not None:
        return running.result()
    try:
        _compile(cc, src, out)
        mine.set_result(out)
    except BaseException as e:
        mine.set_exception(e)
        raise
    finally:
        with _building_lock:
            del _building[out]
    return out


def _compile(cc: str, src: Path, out: Path) -> None:
    out_dir = out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{src.stem}-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *CFLAGS, "-o", tmp, str(src)], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise KernelBuildError(f"{cc} failed on {src.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s", out)


def prebuild() -> None:
    """Starts building the CPU kernels this machine lacks, each in a thread of its own, and
    returns: a first start then compiles them side by side, and beside the model's import and
    loading, where first use would build them one after another (on 2 cores, 7 s for the two
    largest together against 13 s in turn). Each library's first use waits for its build.
    Once a process per kernel directory: the server calls it before the model's import, the
    engine again as it starts."""
    if os.environ.get("DOCQA_CPU_KERNELS", "1") == "0" or _compiler() is None:
        return
    with _building_lock:
        if docqa_home() / "kernels" in _prebuilt:
            return
        _prebuilt.add(docqa_home() / "kernels")
    # a process stopped while it compiled leaves its temporary output behind: those an hour
    # old are no build in progress (the compiler has two minutes)
    for tmp in (docqa_home() / "kernels").glob(".*.so"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > 3600:
                tmp.unlink()

    def run(src: Path) -> None:
        # a failure is left to first use, which builds again and reports it
        with contextlib.suppress(KernelBuildError, OSError, subprocess.SubprocessError):
            build(src)

    for src in sorted(SOURCE.parent.glob("*.c")):  # the layer loop's forward.c among them
        threading.Thread(target=run, args=(src,), name=f"build-{src.stem}", daemon=True).start()


def _attention_signatures() -> dict[str, tuple[list, type]]:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    return {
        "docqa_decode_attention": (
            [p, i, p, i, p, p, i, p, p, i, p, i64, p, i, i, i, i, f, p, i],
            i,
        ),
        "docqa_attention_bf16": ([p, p, i, p, p, i, p, p, p, i64, p, i, i, i, i, f, p, p, i], i),
        "docqa_attention_bf16_exp": ([p, p, i64], i),
        "docqa_attention_bf16_dims": ([], i),
        "docqa_decode_attention_tiled": ([i, i, i], i),
        "docqa_attention_amx_init": ([], i),
    }


def attention_library_at(path: Path) -> ctypes.CDLL:
    """A build of the attention kernels (this tree's, or another revision's for
    bench/attention.py): the entry points it has declared, and the tile unit asked for where
    it can use it."""
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _attention_signatures().items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = restype
    # bf16 products on the AMX tile unit where the CPU, the build and Linux allow it (every
    # bf16 token of the process then takes the same path: -1 keeps the vector path)
    lib.amx = hasattr(lib, "docqa_attention_amx_init") and lib.docqa_attention_amx_init() == 0
    return lib


@functools.cache
def decode_attention_library() -> ctypes.CDLL:
    """The compiled attention kernels (built on first use); raises KernelBuildError."""
    return attention_library_at(build(SOURCE))


def kernels_available() -> bool:
    """Whether the CPU kernels build and load here (the first call builds them)."""
    if os.environ.get("DOCQA_CPU_KERNELS", "1") == "0":
        return False
    try:
        decode_attention_library()
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable, using the torch paths: %s", e)
        return False
    return True


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
    if os.environ.get("DOCQA_CPU_KERNELS", "1") == "0":
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
    if os.environ.get("DOCQA_CPU_KERNELS", "1") == "0":
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


@functools.cache
def elementwise_library() -> ctypes.CDLL | None:
    """The compiled fused element-wise steps (bf16 and float32), or None where they do not
    build."""
    if os.environ.get("DOCQA_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build(ELEMENTWISE_SOURCE)))
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("fused element-wise kernels unavailable, using torch's: %s", e)
        return None
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for suffix in ("bf16", "f32"):
        fn = getattr(lib, f"docqa_add_rms_norm_{suffix}")
        fn.argtypes, fn.restype = [p, i64, p, i64, p, p, i64, i, i, f, i], i
        fn = getattr(lib, f"docqa_silu_mul_{suffix}")
        fn.argtypes, fn.restype = [p, i64, i, i, p, i64, i], i
        fn = getattr(lib, f"docqa_rotary_store_{suffix}")
        fn.argtypes, fn.restype = [p, i64, i, i, i, i, p, p, p, p, p, p, i], i
    lib.docqa_argmax_f32.argtypes, lib.docqa_argmax_f32.restype = [p, i, i, i64, p, i], i
    return lib


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's ``torch.argmax`` (the first of equal maxima, the first NaN where a row has
    one) for float32 logits on the CPU, through elementwise.c where it builds: a decode step's
    greedy tokens (16 rows of 49,152 logits: 0.04 ms there against 0.5-0.9 in torch)."""
    lib = elementwise_library()
    if (
        lib is None
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.shape[1] == 0
        or x.stride(1) != 1
    ):
        return torch.argmax(x, dim=-1).tolist()
    m, n = x.shape
    out = torch.empty(m, dtype=torch.int64)
    rc = lib.docqa_argmax_f32(
        x.data_ptr(), m, n, x.stride(0) if m > 1 else n, out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"argmax kernel: bad sizes {tuple(x.shape)}")
    return out.tolist()


_ELEMENTWISE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@functools.cache
def _elementwise(name: str, dtype: torch.dtype):
    """The compiled step ``name`` for ``dtype`` (looked up once: it is called every layer)."""
    return getattr(elementwise_library(), f"docqa_{name}_{_ELEMENTWISE_SUFFIX[dtype]}")


def fused_elementwise_supports(x: torch.Tensor) -> bool:
    """Whether ``add_rms_norm``, ``silu_mul`` and ``rotary_store`` take this activation
    (bf16 or float32 on the CPU, rows dense) here."""
    return (
        x.device.type == "cpu"
        and x.dtype in _ELEMENTWISE_SUFFIX
        and x.dim() == 2
        and x.stride(1) == 1
        and x.shape[1] % 16 == 0
        and elementwise_library() is not None
    )


def add_rms_norm(
    h: torch.Tensor,  # [n, d] bf16 or float32, the residual stream: updated in place with delta
    delta: torch.Tensor | None,  # [n, d], h's dtype
    weight: torch.Tensor,  # [d], h's dtype
    eps: float,
) -> torch.Tensor:
    """``h += delta`` (in bf16 rounded to bf16), then RMSNorm of each row of h with
    ``weight``, as ``layers.rms_norm`` computes it; one pass per row."""
    n, d = h.shape
    if delta is not None:
        assert delta.shape == h.shape and delta.dtype == h.dtype and delta.stride(1) == 1
    assert weight.dtype == h.dtype
    w = weight.contiguous()
    x = h.new_empty(n, d)
    rc = _elementwise("add_rms_norm", h.dtype)(
        h.data_ptr(),
        h.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        w.data_ptr(),
        x.data_ptr(),
        d,
        n,
        d,
        eps,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"add_rms_norm: bad shape {tuple(h.shape)}")
    return x


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """[n, 2 * inter] bf16 or float32 (gate, then up) -> silu(gate) * up, [n, inter] (in bf16
    rounded once)."""
    n = gu.shape[0]
    assert gu.shape[1] == 2 * inter and gu.stride(1) == 1
    out = gu.new_empty(n, inter)
    rc = _elementwise("silu_mul", gu.dtype)(
        gu.data_ptr(), gu.stride(0), n, inter, out.data_ptr(), inter, torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"silu_mul: bad shape {tuple(gu.shape)}")
    return out


def rotary_store(
    qkv: torch.Tensor,  # [n, (heads + 2 kv heads) * d] bf16 or float32, rows dense: q and k
    # rotated in place
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,  # [n] int64
    cos: torch.Tensor,  # [max positions, d], qkv's dtype
    sin: torch.Tensor,
    slots: torch.Tensor,  # [n] int64, the token's cache slot (block * block_size + offset), -1 none
    k_cache: torch.Tensor,  # [blocks, block_size, kv heads, d], qkv's dtype
    v_cache: torch.Tensor,
) -> None:
    """Rotary embedding of the query and key heads in place, then each token's key and value
    heads stored in its cache slot: one pass per token."""
    n = qkv.shape[0]
    d = cos.shape[1]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d
    assert cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and positions.dtype == slots.dtype == torch.int64
    assert cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype == qkv.dtype
    rc = _elementwise("rotary_store", qkv.dtype)(
        qkv.data_ptr(),
        qkv.stride(0),
        n,
        num_heads,
        num_kv_heads,
        d,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"rotary_store: bad shape {tuple(qkv.shape)}")


def decode_kernel_supports(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    dim: int,
    block_size: int,
) -> bool:
    return (
        q_dtype in DTYPES
        and kv_dtype in DTYPES
        and dim % 32 == 0
        and dim <= MAX_DIM
        and block_size <= MAX_BLOCK
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


ROUND = 64  # keys per online-softmax round (decode_attention.c); shared parts end on one
MAX_ROWS = 16  # query rows per work unit of docqa_decode_attention
TILED_MAX_ROWS = 48  # the same on its register-tiled float32 path (decode_attention_tiled)
BF16_MAX_ROWS = 96  # query rows per work unit of docqa_attention_bf16 (its capacity)


def bf16_unit_rows() -> int:
    """Query rows the plan gives a unit of ``attention_bf16``: 96 (32 tokens of 3 query heads)
    where the tile unit runs it, 48 elsewhere. Each unit reads its keys and stages them once
    for all its rows; on the tile unit its rows go 16 a tile against the staged keys, so fewer,
    larger units cost less (a 51-token question after a cached 1,051-token manual, in one step
    on a 2-core Xeon with AMX, interleaved runs: 25.1-27.3 ms in units of 96 rows, 26.2-28.9
    in units of 48; 16 decodes and that question 36.6-37.8 against 38.4-39.6). Elsewhere
    units keep the 48 rows the AVX512-BF16 paths were measured with (Zen 4)."""
    lib = decode_attention_library()
    return BF16_MAX_ROWS if lib.amx else 48


def bf16_kernel_supports(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int, dim: int
) -> bool:
    """Whether ``attention_bf16`` takes these shapes on this CPU (AVX512-BF16, bf16 q and K/V,
    head_dim 64 or 128, at most BF16_MAX_ROWS query heads per KV head)."""
    if q_dtype != torch.bfloat16 or kv_dtype != torch.bfloat16 or dim not in (64, 128):
        return False
    if num_heads % num_kv_heads or num_heads // num_kv_heads > BF16_MAX_ROWS:
        return False
    return bool(_bf16_dims() & dim)


@functools.cache
def _bf16_dims() -> int:
    return decode_attention_library().docqa_attention_bf16_dims()


@functools.cache
def decode_attention_tiled(q_dtype: torch.dtype, kv_dtype: torch.dtype, dim: int) -> bool:
    """Whether ``decode_attention`` takes these dtypes and head size on its register-tiled
    float32 path here (x86 with FMA): units of up to TILED_MAX_ROWS query rows, and a prompt
    chunk's tokens may walk the chunk's last context together, each masked at its own."""
    if q_dtype not in DTYPES or kv_dtype not in DTYPES:
        return False
    lib = decode_attention_library()
    return bool(lib.docqa_decode_attention_tiled(DTYPES[q_dtype], DTYPES[kv_dtype], dim))


def decode_groups(
    tables: list[list[int]],
    ctx_lens: list[int],
    block_size: int,
    group: int,
    max_rows: int = MAX_ROWS,
) -> tuple[list[int], list[int], list[int]]:
    """Tokens whose contexts start with the same blocks, as the kernel's work groups.

    Returns (order, group_start, group_shared): the tokens in group order, each group's first
    position in ``order`` (plus the end), and the keys each group's tokens share (a multiple
    of ``ROUND``). A group holds at most ``max_rows // group`` tokens. How tokens are grouped
    only decides which K/V rows are read once for several tokens, never a token's result.

    The tokens are sorted by block table, so answers about one manual lie side by side, and
    the sorted run is split at its weakest link (the shortest common prefix of two neighbours)
    while a part is too large, shares nothing, or splitting lets the parts share more keys in
    all: prompts that begin with the same system instructions but go on to different manuals
    part at the manual.
    """
    per_group = max(1, max_rows // group)
    sorted_tokens = sorted(range(len(tables)), key=lambda t: tables[t])

    def common_keys(a: int, b: int) -> int:
        """Keys two tokens share: whole common blocks before either token's last key."""
        ta, tb = tables[a], tables[b]
        n, limit = 0, min(len(ta), len(tb))
        while n < limit and ta[n] == tb[n]:
            n += 1
        keys = min(n * block_size, ctx_lens[a] - 1, ctx_lens[b] - 1)
        return max(0, keys // ROUND * ROUND)

    # link[i]: keys shared by sorted tokens i - 1 and i; a run's shared keys are its minimum
    link = [0] + [common_keys(a, b) for a, b in zip(sorted_tokens, sorted_tokens[1:], strict=False)]

    def shared_of(lo: int, hi: int) -> int:
        return min(link[lo + 1 : hi]) if hi - lo > 1 else 0

    order: list[int] = []
    starts: list[int] = [0]
    shared: list[int] = []
    stack = [(0, len(sorted_tokens))]
    while stack:
        lo, hi = stack.pop()
        keep = shared_of(lo, hi)
        if hi - lo > 1:
            cut = min(range(lo + 1, hi), key=lambda i: link[i])
            gain = shared_of(lo, cut) * (cut - lo - 1) + shared_of(cut, hi) * (hi - cut - 1)
            if hi - lo > per_group or keep == 0 or gain > keep * (hi - lo - 1):
                stack.append((cut, hi))  # popped after [lo, cut): the sorted order is kept
                stack.append((lo, cut))
                continue
        order.extend(sorted_tokens[lo:hi])
        starts.append(len(order))
        shared.append(keep)
    return order, starts, shared


def decode_attention(
    q: torch.Tensor,  # [num_rows, num_heads, dim], heads and dims dense (rows may be strided)
    q_rows: torch.Tensor,  # [T] int64: the decode tokens' rows of q, in group order
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [T, max_blocks] int32, contiguous, in group order
    ctx_lens: torch.Tensor,  # [T] int32, in group order
    scale: float,
    group_start: torch.Tensor | None = None,  # [G + 1] int32 (decode_groups); None: one each
    group_shared: torch.Tensor | None = None,  # [G] int32
    q_start: torch.Tensor | None = None,  # [T] int64 q_rows * q.stride(0), when already known
) -> torch.Tensor:  # [T, num_heads, dim] float32, in group order
    """Each decode token's attention over its context, read in place from the pool."""
    assert q.stride(2) == 1 and q.stride(1) == q.shape[2]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous()
    assert ctx_lens.dtype == torch.int32 and q_rows.dtype == torch.int64
    _, num_heads, dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    t = q_rows.shape[0]
    if group_start is None:
        group_start = torch.arange(t + 1, dtype=torch.int32)
        group_shared = torch.zeros(t, dtype=torch.int32)
    assert group_start.dtype == torch.int32 and group_shared.dtype == torch.int32
    out = torch.empty((t, num_heads, dim), dtype=torch.float32)
    if q_start is None:  # each token's first element (held until the call returns)
        q_start = q_rows * q.stride(0)
    rc = decode_attention_library().docqa_decode_attention(
        q.data_ptr(),
        DTYPES[q.dtype],
        q_start.data_ptr(),
        t,
        group_start.data_ptr(),
        group_shared.data_ptr(),
        group_shared.shape[0],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        DTYPES[k_cache.dtype],
        block_tables.data_ptr(),
        block_tables.stride(0),
        ctx_lens.data_ptr(),
        num_heads,
        num_kv_heads,
        dim,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError("decode attention kernel: shape or groups outside its limits")
    return out


def attention_bf16(
    q: torch.Tensor,  # [num_rows, num_heads, dim] bf16, heads and dims dense (rows may be strided)
    q_rows: torch.Tensor,  # [T] int64: each token's row of q, in group order
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, dim] bf16, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [T, max_blocks] int32, contiguous, in group order
    ctx_lens: torch.Tensor,  # [T] int32, in group order
    scale: float,
    group_start: torch.Tensor,  # [G + 1] int32
    group_shared: torch.Tensor,  # [G] int32: a multiple of ROUND, or >= every context of G
    out: torch.Tensor,  # [num_rows, num_heads, dim] bf16, contiguous: token t's row q_rows[t]
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,  # q_rows times q's, out's row
    # strides, when already known (the same for every layer of a step)
) -> torch.Tensor:
    """Attention of prompt and decode tokens alike, read in place from the pool and written in
    place into ``out`` (``docqa_attention_bf16``)."""
    assert q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == q.shape[2]
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape[1:] == q.shape[1:]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous()
    assert ctx_lens.dtype == torch.int32 and q_rows.dtype == torch.int64
    assert group_start.dtype == torch.int32 and group_shared.dtype == torch.int32
    _, num_heads, dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if offsets is None:  # held until the call returns
        offsets = (q_rows * q.stride(0), q_rows * out.stride(0))
    q_start, out_start = offsets
    rc = decode_attention_library().docqa_attention_bf16(
        q.data_ptr(),
        q_start.data_ptr(),
        q_rows.shape[0],
        group_start.data_ptr(),
        group_shared.data_ptr(),
        group_shared.shape[0],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        ctx_lens.data_ptr(),
        num_heads,
        num_kv_heads,
        dim,
        block_size,
        scale,
        out.data_ptr(),
        out_start.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError("bf16 attention kernel: shape or groups outside its limits")
    return out
