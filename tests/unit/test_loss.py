import torch

from asyncgrpo.loss import group_advantages, grpo_loss, token_logprobs


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
