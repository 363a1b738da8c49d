"""The training recipe: `GRPORecipe` runs one GRPO run on every rank (`setup()`, `train()`, `cleanup()`).

Each step: every `num_iterations` steps rank 0 takes a batch from the rollout queue and splits it over ranks by
tokens; every rank computes the GRPO loss over its micro-batches, backward, optimizer step; every
`weight_sync_steps` steps every rank joins the LoRA gather and rank 0 hands the tensors to the rollout side to
publish. docs/trainer-internals.md walks through the data path.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.trainer_utils import TrainOutput

from asyncgrpo.config import AsyncGRPOConfig, raise_all
from asyncgrpo.contracts import Group
from asyncgrpo.data import base_model_reference, count_training_rows, resolve_model_path
from asyncgrpo.distributed import (accumulation, broadcast_object, dist_max, dist_sums, make_accelerator, on_main,
                                   require_shared_dir, scatter_object, setup_logging)
from asyncgrpo.inference.recovery import (TimeoutSettings, batch_wait_s, check_evaluation_fits_ddp_timeout,
                                          check_outage_fits_ddp_timeout)
from asyncgrpo.rewards import reward_name
from asyncgrpo.transport.factory import open_rollout_side
from asyncgrpo.transport.interface import RolloutInterface
from asyncgrpo.shutdown import exit_code
from asyncgrpo.store import CARD_NAME, export_adapter
from asyncgrpo.timeline import Timeline, span
from asyncgrpo.trainer.batching import (collate, pack_by_tokens, score_completions, split_by_tokens, to_device,
                                        with_positions)
from asyncgrpo.trainer.callbacks import Callbacks
from asyncgrpo.trainer.checkpoint import (TRAINER_STATE, Checkpointer, CheckpointerSettings, TrainerState,
                                          check_backend, clean_partial, load_checkpoint, read_trainer_state,
                                          resolve_checkpoint, restore_rng)
from asyncgrpo.trainer.completions import CompletionLog
from asyncgrpo.trainer.evaluator import Evaluator, EvaluatorSettings
from asyncgrpo.trainer.gather import backend_of, gather_lora_state
from asyncgrpo.trainer.logprobs import sequence_logprobs
from asyncgrpo.trainer.loss import LossSpec, LossSpecSettings, grpo_loss, loss_normaliser
from asyncgrpo.trainer.metrics import LossTotals, RunLoss, StepMetrics, summary_counters
from asyncgrpo.trainer.outputs import CardSettings, LogHistory, TrainerStateSettings, model_card
from asyncgrpo.trainer.policy import PolicySettings, build_policy
from asyncgrpo.trainer.probe import make_probe, probe_sequence
from asyncgrpo.trainer.schedule import build_lr_scheduler

log = logging.getLogger(__name__)


@dataclass
class TrainBatch:
    """One generated batch as the trainer holds it for its `num_iterations` steps: the groups (rank 0 only, for
    logging) and this rank's share, collated into micro-batches once."""

    groups: list[Group]
    micro_batches: list[dict[str, torch.Tensor]]


