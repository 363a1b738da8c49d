"""Episodes on scripted server answers: each turn is sent as the running ids (prompt + sampled + tool suffix, never
re-tokenized), the loss mask is 1 exactly on sampled ids, and the stop rules (no call, max_turns, token budgets, an
environment that is done) hold. The format is tests/agent_format.py's; the integration test runs it on vLLM."""

from __future__ import annotations

import copy
import threading
import time

import agent_tools
import pytest
from agent_format import CHAT_TEMPLATE, agent_tokenizer, lookup
from fakes import FakeVLLM
from fakes import cfg as make_cfg
from liveness import returns_within

from asyncgrpo.contracts import Group
from asyncgrpo.data import PromptRow
from asyncgrpo.errors import ConfigError, ToolError
from asyncgrpo.inference.client import Completion
from asyncgrpo.rollout.episodes import (ChatFormat, Episode, EpisodeRunner, EpisodeStats, TurnAborted, common_prefix,
                                        episode_group, reset_environment, tool_calls_of)
from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.rollout.admission import Admission
from asyncgrpo.rollout.tools import tool_schema

TOK = agent_tokenizer()
EOS = 0


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ScriptedClient:
    """Answers turn k of every episode with `turns[k]` (text + eos unless it ends with `...`), logprob -0.25 each."""

    def __init__(self, turns: list[str], finish: dict[int, str] | None = None):
        self.turns, self.finish, self.prompts, self.max_tokens = turns, finish or {}, [], []
        self.seeds, self.sampling = [], []  # per request: its seed; its (temperature, top_p)
        self.base_url = "http://scripted"

    def complete(self, model, prompt_ids, *, n, max_tokens, temperature, top_p, seed):
        k = TOK.decode(prompt_ids).count("<|im_start|>tool")  # the turn's index: tool messages before it
        self.prompts.append(list(prompt_ids))
        self.max_tokens.append(max_tokens)
        self.seeds.append(seed)
        self.sampling.append((temperature, top_p))
        text = self.turns[min(k, len(self.turns) - 1)]
        reason = self.finish.get(k, "stop")
        sampled = (ids(text) + ([EOS] if reason == "stop" else []))[:max_tokens]
        return [Completion(sampled, [-0.25] * len(sampled), text, reason, model)]


def runner(*, tools=(lookup,), factory=None, max_model_len=None, **values) -> EpisodeRunner:
    cfg = make_cfg(num_generations=2, tools=["agent_format:lookup"], **values)
    return EpisodeRunner(ChatFormat(TOK, TOK.response_template, stop_ids={EOS}), cfg, tools=list(tools),
                         factory=factory, max_model_len=max_model_len)


ROW = PromptRow(prompt=[{"role": "user", "content": "07,45>"}], prompt_ids=[], columns={"start": 1},
                rendered="<rendered>")


def test_each_turn_continues_on_the_exact_sampled_ids_plus_the_rendered_tool_message():
    r = runner(max_turns=3, max_completion_length=20)
    client = ScriptedClient(["45", "7", ""])
    (e,) = [r.start(ROW)]
    r.run(client, e, adapter="a-v3", version=3, seed=None)
    suffix = ids("\n<|im_start|>tool\n") + ids("[2]") + TOK.convert_tokens_to_ids(["<|im_end|>"]) + ids("\n") + \
        TOK.convert_tokens_to_ids(["<|im_start|>"]) + ids("assistant\n")
    turn1 = ids("45") + [EOS]
    assert client.prompts[1] == e.prompt_ids + turn1 + suffix
    assert client.prompts[2][len(client.prompts[1]):][:2] == ids("7") + [EOS]
    assert e.turns == 3 and e.finish_reason == "stop" and e.tool_calls == 2
    assert e.ids == client.prompts[2][len(e.prompt_ids):] + [EOS]  # the last turn: the eos alone
    sampled = [1] * 3 + [0] * len(suffix)
    assert e.loss_mask[:len(sampled)] == sampled
    assert sum(e.loss_mask) == 3 + 2 + 1
    assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(e.logprobs, e.loss_mask))
    assert set(e.versions) == {3}
    assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert e.messages[1] == {"role": "tool", "name": "lookup", "content": "[2]"}
    assert e.messages[0]["tool_calls"][0]["function"]["arguments"] == {"key": "45"}


def test_an_episode_stops_at_max_turns_with_its_last_call_not_run():
    r = runner(max_turns=2, max_completion_length=20)
    e = r.start(ROW)
    # bounded: every turn calls the tool, so a miscounted turn would never end the episode
    returns_within(lambda: r.run(ScriptedClient(["45"]), e, adapter="a", version=0, seed=None), 20.0, "max_turns: 2")
    assert e.turns == 2 and e.tool_calls == 1 and e.finish_reason == "stop"
    assert e.messages[-1]["role"] == "assistant" and "tool_calls" in e.messages[-1]


def test_an_episode_that_reaches_max_episode_tokens_is_truncated():
    r = runner(max_turns=5, max_completion_length=20, max_episode_tokens=30, mask_truncated_completions=True)
    client = ScriptedClient(["4545"])
    e = r.start(ROW)
    r.run(client, e, adapter="a", version=0, seed=None)
    assert e.finish_reason == "length" and len(e.ids) <= 30
    assert client.max_tokens[0] == 20  # the turn's budget, within the episode's
    assert client.max_tokens[-1] == 30 - (len(client.prompts[-1]) - len(e.prompt_ids))  # what the episode has left
    group = episode_group(ROW, [e, e], [0.0, 1.0], {}, index=0, version=0, adapter="a", cfg=r.cfg)
    assert group.masked == [True, True]


def test_a_turn_cut_by_its_token_budget_ends_the_episode_as_truncated():
    r = runner(max_turns=5, max_completion_length=20)
    e = r.start(ROW)
    r.run(ScriptedClient(["45"], finish={0: "length"}), e, adapter="a", version=0, seed=None)
    assert e.turns == 1 and e.tool_calls == 0 and e.finish_reason == "length"


