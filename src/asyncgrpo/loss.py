"""GRPO loss: pure functions over tensors, no model, no distributed state.

Departures from the GRPO paper (as in DAPO / TRL's default "token-level" aggregation):
- the importance ratio is taken against the *behaviour* logprobs the inference server reported for the
  sampled tokens, not against a recomputed "old" policy: with asynchronous rollouts the server's policy is
  the one that actually produced the tokens;
- the surrogate is averaged over all completion tokens of the global batch (token level), not per sequence;
- the clip range may be asymmetric (`epsilon`, `epsilon_high`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages. rewards: (G, N) for G groups of N completions -> (G, N)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each target token. logits: (B, T, V), targets: (B, T) -> (B, T), in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


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
    """Forward: per chunk of positions, logits -> log-softmax at the target; only the (N,) log-sum-exps are kept.
    Backward: per chunk, the logits are recomputed and d logp / d logits = onehot - softmax is applied at once, so
    neither pass holds more than one (chunk x V) fp32 buffer (two with a softcap), all updated in place."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, chunk):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        # Autocast off (forward and backward): the backward recomputes these logits and must get the very same ones,
        # and a backward does not run under the forward's autocast.
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                logits, _ = _chunk_logits(hidden[s:s + chunk], weight, bias, softcap, temperature)  # (n, V)
                target = logits.gather(-1, targets[s:s + chunk].unsqueeze(-1)).squeeze(-1)  # (n,)
                top = logits.amax(dim=-1)  # (n,): log-sum-exp in place, without a second (n, V) buffer
                lse[s:s + chunk] = top + logits.sub_(top.unsqueeze(-1)).exp_().sum(-1).log_()
                out[s:s + chunk] = target - lse[s:s + chunk]
                del logits  # before the next chunk's: two would be alive at once
        # The weight is saved by reference, as nn.Linear's backward does: FSDP / ZeRO-3 re-materialise it for backward.
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.softcap, ctx.chunk = temperature, softcap, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
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
                None, None, None, None)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           temperature: float = 1.0, bias: torch.Tensor | None = None, softcap: float | None = None,
                           chunk_size: int | None = None) -> torch.Tensor:
    """What `token_logprobs(lm_head(hidden), targets, temperature)` gives, without ever holding more than one chunk of
    logits: hidden (N, H) final hidden states at the scored positions only, weight (V, H) (and bias (V,)) the LM head,
    targets (N,) -> (N,) fp32 logprobs. `softcap`: the model's final logit soft-capping (Gemma), applied before the
    temperature as the model's own forward does. Gradients flow to `hidden` (and to `weight`/`bias` if they need
    them). `chunk_size`: positions per chunk, default from `chunk_positions`."""
    chunk = chunk_size or chunk_positions(weight.shape[0])
    return _ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), softcap, chunk)


@dataclass
class LossTerms:
    """The loss and detached statistics; sums are over masked tokens, so callers can reduce across ranks."""

    loss: torch.Tensor
    n_tokens: torch.Tensor
    clipped_tokens: torch.Tensor
    kl_sum: torch.Tensor
    ratio_sum: torch.Tensor
    max_abs_log_ratio: torch.Tensor  # max over masked tokens of |log pi - log behaviour|: 0 when on-policy and exact


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    normaliser: float,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
) -> LossTerms:
    """Token-level clipped surrogate (+ optional k3 KL to the reference policy).

    logprobs, behaviour_logprobs, mask, ref_logprobs: (B, T); advantages: (B,).
    `normaliser` is the number of completion tokens the loss is averaged over (the global batch's count,
    so that micro-batches and ranks add up to one token-level mean).
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - behaviour_logprobs)  # (B, T)
    adv = advantages.unsqueeze(1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    per_token = -torch.min(unclipped, clipped)  # (B, T)
    kl = torch.zeros_like(per_token)
    if beta > 0.0:
        assert ref_logprobs is not None, "beta > 0 needs reference logprobs"
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0  # k3 estimator: >= 0, unbiased for KL(pi || ref)
        per_token = per_token + beta * kl
    loss = (per_token * mask).sum() / normaliser
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
        return LossTerms(
            loss=loss,
            n_tokens=mask.sum(),
            clipped_tokens=(was_clipped.to(mask.dtype) * mask).sum(),
            kl_sum=(kl.detach() * mask).sum(),
            ratio_sum=(ratio.detach() * mask).sum(),
            max_abs_log_ratio=((logprobs.detach() - behaviour_logprobs).abs() * mask).max() if mask.numel()
            else mask.sum(),
        )
