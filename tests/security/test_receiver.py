"""Attacks on the adapter receiver (inference_node/receiver.py), each against a real receiver on 127.0.0.1 in a thread
with FakeVLLM behind it: listening beyond loopback without a key, a stalled upload, a flood of idle connections,
partial uploads, malformed requests, planted symlinks, names ending in a newline, a disk too small, and the trainer's
client quoting the key back. Every probe also checks that nothing was written where it must not be."""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import select
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import requests
from fakes import FakeVLLM, StubServer
from liveness import returns_within

from asyncgrpo.config import API_KEY_ENV
from asyncgrpo.errors import InferenceServerError
from asyncgrpo.inference_node.receiver import (
    FREE_SPACE_MARGIN_BYTES,
    MANIFEST_NAME,
    AdapterReceiver,
    Refused,
    check_args,
    is_loopback,
    main,
    serve,
)
from asyncgrpo.rollout.delivery import ReceiverClient

KEY = "receiver-attack-test-key"
FILES = {"adapter_model.safetensors": b"\x00weights" * 100, "adapter_config.json": b'{"r": 8}'}
DEADLINE_S = 5.0  # every wait below ends in milliseconds when the receiver is right; this only bounds a failure
BOUND_S = 10.0  # liveness bound of a call that hangs for good when the receiver is wrong


def manifest(files: dict[str, bytes]) -> dict:
    return {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}


def entries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def wait_for(condition, what: str, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {deadline_s} s"
        time.sleep(0.01)
    return value


class Started:
    """One receiver serving on 127.0.0.1 in a thread, plus the raw sockets a test opens against it."""

    def __init__(self, rec: AdapterReceiver, **options):
        self.rec = rec
        self.server = serve(rec, "127.0.0.1", 0, KEY, **options)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()
        self.session = requests.Session()
        self.session.trust_env = False
        self.session.headers["Authorization"] = f"Bearer {KEY}"
        self.sockets: list[socket.socket] = []

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=DEADLINE_S)
        self.sockets.append(sock)
        return sock

    def handler_threads(self) -> int:
        """The receiver's connection threads (named `receiver:{port} ...`)."""
        return sum(t.name.startswith(f"receiver:{self.port} ") for t in threading.enumerate())

    def upload(self, name: str, files: dict[str, bytes]) -> requests.Response:
        for filename, data in files.items():
            resp = self.session.put(f"{self.url}/adapters/{name}/{filename}", data=data, timeout=DEADLINE_S)
            assert resp.status_code == 200, resp.text
        return self.session.post(f"{self.url}/adapters/{name}/commit", json=manifest(files), timeout=DEADLINE_S)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.session.close()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def start(tmp_path):
    started: list[Started] = []

    def make(vllm=None, max_file_bytes: int = 1 << 20, **options) -> Started:
        started.append(Started(AdapterReceiver(tmp_path / "adapters", vllm, max_file_bytes=max_file_bytes),
                               **options))
        return started[-1]

    yield make
    for s in started:
        s.close()


