"""The attention kernels of ``csrc/decode_attention.c``: every token of a step, prompt and
decode alike, read in place from the paged KV pool in rounds of ``ROUND`` keys from key 0.

bf16 on AVX512-BF16 (``attention_bf16``, tile products on AMX where the CPU has it), float32
and mixed dtypes elsewhere (``decode_attention``, register-tiled on x86 with FMA). Tokens go in
work groups (``decode_groups``, and the plans of ``inference.attention.backends.CPUBackend``)
whose shared keys are read once for all of them; how tokens are grouped never changes a
token's result.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from inference import kv_quant
from inference.kernels.cpu.build import CSRC, DTYPES, KernelBuildError, build, kernels_enabled

log = logging.getLogger("docqa.engine")

SOURCE = CSRC / "decode_attention.c"
# the kernel's limits (decode_attention.c): head_dim a multiple of 32 up to 256, at most 16
# query heads per KV head; blocks of more than 64 tokens (128) are left to the torch path, the
# kernel's tests covering 8 to 32
MAX_DIM, MAX_GROUP, MAX_BLOCK = 256, 16, 64


def _attention_signatures() -> dict[str, tuple[list, type]]:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    return {
        "docqa_decode_attention": (
            [p, i, p, i, p, p, i, p, p, i, p, i64, p, i, i, i, i, f, p, i],
            i,
        ),
        "docqa_attention_bf16": ([p, p, i, p, p, i, p, p, p, i64, p, i, i, i, i, f, p, p, i], i),
        "docqa_attention_bf16_kv8": (
            [p, p, i, p, p, i, p, p, p, i64, p, i, i, i, i, f, p, p, i, i, p, p],
            i,
        ),
        "docqa_attention_bf16_exp": ([p, p, i64], i),
        "docqa_attention_bf16_dims": ([], i),
        "docqa_decode_attention_tiled": ([i, i, i], i),
        "docqa_decode_attention_kv8": (
            [p, p, i, p, p, i, p, p, p, i64, p, i, i, i, i, f, p, i, i, p, p],
            i,
        ),
        "docqa_decode_attention_kv8_tiled": ([i], i),
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
    if not kernels_enabled():
        return False
    try:
        decode_attention_library()
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable, using the torch paths: %s", e)
        return False
    return True


def decode_kernel_supports(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    dim: int,
    block_size: int,
) -> bool:
    if kv_quant.is_kv8(kv_dtype):  # float32 queries on the register-tiled path only
        kv_ok = q_dtype == torch.float32 and decode_attention_tiled(q_dtype, kv_dtype, dim)
    else:
        kv_ok = q_dtype in DTYPES and kv_dtype in DTYPES
    return (
        kv_ok
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
    larger units cost less (csrc/README.md, "Unit sizes")."""
    lib = decode_attention_library()
    return BF16_MAX_ROWS if lib.amx else 48


def bf16_kernel_supports(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int, dim: int
) -> bool:
    """Whether ``attention_bf16`` takes these shapes on this CPU (AVX512-BF16, bf16 q, bf16 or
    8-bit K/V, head_dim 64 or 128, at most BF16_MAX_ROWS query heads per KV head)."""
    if q_dtype != torch.bfloat16 or dim not in (64, 128):
        return False
    if kv_dtype != torch.bfloat16 and not kv_quant.is_kv8(kv_dtype):
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
    chunk's tokens may walk the chunk's last context together, each masked at its own. Over
    8-bit caches: float32 queries, AVX2 with F16C (``docqa_decode_attention_kv8``)."""
    lib = decode_attention_library()
    if kv_quant.is_kv8(kv_dtype):
        kv8 = getattr(lib, "docqa_decode_attention_kv8_tiled", None)
        return q_dtype == torch.float32 and kv8 is not None and bool(kv8(dim))
    if q_dtype not in DTYPES or kv_dtype not in DTYPES:
        return False
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
    lib = decode_attention_library()
    if kv_quant.is_kv8(k_cache.dtype):  # float32 queries over 8-bit caches, with their scales
        fn = lib.docqa_decode_attention_kv8
        head = [q.data_ptr(), q_start.data_ptr(), t, group_start.data_ptr()]
        caches = [k_cache.data_ptr(), v_cache.data_ptr()]
        extra = [kv_quant.FORMAT_CODE[k_cache.dtype]]
        extra += [
            kv_quant.scales_of(k_cache)[0].data_ptr(),
            kv_quant.scales_of(v_cache)[0].data_ptr(),
        ]
    else:
        fn = lib.docqa_decode_attention
        head = [q.data_ptr(), DTYPES[q.dtype], q_start.data_ptr(), t, group_start.data_ptr()]
        caches = [k_cache.data_ptr(), v_cache.data_ptr(), DTYPES[k_cache.dtype]]
        extra = []
    rc = fn(
        *head,
        group_shared.data_ptr(),
        group_shared.shape[0],
        *caches,
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
        *extra,
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
    place into ``out`` (``docqa_attention_bf16``; over 8-bit caches, with their scales,
    ``docqa_attention_bf16_kv8``)."""
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
    lib = decode_attention_library()
    fn, extra = lib.docqa_attention_bf16, []
    if kv_quant.is_kv8(k_cache.dtype):
        fn = lib.docqa_attention_bf16_kv8
        fmt = kv_quant.FORMAT_CODE[k_cache.dtype]
        extra = [fmt, kv_quant.scales_of(k_cache)[0].data_ptr()]
        extra.append(kv_quant.scales_of(v_cache)[0].data_ptr())
    rc = fn(
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
        *extra,
    )
    if rc != 0:
        raise ValueError("bf16 attention kernel: shape or groups outside its limits")
    return out
