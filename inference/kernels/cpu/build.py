"""Building the CPU kernels of ``csrc/`` on first use.

The C sources are built with the machine's C compiler (``$CC``, else ``cc``/``gcc``) for the
CPU they run on (``-march=native``) and kept under ``$DOCQA_HOME/kernels``, keyed by the source
(and the headers beside it), the flags and the CPU, so a change of any of them builds anew and
replicas that start together share one build (written to a temporary name, then renamed).
Without a compiler (or with ``DOCQA_CPU_KERNELS=0``) the engine runs torch's operations instead.

OpenMP: the library links ``libgomp.so.1``, the runtime torch's CPU build already loaded, so
its threads are torch's threads; each call runs on ``torch.get_num_threads()`` of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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

from inference.model.model_import import docqa_home

log = logging.getLogger("docqa.engine")

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
# the C kernels' dtype codes
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class KernelBuildError(RuntimeError):
    pass


def kernels_enabled() -> bool:
    """False where ``DOCQA_CPU_KERNELS=0`` turns the compiled kernels off."""
    return os.environ.get("DOCQA_CPU_KERNELS", "1") != "0"


def compiler() -> str | None:
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
    cc = compiler()
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
    loading, where first use would build them one after another. Each library's first use
    waits for its build. Once a process per kernel directory: the server calls it before the
    model's import, the runner again as it starts."""
    if not kernels_enabled() or compiler() is None:
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

    for src in sorted(CSRC.glob("*.c")):  # the layer loop's forward.c among them
        threading.Thread(target=run, args=(src,), name=f"build-{src.stem}", daemon=True).start()