def test_the_server_context_bounds_each_turn():
    r = runner(max_turns=5, max_completion_length=50, max_model_len=80)
    client = ScriptedClient(["45"])
    e = r.start(ROW)
    r.run(client, e, adapter="a", version=0, seed=None)
    assert all(len(p) + m <= 80 for p, m in zip(client.prompts, client.max_tokens))
    assert e.finish_reason == "length"


def test_an_aborted_turn_loses_the_group():
    r = runner(max_turns=3)
    with pytest.raises(TurnAborted, match="^turn 2 was aborted by a sync$"):
        r.run_group(ScriptedClient(["45"], finish={1: "abort"}), ROW, n=2, adapter="a", version=0, seed=None)


def test_tool_timeouts_add_up_over_the_turns_of_an_episode():
    def lookup(key: str) -> str:
        """Loop past any tool_timeout, in Python, where the stop lands.

        Args:
            key: not read
        """
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return "late"

    r = runner(tools=(lookup,), max_turns=3, tool_timeout=0.05)
    e = r.start(ROW)
    r.run(ScriptedClient(["45", "7", ""]), e, adapter="a", version=0, seed=None)
    assert (e.tool_calls, e.tool_errors, e.tool_timeouts) == (2, 2, 2)


def test_each_episode_gets_its_own_environment_reset_with_the_row_and_its_observation_in_the_prompt():
    agent_tools.Counter.instances = 0
    r = runner(tools=(), factory=agent_tools.Counter, max_turns=4, max_completion_length=20)
    episodes = [r.start(ROW), r.start(ROW)]
    assert agent_tools.Counter.instances == 2 and episodes[0].environment is not episodes[1].environment
    assert episodes[0].environment.row == {"start": 1, "prompt": ROW.prompt}
    assert "07,45> (start 1)" in TOK.decode(episodes[0].prompt_ids)
    assert list(episodes[0].tools) == ["increment"]


def test_episodes_whose_prompts_differ_share_their_common_prefix_and_carry_the_rest_as_context():
    r = runner(max_turns=1, max_completion_length=20)
    a, b = r.start(ROW), r.start(ROW)
    b.prompt_ids = b.prompt_ids[:-3] + ids("xyz")
    for e in (a, b):
        r.run(ScriptedClient([""]), e, adapter="a", version=1, seed=None)
    group = episode_group(ROW, [a, b], [1.0, 0.0], {}, index=4, version=1, adapter="a", cfg=r.cfg)
    assert group.prompt_ids == a.prompt_ids[:-3] and common_prefix([a.prompt_ids, b.prompt_ids]) == len(a.prompt_ids) - 3
    assert group.completion_ids[1] == ids("xyz") + [EOS]
    assert group.loss_mask[1] == [0, 0, 0, 1] and group.behaviour_logprobs[1] == [0.0, 0.0, 0.0, -0.25]
    assert group.versions == [[1] * 4, [1] * 4] and group.n_sampled_tokens == 2


def test_a_plain_group_has_no_loss_mask_and_counts_every_token_as_sampled():
    g = Group(prompt="p", prompt_ids=[1], completion_ids=[[1, 2], [3]], behaviour_logprobs=[[0.0] * 2, [0.0]],
              rewards=[0.0, 1.0], reward_parts={}, advantages=[0.0, 0.0], version=0, adapter="a")
    assert g.loss_mask == [] and g.n_sampled_tokens == 3
    assert g.completion(1).loss_mask == []


def test_a_group_of_episodes_runs_every_episode_and_counts_them():
    r = runner(max_turns=3, max_completion_length=20)
    episodes = r.run_group(ScriptedClient(["45", ""]), ROW, n=2, adapter="a", version=0, seed=7)
    assert [e.turns for e in episodes] == [2, 2]
    values = r.stats.values()
    assert values["episodes/total"] == 2 and values["episodes/turns_mean"] == 2.0
    assert values["episodes/tool_calls_total"] == 2 and values["episodes/tool_errors_total"] == 0


def test_a_turn_the_parser_rejects_is_plain_text_and_ends_the_episode():
    fmt = ChatFormat(TOK, {"fields": {"content": {"close": "<|im_end|>", "content": "json"}}}, stop_ids={EOS})
    message = fmt.parse(ids("ok"), ids("not json"), [])
    assert message == {"role": "assistant", "content": "not json"}


def test_an_environments_get_reward_is_one_more_reward_named_after_its_class_and_rewards_see_the_environments():
    from asyncgrpo.rollout.build import build_episode_runner, make_group_scorer

    config = make_cfg(environment_factory="agent_tools:Counter", reward_funcs=["agent_tools:messages_reward"])
    scoring = make_group_scorer(config, TOK, None)
    envs = [agent_tools.Counter(), agent_tools.Counter()]
    envs[0].count, envs[1].count = 1, 3
    messages = [[{"role": "assistant", "content": "x"}], [{"role": "assistant", "content": "y"}] * 3]
    rewards, parts = scoring.score_episodes(ROW, [ROW.prompt] * 2, messages, [[1], [2]], ["stop", "stop"], envs)
    assert parts == {"messages_reward": [1.0, 3.0], "Counter": [1.0, 3.0]}
    assert rewards == [2.0, 6.0]
    assert build_episode_runner(make_cfg(), TOK, "/nonexistent", None) is None  # no tools: plain completions


def test_an_environment_with_get_reward_and_no_reward_funcs_is_scored_by_get_reward_alone():
    from asyncgrpo.rollout.build import make_group_scorer

    config = make_cfg(environment_factory="agent_tools:Counter")
    scoring = make_group_scorer(config, TOK, None)
    assert (scoring.scorer.refs, scoring.scorer.weights) == (["agent_tools:Counter"], [1.0])
    assert config.reward_funcs == []  # the config's list is left as it was
    envs = [agent_tools.Counter(), agent_tools.Counter()]
    envs[0].count, envs[1].count = 2, 0
    rewards, parts = scoring.score_episodes(ROW, [ROW.prompt] * 2, [[], []], [[1], [2]], ["stop", "stop"], envs)
    assert parts == {"Counter": [2.0, 0.0]} and rewards == [2.0, 0.0]
    with pytest.raises(ConfigError, match="reward_funcs.*LookupEnv has no get_reward"):
        make_group_scorer(make_cfg(environment_factory="asyncgrpo.toy.agent_task:LookupEnv"), TOK, None)


