"""The recipe's parts that need no launch: when it saves, how it assembles and logs a step's metrics with the
rollout side's counters, what the run summary records, and how a rank's share becomes micro-batches."""

import json
from types import SimpleNamespace

import pytest
import torch
from fakes import cfg as make_cfg
from transformers.trainer_utils import TrainOutput

from asyncgrpo.contracts import Group
from asyncgrpo.trainer.callbacks import Callbacks
from asyncgrpo.trainer.checkpoint import Checkpointer
from asyncgrpo.trainer.completions import CompletionLog
from asyncgrpo.trainer.evaluator import Evaluator
from asyncgrpo.trainer.loss import LossSpec
from asyncgrpo.trainer.metrics import StepMetrics
from asyncgrpo.trainer.outputs import LogHistory
from asyncgrpo.trainer import recipe
from asyncgrpo.trainer.recipe import GRPORecipe


# ---- when a checkpoint is written -----------------------------------------------------------------------------------
def _should_save(cfg, step: int) -> bool:
    return Checkpointer.from_config(cfg).should_save(step, last_step=step == cfg.max_steps)


@pytest.mark.parametrize("step,expected", [(2, False), (3, True), (6, True), (7, True), (5, False)])
def test_saves_every_save_steps_and_at_the_last_step(step, expected):
    cfg = SimpleNamespace(save_steps=3, max_steps=7, weight_sync_steps=1, num_iterations=1, output_dir="out",
                          save_total_limit=None)
    assert _should_save(cfg, step) is expected
    cfg.weight_sync_steps, cfg.save_steps = 2, 4  # the last step (7) published nothing: no checkpoint there
    assert _should_save(cfg, 7) is False
    cfg.weight_sync_steps, cfg.num_iterations, cfg.save_steps = 1, 2, 4  # step 7 is mid-batch: none there either
    assert _should_save(cfg, 7) is False


def test_no_save_steps_means_no_checkpoint_even_at_the_last_step():
    cfg = SimpleNamespace(save_steps=0, max_steps=4, weight_sync_steps=1, num_iterations=1, output_dir="out",
                          save_total_limit=None)
    assert not any(_should_save(cfg, s) for s in range(1, 5))


# ---- the loss spec ---------------------------------------------------------------------------------------------------
def test_the_trainer_holds_the_loss_spec_of_its_config():
    cfg = make_cfg(loss_type="grpo", beta=0.04, epsilon=0.1)
    trainer = GRPORecipe(cfg)
    assert trainer.loss_spec == LossSpec.from_config(cfg)
    assert trainer.loss_spec.counts_sequences and trainer.loss_spec.needs_reference


# ---- logging a step --------------------------------------------------------------------------------------------------
class FakeRollout:  # not in fakes.py: a rollout side as the trainer logs it, no server stand-in
    """The rollout side as `_log` and `_finish` use it: counters, a log, where it put things."""

    adapter_name, adapter_path = "lora-run-v3", "/adapters/run/v000003"

    def __init__(self, tmp_path):
        self.logged: list[tuple[int, dict]] = []
        self.tables: list[tuple] = []
        self.tensorboard_dir = tmp_path / "tensorboard"

    def stats(self) -> dict[str, float]:
        return {"rollout/generated_tokens_per_s": 12.5, "rollout/lost_groups_total": 1,
                "rollout/resent_groups_total": 2, "reward/fallbacks_total": 0, "queue/dropped_stale_total": 3,
                "queue/depth": 4, "queue/dropped_zero_std_total": 5, "queue/inflight_requests": 6}

    def log(self, values: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(values)))

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.tables.append((name, columns, rows, step))


class FakeBar:  # not in fakes.py: tqdm's progress bar, used here only
    def __init__(self):
        self.postfix, self.updates = None, 0

    def set_postfix(self, **kw):
        self.postfix = kw

    def update(self, n):
        self.updates += n


def _trainer(tmp_path, **cfg_values):
    values = {"logging_steps": 2, "max_steps": 5, "output_dir": str(tmp_path), **cfg_values}
    return SimpleNamespace(cfg=SimpleNamespace(**values), rollout=FakeRollout(tmp_path), version=3, step=0,
                           completion_log=None, eval_metrics={}, history=LogHistory(), callbacks=Callbacks())