class GRPORecipe:
    """One run: `setup()`, `train()`, `cleanup()`. Rank 0 also holds the rollout side (`self.rollout`: servers,
    producer, queue, publisher; rollout/side.py), None on the other ranks. `callbacks`: TrainerCallback-style objects
    (callbacks.py); `tokenizer`: used instead of the model directory's (the Python API's `processing_class`)."""

    def __init__(self, cfg: AsyncGRPOConfig, *, callbacks=None, tokenizer=None):
        raise_all(cfg.task_problems())  # no silent defaults: a run names its model, prompts and reward
        self.cfg = cfg
        self.callbacks = Callbacks(callbacks)
        self.given_tokenizer = tokenizer
        # Each component gets only the sections it reads (config.py, `section`): fixed for the run.
        self.loss_spec = LossSpec.from_config(cfg.section(LossSpecSettings))  # what the loss takes from the config
        self.checkpointer = Checkpointer.from_config(cfg.section(CheckpointerSettings))  # when and where to save
        self.evaluator = Evaluator.from_config(cfg.section(EvaluatorSettings))  # when to evaluate on eval_dataset
        self.version = 0  # the trainer's weights at the last sync; the servers serve it once that publish is done
        self.step = 0
        self.data_position = 0  # rank 0: the data stream position after the last prompt trained on
        self.resumed_from: Path | None = None  # the checkpoint this run continues, if any
        self.previous_run_id: str | None = None  # the run id that checkpoint was written by
        self.rollout: RolloutInterface | None = None  # rank 0, once set up (rollout_process: a proxy)
        self.wait_timeline = Timeline()  # rank 0: intervals spent waiting on the rollout queue
        self._batch: TrainBatch | None = None  # the batch being trained on (num_iterations steps)
        self.finished = False  # train() ran to max_steps (cleanup then keeps the final adapter loaded)
        self.stop_requested = threading.Event()  # set by a deferred SIGTERM (shutdown.py): checkpoint, then exit
        self._published: dict[str, torch.Tensor] | None = None  # rank 0: the LoRA tensors of the last sync
        self.completion_log: CompletionLog | None = None  # rank 0 with log_completions
        self.eval_metrics: dict[str, float] = {}  # rank 0: the last evaluation's (eval_strategy: steps)
        self.history = LogHistory()  # rank 0: what was logged, for trainer_state.json and the model card
        self.run_loss = RunLoss()  # every rank: the losses of the steps train() ran, for its training_loss
        # Every rank: the served check's probe (probe.py), fixed from the first batch; None until then.
        self.probe: tuple[list[int], int] | None = None
        self._probe_sent = False  # every rank: the base's logprobs went with a probe already (sent once)

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
        self.callbacks.begin(self.cfg, step=self.step, is_main=self.main, is_local_main=self.acc.is_local_main_process,
                             model=self.acc.unwrap_model(self.model), processing_class=self.tokenizer,
                             optimizer=self.optimizer, lr_scheduler=self.lr_scheduler)
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
        # Every rank: a server outage must not time out the others.
        check_outage_fits_ddp_timeout(cfg.section(TimeoutSettings), self.world)
        self.main = self.acc.is_main_process
        setup_logging(self.rank)
        self.groups_per_step = cfg.groups_per_step(self.world)
        if cfg.num_train_epochs is not None:
            self.cfg = cfg = self._steps_from_epochs(cfg)
        # Rank 0 resolves (and, for the toy, builds) the model first; the others then find it cached.
        self.model_path = on_main(self._resolve_model, "resolving the model")
        if not self.main:
            self.model_path = self._resolve_model()
        self.model, self.optimizer, self.tokenizer, self.peft_config, self.scoring_head = build_policy(
            cfg.section(PolicySettings), self.acc, self.model_path,
            tokenizer=self.given_tokenizer)  # LoRA model, optimizer, prepared
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # Stepped by `_optimise` once per optimizer step, on every backend (schedule.py says why not via accelerate).
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)

    def _steps_from_epochs(self, cfg: AsyncGRPOConfig) -> AsyncGRPOConfig:
        """Collective: `cfg` with `max_steps` counted from `num_train_epochs` and the training split's rows (rank 0
        reads the split; every rank gets the count)."""
        rows = broadcast_object(on_main(lambda: count_training_rows(cfg), "counting the training prompts"))
        steps = cfg.steps_for_epochs(rows, self.world)
        log.info("num_train_epochs %g over %d prompts, %d per step: max_steps %d", cfg.num_train_epochs, rows,
                 self.groups_per_step, steps)
        return dataclasses.replace(cfg, max_steps=steps)

    def _resolve_model(self) -> str:
        return resolve_model_path(self.cfg)

    def _start_rollout(self) -> None:
        """Rank 0: the output directory, then the rollout side (servers checked, prompts loaded, producer started)."""
        out = Path(self.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        clean_partial(out)  # what a save killed midway left behind
        self.cfg.save(out / "config.yaml")
        if self.cfg.log_completions:
            names = [reward_name(r) for r in self.cfg.reward_funcs or []]
            self.completion_log = CompletionLog(out, self.tokenizer, names, self.cfg.num_completions_to_print)
        self.rollout = open_rollout_side(self.cfg, tokenizer=self.tokenizer, model_path=self.model_path,
                                          peft_config=self.peft_config, groups_per_step=self.groups_per_step,
                                          step=self.step, data_position=self.data_position,
                                          previous_run_id=self.previous_run_id)  # rollout_process: a child's
        self.rollout.start()
        if self.cfg.eval_strategy == "steps":  # the others wait for each evaluation too (the held-out prompts known)
            check_evaluation_fits_ddp_timeout(self.cfg.section(TimeoutSettings), self.world,
                                              self.rollout.evaluation_wait_s())

    # ---- the loop -------------------------------------------------------------------------------------
    def train(self) -> TrainOutput:
        """Collective: train to `max_steps` (or until a callback stops the run), save the final adapter; returns
        what transformers' `Trainer.train()` returns: the step reached, the mean loss of the steps this call ran,
        and the run summary (`run_summary.json`; empty off rank 0) with `train_loss` added."""
        cfg = self.cfg
        bar = self._progress_bar()
        started = time.perf_counter()
        while self.step < cfg.max_steps:
            metrics = self.train_step()
            self.run_loss.add(metrics.values["train/loss"])  # reduced over ranks: the same on every rank
            last_step = self.step == cfg.max_steps
            if self.step % cfg.weight_sync_steps == 0:
                self.sync(metrics)
            if self.main:
                self._log(metrics, bar)
            if self.evaluator.should_evaluate(self.step, last_step=last_step):
                # rank 0 evaluates the version just published; a failure stops every rank
                evaluated = on_main(lambda: self.rollout.evaluate(self.step), "evaluating the held-out set")
                if self.main:
                    self.eval_metrics = evaluated
                    self.history.log(evaluated, self.step)
                    self.callbacks.evaluate(self.eval_metrics, self.step)
            saved = self.checkpointer.should_save(self.step, last_step=last_step)
            if saved:
                self.save_checkpoint()
                self.callbacks.save(self.step)
            if self._stop_agreed():
                self._stop_with_checkpoint(saved)
            self.callbacks.step_end(self.step)
            # A callback's `control.should_training_stop` on any rank ends the run on every rank (one collective
            # per step, only with callbacks: every rank runs the same script, so all have them or none).
            if self.callbacks and dist_max(1.0 if self.callbacks.stop_requested else 0.0) > 0:
                log.info("a callback set control.should_training_stop: stopping after step %d", self.step)
                break
        if self.main:
            bar.close()
        self.save_final()
        self.callbacks.end()
        summary = self._finish(time.perf_counter() - started)
        return TrainOutput(self.step, self.run_loss.mean, {**summary, "train_loss": self.run_loss.mean})

    def train_step(self) -> StepMetrics:
        """Collective: one optimizer step (no weight sync) on the next batch from the queue, or, for the
        `num_iterations` - 1 steps after it, on that same batch again."""
        metrics = StepMetrics()
        if self._batch is None or self.step % self.cfg.num_iterations == 0:
            self._batch = self._next_batch(metrics)  # rank 0 waits on the queue; all ranks get their share
        elif self.main:
            metrics.batch(self._batch.groups, self.version, self.cfg.num_generations, waited_s=0.0)
        self._optimise(self._batch.micro_batches, metrics)
        self.step += 1
        return metrics

    def _next_batch(self, metrics: StepMetrics) -> TrainBatch:
        """Collective: rank 0 takes one global batch of groups and sends each rank its share (equal numbers of
        groups, about equal numbers of tokens); every rank collates its share into micro-batches once."""
        def take() -> list[Group]:
            t0 = time.perf_counter()
            with span(self.wait_timeline):  # the trainer's idle time, for `asyncgrpo bench throughput`
                groups = self.rollout.take(self.groups_per_step, self.version,
                                           timeout_s=batch_wait_s(self.cfg))  # ddp_timeout is checked against it
            assert max(self.version - g.version for g in groups) <= self.cfg.max_staleness
            metrics.batch(groups, self.version, self.cfg.num_generations, waited_s=time.perf_counter() - t0)
            self.data_position = max(self.data_position, 1 + max(g.index for g in groups))
            return groups

        groups = on_main(take, "taking a batch from the rollout queue") or []
        share = scatter_object(split_by_tokens(groups, self.world) if self.main else None)  # each rank only its own
        if self.probe is None:
            self.probe = probe_sequence(share, self.pad_id)
        micro_batches = self._micro_batches(share)
        metrics.micro_batches(len(micro_batches))
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
        return [to_device(with_positions(collate(part, self.pad_id)), self.acc.device) for part in parts]

    def policy_logprobs(self, batch: dict[str, torch.Tensor], with_entropy: bool = False):
        """Per-token logprobs (B, T-1) of the sequences in `batch` under the trainer's model, in fp32, zero where
        `mask` is 0 (and, `with_entropy`, each position's entropy beside them). The LM head runs on the completion
        positions only, in chunks (logprobs.py): no (B, T, V) tensor."""
        return sequence_logprobs(self.model, self.scoring_head, batch["input_ids"], batch["attention_mask"],
                                 batch["mask"], self.cfg.temperature, with_entropy=with_entropy,
                                 positions=batch.get("positions"))

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """The trainer's own fp32 logprob of every completion token (for policy-equivalence checks)."""
        return score_completions(self.policy_logprobs, prompt_ids, completion_ids, self.pad_id, self.acc.device)

    def _optimise(self, micro_batches: list[dict[str, torch.Tensor]], metrics: StepMetrics) -> None:
        """Collective: GRPO loss over this rank's micro-batches, backward, clip, optimizer step, schedule step."""
        spec = self.loss_spec
        # The global batch's tokens (and sequences, for the loss types that average over them), in one all-reduce;
        # each micro-batch's tokens read from the device at once (one host sync for the step, not one per batch).
        micro_tokens = torch.stack([b["mask"].sum() for b in micro_batches]).tolist() if micro_batches else []
        n_tokens, n_seqs = dist_sums([float(sum(micro_tokens)),
                                      float(sum(b["mask"].shape[0] for b in micro_batches))])
        n_seqs = n_seqs if spec.counts_sequences else 0.0
        totals = LossTotals(self.world)
        for i, batch in enumerate(micro_batches):
            # The loss is the loss_type's mean over the global batch; DDP averages gradients over ranks, so the
            # normaliser is per rank (loss_normaliser).
            normaliser = loss_normaliser(spec, global_tokens=n_tokens, global_sequences=n_seqs,
                                         micro_tokens=float(micro_tokens[i]), micro_batches=len(micro_batches),
                                         world=self.world)
            # Gradients accumulate over the micro-batches; the last one's backward reduces them across ranks (and,
            # under DeepSpeed, is where the engine steps): one optimizer step per trainer step on every backend.
            with accumulation(self.acc, self.model, accumulate=i < len(micro_batches) - 1):
                totals.add(self._micro_step(batch, normaliser))
        if self.cfg.max_grad_norm > 0:
            grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            if grad_norm is not None:  # DeepSpeed clipped inside its engine (gradient_clipping = max_grad_norm)
                metrics.grad_norm(float(grad_norm))
        lr = self.lr_scheduler.get_last_lr()[0]  # the rate this step used
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        sums, maxima, entropy_hist = totals.reduced()
        metrics.optimiser(sums, maxima, n_tokens=n_tokens, lr=lr, entropy_hist=entropy_hist)

    def _micro_step(self, batch: dict[str, torch.Tensor], normaliser: float):
        """One micro-batch's forward(s), loss and backward; returns its LossTerms."""
        spec = self.loss_spec
        ref = batch.get("ref")
        if spec.needs_reference and ref is None:
            # The reference is the same (possibly sharded) model with the adapter switched off: no second copy. It
            # never changes, so a batch trained on again (num_iterations) keeps it.
            with torch.no_grad(), self.acc.unwrap_model(self.model).disable_adapter():
                ref = batch["ref"] = self.policy_logprobs(batch)
        logprobs, entropy = self.policy_logprobs(batch, with_entropy=True)  # entropy: logged; top_entropy_quantile
        proximal = None
        if spec.importance_weighted:
            # Decoupled PPO: the proximal policy is the trainer when it starts on this batch (PPO's "old" policy,
            # TRL's old logprobs). On the first pass that is this very forward, so its logprobs, detached, are kept
            # for the batch's later passes: no extra forward. Recomputing it every pass would make the ratio 1 at
            # every step and drop the trust region.
            proximal = batch.get("proximal")
            if proximal is None:
                proximal = batch["proximal"] = logprobs.detach()
        terms = grpo_loss(logprobs, batch["behaviour"], batch["advantages"], batch["mask"], spec,
                          normaliser=normaliser, ref_logprobs=ref, proximal_logprobs=proximal, entropy=entropy)
        self.acc.backward(terms.loss)
        return terms

    # ---- weight sync ----------------------------------------------------------------------------------
    def sync(self, metrics: StepMetrics | None = None, first: bool = False, wait: bool = False) -> None:
        """Collective: every rank joins the LoRA-only gather; rank 0 hands the tensors to the rollout side, which
        writes and activates them on every server in the background, overlapping the next training step. The next
        sync first waits for this one, so versions go live in order and a failed publish stops the run there.
        `wait=True` (and the first sync) return only once the server serves the new version."""
        t0 = time.perf_counter()
        gather_stats: dict = {}
        tensors = gather_lora_state(self.acc, self.model, gather_stats)
        gathered = time.perf_counter()
        version = self.version if first else self.version + 1
        probe = self._served_probe(version) if not first else None

        def publish() -> None:
            self._published = tensors
            waited = self.rollout.publish(version, tensors, self.step, wait=first or wait, probe=probe)
            if metrics is not None:
                metrics.sync(gathered - t0, waited, gather_stats["gathered_bytes"])

        on_main(publish, f"publishing policy version {version}")  # the other ranks wait here (a failure stops all)
        self.version = version

    def _served_probe(self, version: int):
        """Collective when due (every `served_check_every` versions, once a batch fixed the probe; the same on every
        rank): the probe's logprobs under the weights being published, for the rollout side to check every server
        against (rank 0's; the others' forward only keeps FSDP/ZeRO-3 in step)."""
        every = self.cfg.served_check_every
        if not every or version % every or self.probe is None:
            return None
        with_base = not self._probe_sent  # the same on every rank: the first due sync after the probe was fixed
        self._probe_sent = True
        return make_probe(self.acc, self.model, self.scoring_head, *self.probe, self.pad_id, with_base=with_base,
                          dtype=self._base_dtype())

    def save_final(self) -> None:
        """Collective: the run's result. Steps trained since the last sync are published first, so that the servers
        serve what is saved; once the last version is served, rank 0 writes it in PEFT format into output_dir itself
        (store.export_adapter), where TRL's save_model puts it, with its model card."""
        if self.step % self.cfg.weight_sync_steps:
            self.sync(wait=True)

        def write() -> None:
            self.rollout.wait_published()  # the run ends when its last version is served
            export_adapter(self.cfg.output_dir, self._published, self.peft_config,
                           base_model_reference(self.model_path), card=self._card(self.cfg.output_dir))

        on_main(write, "saving the final adapter")

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Collective: write `<output_dir>/checkpoint-<step>` atomically (checkpoint.py)."""
        state = TrainerState(step=self.step, version=self.version, data_position=self.data_position,
                             run_id=self.rollout.run_id if self.rollout is not None else "",
                             backend=backend_of(self.acc), world_size=self.world)
        self.checkpointer.save(self.acc, self.model, self.optimizer, state, peft_config=self.peft_config,
                               base_model=base_model_reference(self.model_path), lr_scheduler=self.lr_scheduler,
                               texts=self._checkpoint_texts)

    def _checkpoint_texts(self, path: Path) -> dict[str, str]:
        """Rank 0: what a checkpoint holds for TRL's users beside the adapter: trainer_state.json and its card."""
        state = self.history.trainer_state_json(self.cfg.section(TrainerStateSettings), self.step)
        return {TRAINER_STATE: state, CARD_NAME: self._card(path)}

    def _card(self, adapter_dir) -> str:
        """Rank 0: the model card of the adapter at this step, written into `adapter_dir` (outputs.py)."""
        return model_card(self.cfg.section(CardSettings), base_model=base_model_reference(self.model_path),
                          adapter_dir=adapter_dir, step=self.step, version=self.version,
                          evaluation=self.history.last_evaluation())

    @property
    def stop_grace_s(self) -> float:
        """How long the first SIGTERM waits for a checkpoint (shutdown.py): only with checkpoints on."""
        return self.cfg.stop_grace_s if self.cfg.save_steps else 0.0

    def _stop_agreed(self) -> bool:
        """Collective (with checkpoints on): whether every rank stops after this step, because one of them got SIGTERM
        and this step can be resumed from exactly (its weights published, its batch's passes done)."""
        if not self.stop_grace_s:
            return False  # the same on every rank: no collective, SIGTERM exits at once
        asked = dist_max(1.0 if self.stop_requested.is_set() else 0.0) > 0
        cfg = self.cfg
        return asked and self.step % cfg.weight_sync_steps == 0 and self.step % cfg.num_iterations == 0

    def _stop_with_checkpoint(self, saved: bool) -> None:
        """Collective: save this step (unless it just was) and exit as SIGTERM does (143); cleanup follows."""
        if not saved:
            self.save_checkpoint()
        log.warning("stopped on SIGTERM after step %d with a checkpoint in %s; continue with "
                    "--resume_from_checkpoint latest", self.step, self.cfg.output_dir)
        raise SystemExit(exit_code(signal.SIGTERM))

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
        if self.main:  # the next checkpoint's log_history continues this one's
            self.history = LogHistory.resumed(read_trainer_state(path))
        log.info("resuming from %s: step %d, policy version %d, data position %d", path, state.step, state.version,
                 state.data_position)

    # ---- logging and the end --------------------------------------------------------------------------
    def _progress_bar(self):
        return tqdm(total=self.cfg.max_steps, initial=self.step, desc="asyncgrpo", disable=not self.main,
                    dynamic_ncols=True)

    def _log(self, metrics: StepMetrics, bar) -> None:
        """Rank 0: the step's metrics with the rollout side's counters, and with `log_completions` the table of its
        completions, to every tracker every `logging_steps`."""
        metrics.rollout(self.rollout.stats(), self.version)
        if self.step % self.cfg.logging_steps == 0 or self.step == self.cfg.max_steps:
            metrics.log(self.rollout, self.step)
            self.history.log(metrics.values, self.step)
            self.callbacks.log(metrics.values, self.step)
            if self.completion_log is not None:
                rows = self.completion_log.table(self._batch.groups, self.step)
                self.completion_log.append(rows)
                self.rollout.log_table("completions", self.completion_log.columns, rows, self.step)
        bar.set_postfix(reward=f"{metrics.reward_mean:.3f}", v=self.version, refresh=False)
        bar.update(1)

    def _finish(self, seconds: float) -> dict:
        summary = {}
        if self.main:
            summary = {"steps": self.step, "version": self.version, "adapter_name": self.rollout.adapter_name,
                       "adapter_path": str(self.rollout.adapter_path), "model_path": str(self.model_path),
                       "final_adapter": str(Path(self.cfg.output_dir).resolve()),  # save_final's PEFT files
                       "train_seconds": seconds, **summary_counters(self.rollout.stats()),
                       "tensorboard": str(self.rollout.tensorboard_dir.resolve()),
                       "backend": backend_of(self.acc), "world_size": self.world, "base_dtype": self._base_dtype(),
                       "trainable_dtype": self._trainable_dtype(), "optimizer_state_dtype": self._state_dtype(),
                       "start_step": self.start_step, **self.eval_metrics,
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

    def _trainable_dtype(self) -> str:
        """The dtype the LoRA weights train in after prepare() (fp32 on every backend: distributed.py)."""
        lora = next(p for p in self.acc.unwrap_model(self.model).parameters() if p.requires_grad)
        return str(getattr(lora, "ds_tensor", lora).dtype).removeprefix("torch.")

    def _state_dtype(self) -> str:
        """The dtype of Adam's moments (under DeepSpeed, its ZeRO optimizer's inner torch optimizer holds them)."""
        opt = self.optimizer
        while hasattr(opt, "optimizer"):  # accelerate's wrapper, then DeepSpeed's ZeRO optimizer, down to AdamW
            opt = opt.optimizer
        dtypes = {str(v.dtype).removeprefix("torch.") for s in opt.state.values() for k, v in s.items()
                  if k.startswith("exp_avg")}
        return ",".join(sorted(dtypes))

    def halt(self) -> None:
        """On SIGTERM/SIGINT/SIGHUP (main thread, shutdown.py): resume every server a sync in progress has paused."""
        if self.rollout is not None:
            self.rollout.halt()

    def cleanup(self) -> None:
        """Stop the rollout side (it frees the servers' adapter slots) and leave the process group; safe after a
        setup that failed part-way."""
        if self.rollout is not None:
            self.rollout.close(keep_final=self.finished and self.cfg.keep_final_adapter)
        if hasattr(self, "acc"):
            if self.finished:
                # Every rank reached the end: leave the process group together (a gloo rank that tore it down while
                # rank 0 was still unloading adapters was seen to abort at exit).
                self.acc.wait_for_everyone()
            self.acc.end_training()

