"""A step's metrics: each StepMetrics method against numbers worked out by hand, LossTotals over micro-batches, the run
summary's counters, and every name docs/metrics.md promises still written by the code."""

import re
from pathlib import Path

import pytest
import torch

from asyncgrpo.contracts import Group
from asyncgrpo.trainer.loss import LossTerms
from asyncgrpo.trainer.metrics import (ENTROPY_BINS, ENTROPY_MAX, SUMMARY_COUNTERS, LossTotals, StepMetrics,
                                      histogram_quantile, summary_counters)

ROOT = Path(__file__).resolve().parents[3]


def _group(rewards, version, lengths, finish_reasons, parts=None):
    return Group(prompt="p", prompt_ids=[1], completion_ids=[[2] * n for n in lengths],
                 behaviour_logprobs=[[-1.0] * n for n in lengths], rewards=rewards, reward_parts=parts or {},
                 advantages=[0.0] * len(rewards), version=version, adapter="a", finish_reasons=finish_reasons)


def test_batch_metrics_by_hand():
    # Two groups of 2 at trainer version 5: versions 5 and 3 (staleness 0 and 2); rewards [1, 0] and [2, 2] (the
    # second all equal); completion lengths 3, 1, 4, 4 (mean 3); one of four hit the length limit.
    groups = [_group([1.0, 0.0], 5, [3, 1], ["stop", "length"], {"fmt": [1.0, None]}),
              _group([2.0, 2.0], 3, [4, 4], ["stop", "stop"], {"fmt": [0.0, 1.0], "never": [None, None]})]
    metrics = StepMetrics()
    metrics.batch(groups, version=5, num_generations=2, waited_s=1.5)
    v = metrics.values
    assert v["train/reward"] == 1.25
    assert v["train/reward_std"] == pytest.approx(torch.tensor([1.0, 0, 2, 2]).std().item())
    assert (v["staleness/mean"], v["staleness/max"], v["time/wait_for_data_s"]) == (1.0, 2.0, 1.5)
    assert v["train/frac_reward_zero_std"] == 0.5
    assert (v["train/completions/mean_length"], v["train/completions/clipped_ratio"]) == (3.0, 0.25)
    assert (v["train/completions/min_length"], v["train/completions/max_length"]) == (1.0, 4.0)
    assert v["train/rewards/fmt/mean"] == pytest.approx(2 / 3)  # over the three completions it applied to
    assert "train/rewards/never/mean" not in v  # a function that applied to nothing is not logged
    assert all(type(x) is float for x in v.values())


def _terms(loss, clipped, kl, ratio, max_abs, is_ratio=0.0, is_max=0.0, capped=0.0, kl_b=0.0):
    t = torch.tensor
    return LossTerms(loss=t(loss, requires_grad=True), n_tokens=t(0.0), clipped_tokens=t(clipped), kl_sum=t(kl),
                     ratio_sum=t(ratio), max_abs_log_ratio=t(max_abs), is_ratio_sum=t(is_ratio),
                     is_ratio_max=t(is_max), is_capped_tokens=t(capped), behaviour_kl_sum=t(kl_b))


def test_loss_totals_sum_and_max_over_micro_batches_and_divide_the_loss_by_the_ranks():
    totals = LossTotals(world=2)
    totals.add(_terms(1.0, 2.0, 0.5, 3.0, 0.1, is_ratio=4.0, is_max=1.5, capped=1.0, kl_b=0.25))
    totals.add(_terms(3.0, 1.0, 0.25, 2.0, 0.3, is_ratio=1.0, is_max=1.2, capped=0.0, kl_b=0.5))
    sums, maxima, entropy_hist = totals.reduced()  # one process: the reduction over ranks is the identity
    assert sums == {"loss": 2.0, "clipped": 3.0, "kl": 0.75, "ratio": 5.0, "is_ratio": 5.0, "is_capped": 1.0,
                    "kl_behaviour": 0.75, "masked": 0.0, "entropy": 0.0}
    assert entropy_hist == [0.0] * ENTROPY_BINS  # no entropy computed: nothing counted
    assert maxima == {"max_abs_log_ratio": pytest.approx(0.3), "is_ratio_max": pytest.approx(1.5)}


