"""Both tiers run offline whatever the caller's environment: no hub is reachable from the test machines, and a test
must not depend on `make` having exported these (set before any test module imports huggingface_hub)."""

import os

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
