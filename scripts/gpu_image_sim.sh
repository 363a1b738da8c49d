#!/usr/bin/env bash
# A stand-in for the lent GPU image on a CPU host (docs/gpus.md: the lent image, simulated): a fresh venv of Python
# 3.12 (the image's) with only torch, transformers, accelerate and peft, the wheels scripts/gpu_wheels.sh makes for
# that Python (installed by the check with --no-index), and `cryptography` hidden (tests/hidden); then the GPU
# check's CPU variant: the collectives launch and every backend. Prints the check's summary line and exits with its
# code (0 passed, 3 a check failed, 4 could not start). ~10 minutes on 2 cores; needs the package registry; not part
# of `make test`.
#
#   scripts/gpu_image_sim.sh [OUT [gpu_check arguments]]   # default OUT=/tmp/asyncgrpo-image-sim
#   PYTHON_BIN=/path/to/python3.12 scripts/gpu_image_sim.sh
#
# PYTHON_BIN: default the first Python 3.12 found (python3.12 on PATH, `uv python find 3.12`, pyenv's 3.12.x);
# python3 with a warning when there is none. TORCH (default torch==2.13.0): PyPI's Linux build, which is built for
# CUDA 13.0 like the image's torch (2.11.0+cu130) and runs on CPU here (its CUDA libraries come as pip packages,
# ~3 GB); TORCH=torch==2.13.0+cpu with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu for a smaller venv.
# OUT gets venv/, wheels/ and out/ (results.jsonl, one log per launch).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(realpath -m "${1:-/tmp/asyncgrpo-image-sim}")"
[[ $# -gt 0 ]] && shift   # the rest goes to gpu_check.sh (e.g. --backends ddp,zero3)
find_python312() {
    local found
    for found in "$(command -v python3.12 || true)" "$(uv python find 3.12 2>/dev/null || true)" \
                 "$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"; do
        if [[ -n "$found" ]] && "$found" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$found"; return
        fi
    done
    echo "gpu_image_sim: no Python 3.12 found; using python3 ($(python3 -V)): the image's Python is 3.12" >&2
    echo python3
}
python_bin="${PYTHON_BIN:-$(find_python312)}"
# The image's own packages, at the versions pyproject.toml pins.
torch_req="${TORCH:-torch==2.13.0}"
image=(transformers==5.19.0 accelerate==1.15.0 peft==0.21.2)

rm -rf "$work" && mkdir -p "$work"
"$python_bin" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$torch_req" "${image[@]}"
"$work/venv/bin/python" -c 'import sys, torch, transformers, accelerate, peft
print("gpu_image_sim: Python", sys.version.split()[0], "| torch", torch.__version__, "| transformers",
      transformers.__version__, "| accelerate", accelerate.__version__, "| peft", peft.__version__)' >&2
# The carried wheels for the venv's Python (e.g. 3.11 and cp311); DeepSpeed's is built with PYTHON (the .venv's).
major_minor=$("$work/venv/bin/python" -c 'import sys; print("%d %d" % sys.version_info[:2])')
read -r major minor <<< "$major_minor"
PY_VERSION="$major.$minor" ABI="cp$major$minor" PYTHON="${PYTHON:-$root/.venv/bin/python}" \
    bash "$root/scripts/gpu_wheels.sh" "$work/wheels" >&2
cd /
PYTHON="$work/venv/bin/python" PYTHONPATH="$root/tests/hidden" ASYNCGRPO_HIDE_MODULES=cryptography \
    bash "$root/scripts/gpu_check.sh" --cpu-smoke --wheels "$work/wheels" --out "$work/out" "$@"