def test_a_step_is_logged_with_the_rollout_counters_and_the_version_every_logging_steps_and_at_the_end(tmp_path):
    trainer, bar = _trainer(tmp_path), FakeBar()
    for step in range(1, 6):
        trainer.step = step
        metrics = StepMetrics()
        metrics.batch([_group([1.0, 0.0], version=3)], version=3, num_generations=2, waited_s=0.25)
        GRPORecipe._log(trainer, metrics, bar)
    assert [step for step, _ in trainer.rollout.logged] == [2, 4, 5]  # every 2 steps, and the last (5)
    values = trainer.rollout.logged[0][1]
    assert values["policy/version"] == 3.0 and values["queue/dropped_stale_total"] == 3.0
    assert values["train/reward"] == 0.5 and values["time/wait_for_data_s"] == 0.25
    assert bar.postfix == {"reward": "0.500", "v": 3, "refresh": False} and bar.updates == 5
    # trainer_state.json's log_history: the same steps, under transformers' names (`train/` dropped)
    assert [e["step"] for e in trainer.history.entries] == [2, 4, 5]
    assert trainer.history.entries[0]["reward"] == 0.5 and "train/reward" not in trainer.history.entries[0]


def test_the_run_summary_keeps_its_keys_and_reads_the_rollout_counters(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, keep_final_adapter=False)
    trainer.main, trainer.step, trainer.model_path, trainer.world, trainer.start_step = True, 5, "/models/toy", 2, 0
    trainer.resumed_from, trainer.acc, trainer._base_dtype = None, None, lambda: "float32"
    trainer._trainable_dtype = trainer._state_dtype = lambda: "float32"
    trainer.finished = False
    monkeypatch.setattr(recipe, "backend_of", lambda acc: "ddp")
    summary = GRPORecipe._finish(trainer, 12.0)
    assert set(summary) == {"steps", "version", "adapter_name", "adapter_path", "model_path", "train_seconds",
                            "dropped_stale", "dropped_zero_std", "lost_groups", "resent_groups", "tensorboard",
                            "backend", "world_size", "base_dtype", "start_step", "resumed_from",
                            "adapter_left_loaded", "final_adapter", "trainable_dtype", "optimizer_state_dtype"}
    assert summary["final_adapter"] == str(tmp_path.resolve())  # the PEFT files save_final wrote
    assert (summary["dropped_stale"], summary["dropped_zero_std"], summary["lost_groups"],
            summary["resent_groups"]) == (3, 5, 1, 2)
    assert json.loads((tmp_path / "run_summary.json").read_text()) == summary and trainer.finished


class CharTokenizer:  # not in fakes.py: decoding is all a completions table needs
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_with_log_completions_each_logged_step_writes_its_table_to_the_trackers_and_the_file(tmp_path):
    trainer, bar = _trainer(tmp_path), FakeBar()
    trainer.completion_log = CompletionLog(tmp_path, CharTokenizer(), ["fmt", "never"], limit=3)
    groups = [_group([1.0, 0.0], lengths=[2, 1]), _group([0.5, 0.25], lengths=[3, 1])]
    groups[0].reward_parts = {"fmt": [1.0, None], "never": [None, None]}
    groups[0].advantages = [0.5, -0.5]
    trainer._batch = SimpleNamespace(groups=groups)
    for step in (1, 2):
        trainer.step = step
        metrics = StepMetrics()
        metrics.batch(groups, version=3, num_generations=2, waited_s=0.0)
        GRPORecipe._log(trainer, metrics, bar)
    (name, columns, rows, step), = trainer.rollout.tables  # logging_steps 2: step 2 only
    assert (name, step) == ("completions", 2)
    assert columns == ["step", "prompt", "completion", "fmt", "never", "reward", "advantage"]
    assert rows == [[2, "p", "dd", 1.0, None, 1.0, 0.5], [2, "p", "d", None, None, 0.0, -0.5],
                    [2, "p", "ddd", None, None, 0.5, 0.0]]  # the first 3 completions; the second group has no parts
    lines = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert lines == [dict(zip(columns, row)) for row in rows]


def test_a_reward_no_function_of_the_config_gave_gets_a_column_of_its_own_in_the_completions_table(tmp_path):
    log = CompletionLog(tmp_path, CharTokenizer(), [], limit=None)  # reward_funcs left out beside an environment
    group = _group([1.0, 0.0], lengths=[1, 1])
    group.reward_parts = {"Riddles": [1.0, 0.0]}  # its get_reward, named after its class
    assert log.table([group], 4) == [[4, "p", "d", 1.0, 1.0, 0.0], [4, "p", "d", 0.0, 0.0, 0.0]]
    assert log.columns == ["step", "prompt", "completion", "Riddles", "reward", "advantage"]
    assert log.table([group], 5)[0][3] == 1.0 and log.columns.count("Riddles") == 1