def request_head(method: str, route: str, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {route} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on `sock` (fails if it is not JSON)."""
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    assert resp.getheader("Content-Type") == "application/json", resp.getheaders()
    return resp.status, json.loads(resp.read())


def part_files(root: Path) -> list[Path]:
    return list(root.glob(".part-*"))


# ---- who may listen where -------------------------------------------------------------------------------------------
def test_main_refuses_to_listen_beyond_loopback_without_a_key_before_making_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for host in ("0.0.0.0", "10.1.2.3"):
        with pytest.raises(SystemExit) as info:
            main(["--dir", str(tmp_path / "adapters"), "--host", host, "--port", "0"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "`--host`" in err and repr(host) in err and API_KEY_ENV in err and "--host 127.0.0.1" in err
    assert not (tmp_path / "adapters").exists()  # refused before the directory (or a socket) was made
    # the default host is loopback: without a key the only complaint about this command line is the port
    with pytest.raises(SystemExit):
        main(["--dir", str(tmp_path / "adapters"), "--port", "70000"])
    err = capsys.readouterr().err
    assert "`--port`" in err and "70000" in err and "--host" not in err


def test_the_loopback_check_and_the_ranges_of_the_flags():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("127.5.6.7")
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "10.0.0.5", "no-such-host.invalid"))
    flags = {"host": "0.0.0.0", "port": 8001, "keep": 8, "max_file_bytes": 1 << 30, "socket_timeout": 60.0,
             "max_connections": 32}
    check_args(argparse.Namespace(**flags), api_key="k")  # with a key every interface is allowed
    for flag, bad in (("port", -1), ("keep", -2), ("max_file_bytes", 0), ("socket_timeout", 0.0),
                      ("max_connections", 0)):
        with pytest.raises(Exception, match=f"`--{flag.replace('_', '-')}`") as info:
            check_args(argparse.Namespace(**{**flags, flag: bad}), api_key="k")
        assert type(info.value).__name__ == "ConfigError"


# ---- a stalled upload, idle connections -----------------------------------------------------------------------------
def test_a_stalled_upload_blocks_no_other_version_s_commit_or_load(start):
    vllm = FakeVLLM(strict=False)
    s = start(vllm, socket_timeout_s=30.0)  # the stall outlasts the test: only the other version's calls may end it
    stalled = s.connect()
    stalled.sendall(request_head("PUT", "/adapters/v1/adapter_model.safetensors", {"Content-Length": "100000"}))
    stalled.sendall(b"x" * 10)  # and nothing more
    wait_for(lambda: part_files(s.rec.root), "the stalled upload's .part file")

    def publish_v2():
        committed = s.upload("v2", FILES)
        loaded = s.session.post(f"{s.url}/adapters/v2/load", timeout=DEADLINE_S)
        return committed, loaded

    committed, loaded = returns_within(publish_v2, BOUND_S, "v2's upload, commit and load beside a stalled upload")
    assert committed.status_code == 200 and committed.json()["written"] is True
    assert loaded.status_code == 200 and loaded.json() == {"path": str(s.rec.root / "v2")}
    assert vllm.served == {"v2": str(s.rec.root / "v2")}
    stalled.close()  # the client gives up: its partial file goes, nothing of v1 stays
    wait_for(lambda: not part_files(s.rec.root), "the abandoned .part file removed")
    assert entries(s.rec.root) == sorted(["v2", *(f"v2/{n}" for n in [*FILES, MANIFEST_NAME])])


def test_a_stalled_upload_is_cut_at_the_socket_timeout_and_leaves_nothing(start):
    s = start(socket_timeout_s=0.3)
    before = s.handler_threads()
    stalled = s.connect()
    stalled.sendall(request_head("PUT", "/adapters/v1/adapter_model.safetensors", {"Content-Length": "1000"}))
    stalled.sendall(b"x" * 10)
    status, body = read_answer(stalled)  # answered (and closed) by the receiver, not by the test giving up
    assert status == 408 and "stalled after 10 of 1000 bytes" in body["error"]
    assert stalled.recv(1) == b""
    wait_for(lambda: s.handler_threads() == before, "the stalled connection's thread ended")
    assert entries(s.rec.root) == []


def test_a_body_cut_short_leaves_no_part_file(start):
    s = start()
    sock = s.connect()
    sock.sendall(request_head("PUT", "/adapters/v1/adapter_config.json", {"Content-Length": "1000"}) + b"x" * 10)
    sock.shutdown(socket.SHUT_WR)  # the client's end of the body: 10 of 1000 bytes
    status, body = read_answer(sock)
    assert status == 400 and "ended after 10 of 1000 bytes" in body["error"]
    assert entries(s.rec.root) == []


def test_a_flood_of_idle_connections_is_capped_and_answered_and_a_real_client_gets_through_after_it(start):
    cap = 8
    s = start(socket_timeout_s=30.0, max_connections=cap)
    before = s.handler_threads()
    flood = [s.connect() for _ in range(200)]
    wait_for(lambda: s.handler_threads() - before == cap, f"{cap} connection threads")
    turned_away: list[socket.socket] = []

    def answered() -> bool:  # the 192 beyond the cap are answered 503 and closed, without a thread each
        waiting = [c for c in flood if c not in turned_away]
        ready, _, _ = select.select(waiting, [], [], 0.05)
        turned_away.extend(ready)
        return len(turned_away) >= 200 - cap

    wait_for(answered, "503 answers to the connections beyond the cap")
    assert len(turned_away) == 200 - cap and s.handler_threads() - before == cap
    status, body = read_answer(turned_away[0])
    assert status == 503 and f"{cap} connections open" in body["error"]
    real = s.session.get(f"{s.url}/adapters", timeout=DEADLINE_S)  # an answer now, not a hang
    assert real.status_code == 503 and "limit" in real.json()["error"]
    for c in flood:
        c.close()  # the flood ends: its slots come free at once
    wait_for(lambda: s.handler_threads() == before, "the flood's threads ended")
    assert s.session.get(f"{s.url}/adapters", timeout=DEADLINE_S).json() == {"committed": []}


def test_idle_connections_are_closed_at_the_socket_timeout(start):
    s = start(socket_timeout_s=0.3, max_connections=8)
    before = s.handler_threads()
    idle = [s.connect() for _ in range(8)]
    wait_for(lambda: s.handler_threads() - before == 8, "8 connection threads")
    wait_for(lambda: s.handler_threads() == before, "the idle connections' threads ended at the timeout")
    for c in idle:
        assert c.recv(1) == b""  # closed by the receiver
    assert s.upload("v1", FILES).status_code == 200  # every slot free again


# ---- malformed requests ---------------------------------------------------------------------------------------------
DEEP = b"[" * 200_000 + b"]" * 200_000  # valid JSON, nested far past the parser's recursion limit


@pytest.mark.parametrize("raw, want", [
    (request_head("PUT", "/adapters/v1/adapter_config.json", {"Content-Length": "abc"}) + b"abc", 400),
    (request_head("PUT", "/adapters/v1/adapter_config.json", {"Content-Length": "-5"}), 400),
    (request_head("PUT", "/adapters/v1/adapter_config.json", {"Content-Length": "1e3"}), 400),
    (request_head("PUT", "/adapters/v1/adapter_config.json", {"Content-Length": "²"}), 400),
    (request_head("PUT", "/adapters/v1/adapter_config.json").replace(b"\r\n\r\n", b"\r\nContent-Length: 3\r\n"
                                                                     b"Content-Length: 4\r\n\r\n") + b"abcd", 400),
    (request_head("PUT", "/adapters/v1/adapter_config.json", {"Transfer-Encoding": "chunked"}) + b"3\r\nabc\r\n0\r\n\r\n",
     411),
    (request_head("PUT", "/adapters/v1/adapter_config.json"), 411),
    (request_head("POST", "/adapters/v1/commit", {"Content-Length": str(len(DEEP))}) + DEEP, 400),
    (request_head("POST", "/adapters/v1/commit", {"Content-Length": str(2 << 20)}), 413),
    (request_head("POST", "/adapters/v1/commit", {"Content-Length": "2"}) + b"[]", 400),
    (request_head("GET", "/nowhere"), 404),
    (request_head("DELETE", "/adapters/v1"), 404),
    (request_head("BREW", "/adapters"), 405),
    (b"NONSENSE\r\n\r\n", 400),
])
def test_a_malformed_request_gets_a_4xx_json_answer_and_writes_nothing(start, raw, want):
    s = start()
    sock = s.connect()
    sock.sendall(raw)
    status, body = returns_within(lambda: read_answer(sock), BOUND_S, "the answer to a malformed request")
    assert status == want and body["error"], body
    assert entries(s.rec.root) == []


@pytest.mark.parametrize("bad", [
    {"adapter_config.json": {"size": {"nested": [1, 2]}, "sha256": "0" * 64}},
    {"adapter_config.json": {"size": 8, "sha256": "0" * 64, "extra": {"deep": {}}}},
    {"adapter_config.json": {"size": True, "sha256": "0" * 64}},
    {"adapter_config.json": {"size": -1, "sha256": "0" * 64}},
    {"adapter_config.json": {"size": 8, "sha256": "not hex"}},
    {"adapter_config.json": [8, "0" * 64]},
])
def test_a_manifest_that_is_not_flat_file_size_sha256_is_refused(start, bad):
    s = start()
    s.session.put(f"{s.url}/adapters/v1/adapter_config.json", data=FILES["adapter_config.json"], timeout=DEADLINE_S)
    resp = s.session.post(f"{s.url}/adapters/v1/commit", json=bad, timeout=DEADLINE_S)
    assert resp.status_code == 400 and "adapter_config.json" in resp.json()["error"]
    assert not (s.rec.root / "v1").exists()


# ---- names and symlinks ---------------------------------------------------------------------------------------------
def test_a_name_ending_in_a_newline_is_refused(start):
    s = start()
    for parts in (("v1\n",), ("v1", "adapter_config.json\n")):
        with pytest.raises(Refused) as info:
            s.rec.inside(*parts)
        assert info.value.status == 400
    with pytest.raises(Refused):
        s.rec.put_file("v1\n", "adapter_config.json", 2, _Body(b"{}"))
    s.session.put(f"{s.url}/adapters/v1/adapter_config.json", data=b"{}", timeout=DEADLINE_S)
    resp = s.session.post(f"{s.url}/adapters/v1/commit", timeout=DEADLINE_S,
                          json={"adapter_config.json\n": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}})
    assert resp.status_code == 400 and "not a valid file name" in resp.json()["error"]
    assert entries(s.rec.root) == [".incoming-v1", ".incoming-v1/adapter_config.json"]  # staged, never committed


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def read(self, n: int) -> bytes:
        block, self.data = self.data[:n], self.data[n:]
        return block


def test_a_planted_staging_symlink_is_refused_and_nothing_is_written_outside(start, tmp_path):
    s = start()
    outside = tmp_path / "outside"
    outside.mkdir()
    (s.rec.root / ".incoming-v1").symlink_to(outside)
    resp = s.session.put(f"{s.url}/adapters/v1/adapter_config.json", data=b"{}", timeout=DEADLINE_S)
    assert resp.status_code == 409 and "symlink" in resp.json()["error"]
    assert list(outside.iterdir()) == [] and not part_files(s.rec.root)
    commit = s.session.post(f"{s.url}/adapters/v1/commit", json=manifest({"adapter_config.json": b"{}"}),
                            timeout=DEADLINE_S)
    assert commit.status_code == 409 and list(outside.iterdir()) == []


def test_a_planted_file_symlink_in_staging_is_never_read_or_committed(start, tmp_path):
    s = start()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not yours")
    stage = s.rec.root / ".incoming-v1"
    stage.mkdir()
    (stage / "adapter_config.json").symlink_to(secret)
    resp = s.session.post(f"{s.url}/adapters/v1/commit", json=manifest({"adapter_config.json": b"not yours"}),
                          timeout=DEADLINE_S)  # the manifest matches the secret: only the symlink check refuses
    assert resp.status_code == 422 and "not a regular file" in resp.json()["error"]
    assert entries(s.rec.root) == [] and secret.read_bytes() == b"not yours"


@pytest.mark.parametrize("target", ["outside", "inside"])
def test_a_planted_version_symlink_is_neither_loaded_nor_committed_over(start, tmp_path, target):
    vllm = FakeVLLM(strict=False)
    s = start(vllm)
    assert s.upload("v1", FILES).status_code == 200
    if target == "outside":
        pointed = tmp_path / "elsewhere"
        pointed.mkdir()
        (pointed / MANIFEST_NAME).write_text(json.dumps(manifest(FILES)))
    else:  # another committed version: resolving alone would stay inside the directory and load v1's files as v9
        pointed = s.rec.root / "v1"
    (s.rec.root / "v9").symlink_to(pointed)
    load = s.session.post(f"{s.url}/adapters/v9/load", timeout=DEADLINE_S)
    assert load.status_code == 400 and "symlink" in load.json()["error"]
    assert vllm.served == {}
    put = s.session.put(f"{s.url}/adapters/v9/adapter_config.json", data=b"{}", timeout=DEADLINE_S)
    commit = s.session.post(f"{s.url}/adapters/v9/commit", json=manifest(FILES), timeout=DEADLINE_S)
    assert put.status_code == commit.status_code == 400 and "symlink" in commit.json()["error"]
    assert sorted(p.name for p in pointed.iterdir()) == sorted([*(FILES if target == "inside" else []), MANIFEST_NAME])
    assert s.session.get(f"{s.url}/adapters", timeout=DEADLINE_S).json() == {"committed": ["v1"]}


# ---- disk space -----------------------------------------------------------------------------------------------------
def test_an_upload_larger_than_the_free_space_is_refused_507_before_its_body(start):
    s = start(max_file_bytes=1 << 62)
    too_big = shutil.disk_usage(s.rec.root).free + (1 << 30)
    sock = s.connect()
    sock.sendall(request_head("PUT", "/adapters/v1/adapter_model.safetensors", {"Content-Length": str(too_big)}))
    status, body = read_answer(sock)
    assert status == 507 and "bytes free" in body["error"]
    assert entries(s.rec.root) == []


def test_space_promised_to_an_upload_in_flight_counts_against_the_next(start):
    s = start(max_file_bytes=1 << 62)
    half = (shutil.disk_usage(s.rec.root).free - FREE_SPACE_MARGIN_BYTES) // 2
    first = s.connect()
    slack = 256 << 20  # the disk's free space may drift while the test runs (other writers)
    first.sendall(request_head("PUT", "/adapters/v1/a.bin", {"Content-Length": str(half + slack)}) + b"x")
    wait_for(lambda: part_files(s.rec.root), "the first upload admitted")
    second = s.connect()
    second.sendall(request_head("PUT", "/adapters/v1/b.bin", {"Content-Length": str(half)}))
    status, body = read_answer(second)
    assert status == 507 and "promised to uploads in progress" in body["error"]
    first.shutdown(socket.SHUT_WR)  # the first one ends short: its promise is released
    assert read_answer(first)[0] == 400
    third = s.connect()
    third.sendall(request_head("PUT", "/adapters/v1/b.bin", {"Content-Length": str(half)}) + b"y")
    third.shutdown(socket.SHUT_WR)
    assert read_answer(third)[0] == 400  # admitted now (then cut short by the test), not 507
    assert entries(s.rec.root) == []


# ---- the trainer's client -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["application/json", "text/plain"])
def test_the_receiver_client_scrubs_the_key_a_server_quotes_back(content_type):
    def echo(stub, handler):
        quoted = handler.headers.get("Authorization", "")
        text = json.dumps({"error": f"rejected {quoted}"}) if content_type == "application/json" else f"no {quoted}"
        return 403, content_type, text

    stub = StubServer(echo)
    try:
        with pytest.raises(InferenceServerError) as info:
            ReceiverClient(stub.url, KEY).committed()
    finally:
        stub.close()
    assert KEY in stub.requests[0]["headers"]["Authorization"]  # it was sent, and quoted back
    assert KEY not in str(info.value) and KEY not in info.value.body
    assert "***" in str(info.value) and "***" in info.value.body and info.value.status == 403
