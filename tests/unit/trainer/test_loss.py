import pytest
import torch
from advantage_reference import group_advantages

from asyncgrpo.trainer.logprobs import chunk_positions, chunked_token_logprobs, token_logprobs
from asyncgrpo.trainer.loss import LossSpec, grpo_loss


def test_group_advantages_are_centred_and_scaled_per_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(r)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    assert torch.equal(adv[1], torch.zeros(4))  # no signal in a group that all agree
    assert torch.allclose(group_advantages(r, scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_token_logprobs_match_log_softmax_with_temperature():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    lp = token_logprobs(logits, targets, temperature=0.5)
    expected = torch.log_softmax(logits / 0.5, -1)[0, 1, 4]
    assert torch.allclose(lp[0, 1], expected)


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    terms = grpo_loss(logp, logp.detach(), adv, mask, LossSpec(epsilon_low=0.2, epsilon_high=0.2), normaliser=3.0)
    terms.loss.backward()
    # ratio = 1: d/dlogp of -(ratio * A) / N = -A / N on masked tokens, 0 on padding
    assert torch.allclose(logp.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))
    assert terms.clipped_tokens.item() == 0 and terms.n_tokens.item() == 3


def test_ratio_outside_the_clip_range_gives_no_gradient_and_is_counted():
    behaviour = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.9, 0.52]])).requires_grad_()  # ratios 1.8 and 1.04
    terms = grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2),
                      LossSpec(epsilon_low=0.2, epsilon_high=0.28), normaliser=2.0)
    terms.loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped at 1.28
    assert logp.grad[0, 1].item() < 0.0
    assert terms.clipped_tokens.item() == 1.0
    # a negative advantage is not clipped above: the policy is pushed down however far it moved
    logp2 = torch.log(torch.tensor([[0.9]])).requires_grad_()
    grpo_loss(logp2, behaviour[:, :1], torch.tensor([-1.0]), torch.ones(1, 1),
              LossSpec(epsilon_low=0.2, epsilon_high=0.28), normaliser=1.0).loss.backward()
    assert logp2.grad.item() > 0.0


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    same = grpo_loss(logp, logp, torch.zeros(1), mask, LossSpec(epsilon_low=0.2, epsilon_high=0.2, beta=0.1),
                     normaliser=2.0, ref_logprobs=logp.clone())
    assert same.kl_sum.item() == 0.0 and same.loss.item() == 0.0
    away = grpo_loss(logp, logp, torch.zeros(1), mask, LossSpec(epsilon_low=0.2, epsilon_high=0.2, beta=0.1),
                     normaliser=2.0, ref_logprobs=logp - 0.5)
    k3 = torch.exp(torch.tensor(-0.5)) + 0.5 - 1
    assert torch.isclose(away.kl_sum, 2 * k3)
    assert torch.isclose(away.loss, 0.1 * k3)


def _naive_and_chunked(temperature, softcap=None, bias=False, chunk_size=3, weight_grad=False):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g, dtype=torch.float64).float()
    weight = torch.randn(50, 8, generator=g).requires_grad_(weight_grad)
    b = torch.randn(50, generator=g).requires_grad_(weight_grad) if bias else None
    targets = torch.randint(0, 50, (10,), generator=g)
    upstream = torch.randn(10, generator=g)  # a gradient other than ones, as the GRPO loss sends
    results = []
    for chunked in (False, True):
        h = hidden.clone().requires_grad_()
        if chunked:
            lp = chunked_token_logprobs(h, weight, targets, temperature=temperature, bias=b, softcap=softcap,
                                        chunk_size=chunk_size)
        else:
            logits = torch.nn.functional.linear(h, weight, b)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            lp = token_logprobs(logits.unsqueeze(0), targets.unsqueeze(0), temperature).squeeze(0)
        weight.grad = None
        if b is not None:
            b.grad = None
        (lp * upstream).sum().backward()
        results.append((lp.detach(), h.grad, None if weight.grad is None else weight.grad.clone(),
                        None if b is None or b.grad is None else b.grad.clone()))
    return results


