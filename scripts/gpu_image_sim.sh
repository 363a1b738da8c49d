#!/usr/bin/env bash
# A stand-in for the lent GPU image on a CPU host (docs/gpus.md: the lent image, simulated): a fresh venv of
# PYTHON_BIN with only torch (CPU build), transformers, accelerate and peft, the wheels scripts/gpu_wheels.sh makes for
# that Python, and `cryptography` hidden (tests/hidden); then the GPU check's CPU variant on every backend. Prints the
# check's summary line and exits with its code (0 passed, 3 a check failed, 4 could not start). ~5 minutes on 2 cores;
# needs the package registry for the venv's packages; not part of `make test`.
#
#   scripts/gpu_image_sim.sh [OUT [gpu_check arguments]]   # default OUT=/tmp/asyncgrpo-image-sim
#   PYTHON_BIN=python3.12 scripts/gpu_image_sim.sh          # the lent image's Python, where one is installed
#
# OUT gets venv/, wheels/ and out/ (results.jsonl, one log per backend). torch's CPU build: TORCH (default
# torch==2.13.0+cpu) from PyTorch's CPU index (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) or a wheel
# pip finds locally.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(realpath -m "${1:-/tmp/asyncgrpo-image-sim}")"
[[ $# -gt 0 ]] && shift   # the rest goes to gpu_check.sh (e.g. --backends ddp,zero3)
python_bin="${PYTHON_BIN:-python3}"
# The image's own packages, at the versions pyproject.toml pins.
torch_req="${TORCH:-torch==2.13.0+cpu}"
image=(transformers==5.19.0 accelerate==1.15.0 peft==0.21.2)

rm -rf "$work" && mkdir -p "$work"
"$python_bin" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$torch_req" "${image[@]}"
# The carried wheels for the venv's Python (e.g. 3.11 and cp311); DeepSpeed's is built with PYTHON (the .venv's).
major_minor=$("$work/venv/bin/python" -c 'import sys; print("%d %d" % sys.version_info[:2])')
read -r major minor <<< "$major_minor"
PY_VERSION="$major.$minor" ABI="cp$major$minor" PYTHON="${PYTHON:-$root/.venv/bin/python}" \
    bash "$root/scripts/gpu_wheels.sh" "$work/wheels" >&2
cd /
PYTHON="$work/venv/bin/python" PYTHONPATH="$root/tests/hidden" ASYNCGRPO_HIDE_MODULES=cryptography \
    bash "$root/scripts/gpu_check.sh" --cpu-smoke --wheels "$work/wheels" --out "$work/out" "$@"