def test_an_environment_without_get_reward_adds_no_reward():
    from asyncgrpo.rollout.build import make_group_scorer
    from asyncgrpo.toy.agent_task import LookupEnv

    assert not hasattr(LookupEnv, "get_reward")  # the toy agent world's environment: scored by functions alone
    config = make_cfg(environment_factory="asyncgrpo.toy.agent_task:LookupEnv",
                      reward_funcs=["agent_tools:messages_reward"])
    scoring = make_group_scorer(config, TOK, None)
    assert (scoring.scorer.refs, scoring.scorer.weights) == (["agent_tools:messages_reward"], [1.0])
    messages = [[{"role": "assistant", "content": "x"}], [{"role": "assistant", "content": "y"}] * 2]
    rewards, parts = scoring.score_episodes(ROW, [ROW.prompt] * 2, messages, [[1], [2]], ["stop", "stop"],
                                            [LookupEnv(), LookupEnv()])
    assert parts == {"messages_reward": [1.0, 2.0]} and rewards == [1.0, 2.0]


# ---- episode_version: which adapter each turn is sent to. Pinned: every turn on the group's start version. Latest:
# each turn on the version served when it starts, held in use (never unloaded) until its answer is in, and the group
# as old as its oldest sampled token for max_staleness. The scripted client makes a publish land between two turns,
# which a real server cannot be timed to do. ------------------------------------------------------------------------
class PublishingClient(ScriptedClient):
    """Scripted turns; after turn k's answer, `after[k]()` runs (a publish between turns). Records each turn's
    adapter and what was in use while it ran."""

    def __init__(self, turns, after, schedule):
        super().__init__(turns)
        self.after, self.schedule, self.models, self.in_use = after, schedule, [], []

    def complete(self, model, prompt_ids, **kwargs):
        self.models.append(model)
        self.in_use.append(self.schedule.adapters_in_use())
        answer = super().complete(model, prompt_ids, **kwargs)
        self.after.get(len(self.models) - 1, lambda: None)()
        return answer


def schedule_at(version: int) -> Admission:
    schedule = Admission(make_cfg(), groups_per_step=1, max_inflight=4)
    schedule.set_policy(version, f"a-v{version}")
    return schedule


def run_three_turns(latest: bool):
    """One episode of three turns, its group sent at version 2; version 3 is served by its first turn, 4 and 5 are
    published after turns 1 and 2. Returns the episode, the client, its group and the schedule."""
    schedule = schedule_at(3)
    client = PublishingClient(["45", "7", ""], {0: lambda: schedule.set_policy(4, "a-v4"),
                                               1: lambda: schedule.set_policy(5, "a-v5")}, schedule)
    r = runner(max_turns=3, max_completion_length=20)
    e = r.start(ROW)
    r.run(client, e, adapter="a-v2", version=2, seed=None, latest=schedule.latest if latest else None)
    group = episode_group(ROW, [e, e], [0.0, 1.0], {}, index=0, version=2, adapter="a-v2", cfg=r.cfg)
    return e, client, group, schedule


def sampled_versions(e) -> list[int]:
    return [v for v, m in zip(e.versions, e.loss_mask) if m]


def test_pinned_sends_every_turn_to_the_version_the_group_started_on():
    e, client, group, _ = run_three_turns(latest=False)
    assert client.models == ["a-v2"] * 3
    assert set(e.versions) == {2} and group.version == 2


def test_latest_sends_each_turn_to_the_newest_served_version_and_tags_its_tokens_with_it():
    e, client, group, _ = run_three_turns(latest=True)
    assert client.models == ["a-v3", "a-v4", "a-v5"]
    assert sampled_versions(e) == [3, 3, 3, 4, 4, 5]  # "45"+eos on v3, "7"+eos on v4, eos on v5
    # each tool message is tagged with the turn it follows (context: never in the loss)
    assert [v for v, m in zip(e.versions, e.loss_mask) if not m] == sorted(v for v, m in zip(e.versions, e.loss_mask)
                                                                            if not m)
    assert group.versions[0][-1] == 5
    assert group.version == 3  # as old as its oldest token: not its newest (5), nor the version it was sent at (2)


def test_a_turn_holds_its_adapter_in_use_until_its_answer_is_in():
    _, client, _, schedule = run_three_turns(latest=True)
    assert client.in_use == [{"a-v3"}, {"a-v4"}, {"a-v5"}]
    assert schedule.adapters_in_use() == set()  # released after each turn


def test_the_publisher_never_unloads_the_adapter_a_turn_in_flight_uses(tmp_path):
    paths = [tmp_path / f"v{i:06d}" for i in range(1, 4)]
    for p in paths:
        p.mkdir()
    server = FakeVLLM("http://a:8000")
    publisher = AdapterPublisher([server], "pol", sync_mode="versioned", adapter_root=tmp_path)
    schedule = Admission(make_cfg(), groups_per_step=1, max_inflight=4)

    def publish(version: int) -> None:  # as the rollout side does: serve, tell the schedule, then retire
        publisher.publish(version, paths[version - 1])
        schedule.set_policy(version, publisher.current_name)
        publisher.retire(in_use=schedule.adapters_in_use())

    publish(1)
    with schedule.latest() as (version, adapter):  # a turn sent on v1 ...
        publish(2)
        publish(3)  # ... is still running while two versions are published
        assert (version, adapter) == (1, "pol-v1") and "pol-v1" in server.served and "pol-v2" not in server.served
    publisher.retire(in_use=schedule.adapters_in_use())
    assert set(server.served) == {"pol-v3"}  # once its answer is in, the next retire unloads it


