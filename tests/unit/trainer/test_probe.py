"""The served check's probe (trainer/probe.py): which tokens. Its logprobs are compared with a real server's in
tests/integration/test_served_check.py (fp32: within 1e-6)."""

from asyncgrpo.contracts import Group
from asyncgrpo.trainer.probe import PROBE_CONTEXT_TOKENS, PROBE_SCORED_TOKENS, probe_sequence


def _group(prompt, completion):
    return Group(prompt="", prompt_ids=prompt, completion_ids=[completion, [99]], behaviour_logprobs=[[0.0]] * 2,
                 rewards=[0.0, 1.0], reward_parts={}, advantages=[0.0, 0.0], version=0, adapter="a")


def test_the_probe_is_the_end_of_the_first_prompt_and_the_start_of_its_first_completion():
    prompt, completion = list(range(100)), list(range(200, 250))
    ids, start = probe_sequence([_group(prompt, completion), _group([1], [2])], pad_id=0)
    assert ids[:start] == prompt[-PROBE_CONTEXT_TOKENS:] and ids[start:] == completion[:PROBE_SCORED_TOKENS]
    assert probe_sequence([_group([5, 6], [7])], pad_id=0) == ([5, 6, 7], 2)  # short ones whole


def test_a_rank_with_nothing_to_train_on_still_has_a_sequence_to_forward():
    assert probe_sequence([], pad_id=3) == ([3, 3], 1)
