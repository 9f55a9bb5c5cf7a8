"""Building the CPU kernels: once per process however many ask at once, and side by side at
start (``cpu_build.prebuild``)."""

import ctypes
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from inference.kernels.cpu import build as cpu_build


def _logging_compiler(tmp_path, monkeypatch) -> Path:
    """$CC: the machine's compiler, each call written to a log first (and slowed, so that
    calls made together overlap)."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    real = shutil.which("cc") or shutil.which("gcc")
    cc.write_text(f'#!/bin/sh\necho "$*" >> {log}\nsleep 0.5\nexec {real} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("DOCQA_HOME", str(tmp_path / "home"))
    return log


def test_a_kernel_built_by_several_callers_at_once_compiles_once(tmp_path, monkeypatch):
    log = _logging_compiler(tmp_path, monkeypatch)
    src = tmp_path / "one.c"
    src.write_text("int docqa_one(void) { return 1; }\n")
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: cpu_build.build(src), range(4)))
    assert len(set(paths)) == 1 and paths[0].is_file()
    assert len(log.read_text().splitlines()) == 1
    assert ctypes.CDLL(str(paths[0])).docqa_one() == 1
    # a failed build raises for every caller, and leaves nothing behind
    bad = tmp_path / "bad.c"
    bad.write_text("int docqa_bad(void) { return }\n")
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(cpu_build.build, bad) for _ in range(3)]
    for f in futures:
        with pytest.raises(cpu_build.KernelBuildError, match="bad.c"):
            f.result()
    assert sorted(p.name for p in (tmp_path / "home" / "kernels").iterdir()) == [paths[0].name]


def test_prebuilt_kernels_are_waited_for_not_built_again(tmp_path, monkeypatch):
    log = _logging_compiler(tmp_path, monkeypatch)
    sources = sorted(cpu_build.CSRC.glob("*.c"))
    # temporary outputs: one left by a process stopped mid-build long ago, one in progress
    kernels = tmp_path / "home" / "kernels"
    kernels.mkdir(parents=True)
    stale, fresh = kernels / ".linear-abc.so", kernels / ".linear-def.so"
    stale.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(stale, (time.time() - 7200,) * 2)
    cpu_build.prebuild()
    assert not stale.exists() and fresh.exists()
    # first use of each, while the builds run: one compiler call per source in all
    built = [cpu_build.build(src) for src in sources]
    assert all(p.is_file() for p in built)
    calls = log.read_text().splitlines()
    assert sorted(c.rsplit("/", 1)[-1] for c in calls) == [s.name for s in sources]
