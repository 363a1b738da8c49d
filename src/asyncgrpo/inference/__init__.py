"""Talking to the vLLM inference node: `InferenceClient` (HTTP) and `VLLMServer` (start a local one).

The names are imported on first use (PEP 562) so that `python -m asyncgrpo.inference.server` does not import
its own module twice (runpy warns when the package has already imported it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncgrpo.inference.client import Completion, InferenceClient
    from asyncgrpo.inference.server import VLLMServer

__all__ = ["Completion", "InferenceClient", "VLLMServer"]

_MODULE_OF = {"Completion": "client", "InferenceClient": "client", "VLLMServer": "server"}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
