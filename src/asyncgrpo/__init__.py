"""asyncgrpo: asynchronous GRPO for LoRA adapters, with a dedicated vLLM inference node.

The package is laid out by who runs the code: trainer/ on every rank, rollout/ in one process, inference/ beside the
server, shared modules at the top (docs/design.md).
"""

from asyncgrpo.version import __version__

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "__version__", "parse_args"]


def __getattr__(name: str):
    """`from asyncgrpo import AsyncGRPOTrainer, AsyncGRPOConfig, parse_args` (docs/python-api.md), imported on first
    use so that the modules every process imports do not load the Python API."""
    if name == "AsyncGRPOConfig":
        from asyncgrpo.config import AsyncGRPOConfig

        return AsyncGRPOConfig
    if name in ("AsyncGRPOTrainer", "parse_args"):
        from asyncgrpo import api

        return getattr(api, name)
    raise AttributeError(f"module 'asyncgrpo' has no attribute {name!r}")
