#!/usr/bin/env bash
# Run here, where pip reaches PyPI, before a GPU run of the whole service (bench/gpu_run.sh):
#   bench/gpu_prepare.sh
# 1. .whl/: docqa's own wheel, and the service's Python packages that the GPU machine's image
#    lacks, as wheels for CPython 3.12 on manylinux x86-64, at the versions this checkout's
#    .venv runs (about 20 MB). bench/gpu_run.sh installs docqa there from these alone, keeping
#    every package the machine already has at a version docqa can use.
# 2. .gpu/home: a DOCQA_HOME holding the benchmark model random:llama-3-8b (its config.json and
#    the default model's tokenizer files, a few MB; the weights are drawn there at start).
# Both are ignored by git and travel with the device tool's `carry` (.whl and .gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# the service's own dependencies and what they need beyond the GPU image (which has torch,
# triton, numpy, tokenizers, safetensors, xxhash, uvloop, httpx, prometheus-client, tqdm, ...)
NAMES="litestar litestar-htmx msgspec multipart polyfactory faker rich rich-click click
markdown-it-py mdurl pygments pyyaml anyio sniffio h11 httpcore httpx idna certifi
typing-extensions multidict uvicorn httptools sqlalchemy greenlet aiosqlite asyncpg alembic mako
markupsafe pypdf html2text redis gguf"
pins=()
for n in $NAMES; do
  v=$("$PY" -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p')
  if [ -z "$v" ]; then echo "gpu_prepare: $n is not installed in $PY's environment" >&2; exit 1; fi
  pins+=("$n==$v")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl "${pins[@]}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl .
# the benchmark model's directory, from the default model's tokenizer (imported here if needed)
src=$("$PY" -c 'from inference.model.model_import import import_default_model as f; print(f())')
mkdir -p .gpu/home/models/SmolLM2-135M-Instruct
cp "$src"/config.json "$src"/tokenizer.json "$src"/tokenizer_config.json \
  .gpu/home/models/SmolLM2-135M-Instruct/
DOCQA_HOME=.gpu/home "$PY" -c '
from inference.model.bench_model import benchmark_model_dir
for name in ("llama-3-8b", "smollm2-135m"):
    print(benchmark_model_dir("random:" + name))'
echo "gpu_prepare: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1); $(du -sh .gpu | cut -f1) in .gpu"
