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


def test_no_python_file_of_the_engine_outgrows_a_readers_sitting():
    """One noun per module: no file in inference/ over 500 lines."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "inference").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_the_sampler_and_the_request_do_not_import_each_other():
    """The sampler reads what it needs of a request through a protocol; the request keeps its
    sampling parameters from their own module."""
    imports = re.compile(r"^\s*(from|import)\s+inference\.engine\.(\w+)", re.M)
    engine = ROOT / "inference" / "engine"
    sampler = {m.group(2) for m in imports.finditer((engine / "sampler.py").read_text())}
    sequence = {m.group(2) for m in imports.finditer((engine / "sequence.py").read_text())}
    assert "sequence" not in sampler and "sampler" not in sequence, (sampler, sequence)


def test_no_module_imports_another_modules_private_names():
    """What a module shares it names without a leading underscore (the Triton kernels' shared
    helpers live in kernels/triton/common.py for that)."""
    import ast

    found = []
    for package in ("inference", "app", "prefix_store", "prompts"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    if private:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {private}")
    assert not found, found
