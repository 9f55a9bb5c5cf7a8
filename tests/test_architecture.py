"""Boundaries the code promises: the service layer knows nothing of the web framework, device
differences live in the runners and the ops tables, and the project refers to nothing outside
itself."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_service_layer_imports_nothing_of_the_web_framework():
    code = (
        "import sys, app.qa; "
        "print(sorted(m for m in sys.modules if m.startswith(('litestar', 'app.api'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_device_branches_live_in_the_runners_and_the_device_module():
    """Code that asks which device it runs on is in inference/runner/ (the runners and their
    ops tables) or inference/device.py (which device, which dtype ``auto`` means), nowhere
    else in the engine or the service."""
    pattern = re.compile(r"device\.type|\.is_cuda\b|torch\.cuda\.|is_cpu\b")
    allowed = {ROOT / "inference" / "device.py", *(ROOT / "inference" / "runner").glob("*.py")}
    found = []
    for package in ("inference", "app", "prefix_store", "prompts"):
        for path in (ROOT / package).rglob("*.py"):
            if path in allowed:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_project_refers_to_no_document_outside_it():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    # the documents of the team's workspace, spelled so that this file does not name them
    outside = re.compile("CONTRACTS" + r"\.md|\.\." + "/shared")
    found = [
        p
        for p in tracked
        if (ROOT / p).is_file() and outside.search((ROOT / p).read_text(errors="replace"))
    ]
    assert not found, found
