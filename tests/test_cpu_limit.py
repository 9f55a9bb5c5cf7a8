"""An engine not told its threads takes as many as its cgroup's CPU quota allows (a container's
CPU limit), not one a core it sees: cgroup v2 and v1 layouts, nested limits, none set; and a
real engine started under a real cgroup v1 quota."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference.device import cgroup_cpu_limit


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cgroups(tmp_path: Path, own: str, files: dict[str, str]) -> Path:
    """A /proc/self/cgroup of the line ``own`` at tmp_path/self, and a cgroup tree of these
    files (path under the root -> its text); returns the tree's root."""
    root = tmp_path / "cg"
    _write(tmp_path / "self", own)
    for path, text in files.items():
        _write(root / path, text)
    return root


def test_cgroup_v2_quota_the_tightest_of_the_path(tmp_path):
    root = _cgroups(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "250000 100000\n",
        "kubepods/pod1/ctr/cpu.max": "150000 100000\n",
    })  # fmt: skip
    assert cgroup_cpu_limit(tmp_path / "self", root) == 1.5
    _write(root / "kubepods/pod1/cpu.max", "50000 100000\n")  # the pod's limit is tighter
    assert cgroup_cpu_limit(tmp_path / "self", root) == 0.5


def test_cgroup_v1_quota_and_none_set(tmp_path):
    root = _cgroups(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    assert cgroup_cpu_limit(tmp_path / "self", root) is None  # unlimited
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n")
    assert cgroup_cpu_limit(tmp_path / "self", root) == 3.0
    assert cgroup_cpu_limit(tmp_path / "missing", root) is None
    _write(tmp_path / "garbled", "no colons here\n")
    assert cgroup_cpu_limit(tmp_path / "garbled", root) is None


CPU_V1 = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(
    not (CPU_V1 / "cgroup.procs").exists() or not os.access(CPU_V1, os.W_OK),
    reason="needs a writable cgroup v1 cpu hierarchy (root)",
)
def test_an_engine_under_a_cpu_quota_takes_that_many_threads(default_model_dir):
    """A child process moved into a cgroup of 1.2 CPUs before it starts an engine: torch's
    threads are 2, the quota rounded up, though torch was set to 64."""
    group = CPU_V1 / f"docqa-test-{os.getpid()}"
    group.mkdir(exist_ok=True)
    try:
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(int(1.2 * period)))
        code = (
            "import sys, torch\n"
            f"open('{group}/cgroup.procs', 'w').write(str(__import__('os').getpid()))\n"
            "from pathlib import Path\n"
            "from inference import LLMEngine, EngineConfig\n"
            "torch.set_num_threads(64)\n"
            f"model = Path({str(default_model_dir)!r})\n"
            "LLMEngine(EngineConfig(model_dir=model, kv_cache_gib=0.05))\n"
            "print(torch.get_num_threads())\n"
        )
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout.split()[-1]) == 2
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (CPU_V1 / "cgroup.procs").write_text(pid)
        group.rmdir()
