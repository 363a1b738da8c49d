"""The training recipe. `train()` reads like the data path in DESIGN.md:

    every `num_iterations` steps: take a batch from the rollout queue (rank 0) -> split it over ranks by tokens
    -> GRPO loss, backward, step (all ranks)
    -> every `weight_sync_steps`: gather the LoRA tensors (all ranks) -> write + activate (rank 0) -> barrier
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncgrpo.trainer.checkpoint import (TrainerState, check_backend, clean_partial, load_checkpoint, resolve_checkpoint,
                         restore_rng, save_checkpoint)
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.distributed import (accumulation, broadcast_object, dist_max, dist_sum, make_accelerator, on_main,
                          require_shared_dir, setup_logging)
from asyncgrpo.inference.recovery import check_outage_fits_ddp_timeout
from asyncgrpo.trainer.logprobs import sequence_logprobs
from asyncgrpo.trainer.loss import grpo_loss, loss_normaliser
from asyncgrpo.rewards import reward_means
from asyncgrpo.contracts import Group
from asyncgrpo.trainer.batching import collate, pack_by_tokens, score_completions, split_by_tokens, to_device
from asyncgrpo.rollout.build import open_rollout_side
from asyncgrpo.rollout.interface import RolloutInterface
from asyncgrpo.trainer.policy import build_policy
from asyncgrpo.trainer.schedule import build_lr_scheduler
from asyncgrpo.trainer.gather import backend_of, gather_lora_state
from asyncgrpo.timeline import Timeline, span

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one optimizer step measured; rank 0 writes it to TensorBoard."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, **kw: float) -> None:
        self.values.update({k: float(v) for k, v in kw.items()})


@dataclass
class TrainBatch:
    """One generated batch as the trainer holds it for its `num_iterations` steps: the groups (rank 0 only, for
    logging) and this rank's share, collated into micro-batches once."""

    groups: list[Group]
    micro_batches: list[dict[str, torch.Tensor]]


