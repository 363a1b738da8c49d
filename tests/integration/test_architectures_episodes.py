"""The tiny Gemma 4 model (asyncgrpo.toy.architectures), served by a real vLLM CPU server with tests/tool_formats.py's
Gemma 4 chat and response templates, runs a two-turn tool-calling episode through the project's own episode runner
(built by build_episode_runner, as a run builds it): turn 1 samples a call, the template renders the tool's result
inside the model turn, turn 2 samples on the exact running ids, and the trainer's logprobs (PEFT model, the trainer's
logprob code) of every sampled token equal the server's.

How turn 1 samples a call: a random model never writes one, and a call given as prompt ids would not be sampled. So
the fixture first fine-tunes the tiny model's weights (Adam: 93 steps, ~80 s on 2 busy cores) on the episode expected
here, until its sampled tokens (the call, then the answer after the result) are near-certain at the sampling
temperature; the server then samples them like any others, and that turn 1 parses as a call is asserted. vLLM's
structured outputs were not used: they sample from the policy masked by a grammar, not the distribution the trainer
scores. The episode runs on a small random LoRA over that model, as a training run's episodes do."""

from __future__ import annotations

import math

import pytest
import torch
from fakes import cfg as make_cfg
from tool_formats import GEMMA_RESPONSE, GEMMA_SPECIALS, GEMMA_TEMPLATE, tokenizer

from asyncgrpo.data import PromptRow
from asyncgrpo.rollout.build import build_episode_runner
from asyncgrpo.rollout.episodes import episode_group
from asyncgrpo.toy.architectures import build_tiny_model
from asyncgrpo.trainer.batching import collate
from asyncgrpo.trainer.logprobs import find_scoring_head, sequence_logprobs

ROW = PromptRow(prompt=[{"role": "user", "content": "Weather in Oslo?"}], prompt_ids=[], columns={}, rendered="")
CALL = '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|><|tool_response>'
RESULT = 'response:get_weather{value:<|"|>rain<|"|>}<tool_response|>'  # get_weather's answer, as the template renders
ANSWER = "It rains.<turn|>"
# Gemma 4's generation_config.json stops on <eos>, <turn|> and <|tool_response>; the toy's eos (id 0) stays one too.
STOPS = ["<eos>", "<turn|>", "<|tool_response>"]
TEMPERATURE = 0.7
MAX_MODEL_LEN = 256
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config():
    return make_cfg(tools=["tool_formats:get_weather"], max_turns=3, max_completion_length=48,
                    temperature=TEMPERATURE)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def teach(model_dir, ids: list[int], sampled: list[bool]) -> int:
    """Fine-tune every weight of the model in `model_dir` on one sequence (cross-entropy on the `sampled` positions)
    until those tokens' joint probability at TEMPERATURE is at least 0.98, and save it back; returns the steps."""
    from transformers import AutoModelForCausalLM  # heavy: the model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    x = torch.tensor([ids])
    keep = torch.tensor(sampled[1:])  # position t scores token t+1
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(300):
        logits = model(input_ids=x).logits[0, :-1].float()
        with torch.no_grad():
            joint = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, x[0, 1:, None]).squeeze(-1)[keep].sum()
        if joint > math.log(0.98):
            model.save_pretrained(model_dir)
            return step
        loss = -torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)[keep].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    raise AssertionError(f"the tiny model did not learn the episode in 300 steps (joint logprob {joint:.3f})")


