# docqa API + in-process engine. The default model is imported on first use into $DOCQA_HOME
# (a volume in compose.yaml), so it is fetched once, not at every start.
FROM python:3.11-slim

# CPU torch by default; the GPU override (compose.gpu.yaml) builds with a CUDA index instead.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    DOCQA_HOME=/data

WORKDIR /app
# gcc builds the CPU kernels (inference/kernels/cpu/csrc: attention, linear layers, element-wise
# steps) on first use, for the CPU the container runs on; without it the engine takes torch's
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY app ./app
COPY inference ./inference
COPY prefix_store ./prefix_store
COPY prompts ./prompts
COPY migrations ./migrations
RUN pip install . && useradd --create-home --uid 1000 docqa && mkdir -p /data \
    && chown docqa /data
USER docqa
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2).status != 200)"

# `docqa serve` applies the migrations, then serves; /ready turns 200 once the model is loaded.
CMD ["docqa", "serve", "--host", "0.0.0.0", "--port", "8000"]
