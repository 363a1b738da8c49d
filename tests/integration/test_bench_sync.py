"""`asyncgrpo bench sync` end to end, on the toy model and the session's two real servers (the bench's own hidden-512
model would need servers of its own): its JSON must report what the sync really did, on both servers at once. Speed
figures are not asserted here; the bench prints them."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_sync_reports_lora_only_bytes_and_no_pause_when_versioned(world, vllm_server, second_vllm_server):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "asyncgrpo", "bench", "sync", "--backend", "zero3", "--json",
           "--server", f"{vllm_server.base_url},{second_vllm_server.base_url}", "--model", str(world.model_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout)
    assert (result["backend"], result["backend_detected"], result["world_size"]) == ("zero3", "zero3", 2)
    assert result["servers"] == 2  # every sync was read back from both (the publisher fails the round otherwise)
    # Rank-8 LoRA on q/k/v/o of 2 layers (hidden 128, 2 KV heads of 32): A 8x128 each, B 128x8 (q, o) or 64x8 (k, v).
    adapter_bytes = 4 * 2 * (4 * 8 * 128 + 2 * 128 * 8 + 2 * 64 * 8)
    for mode in ("pause", "versioned"):
        figures = result["modes"][mode]
        assert figures["adapter_bytes"] == adapter_bytes
        assert figures["gathered_bytes"] == adapter_bytes  # only the adapter moved
        assert figures["naive_gathered_bytes"] > 5 * adapter_bytes  # the whole model did, on the naive path
        assert figures["naive_matches"] is True  # and both gathers agree on every LoRA tensor
        assert figures["server_sum_s"] >= figures["load_s"] > 0  # each server's activation includes its load
    assert result["modes"]["versioned"]["pause_s"] == 0.0
    assert result["modes"]["pause"]["pause_s"] > 0.0
    assert result["max_abs_logprob_diff"] < 1e-3  # the served adapter is the trained one
