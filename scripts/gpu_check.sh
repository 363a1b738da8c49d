#!/usr/bin/env bash
# One-GPU check of the trainer's CUDA + NCCL path, in a few minutes, without vLLM or DeepSpeed:
# a Qwen2.5-1.5B-shaped model (random bf16 weights) with LoRA r16 under FSDP2 on an NCCL group of one rank,
# train steps through the project's loss, the LoRA gather, and a device check on every collective asyncgrpo makes.
# Prints ONE JSON line (peak CUDA memory, step time, device checks); exit 0 all checks passed, 1 one failed, 2 no CUDA.
#
#   scripts/gpu_check.sh                       # on a GPU host, from a checkout (no `pip install` needed)
#   scripts/gpu_check.sh --cpu-smoke           # tiny sizes on CPU with gloo (tests/unit/bench/test_gpu_check.py)
#   scripts/gpu_check.sh --layers 4 --steps 3  # every size is a flag: scripts/gpu_check.sh --help
#
# Needs python with torch, transformers, peft and accelerate (PYTHON=/path/to/python to pick one).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # everything is built from config: nothing to download
exec "${PYTHON:-python3}" -m asyncgrpo.bench.gpu_check "$@"
