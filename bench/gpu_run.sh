#!/usr/bin/env bash
# The GPU runs, one command each (after bench/gpu_prepare.sh here; on the GPU machine from the
# repository root, with .whl and .gpu carried):
#   bench/gpu_run.sh check [--dry-run] [SECTIONS]   bench/gpu.py --quick: kernels, timings,
#       engine, fp8 KV, batch invariance (SECTIONS: e.g. timings,engine; default all)
#   bench/gpu_run.sh service [--dry-run]  the whole service under load (below)
# First an environment of its own: a virtualenv over the machine's Python (GPU_PYTHON, python3
# by default), which sees that Python's packages (torch, Triton, numpy, ...) through a .pth
# file, never shadowing them, and into which pip installs docqa's wheel with, from .whl alone
# (no index, no network), only what the machine lacks or has at a version docqa cannot use.
# Then, for `service`, `docqa serve` on the benchmark model random:llama-3-8b (random bf16
# weights, the default tokenizer; SQLite in /tmp) and bench/load.py against it at 1, 16 and 64
# clients in the shared-prefix shape: 8 manuals of about 2,000 tokens, questions of about 128
# tokens, answers of 256. Writes its JSON and logs under $OUT (or bench/results).
# --dry-run: the same on this CPU over this checkout's .venv (docqa's wheel built here, every
# package it needs found in .venv), with this machine's DOCQA_HOME; `service` with
# random:smollm2-135m, 1 client, small.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?usage: bench/gpu_run.sh check|service [--dry-run] [SECTIONS]}
dry=
[ "${2:-}" = --dry-run ] && dry=--dry-run
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
env_dir=${DOCQA_GPU_ENV:-/tmp/docqa-gpu-env}
if [ "$dry" = --dry-run ]; then
  base=${GPU_PYTHON:-.venv/bin/python}
  wheels=$(mktemp -d)
  "$base" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$wheels" . >&2
else
  base=${GPU_PYTHON:-python3}
  wheels=.whl
  [ -n "$(ls "$wheels"/docqa-*.whl 2>/dev/null)" ] || {
    echo "bench/gpu_run.sh: no docqa wheel in $wheels (run bench/gpu_prepare.sh first)" >&2
    exit 2
  }
  export DOCQA_HOME=$PWD/.gpu/home
fi
rm -rf "$env_dir"
"$base" -m venv --without-pip "$env_dir"
site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$base" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_machine.pth"
pip=("$base" -m pip --python "$env_dir/bin/python" install -q --no-index --no-cache-dir)
"${pip[@]}" --no-deps --force-reinstall "$wheels"/docqa-*.whl >&2
"${pip[@]}" --find-links "$wheels" docqa >&2  # its requirements: the machine's, or from .whl
PY=$env_dir/bin/python
"$PY" -c 'import torch, triton; print(f"docqa environment: torch {torch.__version__}, triton {triton.__version__}")'

if [ "$what" = check ]; then
  sections=${3:-${2:-}}
  [ "$sections" = --dry-run ] && sections=
  exec "$PY" bench/gpu.py --quick ${dry:+--dry-run} ${sections:+--sections "$sections"} \
    --out "$OUT/gpu-check.json"
fi
[ "$what" = service ] || { echo "bench/gpu_run.sh: check or service, not $what" >&2; exit 2; }

if [ "$dry" = --dry-run ]; then
  model=random:smollm2-135m
  load=(--concurrency 1 --groups 1 --prompts-per-group 2 --manual-tokens 200
        --question-tokens 16 --output-tokens 8 --requests-per-client 2)
  serve=(--kv-cache-gib 0.25)
else
  model=random:llama-3-8b
  load=(--concurrency 1 16 64 --groups 8 --prompts-per-group 8 --manual-tokens 2000
        --question-tokens 128 --output-tokens 256 --requests-per-client 2)
  serve=(--max-batched-tokens 8192)
fi
port=8765
log="$OUT/gpu-service-server.log"
export DOCQA_DATABASE_URL="sqlite:///$(mktemp -d)/docqa.db"
"$PY" -m app.cli serve --model "$model" --benchmark-weights --port $port \
  "${serve[@]}" > "$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
ready="import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/ready').status_code != 200)"
for _ in $(seq 600); do
  "$PY" -c "$ready" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { tail -50 "$log"; exit 1; }
  sleep 1
done
"$PY" -c "import httpx, json; print(json.dumps(httpx.get('http://127.0.0.1:$port/v1/engine').json()))" \
  > "$OUT/gpu-service-engine.json"
"$PY" bench/load.py --url http://127.0.0.1:$port "${load[@]}" --out "$OUT/gpu-service-load.json"
