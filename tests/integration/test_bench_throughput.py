"""`asyncgrpo bench throughput` end to end on the session's real server, shortened to 6 steps per run: the JSON and
the timelines must describe what the runs did. Speed figures are not asserted here; the bench prints them."""

import json

from asyncgrpo.bench.throughput import run


def test_bench_throughput_reports_each_staleness_and_consistent_timelines(vllm_server, tmp_path):
    result = run(vllm_server.base_url, ["--max_steps", "6"], workdir=str(tmp_path), plot=str(tmp_path / "t.png"))
    assert result["config"]["--num_iterations"] == "3" and "nothing pinned" in result["cores"]["note"]
    runs = result["runs"]
    assert [r["max_staleness"] for r in runs] == [0, 1, 2] and all(r["steps"] == 6 for r in runs)
    assert runs[0]["staleness_mean"] == 0.0 and runs[0]["staleness_max"] == 0  # synchronous: on-policy only
    for r in runs:
        assert r["staleness_max"] <= r["max_staleness"] and r["groups_dropped_stale"] == 0
        assert r["speedup_over_sync"] == round(r["steps_per_s"] / runs[0]["steps_per_s"], 3)
        assert 0.0 <= r["trainer_idle_fraction"] <= 1.0 and 0.0 <= r["inference_idle_fraction"] <= 1.0
        assert 0.0 <= r["heldout_reward"] <= 1.0 and r["generated_tokens_per_s"] > 0
    assert runs[0]["trainer_idle_fraction"] > 0.0  # a synchronous trainer waits for every batch
    records = json.loads((tmp_path / "timelines.json").read_text())
    assert [r["max_staleness"] for r in records] == [0, 1, 2]
    for rec, summary in zip(records, runs):
        for busy, idle in (("trainer_busy", "trainer_idle"), ("server_busy", "server_idle")):
            spans = sorted(rec[busy] + rec[idle])
            assert all(0.0 <= s <= e <= rec["wall_s"] for s, e in spans)
            covered = sum(e - s for s, e in spans)
            assert abs(covered - rec["wall_s"]) < 1e-3  # busy and idle tile the run
        idle_s = sum(e - s for s, e in rec["trainer_idle"])
        assert abs(idle_s / rec["wall_s"] - summary["trainer_idle_fraction"]) < 1e-3
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
