import torch

from asyncgrpo.loss import chunk_positions, chunked_token_logprobs, group_advantages, grpo_loss, token_logprobs


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
    terms = grpo_loss(logp, logp.detach(), adv, mask, epsilon_low=0.2, epsilon_high=0.2, normaliser=3.0)
    terms.loss.backward()
    # ratio = 1: d/dlogp of -(ratio * A) / N = -A / N on masked tokens, 0 on padding
    assert torch.allclose(logp.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))
    assert terms.clipped_tokens.item() == 0 and terms.n_tokens.item() == 3


def test_ratio_outside_the_clip_range_gives_no_gradient_and_is_counted():
    behaviour = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.9, 0.52]])).requires_grad_()  # ratios 1.8 and 1.04
    terms = grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), epsilon_low=0.2, epsilon_high=0.28,
                      normaliser=2.0)
    terms.loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped at 1.28
    assert logp.grad[0, 1].item() < 0.0
    assert terms.clipped_tokens.item() == 1.0
    # a negative advantage is not clipped above: the policy is pushed down however far it moved
    logp2 = torch.log(torch.tensor([[0.9]])).requires_grad_()
    grpo_loss(logp2, behaviour[:, :1], torch.tensor([-1.0]), torch.ones(1, 1), epsilon_low=0.2, epsilon_high=0.28,
              normaliser=1.0).loss.backward()
    assert logp2.grad.item() > 0.0


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    same = grpo_loss(logp, logp, torch.zeros(1), mask, epsilon_low=0.2, epsilon_high=0.2, normaliser=2.0,
                     beta=0.1, ref_logprobs=logp.clone())
    assert same.kl_sum.item() == 0.0 and same.loss.item() == 0.0
    away = grpo_loss(logp, logp, torch.zeros(1), mask, epsilon_low=0.2, epsilon_high=0.2, normaliser=2.0,
                     beta=0.1, ref_logprobs=logp - 0.5)
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
        (lp * upstream).sum().backward()
        results.append((lp.detach(), h.grad, None if weight.grad is None else weight.grad.clone()))
    return results


def test_chunked_logprobs_and_their_gradients_equal_the_naive_ones_at_any_temperature():
    for temperature in (1.0, 0.7, 1.3):
        (lp, gh, _), (clp, cgh, _) = _naive_and_chunked(temperature)
        assert torch.allclose(clp, lp, atol=1e-5, rtol=0), temperature
        assert torch.allclose(cgh, gh, atol=1e-5, rtol=0), temperature
        assert clp.dtype == torch.float32
    # the temperature matters: the same logits at another temperature give other values (the check above can fail)
    assert not torch.allclose(_naive_and_chunked(1.0)[1][0], _naive_and_chunked(0.7)[1][0], atol=1e-3)


def test_chunked_logprobs_apply_softcap_and_bias_and_give_the_head_its_gradient():
    (lp, gh, gw), (clp, cgh, cgw) = _naive_and_chunked(0.8, softcap=3.0, bias=True, chunk_size=4, weight_grad=True)
    assert torch.allclose(clp, lp, atol=1e-5, rtol=0)
    assert torch.allclose(cgh, gh, atol=1e-5, rtol=0)
    assert torch.allclose(cgw, gw, atol=1e-5, rtol=0)
    uncapped = _naive_and_chunked(0.8, bias=True)[1][0]
    assert (uncapped - clp).abs().max() > 1e-2  # the softcap changed the values: the comparison has teeth


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
