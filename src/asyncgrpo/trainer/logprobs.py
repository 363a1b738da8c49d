"""The trainer's logprobs of the sampled tokens under a (possibly sharded) causal LM, without full-vocabulary logits.

`sequence_logprobs` runs the model with its LM head swapped, for one call, for a chunked log-softmax at the
completion positions only (`chunked_token_logprobs`, its own autograd function, which can also give each position's
entropy); a head it cannot reproduce exactly falls back to the full logits (`token_logprobs`), with a warning.
docs/trainer-internals.md says why the head runs inside the model's forward on every backend and how the chunks keep
memory flat.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch


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
                      mask: torch.Tensor, temperature: float, chunk_size: int | None = None, *,
                      with_entropy: bool = False, positions: torch.Tensor | None = None):
    """Logprob of every next token under `model` (the wrapped model the backend runs), fp32 (B, T-1): position t
    scores token t+1; zero where `mask` (B, T-1) is 0. `head`: from `find_scoring_head`, or None for the naive path
    (the model's full (B, T, V) logits). `with_entropy`: also the entropy (B, T-1) of the distribution the token was
    sampled from (softmax of logits / temperature), detached, zero where `mask` is 0: returns (logprobs, entropy).
    `positions`: the flat indices of `mask > 0` in (B, T-1), as `collate` makes them on the host; without them they
    are found on the device, and on a GPU the host then waits for everything queued before to learn their count."""
    targets = input_ids[:, 1:]  # (B, T-1)
    keep = mask > 0  # (B, T-1)
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        lp = torch.where(keep, token_logprobs(logits[:, :-1], targets, temperature), 0.0)
        if not with_entropy:
            return lp
        return lp, torch.where(keep, token_entropy(logits[:, :-1], temperature), 0.0)
    entropy = {}
    flat = positions.to(keep.device) if positions is not None else keep.flatten().nonzero().squeeze(1)  # (N,)
    at = (flat // keep.shape[1], flat % keep.shape[1])  # (row, column) of each completion token, row-major

    def completion_logprobs(hidden: torch.Tensor) -> torch.Tensor:  # hidden: (B, T, H), the final hidden states
        scored = chunked_token_logprobs(hidden[:, :-1][at], head.module.weight, targets[at],  # (N,)
                                        temperature=temperature, bias=head.module.bias, softcap=head.softcap,
                                        chunk_size=chunk_size, entropy=with_entropy)
        lp, ent = scored if with_entropy else (scored, None)
        if ent is not None:
            entropy["value"] = torch.zeros(keep.shape, dtype=ent.dtype, device=ent.device).index_put(at, ent)
        return torch.zeros(keep.shape, dtype=lp.dtype, device=lp.device).index_put(at, lp)  # (B, T-1)

    with _scoring(head, completion_logprobs):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    assert out.logits.shape == keep.shape, f"the model post-processed the head's output: {tuple(out.logits.shape)}"
    return (out.logits, entropy["value"]) if with_entropy else out.logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each target token. logits: (B, T, V), targets: (B, T) -> (B, T), in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at each position, fp32, no gradient. logits: (B, T, V) -> (B, T)."""
    with torch.no_grad():
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return -(logp.exp() * logp).sum(-1)


# Positions per chunk are sized so that one chunk's fp32 logits take about this much memory (the backward holds
# about three such buffers at a time): 2**26 elements = 256 MiB, ~440 positions at a 152k vocabulary.
CHUNK_LOGIT_ELEMENTS = 2**26


def chunk_positions(vocab_size: int, budget_elements: int = CHUNK_LOGIT_ELEMENTS) -> int:
    """Positions per chunk so that a chunk's (positions x vocab) fp32 logits hold about `budget_elements`."""
    return max(1, budget_elements // vocab_size)


def _chunk_logits(hidden, weight, bias, softcap, temperature):
    """(n, H) hidden -> (n, V) fp32 logits as the model computes them, softcapped, divided by the temperature; also
    1 - tanh^2 of the softcap (its derivative), or None. Only called without autograd: scaled in place."""
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()  # new: ours to overwrite
    slope = None
    if softcap is not None:
        logits.div_(softcap).tanh_()
        slope = 1.0 - logits.square()
        logits.mul_(softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits, slope


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Forward: per chunk of positions, logits -> log-softmax at the target (and, asked, the entropy, a second
    output without gradient); only the (N,) log-sum-exps are kept. Backward: per chunk, the logits are recomputed and
    d logp / d logits = onehot - softmax is applied at once, so neither pass holds more than one (chunk x V) fp32
    buffer (two with a softcap or with the entropy), all updated in place."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, chunk, with_entropy):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else out.new_zeros(0)
        # Autocast off (forward and backward): the backward recomputes these logits and must get the very same ones,
        # and a backward does not run under the forward's autocast.
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                logits, _ = _chunk_logits(hidden[s:s + chunk], weight, bias, softcap, temperature)  # (n, V)
                target = logits.gather(-1, targets[s:s + chunk].unsqueeze(-1)).squeeze(-1)  # (n,)
                top = logits.amax(dim=-1)  # (n,): log-sum-exp in place, without a second (n, V) buffer
                if with_entropy:  # z = logits - top, e = exp(z): H = log sum e - sum(e z) / sum e
                    z = logits.sub_(top.unsqueeze(-1))
                    e = z.exp()  # the one extra (n, V) buffer
                    total = e.sum(-1)
                    entropy[s:s + chunk] = total.log() - e.mul_(z).sum(-1) / total
                    lse[s:s + chunk] = top + total.log()
                    del e, z
                else:
                    lse[s:s + chunk] = top + logits.sub_(top.unsqueeze(-1)).exp_().sum(-1).log_()
                out[s:s + chunk] = target - lse[s:s + chunk]
                del logits  # before the next chunk's: two would be alive at once
        # The weight is saved by reference, as nn.Linear's backward does: FSDP / ZeRO-3 re-materialise it for backward.
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.softcap, ctx.chunk = temperature, softcap, chunk
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _ChunkedTokenLogprobs._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            logits, slope = _chunk_logits(h, weight, bias, ctx.softcap, ctx.temperature)  # (n, V)
            # d logp / d logits = onehot(target) - softmax, scaled by the incoming gradient; in place on `logits`.
            grad = logits.sub_(lse[s:s + ctx.chunk].unsqueeze(-1)).exp_().neg_()
            grad.scatter_add_(-1, targets[s:s + ctx.chunk].unsqueeze(-1), torch.ones_like(grad[:, :1]))
            grad.mul_(grad_out[s:s + ctx.chunk].unsqueeze(-1))
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if slope is not None:  # d(cap * tanh(z / cap)) / dz = 1 - tanh^2
                grad.mul_(slope)
            if need_h:
                grad_h[s:s + ctx.chunk] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(grad.t(), h.float())
            if need_b:
                grad_b.add_(grad.sum(0))
            del logits, grad, slope  # before the next chunk's
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None, None)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           temperature: float = 1.0, bias: torch.Tensor | None = None, softcap: float | None = None,
                           chunk_size: int | None = None, entropy: bool = False):
    """What `token_logprobs(lm_head(hidden), targets, temperature)` gives, without ever holding more than one chunk of
    logits: hidden (N, H) final hidden states at the scored positions only, weight (V, H) (and bias (V,)) the LM head,
    targets (N,) -> (N,) fp32 logprobs. `softcap`: the model's final logit soft-capping (Gemma), applied before the
    temperature as the model's own forward does. Gradients flow to `hidden` (and to `weight`/`bias` if they need
    them). `chunk_size`: positions per chunk, default from `chunk_positions`. `entropy`: return (logprobs, entropy),
    the (N,) entropy of each position's distribution (as `token_entropy`), computed in the same chunks, detached."""
    chunk = chunk_size or chunk_positions(weight.shape[0])
    lp, ent = _ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), softcap, chunk, entropy)
    return (lp, ent) if entropy else lp
