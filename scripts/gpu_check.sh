#!/usr/bin/env bash
# The trainer's own training step on every backend (DDP, FSDP1, FSDP2, ZeRO-2, ZeRO-3), on one GPU under NCCL, with
# the real launch/accelerate/*.yaml files and Qwen2.5-1.5B's shape (random bf16 weights, built locally: nothing is
# downloaded). Prints ONE JSON line; exit 0 every backend passed, 1 one failed, 2 no CUDA. docs/gpus.md explains.
#
#   scripts/gpu_check.sh                               # on a GPU host, from a checkout (no `pip install` needed)
#   scripts/gpu_check.sh --backends fsdp2,zero3        # some backends
#   scripts/gpu_check.sh --cpu-smoke --backends ddp    # the CPU variant: 2 gloo ranks, the toy model
#
# Needs python with torch, transformers, peft and accelerate (PYTHON=/path/to/python to pick one); ZeRO also needs
# DeepSpeed, installed from ./wheels when it is missing (docs/gpus.md: carrying DeepSpeed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # everything is built from config: nothing to download
exec "${PYTHON:-python3}" -m asyncgrpo.bench.gpu_check "$@"
