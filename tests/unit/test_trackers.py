"""report_to: which trackers a value opens, the error for a missing package, and what tensorboard, wandb (offline)
and trackio (local) hold after a run of logging, each read back from its own files."""

from __future__ import annotations

import pytest
from trackers_read import trackio_logs, wandb_history, wandb_run_dir

from asyncgrpo import trackers as trackers_module
from asyncgrpo.errors import ConfigError
from asyncgrpo.trackers import Trackers, markdown_table, resolve_report_to


def test_report_to_names_all_and_none():
    assert resolve_report_to(["tensorboard", "wandb", "tensorboard"]) == ["tensorboard", "wandb"]
    assert resolve_report_to("none") == [] and resolve_report_to([]) == [] and resolve_report_to(None) == []
    assert resolve_report_to("all") == [n for n in trackers_module.TRACKERS if trackers_module.installed(n)]
    assert {"tensorboard", "wandb", "trackio"} <= set(resolve_report_to(["all"]))
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'.*use some of tensorboard, wandb"):
        resolve_report_to(["tensorbord"])


def test_a_tracker_whose_package_is_missing_names_the_pip_install(monkeypatch):
    monkeypatch.setattr(trackers_module, "installed", lambda name: name != "mlflow")
    with pytest.raises(ConfigError, match="names mlflow, but its package is not installed.*pip install mlflow"):
        resolve_report_to(["tensorboard", "mlflow"])
    assert resolve_report_to(["mlflow"], check_installed=False) == ["mlflow"]  # config validation: not yet


def test_markdown_table_escapes_cells():
    assert markdown_table(["a", "b"], [["x|y", 0.123456], ["1\n2", None]]) == (
        "| a | b |\n| --- | --- |\n| x\\|y | 0.1235 |\n| 1<br>2 | None |")


@pytest.fixture
def opened(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr("trackio.utils.TRACKIO_DIR", tmp_path / "trackio")  # read at import: the env var is too late
    monkeypatch.setattr("trackio.sqlite_storage.TRACKIO_DIR", tmp_path / "trackio", raising=False)
    t = Trackers.open(["tensorboard", "wandb", "trackio"], output_dir=tmp_path / "out", run_name="run-a",
                      config={"learning_rate": 1e-5, "report_to": ["tensorboard"]})
    yield t
    t.close()


def test_each_tracker_holds_the_scalars_at_their_steps_and_the_table(opened, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for step in (1, 2):
        opened.log({"train/reward": 0.5 * step, "policy/version": float(step)}, step)
    opened.log({"sync/load_s": 0.25}, 1)  # late, as the publish thread logs: still at step 1
    opened.log_table("completions", ["prompt", "completion", "reward"], [["07,45>", "45", 1.0]], 2)
    opened.close()

    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [(1, 0.5), (2, 1.0)]
    assert [(e.step, e.value) for e in events.Scalars("sync/load_s")] == [(1, 0.25)]
    assert "completions/text_summary" in events.Tags()["tensors"]

    rows = wandb_history(wandb_run_dir(tmp_path / "out"))
    assert [(r["train/global_step"], r["train/reward"]) for r in rows if "train/reward" in r] == [(1, 0.5), (2, 1.0)]
    assert [(r["train/global_step"], r["sync/load_s"]) for r in rows if "sync/load_s" in r] == [(1, 0.25)]
    (table,) = [r for r in rows if "completions/_type" in r]
    assert (table["completions/_type"], table["completions/nrows"], table["train/global_step"]) == ("table-file", 1, 2)

    logs = trackio_logs(tmp_path / "trackio", "asyncgrpo")
    assert [(step, m["train/reward"]) for _, step, m in logs if "train/reward" in m] == [(1, 0.5), (2, 1.0)]
    (table_row,) = [(name, step, m["completions"]) for name, step, m in logs if "completions" in m]
    assert table_row[:2] == ("run-a", 2)
    assert table_row[2]["_value"] == [{"prompt": "07,45>", "completion": "45", "reward": 1.0}]


@pytest.mark.parametrize("name", list(trackers_module.TRACKERS))
def test_the_missing_package_hint_offers_the_extra_only_for_trackers_it_installs(monkeypatch, name):
    import re
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = {re.split(r"[=<>\[ ]", req)[0] for req in pyproject["project"]["optional-dependencies"]["trackers"]}
    monkeypatch.setattr(trackers_module, "installed", lambda n: False)
    with pytest.raises(ConfigError) as err:
        resolve_report_to([name])
    assert ("asyncgrpo[trackers]" in str(err.value)) == (trackers_module.TRACKERS[name][1] in extra), str(err.value)
