"""`asyncgrpo bench agent`: the config of each run (the agent demo's, the bench's workload, the overrides on top),
the comparison with the synchronous run, and the command line reaching `run` (the runs themselves need a vLLM
server and minutes: the bench is run by hand, its figures are in docs/benchmarks.md)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import cfg as fake_cfg

from asyncgrpo.bench import agent
from asyncgrpo.cli import main

WORLD = SimpleNamespace(model_dir=Path("/cache/agent-x/model"), train_file=Path("/cache/agent-x/train.jsonl"))


def test_each_run_is_the_demo_config_with_the_workload_its_staleness_and_its_own_directories(tmp_path):
    cfg = agent.run_config(WORLD, tmp_path, 2, "http://127.0.0.1:9", {}, "s2-pinned")
    assert cfg.environment_factory == "asyncgrpo.toy.agent_task:LookupEnv" and cfg.max_turns == 5  # the demo's
    assert (cfg.per_device_train_batch_size, cfg.sync_mode, cfg.max_steps) == (64, "versioned", 60)  # the bench's
    assert cfg.num_iterations == cfg.weight_sync_steps == agent.NUM_ITERATIONS  # one publish per generated batch
    assert cfg.max_staleness == 2 and cfg.vllm_server_base_url == "http://127.0.0.1:9"
    assert cfg.output_dir == str(tmp_path / "s2-pinned") and cfg.episode_version == "pinned"


def test_overrides_win_over_the_workload_and_extras_over_both(tmp_path):
    cfg = agent.run_config(WORLD, tmp_path, 1, "http://127.0.0.1:9", {"episode_version": "latest", "max_steps": 7},
                           "warmup", max_steps=2)
    assert cfg.episode_version == "latest" and cfg.max_steps == 2 and cfg.max_staleness == 1


def test_speedup_and_success_are_relative_to_the_synchronous_run():
    runs = agent.compare_to_sync([{"max_staleness": 0, "steps_per_s": 0.5, "heldout_success": 0.3},
                                  {"max_staleness": 1, "steps_per_s": 0.9, "heldout_success": 0.27}])
    assert [r["speedup_over_sync"] for r in runs] == [1.0, 1.8]
    assert [r["heldout_success_minus_sync"] for r in runs] == [0.0, -0.03]
    (alone,) = agent.compare_to_sync([{"max_staleness": 1, "steps_per_s": 0.9, "heldout_success": 0.27}])
    assert alone["speedup_over_sync"] is None and alone["heldout_success_minus_sync"] is None


def test_the_command_line_passes_the_grid_the_tool_latency_and_config_overrides(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(agent, "run", lambda **kwargs: calls.append(kwargs) or {"runs": []})
    assert main(["bench", "agent", "--json", "--grid", "1,2", "--tool_latency", "0.2",
                 "--episode_version", "latest"]) == 0
    assert main(["bench", "agent", "--num_iterations", "3"]) == 0
    assert main(["bench", "agent", "--compare_versions"]) == 0
    assert main(["bench", "agent", "--overhead_only"]) == 0
    assert calls == [{"server_url": None, "overrides": ["--episode_version", "latest"], "stalenesses": (1, 2),
                      "tool_latency_s": 0.2, "compare_versions": False, "overhead_only": False},
                     {"server_url": None, "overrides": [], "num_iterations": 3, "compare_versions": False,
                      "overhead_only": False},
                     {"server_url": None, "overrides": [], "compare_versions": True, "overhead_only": False},
                     {"server_url": None, "overrides": [], "compare_versions": False, "overhead_only": True}]
    assert capsys.readouterr().out.split() == ['{"runs":', '[]}'] * 4


def test_the_overhead_rows_are_chat_rows_that_an_episode_starts_from(tmp_path):
    """The overhead measurement plays the toy world's training rows: read as bare records they were plain-text rows,
    which every episode refuses (`prompt_format`), and `--overhead_only` failed before its first turn."""
    from agent_format import agent_tokenizer, lookup

    from asyncgrpo.rollout.episodes import ChatFormat, EpisodeRunner

    records = [{"prompt": [{"role": "user", "content": f"find {k}"}], "answer": str(i), "key": k, "hops": 1,
                "world_seed": 0} for i, k in enumerate(["zx", "ce", "zl"])]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    world = SimpleNamespace(model_dir=Path("toy"), train_file=train)
    tok = agent_tokenizer()
    cfg = agent.load_agent_config({**agent.agent_config(world, output_dir=str(tmp_path)), "model_name_or_path": "toy"})
    rows = agent.overhead_rows(cfg, tok, groups=2)
    assert [r.prompt for r in rows] == [records[0]["prompt"], records[1]["prompt"]]
    assert [r.columns["key"] for r in rows] == ["zx", "ce"] and all(r.is_chat for r in rows)
    runner = EpisodeRunner(ChatFormat(tok, tok.response_template, stop_ids={0}),
                           fake_cfg(num_generations=2, tools=["agent_format:lookup"]), tools=[lookup], factory=None,
                           max_model_len=None)
    episode = runner.start(rows[0])
    assert tok.decode(episode.prompt_ids).endswith("<|im_start|>user\nfind zx<|im_end|>\n<|im_start|>assistant\n")
