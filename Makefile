# Thin targets over scripts/: every target installs what it needs first (scripts/setup.sh is idempotent).
VENV ?= .venv
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1

.PHONY: setup demo test test-unit bench mutate gpu-check gpu-wheels slurm-check container-check

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/asyncgrpo demo

# --durations: the slowest tests (setup, which starts servers and shared runs, apart from the call) at the end of
# every run, so that the next slow-down shows where it is without a run of its own.
test: setup
	$(VENV)/bin/python -m pytest -q --durations=30 tests

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

# The trainer's step on every backend on one GPU (docs/gpus.md): torch, transformers, peft and accelerate from the
# python it runs with, the rest from ./wheels (`make gpu-wheels`). make reports any failing recipe as 2, so the line
# below prints the script's own exit code (0 passed, 3 a check failed, 4 could not start, 5 no CUDA) before it exits
# with it; scripts/gpu_check.sh run directly exits with that code. GPU_CHECK_ARGS="--backends ddp" passes arguments.
gpu-check:
	@bash scripts/gpu_check.sh $(GPU_CHECK_ARGS); code=$$?; echo "gpu-check: scripts/gpu_check.sh exited $$code" >&2; exit $$code

# The wheels the GPU check carries for a Python 3.12 x86_64 image without DeepSpeed and pydantic (docs/gpus.md),
# into ./wheels (WHEELS=dir for another); needs the package registry and this checkout's .venv (for DeepSpeed's build).
gpu-wheels:
	PYTHON=$(abspath $(VENV))/bin/python bash scripts/gpu_wheels.sh $(WHEELS)

# launch/slurm/train.sbatch (CPU variant) under a real one-host Slurm; needs root; ~4-5 min; not part of `make test`.
slurm-check: setup
	VENV=$(abspath $(VENV)) scripts/slurm_check.sh

# The trainer image built from ./Dockerfile and the demo trained in containers (the inference node's vLLM CPU build
# in one, the trainer in another, host networking) on this host with podman; checks the held-out gain and removes
# every container, image and folder it made. Needs root; 30-45 min on 2 busy cores; not part of `make test`.
container-check:
	scripts/container_check.sh
