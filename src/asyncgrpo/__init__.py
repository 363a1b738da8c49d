"""asyncgrpo: asynchronous GRPO for LoRA adapters, with a dedicated vLLM inference node.

The package is laid out by who runs the code: trainer/ on every rank, rollout/ in one process, inference/ beside the
server, shared modules at the top (docs/design.md).
"""

__version__ = "0.1.0"
