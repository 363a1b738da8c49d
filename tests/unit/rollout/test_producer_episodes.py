"""The producer with episodes: a group of multi-turn episodes reaches the queue with its loss mask and versions, and
a server that dies between two turns loses the whole group, which is sent again from its first turn with fresh
environments. A stub HTTP server stands in for vLLM: a real one cannot be made to die exactly under a second turn."""

from __future__ import annotations

import pytest
from agent_format import agent_tokenizer, lookup

from asyncgrpo.data import PromptRow
from asyncgrpo.rollout.episodes import ChatFormat, EpisodeRunner
from fakes import generation

TOK = agent_tokenizer()


def turn_of(body) -> int:
    return TOK.decode(body["prompt"]).count("<|im_start|>tool")


def rows():
    return [PromptRow(prompt=[{"role": "user", "content": f"0{i},45>"}], prompt_ids=[1], columns={}, rendered=f"p{i}")
            for i in range(8)]


def with_episodes(rollout):
    rollout.producer.episodes = EpisodeRunner(ChatFormat(TOK, TOK.response_template, stop_ids={0}), rollout.cfg,
                                              tools=[lookup], factory=None, max_model_len=None)
    return rollout


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("version", [0, 3])
def test_a_group_of_episodes_reaches_the_queue_with_its_loss_mask_and_versions(rollout_on_stub, version):
    @generation
    def route(body):
        ids = TOK.encode("7", add_special_tokens=False) + [0] if turn_of(body) == 0 else [0]
        return rollout_on_stub.answer(body, [ids] * body["n"])

    rollout = with_episodes(rollout_on_stub(route, rows=rows(), tools=["agent_format:lookup"], max_turns=4))
    groups = rollout.run(version=version, adapter=f"demo-v{version}")
    rollout_on_stub.stop(rollout.producer)
    for g in groups:
        assert len(g.completion_ids) == 2 and all(len(m) == len(c) for m, c in zip(g.loss_mask, g.completion_ids))
        assert all(set(v) == {version} for v in g.versions) and g.version == version
        assert all(m[:2] == [1, 1] and m[-1] == 1 and 0 in m for m in g.loss_mask)  # sampled, tool message, sampled
    bodies = rollout.generation_bodies()
    assert all(b["model"] == f"demo-v{version}" and b["n"] == 1 for b in bodies)  # every turn on the start adapter
    assert rollout.producer.episodes.stats.values()["episodes/tool_calls_total"] == 2 * len(groups)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_server_that_dies_between_turns_loses_the_group_and_it_is_sent_again_from_its_first_turn(rollout_on_stub):
    second_turns = []

    @generation
    def route(body):
        if turn_of(body) == 1:
            second_turns.append(body["prompt"])
            if len(second_turns) == 1:
                return None  # the server dies under the first episode's second turn
        ids = TOK.encode("7", add_special_tokens=False) + [0] if turn_of(body) == 0 else [0]
        return rollout_on_stub.answer(body, [ids] * body["n"])

    rollout = with_episodes(rollout_on_stub(route, rows=rows(), tools=["agent_format:lookup"], max_turns=4))
    groups = rollout.run()
    rollout_on_stub.stop(rollout.producer)
    assert rollout.producer.lost_groups == 1 and rollout.producer.resent_groups == 1
    assert sorted(g.index for g in groups) == [0, 1]
    assert all(g.loss_mask for g in groups)
