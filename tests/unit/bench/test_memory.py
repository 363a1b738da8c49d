"""`asyncgrpo bench memory --json` at a small size: the command runs both variants in their own processes and prints
the figures docs/memory.md reports."""

import json
import subprocess
import sys


def test_memory_bench_prints_both_peaks_and_the_chunked_path_scores_like_the_naive_one():
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo", "bench", "memory", "--json", "--vocab_size", "32000",
                           "--completion_tokens", "256"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert {"naive_peak_bytes", "chunked_peak_bytes", "vocab_size", "completion_tokens",
            "max_abs_logprob_diff"} <= result.keys()
    assert (result["vocab_size"], result["completion_tokens"]) == (32000, 256)
    assert result["max_abs_logprob_diff"] < 1e-4  # the same tokens, weights and temperature on both paths
    # 288 positions x 32k vocabulary: each naive (B, T, V) fp32 buffer is 37 MB, and the naive step holds several.
    assert result["naive_peak_bytes"] > 100e6
    assert result["chunked_peak_bytes"] < result["naive_peak_bytes"] / 2
