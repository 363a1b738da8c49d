"""Is the served policy the trained policy? Trains a few steps against a real vLLM server, then compares, token
by token, the logprobs the server reports under the published adapter with the trainer's own (fp32).

Three comparisons on the same fixed completions (sampled from the server under the current adapter):
- `sampled`: the server's logprobs of the tokens it sampled vs the trainer's, right after a sync;
- `before_sync`: after one more optimizer step, not yet published: these must differ measurably;
- `after_sync`: after that step is published: these must agree again.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import load_prompts, toy_world
from asyncgrpo.demo import default_config_path
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port, served_lora_rank
from asyncgrpo.rewards import completion_text
from asyncgrpo.toy.shapes import shape_model_dir, shape_name
from asyncgrpo.trainer.recipe import GRPORecipe


def _max_diff(a: list[list[float]], b: list[list[float | None]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def measure(trainer, prompts: list[list[int]], n: int = 4) -> dict:
    """`trainer` is set up and has published its weights. Returns the three max abs logprob differences."""
    client, cfg = trainer.rollout.parts.clients[0], trainer.cfg
    prompt_ids, completion_ids, served = [], [], []
    for ids in prompts:
        for c in client.complete(trainer.rollout.adapter_name, ids, n=n, max_tokens=cfg.max_completion_length, temperature=cfg.temperature):
            prompt_ids.append(ids)
            completion_ids.append(c.token_ids)
            served.append(c.logprobs)

    def server_scores() -> list[list[float]]:  # under the adapter the server serves now
        return [client.score(trainer.rollout.adapter_name, p + c)[len(p):] for p, c in zip(prompt_ids, completion_ids)]

    sampled = _max_diff(trainer.score(prompt_ids, completion_ids), served)
    trainer.train_step()  # the trainer moves on; the server still serves the previous version
    mine = trainer.score(prompt_ids, completion_ids)
    before = _max_diff(mine, server_scores())
    trainer.sync(wait=True)
    after = _max_diff(mine, server_scores())
    return {"max_abs_logprob_diff": max(sampled, after), "max_abs_logprob_diff_sampled": sampled,
            "max_abs_logprob_diff_after_sync": after, "max_abs_logprob_diff_before_sync": before,
            "completions": len(completion_ids), "completion_tokens": sum(len(c) for c in completion_ids),
            "policy_version": trainer.version}


def served_vs_exported(client, adapter_name: str, adapter_dir: str | Path, model_dir: str | Path,
                       prompts: list[list[int]], *, n: int = 4, max_tokens: int, temperature: float) -> dict:
    """The same probe on a finished run, whose trainer is gone: the server's logprobs of completions it samples under
    `adapter_name` against those of the run's exported adapter (`adapter_dir`, PEFT format) on the base model in
    fp32, on this process's CPU. A server that serves the base, an older version or a wrongly applied adapter differs
    by far more than float error."""
    # heavy: torch, transformers, peft; only when a finished run is probed
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                                      str(adapter_dir)).eval()
    served, mine = [], []
    for ids in prompts:
        for c in client.complete(adapter_name, ids, n=n, max_tokens=max_tokens, temperature=temperature):
            tokens = torch.tensor([list(ids) + list(c.token_ids)])
            with torch.no_grad():
                logits = model(input_ids=tokens).logits[0, :-1].float() / temperature  # (T-1, V): processed logprobs
                logprobs = torch.log_softmax(logits, -1)
            picked = logprobs[len(ids) - 1:].gather(-1, tokens[0, len(ids):, None]).squeeze(-1)  # (completion,)
            mine.append(picked.tolist())
            served.append(c.logprobs)
    return {"max_abs_logprob_diff": round(_max_diff(mine, served), 6), "completions": len(served),
            "completion_tokens": sum(len(s) for s in served), "adapter": adapter_name}


def text_length_reward(prompts, completions, **columns) -> list[float]:
    """A reward for random-weight models (whose answers the toy cannot grade): the completion's length in
    characters / 100. It differs within a group, so every step moves the adapter."""
    return [len(completion_text(c)) / 100 for c in completions]


def run(server_url: str | None, overrides: list[str], workdir: str | None = None) -> dict:
    """Build the toy world, start a vLLM server unless `server_url` is given, train 2 steps (`--max_steps N`: N),
    measure. `--model_name_or_path shape:NAME` trains and serves that real-shape model (the toy's prompts)."""
    base = AsyncGRPOConfig.load(default_config_path(), overrides)
    world = toy_world(base)
    model_dir = world.model_dir
    if shape_name(base.model_name_or_path):
        model_dir = shape_model_dir(base.model_name_or_path, base.torch_dtype, os.environ.get("ASYNCGRPO_CACHE"))
        # The toy's reward gives a random model 0 everywhere: no advantage, no update, nothing to tell apart.
        overrides = ["--reward_funcs", "asyncgrpo.bench.policy_equivalence:text_length_reward", *overrides,
                     "--model_name_or_path", model_dir]
    with contextlib.ExitStack() as stack:
        work = Path(workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncgrpo-bench-")))
        if server_url is None:
            # The trainer's dtype and LoRA rank: served == trained is then a like-for-like comparison.
            server = VLLMServer(model_dir, find_free_port(), max_loras=2, max_model_len=256, dtype=base.torch_dtype,
                                max_lora_rank=served_lora_rank(base.lora_r), log_path=work / "vllm.log")
            stack.callback(server.stop)
            server.start()
            server.wait_ready(timeout_s=180.0 if model_dir == world.model_dir else 900.0)  # a real shape loads slowly
            server_url = server.base_url
        cfg = AsyncGRPOConfig.load(default_config_path(), [
            "--max_steps", "2", "--per_device_train_batch_size", "64", "--max_staleness", "0",
            "--output_dir", str(work / "run"), "--lora_adapter_path", str(work / "adapters"),
            "--vllm_server_base_url", server_url, "--torch_num_threads", "0", *overrides])
        trainer = GRPORecipe(cfg)
        try:
            trainer.setup()
            trainer.train()
            rows = load_prompts(world.heldout_file, trainer.tokenizer, cfg.prompt_column)[:8]
            return measure(trainer, [r.prompt_ids for r in rows])
        finally:
            trainer.cleanup()
