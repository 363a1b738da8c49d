# The asyncgrpo TRAINER image (the inference node runs the stock vLLM image: see README, "Containers").
#
#   docker build -t asyncgrpo:cpu .                            # CPU base (python:3.11-slim), CPU torch
#   docker build -t asyncgrpo:cuda --build-arg DEVICE=cuda .   # CUDA base (nvidia/cuda runtime), CUDA torch
#
#   docker run --rm -v /shared:/shared asyncgrpo:cuda asyncgrpo train --config /shared/my.yaml ...
#
# Installs the package and its pinned dependencies from pyproject.toml (with DeepSpeed), nothing else: no model,
# tokenizer or dataset is downloaded at build time. Mount a cache at /cache (HF_HOME) and the shared adapter
# directory at the SAME path the inference node sees it.
ARG DEVICE=cpu
ARG CPU_IMAGE=python:3.11-slim-bookworm
# DeepSpeed ops that need nvcc (none by default: asyncgrpo uses torch's AdamW) want a `-devel` image instead.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CPU_IMAGE} AS base-cpu
# PyPI's Linux torch wheels are CUDA builds; the CPU build comes from PyTorch's own index.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ninja-build curl \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

FROM ${CUDA_IMAGE} AS base-cuda
ENV TORCH_INDEX_URL=https://pypi.org/simple
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev g++ ninja-build curl \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

FROM base-${DEVICE}
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    ASYNCGRPO_CACHE=/cache/asyncgrpo \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions
WORKDIR /opt/asyncgrpo
# Dependencies first (a layer that changes only with pyproject.toml), torch alone from the index that matches DEVICE.
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.0" \
    && pip install ".[deepspeed]" \
    && python -c "import asyncgrpo.config, torch, accelerate, peft, transformers; print('torch', torch.__version__)"
COPY configs ./configs
COPY launch ./launch
# Never run as root on a shared cluster filesystem: pass --user $(id -u):$(id -g) to docker run.
CMD ["asyncgrpo", "--help"]
