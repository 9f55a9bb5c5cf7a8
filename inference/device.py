"""Which device the engine runs on, and which compute dtype ``auto`` means there.

``auto`` is bfloat16 on CUDA and on CPUs whose bf16 matrix products are faster than float32
ones, float32 on other CPUs. On a CPU the answer is measured once per machine and kept beside
the kernels, so every process sharing ``DOCQA_HOME`` runs one dtype.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from inference.kernels.cpu import linear
from inference.kernels.cpu.build import cpu_flags, machine_file
from inference.model.config import parse_dtype

log = logging.getLogger("docqa.engine")


def default_device() -> torch.device:
    """CUDA when torch sees a GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parallel_units(device: torch.device, fallback: int = 4) -> int:
    """A device's units that run programs side by side: a GPU's multiprocessors; elsewhere
    (Triton's interpreter on the CPU) ``fallback``."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return fallback


def cgroup_cpu_limit(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> float | None:
    """The CPUs this process's cgroup may use: the tightest CFS quota over its period of its
    cgroup and their parents (v2 ``cpu.max``; v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), as a container's CPU limit sets it; None where none is set or
    none can be read. torch's thread count follows the cores it sees, not this."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:  # cgroup v2
            bases, files = [root, root / "unified"], ("cpu.max",)
        elif "cpu" in controllers.split(","):  # cgroup v1
            bases = [root / controllers, root / "cpu", root / "cpu,cpuacct"]
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for base in bases:
            if not base.is_dir():
                continue
            d = base / path.strip("/")
            while True:
                limit = _cfs_limit(d, files)
                if limit is not None:
                    limits.append(limit)
                if d == base or base not in d.parents:
                    break
                d = d.parent
            break
    return min(limits) if limits else None


def _cfs_limit(d: Path, files: tuple[str, ...]) -> float | None:
    try:
        if len(files) == 1:  # "max 100000" or "150000 100000"
            quota, period = (d / files[0]).read_text().split()[:2]
        else:
            quota, period = ((d / f).read_text().strip() for f in files)
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def default_threads() -> int:
    """torch's threads for an engine not told: torch's own count (the cores it sees), or
    fewer where the process's cgroup holds it to fewer CPUs (a container's CPU limit): more
    threads than its quota makes OpenMP's threads wait on each other's time slices."""
    threads = torch.get_num_threads()
    limit = cgroup_cpu_limit()
    return max(1, min(threads, math.ceil(limit))) if limit else threads


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 matrix products run natively (else oneDNN emulates them,
    several times slower than float32)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


# the version of the measurement below: a record written by another version is measured anew
_DTYPE_PROBE_VERSION = 2


def _dtype_record_path() -> Path:
    """Where this machine's answer to ``cpu_bf16_matmul_is_faster`` is kept
    (``machine_file``), keyed by the sources of the products it weighs, which of
    them are built here (DOCQA_CPU_KERNELS=0 weighs torch's) and the measurement's version."""
    built = (
        linear.linear_f32_panel(),
        linear.linear_bf16_panel(),
        linear.linear_bf16_amx_available(),
    )
    return machine_file(
        "auto-dtype",
        str(_DTYPE_PROBE_VERSION),
        repr(built),
        linear.LINEAR_SOURCE.read_bytes().decode(errors="replace"),
        linear.AMX_SOURCE.read_bytes().decode(errors="replace"),
    )


