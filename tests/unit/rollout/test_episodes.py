"""Episodes on scripted server answers: each turn is sent as the running ids (prompt + sampled + tool suffix, never
re-tokenized), the loss mask is 1 exactly on sampled ids, and the stop rules (no call, max_turns, token budgets, an
environment that is done) hold. The format is tests/agent_format.py's; the integration test runs it on vLLM."""

from __future__ import annotations

import agent_tools
import pytest
from agent_format import agent_tokenizer, lookup
from fakes import FakeVLLM
from fakes import cfg as make_cfg

from asyncgrpo.contracts import Group
from asyncgrpo.data import PromptRow
from asyncgrpo.errors import ConfigError
from asyncgrpo.inference.client import Completion
from asyncgrpo.rollout.episodes import ChatFormat, EpisodeRunner, TurnAborted, common_prefix, episode_group
from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.rollout.scheduler import RolloutSchedule

TOK = agent_tokenizer()
EOS = 0


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ScriptedClient:
    """Answers turn k of every episode with `turns[k]` (text + eos unless it ends with `...`), logprob -0.25 each."""

    def __init__(self, turns: list[str], finish: dict[int, str] | None = None):
        self.turns, self.finish, self.prompts, self.max_tokens = turns, finish or {}, [], []
        self.base_url = "http://scripted"

    def complete(self, model, prompt_ids, *, n, max_tokens, temperature, top_p, seed):
        k = TOK.decode(prompt_ids).count("<|im_start|>tool")  # the turn's index: tool messages before it
        self.prompts.append(list(prompt_ids))
        self.max_tokens.append(max_tokens)
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
    r.run(ScriptedClient(["45"]), e, adapter="a", version=0, seed=None)
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
    with pytest.raises(TurnAborted):
        r.run_group(ScriptedClient(["45"], finish={1: "abort"}), ROW, n=2, adapter="a", version=0, seed=None)


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


def test_a_tokenizer_without_a_response_template_is_refused_for_tools():
    from asyncgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="response_template"):
        ChatFormat(TOK, None, stop_ids={EOS})


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


def schedule_at(version: int) -> RolloutSchedule:
    schedule = RolloutSchedule(make_cfg(), groups_per_step=1, max_inflight=4)
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
    schedule = RolloutSchedule(make_cfg(), groups_per_step=1, max_inflight=4)

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
