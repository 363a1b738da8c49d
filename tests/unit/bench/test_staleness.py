"""`asyncgrpo bench staleness`: the cells' configs and the per-cell summary (the training runs themselves need a
server and ~40 minutes; they are not run in the unit tests)."""

import pytest

from asyncgrpo.bench.staleness import WORKLOAD, cell_overrides, summarise
from asyncgrpo.config import AsyncGRPOConfig


def test_a_cell_lets_the_producer_run_max_staleness_versions_ahead_with_its_correction():
    cfg = AsyncGRPOConfig.load(None, ["--model_name_or_path", "toy", "--lora_adapter_path", "/tmp/a", *WORKLOAD,
                                      *cell_overrides(4, "token_truncate", 2, groups_per_step=32)])
    assert (cfg.max_staleness, cfg.seed, cfg.weight_sync_steps, cfg.num_iterations) == (4, 2, 1, 1)
    assert cfg.inflight_requests(32) == 32 * 5  # five steps' worth: batches up to 4 versions ahead
    assert cfg.vllm_importance_sampling_correction and cfg.vllm_importance_sampling_mode == "token_truncate"
    plain = AsyncGRPOConfig.load(None, ["--model_name_or_path", "toy", "--lora_adapter_path", "/tmp/a",
                                        *cell_overrides(0, "none", 0, 32)])
    assert plain.vllm_importance_sampling_correction is False


def test_summary_gives_mean_spread_and_distance_to_the_synchronous_run():
    cells = [{"max_staleness": 0, "correction": "none", "seed": s, "heldout_reward": r, "staleness_mean": 0.0}
             for s, r in enumerate([0.80, 0.84, 0.82])]
    cells += [{"max_staleness": 4, "correction": "token_truncate", "seed": s, "heldout_reward": r,
               "staleness_mean": 3.5} for s, r in enumerate([0.78, 0.80])]
    sync, tis = summarise(cells)
    assert (sync["heldout_reward_mean"], sync["heldout_reward_std"], sync["minus_sync"]) == (0.82, 0.02, 0.0)
    # mean 0.79, sample std of [0.78, 0.80] = 0.014142, 0.79 - 0.82 = -0.03
    assert tis["heldout_reward_mean"] == pytest.approx(0.79) and tis["heldout_reward_std"] == pytest.approx(0.0141)
    assert tis["minus_sync"] == pytest.approx(-0.03) and tis["staleness_mean"] == 3.5
    assert (tis["heldout_reward_min"], tis["heldout_reward_max"], tis["seeds"]) == (0.78, 0.80, 2)


def test_none_is_the_loss_without_delta_and_default_the_config_defaults():
    def load(correction):
        return AsyncGRPOConfig.load(None, ["--model_name_or_path", "toy", "--lora_adapter_path", "/tmp/a", *WORKLOAD,
                                           *cell_overrides(2, correction, 0, groups_per_step=32)])

    assert load("none").delta is None and not load("none").vllm_importance_sampling_correction
    assert load("default").delta == 3.0 and not load("default").vllm_importance_sampling_correction
    tis = load("token_truncate")
    assert tis.delta == 3.0 and tis.vllm_importance_sampling_correction
