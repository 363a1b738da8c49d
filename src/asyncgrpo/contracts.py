"""The data that crosses between the rollout side and the trainer: a scored `Group` and its advantages, and the
`ServedProbe` a published version carries so that the rollout side can check the servers serve it.

A group is built by the producer (in rank 0, a child, or another host), sent over the rollout link (transport/wire.py)
and trained on by every rank, so it depends on nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field


@dataclass
class Group:
    """One prompt and its `num_generations` completions, scored, with the policy version that made them."""

    prompt: str
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]  # the server's logprob of each sampled token
    rewards: list[float]
    reward_parts: dict[str, list[float | None]]  # None: the function did not apply to that completion
    advantages: list[float]
    version: int  # policy version that was being served when the request was sent
    adapter: str  # adapter name that served the request
    finish_reasons: list[str] = field(default_factory=list)
    index: int = -1  # the prompt's position in the producer's data stream (orders a batch; checkpoints resume after it)
    masked: list[bool] = field(default_factory=list)  # completions left out of the loss (mask_truncated_completions)
    # Episodes (multi-turn, tools: docs/agents.md); empty for plain completions, whose every token was sampled.
    loss_mask: list[list[int]] = field(default_factory=list)  # per token: 1 sampled, 0 tool/template (context only)
    versions: list[list[int]] = field(default_factory=list)  # per token: the policy version that sampled it

    @property
    def n_sampled_tokens(self) -> int:
        """Tokens the model sampled (what the loss trains on): all completion tokens unless a loss mask says less."""
        if not self.loss_mask:
            return self.n_completion_tokens
        return sum(sum(m) for m in self.loss_mask)

    @property
    def n_completion_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    def completion(self, j: int) -> Group:
        """This group with its j-th completion only (micro-batches packed by length split groups)."""
        return dataclasses.replace(self, completion_ids=[self.completion_ids[j]],
                                   behaviour_logprobs=[self.behaviour_logprobs[j]], rewards=[self.rewards[j]],
                                   advantages=[self.advantages[j]], finish_reasons=self.finish_reasons[j:j + 1],
                                   reward_parts={k: [v[j]] for k, v in self.reward_parts.items()},
                                   masked=self.masked[j:j + 1], loss_mask=self.loss_mask[j:j + 1],
                                   versions=self.versions[j:j + 1])


@dataclass
class ServedProbe:
    """A short fixed token sequence and the trainer's logprobs of its last tokens under one version's weights, sent
    with that version: the rollout side asks each server for the same logprobs under the version's adapter name and
    compares (rollout/served_check.py). Raw logprobs (temperature 1, no sampling processor): what vLLM's
    `prompt_logprobs` reports."""

    token_ids: list[int]  # the whole sequence both sides score
    start: int  # the first scored position: logprobs[i] is token_ids[start + i]'s, given the tokens before it
    logprobs: list[float]  # the trainer's, under the version this probe is sent with
    base_logprobs: list[float] | None = None  # the same tokens with the adapter off: set on a probe's first sending
    # The dtype the trainer's base was built in: a DeepSpeed json with bf16 on gives a bf16 base under torch_dtype
    # float32 (trainer/policy.py base_dtype), and the bound of the comparison follows what was really run.
    dtype: str = "float32"


def finish_reason_from_tokens(finish_reason: str, token_ids: list[int], end_token_ids: frozenset[int]) -> str:
    """The server's finish reason, read against the tokens: `length` becomes `stop` when the last sampled token is an
    end token. vLLM checks the length before the end token, so an EOS sampled as the `max_tokens`-th token is
    reported as `length`, although the completion is whole; only a completion cut off by the limit is truncated."""
    if finish_reason == "length" and token_ids and token_ids[-1] in end_token_ids:
        return "stop"
    return finish_reason


def scored_advantages(rewards: list[float], scale_rewards: str) -> list[float]:
    """A group's advantages when it is scored (the producer's and the episode runner's one rule): centred and divided
    by the group's own std for `scale_rewards: group`, only centred for `none` and for `batch`, whose std is the whole
    batch's and is applied when the batch is taken (`scale_by_batch_std`)."""
    return centred_advantages(rewards, "none" if scale_rewards == "batch" else scale_rewards)


def centred_advantages(rewards: list[float], scale: str, eps: float = 1e-4) -> list[float]:
    """One group's advantages as TRL computes them (reward - group mean, divided by the group's unbiased std + eps
    when `scale` is "group"), in plain Python: the producer runs this once per group, where a torch call cost more
    than the rest of the group's bookkeeping."""
    n = len(rewards)
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if scale == "none":
        return centred
    assert scale == "group", f"a group is scaled by its own std or not at all, not {scale!r}"
    std = math.sqrt(sum(c * c for c in centred) / (n - 1)) if n > 1 else math.nan  # torch: nan for one sample
    return [c / (std + eps) for c in centred]


def scale_by_batch_std(groups: list[Group], eps: float = 1e-4) -> None:
    """`scale_rewards: batch`: divide the groups' centred advantages by the std of every reward in the batch (torch's
    unbiased std, as TRL). In place; the producer centred each group when it was scored."""
    rewards = [r for g in groups for r in g.rewards]
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    for g in groups:
        g.advantages = [a / (std + eps) for a in g.advantages]