def test_the_staleness_bound_reads_the_oldest_token_of_a_latest_group():
    _, _, group, _ = run_three_turns(latest=True)  # tokens of versions 3, 4 and 5
    queue = RolloutQueue(max_staleness=1)
    queue.put(group)
    with pytest.raises(TimeoutError):
        queue.take(1, trainer_version=5, timeout_s=0.01)  # 5 - 3 > 1: dropped, though its newest token is fresh
    assert queue.dropped_stale == 1
    queue.put(group)
    assert queue.take(1, trainer_version=4, timeout_s=0.01) == [group]  # 4 - 3 <= 1 (4 - 2 would not be)


def test_an_unknown_episode_version_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="episode_version.*use pinned or latest"):
        make_cfg(episode_version="newest")


# ---- the parts of an episode, one at a time ---------------------------------------------------------------------
def test_tool_calls_are_read_in_the_openai_and_the_bare_form_and_a_call_without_name_or_arguments_still_counts():
    message = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}},
        {"name": "add", "arguments": {"x": 1}},  # no `function` wrapper: the call itself
        {"function": {}},  # neither: a call of no tool (call_tool answers "no tool named ''"), with no arguments
        "lookup(a)",  # not an object at all
    ]}
    assert tool_calls_of(message) == [("lookup", {"key": "a"}), ("add", {"x": 1}), ("", {}), ("", {})]
    assert tool_calls_of({"role": "assistant", "content": "done"}) == []
    assert tool_calls_of({"role": "assistant", "tool_calls": None}) == []


def test_append_adds_sampled_ids_with_their_logprobs_and_context_ids_with_none_after_what_is_there():
    e = Episode(prompt=[], prompt_ids=[9], tools={}, schemas=[])
    e.append([1, 2], [-0.5, -0.25], 3)
    e.append([5, 6, 7], None, 4)
    e.append([8], [-1.0], 4)
    assert e.ids == [1, 2, 5, 6, 7, 8]
    assert e.loss_mask == [1, 1, 0, 0, 0, 1]
    assert e.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert e.versions == [3, 3, 4, 4, 4, 4]


def finished(turns: int, calls: int, errors: int, seconds: float, tokens: int, reason: str,
             timeouts: int = 0) -> Episode:
    e = Episode(prompt=[], prompt_ids=[], tools={}, schemas=[], ids=[0] * tokens, finish_reason=reason, turns=turns)
    e.tool_calls, e.tool_errors, e.tool_seconds, e.tool_timeouts = calls, errors, seconds, timeouts
    return e


def counters(stats: EpisodeStats) -> dict:
    """The counters, without the gauge of hung tool threads (the process's, which other tests move)."""
    values = stats.values()
    assert values.pop("episodes/tool_threads_hung") >= 0
    return values


def test_episode_stats_add_up_every_episode_so_far_and_average_over_episodes():
    stats = EpisodeStats()
    assert stats.values()["episodes/turns_mean"] == 0.0  # none yet: no division by zero
    stats.add([finished(turns=2, calls=1, errors=1, seconds=0.5, tokens=4, reason="length", timeouts=1)])
    assert counters(stats) == {"episodes/total": 1, "episodes/turns_mean": 2.0, "episodes/tool_calls_total": 1,
                               "episodes/tool_errors_total": 1, "episodes/tool_timeouts_total": 1,
                               "episodes/tool_seconds_total": 0.5, "episodes/tokens_mean": 4.0,
                               "episodes/truncated_total": 1}
    stats.add([finished(turns=1, calls=0, errors=0, seconds=0.25, tokens=2, reason="stop"),
               finished(turns=6, calls=2, errors=1, seconds=1.0, tokens=9, reason="length", timeouts=1)])
    assert counters(stats) == {"episodes/total": 3, "episodes/turns_mean": 3.0, "episodes/tool_calls_total": 3,
                               "episodes/tool_errors_total": 2, "episodes/tool_timeouts_total": 2,
                               "episodes/tool_seconds_total": 1.75, "episodes/tokens_mean": 5.0,
                               "episodes/truncated_total": 2}


class Observer:
    """An environment whose reset returns what the test sets in `observation` (awaited if `asynchronous`)."""

    observation: object = None
    asynchronous = False

    def reset(self, **row):
        if not self.asynchronous:
            return self.observation

        async def later():
            return self.observation

        return later()


class Broken:
    def reset(self, **row):
        raise ValueError("no table for this row")


def test_a_reset_observation_is_text_only_sync_or_async_and_a_failing_reset_names_the_class_and_the_prompt():
    env = Observer()
    for asynchronous in (False, True):
        env.asynchronous = asynchronous
        env.observation = " (start 3)"
        assert reset_environment(env, ROW) == " (start 3)"
        for nothing in ("", None, {"start": 3}, 7):  # no text: nothing is appended to the prompt
            env.observation = nothing
            assert reset_environment(env, ROW) is None
    with pytest.raises(ToolError, match=r"^Broken.reset raised ValueError: no table for this row on prompt \[\{'role'"):
        reset_environment(Broken(), ROW)


def test_common_prefix_is_the_length_every_sequence_shares():
    assert common_prefix([[1, 2, 3]]) == 3
    assert common_prefix([[1, 2, 3], [1, 2]]) == 2
    assert common_prefix([[1, 2, 3], [1, 5, 3], [1, 2, 3]]) == 1
    assert common_prefix([[4], [1, 2]]) == 0


