# The asyncgrpo TRAINER image (the inference node runs the stock vLLM image: see docs/gpus.md, "Containers").
#
#   docker build -t asyncgrpo:cpu .                            # CPU base (python:3.11-slim), CPU torch
#   docker build -t asyncgrpo:cuda --build-arg DEVICE=cuda .   # CUDA 13.0 base, torch built for CUDA 13.0 (cu130)
#
#   docker run --rm -v /nfs:/nfs asyncgrpo:cuda asyncgrpo train --config /nfs/my.yaml ...
#
# Installs the package and its pinned dependencies from pyproject.toml (with DeepSpeed), nothing else: no model,
# tokenizer or dataset is downloaded at build time. Mount a cache at /cache (HF_HOME) and the shared adapter
# directory at the SAME path the inference node sees it.
#
# Pins (they must agree with each other; the build checks torch.version.cuda against TORCH_CUDA):
#   torch 2.13.0 (pyproject.toml). Its stable CUDA builds are CUDA 12.6 and CUDA 13.0 (PyTorch's release matrix);
#   there is no CUDA 12.8 build of 2.13.
#   DEVICE=cuda (default): nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04 + https://download.pytorch.org/whl/cu130.
#     CUDA 13.0 needs an NVIDIA driver >= 580 on the host.
#   Older drivers (CUDA 12.x, >= 525): --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04
#     --build-arg TORCH_CUDA=cu126
#   DEVICE=cpu: python:3.11-slim-bookworm + https://download.pytorch.org/whl/cpu (PyPI's Linux wheels are CUDA builds).
ARG DEVICE=cpu
ARG CPU_IMAGE=python:3.11-slim-bookworm
# DeepSpeed ops that need nvcc (none by default: asyncgrpo uses torch's AdamW) want a `-devel` image instead.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04
# The torch build for CUDA_IMAGE's CUDA: cu130 for 13.0, cu126 for 12.6.
ARG TORCH_CUDA=cu130

FROM ${CPU_IMAGE} AS base-cpu
# PyPI's Linux torch wheels are CUDA builds; the CPU build comes from PyTorch's own index.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    TORCH_CUDA=cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ninja-build curl \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

FROM ${CUDA_IMAGE} AS base-cuda
ARG TORCH_CUDA
# PyPI's default Linux wheel is built for one CUDA version that changes between torch releases: take the build that
# matches the base image from PyTorch's own index instead.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_CUDA} \
    TORCH_CUDA=${TORCH_CUDA}
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
# torch first, alone, from the index that matches the base; the second install then finds torch==2.13.0 satisfied
# and keeps that build. The check fails the build if a different build slipped in (e.g. PyPI's default CUDA).
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.0" \
    && pip install ".[deepspeed]" \
    && python -c "import asyncgrpo.config, torch, accelerate, peft, transformers, os; \
want = os.environ['TORCH_CUDA']; got = 'cpu' if torch.version.cuda is None else 'cu' + torch.version.cuda.replace('.', ''); \
print('torch', torch.__version__, 'built for', got); \
assert got == want, f'torch is built for {got}, the image wants {want}: check TORCH_CUDA and CUDA_IMAGE'"
COPY configs ./configs
COPY launch ./launch
# Never run as root on a shared cluster filesystem: pass --user $(id -u):$(id -g) to docker run.
CMD ["asyncgrpo", "--help"]