def test_evaluation_runs_every_eval_steps_and_at_the_last_step_only_with_eval_strategy_steps():
    def evaluates(strategy, interval=2, max_steps=5):
        cfg = SimpleNamespace(eval_strategy=strategy, evaluation_interval=interval, max_steps=max_steps)
        return [s for s in range(1, max_steps + 1)
                if Evaluator.from_config(cfg).should_evaluate(s, last_step=s == cfg.max_steps)]
    assert evaluates("steps") == [2, 4, 5]
    assert evaluates("no") == []


# ---- micro-batches ---------------------------------------------------------------------------------------------------
def _group(rewards, version=0, lengths=None, prompt=(1, 2)):
    lengths = lengths or [2] * len(rewards)
    return Group(prompt="p", prompt_ids=list(prompt), completion_ids=[[3] * n for n in lengths],
                 behaviour_logprobs=[[-1.0] * n for n in lengths], rewards=list(rewards), reward_parts={},
                 advantages=[0.0] * len(rewards), version=version, adapter="a", finish_reasons=["stop"] * len(rewards))


def test_without_a_token_budget_a_share_is_cut_into_whole_groups_of_the_per_device_batch():
    cfg = SimpleNamespace(max_tokens_per_microbatch=None, per_device_train_batch_size=4, num_generations=2)
    trainer = SimpleNamespace(cfg=cfg, pad_id=0, acc=SimpleNamespace(device=torch.device("cpu")))
    share = [_group([1.0, 0.0], lengths=[2, 3]) for _ in range(3)]
    micro = GRPORecipe._micro_batches(trainer, share)
    assert [b["input_ids"].shape[0] for b in micro] == [4, 2]  # 2 groups of 2 completions, then the last group
    assert all(b["mask"].sum(dim=1).tolist() == [2.0, 3.0] * (b["input_ids"].shape[0] // 2) for b in micro)


def test_with_a_token_budget_completions_are_packed_by_length_within_it():
    cfg = SimpleNamespace(max_tokens_per_microbatch=12, per_device_train_batch_size=4, num_generations=2)
    trainer = SimpleNamespace(cfg=cfg, pad_id=0, acc=SimpleNamespace(device=torch.device("cpu")))
    share = [_group([1.0, 0.0], lengths=[4, 1]), _group([0.0, 1.0], lengths=[4, 2])]  # sequences of 6, 3, 6, 4
    micro = GRPORecipe._micro_batches(trainer, share)  # one process: the count needs no other rank
    assert [tuple(b["input_ids"].shape) for b in micro] == [(2, 6), (2, 4)]  # 2 x 6 = 12 and 2 x 4 within 12
    assert sum(float(b["mask"].sum()) for b in micro) == 4 + 1 + 4 + 2


@pytest.mark.parametrize("step,publishes", [(4, False), (5, True)])
def test_the_final_adapter_is_the_last_served_version_with_unpublished_steps_published_first(tmp_path, monkeypatch,
                                                                                            step, publishes):
    synced, exported = [], []
    trainer = SimpleNamespace(cfg=SimpleNamespace(weight_sync_steps=2, output_dir=str(tmp_path)), step=step,
                              rollout=SimpleNamespace(wait_published=lambda: exported.append("waited")),
                              _published={"w": torch.zeros(1)}, peft_config="peft", model_path="org/model")
    trainer.sync = lambda wait=False: synced.append(wait)
    trainer._card = lambda directory: f"the card of {directory} at step {trainer.step}"
    monkeypatch.setattr(recipe, "export_adapter", lambda *args, card: exported.append((*args, card)))
    GRPORecipe.save_final(trainer)
    assert synced == ([True] if publishes else [])  # steps 5: one step since the sync at 4 is published first
    assert exported == ["waited", (str(tmp_path), trainer._published, "peft", "org/model",  # once it is served,
                                   f"the card of {tmp_path} at step {step}")]  # with its model card


# ---- SIGTERM with checkpoints on: stop at a step that can be resumed from, with a checkpoint --------------------------
def _loop(sigterm_at: int, **values) -> tuple[GRPORecipe, list[tuple[str, int]]]:
    """A trainer whose steps, syncs and saves are recorded, not run; SIGTERM (the deferred one: shutdown.py) is
    received during step `sigterm_at`."""
    trainer = GRPORecipe(make_cfg(**{"max_steps": 10, "save_steps": 5, **values}))
    trainer.main, trainer.world = False, 1
    calls: list[tuple[str, int]] = []

    def train_step():
        trainer.step += 1
        calls.append(("step", trainer.step))
        if trainer.step == sigterm_at:
            trainer.stop_requested.set()
        return StepMetrics({"train/loss": float(trainer.step)})  # step k's loss is k

    trainer.train_step = train_step
    trainer.sync = lambda metrics=None: calls.append(("sync", trainer.step))
    trainer.save_checkpoint = lambda: calls.append(("save", trainer.step))
    trainer.save_final = lambda: calls.append(("final", trainer.step))
    trainer._finish = lambda seconds: {}
    return trainer, calls


def test_sigterm_saves_the_step_in_progress_and_exits_143_without_training_on():
    trainer, calls = _loop(sigterm_at=3)
    with pytest.raises(SystemExit) as exited:
        trainer.train()
    assert exited.value.code == 143
    assert calls[-3:] == [("step", 3), ("sync", 3), ("save", 3)]  # published, then saved: resumable exactly
    assert ("step", 4) not in calls and ("final", 3) not in calls


def test_sigterm_mid_batch_goes_on_to_the_batch_s_last_pass_before_saving():
    trainer, calls = _loop(sigterm_at=3, num_iterations=2, save_steps=4)  # step 3 is the first pass of batch 2
    with pytest.raises(SystemExit):
        trainer.train()
    assert calls[-2:] == [("sync", 4), ("save", 4)] and ("step", 5) not in calls


def test_sigterm_on_a_save_step_saves_once():
    trainer, calls = _loop(sigterm_at=5)
    with pytest.raises(SystemExit):
        trainer.train()
    assert [c for c in calls if c[0] == "save"] == [("save", 5)]


def test_without_checkpoints_sigterm_is_not_deferred():
    trainer, _ = _loop(sigterm_at=3, save_steps=0)
    assert trainer.stop_grace_s == 0.0
    assert GRPORecipe(make_cfg(save_steps=5, stop_grace_s=0)).stop_grace_s == 0.0
    assert GRPORecipe(make_cfg(save_steps=5)).stop_grace_s == 20.0
    trainer.train()  # the loop runs on: SIGTERM is the handler's to act on at once (shutdown.py)


# ---- what train() returns ---------------------------------------------------------------------------------------------
def test_train_returns_transformers_train_output_with_the_mean_loss_of_the_steps_this_call_ran():
    trainer, _ = _loop(sigterm_at=0, save_steps=0, max_steps=6)
    trainer.step = 2  # resumed at step 2: steps 1-2 were trained by an earlier call, 3-6 by this one
    trainer._finish = lambda seconds: {"steps": trainer.step, "version": 6}
    out = trainer.train()
    assert isinstance(out, TrainOutput)
    # losses 3, 4, 5, 6: mean 4.5. Over the global step it would be 18 / 6 = 3.0; the last step's alone 6.0.
    assert out == TrainOutput(6, 4.5, {"steps": 6, "version": 6, "train_loss": 4.5})


class StopAfter:  # a transformers-style callback asking to stop
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def test_a_run_a_callback_stops_early_reports_the_steps_it_ran_and_their_loss():
    trainer, _ = _loop(sigterm_at=0, save_steps=0, max_steps=10)
    trainer.callbacks = Callbacks([StopAfter(3)])
    trainer.callbacks.begin(trainer.cfg, step=0, is_main=True, is_local_main=True)
    out = trainer.train()
    assert (out.global_step, out.training_loss) == (3, 2.0)  # losses 1, 2, 3 (not max_steps, not 10 steps)
    assert out.metrics == {"train_loss": 2.0}  # off rank 0 the summary is empty: only the loss


def test_a_call_that_trains_no_step_reports_a_loss_of_zero_as_transformers_does():
    trainer, _ = _loop(sigterm_at=0, save_steps=0, max_steps=4)
    trainer.step = 4  # resumed from the last checkpoint of a finished run
    assert trainer.train() == TrainOutput(4, 0.0, {"train_loss": 0.0})
