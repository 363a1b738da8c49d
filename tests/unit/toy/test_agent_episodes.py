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
    turn, `@lookup(key=..)` for a key (letters reversed when `swap`), else (a value, an error) its first two
    characters as the answer."""

    training = False

    def __init__(self, tokenizer, swap: bool = False):
        self.tokenizer, self.swap = tokenizer, swap

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tokenizer.decode([i for i, m in zip(ids, mask) if m])
            last = re.search(r"(?:find |tool\n)([^<]+)<\|im_end\|><\|im_start\|>assistant\n$", text).group(1)
            if last.isdigit() or last.startswith("error"):
                turn = last[:2]
            else:
                turn = f"@lookup(key={last[::-1] if self.swap else last})"
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


def test_unknown_keys_come_back_as_counted_tool_errors(tokenizer):
    table = make_table(0)[0]
    rows = [r for r in make_agent_split(0)[1] if r["key"][::-1] not in table][:5]
    assert rows  # some reversed keys are not in the table
    result = heldout_success(ScriptedPolicy(tokenizer, swap=True), tokenizer, rows)
    assert (result.success, result.tool_errors, result.tool_calls_mean, result.turns_mean) == (0.0, len(rows), 1, 2)
    episode = run_episodes(ScriptedPolicy(tokenizer, swap=True), tokenizer, rows[:1])[0]
    assert episode["messages"][1] == {"role": "tool", "name": "lookup",
                                      "content": f"error: unknown key {rows[0]['key'][::-1]}"}


def test_max_turns_ends_an_episode_that_is_still_calling(tokenizer):
    rows = [r for r in make_agent_split(0)[1] if r["hops"] >= 2][:10]
    result = heldout_success(ScriptedPolicy(tokenizer), tokenizer, rows, max_turns=2)
    assert (result.success, result.tool_calls_mean, result.turns_mean, result.tool_errors) == (0.0, 2.0, 2.0, 0)


def test_warmup_batches_are_deterministic_and_fit_the_model(tokenizer):
    first = warmup_batch(tokenizer, random.Random(1), 16, 0.25, 0.15)
    again = warmup_batch(tokenizer, random.Random(1), 16, 0.25, 0.15)
    other = warmup_batch(tokenizer, random.Random(2), 16, 0.25, 0.15)
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
