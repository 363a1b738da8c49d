"""`asyncgrpo bench memory --json [--vocab_size 151936 --completion_tokens 1024]`: the peak memory of one train step
(forward + GRPO loss + backward) with chunked vs naive logprobs.

A tiny random Qwen2 with a real-size vocabulary and a LoRA adapter; each variant runs in a fresh subprocess, so that
one variant's freed memory cannot hide the other's peak. What is measured: docs/benchmarks.md ("`bench memory`").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncgrpo.children import run_group
from asyncgrpo.trainer.logprobs import (
    chunk_positions,
    find_scoring_head,
    sequence_logprobs,
)
from asyncgrpo.trainer.loss import LossSpec, grpo_loss

PROMPT_TOKENS = 16  # per sequence: the naive path pays the logits of prompt positions too
COMPLETION_PER_SEQ = 128


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _model(vocab_size: int, hidden: int):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, lora).train()


def _batch(vocab_size: int, completion_tokens: int):
    """Sequences of PROMPT_TOKENS + up to COMPLETION_PER_SEQ tokens, `completion_tokens` completion tokens in all."""
    n_seq = -(-completion_tokens // COMPLETION_PER_SEQ)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (n_seq, PROMPT_TOKENS + COMPLETION_PER_SEQ), generator=g)
    mask = torch.zeros(n_seq, PROMPT_TOKENS + COMPLETION_PER_SEQ - 1)
    left = completion_tokens
    for i in range(n_seq):
        n = min(left, COMPLETION_PER_SEQ)
        mask[i, PROMPT_TOKENS - 1:PROMPT_TOKENS - 1 + n] = 1.0
        left -= n
    return input_ids, torch.ones_like(input_ids), mask


def measure_variant(variant: str, vocab_size: int, completion_tokens: int, hidden: int, temperature: float) -> dict:
    """In this process: build, then one forward + loss + backward; the step's peak memory and the logprobs."""
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = _model(vocab_size, hidden).to(device)
    head = find_scoring_head(model) if variant == "chunked" else None
    assert variant == "naive" or head is not None
    input_ids, attention, mask = (t.to(device) for t in _batch(vocab_size, completion_tokens))
    advantages = torch.linspace(-1, 1, input_ids.shape[0], device=device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    logprobs = sequence_logprobs(model, head, input_ids, attention, mask, temperature)
    terms = grpo_loss(logprobs, logprobs.detach(), advantages, mask, LossSpec(epsilon_low=0.2, epsilon_high=0.2),
                      normaliser=float(mask.sum()))
    terms.loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _peak_rss_bytes()
    return {"variant": variant, "device": device.type, "step_peak_bytes": peak - before, "peak_bytes": peak,
            "before_step_bytes": before, "logprobs": logprobs[mask > 0].tolist()}


def _run_variant(variant: str, vocab_size: int, completion_tokens: int, hidden: int, temperature: float) -> dict:
    cmd = [sys.executable, "-m", "asyncgrpo.bench.memory", "--variant", variant, "--vocab_size", str(vocab_size),
           "--completion_tokens", str(completion_tokens), "--hidden", str(hidden), "--temperature", str(temperature)]
    proc = run_group(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory bench variant {variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(vocab_size: int = 151936, completion_tokens: int = 1024, hidden: int = 64, temperature: float = 0.7) -> dict:
    """Both variants, each in its own fresh process; the step peaks side by side."""
    naive = _run_variant("naive", vocab_size, completion_tokens, hidden, temperature)
    chunked = _run_variant("chunked", vocab_size, completion_tokens, hidden, temperature)
    diff = max(abs(a - b) for a, b in zip(naive["logprobs"], chunked["logprobs"]))
    assert len(naive["logprobs"]) == len(chunked["logprobs"]) == completion_tokens
    return {"device": naive["device"], "measure": "cuda max_memory_allocated" if naive["device"] == "cuda"
            else "peak RSS", "vocab_size": vocab_size, "completion_tokens": completion_tokens,
            "prompt_tokens": PROMPT_TOKENS * -(-completion_tokens // COMPLETION_PER_SEQ), "hidden_size": hidden,
            "temperature": temperature, "chunk_positions": chunk_positions(vocab_size),
            "naive_peak_bytes": naive["step_peak_bytes"], "chunked_peak_bytes": chunked["step_peak_bytes"],
            "chunked_over_naive": round(chunked["step_peak_bytes"] / naive["step_peak_bytes"], 4),
            "naive_process_peak_bytes": naive["peak_bytes"], "chunked_process_peak_bytes": chunked["peak_bytes"],
            "max_abs_logprob_diff": diff}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one variant of the memory bench (run by `asyncgrpo bench memory`)")
    parser.add_argument("--variant", choices=["naive", "chunked"], required=True)
    parser.add_argument("--vocab_size", type=int, required=True)
    parser.add_argument("--completion_tokens", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--temperature", type=float, required=True)
    args = parser.parse_args(argv)
    result = measure_variant(args.variant, args.vocab_size, args.completion_tokens, args.hidden, args.temperature)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
