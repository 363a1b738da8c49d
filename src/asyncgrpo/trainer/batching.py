"""A batch of groups into what the model sees: shares per rank and micro-batches by tokens, padded tensors on the
device, and scoring completions under the trainer's policy."""

from __future__ import annotations

import torch

from asyncgrpo.contracts import Group


def split_by_tokens(groups: list[Group], parts: int) -> list[list[Group]]:
    """Deal `groups` to `parts` ranks: the same number each (every rank runs the same micro-steps and collectives)
    and about the same number of tokens (prompt + completion, what a forward costs). Largest groups first, each to
    the least-loaded rank with room; each share keeps the batch's order."""
    if len(groups) % parts:
        raise ValueError(f"{len(groups)} groups do not split evenly over {parts} ranks")
    room = len(groups) // parts
    cost = [sum(len(g.prompt_ids) + len(c) for c in g.completion_ids) for g in groups]
    load, members = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(groups)), key=lambda i: -cost[i]):
        rank = min((r for r in range(parts) if len(members[r]) < room), key=lambda r: load[r])
        load[rank] += cost[i]
        members[rank].append(i)
    return [[groups[i] for i in sorted(m)] for m in members]


def pack_by_tokens(lengths: list[int], budget: int, count: int | None = None) -> list[list[int]]:
    """Indices of sequences (of `lengths` tokens each) packed into micro-batches: longest first, each micro-batch a
    run of consecutive lengths whose padded size (sequences x its longest) is at most `budget`; a sequence longer than
    the budget goes alone. `count`: then the micro-batch of largest padded size is halved until there are exactly
    `count` (every rank must run the same number of forwards; halving keeps each within the budget)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packed: list[list[int]] = []
    for i in order:
        if packed and (len(packed[-1]) + 1) * lengths[packed[-1][0]] <= budget:
            packed[-1].append(i)
        else:
            packed.append([i])
    assert count is None or len(packed) <= count <= len(lengths), (len(packed), count, len(lengths))
    while count is not None and len(packed) < count:
        j = max((k for k in range(len(packed)) if len(packed[k]) > 1), key=lambda k: len(packed[k]) * lengths[packed[k][0]])
        half = len(packed[j]) // 2
        packed[j:j + 1] = [packed[j][:half], packed[j][half:]]
    return packed


def collate(groups: list[Group], pad_id: int) -> dict[str, torch.Tensor]:
    """Groups -> padded CPU tensors, one row per completion. Position t of `behaviour`/`mask` scores token t+1 of
    the sequence; a completion the group marks `masked` keeps its tokens but none in `mask`, and an episode's tool and
    template tokens (its `loss_mask` 0) are context, not in `mask`.
    input_ids, attention_mask: (B, T); behaviour, mask: (B, T-1); advantages: (B,)."""
    seqs, behaviour, advantages, spans, loss_masks = [], [], [], [], []
    for g in groups:
        masked = g.masked or [False] * len(g.completion_ids)
        for j, (ids, lps, adv, out) in enumerate(zip(g.completion_ids, g.behaviour_logprobs, g.advantages, masked)):
            seqs.append(g.prompt_ids + ids)
            behaviour.append(lps)
            advantages.append(adv)
            spans.append((len(g.prompt_ids) - 1, 0 if out else len(ids)))  # a masked completion: no loss tokens
            loss_masks.append(g.loss_mask[j] if g.loss_mask else None)  # an episode: tool/template tokens are 0
    length = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), length), dtype=torch.long)
    old = torch.zeros((len(seqs), length - 1))
    mask = torch.zeros((len(seqs), length - 1))
    for i, (s, lps, (start, n), keep) in enumerate(zip(seqs, behaviour, spans, loss_masks)):
        input_ids[i, :len(s)] = torch.tensor(s)
        attention[i, :len(s)] = 1
        old[i, start:start + n] = torch.tensor(lps[:n])
        mask[i, start:start + n] = 1.0 if keep is None else torch.tensor(keep[:n], dtype=mask.dtype)
    return {"input_ids": input_ids, "attention_mask": attention, "behaviour": old, "mask": mask,
            "advantages": torch.tensor(advantages, dtype=torch.float32)}


def with_positions(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collated (host) batch plus `positions`, (N,): the flat indices of its `mask > 0` in (B, T-1), for
    `sequence_logprobs`. Found here, on the host: on a GPU the host would wait for their count at every forward."""
    return {**batch, "positions": (batch["mask"].flatten() > 0).nonzero().squeeze(1)}


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """A collated batch on the training device, in one pass: the logits it meets are there, and the DeepSpeed
    engine moves no inputs itself. On CUDA the host tensors are pinned first, so the copies run asynchronously."""
    device = torch.device(device)
    if device.type == "cpu":
        return dict(batch)
    pin = device.type == "cuda"
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=pin) for k, v in batch.items()}


@torch.no_grad()
def score_completions(logprobs_of, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                      device) -> list[list[float]]:
    """The logprob of every completion token under `logprobs_of` (a collated batch on `device` -> (B, T-1) logprobs,
    zero off the mask), one list per (prompt, completion)."""
    groups = [Group(prompt="", prompt_ids=p, completion_ids=[c], behaviour_logprobs=[[0.0] * len(c)], rewards=[0.0],
                    reward_parts={}, advantages=[0.0], version=0, adapter="") for p, c in zip(prompt_ids, completion_ids)]
    batch = to_device(collate(groups, pad_id), device)
    logprobs = logprobs_of(batch)
    return [logprobs[i][batch["mask"][i] > 0].tolist() for i in range(len(groups))]
