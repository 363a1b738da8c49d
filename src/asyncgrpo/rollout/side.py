"""RolloutSide: rank 0's half of a run, everything that talks to the inference servers, behind one interface.

It owns the HTTP clients, the recovery of servers that stop answering, the adapter store and the publisher (and the
one thread that publishes in the background, in order), the reward scorer, the queue, the producer with its schedule,
and the TensorBoard writer (the publish thread logs each sync's timings to it). It alone knows which policy version
is live and under which adapter name. The trainer only hands it tensors and takes batches:

    side = RolloutSide(cfg, tokenizer=tok, model_path=path, peft_config=lora, groups_per_step=n)
    side.start()                                   # servers checked, data loaded, producer started: nothing sent yet
    side.publish(0, tensors, step=0, wait=True)    # version 0 served: generation begins
    groups = side.take(n, version=0, timeout_s=t)  # a batch no more than max_staleness versions old
    side.publish(1, tensors, step=1)               # in the background; its failure is raised by the next call
    side.wait_published(); side.close(keep_final=True)
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from asyncgrpo.contracts import Group

log = logging.getLogger(__name__)


class RolloutSide:
    """Clients, recovery, store, publisher, scorer, queue, producer and the TensorBoard writer of one run (rank 0).

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
        self.tensorboard_dir = Path(cfg.output_dir) / "tensorboard"
        # Set by start(); None until then, so that halt() and close() work after a start that failed part-way.
        self.clients: list = []
        self.recovery = self.store = self.publisher = self.scorer = self.queue = self.producer = self.writer = None
        self._publish_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")  # one: in order
        self._publishing: Future | None = None

    # ---- start ----------------------------------------------------------------------------------------
    # Not mutated (make mutate): start() wires parts that each have unit tests of their own, behind the doctor,
    # which needs a real server; every integration test that trains runs it (docs/testing.md).
    def start(self) -> None:  # pragma: no mutate block
        """Check every server (`asyncgrpo doctor`: fail now, naming the fix), load the prompts, start the producer.
        It sends nothing before the first `publish`."""
        from torch.utils.tensorboard import SummaryWriter

        from asyncgrpo.data import load_prompt_set, server_max_model_len
        from asyncgrpo.rollout.preflight import require_healthy_setup
        from asyncgrpo.inference.client import InferenceClient
        from asyncgrpo.inference.recovery import ServerRecovery
        from asyncgrpo.rollout.delivery import make_delivery
        from asyncgrpo.rollout.publish import AdapterPublisher
        from asyncgrpo.store import AdapterStore, clean_stale_temporaries
        from asyncgrpo.rollout.producer import RolloutProducer
        from asyncgrpo.rollout.queue import RolloutQueue
        from asyncgrpo.rollout.scoring import make_group_scorer

        cfg = self.cfg
        self.clients = [InferenceClient(url, api_key=cfg.api_key, timeout_s=cfg.vllm_request_timeout)
                        for url in cfg.server_urls]
        for client in self.clients:
            client.wait_healthy(cfg.vllm_server_timeout)
        require_healthy_setup(cfg, self.clients, self.model_path)
        clean_stale_temporaries(cfg.lora_adapter_path)  # what writers of killed runs left in their directories
        self.store = AdapterStore(Path(cfg.lora_adapter_path) / self.run_id)
        # A server that stops answering is waited for (vllm_server_timeout), and gets the current adapter back
        # before any generation goes to it; rollouts and syncs share this one view of which servers are up.
        self.recovery = ServerRecovery(cfg.vllm_server_timeout)
        self.publisher = AdapterPublisher(self.clients, f"{cfg.lora_name}-{self.run_id}", cfg.sync_mode,
                                          cfg.sync_pause_mode, recovery=self.recovery,
                                          adapter_root=cfg.lora_adapter_path,  # paths sent never leave it
                                          delivery=make_delivery(cfg))  # adapter_delivery: shared_fs | http
        self.recovery.restore = self.publisher.restore
        # Prompts that leave the server no room for max_completion_length tokens are skipped (and counted). The
        # first server answers for what all share: the base model, max_model_len.
        prompts = load_prompt_set(cfg, self.tokenizer, model_path=self.model_path,
                                  server_max_model_len=server_max_model_len(self.clients[0].models()))
        self.queue = RolloutQueue(cfg.max_staleness, scale_rewards=cfg.scale_rewards,
                                  dynamic_sampling=cfg.dynamic_sampling)
        # Decoding and reward scoring: in the request threads, or in `reward_workers` processes (closed by stop())
        self.scorer = make_group_scorer(cfg, self.tokenizer, prompts.response_template)
        self.producer = RolloutProducer(clients=self.clients, rows=prompts.rows, scorer=self.scorer, queue=self.queue,
                                        groups_per_step=self.groups_per_step, cfg=cfg,
                                        start_position=self.data_position, recovery=self.recovery,
                                        start_batch=self.start_step // cfg.num_iterations)  # a resumed run's batch
        resumed = self.previous_run_id is not None
        # Resuming: hide what a killed run logged after its checkpoint (TensorBoard purges steps >= purge_step).
        self.writer = SummaryWriter(str(self.tensorboard_dir), purge_step=self.start_step + 1 if resumed else None)
        self.writer.add_scalar("data/prompts_skipped_too_long", prompts.skipped_too_long, self.start_step)
        if resumed:
            self._unload_previous_run()
        self.producer.start()

    def _unload_previous_run(self) -> None:  # pragma: no mutate block - as start(); test_checkpoint.py (integration)
        """The run that wrote the checkpoint may have left its adapters loaded on the servers (it was killed); unload
        them so they do not hold the server's adapter slots. Best effort."""
        prefix = f"{self.cfg.lora_name}-{self.previous_run_id}-v"
        for client in self.clients:
            try:
                for name in [n for n in client.adapter_paths() if n.startswith(prefix)]:
                    client.unload_adapter(name)
            except Exception as exc:  # noqa: BLE001 - a leftover adapter costs a slot, not correctness
                log.warning("could not unload the previous run's adapters from %s: %s", client.base_url, exc)

    # ---- batches --------------------------------------------------------------------------------------
    def take(self, n: int, version: int, timeout_s: float) -> list[Group]:
        """Block until `n` groups at most `max_staleness` versions older than the trainer's `version` are queued,
        and return them (oldest version first, then data order); re-raises the producer's failure."""
        return self.queue.take(n, version, timeout_s=timeout_s)

    # ---- publishing -----------------------------------------------------------------------------------
    @property
    def adapter_name(self) -> str | None:
        """The adapter name the servers serve the live version under (None before the first publish)."""
        return self.publisher.current_name if self.publisher is not None else None

    @property
    def adapter_path(self) -> Path | None:
        """The trainer-side directory of the live version."""
        return self.store.path(self.version) if self.version is not None else None

    def publish(self, version: int, tensors: dict, step: int, wait: bool = False) -> float:
        """Hand version `version`'s LoRA tensors to the publish thread (atomic write, then activation on every
        server), after the previous publish: versions go live in order, and a failed publish is raised here, by
        the next call. `wait` (or `publish_in_background: false`): return once the servers serve it. `step`: the
        trainer step its timings are logged at. Returns the seconds spent waiting for the previous publish."""
        t0 = time.perf_counter()
        self.wait_published()  # raises here if the previous publish failed
        waited = time.perf_counter() - t0
        self._publishing = self._publish_thread.submit(self._publish, version, tensors, step)
        if wait or not self.cfg.publish_in_background:
            self.wait_published()
        return waited

    def _publish(self, version: int, tensors: dict, step: int) -> None:
        """On the publish thread: write the version, activate it, point new requests at it, retire what nothing
        uses; its timings go to TensorBoard at `step`."""
        t0 = time.perf_counter()
        path = self.store.write(version, tensors, self.peft_config, base_model=str(Path(self.model_path).resolve()))
        written = time.perf_counter()
        timing = self.publisher.publish(version, path)
        self.version = version
        self.producer.set_policy(version, self.publisher.current_name)  # new requests go to the new version
        self.publisher.retire(in_use=self.producer.adapters_in_use())
        self.store.prune(self.cfg.keep_adapter_versions, in_use=set(self.publisher.loaded.values()))
        for key, value in {"sync/write_s": written - t0, "sync/server_s": timing.server_s,
                           "sync/paused_s": timing.paused_s, "sync/load_s": timing.load_s}.items():
            self.writer.add_scalar(key, value, step)

    def wait_published(self) -> None:
        """Block until the publish in progress (if any) is done; re-raises its error."""
        done, self._publishing = self._publishing, None
        if done is not None:
            done.result()

    # ---- logging --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Rollout, queue and reward counters now (TensorBoard names; the run summary reads them too)."""
        producer, queue = self.producer, self.queue
        elapsed = time.monotonic() - producer.started_at
        return {"rollout/generated_tokens_per_s": producer.generated_tokens / max(elapsed, 1e-9),
                "rollout/lost_groups_total": producer.lost_groups,
                "rollout/resent_groups_total": producer.resent_groups,
                "reward/fallbacks_total": self.scorer.fallbacks,
                "queue/dropped_stale_total": queue.dropped_stale, "queue/depth": len(queue),
                "queue/dropped_zero_std_total": queue.dropped_zero_std,
                "queue/inflight_requests": producer.inflight}

    def log(self, values: dict[str, float], step: int) -> None:
        """Write `values` to TensorBoard at `step`."""
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    # ---- the end --------------------------------------------------------------------------------------
    def halt(self) -> None:
        """On SIGTERM/SIGINT (main thread, shutdown.py): resume every server a sync in progress has paused."""
        if self.publisher is not None:
            self.publisher.halt()

    def close(self, keep_final: bool) -> None:
        """Stop the producer, unload every version this run loaded (all but the live one with `keep_final`), close
        the log. Safe after a start that failed part-way."""
        self._publish_thread.shutdown(wait=True)
        if self.producer is not None:
            self.producer.stop()  # also stops the reward workers
        elif self.scorer is not None:
            self.scorer.close()
        if self.publisher is not None:  # free the servers' adapter slots this run held
            self.publisher.unload_all(keep=self.publisher.current_name if keep_final else None)
        if self.writer is not None:
            self.writer.close()