class AsyncGRPOTrainer:
    """One run: `setup()`, `train()`, `cleanup()`. Rank 0 also holds the rollout side (`self.rollout`: servers,
    producer, queue, publisher; rollout/side.py), None on the other ranks."""

    def __init__(self, cfg: AsyncGRPOConfig):
        self.cfg = cfg
        self.version = 0  # policy version the server serves (and the trainer's weights at the last sync)
        self.step = 0
        self.data_position = 0  # rank 0: the data stream position after the last prompt trained on
        self.resumed_from: Path | None = None  # the checkpoint this run continues, if any
        self.previous_run_id: str | None = None  # the run id that checkpoint was written by
        self.rollout: RolloutInterface | None = None  # rank 0, once set up (rollout_process: a proxy)
        self.wait_timeline = Timeline()  # rank 0: intervals spent waiting on the rollout queue
        self._batch: TrainBatch | None = None  # the batch being trained on (num_iterations steps)
        self.finished = False  # train() ran to max_steps (cleanup then keeps the final adapter loaded)

    # ---- setup ----------------------------------------------------------------------------------------
    def setup(self) -> None:
        self.setup_model()
        if self.cfg.save_steps or self.cfg.resume_from_checkpoint:
            require_shared_dir(self.cfg.output_dir, "output_dir")  # every node writes and reads checkpoints there
        self._resume()  # before rank 0's setup: the producer starts at the checkpoint's data position
        # Rank 0 alone talks to the servers and reads the data; if that fails, every rank stops at once with its
        # message (`on_main`) instead of waiting `ddp_timeout` in the next collective.
        on_main(self._start_rollout, "start-up (doctor checks, data, reward functions)")
        # Version 0 is the untrained adapter (LoRA B = 0: the base policy), or when resuming the checkpoint's
        # version: it is published to every server before the producer sends its first request.
        self.sync(first=True)
        self.start_step = self.step
        if self.resumed_from is not None:
            restore_rng(self.resumed_from, self.rank)  # last: nothing after it draws numbers before training

    def setup_model(self) -> None:
        """Collective: the process group, then the model with its LoRA adapter and optimizer, prepared for the
        backend the launcher chose."""
        cfg = self.cfg
        if cfg.torch_num_threads:
            torch.set_num_threads(cfg.torch_num_threads)
        # The process group first: everything after may need collectives.
        self.acc = make_accelerator(cfg.ddp_timeout, cfg.deepspeed)
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        check_outage_fits_ddp_timeout(cfg, self.world)  # every rank: a server outage must not time out the others
        self.main = self.acc.is_main_process
        setup_logging(self.rank)
        self.groups_per_step = cfg.groups_per_step(self.world)
        # Rank 0 resolves (and, for the toy, builds) the model first; the others then find it cached.
        self.model_path = on_main(self._resolve_model, "resolving the model")
        if not self.main:
            self.model_path = self._resolve_model()
        self.model, self.optimizer, self.tokenizer, self.peft_config, self.scoring_head = build_policy(
            cfg, self.acc, self.model_path)  # the LoRA-wrapped model and its optimizer, prepared (policy.py)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # Stepped by `_optimise` once per optimizer step, on every backend (schedule.py says why not via accelerate).
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)

    def _resolve_model(self) -> str:
        from asyncgrpo.data import resolve_model_path

        return resolve_model_path(self.cfg)

    def _start_rollout(self) -> None:
        """Rank 0: the output directory, then the rollout side (servers checked, prompts loaded, producer started)."""
        out = Path(self.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        clean_partial(out)  # what a save killed midway left behind
        self.cfg.save(out / "config.yaml")
        self.rollout = open_rollout_side(self.cfg, tokenizer=self.tokenizer, model_path=self.model_path,
                                          peft_config=self.peft_config, groups_per_step=self.groups_per_step,
                                          step=self.step, data_position=self.data_position,
                                          previous_run_id=self.previous_run_id)  # rollout_process: a child's
        self.rollout.start()

    # ---- the loop -------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg
        bar = self._progress_bar()
        started = time.perf_counter()
        while self.step < cfg.max_steps:
            stats = self.train_step()
            if self.step % cfg.weight_sync_steps == 0:
                self.sync(stats)
            if self.main:
                self._log(stats, bar)
            if self._should_save():
                self.save_checkpoint()
        if self.main:
            bar.close()
            self.rollout.wait_published()  # the run ends when its last version is served
        return self._finish(time.perf_counter() - started)

    def train_step(self) -> StepStats:
        """Collective: one optimizer step (no weight sync) on the next batch from the queue, or, for the
        `num_iterations` - 1 steps after it, on that same batch again."""
        stats = StepStats()
        if self._batch is None or self.step % self.cfg.num_iterations == 0:
            self._batch = self._next_batch(stats)  # rank 0 waits on the queue; all ranks get their share
        elif self.main:
            self._batch_stats(self._batch.groups, stats, waited_s=0.0)
        self._optimise(self._batch.micro_batches, stats)
        self.step += 1
        return stats

    def _next_batch(self, stats: StepStats) -> TrainBatch:
        """Collective: rank 0 takes one global batch of groups and sends each rank its share (equal numbers of
        groups, about equal numbers of tokens); every rank collates its share into micro-batches once."""
        def take() -> list[Group]:
            t0 = time.perf_counter()
            with span(self.wait_timeline):  # the trainer's idle time, for `asyncgrpo bench throughput`
                groups = self.rollout.take(self.groups_per_step, self.version,
                                           timeout_s=self.cfg.vllm_request_timeout * 4 + self.cfg.vllm_server_timeout)
            assert max(self.version - g.version for g in groups) <= self.cfg.max_staleness
            self._batch_stats(groups, stats, waited_s=time.perf_counter() - t0)
            self.data_position = max(self.data_position, 1 + max(g.index for g in groups))
            return groups

        groups = on_main(take, "taking a batch from the rollout queue") or []
        share = broadcast_object(split_by_tokens(groups, self.world) if self.main else None)[self.rank]
        micro_batches = self._micro_batches(share)
        stats.add(**{"train/micro_batches": len(micro_batches)})  # the same on every rank
        return TrainBatch(groups, micro_batches)

    def _micro_batches(self, share: list[Group]) -> list[dict[str, torch.Tensor]]:
        """Collective (with a token budget): this rank's groups collated into micro-batches, each moved to this
        rank's device once and kept there for the batch's num_iterations steps. Without a budget,
        `per_device_train_batch_size` completions (whole groups) each; with `max_tokens_per_microbatch`, completions
        sorted by length and packed within the budget, and as many micro-batches on every rank as on the rank that
        needs most (FSDP and ZeRO run collectives inside each forward, so the counts must match)."""
        budget = self.cfg.max_tokens_per_microbatch
        if not budget:
            per_micro = self.cfg.per_device_train_batch_size // self.cfg.num_generations
            parts = [share[i:i + per_micro] for i in range(0, len(share), per_micro)]
        else:
            singles = [g.completion(j) for g in share for j in range(len(g.completion_ids))]
            lengths = [len(s.prompt_ids) + len(s.completion_ids[0]) for s in singles]
            packed = pack_by_tokens(lengths, budget)
            packed = pack_by_tokens(lengths, budget, count=int(dist_max(len(packed))))
            parts = [[singles[i] for i in sorted(b)] for b in packed]
        return [to_device(collate(part, self.pad_id), self.acc.device) for part in parts]

    def _batch_stats(self, groups: list[Group], stats: StepStats, waited_s: float) -> None:
        """Rank 0: what this step's batch holds (rewards, staleness against the trainer's version now)."""
        staleness = [self.version - g.version for g in groups]
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        stats.add(**{"time/wait_for_data_s": waited_s, "reward/mean": rewards.mean(), "reward/std": rewards.std(),
                     "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
                     # TRL's name: groups of this batch whose rewards are all equal (0 with dynamic_sampling)
                     "reward/frac_reward_zero_std": sum(max(g.rewards) == min(g.rewards) for g in groups) / len(groups),
                     "completion/mean_length": sum(g.n_completion_tokens for g in groups)
                     / (len(groups) * self.cfg.num_generations),
                     # hit max_completion_length (left out of the loss with mask_truncated_completions)
                     "completion/truncated_fraction": sum(r == "length" for g in groups for r in g.finish_reasons)
                     / (len(groups) * self.cfg.num_generations)})
        for name, mean in reward_means([g.reward_parts for g in groups]).items():
            if mean is not None:  # None: the function applied to no completion of this batch
                stats.add(**{f"reward/{name}": mean})

    def policy_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token logprobs (B, T-1) of the sequences in `batch` under the trainer's model, in fp32, zero where
        `mask` is 0. The LM head runs on the completion positions only, in chunks (logprobs.py): no (B, T, V) tensor."""
        return sequence_logprobs(self.model, self.scoring_head, batch["input_ids"], batch["attention_mask"],
                                 batch["mask"], self.cfg.temperature)

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """The trainer's own fp32 logprob of every completion token (for policy-equivalence checks)."""
        return score_completions(self.policy_logprobs, prompt_ids, completion_ids, self.pad_id, self.acc.device)

    def _optimise(self, micro_batches: list[dict[str, torch.Tensor]], stats: StepStats) -> None:
        """Collective: GRPO loss over this rank's micro-batches, backward, clip, optimizer step, schedule step."""
        cfg = self.cfg
        n_tokens = dist_sum(sum(float(b["mask"].sum()) for b in micro_batches))
        # grpo and dr_grpo average over sequences: count them over every rank the same collective way.
        n_seqs = 0.0
        if cfg.loss_type in ("grpo", "dr_grpo"):
            n_seqs = dist_sum(float(sum(b["mask"].shape[0] for b in micro_batches)))
        totals = dict.fromkeys(("loss", "clipped", "kl", "ratio", "is_ratio", "is_capped", "kl_behaviour"), 0.0)
        maxima = {"max_abs_log_ratio": 0.0, "is_ratio_max": 0.0}
        for i, batch in enumerate(micro_batches):
            # The loss is the loss_type's mean over the global batch; DDP averages gradients over ranks, so the
            # normaliser is per rank (loss_normaliser).
            normaliser = loss_normaliser(cfg.loss_type, global_tokens=n_tokens, global_sequences=n_seqs,
                                         micro_tokens=float(batch["mask"].sum()), micro_batches=len(micro_batches),
                                         world=self.world, max_completion_length=cfg.max_completion_length)
            # Gradients accumulate over the micro-batches; the last one's backward reduces them across ranks (and,
            # under DeepSpeed, is where the engine steps): one optimizer step per trainer step on every backend.
            with accumulation(self.acc, self.model, accumulate=i < len(micro_batches) - 1):
                terms = self._micro_step(batch, normaliser)
            for key, value in (("loss", float(terms.loss.detach()) / self.world), ("clipped", terms.clipped_tokens),
                               ("kl", terms.kl_sum), ("ratio", terms.ratio_sum), ("is_ratio", terms.is_ratio_sum),
                               ("is_capped", terms.is_capped_tokens), ("kl_behaviour", terms.behaviour_kl_sum)):
                totals[key] += float(value)
            maxima["max_abs_log_ratio"] = max(maxima["max_abs_log_ratio"], float(terms.max_abs_log_ratio))
            maxima["is_ratio_max"] = max(maxima["is_ratio_max"], float(terms.is_ratio_max))
        if cfg.max_grad_norm > 0:
            grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            if grad_norm is not None:  # DeepSpeed clipped inside its engine (gradient_clipping = max_grad_norm)
                stats.add(**{"train/grad_norm": float(grad_norm)})
        lr = self.lr_scheduler.get_last_lr()[0]  # the rate this step used
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        summed = {k: dist_sum(v) for k, v in totals.items()}
        per_token = max(n_tokens, 1.0)  # every token masked (e.g. all truncated): statistics of nothing are 0
        stats.add(**{"train/loss": summed["loss"], "train/clip_fraction": summed["clipped"] / per_token,
                     "train/kl": summed["kl"] / per_token, "train/ratio_mean": summed["ratio"] / per_token,
                     "train/tokens": n_tokens, "train/learning_rate": lr,
                     # Per token, trainer vs the server's behaviour logprobs: numerical noise when on-policy.
                     "train/max_abs_log_ratio": dist_max(maxima["max_abs_log_ratio"]),
                     # Off-policy: the IS ratio proximal (or current) / behaviour before any cap, the fraction of
                     # tokens the correction truncated or masked, and the k3 estimate of KL(behaviour || trainer).
                     "sampling/importance_sampling_ratio/mean": summed["is_ratio"] / per_token,
                     "sampling/importance_sampling_ratio/max": dist_max(maxima["is_ratio_max"]),
                     "sampling/is_capped_fraction": summed["is_capped"] / per_token,
                     "sampling/kl_behaviour": summed["kl_behaviour"] / per_token})

    def _micro_step(self, batch, normaliser: float):
        cfg = self.cfg
        ref = batch.get("ref")
        if cfg.beta > 0 and ref is None:
            # The reference is the same (possibly sharded) model with the adapter switched off: no second copy. It
            # never changes, so a batch trained on again (num_iterations) keeps it.
            with torch.no_grad(), self.acc.unwrap_model(self.model).disable_adapter():
                ref = batch["ref"] = self.policy_logprobs(batch)
        logprobs = self.policy_logprobs(batch)
        proximal = None
        if cfg.vllm_importance_sampling_correction:
            # Decoupled PPO: the proximal policy is the trainer when it starts on this batch (PPO's "old" policy,
            # TRL's old logprobs). On the first pass that is this very forward, so its logprobs, detached, are kept
            # for the batch's later passes: no extra forward. Recomputing it every pass would make the ratio 1 at
            # every step and drop the trust region.
            proximal = batch.get("proximal")
            if proximal is None:
                proximal = batch["proximal"] = logprobs.detach()
        terms = grpo_loss(logprobs, batch["behaviour"], batch["advantages"], batch["mask"],
                          epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_upper, normaliser=normaliser,
                          beta=cfg.beta, ref_logprobs=ref, loss_type=cfg.loss_type,
                          importance_sampling_level=cfg.importance_sampling_level, delta=cfg.delta,
                          proximal_logprobs=proximal,
                          is_mode=cfg.vllm_importance_sampling_mode if proximal is not None else None,
                          is_cap=cfg.vllm_importance_sampling_cap)
        self.acc.backward(terms.loss)
        return terms

    # ---- weight sync ----------------------------------------------------------------------------------
    def sync(self, stats: StepStats | None = None, first: bool = False, wait: bool = False) -> None:
        """Collective: every rank joins the LoRA-only gather; rank 0 hands the tensors to the rollout side, which
        writes and activates them on every server in the background, overlapping the next training step. The next
        sync first waits for this one, so versions go live in order and a failed publish stops the run there.
        `wait=True` (and the first sync) return only once the server serves the new version."""
        t0 = time.perf_counter()
        gather_stats: dict = {}
        tensors = gather_lora_state(self.acc, self.model, gather_stats)
        gathered = time.perf_counter()
        version = self.version if first else self.version + 1

        def publish() -> None:
            waited = self.rollout.publish(version, tensors, self.step, wait=first or wait)
            if stats is not None:
                stats.add(**{"sync/gather_s": gathered - t0, "sync/wait_previous_publish_s": waited,
                             "sync/gathered_bytes": gather_stats["gathered_bytes"]})

        on_main(publish, f"publishing policy version {version}")  # the other ranks wait here (a failure stops all)
        self.version = version

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Collective: write `<output_dir>/checkpoint-<step>` atomically (checkpoint.py)."""
        state = TrainerState(step=self.step, version=self.version, data_position=self.data_position,
                             run_id=self.rollout.run_id if self.rollout is not None else "", backend=backend_of(self.acc), world_size=self.world)
        save_checkpoint(self.acc, self.model, self.optimizer, state, output_dir=self.cfg.output_dir,
                        peft_config=self.peft_config, base_model=str(Path(self.model_path).resolve()),
                        total_limit=self.cfg.save_total_limit, lr_scheduler=self.lr_scheduler)

    def _should_save(self) -> bool:
        """Every `save_steps`, and (as TRL does) at the last step, if that step published its weights and finished its
        batch's `num_iterations` passes."""
        every, step = self.cfg.save_steps, self.step
        return bool(every) and (step % every == 0 or (step == self.cfg.max_steps
                                                      and step % self.cfg.weight_sync_steps == 0
                                                      and step % self.cfg.num_iterations == 0))

    def _resume(self) -> None:
        """Every rank: refuse a backend checkpoints do not support; when resuming, load the checkpoint
        `resume_from_checkpoint` names into the model and the optimizer, and continue its step, policy version and
        data position (output_dir is shared, so every rank finds the same checkpoint)."""
        if self.cfg.save_steps or self.cfg.resume_from_checkpoint:
            check_backend(backend_of(self.acc))
        if not self.cfg.resume_from_checkpoint:
            return
        path = resolve_checkpoint(self.cfg.resume_from_checkpoint, self.cfg.output_dir)
        state = load_checkpoint(path, self.acc, self.model, self.optimizer, lr_scheduler=self.lr_scheduler)
        self.step, self.version, self.data_position = state.step, state.version, state.data_position
        self.resumed_from, self.previous_run_id = path, state.run_id
        log.info("resuming from %s: step %d, policy version %d, data position %d", path, state.step, state.version,
                 state.data_position)

    # ---- logging and the end --------------------------------------------------------------------------
    def _progress_bar(self):
        from tqdm.auto import tqdm

        return tqdm(total=self.cfg.max_steps, initial=self.step, desc="asyncgrpo", disable=not self.main,
                    dynamic_ncols=True)

    def _log(self, stats: StepStats, bar) -> None:
        """Rank 0: the step's statistics with the rollout side's counters, to TensorBoard every `logging_steps`."""
        stats.add(**self.rollout.stats(), **{"policy/version": self.version})
        if self.step % self.cfg.logging_steps == 0 or self.step == self.cfg.max_steps:
            self.rollout.log(stats.values, self.step)
        bar.set_postfix(reward=f"{stats.values['reward/mean']:.3f}", v=self.version, refresh=False)
        bar.update(1)

    def _finish(self, seconds: float) -> dict:
        summary = {}
        if self.main:
            rollout = self.rollout.stats()
            summary = {"steps": self.step, "version": self.version, "adapter_name": self.rollout.adapter_name,
                       "adapter_path": str(self.rollout.adapter_path), "model_path": str(self.model_path),
                       "train_seconds": seconds, "dropped_stale": rollout["queue/dropped_stale_total"],
                       "dropped_zero_std": rollout["queue/dropped_zero_std_total"],
                       "lost_groups": rollout["rollout/lost_groups_total"],
                       "resent_groups": rollout["rollout/resent_groups_total"],
                       "tensorboard": str(self.rollout.tensorboard_dir.resolve()),
                       "backend": backend_of(self.acc), "world_size": self.world, "base_dtype": self._base_dtype(),
                       "start_step": self.start_step,
                       "resumed_from": str(self.resumed_from) if self.resumed_from is not None else None,
                       # every other version is unloaded at cleanup; this one too unless keep_final_adapter
                       "adapter_left_loaded": self.rollout.adapter_name if self.cfg.keep_final_adapter else None}
            (Path(self.cfg.output_dir) / "run_summary.json").write_text(json.dumps(summary, indent=2))
            log.info("done: %s", json.dumps(summary))
        self.finished = True
        return summary

    def _base_dtype(self) -> str:
        """The dtype the frozen base weights are held in after prepare() (what a backend did to `torch_dtype`)."""
        frozen = next(p for p in self.acc.unwrap_model(self.model).parameters() if not p.requires_grad)
        return str(getattr(frozen, "ds_tensor", frozen).dtype).removeprefix("torch.")

    def halt(self) -> None:
        """On SIGTERM/SIGINT (main thread, shutdown.py): resume every server a sync in progress has paused."""
        if self.rollout is not None:
            self.rollout.halt()

    def cleanup(self) -> None:
        """Stop the rollout side (it frees the servers' adapter slots) and leave the process group; safe after a
        setup that failed part-way."""
        if self.rollout is not None:
            self.rollout.close(keep_final=self.finished and self.cfg.keep_final_adapter)
        if hasattr(self, "acc"):
            if self.finished:  # every rank reached the end: leave the process group together (a gloo rank that tore it
                self.acc.wait_for_everyone()  # down while rank 0 was still unloading adapters was seen to abort at exit)
            self.acc.end_training()

