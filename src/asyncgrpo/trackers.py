"""Experiment trackers (`report_to`): accelerate's tracker classes behind one object the run's metrics go through.

`resolve_report_to` turns `report_to` into tracker names (`all`: every one installed, `none`: none) without importing
anything heavy, so a config is checked fast; `Trackers.open` builds one accelerate tracker per name, and `log`,
`log_table` and `close` reach each of them. Metric names, and where each tracker writes: docs/metrics.md.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
from pathlib import Path

from asyncgrpo.errors import ConfigError

log = logging.getLogger(__name__)

# report_to name -> the module it needs and the package to install (accelerate's tracker names).
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "trackio": ("trackio", "trackio"), "mlflow": ("mlflow", "mlflow"), "comet_ml": ("comet_ml", "comet-ml"),
            "aim": ("aim", "aim"), "clearml": ("clearml", "clearml"), "dvclive": ("dvclive", "dvclive"),
            "swanlab": ("swanlab", "swanlab")}
# The trackers `pip install 'asyncgrpo[trackers]'` installs (pyproject.toml; a test keeps the two in step).
TRACKERS_EXTRA = ("wandb", "trackio")
STEP_KEY = "train/global_step"  # wandb: the x-axis of every chart (logged as a value, as transformers does)


def installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKERS[name][0]) is not None


def resolve_report_to(report_to: list[str] | str | None, *, check_installed: bool = True) -> list[str]:
    """`report_to` -> the tracker names to open, in order, without repeats: `all` is every installed tracker,
    `none` (or an empty list) is none. An unknown name, or (with `check_installed`) one whose package is missing,
    is a ConfigError naming the fix."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if names in (["none"], []):
        return []
    if "all" in names:
        return [name for name in TRACKERS if installed(name)]
    out: list[str] = []
    for name in names:
        if name not in TRACKERS:
            raise ConfigError("report_to", f"unknown tracker {name!r}",
                              f"use some of {', '.join(TRACKERS)}, or `all`, or `none`")
        if check_installed and not installed(name):
            extra = " (or `pip install 'asyncgrpo[trackers]'`)" if name in TRACKERS_EXTRA else ""
            raise ConfigError("report_to", f"names {name}, but its package is not installed here",
                              f"pip install {TRACKERS[name][1]}{extra}, or drop {name} from report_to")
        if name not in out:
            out.append(name)
    return out