# ---- sampling settings, seeds and budgets -------------------------------------------------------------------------
def test_every_turn_is_sampled_with_the_configured_settings_and_a_seed_of_its_own_per_episode_and_turn():
    r = runner(max_turns=3, max_completion_length=20, temperature=0.7)
    client = ScriptedClient(["45", "7", ""])
    r.run_group(client, ROW, n=2, adapter="a", version=0, seed=7)
    assert sorted(client.seeds) == sorted([7, 7 + 7919, 7 + 2 * 7919, 8, 8 + 7919, 8 + 2 * 7919])  # episode j: seed + j
    assert set(client.sampling) == {(0.7, 1.0)}
    e = r.start(ROW)
    client = ScriptedClient(["45", "7", ""])
    r.run(client, e, adapter="a", version=0, seed=2**31 - 5)
    assert client.seeds == [2**31 - 5, 7914, 7914 + 7919]  # kept within vLLM's 31 bits
    client = ScriptedClient(["45", ""])
    r.run_group(client, ROW, n=2, adapter="a", version=0, seed=None)
    assert client.seeds == [None] * 4  # no seed: the server draws


def turn_lengths() -> tuple[int, int]:
    """(ids of the sampled turn "45" with its eos, ids of the tool message and generation prompt that follow it)."""
    r = runner(max_turns=2, max_completion_length=20)
    e = r.start(ROW)
    r.run(ScriptedClient(["45"]), e, adapter="a", version=0, seed=None)
    return 3, e.loss_mask.count(0)


def test_a_turn_with_one_token_of_room_left_is_still_sampled_and_the_next_tool_message_then_does_not_fit():
    turn, suffix = turn_lengths()
    r = runner(max_turns=5, max_completion_length=20, max_episode_tokens=turn + suffix + 1)
    client = ScriptedClient(["45"])
    e = r.start(ROW)
    r.run(client, e, adapter="a", version=0, seed=None)
    assert client.max_tokens == [20, 1]
    assert e.turns == 2 and e.finish_reason == "length" and len(e.ids) == turn + suffix + 1
    r = runner(max_turns=5, max_completion_length=20, max_episode_tokens=turn + suffix)  # no token after the message
    e = r.start(ROW)
    client = ScriptedClient(["45"])
    r.run(client, e, adapter="a", version=0, seed=None)
    assert client.max_tokens == [20] and e.finish_reason == "length" and e.ids == e.ids[:turn]


def test_an_episode_never_outgrows_the_server_context_and_a_prompt_that_fills_it_is_truncated_unsent():
    turn, suffix = turn_lengths()
    prompt = len(runner().start(ROW).prompt_ids)
    r = runner(max_turns=5, max_completion_length=20, max_model_len=prompt + turn + suffix - 1)
    e = r.start(ROW)
    r.run(ScriptedClient(["45"]), e, adapter="a", version=0, seed=None)
    assert e.finish_reason == "length" and len(e.ids) == turn  # the tool message did not fit: not appended
    r = runner(max_turns=5, max_completion_length=20, max_model_len=prompt)
    client = ScriptedClient(["45"])
    e = r.start(ROW)
    r.run(client, e, adapter="a", version=0, seed=None)
    assert client.prompts == [] and e.turns == 0 and e.finish_reason == "length"


# ---- an environment's tool --------------------------------------------------------------------------------------
class Desk:
    """An environment whose one tool is this format's `lookup`, so the scripted turns call it with their text as the
    key: an int, as its schema says (the parser casts it). Key 9 ends the episode (`done`, set only then), key 1
    raises, key 0 hangs until `release` is set."""

    release = threading.Event()

    def __init__(self):
        self.keys = []

    def reset(self, **row):
        return None

    def lookup(self, key: int) -> str:
        """Look a key up.

        Args:
            key: the key
        """
        self.keys.append(key)
        if key == 9:
            self.done = True
        if key == 1:
            raise KeyError(key)
        if key == 0:
            Desk.release.wait(60)
        return "ok"


def test_an_environment_that_is_done_ends_the_episode_after_its_tool_message():
    r = runner(tools=(), factory=Desk, max_turns=5, max_completion_length=20)
    e = r.start(ROW)
    client = ScriptedClient(["45", "9", "7"])
    r.run(client, e, adapter="a", version=0, seed=None)
    assert e.environment.keys == [45, 9]  # ints: the schema of the environment's tool cast them
    assert e.turns == 2 and e.finish_reason == "stop" and len(client.prompts) == 2
    assert e.messages[-1] == {"role": "tool", "name": "lookup", "content": "ok"}
    assert e.ids[-2:] == ids("9") + [EOS] and e.loss_mask[-2:] == [1, 1]  # no tool message rendered after it


def test_tool_errors_and_seconds_add_up_over_the_turns_and_a_hung_tool_is_cut_at_tool_timeout():
    Desk.release = threading.Event()
    r = runner(tools=(), factory=Desk, max_turns=5, max_completion_length=20, tool_timeout=0.2)
    e = r.start(ROW)
    try:
        returns_within(lambda: r.run(ScriptedClient(["0", "1", ""]), e, adapter="a", version=0, seed=None), 20.0,
                       "an episode whose first tool call hangs")
    finally:
        Desk.release.set()
    assert e.turns == 3 and e.tool_calls == 2 and e.tool_errors == 2
    assert e.tool_seconds >= 0.2  # the first turn's call waited its whole tool_timeout
    assert "did not finish within tool_timeout=0.2 s" in e.messages[1]["content"]
    assert e.messages[3]["content"] == '{"error": "KeyError: 1"}'


# ---- the group the trainer gets ---------------------------------------------------------------------------------
def test_an_episode_group_carries_the_rows_rendered_prompt_its_scores_and_finish_reasons():
    a = Episode(prompt=[], prompt_ids=[1, 2, 3], tools={}, schemas=[], finish_reason="stop")
    b = Episode(prompt=[], prompt_ids=[1, 2, 3], tools={}, schemas=[], finish_reason="length")
    a.append([4, 5], [-0.5, -0.5], 2)
    b.append([6], [-0.25], 2)
    parts = {"r": [0.0, 4.0]}
    group = episode_group(ROW, [a, b], [0.0, 4.0], parts, index=5, version=2, adapter="a-v2",
                          cfg=make_cfg(scale_rewards="batch"))  # the batch's std scales it later: centred only
    assert group.prompt == "<rendered>" and group.prompt_ids == [1, 2, 3]
    assert group.completion_ids == [[4, 5], [6]] and group.behaviour_logprobs == [[-0.5, -0.5], [-0.25]]
    assert group.rewards == [0.0, 4.0] and group.reward_parts == parts and group.advantages == [-2.0, 2.0]
    assert (group.version, group.adapter, group.index) == (2, "a-v2", 5)
    assert group.finish_reasons == ["stop", "length"] and group.masked == []  # mask_truncated_completions off
    group = episode_group(ROW, [a, b], [0.0, 4.0], parts, index=5, version=2, adapter="a-v2",
                          cfg=make_cfg(scale_rewards="group"))
    assert group.advantages == pytest.approx([-2.0 / 8**0.5, 2.0 / 8**0.5], abs=1e-3)