def test_chunked_logprobs_and_their_gradients_equal_the_naive_ones_at_any_temperature():
    for temperature in (1.0, 0.7, 1.3, 2.0):  # 2.0 too: a check against one special value would pass at 1.0
        (lp, gh, _, _), (clp, cgh, _, _) = _naive_and_chunked(temperature)
        assert torch.allclose(clp, lp, atol=1e-5, rtol=0), temperature
        assert torch.allclose(cgh, gh, atol=1e-5, rtol=0), temperature
        assert clp.dtype == torch.float32
    # the temperature matters: the same logits at another temperature give other values (the check above can fail)
    assert not torch.allclose(_naive_and_chunked(1.0)[1][0], _naive_and_chunked(0.7)[1][0], atol=1e-3)


def test_chunked_logprobs_apply_softcap_and_bias_and_give_the_head_its_gradient():
    (lp, gh, gw, gb), (clp, cgh, cgw, cgb) = _naive_and_chunked(0.8, softcap=3.0, bias=True, chunk_size=4,
                                                                  weight_grad=True)
    assert torch.allclose(clp, lp, atol=1e-5, rtol=0)
    assert torch.allclose(cgh, gh, atol=1e-5, rtol=0)
    assert torch.allclose(cgw, gw, atol=1e-5, rtol=0)
    assert cgb is not None and cgb.shape == (50,) and torch.allclose(cgb, gb, atol=1e-5, rtol=0)  # summed per row
    uncapped = _naive_and_chunked(0.8, bias=True)[1][0]
    assert (uncapped - clp).abs().max() > 1e-2  # the softcap changed the values: the comparison has teeth


def test_chunked_logprobs_default_to_temperature_1_and_a_chunk_sized_from_the_vocabulary():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(7, 8, generator=g), torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (7,), generator=g)
    naive = token_logprobs(torch.nn.functional.linear(hidden, weight).unsqueeze(0), targets.unsqueeze(0), 1.0)
    assert torch.allclose(chunked_token_logprobs(hidden, weight, targets), naive.squeeze(0), atol=1e-5, rtol=0)


def test_rows_whose_logits_lie_far_apart_each_get_their_own_log_sum_exp():
    # Row 1's logits are ~100x row 0's: shifted by the chunk's largest logit instead of its own row's, row 0's
    # exponentials would all underflow in float32 (exp(-88) is the floor) and its log-sum-exp become -inf.
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 8, generator=g), torch.randn(50, 8, generator=g)
    hidden[1] *= 100.0
    targets = torch.tensor([3, 4])
    naive = token_logprobs(torch.nn.functional.linear(hidden, weight).unsqueeze(0), targets.unsqueeze(0), 1.0)
    chunked = chunked_token_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=2)
    assert torch.isfinite(chunked).all() and torch.allclose(chunked, naive.squeeze(0), atol=1e-4, rtol=0)


def test_chunk_size_does_not_change_the_result_and_is_sized_from_the_vocabulary():
    one = _naive_and_chunked(1.0, chunk_size=1)[1]
    all_at_once = _naive_and_chunked(1.0, chunk_size=100)[1]
    assert torch.allclose(one[0], all_at_once[0], atol=1e-6) and torch.allclose(one[1], all_at_once[1], atol=1e-6)
    assert chunk_positions(151936) == 2**26 // 151936 and chunk_positions(10**9) == 1