def random_adapter(model_dir, root):
    """A rank-8 LoRA with small random weights on every decoder module, written by the trainer's AdapterStore."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM  # heavy: the model

    from asyncgrpo.store import AdapterStore

    torch.manual_seed(1)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=MODULES, task_type="CAUSAL_LM", init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.02)  # 0.05 would drown the taught episode (joint logprob -21.6)
    return AdapterStore(root / "adapters").write(0, get_peft_model_state_dict(model), lora, base_model=str(model_dir))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model directory, client, adapter name, adapter directory): the tiny Gemma 4 model with the Gemma 4 format's
    tokenizer and stop ids, taught the episode, served by one vLLM server (health-polled) with the LoRA loaded."""
    from transformers import GenerationConfig

    from asyncgrpo.inference.client import InferenceClient
    from asyncgrpo.inference_node.vllm_server import find_free_port
    from integration.runs import make_server

    root = tmp_path_factory.mktemp("gemma4-episode")
    model_dir = build_tiny_model("gemma4", root / "model")
    tok = tokenizer(GEMMA_SPECIALS, GEMMA_TEMPLATE, GEMMA_RESPONSE)
    tok.save_pretrained(model_dir)
    prompt = build_episode_runner(config(), tok, str(model_dir), MAX_MODEL_LEN).start(ROW).prompt_ids
    call, result, answer = encode(tok, CALL), encode(tok, RESULT), encode(tok, ANSWER)
    teach(model_dir, prompt + call + result + answer,
          [False] * len(prompt) + [True] * len(call) + [False] * len(result) + [True] * len(answer))
    stops = [tok.eos_token_id, *tok.convert_tokens_to_ids(STOPS)]
    GenerationConfig(bos_token_id=tok.eos_token_id, eos_token_id=stops,
                     pad_token_id=tok.eos_token_id).save_pretrained(model_dir)
    adapter_dir = random_adapter(model_dir, root)
    with make_server(model_dir, find_free_port(), max_model_len=MAX_MODEL_LEN, log_path=root / "vllm.log") as server:
        with InferenceClient(server.base_url) as client:
            client.load_adapter("gemma4-episode", adapter_dir)
            yield model_dir, client, "gemma4-episode", adapter_dir


class Recording:
    """The real client, keeping each turn's prompt ids and answer (what the server sampled, exactly)."""

    def __init__(self, client):
        self.client, self.prompts, self.turns = client, [], []
        self.base_url = client.base_url

    def complete(self, model, prompt_ids, **kwargs):
        out = self.client.complete(model, prompt_ids, **kwargs)
        self.prompts.append(list(prompt_ids))
        self.turns.append(out[0])
        return out


def test_gemma4_a_sampled_call_continues_on_the_exact_ids_and_the_trainer_scores_every_sampled_token_alike(served):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: the trainer's side

    model_dir, client, adapter, adapter_dir = served
    tok = AutoTokenizer.from_pretrained(model_dir)  # what a run loads: the templates came back from disk
    cfg = config()
    runner = build_episode_runner(cfg, tok, str(model_dir), MAX_MODEL_LEN)
    assert runner.fmt.response_template == GEMMA_RESPONSE
    rec = Recording(client)
    e = runner.start(ROW)
    runner.run(rec, e, adapter=adapter, version=0, seed=5)
    assert len(rec.turns) == 2, [tok.decode(t.token_ids) for t in rec.turns]
    first, second = rec.turns

    # Turn 1 sampled a call and stopped at <|tool_response>; it parsed into a typed call.
    assert tok.decode(first.token_ids) == CALL and first.finish_reason == "stop"
    assert e.messages[0]["tool_calls"] == [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]
    # Turn 2's prompt: the running ids, the sampled ids as they were, then the tool message as the Gemma 4 template
    # renders it inside the model turn (its generation prompt after a tool message is empty).
    result = encode(tok, RESULT)
    assert rec.prompts == [e.prompt_ids, e.prompt_ids + first.token_ids + result]
    assert e.messages[1:] == [{"role": "tool", "name": "get_weather", "content": "rain"},
                              {"role": "assistant", "content": "It rains."}]
    assert (e.turns, e.tool_calls, e.tool_errors, e.finish_reason) == (2, 1, 0, "stop")
    # The episode the trainer gets: every sampled id exact and in the loss, the tool tokens context only.
    assert e.ids == first.token_ids + result + second.token_ids
    assert e.loss_mask == [1] * len(first.token_ids) + [0] * len(result) + [1] * len(second.token_ids)
    assert e.logprobs == first.logprobs + [0.0] * len(result) + second.logprobs

    group = episode_group(ROW, [e], [1.0], {}, index=0, version=0, adapter=adapter, cfg=cfg)
    batch = collate([group], pad_id=tok.pad_token_id)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        trainer = sequence_logprobs(policy, find_scoring_head(policy), batch["input_ids"], batch["attention_mask"],
                                    batch["mask"], cfg.temperature)
    sampled = batch["mask"] > 0
    assert int(sampled.sum()) == len(first.token_ids) + len(second.token_ids)
    diff = (trainer[sampled] - batch["behaviour"][sampled]).abs().max().item()
    assert diff < 1e-3, diff  # the tolerance of test_architectures.py's trainer/server comparison (fp32)
