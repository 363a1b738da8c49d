"""The rollout interface (transport/interface.py) is the whole contract between the trainer and its rollout side: both
implementations have every member with the same kind and parameter names, the serve loop (transport/rollout_server.py) answers
every member and refuses anything else, and a call through the proxy reaches the side as the trainer made it. Adding
a member to the interface alone makes these tests name what is missing."""

from __future__ import annotations

import inspect
import re
import threading
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch
from fakes import cfg
from liveness import returns_within
from safetensors.torch import save

from asyncgrpo.contracts import ServedProbe
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import RolloutProcessError
from asyncgrpo.transport import rollout_server
from asyncgrpo.transport.interface import RolloutInterface, interface_members
from asyncgrpo.transport.process import RolloutProcess
from asyncgrpo.rollout.side import RolloutSide
from asyncgrpo.trainer import recipe

IMPLEMENTATIONS = [RolloutSide, RolloutProcess]
MEMBERS = interface_members()


def _cfg(tmp_path) -> AsyncGRPOConfig:
    return cfg(lora_adapter_path=str(tmp_path / "a"), output_dir=str(tmp_path / "out"), sync_mode="versioned",
               vllm_request_timeout=1.0)


def _instance(cls, tmp_path):
    """One that is never started: nothing spawned, no server."""
    return cls(_cfg(tmp_path), tokenizer=None, model_path=str(tmp_path), peft_config=None, groups_per_step=1)


def _parameters(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


def test_the_interface_declares_everything_the_trainer_uses_of_its_rollout_side():
    used = set(re.findall(r"self\.rollout\.(\w+)", inspect.getsource(recipe)))
    assert {"start", "take", "publish", "stats", "close"} <= used  # the pattern still finds the trainer's calls
    assert used <= set(MEMBERS), f"used by the trainer, not declared: {sorted(used - set(MEMBERS))}"


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_implementation_has_every_member_with_the_same_kind_and_parameter_names(cls, tmp_path):
    instance = _instance(cls, tmp_path)
    try:
        for name, kind in MEMBERS.items():
            declared, found = inspect.getattr_static(RolloutInterface, name, None), inspect.getattr_static(cls, name,
                                                                                                        None)
            if kind == "method":
                assert inspect.isfunction(found), f"{cls.__name__}.{name} is not a method"
                assert _parameters(found) == _parameters(declared), f"{cls.__name__}.{name}'s parameters"
            elif kind == "property":
                assert isinstance(found, property), f"{cls.__name__}.{name} is not a property"
            else:
                assert found is None and name in vars(instance), f"{cls.__name__}.{name} is not a plain attribute"
    finally:
        instance.close(keep_final=False)


class RecordingSide:
    """A side whose every interface member records its call (methods) or gives a value of its own (the others)."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        for name, kind in MEMBERS.items():
            if kind == "method":
                setattr(self, name, self._recorder(name))
            else:
                setattr(self, name, f"the {name}")
        self.tensorboard_dir = Path("relative/tensorboard")  # resolved by the serve loop
        self.take = self._recorder("take", returns=[])  # a batch of no groups

    def _recorder(self, name: str, returns=None):
        def call(*args, **kwargs):
            self.calls.append((name, args + tuple(kwargs.values())))
            return returns if returns is not None else f"{name} done"
        return call

    def shutdown(self):  # not a member of the interface: the serve loop must not reach it
        self.calls.append(("shutdown", ()))


def _placeholder_args(name: str) -> tuple:
    return tuple(f"{name}:{p}" for p in _parameters(getattr(RolloutInterface, name)))


def test_the_serve_loop_answers_every_member_of_the_interface():
    side = RecordingSide()
    blob = save({"w": torch.ones(2)})
    for name, kind in MEMBERS.items():
        side.calls.clear()
        if name == "publish":
            probe = ServedProbe(token_ids=[5, 6, 7], start=1, logprobs=[-0.5, -1.5])
            assert rollout_server._handle(side, name, (3, blob, 7, True, probe)) == "publish done"
            ((_, (version, tensors, step, wait, got)),) = side.calls
            assert (version, list(tensors), tensors["w"].tolist(), step, wait) == (3, ["w"], [1.0, 1.0], 7, True)
            assert got == probe  # the served check's probe reaches the side with its version
        elif name == "take":
            assert isinstance(rollout_server._handle(side, name, (2, 0, 1.5)), bytes)  # the binary batch (wire.py)
            assert side.calls == [("take", (2, 0, 1.5))]
        elif name == "tensorboard_dir":
            assert rollout_server._handle(side, name, ()) == Path("relative/tensorboard").resolve()
        elif kind == "method":
            args = _placeholder_args(name)
            rollout_server._handle(side, name, args)
            assert side.calls == [(name, args)], name
        else:
            assert rollout_server._handle(side, name, ()) == f"the {name}"


@pytest.mark.parametrize("op", ["shutdown", "__class__", "_publish", "calls", "peer"])
def test_the_serve_loop_refuses_anything_that_is_not_a_member(op):
    side = RecordingSide()
    with pytest.raises(RolloutProcessError, match=rf"`{op}`, which is not part of the rollout interface.*Fix: run "
                                                  r"the same asyncgrpo version"):
        rollout_server._handle(side, op, ())
    assert side.calls == []


class PipePeer:
    """A peer whose other end is a thread in this process serving `side` with the real serve loop."""

    name, in_process, fix = "the test's rollout side", "in process", "none"

    def __init__(self, side):
        self.conn, self._theirs = Pipe()
        self.side, self.thread = side, None

    def connect(self, cfg, side_kwargs, run_id):
        self.thread = threading.Thread(target=rollout_server._answer_requests, args=(self._theirs, self.side), daemon=True)
        self.thread.start()

    def started(self):
        return self.thread is not None

    def alive(self):
        return self.thread.is_alive()

    def how_it_ended(self, exc):
        return "ended"

    def halt(self):
        pass

    def stop(self, bound):
        self.conn.close()
        self.thread.join(bound)


def test_a_call_through_the_proxy_reaches_the_side_as_the_trainer_made_it(tmp_path):
    side = RecordingSide()
    proxy = RolloutProcess(_cfg(tmp_path), model_path="m", peft_config=None, groups_per_step=1,
                           peer=PipePeer(side))
    proxy.start()
    assert proxy.take(2, version=1, timeout_s=5.0) == []
    probe = ServedProbe(token_ids=[1, 2], start=1, logprobs=[-0.25], base_logprobs=[-0.5])
    proxy.publish(4, {"w": torch.zeros(3)}, step=9, probe=probe)
    proxy.wait_published()
    proxy.log({"train/loss": 0.5}, step=2)
    assert (proxy.adapter_name, proxy.adapter_path, proxy.stats()) == ("the adapter_name", "the adapter_path",
                                                                      "stats done")
    assert proxy.tensorboard_dir == Path("relative/tensorboard").resolve()
    returns_within(lambda: proxy.close(keep_final=True), 10, "close through the proxy")
    names = [name for name, _ in side.calls]
    assert names == ["start", "take", "publish", "wait_published", "log", "stats", "close"]
    assert side.calls[1] == ("take", (2, 1, 5.0)) and side.calls[4] == ("log", ({"train/loss": 0.5}, 2))
    assert side.calls[2][1][0] == 4 and side.calls[2][1][1]["w"].tolist() == [0.0] * 3 and side.calls[2][1][2:] == (
        9, False, probe)
    assert side.calls[-1] == ("close", (True,))
