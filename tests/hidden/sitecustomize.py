"""Hides the top-level modules named in ASYNCGRPO_HIDE_MODULES (comma-separated) from every Python process started
with this folder on PYTHONPATH, as if they were not installed; children inherit both, so `accelerate launch`'s ranks
are covered too. The GPU check's CPU twin hides what the lent GPU image lacks (docs/gpus.md), so that an import of
it on the check's path fails CI, not the GPU hour."""

import os
import sys
from importlib.abc import MetaPathFinder

HIDE_ENV = "ASYNCGRPO_HIDE_MODULES"


class HiddenModules(MetaPathFinder):
    def __init__(self, names: frozenset[str]):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/hidden: {HIDE_ENV})", name=name)
        return None


_names = frozenset(n.strip() for n in os.environ.get(HIDE_ENV, "").split(",") if n.strip())
if _names:
    sys.meta_path.insert(0, HiddenModules(_names))
