"""The adapter publisher: serves each new adapter version on every inference server, all of them or none.

`AdapterPublisher.publish` checks the version's files, hands them to the delivery (rollout/delivery.py), then on
every server at once loads it under its own name (`{prefix}-v{N}`), pausing the server around the load in `pause`
mode, and reads it back. A failure leaves every server resumed and serving the previous version; `halt()` (the
SIGTERM handler) resumes whatever a sync in progress has paused. docs/publish-internals.md says why it works so.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.config import SYNC_MODES
from asyncgrpo.errors import InferenceServerError, ServerUnreachableError, SyncError
from asyncgrpo.inference.recovery import ServerGoneError
from asyncgrpo.rollout.delivery import SharedFsDelivery
from asyncgrpo.store import verify_adapter_files

log = logging.getLogger(__name__)

# halt() waits this long for pause calls on their way before it resumes (a pause takes ~30 ms; `wait` mode lasts as
# long as the requests it waits for). Bounded: a signal handler must not hang on a server that does not answer.
HALT_WAIT_S = 10.0


def resume_hint(url: str) -> str:
    """The manual fix for a server left paused."""
    return f"resume it by hand with `curl -X POST {url}/resume` (POST /resume)"


@dataclass
class PublishTiming:
    """One sync's timings. The servers are synced concurrently: `server_s` is the wall-clock time of the whole
    activation (every server, read-back included), the others are the slowest server's figure (max over servers)."""

    server_s: float = 0.0  # pause -> load -> reset -> resume -> read back on every server, wall clock
    paused_s: float = 0.0  # the longest time any one server spent paused (0 in versioned mode)
    load_s: float = 0.0  # the slowest server's load calls (POST /v1/load_lora_adapter)
    # Each server's own activation time, summed: what one server after another would have cost at the same
    # per-server speed (server_sum_s / server_s is how much the concurrency overlapped).
    server_sum_s: float = 0.0


_VERSION_MARK = "-v"  # between a run's prefix and a version number


def run_prefix(lora_name: str, run_id: str) -> str:
    """What every adapter name of one run starts with, `{lora_name}-{run_id}`; each version adds `-v{N}`
    (`version_name`). vLLM refuses to load a name twice in a server's lifetime, hence a new id for every run."""
    return f"{lora_name}-{run_id}"


def version_name(prefix: str, version: int) -> str:
    """The name version `version` of the run whose names start with `prefix` is served under."""
    return f"{prefix}{_VERSION_MARK}{version}"


def is_version_of(name: str, prefix: str) -> bool:
    """Whether `name` is a version's name (`version_name`) of the run whose names start with `prefix`."""
    head, mark, number = name.rpartition(_VERSION_MARK)
    return bool(mark) and head == prefix and number.isdigit()


def contained_adapter_path(path: str | Path, root: Path | None) -> Path:
    """`path` resolved (symlinks and `..` followed); a SyncError if it lies outside `root` (`lora_adapter_path`).

    The server loads whatever directory it is told to, and its adapter routes may be reachable by others on its
    network: asyncgrpo itself never asks it to read anything outside the adapter directory."""
    resolved = Path(path).resolve()
    if root is not None and not resolved.is_relative_to(root):
        raise SyncError(f"adapter path {str(path)!r} resolves to {str(resolved)!r}, outside lora_adapter_path "
                        f"{str(root)!r}; refusing to send it to the inference server. Fix: publish only adapters "
                        f"written under lora_adapter_path (and do not symlink out of it)")
    return resolved


