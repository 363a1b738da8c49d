"""RolloutSide: rank 0's rollout side in this process, everything that talks to the inference servers.

It owns the parts rollout/build.py builds (clients, recovery, adapter store, publisher, scorer, queue, producer) plus
the publish thread, the trackers (`report_to`) and the held-out prompts (`eval_dataset`), and alone knows which
version is live under which adapter name. It implements RolloutInterface (transport/interface.py, which documents each
call); the trainer hands it tensors and takes batches: start, publish(0, wait=True), then take and publish each step,
wait_published, close.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from asyncgrpo.contracts import Group, ServedProbe
from asyncgrpo.data import base_model_reference
from asyncgrpo.inference.recovery import evaluation_wait_s
from asyncgrpo.rollout.build import RolloutParts, build_parts
from asyncgrpo.rollout.concurrency import WAITED_S
from asyncgrpo.rollout.evaluation import evaluate_served
from asyncgrpo.rollout.publish import is_version_of, run_prefix
from asyncgrpo.trackers import Trackers, resolve_report_to

log = logging.getLogger(__name__)

EXTRA_ROWS = 64  # rows of the reward_extra table per step (the completions table's default too)

EVAL_CONCURRENCY = 16  # held-out requests in flight at once, beside the producer's (evaluation waits for them all)


class RolloutSide:
    """Clients, recovery, store, publisher, scorer, queue, producer and the trackers of one run (rank 0).

    `step`: the trainer's step at start (a resumed run's checkpoint step: the producer fills that step's batch first
    and TensorBoard drops what a killed run logged after it); `data_position`: where the data stream resumes;
    `previous_run_id`: the run id of the checkpoint resumed from (its adapters are unloaded from the servers), None
    when not resuming."""

    def __init__(self, cfg, *, tokenizer, model_path: str, peft_config, groups_per_step: int, step: int = 0,
                 data_position: int = 0, previous_run_id: str | None = None):
        self.cfg = cfg
        self.tokenizer, self.model_path, self.peft_config = tokenizer, model_path, peft_config
        self.groups_per_step = groups_per_step
        self.start_step, self.data_position, self.previous_run_id = step, data_position, previous_run_id
        # Names must be unique for the server's lifetime (vLLM refuses to re-load one), and versions on disk are
        # immutable: each run gets an id, its adapters go to lora_adapter_path/<run id>/v<N>.
        self.run_id = uuid.uuid4().hex[:8]
        self.version: int | None = None  # the version the servers serve (None: none published yet)
        # Set by start(); None until then, so that halt() and close() work after a start that failed part-way.
        self.parts: RolloutParts | None = None  # clients, store, publisher, queue, producer, ... (rollout/build.py)
        self.trackers: Trackers | None = None
        self._publish_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")  # one: in order
        self._extra: dict[str, list] = {}  # log_extra columns taken from the scorer, written at the next log()
        self._extra_lock = threading.Lock()  # log() runs on the publish thread too
        self._publishing: Future | None = None

    # ---- start ----------------------------------------------------------------------------------------
    def start(self) -> None:  # pragma: no mutate block
        """Check every server (`asyncgrpo doctor`: fail now, naming the fix), load the prompts, start the producer.
        It sends nothing before the first `publish`."""
        first_batch = self.start_step // self.cfg.num_iterations  # a resumed run's checkpoint's batch
        self.parts = parts = build_parts(self.cfg, tokenizer=self.tokenizer, model_path=self.model_path,
                                         run_id=self.run_id, groups_per_step=self.groups_per_step,
                                         start_position=self.data_position, start_batch=first_batch)
        resumed = self.previous_run_id is not None
        # Resuming: hide what a killed run logged after its checkpoint (TensorBoard purges steps >= purge_step).
        self.trackers = Trackers.open(resolve_report_to(self.cfg.report_to), output_dir=self.cfg.output_dir,
                                      run_name=self.cfg.run_name or f"{Path(self.cfg.output_dir).name}-{self.run_id}",
                                      config=self.cfg.to_dict(),
                                      purge_step=self.start_step + 1 if resumed else None)
        self.log({"data/prompts_skipped_too_long": parts.prompts_skipped_too_long}, self.start_step)
        if resumed:
            self._unload_previous_run()
        parts.producer.start()

    def _unload_previous_run(self) -> None:  # pragma: no mutate block
        """The run that wrote the checkpoint may have left its adapters loaded on the servers (it was killed); unload
        them so they do not hold the server's adapter slots. Best effort."""
        prefix = run_prefix(self.cfg.lora_name, self.previous_run_id)
        for client in self.parts.clients:
            try:
                for name in [n for n in client.adapter_paths() if is_version_of(n, prefix)]:
                    client.unload_adapter(name)
            except Exception as exc:  # noqa: BLE001 - a leftover adapter costs a slot, not correctness
                log.warning("could not unload the previous run's adapters from %s: %s", client.base_url, exc)

    @property
    def tensorboard_dir(self) -> Path:
        """<output_dir>/tensorboard (relative if output_dir is)."""
        return Path(self.cfg.output_dir) / "tensorboard"

    # ---- batches --------------------------------------------------------------------------------------
    def take(self, n: int, version: int, timeout_s: float) -> list[Group]:
        """Block until `n` groups at most `max_staleness` versions older than the trainer's `version` are queued,
        and return them (oldest version first, then data order); re-raises the producer's failure."""
        t0 = time.monotonic()
        groups = self.parts.queue.take(n, version, timeout_s=timeout_s)
        if self.cfg.adaptive_inflight:
            self.parts.producer.adapt_inflight(trainer_waited=time.monotonic() - t0 > WAITED_S)
        return groups

    # ---- publishing -----------------------------------------------------------------------------------
    @property
    def adapter_name(self) -> str | None:
        """The adapter name the servers serve the live version under (None before the first publish)."""
        return self.parts.publisher.current_name if self.parts is not None else None

    @property
    def adapter_path(self) -> Path | None:
        """The trainer-side directory of the live version."""
        return self.parts.store.path(self.version) if self.version is not None else None

    def publish(self, version: int, tensors: dict, step: int, wait: bool = False,
                probe: ServedProbe | None = None) -> float:
        """Hand version `version`'s LoRA tensors to the publish thread (atomic write, then activation on every
        server), after the previous publish: versions go live in order, and a failed publish is raised here, by
        the next call. `wait` (or `publish_in_background: false`): return once the servers serve it. `step`: the
        trainer step its timings are logged at. `probe`: the trainer's logprobs to check every server against
        (served_check_every). Returns the seconds spent waiting for the previous publish."""
        t0 = time.perf_counter()
        self.wait_published()  # raises here if the previous publish failed
        waited = time.perf_counter() - t0
        self._publishing = self._publish_thread.submit(self._publish_or_fail, version, tensors, step, probe)
        if wait or not self.cfg.publish_in_background:
            self.wait_published()
        return waited

    def _publish_or_fail(self, version: int, tensors: dict, step: int, probe: ServedProbe | None) -> None:
        """`_publish`; its failure also goes to the queue, so that a trainer waiting in `take` for this version's
        groups (max_staleness 0 waits for them) gets the error now instead of a timeout."""
        try:
            self._publish(version, tensors, step, probe)
        except BaseException as exc:
            self.parts.queue.fail(exc)
            raise

    def _publish(self, version: int, tensors: dict, step: int, probe: ServedProbe | None) -> None:
        """On the publish thread: write the version, activate it, point new requests at it, retire what nothing
        uses; its timings go to the trackers at `step`."""
        store, publisher, producer = self.parts.store, self.parts.publisher, self.parts.producer
        t0 = time.perf_counter()
        path = store.write(version, tensors, self.peft_config, base_model=base_model_reference(self.model_path))
        written = time.perf_counter()
        timing = publisher.publish(version, path, probe)
        self.version = version
        self.parts.scorer.at_step(step, version)  # reward functions' trainer_state, from the next group scored on
        producer.set_policy(version, publisher.current_name)  # new requests go to the new version
        publisher.retire(in_use=producer.adapters_in_use())
        store.prune(self.cfg.keep_adapter_versions, in_use=set(publisher.loaded.values()))
        checked = {name: value for name, value in (("sync/served_logprob_max_diff", timing.served_logprob_max_diff),
                                                   ("sync/served_probe_change", timing.served_probe_change))
                   if value is not None}
        self.log({"sync/write_s": written - t0, "sync/server_s": timing.server_s, "sync/paused_s": timing.paused_s,
                  "sync/load_s": timing.load_s, **checked}, step)

    def wait_published(self) -> None:
        """Block until the publish in progress (if any) is done; re-raises its error."""
        done, self._publishing = self._publishing, None
        if done is not None:
            done.result()

    # ---- logging --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Rollout, queue and reward counters now (tracker names; the run summary reads them too)."""
        producer, queue = self.parts.producer, self.parts.queue
        elapsed = time.monotonic() - producer.started_at
        episodes = producer.episodes.stats.values() if producer.episodes is not None else {}  # with tools only
        return {**episodes, **self._logged_metrics(),
                "rollout/generated_tokens_per_s": producer.generated_tokens / max(elapsed, 1e-9),
                "rollout/lost_groups_total": producer.lost_groups,
                "rollout/resent_groups_total": producer.resent_groups,
                "reward/fallbacks_total": self.parts.scorer.fallbacks,
                "queue/dropped_stale_total": queue.dropped_stale, "queue/depth": len(queue),
                "queue/dropped_zero_std_total": queue.dropped_zero_std,
                "queue/inflight_requests": producer.inflight,
                **({"queue/inflight_limit": producer.max_inflight} if self.cfg.adaptive_inflight else {}),
                **({"rollout/inflight_continuations_total": producer.inflight_stats.continuations,
                    "rollout/inflight_completions_moved_total": producer.inflight_stats.completions_moved,
                    "rollout/inflight_tokens_cut_total": producer.inflight_stats.tokens_cut,
                    "rollout/inflight_tokens_moved_total": producer.inflight_stats.tokens_moved}
                   if self.cfg.inflight_weight_updates else {})}

    def _logged_metrics(self) -> dict[str, float]:
        """Reward functions' `log_metric` values since the last call, each as its mean under `train/<name>` (TRL's
        averaging per logging step); their `log_extra` columns wait for the next `log` (they need its step)."""
        metrics, extra = self.parts.scorer.take_logged()
        with self._extra_lock:
            for column, values in extra.items():
                self._extra.setdefault(column, []).extend(values)
        return {f"train/{name}": sum(v) / len(v) for name, v in metrics.items() if v}

    def log(self, values: dict[str, float], step: int) -> None:
        """Write `values` at `step` to every tracker: every metric the side writes goes through here (the publish
        thread's sync timings too). Columns reward functions logged with `log_extra` go with them as a table."""
        self.trackers.log(values, step)
        with self._extra_lock:
            extra, self._extra = self._extra, {}
        if extra:
            columns = sorted(extra)
            rows = min(max(len(v) for v in extra.values()), EXTRA_ROWS)
            self.trackers.log_table("reward_extra", ["step", *columns],
                                    [[step, *(extra[c][i] if i < len(extra[c]) else None for c in columns)]
                                     for i in range(rows)], step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """Write a table at `step` to every tracker that shows tables."""
        self.trackers.log_table(name, columns, rows, step)

    def evaluate(self, step: int) -> dict[str, float]:
        """`eval_dataset`'s held-out reward under the live adapter (`num_generations_eval` completions per prompt at
        the training temperature), scored as training scores; logged at `step` and returned."""
        self.wait_published()  # the adapter the trainer just published, and no retirement during the evaluation
        cfg, parts = self.cfg, self.parts
        result = evaluate_served(parts.clients[0], parts.publisher.current_name, parts.eval_rows, parts.scorer,
                                 max_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                 n=cfg.num_generations_eval or cfg.num_generations,
                                 concurrency=EVAL_CONCURRENCY)
        metrics = result.metrics()
        self.log(metrics, step)
        return metrics

    def evaluation_wait_s(self) -> float:
        """The longest one `evaluate` can take and still succeed: its prompts, EVAL_CONCURRENCY at a time."""
        return evaluation_wait_s(self.cfg, len(self.parts.eval_rows), EVAL_CONCURRENCY)

    # ---- the end --------------------------------------------------------------------------------------
    def halt(self) -> None:
        """On SIGTERM/SIGINT (main thread, shutdown.py): resume every server a sync in progress has paused."""
        if self.parts is not None:
            self.parts.publisher.halt()

    def close(self, keep_final: bool) -> None:
        """Stop the producer, unload every version this run loaded (all but the live one with `keep_final`), close
        the log. Safe after a start that failed part-way."""
        self._publish_thread.shutdown(wait=True)
        if self.parts is not None:
            producer = self.parts.producer
            producer.stop()  # also stops the reward workers
            if producer.episodes is not None:
                producer.episodes.close()  # every pooled environment's close(), where it has one
            publisher = self.parts.publisher  # free the servers' adapter slots this run held
            publisher.unload_all(keep=publisher.current_name if keep_final else None)
        if self.trackers is not None:
            self.trackers.close()
