"""The trainer's per-token entropy, computed in the chunked LM head's forward (never the full vocabulary at every
position at once), against the entropy of the model's own full logits; and `top_entropy_quantile`'s token mask."""

import math

import pytest
import torch

from asyncgrpo.trainer.logprobs import chunked_token_logprobs, find_scoring_head, sequence_logprobs, token_entropy
from asyncgrpo.trainer.loss import LossSpec, grpo_loss, high_entropy_mask


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def _gemma3(softcap):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=32, max_position_embeddings=64,
                                              final_logit_softcapping=softcap, sliding_window=8))


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).train()


def _batch(vocab=300):
    """Two sequences of different lengths (right padding), completion positions from different offsets."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab, (2, 12), generator=g)
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, 9:] = 0
    mask = torch.zeros(2, 11)
    mask[0, 4:11] = 1.0
    mask[1, 2:8] = 1.0
    return input_ids, attention, mask


def _full_logits_entropy(model, temperature):
    input_ids, attention, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float() / temperature
    p = torch.softmax(logits, -1)
    return torch.where(mask > 0, -(p * torch.log(p)).sum(-1), 0.0), mask


@pytest.mark.parametrize("make, temperature", [(_qwen2, 1.0), (_qwen2, 0.7), (lambda: _gemma3(softcap=0.2), 0.9)])
def test_chunked_entropy_equals_the_full_logits_entropy_and_leaves_logprobs_and_gradients_alone(make, temperature):
    model = _lora(make())
    want, mask = _full_logits_entropy(model, temperature)
    input_ids, attention, _ = _batch(model.config.vocab_size)
    head = find_scoring_head(model)
    results = []
    for h in (head, None):  # the chunked head (3 positions a chunk), then the full-logits fallback
        model.zero_grad(set_to_none=True)
        lp, entropy = sequence_logprobs(model, h, input_ids, attention, mask, temperature, chunk_size=3,
                                        with_entropy=True)
        assert not entropy.requires_grad and entropy.shape == mask.shape
        assert torch.allclose(entropy, want, atol=1e-5, rtol=0)
        assert torch.equal(entropy[mask == 0], torch.zeros(int((mask == 0).sum())))
        lp.sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    model.zero_grad(set_to_none=True)
    plain = sequence_logprobs(model, head, input_ids, attention, mask, temperature, chunk_size=3)
    plain.sum().backward()
    assert torch.equal(plain.detach(), results[0][0])  # asking for the entropy changes no logprob ...
    for a, b in zip([p.grad for p in model.parameters() if p.requires_grad], results[0][1]):
        assert torch.equal(a, b)  # ... and no gradient
    assert want[mask > 0].min() > 0.1 and want.max() < math.log(300)  # a real spread, below uniform


def test_chunked_entropy_of_known_distributions():
    # Hidden states that make the logits [0, 0, 0, 0] (uniform: log 4) and [big, 0, 0, 0] (near 0).
    weight = torch.eye(4)
    hidden = torch.tensor([[0.0, 0.0, 0.0, 0.0], [60.0, 0.0, 0.0, 0.0]])
    lp, entropy = chunked_token_logprobs(hidden, weight, torch.tensor([1, 0]), chunk_size=1, entropy=True)
    assert entropy[0].item() == pytest.approx(math.log(4)) and entropy[1].item() == pytest.approx(0.0, abs=1e-6)
    assert lp.tolist() == pytest.approx([-math.log(4), 0.0], abs=1e-6)
    assert token_entropy(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))


def test_high_entropy_mask_keeps_the_top_quantile_of_masked_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # 7.0 is padding: never counted or kept
    kept = high_entropy_mask(entropy, mask, 0.3)  # threshold: the 0.7 quantile of the 7 masked values
    threshold = torch.quantile(entropy[mask > 0], 0.7)
    assert torch.equal(kept, ((entropy >= threshold) & (mask > 0)).float())
    assert kept.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]  # 0.9 and 0.7 (threshold 0.54)
    assert high_entropy_mask(entropy, torch.zeros(2, 4), 0.3).sum() == 0


def test_top_entropy_quantile_trains_only_the_high_entropy_tokens_and_counts_the_rest():
    lp = torch.zeros(1, 4, requires_grad=True)
    spec = LossSpec(epsilon_low=0.2, epsilon_high=0.2, top_entropy_quantile=0.5)
    terms = grpo_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 4), spec, normaliser=4.0,
                      entropy=torch.tensor([[0.1, 2.0, 3.0, 0.2]]))
    terms.loss.backward()
    assert lp.grad.tolist() == [[0.0, -0.25, -0.25, 0.0]]  # the normaliser still counts every token (as TRL)
    assert terms.masked_tokens.item() == 2.0 and terms.entropy.tolist() == pytest.approx([0.1, 2.0, 3.0, 0.2])
    with pytest.raises(AssertionError, match="entropy"):
        grpo_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 4), spec, normaliser=4.0)
