"""ZeRO-3 loading: the base is partitioned as it is built (zero.Init) yet keeps `torch_dtype`, and its rotary
buffers are the fp32 values a plain load computes. One rank (gloo, world size 1) in a fresh process: zero.Init needs a
process group, and this one must not leak into other tests."""

import json
import os
import subprocess
import sys

from asyncgrpo.inference_node.vllm_server import find_free_port

SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import deepspeed_config
from asyncgrpo.distributed import recompute_rotary_buffers, zero3_init_in

config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, rope_theta=1e6)
Qwen2ForCausalLM(config).save_pretrained(sys.argv[2])
plain = Qwen2ForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16).model.rotary_emb.inv_freq  # fp32
ds = json.load(open("launch/deepspeed/zero3.json"))
ds.update(bf16={"enabled": False}, train_micro_batch_size_per_gpu=1)  # accelerate with mixed_precision "no"
keep = HfDeepSpeedConfig(ds)
with zero3_init_in(torch.bfloat16):
    model = Qwen2ForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16)
out = {"params": sorted({str(p.dtype) for p in model.parameters()}),
       "partitioned": all(hasattr(p, "ds_id") for p in model.parameters()),
       "inv_freq_before": str(model.model.rotary_emb.inv_freq.dtype),
       "rebuilt": recompute_rotary_buffers(model),
       "inv_freq_equal": torch.equal(model.model.rotary_emb.inv_freq, plain),
       "config_bf16_after": deepspeed_config()["bf16"]["enabled"]}
print(json.dumps(out))
'''


def test_zero3_init_keeps_a_bf16_base_partitioned_and_rotary_buffers_fp32(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(find_free_port()), str(tmp_path)], capture_output=True,
                          text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["params"] == ["torch.bfloat16"]  # not DeepSpeed's fp32: the config copy followed torch_dtype
    assert out["partitioned"]  # built under zero.Init
    assert out["inv_freq_before"] == "torch.bfloat16"  # what zero.Init did to the rotary buffer ...
    assert out["rebuilt"] == 1 and out["inv_freq_equal"]  # ... undone: the exact fp32 values of a plain build
    assert out["config_bf16_after"] is False  # the engine's own config is back
