"""How an adapter version's files reach an inference server (`adapter_delivery`), behind the publisher's load step.

`SharedFsDelivery` (`shared_fs`): the server reads the trainer's `lora_adapter_path` at the same path.
`HttpDelivery` (`http`): the files are uploaded to an adapter receiver beside each server (inference_node/receiver.py)
before any pause, and the receiver loads its own copy. Both answer `stage_all`, `stage`, `load` and `served_path`;
docs/publish-internals.md says what each does and when, docs/delivery.md how to set `http` up.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import requests

from asyncgrpo.config import API_KEY_ENV, InferenceSettings
from asyncgrpo.errors import InferenceServerError, ServerUnreachableError, SyncError
from asyncgrpo.inference.recovery import backoff_delays
from asyncgrpo.receiver_timeouts import ADMIN_TIMEOUT_S, CONNECT_TIMEOUT_S, HEALTH_TIMEOUT_S, UPLOAD_TIMEOUT_S
from asyncgrpo.redact import redact
from asyncgrpo.store import MANIFEST_NAME

log = logging.getLogger(__name__)


class SharedFsDelivery:
    """The server reads the trainer's adapter directory (the default)."""

    name = "shared_fs"

    def stage(self, client, name: str, path: Path) -> None:
        """Nothing to send: the server reads `path` itself."""

    def stage_all(self, clients, name: str, path: Path) -> list[tuple[object, BaseException]]:
        """Nothing to send to any server."""
        return []

    def load(self, client, name: str, path: Path) -> None:
        client.load_adapter(name, str(path))

    def served_path(self, client, name: str, path: Path) -> str:
        return str(path.resolve())


class ReceiverClient:
    """HTTP client of one adapter receiver (inference_node/receiver.py)."""

    def __init__(self, base_url: str, api_key: str | None):
        self.base_url = base_url.rstrip("/")
        self._session = requests.Session()
        self._lock = threading.Lock()  # the publisher and a recovery thread may both call: one Session, one at a time
        self._session.trust_env = False  # no proxies or ~/.netrc: a private network, and the bearer token wins
        self._api_key = api_key
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def _call(self, what: str, method: str, route: str, *, timeout_s: float, **kwargs) -> dict:
        url = f"{self.base_url}{route}"
        try:
            with self._lock:
                resp = self._session.request(method, url, timeout=(CONNECT_TIMEOUT_S, timeout_s), **kwargs)
        except requests.ConnectionError as exc:
            raise self._error(
                f"{what}: cannot reach the adapter receiver at {url} ({exc.__class__.__name__}). Start it beside vLLM "
                f"(`launch/vllm/receiver.sh`) or fix adapter_receiver_url", unreachable=True) from exc
        except requests.RequestException as exc:
            raise self._error(f"{what}: {method} {url} failed: {exc}") from exc
        if not resp.ok:
            text = redact(resp.text, self._api_key)  # before the cut below (redact.py)
            try:
                detail = redact(str(resp.json().get("error", text)), self._api_key)
            except (ValueError, AttributeError):
                detail = text[:2000]
            hint = (f". Set {API_KEY_ENV} to the key the receiver was started with" if resp.status_code == 401 else "")
            raise self._error(f"{what}: {method} {url} answered HTTP {resp.status_code}: {detail}{hint}",
                              status=resp.status_code, body=resp.text)
        try:
            return resp.json()
        except ValueError:
            raise self._error(f"{what}: {method} {url} answered {resp.status_code} with a body that is not JSON: "
                              f"{redact(resp.text, self._api_key)[:200]!r}", status=resp.status_code,
                              body=resp.text) from None

    def _error(self, message: str, status: int | None = None, body: str | None = None,
               unreachable: bool = False) -> InferenceServerError:
        """An InferenceServerError (ServerUnreachableError when no answer came) with the API key scrubbed from
        everything it carries, as InferenceClient._error does: a receiver or a proxy in front of it may quote the
        request, its Authorization header included, back in its answer."""
        message = redact(message, self._api_key)
        body = redact(body, self._api_key) if body is not None else None
        kind = ServerUnreachableError if unreachable else InferenceServerError
        return kind(message, status=status, body=body)

    def health(self) -> bool:
        try:
            resp = self._session.get(f"{self.base_url}/health", timeout=(CONNECT_TIMEOUT_S, HEALTH_TIMEOUT_S))
            return resp.status_code == 200
        except requests.RequestException:
            return False

    def committed(self) -> list[str]:
        """The versions committed there (needs the key: how the doctor checks it)."""
        return self._call("list adapters", "GET", "/adapters", timeout_s=ADMIN_TIMEOUT_S)["committed"]

    def upload(self, name: str, directory: Path) -> str:
        """Send every file named in `directory`'s manifest, then commit; returns the receiver's path for it."""
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
        for filename in manifest:
            with open(directory / filename, "rb") as f:
                self._call(f"upload {filename}", "PUT", f"/adapters/{name}/{filename}", data=f,
                           timeout_s=UPLOAD_TIMEOUT_S)
        return self._call(f"commit {name}", "POST", f"/adapters/{name}/commit", json=manifest,
                          timeout_s=ADMIN_TIMEOUT_S)["path"]

    def load(self, name: str) -> str:
        """Load the committed version into the receiver's vLLM; returns the path vLLM reports."""
        return self._call(f"load {name}", "POST", f"/adapters/{name}/load", timeout_s=ADMIN_TIMEOUT_S)["path"]

    def close(self) -> None:
        self._session.close()


