#!/usr/bin/env bash
# The exact wheel set scripts/gpu_check.sh carries to a GPU image that has Python 3.12 (x86_64, glibc >= 2.28) with
# torch, transformers, accelerate and peft, but not DeepSpeed, pydantic or requests: each at the version this
# checkout's .venv runs with, no dependency resolved (so torch is never pulled), into one folder; prints its size,
# which must stay under the 64 MiB a lent GPU machine takes beside the working tree. docs/gpus.md: carried wheels.
#
#   scripts/gpu_wheels.sh [DIR]          # default ./wheels; `make gpu-wheels` (WHEELS=DIR)
#   PY_VERSION=3.11 ABI=cp311 scripts/gpu_wheels.sh wheels-311   # for another Python
#
# Needs the package registry. DeepSpeed publishes only a source archive: its wheel is built (pure Python, its ops are
# compiled on first use, and the check uses none) with PYTHON (default .venv/bin/python), which must have torch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$(realpath -m "${1:-$root/wheels}")"
python="${PYTHON:-$root/.venv/bin/python}"
py_version="${PY_VERSION:-3.12}"
abi="${ABI:-cp312}"
limit_mib=64

# DeepSpeed and what it imports that the image lacks; its other requirements (numpy, packaging, psutil, tqdm, torch)
# come with torch, transformers and accelerate.
deepspeed=(deepspeed==0.19.8)
deepspeed_deps=(hjson==3.1.0 py-cpuinfo==9.0.0 msgpack==1.2.4 ninja==1.13.2 einops==0.8.2
                pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
                typing-extensions==4.16.0)
# The trainer's HTTP client (asyncgrpo.inference) is imported on the step's path; huggingface_hub 1.x uses httpx,
# so an image may well lack requests.
trainer_deps=(requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3)

rm -rf "$dir"
mkdir -p "$dir"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$py_version" --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d "$dir" "${deepspeed_deps[@]}" "${trainer_deps[@]}"
"$python" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$dir" "${deepspeed[@]}"

count=$(find "$dir" -name '*.whl' | wc -l)
bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
ls -1 "$dir"
echo "gpu_wheels: $count wheels, $bytes bytes (${mib} MiB) in $dir"
if (( bytes >= limit_mib * 1048576 )); then
    echo "gpu_wheels: over the ${limit_mib} MiB a lent GPU machine takes beside the working tree" >&2
    exit 1
fi