def test_an_episode_group_is_as_old_as_its_oldest_sampled_token_or_as_sent_when_nothing_was_sampled():
    a = Episode(prompt=[], prompt_ids=[1, 2], tools={}, schemas=[])
    a.append([4], [-0.5], 3)
    a.append([9, 9], None, 1)  # context (a tool message) tagged older: not sampled, so it does not count
    a.append([5], [-0.5], 4)
    group = episode_group(ROW, [a, a], [0.0, 1.0], {}, index=0, version=2, adapter="a-v2", cfg=make_cfg())
    assert group.version == 3  # the oldest sampled token's version, not the one it was sent with nor the context's
    empty = Episode(prompt=[], prompt_ids=[1, 2], tools={}, schemas=[], finish_reason="length")  # prompt filled it
    group = episode_group(ROW, [empty, empty], [0.0, 0.0], {}, index=0, version=2, adapter="a-v2", cfg=make_cfg())
    assert group.version == 2 and group.completion_ids == [[], []]

# ---- the chat format: what it renders, and what it refuses --------------------------------------------------------
def test_the_prompt_lists_the_tools_and_gets_the_system_prompt_unless_it_has_its_own():
    schemas = [tool_schema(lookup)]
    plain = ChatFormat(TOK, TOK.response_template, stop_ids={EOS})
    assert TOK.decode(plain.prompt_ids(ROW.prompt, schemas)) == \
        "<|im_start|>system\ntools: lookup<|im_end|>\n<|im_start|>user\n07,45><|im_end|>\n<|im_start|>assistant\n"
    told = ChatFormat(TOK, TOK.response_template, stop_ids={EOS}, system_prompt="Be brief.")
    assert TOK.decode(told.prompt_ids(ROW.prompt, [])) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n07,45><|im_end|>\n<|im_start|>assistant\n"
    own = [{"role": "system", "content": "Mine."}, *ROW.prompt]
    assert TOK.decode(told.prompt_ids(own, [])) == \
        "<|im_start|>system\nMine.<|im_end|>\n<|im_start|>user\n07,45><|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_kwargs_reach_the_prompt_and_the_tool_messages():
    tok = copy.deepcopy(TOK)
    tok.chat_template = CHAT_TEMPLATE + "{% if mark %}[mark]{% endif %}"
    fmt = ChatFormat(tok, tok.response_template, stop_ids={EOS}, template_kwargs={"mark": True})
    assert TOK.decode(fmt.prompt_ids(ROW.prompt, [])).endswith("<|im_start|>assistant\n[mark]")
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "lookup",
                                                                                  "arguments": {"key": "45"}}}]}
    suffix = fmt.tool_suffix(call, [{"role": "tool", "name": "lookup", "content": "[2]"}], [])
    assert TOK.decode(suffix) == "\n<|im_start|>tool\n[2]<|im_end|>\n<|im_start|>assistant\n[mark]"


def test_a_tokenizer_that_cannot_run_episodes_is_refused_naming_what_is_missing_and_the_fix():
    with pytest.raises(ConfigError) as error:
        ChatFormat(TOK, None, stop_ids={EOS})
    assert error.value.field == "tools"
    assert "has no response_template, so tool calls cannot be parsed from what the model samples" in str(error.value)
    assert str(error.value).endswith(". Fix: set `tokenizer.response_template` (transformers' response template dict; "
                                     "TRL's chat_template_utils has them for Qwen3 and Gemma 4) and save the tokenizer")
    bare = copy.deepcopy(TOK)
    bare.chat_template = None
    with pytest.raises(ConfigError) as error:
        ChatFormat(bare, TOK.response_template, stop_ids={EOS})
    assert error.value.field == "tools" and "has no chat template" in str(error.value)
    assert str(error.value).endswith(". Fix: use a tokenizer whose chat template renders tool calls and tool messages")


def test_a_template_whose_turns_end_on_no_stop_id_or_that_rerenders_earlier_turns_is_refused_for_tool_messages():
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "lookup",
                                                                                  "arguments": {"key": "45"}}}]}
    result = [{"role": "tool", "name": "lookup", "content": "[2]"}]
    with pytest.raises(ToolError, match=r"renders an assistant tool-call turn with none of the stop ids \[7\], so "
                                        r"where a sampled turn ends in it is unknown. Fix: give the tokenizer"):
        ChatFormat(TOK, TOK.response_template, stop_ids={7}).tool_suffix(call, result, [])
    counting = copy.deepcopy(TOK)
    counting.chat_template = "{{ messages | length }}" + CHAT_TEMPLATE  # the count changes as messages are added
    with pytest.raises(ToolError) as error:
        ChatFormat(counting, TOK.response_template, stop_ids={EOS}).tool_suffix(call, result, [])
    assert "not prefix-preserving" in str(error.value)
    assert str(error.value).endswith(". Fix: use a template that keeps earlier turns as they were rendered (TRL ships "
                                     "*_training templates)")


