"""The training loop's rank-0-only work, over two real gloo ranks: what rank 0 does alone while the others wait
(the held-out evaluation) runs under `on_main`, so a failure there stops every rank at once with its message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gloo import two_ranks

from asyncgrpo.distributed import PeerFailed
from asyncgrpo.trainer.callbacks import Callbacks
from asyncgrpo.trainer.metrics import RunLoss
from asyncgrpo.trainer.outputs import LogHistory
from asyncgrpo.trainer.recipe import GRPORecipe


class Rollout:
    def __init__(self, fails: bool):
        self.fails = fails

    def evaluate(self, step: int) -> dict:
        if self.fails:
            raise RuntimeError("the eval server stopped answering")
        return {"eval/reward": 0.5}


def loop(rank: int, evaluation_fails: bool):
    """`GRPORecipe.train` over one step that evaluates, everything else stubbed; what this rank ended with."""
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(max_steps=1, weight_sync_steps=1), step=0, main=rank == 0, eval_metrics={},
        rollout=Rollout(evaluation_fails) if rank == 0 else None,  # only rank 0 holds the rollout side
        _progress_bar=lambda: SimpleNamespace(close=lambda: None), sync=lambda metrics: None,
        _log=lambda metrics, bar: None,
        evaluator=SimpleNamespace(should_evaluate=lambda step, last_step: True),
        checkpointer=SimpleNamespace(should_save=lambda step, last_step: False), _stop_agreed=lambda: False,
        save_final=lambda: None, _finish=lambda seconds: {}, history=LogHistory(), callbacks=Callbacks(),
        run_loss=RunLoss())

    def train_step():
        trainer.step += 1
        return SimpleNamespace(values={"train/loss": 0.0})  # the step's metrics, as far as the loop reads them

    trainer.train_step = train_step
    try:
        GRPORecipe.train(trainer)
    except (PeerFailed, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return "finished", trainer.eval_metrics, trainer.history.entries


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with two_ranks(tmp_path_factory.mktemp("recipe-ranks"), {"loop": loop}) as run:
        yield run


def test_a_failed_evaluation_on_rank_0_stops_the_other_ranks_at_once_with_its_message(run):
    rank0, rank1 = run("loop", True)
    assert rank0 == ("RuntimeError", "the eval server stopped answering")
    assert rank1[0] == "PeerFailed"
    assert "evaluating the held-out set" in rank1[1] and "the eval server stopped answering" in rank1[1]


def test_an_evaluation_that_succeeds_is_kept_on_rank_0_only(run):
    # rank 0 also keeps it in trainer_state.json's log_history, under transformers' name
    assert run("loop", False) == (("finished", {"eval/reward": 0.5}, [{"eval_reward": 0.5, "step": 1}]),
                                  ("finished", {}, []))
