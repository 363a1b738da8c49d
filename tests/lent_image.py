"""The lent GPU image as the CPU tests see it (docs/gpus.md): the modules it lacks that the GPU check does not carry,
hidden from a child process by tests/hidden/sitecustomize.py."""

from __future__ import annotations

from pathlib import Path

HIDDEN = Path(__file__).resolve().parent / "hidden"
# DeepSpeed and pydantic are lacking too, but the check carries them (scripts/gpu_wheels.sh).
IMAGE_LACKS = ("cryptography",)


def as_on_the_image(env: dict) -> dict:
    """`env` with IMAGE_LACKS hidden from the child and its children (PYTHONPATH and the variable are inherited)."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": f"{HIDDEN}:{path}" if path else str(HIDDEN),
            "ASYNCGRPO_HIDE_MODULES": ",".join(IMAGE_LACKS)}