def test_episodes_need_chat_prompts_and_an_environment_that_can_be_built_with_documented_tools():
    with pytest.raises(ConfigError) as error:
        runner().start(PromptRow(prompt="07,45>", prompt_ids=[1], columns={}))
    assert error.value.field == "prompt_format" and "is plain text, but episodes need chat messages" in str(error.value)
    assert str(error.value).endswith(". Fix: use `prompt_format: chat`")

    def broken():
        raise RuntimeError("no room")

    with pytest.raises(ToolError, match=r"^environment_factory agent_tools:Counter could not be built: RuntimeError: "
                                        r"no room"):
        runner(tools=(), factory=broken, environment_factory="agent_tools:Counter").start(ROW)

    class Undocumented(Observer):
        def peek(self, x: int) -> int:
            return x

    with pytest.raises(ConfigError) as error:
        runner(tools=(), factory=Undocumented).start(ROW)
    assert error.value.field == "environment_factory" and "no schema for tool" in str(error.value)
    with pytest.raises(ConfigError) as error:
        runner(tools=(agent_tools.no_docstring,))
    assert error.value.field == "tools"
    assert runner().start(ROW).environment is None  # tools alone: no environment


def test_environments_are_reused_across_groups_and_closed_at_the_end_never_one_per_episode():
    agent_tools.Counter.instances = 0
    r = runner(tools=(), factory=agent_tools.Counter, max_turns=2, max_completion_length=20)
    first = r.run_group(ScriptedClient(["45", ""]), ROW, n=2, adapter="a", version=0, seed=None)
    envs = {id(e.environment) for e in first}
    for e in first:
        e.environment.count = 99  # state left by the first episodes
    r.release(first)
    assert all(e.environment is None for e in first)
    second = r.run_group(ScriptedClient(["45", ""]), ROW, n=2, adapter="a", version=0, seed=None)
    assert {id(e.environment) for e in second} == envs and agent_tools.Counter.instances == 2  # reset, not rebuilt
    assert [e.environment.count for e in second] == [1, 1]  # reset with the row (`start`) before reuse
    r.release(second)
    with pytest.raises(TurnAborted):  # a lost group gives its environments back too
        r.run_group(ScriptedClient(["45"], finish={1: "abort"}), ROW, n=2, adapter="a", version=0, seed=None)
    r.run_group(ScriptedClient(["45", ""]), ROW, n=2, adapter="a", version=0, seed=None)
    assert agent_tools.Counter.instances == 2


def test_closing_the_runner_closes_every_pooled_environment_and_one_given_back_later():
    agent_tools.Workshop.closed = 0
    r = runner(tools=(), factory=agent_tools.Workshop, max_turns=1, max_completion_length=20)
    done = r.run_group(ScriptedClient([""]), ROW, n=2, adapter="a", version=0, seed=None)
    late = r.run_group(ScriptedClient([""]), ROW, n=1, adapter="a", version=0, seed=None)
    r.release(done)
    r.close()
    assert agent_tools.Workshop.closed == 2
    r.release(late)  # a group still being scored when the run ended
    assert agent_tools.Workshop.closed == 3


def test_an_environment_that_owns_its_data_runs_without_a_dataset_its_reset_giving_the_prompt():
    from asyncgrpo.data import load_prompt_set
    from asyncgrpo.rollout.build import make_group_scorer

    config = make_cfg(dataset_name="environment", environment_factory="agent_tools:Riddles", num_generations=2,
                      max_turns=2, max_completion_length=20)
    (row,) = load_prompt_set(config, TOK).rows  # one placeholder row: every group is its episodes
    assert row.prompt == [{"role": "user", "content": ""}] and row.columns == {}
    r = EpisodeRunner(ChatFormat(TOK, TOK.response_template, stop_ids={EOS}), config, tools=[],
                      factory=agent_tools.Riddles, max_model_len=None)
    episodes = r.run_group(ScriptedClient(["45", ""]), row, n=2, adapter="a", version=0, seed=None)
    assert [e.prompt for e in episodes] == [[{"role": "user", "content": "Say 45."}]] * 2
    assert TOK.decode(episodes[0].prompt_ids).endswith("user\nSay 45.<|im_end|>\n<|im_start|>assistant\n")
    assert episodes[0].environment.kwargs == {"prompt": [{"role": "user", "content": ""}]}  # TRL: the row
    rewards, parts = make_group_scorer(config, TOK, None).score_episodes(
        row, [e.prompt for e in episodes], [e.messages for e in episodes], [e.ids for e in episodes],
        [e.finish_reason for e in episodes], [e.environment for e in episodes])
    assert parts == {"Riddles": [1.0, 1.0]} and rewards == [1.0, 1.0]  # get_reward alone: no default reward


def test_a_tool_result_is_capped_in_characters_then_in_tokens_and_a_call_its_schema_refuses_is_an_error_to_read():
    r = runner(tools=(), factory=agent_tools.Loud, max_turns=3, max_completion_length=20, tool_output_max_chars=120,
               tool_output_max_tokens=100)
    e = r.start(ROW)
    r.run(ScriptedClient(["100", "ab", ""]), e, adapter="a", version=0, seed=None)  # key 100: 200 characters
    # 120 characters and the line saying they were cut: 170 one-character tokens, cut to 100
    assert e.messages[1]["content"] == "ab" * 50 + "\n[output cut: 170 tokens, the first 100 shown]"
    assert e.messages[3] == {"role": "tool", "name": "lookup",
                             "content": '{"error": "lookup was not called: key must be integer, got str \'ab\'"}'}
    assert (e.tool_calls, e.tool_errors) == (2, 1)
    assert "ab" * 50 + "\n[output cut: 170 tokens" in TOK.decode(e.ids)  # what the model reads next
    uncut = runner(tools=(), factory=agent_tools.Loud, max_turns=2, max_completion_length=20,
                   tool_output_max_chars=120, tool_output_max_tokens=None)
    e = uncut.start(ROW)
    uncut.run(ScriptedClient(["100", ""]), e, adapter="a", version=0, seed=None)
    assert e.messages[1]["content"] == "ab" * 60 + "\n[output cut: 200 characters, the first 120 shown]"


