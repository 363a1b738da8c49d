"""bench/modes.py: the rollout modes `bench throughput` and `bench agent` compare, and the figures each run adds to
their JSON (computed here from recorded counts and timelines; the runs themselves need a vLLM server and minutes)."""

from types import SimpleNamespace

import pytest

from asyncgrpo.bench import modes
from asyncgrpo.bench.throughput import rollout_figures, run_summary
from asyncgrpo.cli import main
from asyncgrpo.rollout.inflight import InflightStats


def test_each_mode_sets_its_keys_and_episodes_moved_mid_turn_start_each_turn_on_the_newest_version():
    assert modes.mode_settings("batch", episodes=False) == {"rollout_mode": "batch", "inflight_weight_updates": False}
    assert modes.mode_settings("stream", episodes=True) == {"rollout_mode": "stream", "inflight_weight_updates": False}
    assert modes.mode_settings("stream+inflight", episodes=False) == {"rollout_mode": "stream",
                                                                      "inflight_weight_updates": True}
    assert modes.mode_settings("stream+inflight", episodes=True) == {
        "rollout_mode": "stream", "inflight_weight_updates": True, "episode_version": "latest"}
    assert modes.parse_modes("stream+inflight, batch") == ("stream+inflight", "batch")
    with pytest.raises(ValueError, match="'pipeline'.*choose from batch, stream, stream\\+inflight"):
        modes.parse_modes("batch,pipeline")


def test_the_default_mode_reported_is_the_configs_default():
    assert modes.default_rollout_mode() == "batch"


def test_wasted_and_resampled_fractions_are_shares_of_the_tokens_generated():
    # 1000 tokens reached the queue; 30 of them in groups dropped as too old, 250 sampled after a move
    assert modes.generation_figures(generated_tokens=1000, dropped_stale_tokens=30, tokens_moved=250) == {
        "generated_tokens_wasted_fraction": 0.03, "tokens_resampled_fraction": 0.25}
    assert modes.generation_figures(generated_tokens=0, dropped_stale_tokens=0, tokens_moved=0) == {
        "generated_tokens_wasted_fraction": 0.0, "tokens_resampled_fraction": 0.0}


def test_a_runs_figures_are_read_from_its_queue_and_producer():
    stats = InflightStats(tokens_moved=40)
    parts = SimpleNamespace(producer=SimpleNamespace(generated_tokens=800, inflight_stats=stats),
                            queue=SimpleNamespace(dropped_stale=3, dropped_stale_tokens=120))
    assert rollout_figures(parts) == {"groups_dropped_stale": 3, "generated_tokens_wasted_fraction": 0.15,
                                      "tokens_resampled_fraction": 0.05}


def test_idle_fractions_come_from_the_recorded_timelines_of_one_run():
    # 10 s run: the trainer waited 2 s + 1 s (an overlap counted once); the server had requests in flight 6 s.
    s = run_summary(staleness=1, steps=5, t0=100.0, t1=110.0, waits=[(100.0, 102.0), (101.5, 102.0), (108.0, 109.0)],
                    busy=[(100.0, 104.0), (106.0, 108.0)], history=[], generated_tokens=0)
    assert (s["trainer_idle_fraction"], s["inference_idle_fraction"], s["steps_per_s"]) == (0.3, 0.4, 0.5)


def test_speedup_is_over_the_batch_run_at_staleness_0_even_when_another_mode_ran_first():
    runs = [{"rollout_mode": "stream", "max_staleness": 0, "steps_per_s": 0.6, "heldout_reward": 0.5},
            {"rollout_mode": "batch", "max_staleness": 0, "steps_per_s": 0.5, "heldout_reward": 0.6},
            {"rollout_mode": "stream", "max_staleness": 1, "steps_per_s": 1.0, "heldout_reward": 0.58}]
    out = modes.compare_to_sync(runs, "heldout_reward")
    assert [r["speedup_over_sync"] for r in out] == [1.2, 1.0, 2.0]
    assert [r["heldout_reward_minus_sync"] for r in out] == [-0.1, 0.0, -0.02]


def test_the_command_line_passes_modes_and_staleness_to_both_benches(monkeypatch, capsys):
    from asyncgrpo.bench import agent, throughput

    calls = []
    monkeypatch.setattr(agent, "run", lambda **kwargs: calls.append(("agent", kwargs)) or {"runs": []})
    monkeypatch.setattr(throughput, "run", lambda **kwargs: calls.append(("throughput", kwargs)) or {"runs": []})
    assert main(["bench", "agent", "--modes", "batch,stream+inflight", "--staleness", "0,1"]) == 0
    assert main(["bench", "throughput", "--modes", "stream", "--staleness", "1"]) == 0
    assert calls == [("agent", {"server_url": None, "overrides": [], "compare_versions": False, "overhead_only": False,
                                "stalenesses": (0, 1), "modes": ("batch", "stream+inflight")}),
                     ("throughput", {"server_url": None, "overrides": [], "plot": None, "stalenesses": (1,),
                                     "modes": ("stream",)})]
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--modes", "async"])
    assert "choose from batch, stream, stream+inflight" in capsys.readouterr().err
