"""The producer with episodes: a group of multi-turn episodes reaches the queue with its loss mask and versions, and
a server that dies between two turns loses the whole group, which is sent again from its first turn with fresh
environments. A stub HTTP server stands in for vLLM: a real one cannot be made to die exactly under a second turn."""

from __future__ import annotations

import agent_tools
import pytest
from agent_format import agent_tokenizer, lookup
from fakes import generation

from asyncgrpo.data import PromptRow
from asyncgrpo.errors import BehaviourLogprobError
from asyncgrpo.rollout.episodes import ChatFormat, EpisodeRunner
from asyncgrpo.rollout.build import build_producer
from asyncgrpo.rollout.producer import request_seed
from asyncgrpo.rollout.queue import RolloutQueue

TOK = agent_tokenizer()


def turn_of(body) -> int:
    return TOK.decode(body["prompt"]).count("<|im_start|>tool")


def rows():
    return [PromptRow(prompt=[{"role": "user", "content": f"0{i},45>"}], prompt_ids=[1], columns={}, rendered=f"p{i}")
            for i in range(8)]


def with_episodes(rollout, factory=None):
    """`rollout` with its producer built again as build_parts builds it with tools: its episode runner passed to
    build_producer (on a fresh queue: the first producer, never started, stays wired to the old one)."""
    runner = EpisodeRunner(ChatFormat(TOK, TOK.response_template, stop_ids={0}), rollout.cfg, tools=[lookup],
                           factory=factory, max_model_len=None)
    first = rollout.producer
    rollout.queue = RolloutQueue(rollout.cfg.max_staleness, scale_rewards=rollout.cfg.scale_rewards,
                                 dynamic_sampling=rollout.cfg.dynamic_sampling)
    rollout.producer = build_producer(rollout.cfg, clients=rollout.clients, rows=rollout.rows, scorer=first.scorer,
                                      queue=rollout.queue, groups_per_step=first.groups_per_step, episodes=runner)
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


def seven_then_stop(body):
    ids = TOK.encode("7", add_special_tokens=False) + [0] if turn_of(body) == 0 else [0]
    return [ids] * body["n"]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("factory", [None, "agent_tools:Counter"])
def test_episodes_are_scored_on_what_they_said_with_their_environments_and_each_turn_is_seeded(rollout_on_stub,
                                                                                              factory):
    seen = []

    def reward(prompts, completions, **columns):
        seen.append({"prompts": prompts, "completions": completions, **columns})
        return [float(len(c)) for c in completions]

    @generation
    def route(body):
        return rollout_on_stub.answer(body, seven_then_stop(body))

    extra = {} if factory is None else {"environment_factory": factory}
    rollout = rollout_on_stub(route, rows=rows(), reward=reward, tools=["agent_format:lookup"], max_turns=4,
                              seeded_generation=True, seed=11, **extra)
    with_episodes(rollout, agent_tools.Counter if factory else None)
    groups = rollout.run()
    rollout_on_stub.stop(rollout.producer)
    by_index = {g.index: g for g in groups}
    scored = {int(call["prompts"][0][-1]["content"][1]): call for call in seen}  # by row: "0{i},45>..."
    for g in groups:
        i = int(g.prompt[1:])  # the row's rendered prompt, "p{i}" (the stream's order is shuffled)
        call = scored[i]
        assert call["completion_ids"] == g.completion_ids  # the whole prompt is shared: the ids are the episode's
        assert g.reward_parts == {"format_reward": [3.0, 3.0]} and g.rewards == [3.0, 3.0]  # assistant, tool, assistant
        assert [m["role"] for m in call["completions"][0]] == ["assistant", "tool", "assistant"]
        assert g.adapter == "demo-v0" and call["truncated"] == [False, False]
        if factory is None:
            assert "environments" not in call and call["prompts"] == [rows()[i].prompt] * 2
        else:  # each episode's own environment, reset with the row: its observation is in the prompt scored
            envs = call["environments"]
            assert all(isinstance(e, agent_tools.Counter) for e in envs) and envs[0] is not envs[1]
            assert call["prompts"][0][-1]["content"] == f"0{i},45> (start 0)"
    if factory is not None:  # one request in flight (max_inflight_requests 1): two instances serve every group
        assert len(seen) >= 2 and rollout.producer.episodes.environments.built == 2
    # every sampled token is counted (a group: two episodes of "7", eos then eos), also of groups not taken yet
    assert rollout.producer.generated_tokens >= 6 * len(groups) and rollout.producer.generated_tokens % 6 == 0
    first_turns = {b["seed"] for b in rollout.generation_bodies() if turn_of(b) == 0}
    second_turns = {b["seed"] for b in rollout.generation_bodies() if turn_of(b) == 1}
    for index in by_index:
        seed = request_seed(11, index, 2)
        assert {seed, seed + 1} <= first_turns and {seed + 7919, seed + 1 + 7919} <= second_turns


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_turn_aborted_by_a_sync_loses_the_group_and_it_is_sent_again(rollout_on_stub):
    aborted = []

    @generation
    def route(body):
        if turn_of(body) == 1 and not aborted:
            aborted.append(body["prompt"])
            return rollout_on_stub.answer(body, [[0]], finish_reasons=["abort"])
        return rollout_on_stub.answer(body, seven_then_stop(body))

    rollout = with_episodes(rollout_on_stub(route, rows=rows(), tools=["agent_format:lookup"], max_turns=4))
    groups = rollout.run()
    rollout_on_stub.stop(rollout.producer)
    assert rollout.producer.lost_groups == 1 and rollout.producer.resent_groups == 1
    assert sorted(g.index for g in groups) == [0, 1] and all(len(g.completion_ids) == 2 for g in groups)