def test_chunked_logprobs_ignore_autocast_so_the_backward_matches_the_forward():
    """Under autocast (accelerate's DDP mixed precision) the head would run in bf16 in the forward but not in the
    backward's recompute; the chunked path runs in the weights' dtype in both."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(6, 16, generator=g) * 4).requires_grad_()
    weight = torch.randn(40, 16, generator=g)
    targets = torch.randint(0, 40, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = chunked_token_logprobs(hidden, weight, targets, temperature=0.9, chunk_size=4)
        bf16 = token_logprobs(torch.nn.functional.linear(hidden, weight).unsqueeze(0), targets.unsqueeze(0), 0.9)
    lp.sum().backward()
    h2 = hidden.detach().clone().requires_grad_()
    exact = token_logprobs(torch.nn.functional.linear(h2, weight).unsqueeze(0), targets.unsqueeze(0), 0.9).squeeze(0)
    exact.sum().backward()
    assert (bf16.squeeze(0) - exact).abs().max() > 1e-3  # autocast really changes a head run under it
    assert torch.allclose(lp, exact, atol=1e-5, rtol=0)
    assert torch.allclose(hidden.grad, h2.grad, atol=1e-5, rtol=0)


# ---- group advantages, written out by hand -------------------------------------------------------------------------
def test_group_advantages_use_the_sample_std_of_each_group_plus_eps():
    # Group 0: mean 0.25, centred (0.75, -0.25, -0.25, -0.25), sample std sqrt(0.75 / 3) = 0.5 -> / 0.5001.
    # Group 1: mean 3, centred (-1, 1, -1, 1), sample std sqrt(4 / 3) = 1.1547005 -> / 1.1548005 = 0.8659504.
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 2.0, 4.0]], dtype=torch.float64)
    expected = torch.tensor([[1.4997000599880024, -0.49990001999600085, -0.49990001999600085, -0.49990001999600085],
                             [-0.8659504102790668, 0.8659504102790668, -0.8659504102790668, 0.8659504102790668]],
                            dtype=torch.float64)
    assert torch.allclose(group_advantages(r), expected, rtol=0, atol=1e-12)
    assert torch.allclose(group_advantages(r, eps=0.0)[0], torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64))


def test_unscaled_advantages_only_subtract_each_groups_own_mean():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 2.0, 4.0]])
    assert torch.equal(group_advantages(r, scale=False), torch.tensor([[0.75, -0.25, -0.25, -0.25],
                                                                       [-1.0, 1.0, -1.0, 1.0]]))


# ---- the clipped surrogate, token by token -------------------------------------------------------------------------
EPS_LOW, EPS_HIGH = 0.2, 0.28  # asymmetric, so that swapping the two bounds changes the answer


def _case():
    """Three sequences (float64), behaviour logprob -1 everywhere, chosen ratios; padding has a far-off ratio.
    row 0, A = +2: ratio 1.5 (above 1 + 0.28: clipped), 1.25 (inside [0.8, 1.28], but above 1 + eps_low),
                   0.5 (below 0.8: a positive advantage is not clipped below), padding (ratio 3)
    row 1, A = -1: ratio 0.5 (below 0.8: clipped), 0.78 (below 0.8, above 1 - eps_high: clipped),
                   1.5 (above 1.28: a negative advantage is not clipped above), 0.9
    row 2, A = 0:  ratio 0.5, 1.5 (outside the range, but no advantage: nothing clipped), padding, padding"""
    ratios = torch.tensor([[1.5, 1.25, 0.5, 3.0], [0.5, 0.78, 1.5, 0.9], [0.5, 1.5, 3.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    behaviour = torch.full((3, 4), -1.0, dtype=torch.float64)
    logp = (behaviour + ratios.log()).requires_grad_()
    adv = torch.tensor([2.0, -1.0, 0.0], dtype=torch.float64)
    return logp, behaviour, adv, mask, ratios


def test_each_clip_bound_applies_to_its_own_advantage_sign():
    logp, behaviour, adv, mask, _ = _case()
    terms = grpo_loss(logp, behaviour, adv, mask, LossSpec(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH), normaliser=9.0)
    # per token -min(r A, clip(r) A):
    # row 0: -min(3, 2.56) = -2.56, -2.5, -min(1, 1.6) = -1; row 1: -min(-0.5, -0.8) = 0.8, 0.8, 1.5, 0.9; row 2: 0
    assert abs(terms.loss.item() - (-2.56 - 2.5 - 1.0 + 0.8 + 0.8 + 1.5 + 0.9) / 9.0) < 1e-12
    terms.loss.backward()
    # Unclipped tokens: d/dlogp of -(r A) / N = -r A / N; clipped ones and padding: 0.
    expected_grad = torch.tensor([[0.0, -2 * 1.25 / 9, -2 * 0.5 / 9, 0.0],
                                  [0.0, 0.0, 1.5 / 9, 0.9 / 9],
                                  [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected_grad, rtol=0, atol=1e-12)


def test_clipped_tokens_count_only_masked_tokens_clipped_in_their_advantages_direction():
    logp, behaviour, adv, mask, _ = _case()
    terms = grpo_loss(logp, behaviour, adv, mask, LossSpec(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH), normaliser=9.0)
    assert terms.clipped_tokens.item() == 3.0  # (0, 0) above 1.28 with A > 0; (1, 0) and (1, 1) below 0.8 with A < 0


def test_loss_statistics_are_sums_over_masked_tokens():
    logp, behaviour, adv, mask, ratios = _case()
    terms = grpo_loss(logp, behaviour, adv, mask, LossSpec(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH), normaliser=9.0)
    assert terms.n_tokens.item() == 9.0
    assert abs(terms.ratio_sum.item() - (1.5 + 1.25 + 0.5 + 0.5 + 0.78 + 1.5 + 0.9 + 0.5 + 1.5)) < 1e-12
    assert abs(terms.max_abs_log_ratio.item() - abs(torch.log(torch.tensor(0.5, dtype=torch.float64)).item())) < 1e-12
    assert terms.kl_sum.item() == 0.0  # beta 0: no KL term at all
    for stat in (terms.n_tokens, terms.clipped_tokens, terms.ratio_sum, terms.max_abs_log_ratio, terms.kl_sum):
        assert not stat.requires_grad  # statistics never carry the graph into logging or reductions


def test_a_batch_with_no_tokens_has_zero_statistics():
    empty = torch.zeros(0, 3)
    terms = grpo_loss(empty, empty, torch.zeros(0), empty, LossSpec(epsilon_low=0.2, epsilon_high=0.2), normaliser=1.0)
    assert (terms.loss.item(), terms.n_tokens.item(), terms.max_abs_log_ratio.item()) == (0.0, 0.0, 0.0)


def test_kl_is_summed_over_masked_tokens_and_added_to_the_loss_per_token():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    ref = logp.detach() - torch.tensor([[0.5, -0.25, 4.0]], dtype=torch.float64)  # the last token is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    terms = grpo_loss(logp, logp.detach(), torch.tensor([1.0], dtype=torch.float64), mask,
                      LossSpec(epsilon_low=0.2, epsilon_high=0.2, beta=0.1), normaliser=2.0, ref_logprobs=ref)
    k3 = [torch.exp(torch.tensor(d, dtype=torch.float64)).item() - d - 1 for d in (-0.5, 0.25)]  # d = ref - logp
    assert abs(terms.kl_sum.item() - sum(k3)) < 1e-12
    # surrogate -1 per token (ratio 1, A = 1) plus 0.1 x k3, averaged over the normaliser
    assert abs(terms.loss.item() - (-2.0 + 0.1 * sum(k3)) / 2.0) < 1e-12
    terms.loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): the KL pulls logp back toward the reference
    expected = [(-1.0 + 0.1 * (1 - torch.exp(torch.tensor(-d, dtype=torch.float64)).item())) / 2.0 for d in (0.5, -0.25)]
    assert torch.allclose(logp.grad[0, :2], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert logp.grad[0, 2].item() == 0.0


def test_micro_batches_and_ranks_add_up_to_one_token_level_mean():
    """The trainer splits a global batch over ranks and micro-batches and passes every call the global token count
    divided by the ranks (DDP then averages gradients over ranks): the result is the plain mean over all tokens of the
    global batch, whatever the length of each micro-batch."""
    torch.manual_seed(0)
    logp = torch.randn(8, 5, dtype=torch.float64) * 0.1 - 1.0
    behaviour = logp + torch.randn(8, 5, dtype=torch.float64) * 0.3
    adv = torch.randn(8, dtype=torch.float64)
    lengths = [5, 1, 2, 5, 3, 1, 4, 2]  # uneven, so that a local token count would weight micro-batches wrongly
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths], dtype=torch.float64)
    kw = dict(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)

    whole = logp.clone().requires_grad_()
    reference = grpo_loss(whole, behaviour, adv, mask, LossSpec(**kw), normaliser=float(sum(lengths)))
    reference.loss.backward()

    world, normaliser = 2, sum(lengths) / 2
    grads, losses, tokens = [], [], 0.0
    for rank in range(world):  # rank r holds rows 4r..4r+3, in two micro-batches of two rows
        param = logp.clone().requires_grad_()
        for rows in (slice(4 * rank, 4 * rank + 2), slice(4 * rank + 2, 4 * rank + 4)):
            terms = grpo_loss(param[rows], behaviour[rows], adv[rows], mask[rows], LossSpec(**kw),
                              normaliser=normaliser)
            terms.loss.backward()  # gradients accumulate over micro-batches
            losses.append(terms.loss.item())
            tokens += terms.n_tokens.item()
        grads.append(param.grad)
    assert tokens == sum(lengths)
    assert abs(sum(losses) / world - reference.loss.item()) < 1e-12
    assert torch.allclose(sum(grads) / world, whole.grad, rtol=0, atol=1e-12)  # DDP's all-reduce mean


def test_token_logprobs_are_fp32_for_every_position_of_a_bf16_batch():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5).to(torch.bfloat16)
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    lp = token_logprobs(logits, targets)
    assert lp.dtype == torch.float32 and lp.shape == (2, 3)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    assert torch.equal(lp, expected)


def test_a_ratio_exactly_on_a_bound_is_not_clipped_and_keeps_its_gradient():
    # epsilon 0 puts both bounds at ratio 1, where an on-policy token sits exactly
    logp = torch.tensor([[-1.0], [-1.0]], dtype=torch.float64, requires_grad=True)
    terms = grpo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0], dtype=torch.float64),
                      torch.ones(2, 1, dtype=torch.float64), LossSpec(epsilon_low=0.0, epsilon_high=0.0),
                      normaliser=2.0)
    terms.loss.backward()
    assert terms.clipped_tokens.item() == 0.0
    assert logp.grad[:, 0].tolist() == [-0.5, 0.5]


def test_a_boolean_mask_gives_the_same_terms_in_the_logprobs_dtype():
    logp, behaviour, adv, mask, _ = _case()
    as_float = grpo_loss(logp, behaviour, adv, mask, LossSpec(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH),
                         normaliser=9.0)
    as_bool = grpo_loss(logp, behaviour, adv, mask.bool(), LossSpec(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH),
                        normaliser=9.0)
    for name in ("loss", "n_tokens", "clipped_tokens", "ratio_sum", "max_abs_log_ratio"):
        a, b = getattr(as_float, name), getattr(as_bool, name)
        assert b.dtype == torch.float64 and torch.equal(a, b), name


def test_a_kl_penalty_without_reference_logprobs_is_refused():
    logp = torch.zeros(1, 2)
    with pytest.raises(AssertionError, match="^beta > 0 needs reference logprobs$"):
        grpo_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), LossSpec(epsilon_low=0.2, epsilon_high=0.2, beta=0.1),
                  normaliser=2.0)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_token_logprobs_divide_the_logits_by_any_temperature(temperature):
    torch.manual_seed(1)
    logits = torch.randn(1, 4, 6)
    targets = torch.tensor([[5, 0, 3, 3]])
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(token_logprobs(logits, targets, temperature=temperature), expected)


def test_a_kl_term_without_reference_logprobs_is_refused_with_the_reason():
    logp = torch.tensor([[-1.0, -2.0]])
    with pytest.raises(AssertionError) as err:
        grpo_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), LossSpec(epsilon_low=0.2, epsilon_high=0.2, beta=0.1),
                  normaliser=2.0)
    assert str(err.value) == "beta > 0 needs reference logprobs"