class HttpDelivery:
    """Each server's receiver gets the files (`stage`) and loads its own copy (`load`)."""

    name = "http"

    def __init__(self, receivers: dict[str, ReceiverClient], outage_s: float = 0.0, sleep=time.sleep):
        self.receivers = receivers  # vLLM base URL -> the receiver beside it
        self.outage_s = outage_s  # how long a receiver that stopped answering is waited for (vllm_server_timeout)
        self._sleep = sleep
        self._paths: dict[tuple[str, str], str] = {}  # (vLLM base URL, adapter name) -> the receiver's path

    def _receiver(self, client) -> ReceiverClient:
        return self.receivers[client.base_url]

    def _surviving(self, receiver: ReceiverClient, call):
        """`call()`; if the receiver does not answer (restarting, its node rebooting), wait up to `outage_s` for its
        /health, then `call()` once more (every receiver call is idempotent). A receiver outage is the receiver's
        own: the vLLM server beside it may be up, so it is not left to the server's recovery, which would find the
        server healthy and retry at once."""
        try:
            return call()
        except ServerUnreachableError as exc:
            if self.outage_s <= 0:
                raise
            cause = exc
        log.warning("adapter receiver %s stopped answering (%s); waiting up to %g s (vllm_server_timeout) for it to "
                    "come back", receiver.base_url, cause, self.outage_s)
        waited = 0.0
        for delay in backoff_delays(self.outage_s):
            self._sleep(delay)
            waited += delay
            if receiver.health():
                log.warning("adapter receiver %s is back after %.1f s", receiver.base_url, waited)
                return call()
        raise SyncError(f"the adapter receiver at {receiver.base_url} stopped answering and did not come back within "
                        f"{self.outage_s:g} s (vllm_server_timeout). Fix: restart it beside vLLM on the same address "
                        f"(launch/vllm/receiver.sh), then start the run again from its last checkpoint in output_dir; "
                        f"or raise vllm_server_timeout") from cause

    def stage(self, client, name: str, path: Path) -> None:
        """Upload and commit (idempotent: a version committed before answers at once)."""
        receiver = self._receiver(client)
        self._paths[(client.base_url, name)] = self._surviving(receiver, lambda: receiver.upload(name, path))

    def stage_all(self, clients, name: str, path: Path) -> list[tuple[object, BaseException]]:
        """`stage` on every server's receiver at once, one thread each (receivers are separate nodes: the uploads
        overlap); waits for all of them, so that a failure reports every receiver that failed. Returns (client,
        error) for each that failed, in `clients` order; empty when every receiver committed the version. A
        receiver that committed it serves nothing new: loading comes later, and only if none failed. Daemon
        threads: an upload stuck on a dead receiver never holds up the process's exit."""
        errors: list[BaseException | None] = [None] * len(clients)

        def upload(i: int, client) -> None:
            try:
                self.stage(client, name, path)  # each thread writes its own key of `_paths`
            except BaseException as exc:  # noqa: BLE001 - handed to the publisher, which raises it
                errors[i] = exc

        if len(clients) == 1:
            upload(0, clients[0])  # nothing to overlap: no thread
        else:
            threads = [threading.Thread(target=upload, args=(i, c), name=f"stage-{c.base_url}", daemon=True)
                       for i, c in enumerate(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        return [(c, e) for c, e in zip(clients, errors) if e is not None]

    def load(self, client, name: str, path: Path) -> None:
        receiver = self._receiver(client)
        try:
            served = self._surviving(receiver, lambda: receiver.load(name))
        except InferenceServerError as exc:
            if exc.status != 404:
                raise
            # Not committed there: a replaced node (or receiver directory) lost it, e.g. a restarted server.
            log.warning("%s does not hold %s; uploading it again", receiver.base_url, name)
            self.stage(client, name, path)
            served = self._surviving(receiver, lambda: receiver.load(name))
        want = self._paths.get((client.base_url, name))
        if served != want:
            raise SyncError(f"the receiver {receiver.base_url} reports {name} served from {served!r}, but committed "
                            f"it at {want!r}")

    def served_path(self, client, name: str, path: Path) -> str | None:
        return self._paths.get((client.base_url, name))

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()


def make_delivery(inference: InferenceSettings):
    """The delivery `inference.adapter_delivery` asks for, with one receiver per server for `http`."""
    if inference.adapter_delivery == "shared_fs":
        return SharedFsDelivery()
    return HttpDelivery({url: ReceiverClient(receiver, inference.api_key)
                         for url, receiver in zip(inference.server_urls, inference.receiver_urls, strict=True)},
                        outage_s=inference.vllm_server_timeout)