def test_a_turn_with_an_impossible_logprob_stops_the_run_naming_the_server_the_prompt_and_the_adapter(rollout_on_stub):
    @generation
    def route(body):
        return rollout_on_stub.answer(body, seven_then_stop(body), logprob=-5000.0 if turn_of(body) == 0 else -0.5)

    rollout = with_episodes(rollout_on_stub(route, rows=rows()[:1], groups_per_step=1, tools=["agent_format:lookup"],
                                            max_turns=4))
    seven = TOK.encode("7", add_special_tokens=False)[0]
    with pytest.raises(BehaviourLogprobError, match=rf"^{rollout.server.url} returned logprob -5000.0 for token 0 "
                                                    rf"\(id {seven}\) of completion 0 of the request for prompt 0 "
                                                    rf"\(adapter 'demo-v0'\)"):
        rollout.run()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("episode_version", ["pinned", "latest"])
def test_a_version_published_between_turns_is_used_only_with_episode_version_latest(rollout_on_stub, episode_version):
    published = []

    @generation
    def route(body):
        if not published:  # the first request of the run: its episode's next turn is sent after version 1 is live
            published.append(body["model"])
            rollout.producer.set_policy(1, "demo-v1")
        return rollout_on_stub.answer(body, seven_then_stop(body))

    rollout = with_episodes(rollout_on_stub(route, rows=rows(), tools=["agent_format:lookup"], max_turns=4,
                                            episode_version=episode_version))
    group = rollout.run(groups=1)[0]
    rollout_on_stub.stop(rollout.producer)
    bodies = rollout.generation_bodies()  # one request in flight: the first group's turns come first
    assert published == ["demo-v0"] and turn_of(bodies[0]) == 0
    first_episode_second_turn = next(b for b in bodies[1:] if turn_of(b) == 1)
    sampled = [v for vs, m in zip(group.versions, group.loss_mask) for v, k in zip(vs, m) if k]
    assert group.version == 0  # the oldest sampled token's version: what max_staleness bounds
    if episode_version == "latest":
        assert first_episode_second_turn["model"] == "demo-v1"
        assert set(sampled) == {0, 1}  # its first turn's tokens tagged 0, later turns' 1
    else:  # every turn of the group's episodes on the adapter it started on
        assert first_episode_second_turn["model"] == "demo-v0"
        assert set(sampled) == {0}
