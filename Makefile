# Thin targets over scripts/: every target installs what it needs first (scripts/setup.sh is idempotent).
VENV ?= .venv
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1

.PHONY: setup demo test test-unit bench mutate gpu-check slurm-check

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/asyncgrpo demo

test: setup
	$(VENV)/bin/python -m pytest -q tests

# The fast tier alone: everything not marked `integration` (tests/integration/conftest.py marks its whole directory).
test-unit: setup
	$(VENV)/bin/python -m pytest -q -m "not integration" tests

bench: setup
	$(VENV)/bin/asyncgrpo bench policy_equivalence --json
	$(VENV)/bin/asyncgrpo bench sync --backend all --json
	$(VENV)/bin/asyncgrpo bench throughput --json --plot docs/throughput.png
	$(VENV)/bin/asyncgrpo bench memory --json

# Mutation testing of the core rules (trainer/ loss, logprobs, gather, checkpoint, batching; rollout/; the store) against the unit tests; one JSON line
# (docs/testing.md: the figure and every surviving mutant). ~0.4 s a mutant on 2 quiet cores: about 45 minutes for 6863; not part of CI.
mutate: setup
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[mutate]"
	$(VENV)/bin/python scripts/mutate.py

# The trainer's step on every backend on one GPU (docs/gpus.md); needs torch, transformers, peft and accelerate only.
gpu-check:
	bash scripts/gpu_check.sh

# launch/slurm/train.sbatch (CPU variant) under a real one-host Slurm; needs root; ~4-5 min; not part of `make test`.
slurm-check: setup
	VENV=$(abspath $(VENV)) scripts/slurm_check.sh