def plain_config(values: dict) -> dict:
    """A config as trackers store hyperparameters: numbers, strings, bools and None; anything else as JSON."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v, default=str)
            for k, v in values.items()}


class Trackers:
    """The run's open trackers. Any thread may log (the publish thread logs sync timings): one lock serialises the
    calls. wandb gets the step as the value `train/global_step`, its charts' x-axis, so that a value logged late
    (a sync timing) still lands at its step; the others take the step as theirs."""

    def __init__(self, trackers: list):
        self.trackers = trackers
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    @classmethod
    def open(cls, names: list[str], *, output_dir: str | Path, run_name: str, config: dict,
             purge_step: int | None = None) -> Trackers:
        """Start one tracker per name. TensorBoard writes `<output_dir>/tensorboard` (`purge_step`: a resumed run
        hides what a killed one logged from that step on); wandb writes `<output_dir>/wandb` (project
        `$WANDB_PROJECT`, else asyncgrpo); trackio its own directory (`$TRACKIO_DIR`); mlflow `$MLFLOW_TRACKING_URI`,
        else `<output_dir>/mlruns`. `config` is stored as the run's hyperparameters."""
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS  # heavy: accelerate imports torch

        _plain_accelerate_logging()
        out = Path(output_dir)
        project = os.environ.get("WANDB_PROJECT", "asyncgrpo")
        trackers = []
        try:
            for name in names:
                tracker = _build(LOGGER_TYPE_TO_CLASS[name], name, out, project, run_name, purge_step)
                # Only the process that logs opens trackers: accelerate's own main-process check would build a
                # PartialState here, which in a rollout child or on a rollout host is not this run's.
                tracker.main_process_only = False
                tracker.start()
                if name == "wandb":
                    tracker.run.define_metric(STEP_KEY)
                    tracker.run.define_metric("*", step_metric=STEP_KEY, step_sync=True)
                if name != "tensorboard":  # TensorBoard's hparams would add a run beside the metrics
                    tracker.store_init_configuration(plain_config(config))
                trackers.append(tracker)
        except BaseException:
            cls(trackers).close()
            raise
        log.info("metrics go to %s", ", ".join(names) or "no tracker (report_to: none)")
        return cls(trackers)

    def log(self, values: dict[str, float], step: int) -> None:
        """Scalars at `step`, to every tracker."""
        with self._lock:
            for tracker in self.trackers:
                if tracker.name == "wandb":
                    tracker.log({**values, STEP_KEY: step})
                else:
                    tracker.log(values, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A table at `step`: a wandb or trackio Table, TensorBoard text (a markdown table), mlflow `log_table`;
        trackers without tables are skipped."""
        with self._lock:
            for tracker in self.trackers:
                _table(tracker, name, columns, rows, step)

    def close(self) -> None:
        with self._lock:
            for tracker in self.trackers:
                try:
                    tracker.finish()
                except Exception as exc:  # noqa: BLE001 - one tracker failing to close must not hide the others
                    log.warning("closing the %s tracker failed: %s", tracker.name, exc)
            self.trackers = []


def _plain_accelerate_logging() -> None:
    """accelerate's tracker classes log through accelerate's logger, which raises unless this process built an
    accelerate state; a rollout child or a rollout host logs without one (building one there would join the
    trainer's process group). There, their debug lines go to a plain logger of the same name."""
    import accelerate.tracking  # heavy: accelerate imports torch
    from accelerate.state import PartialState  # heavy: as above

    if not PartialState._shared_state:
        accelerate.tracking.logger = logging.getLogger(accelerate.tracking.__name__)


def _build(kind, name: str, out: Path, project: str, run_name: str, purge_step: int | None):
    """One accelerate tracker, not started, with the arguments its kind takes."""
    if name == "tensorboard":
        kwargs = {"purge_step": purge_step} if purge_step is not None else {}
        return kind("tensorboard", str(out), **kwargs)  # accelerate joins them: <output_dir>/tensorboard
    if name == "wandb":
        out.mkdir(parents=True, exist_ok=True)
        return kind(project, name=run_name, dir=str(out))
    if name == "trackio":
        return kind(project, name=run_name, embed=False)
    if name == "mlflow":
        uri = os.environ.get("MLFLOW_TRACKING_URI") or str((out / "mlruns").resolve())
        return kind(project, logging_dir=uri, run_name=run_name)
    if kind.requires_logging_directory:
        return kind(run_name, str(out))
    return kind(run_name)


def _table(tracker, name: str, columns: list[str], rows: list[list], step: int) -> None:
    if tracker.name == "wandb":
        import wandb  # heavy: only with report_to wandb

        tracker.log({name: wandb.Table(columns=columns, data=rows), STEP_KEY: step})
    elif tracker.name == "trackio":
        import trackio  # heavy: only with report_to trackio

        tracker.log({name: trackio.Table(columns=columns, data=rows)}, step=step)
    elif tracker.name == "tensorboard":
        tracker.writer.add_text(name, markdown_table(columns, rows), step)
    elif tracker.name == "mlflow":
        import mlflow  # heavy: only with report_to mlflow

        mlflow.log_table({c: [r[i] for r in rows] for i, c in enumerate(columns)}, f"{name}/step_{step:06d}.json")
    elif hasattr(tracker, "log_table"):
        tracker.log_table(name, columns=columns, data=rows, step=step)


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """Rows as a markdown table (TensorBoard's text tab renders it); `|` and newlines in a cell are escaped."""
    def cell(value) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