class AdapterPublisher:
    """Activates each new adapter version on every server, in one of two modes:

    - `pause`: pause -> load the new version -> reset prefix cache -> resume (resume in `finally`);
    - `versioned`: load the new version beside the old ones, with no pause at all; requests already running
      finish on the version they started with, new requests go to the new name.

    In both, each version is loaded under its own name, `{prefix}-v{N}`, never in place: a completion's version
    tag is exact, and vLLM does not re-read an in-place adapter from disk at every engine step (measured: in place
    costs throughput, and a deleted directory kills the engine). `retire` unloads old versions no request uses.
    """

    def __init__(self, clients, prefix: str, sync_mode: str = "pause", pause_mode: str = "keep", recovery=None,
                 adapter_root: str | Path | None = None, delivery=None):
        assert sync_mode in SYNC_MODES, sync_mode
        # How the files reach each server (`adapter_delivery`, rollout/delivery.py): read in place, or uploaded.
        self.delivery = delivery if delivery is not None else SharedFsDelivery()
        # Every path sent to a server must resolve inside this directory (`lora_adapter_path`); None: no check.
        self.adapter_root = Path(adapter_root).resolve() if adapter_root is not None else None
        self.recovery = recovery  # a ServerRecovery: wait for a server that went away (None: fail at once)
        self.clients = list(clients)
        self.prefix = prefix
        self.sync_mode = sync_mode
        self.pause_mode = pause_mode
        self.current_name: str | None = None  # the version every server serves to new requests
        self.loaded: dict[str, Path] = {}  # adapter name -> directory, for every version still loaded
        # Servers paused by a sync in progress; `halt()` resumes them. Servers are paused concurrently, so the lock
        # is not held across a pause call: `halt()` waits for the calls on their way (`_pausing`) before it resumes,
        # so a halt either comes first and no pause is sent, or resumes the server after its pause has landed.
        self._pause_lock = threading.Condition()
        self._paused: dict[str, object] = {}  # base_url -> client
        self._pausing: set[str] = set()  # base_urls whose pause call has not returned yet
        self._halted = threading.Event()

    def halt(self) -> list[str]:
        """Stop syncing for good and resume every server a sync in progress has paused; returns their URLs.
        Safe from a signal handler on another thread than the publisher's: it never waits for the sync itself, only
        for pause calls on their way (at most HALT_WAIT_S), so that its resume lands after them."""
        with self._pause_lock:
            self._halted.set()  # from here on no pause is sent
            if not self._pause_lock.wait_for(lambda: not self._pausing, timeout=HALT_WAIT_S):
                log.error("pause calls to %s did not return within %g s; resuming anyway (a pause landing later is "
                          "undone by its sync's own resume, if the process lives on)", sorted(self._pausing),
                          HALT_WAIT_S)
            paused = list(self._paused.items())
            self._paused.clear()  # a second halt (the signal watcher's, then the handler's) finds nothing to do
        resumed = []
        for url, client in paused:
            try:
                client.resume()
                resumed.append(url)
                log.warning("resumed %s, which a weight sync in progress had paused", url)
            except Exception as exc:  # noqa: BLE001 - try every server, report each that could not be resumed
                log.error("could not resume %s (%s); %s", url, exc, resume_hint(url))
        return resumed

    def _pause(self, client) -> None:
        url = client.base_url
        with self._pause_lock:
            if self._halted.is_set():
                raise SyncError("the process is stopping (SIGTERM/SIGINT): this sync was not started")
            self._paused[url] = client  # first: a pause that times out may still have paused it
            self._pausing.add(url)
        try:
            client.pause(mode=self.pause_mode)
        except BaseException:
            with self._pause_lock:
                self._paused.pop(url, None)
            with contextlib.suppress(Exception):  # best effort: the pause's own error is the one to report
                client.resume()
            raise
        finally:
            with self._pause_lock:  # after the resume above: a halt waiting for this call resumes after both
                self._pausing.discard(url)
                self._pause_lock.notify_all()

    def _resume(self, client) -> None:
        try:
            client.resume()
        except InferenceServerError as exc:
            if isinstance(exc, ServerUnreachableError):
                raise  # down or restarting (a restarted server is not paused): recovery handles it
            raise SyncError(f"{exc}\n  The server {client.base_url} may still be paused: "
                            f"{resume_hint(client.base_url)}") from exc
        finally:
            with self._pause_lock:
                self._paused.pop(client.base_url, None)

    def name(self, version: int) -> str:
        return version_name(self.prefix, version)

    def publish(self, version: int, path: Path) -> PublishTiming:
        """Serve the adapter in `path` as version `version` on every server. On failure every server is
        resumed and still serves the previous version, and a SyncError says which server failed and why."""
        path = contained_adapter_path(path, self.adapter_root)
        try:
            verify_adapter_files(path)  # once, before any server is asked to read it
        except SyncError as exc:
            raise SyncError(f"{exc}\n  No server was asked to load it; the servers still serve "
                            f"{self.current_name or 'no adapter'}.") from exc
        name = self.name(version)
        t0 = time.perf_counter()
        # Every server gets the files before any is paused (http: an upload to each receiver, all at once).
        failed = self.delivery.stage_all(self.clients, name, path)
        if failed:
            client, exc = failed[0]
            if not isinstance(exc, Exception):
                raise exc  # KeyboardInterrupt, SystemExit: as they are
            others = "".join(f"\n  {c.base_url} failed too: {e}" for c, e in failed[1:])
            raise SyncError(f"delivering {path} to {client.base_url} failed: {exc}{others}\n  No server was asked to "
                            f"load it; the servers still serve {self.current_name or 'no adapter'}.") from exc
        outcomes = self._activate_all(name, path)
        failed = [(client, exc) for client, _, exc in outcomes if exc is not None]
        if failed:
            for client, _, exc in outcomes:  # all servers or none: take the new version off those that got it
                if exc is None:
                    self._unload_quietly(client, name)
            client, exc = failed[0]
            if not isinstance(exc, Exception):
                raise exc  # KeyboardInterrupt, SystemExit: propagate as they are, after the clean-up
            others = "".join(f"\n  {c.base_url} failed too: {e}" for c, e in failed[1:])
            raise SyncError(f"publishing {path} to {client.base_url} failed: {exc}\n  "
                            f"{self._state_after_failure(client, exc)}{others}") from exc
        self.loaded[name] = path
        self.current_name = name
        timings = [t for _, t, _ in outcomes]
        return PublishTiming(server_s=time.perf_counter() - t0, paused_s=max(t.paused_s for t in timings),
                             load_s=max(t.load_s for t in timings), server_sum_s=sum(t.server_s for t in timings))

    def _activate_all(self, name: str, path: Path) -> list[tuple[object, PublishTiming, BaseException | None]]:
        """`_activate_recovering` on every server at once, one thread each; waits for all of them (a server that
        fails does not cut the others short: all-or-nothing needs to know which got the new version). Returns
        (client, its timing, its error or None) per server, in `self.clients` order. Daemon threads: a call stuck
        on a dead server never holds up the process's exit (`halt()` resumes what they paused)."""
        outcomes: list = [None] * len(self.clients)

        def activate(i: int, client) -> None:
            timing = PublishTiming()
            t0 = time.perf_counter()
            try:
                timing.paused_s = self._activate_recovering(client, name, path, timing)
                outcomes[i] = (client, timing, None)
            except BaseException as exc:  # noqa: BLE001 - handed to publish(), which cleans up and re-raises
                outcomes[i] = (client, timing, exc)
            timing.server_s = time.perf_counter() - t0  # this server's own activation

        if len(self.clients) == 1:
            activate(0, self.clients[0])  # nothing to overlap: no thread
            return outcomes
        threads = [threading.Thread(target=activate, args=(i, c), name=f"sync-{c.base_url}", daemon=True)
                   for i, c in enumerate(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return outcomes

    def restore(self, client) -> None:
        """Re-register the current version on a server that lost it (a restarted vLLM knows no adapters)."""
        name = self.current_name
        path = self.loaded.get(name) if name is not None else None
        if path is None:
            return  # nothing published yet
        if self._serves(client, name, path):
            return  # still loaded: the server did not restart (a network fault)
        verify_adapter_files(path)
        self.delivery.load(client, name, path)  # http: the receiver's copy, uploaded again only if it lost it
        self._check_served(client, name, path)
        log.warning("re-registered %s (%s) on %s", name, path, client.base_url)

    def _activate_recovering(self, client, name: str, path: Path, timing: PublishTiming | None = None) -> float:
        """`_activate`; if the server is unreachable, wait for it to come back (and get the current version
        back), then once more."""
        seen = self.recovery.epoch(client) if self.recovery is not None else 0
        try:
            return self._activate(client, name, path, timing)
        except ServerUnreachableError as exc:
            if self.recovery is None:
                raise
            self.recovery.recover(client, seen, cause=exc)
        if client.adapter_paths().get(name) is not None:  # the load went through before the connection broke
            self._check_served(client, name, path)
            return 0.0
        return self._activate(client, name, path, timing)

    def _load(self, client, name: str, path: Path, timing: PublishTiming | None) -> None:
        t0 = time.perf_counter()
        self.delivery.load(client, name, path)
        if timing is not None:
            timing.load_s += time.perf_counter() - t0

    def _activate(self, client, name: str, path: Path, timing: PublishTiming | None = None) -> float:
        """Load `name` on one server (pausing it in pause mode), then read it back; returns the seconds paused."""
        paused_s = 0.0
        if self.current_name is None or self.sync_mode == "versioned":
            # The first version (nothing is generating yet), or versioned mode: load beside the old versions.
            self._load(client, name, path, timing)
        else:
            self._pause(client)  # recorded, so that a SIGTERM during the sync resumes the server (halt)
            paused_at = time.perf_counter()
            try:
                self._load(client, name, path, timing)  # a failed load leaves nothing loaded under `name`
                try:
                    client.reset_prefix_cache()
                except BaseException:
                    self._unload_quietly(client, name)
                    raise
            finally:
                self._resume(client)  # always: a paused server stalls every rollout
                paused_s = time.perf_counter() - paused_at
        # Read back (after resuming: no request uses `name` before publish() returns, so the check need not hold up
        # generation); a failed check takes the new version off before anyone sees it.
        try:
            self._check_served(client, name, path)
        except BaseException:
            self._unload_quietly(client, name)
            raise
        return paused_s

    def _state_after_failure(self, client, exc: BaseException) -> str:
        """What a failed sync left on `client`, as far as is known (a dead server serves nothing)."""
        dead = (ServerUnreachableError, ServerGoneError)
        if isinstance(exc, dead) or isinstance(exc.__cause__, dead):
            return "The server did not answer (it is down or restarting); nothing is being served by it now."
        if client.base_url in self._paused:
            return f"The server may still be paused: {resume_hint(client.base_url)}."
        return f"The server is not paused and still serves {self.current_name or 'no adapter'}."

    def unload_all(self, keep: str | None = None) -> list[str]:
        """At the end of a run: unload every version this run loaded except `keep`, so that they stop holding the
        servers' `--max-loras` slots. Best effort, and never slow: a server that does not answer /health now is
        skipped (a dead server holds nothing; waiting for it would hold up the exit)."""
        unloaded = []
        names = [n for n in self.loaded if n != keep]
        for client in self.clients:
            if not names:
                break
            if not client.health():
                log.warning("%s does not answer; the run's adapters were not unloaded from it", client.base_url)
                continue
            for name in names:
                try:
                    client.unload_adapter(name)
                    unloaded.append(name)
                except InferenceServerError as exc:
                    if exc.status != 404:  # 404: not loaded there (a restarted server)
                        log.warning("%s was not unloaded from %s: %s", name, client.base_url, exc)
        self.loaded = {n: p for n, p in self.loaded.items() if n == keep}
        return unloaded

    def retire(self, in_use: set[str]) -> None:
        """Unload every version but the current one that no request uses any more."""
        for name in [n for n in self.loaded if n != self.current_name and n not in in_use]:
            for client in self.clients:
                try:
                    client.unload_adapter(name)
                except InferenceServerError as exc:
                    if exc.status != 404 and not isinstance(exc, ServerUnreachableError):
                        raise
                    # 404: a restarted server never had it; unreachable: it is being recovered without it
                    log.warning("%s was not unloaded from %s: %s", name, client.base_url, exc)
            del self.loaded[name]

    @staticmethod
    def _unload_quietly(client, name: str) -> None:
        try:
            client.unload_adapter(name)
        except Exception as exc:  # report it, but let the original failure be the one raised
            log.error("could not unload %s from %s after a failed sync: %s", name, client.base_url, exc)

    def _serves(self, client, name: str, path: Path) -> bool:
        """Whether `client` serves `name` from where this delivery put `path` (http: the receiver's copy)."""
        return _same_path(client.adapter_paths().get(name), self.delivery.served_path(client, name, path))

    def _check_served(self, client, name: str, path: Path) -> None:
        served, want = client.adapter_paths().get(name), self.delivery.served_path(client, name, path)
        if not _same_path(served, want):
            raise SyncError(f"server {client.base_url} reports adapter {name!r} at {served!r} after loading "
                            f"{want!r}; the new version was not applied")


def _same_path(served: str | None, want: str | None) -> bool:
    return served is not None and want is not None and Path(served).resolve() == Path(want).resolve()
