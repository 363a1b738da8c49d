"""The rollout side as the trainer sees it: `RolloutInterface`, the one declared interface every form implements.

RolloutSide runs it in the training process; transport.process.RolloutProcess is a proxy for one running in another
process (a spawned child or `asyncgrpo rollout-serve`), whose serve loop (transport/rollout_server.py) answers every member
listed here. Adding a member: declare it here, implement it in both, and the serve loop answers it as is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from asyncgrpo.contracts import Group, ServedProbe


@runtime_checkable
class RolloutInterface(Protocol):
    """What rank 0 calls on its rollout side, whichever process runs it. Calls come from the trainer's main thread,
    except `halt`, which its signal handling may call from any thread, at any time (shutdown.py)."""

    run_id: str
    """This run's id: adapters go to lora_adapter_path/<run_id>/ and are served as <lora_name>-<run_id>-v<N>;
    checkpoints record it, so a resumed run can unload what a killed one left loaded."""

    def start(self) -> None:
        """Check every server (fail now, naming the fix), load the prompts, start the producer. Nothing is sent to a
        server before the first `publish`."""

    def take(self, n: int, version: int, timeout_s: float) -> list[Group]:
        """Block until `n` groups at most `max_staleness` versions older than the trainer's `version` are queued,
        and return them (oldest version first, then data order). Raises the producer's failure, or TimeoutError
        after `timeout_s`."""

    def publish(self, version: int, tensors: dict, step: int, wait: bool = False,
                probe: ServedProbe | None = None) -> float:
        """Hand version `version`'s LoRA tensors over to be written and served, after the previous publish (versions
        go live in order; a failed publish is raised by the next call). `wait` (or `publish_in_background: false`):
        return once the servers serve it. `step`: the trainer step its timings are logged at. `probe`: the
        trainer's logprobs of a fixed sequence under this version, which every server must match before the version
        is used (ServedPolicyError otherwise). Returns the seconds spent waiting for the previous publish."""

    def wait_published(self) -> None:
        """Block until the publish in progress (if any) is done; raises its error."""

    @property
    def adapter_name(self) -> str | None:
        """The name the servers serve the live version under (None before the first publish)."""

    @property
    def adapter_path(self) -> Path | None:
        """The directory of the live version (None before the first publish)."""

    @property
    def tensorboard_dir(self) -> Path:
        """Where the rollout side writes TensorBoard with `report_to: tensorboard` (in another process: an absolute
        path on its host)."""

    def stats(self) -> dict[str, float]:
        """Rollout, queue and reward counters now, under their TensorBoard names (docs/metrics.md)."""

    def log(self, values: dict[str, float], step: int) -> None:
        """Write `values` at `step` to every tracker in `report_to`: the one writer of a run's metrics."""

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """Write a table (e.g. the step's completions) at `step` to every tracker that shows tables."""

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out reward of `eval_dataset` under the live adapter, once its publish is done (`eval/...`
        metrics), logged at `step` and returned."""

    def evaluation_wait_s(self) -> float:
        """After `start`: the longest one `evaluate` can take and still succeed (0 without eval_dataset), which
        ddp_timeout must exceed with several ranks (inference/recovery.py: evaluation_wait_s)."""

    def halt(self) -> None:
        """On SIGTERM/SIGINT: resume every server a sync in progress has paused; no later sync pauses one."""

    def close(self, keep_final: bool) -> None:
        """Stop generating and unload every version this run loaded (all but the live one with `keep_final`). Safe
        after a start that failed part-way."""


def interface_members() -> dict[str, str]:
    """Every member of RolloutInterface and its kind: "method", "property" or "attribute" (a plain value, run_id)."""
    kinds = {name: "attribute" for name in RolloutInterface.__annotations__}
    for name, value in vars(RolloutInterface).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            kinds[name] = "property"
        elif callable(value):
            kinds[name] = "method"
    return kinds
