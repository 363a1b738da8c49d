"""The trainer's chunked logprob path (the LM head run on completion positions only, chunk by chunk) against the
model's own full logits, on tiny random models built from transformers' config classes."""

import pytest
import torch

from asyncgrpo.trainer.logprobs import chunked_token_logprobs, find_scoring_head, sequence_logprobs, token_logprobs
from models import lora_qv, two_padded_sequences


def _qwen2(vocab=300, **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, **extra)
    return Qwen2ForCausalLM(config)


def _gemma3(softcap=5.0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                              final_logit_softcapping=softcap, sliding_window=8)
    return Gemma3ForCausalLM(config)


def _both_paths(model, temperature, chunk_size=3):
    input_ids, attention, mask = two_padded_sequences(model.config.vocab_size)
    head = find_scoring_head(model)
    assert head is not None
    results = []
    for h in (None, head):
        model.zero_grad(set_to_none=True)
        lp = sequence_logprobs(model, h, input_ids, attention, mask, temperature, chunk_size=chunk_size)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((lp.detach(), grads))
    return mask, results


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_policy_logprobs_chunked_equal_the_full_logits_path_with_lora_gradients(temperature):
    mask, ((naive, naive_grads), (chunked, chunked_grads)) = _both_paths(lora_qv(_qwen2()), temperature)
    assert chunked.shape == (2, 11) and chunked.dtype == torch.float32
    assert torch.equal(chunked[mask == 0], torch.zeros(int((mask == 0).sum())))  # zeros off the completion
    assert torch.allclose(chunked, naive, atol=1e-5, rtol=0)
    assert naive_grads.keys() == chunked_grads.keys() and naive_grads
    for name, grad in naive_grads.items():
        assert grad.abs().max() > 0, name  # the gradient reaches the LoRA weights under the head
        assert torch.allclose(chunked_grads[name], grad, atol=1e-5, rtol=0), name


def test_policy_logprobs_chunked_apply_gemma_final_logit_softcapping_once():
    model = lora_qv(_gemma3(softcap=0.2))  # small: random logits are small too
    mask, ((naive, _), (chunked, _)) = _both_paths(model, 0.9)
    assert find_scoring_head(model).softcap == 0.2
    assert torch.allclose(chunked, naive, atol=1e-5, rtol=0)
    assert model.config.final_logit_softcapping == 0.2  # restored after the call
    assert "forward" not in vars(model.get_output_embeddings())  # the head's own forward is back
    without = sequence_logprobs(lora_qv(_gemma3(softcap=None)), None, *two_padded_sequences(), 0.9)
    assert (without - naive).abs().max() > 1e-3  # the softcap moved the values: the check above has teeth


def test_heads_the_chunked_path_cannot_model_fall_back_to_full_logits():
    assert find_scoring_head(_qwen2()) is not None
    from peft import LoraConfig, get_peft_model

    lora_head = get_peft_model(_qwen2(), LoraConfig(r=4, target_modules=["lm_head"]))
    assert find_scoring_head(lora_head) is None
    scaled = _qwen2()
    scaled.config.logits_scaling = 8.0  # as Granite's forward divides the head's output
    assert find_scoring_head(scaled) is None


@pytest.mark.parametrize("scale, chunked", [(None, True), (1, True), (1.0, True), (2.0, False), (0.5, False)])
def test_a_logit_scale_of_exactly_one_keeps_the_chunked_path_and_any_other_leaves_it(scale, chunked):
    model = _qwen2()
    model.config.logit_scale = scale  # Cohere's name; 1 rescales nothing
    assert (find_scoring_head(model) is not None) == chunked


