#!/usr/bin/env bash
# The trainer's own training step on every backend (DDP, FSDP1, FSDP2, ZeRO-2, ZeRO-3), on one GPU under NCCL, with
# the real launch/accelerate/*.yaml files and Qwen2.5-1.5B's shape (random bf16 weights, built locally: nothing is
# downloaded). One launch per backend, each with its own deadline inside --budget (default 480 s), each ended whole
# at its deadline; each backend's JSON line is appended to OUT/results.jsonl (--out, default ./gpu-check-out) as it
# ends, and the summary line closes it and goes to stdout. Exit: 0 every backend passed, 3 one failed, 4 could not
# start (the JSON line says why), 5 no CUDA; 1 is a crash of the check itself, 2 bad arguments. docs/gpus.md explains.
#
#   scripts/gpu_check.sh                               # on a GPU host, from a checkout (no `pip install` needed)
#   scripts/gpu_check.sh --backends fsdp2,zero3        # some backends
#   scripts/gpu_check.sh --cpu-smoke --backends ddp    # the CPU variant: 2 gloo ranks, the toy model
#
# Needs python with torch, transformers, peft and accelerate (PYTHON=/path/to/python to pick one); what else it needs
# (DeepSpeed and pydantic for ZeRO, requests) it installs when missing from ./wheels (--wheels; made by
# scripts/gpu_wheels.sh) into a private folder for its launches, never into that python's environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # everything is built from config: nothing to download
exec "${PYTHON:-python3}" -m asyncgrpo.bench.gpu_check "$@"