def test_tool_process_runs_the_tools_by_reference_and_is_refused_where_namespaces_cannot_start(monkeypatch):
    from asyncgrpo.rollout import tool_process

    monkeypatch.setattr(tool_process, "probe", lambda: None)
    assert runner(tool_process=True).process_refs == {"lookup": "agent_format:lookup"}
    assert runner().process_refs == {}
    monkeypatch.setattr(tool_process, "probe", lambda: "unshare: write failed /proc/self/uid_map: Operation not "
                                                       "permitted")
    with pytest.raises(ConfigError, match="tool_process.*uid_map.*set `tool_process: false`"):
        runner(tool_process=True)


def test_an_environment_factory_may_be_any_callable_and_its_reward_is_named_after_the_instances_class():
    from asyncgrpo.rollout.build import make_group_scorer
    from asyncgrpo.rollout.tools import load_environment_factory

    factory = load_environment_factory("agent_tools:make_counter")
    scoring = make_group_scorer(make_cfg(environment_factory="agent_tools:make_counter"), TOK, None)
    assert scoring.scorer.refs == ["agent_tools:Counter"]  # TRL: the class's name, not the factory's
    e = runner(tools=(), factory=factory, environment_factory="agent_tools:make_counter").start(ROW)
    assert isinstance(e.environment, agent_tools.Counter) and list(e.tools) == ["increment"]
    broken = runner(tools=(), factory=load_environment_factory("agent_tools:make_nothing"),
                    environment_factory="agent_tools:make_nothing")
    with pytest.raises(ConfigError, match="agent_tools:make_nothing returned a object, which has no reset"):
        broken.start(ROW)


class MovingClient:
    """`complete_until` for episodes whose first turn is interrupted after its first token by a new version: the
    version served moves from 1 to 2 at that point; every other request answers whole. Turn k is `turns[k]` + eos."""

    def __init__(self, turns: list[str], served: list[int]):
        self.turns, self.served, self.calls = turns, served, []
        self.sampling: list[tuple] = []  # per request: (temperature, top_p, seed)
        self.base_url = "http://moving"

    def complete_until(self, model, prompts, *, n, max_tokens, interrupted, temperature=1.0, top_p=1.0, seed=None,
                       extra=None):
        (prompt,) = prompts
        self.calls.append((model, list(prompt), max_tokens))
        self.sampling.append((temperature, top_p, seed))
        k = TOK.decode(prompt).count("<|im_start|>tool")
        whole = ids(self.turns[min(k, len(self.turns) - 1)]) + [EOS]
        if len(self.calls) == 1:  # the first turn: one token streamed, then version 2 goes live
            self.served[0] = 2
            assert interrupted()
            return [Completion(whole[:1], [-0.5], "", "", model)]
        if len(self.calls) == 2:  # its continuation: the rest of the turn, on version 2
            return [Completion(whole[1:], [-0.25] * (len(whole) - 1), "", "stop", model)]
        return [Completion(whole, [-0.125] * len(whole), "", "stop", model)]


def test_a_turn_interrupted_by_a_new_version_goes_on_from_its_tokens_and_each_token_keeps_its_version():
    from asyncgrpo.rollout.episodes import MidTurn
    from asyncgrpo.rollout.inflight import InflightStats

    served = [1]
    stats = InflightStats()
    r = runner(max_turns=2, max_completion_length=20, episode_version="latest", inflight_weight_updates=True)
    client = MovingClient(["45", "7"], served)
    e = r.start(ROW)

    def latest():
        from contextlib import nullcontext
        return nullcontext((served[0], f"a-v{served[0]}"))

    r.run(client, e, adapter="a-v1", version=1, seed=None, latest=latest,
          mid_turn=MidTurn(served=lambda: served[0], stats=stats))
    turn1 = ids("45") + [EOS]
    (m1, p1, _), (m2, p2, budget2), (m3, p3, _) = client.calls
    assert (m1, m2, m3) == ("a-v1", "a-v2", "a-v2")  # the turn moved onto version 2; the next turn started there
    assert p2 == p1 + turn1[:1] and budget2 == 20 - 1  # continued from its one token, with the turn's budget left
    assert p3[:len(p1) + len(turn1)] == p1 + turn1  # the next turn sees the whole first turn, never re-tokenized
    sampled = [(v, lp) for v, lp, m in zip(e.versions, e.logprobs, e.loss_mask) if m]
    assert sampled[:len(turn1)] == [(1, -0.5)] + [(2, -0.25)] * (len(turn1) - 1)
    assert all(v == 2 for v, m in zip(e.versions[len(turn1):], e.loss_mask[len(turn1):]))  # suffix and turn 2
    assert (stats.continuations, stats.completions_moved, stats.tokens_moved) == (1, 1, len(turn1) - 1)


def test_a_group_moved_mid_turn_samples_every_part_of_its_turns_with_the_configured_settings_and_seeds():
    from contextlib import nullcontext

    from asyncgrpo.rollout.episodes import MidTurn
    from asyncgrpo.rollout.inflight import InflightStats

    served, stats = [1], InflightStats()
    r = runner(max_turns=2, max_completion_length=20, episode_version="latest", inflight_weight_updates=True,
               temperature=0.7)
    client = MovingClient(["45", "7"], served)
    (e,) = r.run_group(client, ROW, n=1, adapter="a-v1", version=1, seed=7,
                       latest=lambda: nullcontext((served[0], f"a-v{served[0]}")),
                       mid_turn=MidTurn(served=lambda: served[0], stats=stats))
    assert [m for m, _, _ in client.calls] == ["a-v1", "a-v2", "a-v2"] and stats.continuations == 1  # moved
    # the configured temperature on every request; the turn's seed on its first request and the next turn's on that
    # one; the continuation unseeded (docs/rollout-internals.md says so)
    assert client.sampling == [(0.7, 1.0, 7), (0.7, 1.0, None), (0.7, 1.0, 7 + 7919)]
    assert e.turns == 2


def test_moving_turns_mid_generation_needs_episode_version_latest():
    with pytest.raises(ConfigError, match="inflight_weight_updates.*set `episode_version: latest`"):
        make_cfg(tools=["agent_format:lookup"], inflight_weight_updates=True)