def _composite(**outer):
    """A tiny Gemma 3 image-text model on the meta device (its head and configs are all find_scoring_head reads): a
    composite config, the text model's own config inside; `outer` set on the outer one."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=64, sliding_window=8)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    for name, value in outer.items():
        setattr(config, name, value)
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config)
    assert model.config.get_text_config() is not model.config  # the layout under test: two configs
    return model


def test_a_composite_models_outer_config_is_read_as_well_as_its_text_config():
    assert find_scoring_head(_composite(logits_scaling=2.0)) is None  # set on the outer config only
    head = find_scoring_head(_composite(final_logit_softcapping=30.0))
    assert head.softcap == 30.0 and len(head.configs) == 2
    both = _composite(final_logit_softcapping=30.0)
    both.config.get_text_config().final_logit_softcapping = 50.0
    with pytest.raises(AssertionError, match="two different final_logit_softcapping values"):
        find_scoring_head(both)
    same = _composite(final_logit_softcapping=30.0)
    same.config.get_text_config().final_logit_softcapping = 30.0
    assert find_scoring_head(same).softcap == 30.0  # the same cap twice is one cap


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")  # one rank: nothing to shard
def test_an_fsdp1_wrapped_head_is_unwrapped_to_its_linear(tmp_path):
    from gloo import one_rank
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _qwen2()
    linear = model.lm_head
    with one_rank(tmp_path):
        model.lm_head = FSDP(linear, use_orig_params=True, device_id=torch.device("cpu"))  # its own FSDP unit
        assert model.get_output_embeddings() is not linear  # the layout under test: the wrapper is what is found
        head = find_scoring_head(model)
    assert head is not None and head.module is linear


def _phi():
    """A head with a bias (Phi's lm_head), set to values that move the logprobs (the model initialises it to zero)."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    config = PhiConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=64)
    model = PhiForCausalLM(config)
    with torch.no_grad():
        model.lm_head.bias.normal_(0.0, 1.0)
    return model


def test_policy_logprobs_chunked_add_the_head_s_bias():
    mask, ((naive, naive_grads), (chunked, chunked_grads)) = _both_paths(lora_qv(_phi()), 1.0)
    assert torch.allclose(chunked, naive, atol=1e-5, rtol=0)
    for name, grad in naive_grads.items():
        assert torch.allclose(chunked_grads[name], grad, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("chunked", [False, True], ids=["full-logits", "chunked"])
def test_tokens_the_attention_mask_hides_do_not_change_the_logprobs(chunked):
    """Left padding: the first tokens of row 0 are hidden by its attention mask, so what they are cannot matter."""
    model = _qwen2()
    input_ids, attention, mask = two_padded_sequences()
    attention[0, :3] = 0
    head = find_scoring_head(model) if chunked else None
    with torch.no_grad():
        first = sequence_logprobs(model, head, input_ids, attention, mask, 1.0)
        other = input_ids.clone()
        other[0, :3] = (other[0, :3] + 100) % 300
        second = sequence_logprobs(model, head, other, attention, mask, 1.0)
    assert torch.isfinite(first).all() and (first[mask > 0] != 0).all()
    assert torch.allclose(first, second, atol=1e-6, rtol=0)


def test_chunked_logprobs_run_the_head_in_its_own_dtype_and_give_the_hidden_states_theirs():
    """fp32 hidden states into a bf16 head (as under mixed precision): cast to the head's dtype for the product, as
    nn.Linear under autocast would, and the gradient comes back in fp32."""
    torch.manual_seed(0)
    weight = torch.randn(50, 16).to(torch.bfloat16)
    hidden = torch.randn(7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    chunked = chunked_token_logprobs(hidden, weight, targets, chunk_size=3)
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    logits = torch.nn.functional.linear(reference_hidden.to(torch.bfloat16), weight)
    reference = token_logprobs(logits[None], targets[None])[0]
    assert torch.allclose(chunked, reference, atol=1e-5, rtol=0)
    chunked.sum().backward()
    reference.sum().backward()
    assert hidden.grad.dtype == torch.float32
    assert torch.allclose(hidden.grad, reference_hidden.grad, atol=1e-2, rtol=0)


def test_positions_found_on_the_host_give_the_same_logprobs_and_the_forward_finds_none_itself():
    # On a GPU, finding the completion positions from the device mask (nonzero, boolean indexing) makes the host wait
    # for the count at every forward; `with_positions` finds them once at collate time, on the host.
    from torch.utils._python_dispatch import TorchDispatchMode

    from asyncgrpo.trainer.batching import with_positions

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    model = lora_qv(_qwen2())
    input_ids, attention, mask = two_padded_sequences(model.config.vocab_size)
    head = find_scoring_head(model)
    positions = with_positions({"mask": mask})["positions"]
    assert positions.tolist() == [i for i, m in enumerate(mask.flatten().tolist()) if m > 0]
    found, given = Ops(), Ops()
    with found:
        lp_found, ent_found = sequence_logprobs(model, head, input_ids, attention, mask, 0.7, with_entropy=True)
    with given:
        lp_given, ent_given = sequence_logprobs(model, head, input_ids, attention, mask, 0.7, with_entropy=True,
                                                positions=positions)
    assert torch.equal(lp_found, lp_given) and torch.equal(ent_found, ent_given)
    assert any("nonzero" in n for n in found.names)  # the fallback finds them on the device
    assert not any("nonzero" in n for n in given.names), sorted(set(given.names))
