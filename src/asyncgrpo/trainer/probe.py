"""The trainer's half of the live served == trained check (`served_check_every`): a fixed token sequence taken from
the first batch trained on, and its raw logprobs under the weights being published, sent with the version
(contracts.ServedProbe) for the rollout side to compare with each server's (rollout/served_check.py).

Every rank scores a probe of its own at the same syncs, because under FSDP and ZeRO-3 a forward gathers parameters
from every rank (and DDP may broadcast buffers in one); only rank 0's result is sent. docs/publish-internals.md.
"""

from __future__ import annotations

import contextlib

import torch

from asyncgrpo.contracts import Group, ServedProbe
from asyncgrpo.trainer.batching import score_completions
from asyncgrpo.trainer.logprobs import sequence_logprobs

PROBE_CONTEXT_TOKENS = 64  # the prompt's last tokens kept as context (the scored tokens see the same on both sides)
PROBE_SCORED_TOKENS = 32  # completion tokens scored: a forward of <= 96 tokens per check, on every rank


def probe_sequence(share: list[Group], pad_id: int) -> tuple[list[int], int]:
    """(token ids, first scored position): the end of this rank's first prompt and the start of its first sampled
    completion, which the policy is trained on, so that one optimizer step moves their logprobs visibly."""
    if not share or not share[0].completion_ids[0]:
        return [pad_id, pad_id], 1  # a rank with nothing to train on still joins the forward
    group = share[0]
    context = list(group.prompt_ids[-PROBE_CONTEXT_TOKENS:])
    return context + list(group.completion_ids[0][:PROBE_SCORED_TOKENS]), len(context)


def probe_logprobs(acc, model, head, ids: list[int], start: int, pad_id: int, *, base: bool = False) -> list[float]:
    """Collective (under FSDP and ZeRO-3: a forward): the raw (temperature 1) logprobs of ids[start:] under the
    model's weights now, in eval mode (no LoRA dropout), no gradient; `base`: with the adapter off."""
    was_training = model.training
    model.eval()
    adapter_off = acc.unwrap_model(model).disable_adapter() if base else contextlib.nullcontext()
    try:
        with torch.no_grad(), adapter_off:
            return score_completions(
                lambda b: sequence_logprobs(model, head, b["input_ids"], b["attention_mask"], b["mask"], 1.0,
                                            positions=b.get("positions")),
                [ids[:start]], [ids[start:]], pad_id, acc.device)[0]
    finally:
        model.train(was_training)


def make_probe(acc, model, head, ids: list[int], start: int, pad_id: int, *, with_base: bool,
               dtype: str = "float32") -> ServedProbe:
    """Collective: the probe for the weights now; `with_base` (a probe's first sending): the base's logprobs too,
    so that a server serving the base can be named as such."""
    base = probe_logprobs(acc, model, head, ids, start, pad_id, base=True) if with_base else None
    return ServedProbe(token_ids=list(ids), start=start,
                       logprobs=probe_logprobs(acc, model, head, ids, start, pad_id), base_logprobs=base, dtype=dtype)
