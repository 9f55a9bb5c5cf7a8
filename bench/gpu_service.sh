#!/usr/bin/env bash
# The whole service on a GPU, in one command (after bench/gpu_prepare.sh here; on the GPU machine
# from the repository root, with .whl and .gpu carried):
#   bench/gpu_service.sh [--dry-run]
# Installs the carried wheels, starts `docqa serve` on the benchmark model random:llama-3-8b
# (random bf16 weights, the default tokenizer; SQLite in /tmp) and runs bench/load.py against it
# at 1, 16 and 64 clients in the shared-prefix shape: 8 manuals of about 2,000 tokens, questions
# of about 128 tokens, answers of 256. Writes the load JSON and the server's log under $OUT (or
# bench/results). --dry-run: the same on this CPU with random:smollm2-135m, 1 client, small.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
if [ "${1:-}" != --dry-run ] && [ -d .whl ] && [ -n "$(ls .whl)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
PY=${PY:-python3}
[ -x .venv/bin/python ] && [ "${1:-}" = --dry-run ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1
if [ "${1:-}" = --dry-run ]; then  # this machine's DOCQA_HOME and .venv
  model=random:smollm2-135m
  load=(--concurrency 1 --groups 1 --prompts-per-group 2 --manual-tokens 200
        --question-tokens 16 --output-tokens 8 --requests-per-client 2)
  serve=(--kv-cache-gib 0.25)
else
  export DOCQA_HOME=$PWD/.gpu/home
  model=random:llama-3-8b
  load=(--concurrency 1 16 64 --groups 8 --prompts-per-group 8 --manual-tokens 2000
        --question-tokens 128 --output-tokens 256 --requests-per-client 2)
  serve=(--max-batched-tokens 8192)
fi
port=8765
db=$(mktemp -d)/docqa.db
log="$OUT/gpu-service-server.log"
mkdir -p "$OUT"
export DOCQA_DATABASE_URL="sqlite:///$db"
"$PY" -m app.cli serve --model "$model" --benchmark-weights --port $port \
  "${serve[@]}" > "$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  if "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/ready').status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 $server 2>/dev/null || { tail -50 "$log"; exit 1; }
  sleep 1
done
"$PY" -c "import httpx, json; print(json.dumps(httpx.get('http://127.0.0.1:$port/v1/engine').json()))" \
  > "$OUT/gpu-service-engine.json"
"$PY" bench/load.py --url http://127.0.0.1:$port "${load[@]}" --out "$OUT/gpu-service-load.json"
