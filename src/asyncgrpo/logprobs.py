"""The trainer's logprobs of the sampled tokens under a (possibly sharded) causal LM, without full-vocabulary logits.

The LM head runs inside the model's own forward, because that is where every backend has its weight whole: DDP and
ZeRO-2 hold it whole; FSDP1/FSDP2 unshard the root unit (which holds the head) for its forward and again for its
backward; ZeRO-3 gathers each module's weights around that module's forward and re-gathers them for its backward.
For the duration of one call the head's `forward` is replaced by a function that keeps the hidden states at the
completion positions only and takes the log-softmax of the sampled tokens chunk by chunk
(`loss.chunked_token_logprobs`); the model then hands back those (B, T-1) logprobs as its `logits`. Its weight is
read inside the head's own forward and saved by reference for the backward, exactly as `nn.Linear` does, so every
backend's materialisation hooks apply unchanged.

A head this cannot model exactly falls back to the model's full logits (`token_logprobs`, the naive path), with a
warning: a head that is not a plain `nn.Linear` (e.g. LoRA on `lm_head`), or a model that rescales its logits after
the head (`logits_scaling`, `logit_scale`). Gemma's `final_logit_softcapping` is applied here instead of in the model.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from .loss import chunked_token_logprobs, token_logprobs

log = logging.getLogger(__name__)

# Config attributes with which a model's forward rescales the head's output: the chunked path would miss them.
_RESCALING_ATTRS = ("logits_scaling", "logit_scale", "output_multiplier_scale")


@dataclass
class ScoringHead:
    """The LM head the chunked path runs in place of the model's, and the configs its forward reads a softcap from."""

    module: torch.nn.Linear
    softcap: float | None
    configs: list = field(default_factory=list)


def find_scoring_head(model) -> ScoringHead | None:
    """`model`: the unwrapped model (a PEFT model or a transformers causal LM). None when the chunked path cannot
    reproduce its head exactly (the reason is logged)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    head = getattr(head, "_fsdp_wrapped_module", head)  # FSDP1, had the head been wrapped as its own unit
    configs = list({id(c): c for c in (base.config, base.config.get_text_config())}.values())
    if not isinstance(head, torch.nn.Linear):
        log.warning("logprobs: the LM head is a %s, not nn.Linear: full-vocabulary logits are used (more memory)",
                    type(head).__name__)
        return None
    scaled = [a for c in configs for a in _RESCALING_ATTRS if getattr(c, a, None) not in (None, 1, 1.0)]
    if scaled:
        log.warning("logprobs: the model rescales its logits (%s): full-vocabulary logits are used (more memory)",
                    scaled[0])
        return None
    softcaps = {getattr(c, "final_logit_softcapping", None) for c in configs} - {None}
    assert len(softcaps) <= 1, f"two different final_logit_softcapping values: {softcaps}"
    return ScoringHead(head, softcaps.pop() if softcaps else None, configs)


@contextlib.contextmanager
def _scoring(head: ScoringHead, forward):
    """Within: `head.module` runs `forward` (its hooks still run around it), and the model applies no softcap."""
    saved = [getattr(c, "final_logit_softcapping", None) for c in head.configs]
    own_forward = vars(head.module).get("forward")  # e.g. a hook some library set on the instance: put back after
    head.module.forward = forward  # an instance attribute: found before the class's forward
    for c in head.configs:
        if hasattr(c, "final_logit_softcapping"):
            c.final_logit_softcapping = None
    try:
        yield
    finally:
        if own_forward is None:
            del head.module.forward
        else:
            head.module.forward = own_forward
        for c, value in zip(head.configs, saved):
            if hasattr(c, "final_logit_softcapping"):
                c.final_logit_softcapping = value


def sequence_logprobs(model, head: ScoringHead | None, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      mask: torch.Tensor, temperature: float, chunk_size: int | None = None) -> torch.Tensor:
    """Logprob of every next token under `model` (the wrapped model the backend runs), fp32 (B, T-1): position t
    scores token t+1; zero where `mask` (B, T-1) is 0. `head`: from `find_scoring_head`, or None for the naive path
    (the model's full (B, T, V) logits)."""
    targets = input_ids[:, 1:]  # (B, T-1)
    keep = mask > 0  # (B, T-1)
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return torch.where(keep, token_logprobs(logits[:, :-1], targets, temperature), 0.0)

    def completion_logprobs(hidden: torch.Tensor) -> torch.Tensor:  # hidden: (B, T, H), the final hidden states
        lp = chunked_token_logprobs(hidden[:, :-1][keep], head.module.weight, targets[keep],  # (N,), N = keep.sum()
                                    temperature=temperature, bias=head.module.bias, softcap=head.softcap,
                                    chunk_size=chunk_size)
        return torch.zeros(keep.shape, dtype=lp.dtype, device=lp.device).masked_scatter(keep, lp)  # (B, T-1)

    with _scoring(head, completion_logprobs):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    assert out.logits.shape == keep.shape, f"the model post-processed the head's output: {tuple(out.logits.shape)}"
    return out.logits
