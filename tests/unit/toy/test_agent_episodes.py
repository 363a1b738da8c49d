"""`heldout_success`'s episode loop, driven by a scripted policy in place of the model (the real tokenizer, chat and
response templates and `LookupEnv`): calls run, results come back as tool turns, each turn continues on the ids
the policy wrote, and the figures count what happened. Also: warm-up batches are deterministic by seed."""

import random
import re

import pytest
import torch

from asyncgrpo.toy.agent_chat import build_agent_tokenizer, render_ids
from asyncgrpo.toy.agent_episodes import heldout_success, run_episodes, warmup_batch
from asyncgrpo.toy.agent_task import LookupEnv, make_agent_split, make_table
from asyncgrpo.toy.agent_world import AgentWorldSpec


@pytest.fixture(scope="module")
def tokenizer():
    return build_agent_tokenizer()


@pytest.fixture(autouse=True)
def no_latency():
    LookupEnv.latency_s = 0.0
    yield
    LookupEnv.latency_s = None


class ScriptedPolicy:
    """Stands in for the model's `generate`: reads the last user/tool content of each prompt and writes the next
    turn: `@lookup()` after the question or a key (`-> ab`), the value after `= 47`; `overshoot` calls once more
    after the value (then answers the error's first two characters), `call` is the call it writes."""

    training = False

    def __init__(self, tokenizer, overshoot: bool = False, call: str = "@lookup()"):
        self.tokenizer, self.overshoot, self.call = tokenizer, overshoot, call

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tokenizer.decode([i for i, m in zip(ids, mask) if m])
            last = re.search(r"(?:find |tool\n)([^<]+)<\|im_end\|><\|im_start\|>assistant\n$", text).group(1)
            if last.startswith("= ") and not self.overshoot or last.startswith("{"):
                turn = last.removeprefix("= ")[:2]
            else:
                turn = self.call
            new = self.tokenizer.encode(turn + "<|im_end|>", add_special_tokens=False)
            rows.append(ids + new + [self.tokenizer.pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


def test_a_policy_that_follows_the_chain_succeeds_in_hops_calls(tokenizer):
    rows = make_agent_split(0)[1][:30]
    result = heldout_success(ScriptedPolicy(tokenizer), tokenizer, rows)
    hops = [r["hops"] for r in rows]
    assert result.success == 1.0 and (result.tool_errors, result.truncated) == (0, 0)
    assert result.tool_calls_mean == pytest.approx(sum(hops) / len(hops))
    assert result.turns_mean == pytest.approx(sum(hops) / len(hops) + 1)


def test_each_turn_continues_on_the_written_ids_and_tool_turns(tokenizer):
    rows = make_agent_split(0)[1][:10]
    tools = [LookupEnv().lookup]
    for row, episode in zip(rows, run_episodes(ScriptedPolicy(tokenizer), tokenizer, rows)):
        assert episode["ids"] == render_ids(tokenizer, [*row["prompt"], *episode["messages"]], tools)
        assert [m["role"] for m in episode["messages"]] == ["assistant", "tool"] * row["hops"] + ["assistant"]
        assert episode["messages"][-1] == {"role": "assistant", "content": row["answer"]}


def test_failed_calls_come_back_as_counted_tool_errors_worded_as_the_episode_runners(tokenizer):
    from asyncgrpo.rollout.tools import call_tool

    rows = [r for r in make_agent_split(0)[1] if r["hops"] == 1][:5]
    result = heldout_success(ScriptedPolicy(tokenizer, overshoot=True), tokenizer, rows)
    assert (result.success, result.tool_errors, result.tool_calls_mean, result.turns_mean) == (0.0, 5, 2, 3)
    env = LookupEnv()
    env.reset(**rows[0])
    env.lookup()
    runner = call_tool({"lookup": env.lookup}, "lookup", {}, 5.0)  # the episode runner, after the value
    episode = run_episodes(ScriptedPolicy(tokenizer, overshoot=True), tokenizer, rows[:1])[0]
    assert runner.error and episode["messages"][3] == {"role": "tool", "name": "lookup", "content": runner.content}
    ended = f"ChainEndedError: the chain ended at {rows[0]['answer']}; answer that value"
    assert runner.content == f'{{"error": "{ended}"}}'
    for call, (name, arguments) in (("@search()", ("search", {})), ("@lookup(key=ab)", ("lookup", {"key": "ab"}))):
        env.reset(**rows[0])
        episode = run_episodes(ScriptedPolicy(tokenizer, call=call), tokenizer, rows[:1])[0]
        expected = call_tool({"lookup": env.lookup}, name, arguments, 5.0).content
        assert episode["messages"][1]["content"] == expected and expected.startswith('{"error": ')


def test_max_turns_ends_an_episode_that_is_still_calling(tokenizer):
    rows = [r for r in make_agent_split(0)[1] if r["hops"] >= 2][:10]
    result = heldout_success(ScriptedPolicy(tokenizer), tokenizer, rows, max_turns=2)
    assert (result.success, result.tool_calls_mean, result.turns_mean, result.tool_errors) == (0.0, 2.0, 2.0, 0)


def test_warmup_batches_are_deterministic_and_fit_the_model(tokenizer):
    first = warmup_batch(tokenizer, random.Random(1), 16, 0.3, 0.2)
    again = warmup_batch(tokenizer, random.Random(1), 16, 0.3, 0.2)
    other = warmup_batch(tokenizer, random.Random(2), 16, 0.3, 0.2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0][:, :40], other[0][:, :40]) or first[0].shape != other[0].shape
    inputs, labels = first
    assert inputs.shape == labels.shape and inputs.shape[1] <= 256
    assert ((labels == -100) | (labels == inputs)).all()  # a label is the token itself or ignored


def test_spec_key_changes_with_any_field_and_rejects_useless_mistake_rates():
    assert AgentWorldSpec().key() == AgentWorldSpec().key() != AgentWorldSpec(seed=1).key()
    assert AgentWorldSpec(stop_early_prob=0.1).key() != AgentWorldSpec().key()
    with pytest.raises(Exception, match="stop_early_prob"):
        AgentWorldSpec(stop_early_prob=0.6)
    with pytest.raises(Exception, match="guess_prob"):
        AgentWorldSpec(guess_prob=-0.1)
    with pytest.raises(Exception, match="eval_every"):  # the shared warm-up check runs for the agent world too
        AgentWorldSpec(warmup_steps=50)  # its eval_every is 100
    assert AgentWorldSpec(batch_size=32).key() != AgentWorldSpec().key()  # an inherited field is in the key
