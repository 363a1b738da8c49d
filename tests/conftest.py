"""Both tiers run offline whatever the caller's environment: no hub is reachable from the test machines, and a test
must not depend on `make` having exported these (set before any test module imports huggingface_hub)."""

import json
import logging
import os
import time
from pathlib import Path

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
STALE_LOCK_S = 600  # building DeepSpeed's CPU op takes a minute or two on 2 cores


def pytest_sessionstart(session):
    """Remove a stale lock from torch's extension builds. Every DeepSpeed start on CPU loads its shared-memory op,
    and torch takes `<extensions>/<op>/lock` for that even when the op is built; a process killed while holding it
    (`make mutate` kills a mutant's tests at their timeout) left every later DeepSpeed start waiting forever."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    for lock in root.glob("*/*/lock"):
        try:
            stale = time.time() - lock.stat().st_mtime > STALE_LOCK_S
        except FileNotFoundError:  # its holder released it since the glob
            continue
        if stale:
            logging.getLogger(__name__).warning("removing a stale torch extension lock %s", lock)
            lock.unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    """Under `make mutate` only (mutmut names the mutant in MUTANT_UNDER_TEST): run a mutant's tests fastest first, by
    the durations mutmut measured (mutants/mutmut-stats.json; the tests run in mutants/). mutmut stops at the first
    failure (-x) but hands the tests over in no particular order, so a mutant that a 0.05 s test kills could first sit
    through a 2 s spawn test or a 30 s stop wait. Ordinary runs keep pytest's order."""
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    stats = Path("mutmut-stats.json")
    if not stats.is_file():
        return
    durations = json.loads(stats.read_text())["duration_by_test"]
    items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))  # stable: ties keep pytest's order