def _measure_bf16_against_float32() -> float:
    """bf16 time over float32 time for the products the model would run (``CPULinear``):
    linear.c in float32 against linear_amx.c where the tile unit is ours, else
    linear.c's bf16 panels; torch's where those do not build. The two run in turn, seven times
    each after a warm-up, on one thread timed in its CPU time (other busy processes cannot
    change it); the median of the seven ratios."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 576, generator=gen)
    w = torch.randn(1536, 576, generator=gen)
    panels = linear.linear_f32_panel()
    amx = panels and linear.linear_bf16_amx_available()
    if panels and (amx or linear.linear_bf16_panel()):
        f32 = functools.partial(linear.linear_f32, a, linear.pack_linear_f32(w), 1536)
        if amx:
            p16 = linear.pack_linear_bf16_amx(w.bfloat16())
            f16 = functools.partial(linear.linear_bf16_amx, a.bfloat16(), p16, 1536)
        else:
            p16 = linear.pack_linear_bf16(w.bfloat16())
            f16 = functools.partial(linear.linear_bf16, a.bfloat16(), p16, 1536)
    else:
        f32 = functools.partial(torch.mm, a, w.T)
        f16 = functools.partial(torch.mm, a.bfloat16(), w.bfloat16().T)

    def timed(product) -> float:
        t = time.thread_time()
        product()
        return max(time.thread_time() - t, 1e-9)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            timed(f32), timed(f16)
            ratios = sorted(timed(f16) / timed(f32) for _ in range(7))
    finally:
        torch.set_num_threads(threads)
    return ratios[len(ratios) // 2]


@functools.cache
def cpu_bf16_matmul_is_faster() -> bool:
    """Whether bf16 matrix products beat float32 ones on this CPU: native bf16 support alone
    does not decide it (csrc/README.md, "The auto dtype", has what each CPU measured). The
    products the model would run are compared (``_measure_bf16_against_float32``).

    Measured once per machine: the first process writes the answer beside the kernels
    (``_dtype_record_path``) and every later one reads it, so replicas sharing ``DOCQA_HOME``
    (compose's volume, one test run) run one dtype, and with it one prefix-cache fingerprint,
    even where the two dtypes are that close. Where two start together, the first record
    written wins for both. Delete the record to measure again."""
    if not cpu_has_native_bf16():
        return False
    path = _dtype_record_path()
    try:
        record, how = json.loads(path.read_text()), "as measured before"
        if not isinstance(record["bf16_faster"], bool):
            raise ValueError(record)
    except (OSError, ValueError, KeyError, TypeError):
        ratio = _measure_bf16_against_float32()
        mine = {"bf16_faster": ratio < 1.0, "bf16_over_float32_time": round(ratio, 3)}
        record = _keep_first(path, mine)
        how = "measured now" if record == mine else f"as another process measured ({mine} here)"
    log.info(
        "dtype: auto is %s, %s (bf16 products %sx the float32 time; %s)",
        "bfloat16" if record["bf16_faster"] else "float32",
        how,
        record.get("bf16_over_float32_time", "?"),
        path,
    )
    return bool(record["bf16_faster"])


def _keep_first(path: Path, record: dict) -> dict:
    """Writes ``record`` to ``path`` unless another process wrote there first (a temporary
    file, then a hard link, which fails where the name exists); returns the record kept there,
    or ``record`` itself where none can be kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("could not keep %s in %s (%s)", record, path, e)
        return record


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and on CPUs whose bf16 products are faster than float32
    ones (``cpu_bf16_matmul_is_faster``); float32 on other CPUs. Answers are unchanged either
    way in the sense of bench/ttft.py and tests/test_real_model.py."""
    if dtype == "auto":
        if device.type == "cpu" and not cpu_bf16_matmul_is_faster():
            return torch.float32
        return torch.bfloat16
    return parse_dtype(dtype)


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_during(device: torch.device, fn) -> int | None:
    """Bytes of memory in use at the peak of ``fn()``, above what was in use when it began:
    on a GPU from torch's allocator statistics (its cache emptied first), on the CPU from the
    process's resident high-water mark (Linux: reset through /proc/self/clear_refs); None
    where the CPU gives no such mark."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
        return peak
    base = _proc_status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark back to the resident set now
    except OSError:
        base = None
    fn()
    peak = _proc_status_kib("VmHWM")
    if base is None or peak is None:
        return None
    return max(0, peak - base) * 1024


def capturing_graph(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``t``'s device (its kernels' grids are then
    fixed for every replay)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def tensor_from_host(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``: on a GPU through pinned memory and an
    asynchronous copy, so the host never waits for the device's queued work."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
