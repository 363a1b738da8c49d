# The asyncgrpo TRAINER image (the inference node runs the stock vLLM image: see docs/gpus.md, "Containers";
# on hosts without GPUs, launch/vllm/cpu.Dockerfile adds vLLM's CPU build to this image).
#
#   docker build -t asyncgrpo:cpu .            # python:3.11-slim base, torch's CPU build
#   docker build -t asyncgrpo:cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04 --build-arg TORCH_BUILD=cu130 .
#   podman build -v /opt/wheels:/wheels:ro --build-arg BASE_IMAGE=localhost/my-base --build-arg TORCH_WHEELS=/wheels .
#       # a base made locally and torch from a wheel folder, for a host that reaches PyPI but neither an image
#       # registry nor download.pytorch.org (`make container-check`: scripts/container_check.sh, docs/containers.md)
#
#   docker run --rm -v /nfs:/nfs asyncgrpo:cuda asyncgrpo train --config /nfs/my.yaml ...
#
# Installs the package and its pinned dependencies from pyproject.toml (with DeepSpeed), nothing else: no model,
# tokenizer or dataset is downloaded at build time. Mount a cache at /cache (HF_HOME) and the shared adapter
# directory at the SAME path the inference node sees it.
#
# BASE_IMAGE is any Debian or Ubuntu image; Python 3 and its venv module are installed with apt when it lacks them
# (the CUDA images have no Python). TORCH_BUILD names torch's build and must match the base (the build checks
# torch.version.cuda against it):
#   torch 2.13.0 (pyproject.toml). Its stable CUDA builds are CUDA 12.6 and CUDA 13.0 (PyTorch's release matrix);
#   there is no CUDA 12.8 build of 2.13.
#   cpu (default): python:3.11-slim-bookworm + https://download.pytorch.org/whl/cpu (PyPI's Linux wheels are CUDA
#     builds).
#   cu130: nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04 + https://download.pytorch.org/whl/cu130. CUDA 13.0 needs an
#     NVIDIA driver >= 580 on the host.
#   cu126, for older drivers (CUDA 12.x, >= 525): nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04.
#   DeepSpeed ops that need nvcc (none by default: asyncgrpo uses torch's AdamW) want a `-devel` CUDA image instead.
# TORCH_WHEELS (default empty: PyTorch's index): a folder inside the build (podman build -v DIR:FOLDER) that holds
# the torch wheel for the base's Python and TORCH_BUILD (torch-2.13.0+cpu-cp311-...whl); torch's own dependencies
# still come from PyPI.
# CA_BUNDLE (default empty): a CA bundle mounted into the build for pip, on a host whose HTTPS goes through a
# TLS-inspecting proxy (podman build -v /etc/ssl/certs/ca-certificates.crt:/tmp/host-ca.pem:ro
# --build-arg CA_BUNDLE=/tmp/host-ca.pem); used by the build's pip only, not kept in the image.
# (One stage on purpose: `FROM base-${DEVICE}` stage selection is not resolved by the buildah of Debian 12's podman.)
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG TORCH_BUILD=cpu
ARG TORCH_WHEELS=
ARG CA_BUNDLE=
# PyPI's default Linux wheel is built for one CUDA version that changes between torch releases: take the build that
# matches the base image from PyTorch's own index instead.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_BUILD} \
    TORCH_BUILD=${TORCH_BUILD}
# Python's headers too: torch's compiler (inductor, used by vLLM's CPU build) and DeepSpeed's op builds include
# Python.h. python:*-slim images have them; Debian's python3 needs python3-dev.
RUN python3 -c "import venv, ensurepip, os, sysconfig; \
assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" 2>/dev/null \
    && have_python=1 || have_python=0; \
    apt-get update \
    && if [ "$have_python" = 0 ]; then extra="python3 python3-venv python3-dev"; else extra=""; fi \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ ninja-build curl $extra \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    ASYNCGRPO_CACHE=/cache/asyncgrpo \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions
WORKDIR /opt/asyncgrpo
COPY pyproject.toml README.md ./
COPY src ./src
# torch first, alone, from the index (or the wheel folder) that matches the base; the second install then finds
# torch==2.13.0 satisfied and keeps that build. The check fails the build if a different build slipped in (e.g.
# PyPI's default CUDA one).
RUN if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi \
    && torch_req="torch==2.13.0" \
    && if [ -n "$TORCH_WHEELS" ]; then pip install --find-links "$TORCH_WHEELS" "$torch_req+$TORCH_BUILD"; \
       else pip install --index-url "$TORCH_INDEX_URL" "$torch_req"; fi \
    && pip install ".[deepspeed]" \
    && python -c "import asyncgrpo.config, torch, accelerate, peft, transformers, os; \
want = os.environ['TORCH_BUILD']; got = 'cpu' if torch.version.cuda is None else 'cu' + torch.version.cuda.replace('.', ''); \
print('torch', torch.__version__, 'built for', got); \
assert got == want, f'torch is built for {got}, the image wants {want}: check TORCH_BUILD and BASE_IMAGE'"
COPY configs ./configs
COPY launch ./launch
# Never run as root on a shared cluster filesystem: pass --user $(id -u):$(id -g) to docker run.
CMD ["asyncgrpo", "--help"]
