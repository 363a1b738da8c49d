"""The check both episode paths are held to: the trainer's own fp32 logprob of every sampled token of a group, against
the behaviour logprob the server reported for it."""

from __future__ import annotations


def max_sampled_gap(model_dir, group, temperature: float, pad_id: int) -> tuple[float, int, object, dict]:
    """(largest |trainer - server| logprob over the group's sampled tokens, how many were compared, the fp32 model,
    the collated batch)."""
    import torch
    from transformers import AutoModelForCausalLM  # heavy: the trainer's model

    from asyncgrpo.trainer.batching import collate
    from asyncgrpo.trainer.logprobs import find_scoring_head, sequence_logprobs

    batch = collate([group], pad_id=pad_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        trainer = sequence_logprobs(model, find_scoring_head(model), batch["input_ids"], batch["attention_mask"],
                                    batch["mask"], temperature)
    sampled = batch["mask"] > 0
    return (trainer[sampled] - batch["behaviour"][sampled]).abs().max().item(), int(sampled.sum()), model, batch
