"""asyncgrpo: asynchronous GRPO for LoRA adapters, with a dedicated vLLM inference node."""

__version__ = "0.1.0"