def test_optimiser_metrics_are_per_token_of_the_global_batch():
    metrics = StepMetrics()
    sums = {"loss": -0.5, "clipped": 2.0, "kl": 1.0, "ratio": 8.0, "is_ratio": 6.0, "is_capped": 1.0,
            "kl_behaviour": 0.4}
    metrics.optimiser(sums, {"max_abs_log_ratio": 0.2, "is_ratio_max": 3.0}, n_tokens=8.0, lr=1e-5)
    v = metrics.values
    assert (v["train/loss"], v["train/clip_ratio/region_mean"], v["train/kl"], v["train/ratio_mean"]) == \
        (-0.5, 0.25, 0.125, 1.0)
    assert (v["train/tokens"], v["train/learning_rate"], v["train/max_abs_log_ratio"]) == (8.0, 1e-5, 0.2)
    assert v["train/sampling/importance_sampling_ratio/mean"] == 0.75
    assert v["train/sampling/importance_sampling_ratio/max"] == 3.0
    assert (v["train/sampling/is_capped_fraction"], v["train/sampling/kl_behaviour"]) == (0.125, 0.05)
    empty = StepMetrics()  # every token masked: statistics of nothing are 0, not a division by zero
    empty.optimiser(dict.fromkeys(sums, 0.0), {"max_abs_log_ratio": 0.0, "is_ratio_max": 0.0}, n_tokens=0.0, lr=0.1)
    assert empty.values["train/clip_ratio/region_mean"] == 0.0 and empty.values["train/tokens"] == 0.0


def test_sync_rollout_micro_batch_and_grad_norm_metrics_keep_their_names():
    metrics = StepMetrics()
    metrics.micro_batches(3)
    metrics.grad_norm(0.5)
    metrics.sync(0.1, 0.2, 4096)
    metrics.rollout({"queue/depth": 7}, version=4)
    assert metrics.values == {"train/micro_batches": 3.0, "train/grad_norm": 0.5, "sync/gather_s": 0.1,
                              "sync/wait_previous_publish_s": 0.2, "sync/gathered_bytes": 4096.0,
                              "queue/depth": 7.0, "policy/version": 4.0}


def test_log_hands_every_value_to_the_logger_at_the_step():
    seen = []
    metrics = StepMetrics()
    metrics.micro_batches(2)
    metrics.log(type("Logger", (), {"log": lambda self, values, step: seen.append((values, step))})(), 9)
    assert seen == [({"train/micro_batches": 2.0}, 9)]


def test_the_run_summary_reads_its_four_counters():
    counters = {"queue/dropped_stale_total": 1, "queue/dropped_zero_std_total": 2, "rollout/lost_groups_total": 3,
                "rollout/resent_groups_total": 4, "queue/depth": 9}
    assert summary_counters(counters) == {"dropped_stale": 1, "dropped_zero_std": 2, "lost_groups": 3,
                                          "resent_groups": 4}
    assert set(SUMMARY_COUNTERS) == {"dropped_stale", "dropped_zero_std", "lost_groups", "resent_groups"}


def test_every_name_docs_metrics_promises_is_written_somewhere_in_the_code():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    names = set(re.findall(r"`([a-z_]+/[a-z_/]+)`", doc)) | {"train/sampling/importance_sampling_ratio/max"}  # "/max"
    names -= {"train/rewards/", "eval/rewards/"}  # per function: `train/rewards/<name>/mean`, checked below
    assert "train/rewards/{name}/mean" in (ROOT / "src" / "asyncgrpo" / "trainer" / "metrics.py").read_text()
    assert {"train/loss", "policy/version", "sync/write_s"} <= names  # the pattern finds the names
    code = "\n".join(p.read_text() for p in (ROOT / "src" / "asyncgrpo").rglob("*.py"))
    missing = sorted(n for n in names if f'"{n}"' not in code)
    assert not missing, f"docs/metrics.md names no code writes: {missing}"


