"""The policy a run trains, built in one place for the trainer and the benchmarks (`build_policy`): the base model
with its LoRA adapter (lora.py), AdamW over the adapter alone, prepared for the backend the launcher chose, and the
LM head the chunked logprob path runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from asyncgrpo.config import MemorySettings, ModelSettings, TrainingSettings
from asyncgrpo.data import local_model_dir
from asyncgrpo.distributed import (configure_backend, deepspeed_mode_on, fp32_buffer_check, recompute_rotary_buffers,
                                   zero3_init_in)
from asyncgrpo.errors import ConfigError
from asyncgrpo.lora import with_lora
from asyncgrpo.trainer.gather import backend_of, lora_parameters
from asyncgrpo.trainer.logprobs import find_scoring_head

log = logging.getLogger(__name__)


@dataclass
class PolicySettings(ModelSettings, TrainingSettings, MemorySettings):
    """The sections the policy is built from: the base and its LoRA, the optimizer's keys and the seed, and
    gradient checkpointing."""


class Policy(NamedTuple):
    """What `build_policy` returns; the model and optimizer as `accelerator.prepare` returned them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: object
    peft_config: object  # PEFT's LoraConfig (written into every published adapter)
    scoring_head: object  # the LM head the chunked logprob path runs (None: full logits; logprobs.py)


def base_dtype(model: ModelSettings, acc) -> str:
    """The dtype the base model is built in: `torch_dtype`, or bf16 when a DeepSpeed json turns its bf16 mode on
    (`bf16.enabled` true, or `auto` under bf16 mixed precision): that mode is translated into a bf16 base under fp32
    LoRA weights (distributed._fp32_buffers_and_reduction switches DeepSpeed's own off)."""
    if not deepspeed_mode_on(acc, "bf16") or model.torch_dtype == "bfloat16":
        return model.torch_dtype
    if model.torch_dtype != "float32":
        raise ConfigError("torch_dtype", f"is {model.torch_dtype}, but the DeepSpeed json turns bf16 on",
                          "set `torch_dtype: bfloat16`, or `\"bf16\": {\"enabled\": \"auto\"}` in the json "
                          "without bf16 mixed precision")
    log.info("the DeepSpeed json turns bf16 on: the base model is built in bfloat16 (torch_dtype says float32)")
    return "bfloat16"


def load_placement(acc) -> dict:
    """Where `from_pretrained` puts the base. Under DDP and ZeRO-2 on a GPU every rank keeps the whole base on its
    device, so it is read straight onto that device; read into host RAM first, 8 ranks of a 7B bf16 base would hold
    8 x 15 GB of a node's memory at once. FSDP (one rank reads, then shards) and ZeRO-3 (partitioned as it is built)
    load their own way, and on CPU the weights are already where they go."""
    if acc.device.type != "cuda" or backend_of(acc) not in ("ddp", "zero2"):
        return {}
    return {"device_map": {"": acc.device}}


def build_policy(cfg: PolicySettings, acc, model_path: str, tokenizer=None) -> Policy:
    """Collective (under FSDP/ZeRO `prepare` shards the model): the tokenizer (`tokenizer`, or `model_path`'s) and
    base model of `model_path` in `torch_dtype`, the LoRA adapter (the same initialisation on every rank: seeded), AdamW over the LoRA parameters
    only, prepared by `acc`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: transformers, only when a model is built

    torch.manual_seed(cfg.seed)  # same LoRA initialisation on every rank
    with acc.local_main_process_first():  # a hub model is downloaded once per node; the others read the cache
        local_dir = local_model_dir(model_path)
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(local_dir)
    dtype = getattr(torch, base_dtype(cfg, acc))
    # Under ZeRO-3 the base is partitioned as it is built, in `torch_dtype` (zero3_init_in); under FSDP with
    # `fsdp_cpu_ram_efficient_loading` only local rank 0 reads the weights (transformers), the others get them
    # from rank 0 when the model is sharded (accelerate).
    with zero3_init_in(dtype):
        base = AutoModelForCausalLM.from_pretrained(local_dir, dtype=dtype, **load_placement(acc))
    if any(hasattr(p, "ds_id") for p in base.parameters()):
        rebuilt = recompute_rotary_buffers(base)  # zero.Init rounded them to torch_dtype too
        log.info("ZeRO-3: the base was partitioned as it was built (zero.Init), in %s; rotary buffers of %d "
                 "modules recomputed in fp32", str(dtype).removeprefix("torch."), rebuilt)
    if cfg.gradient_checkpointing:
        # Non-reentrant: it works with frozen inputs and FSDP/ZeRO-3 (PEFT also makes the embeddings' output
        # require grad when it sees checkpointing on).
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, peft_config = with_lora(cfg, base)
    model.train()  # transformers 5 returns models in eval mode
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), f"non-LoRA trainable params: {trainable[:3]}"
    params = [p for _, p in lora_parameters(model)]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2))
    configure_backend(acc, model, max_grad_norm=cfg.max_grad_norm)
    model, optimizer = acc.prepare(model, optimizer)
    fp32_buffer_check(model)
    return Policy(model, optimizer, tokenizer, peft_config, find_scoring_head(acc.unwrap_model(model)))