def test_entropy_is_summed_and_binned_over_micro_batches_and_logged_as_mean_and_quantiles():
    totals = LossTotals(world=1)
    for values in ([0.5, 1.5], [2.5, 3.5, 4.5]):
        terms = _terms(0.0, 0.0, 0.0, 0.0, 0.0)
        terms.entropy, terms.masked_tokens = torch.tensor(values), torch.tensor(1.0)
        totals.add(terms)
    sums, maxima, hist = totals.reduced()
    assert sums["entropy"] == 12.5 and sums["masked"] == 2.0 and sum(hist) == 5.0
    width = ENTROPY_MAX / ENTROPY_BINS
    assert hist[int(0.5 / width)] == 1.0 and hist[int(4.5 / width)] == 1.0
    metrics = StepMetrics()
    metrics.optimiser(sums, maxima, n_tokens=5.0, lr=0.1, entropy_hist=hist)
    v = metrics.values
    assert v["train/entropy"] == 2.5 and v["train/masked_fraction"] == 0.4
    # the median of 0.5..4.5 is 2.5, read from the histogram within one bin
    assert abs(v["train/entropy_p50"] - 2.5) <= width and v["train/entropy_p10"] < v["train/entropy_p90"]


def test_a_histogram_quantile_interpolates_within_its_bin_and_is_0_when_empty():
    assert histogram_quantile([0.0, 4.0, 0.0, 0.0], 0.5, top=4.0) == 1.5  # half of bin [1, 2)
    assert histogram_quantile([2.0, 0.0, 0.0, 2.0], 0.9, top=4.0) == pytest.approx(3.8)
    assert histogram_quantile([0.0] * 4, 0.5) == 0.0


def test_a_batch_of_episodes_reports_turns_tokens_truncation_and_token_staleness():
    from asyncgrpo.contracts import Group
    from asyncgrpo.trainer.metrics import StepMetrics, turns

    assert turns([0, 1, 1, 0, 0, 1, 0, 1]) == 3 and turns([]) == 0
    g = Group(prompt="p", prompt_ids=[1], completion_ids=[[1, 2, 3, 4], [5, 6]], behaviour_logprobs=[[0.0] * 4, [0.0] * 2],
              rewards=[0.0, 1.0], reward_parts={}, advantages=[0.0, 0.0], version=2, adapter="a",
              finish_reasons=["stop", "length"], loss_mask=[[1, 0, 0, 1], [1, 1]], versions=[[2] * 4, [2, 2]])
    metrics = StepMetrics()
    metrics.batch([g], version=4, num_generations=2, waited_s=0.0)
    v = metrics.values
    assert (v["episode/turns_mean"], v["episode/tokens_mean"], v["episode/sampled_tokens_mean"]) == (1.5, 3.0, 2.0)
    assert v["episode/truncated_fraction"] == 0.5 and v["episode/token_staleness_max"] == 2.0


def test_adding_micro_batches_reads_nothing_back_to_the_host_until_the_step_is_reduced(monkeypatch):
    # On a GPU each read of a device tensor by the host waits for all the work queued before it: the totals add up
    # on the device, and `reduced` reads them once per step.
    def read(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host")

    terms = _terms(1.0, 2.0, 0.5, 3.0, 0.1, is_ratio=4.0, is_max=1.5, capped=1.0, kl_b=0.25)
    terms.entropy, terms.masked_tokens = torch.tensor([0.5, 1.5]), torch.tensor(1.0)
    totals = LossTotals(world=2)
    with monkeypatch.context() as patched:
        for name in ("__float__", "__int__", "__bool__", "item", "tolist", "cpu", "numpy"):
            patched.setattr(torch.Tensor, name, read)
        totals.add(terms)
        totals.add(terms)
    sums, maxima, hist = totals.reduced()
    assert (sums["loss"], sums["clipped"], sums["entropy"], sums["masked"], sum(hist)) == (1.0, 4.0, 4.0, 2.0, 4.0)
    assert maxima == {"max_abs_log_ratio": pytest.approx(0.1), "is_ratio_max": pytest.approx(1.5)}


def test_a_rank_without_micro_batches_reduces_zeros():
    sums, maxima, hist = LossTotals(world=2).reduced()
    assert set(sums.values()) == {0.0} and set(maxima.values()) == {0.0} and hist == [0.0] * ENTROPY_BINS
