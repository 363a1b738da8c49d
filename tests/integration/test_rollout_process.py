"""`rollout_process: true` against the session's real vLLM server: a 2-process accelerate run (DDP, gloo) trains with
its rollout side in a child process of rank 0, and no child outlives it; a rollout process killed mid-run stops the
trainer with an error naming it, never a hang; SIGTERM during a sync held paused reaches the child, which resumes the
server before the run exits 143. And the other-host form: `asyncgrpo rollout-serve` started on its own, which the
run reaches by `rollout_address` over loopback TCP, serves the run and exits 0 after its close."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from integration.runs import REPO, held_sync, is_paused, module_run, run_adapters, train

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.config import ROLLOUT_KEY_ENV
from asyncgrpo.inference_node.vllm_server import find_free_port

CHILD = re.compile(r"rollout side running in its own process \(pid (\d+)\)")
CHILD_RUN = ("--rollout_process", "true", "--max_steps", "30")  # a single-process run whose rollout side is a child


def _alive(pid: int) -> bool:
    """Whether `pid` is still a (non-zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _child_pid(log: str) -> int:
    found = CHILD.findall(log)
    assert len(found) == 1, log[-3000:]  # rank 0 alone spawns one
    return int(found[0])


two_process_run = module_run("rollout-process", "--rollout_process", "true", "--max_steps", "3",
                             "--per_device_train_batch_size", "32", "--learning_rate", "5e-3")


def test_a_run_with_its_rollout_side_in_a_child_process_trains_and_publishes(two_process_run, client, tb_scalars):
    out, summary, proc = two_process_run
    assert summary["steps"] == 3 and summary["version"] == 3
    assert [v for _, v in tb_scalars(out / "tensorboard", "policy/version")] == [1.0, 2.0, 3.0]
    assert len(tb_scalars(out / "tensorboard", "train/reward")) == 3  # the trainer's stats, written by the child
    assert len(tb_scalars(out / "tensorboard", "sync/server_s")) == 4  # the child's own publish timings (v0..v3)
    child = _child_pid(proc.stderr)  # rank 0 logs the pid it spawned; the child logs its own and its parent's
    assert re.search(rf"\[rollout\] .* rollout side started in process {child} \(parent \d+\)", proc.stderr)
    # close(keep_final=True) went through the pipe: the final version alone stays loaded.
    assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    assert run_adapters(client, summary) == [summary["adapter_name"]]


def test_no_rollout_process_outlives_the_run(two_process_run):
    _, _, proc = two_process_run
    assert not _alive(_child_pid(proc.stderr))
    assert "did not exit within" not in proc.stderr  # it closed and exited when asked, it was not killed


def test_a_rollout_process_killed_mid_sync_stops_the_trainer_naming_it_and_no_server_stays_paused(vllm_server,
                                                                                                   tmp_path):
    url = vllm_server.base_url
    # The proxy holds version 1's sync paused in the child: the kill lands mid-sync, the worst moment.
    with held_sync(url, tmp_path, *CHILD_RUN) as (proxy_url, proc):
        child = _child_pid((tmp_path / "train.log").read_text())
        os.kill(child, signal.SIGKILL)  # as the out-of-memory killer would
        code = proc.wait(timeout=120)  # reported within a poll, not after take's timeout
        paused_after = is_paused(url)
    log = (tmp_path / "train.log").read_text()
    assert code == 2, log[-3000:]
    assert f"asyncgrpo: error: the rollout process (pid {child}) was killed by SIGKILL while the trainer waited" in log
    assert "Fix:" in log and not (tmp_path / "run_summary.json").exists()
    # The child could not resume the server it paused; the trainer, still alive, did (and its message says so).
    assert f"It left {proxy_url} paused mid-sync; the trainer resumed them." in log
    assert paused_after is False, log[-3000:]
    assert not _alive(child)


def test_sigterm_reaches_the_rollout_process_which_resumes_a_paused_server(vllm_server, tmp_path):
    url = vllm_server.base_url
    # The proxy holds version 1's sync (in the child) paused until the server is resumed.
    with held_sync(url, tmp_path, *CHILD_RUN) as (proxy_url, proc):
        child = _child_pid((tmp_path / "train.log").read_text())
        proc.send_signal(signal.SIGTERM)  # to the trainer only, as a launcher does
        code = proc.wait(timeout=120)
        paused_after = is_paused(url)
    log = (tmp_path / "train.log").read_text()
    assert code == 143, log[-3000:]
    assert paused_after is False, log[-3000:]
    assert f"resumed {proxy_url}, which a weight sync in progress had paused" in log
    assert re.search(r"\[rollout\].*received SIGTERM: making sure no inference server is left paused", log), log[-3000:]
    assert not _alive(child)


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("asyncgrpo: error:")]


def test_an_error_in_the_rollout_process_reaches_the_user_as_it_would_in_process(tmp_path):
    """No server answers: the child's start-up fails; the trainer raises the same type with the same message (the CLI
    prints AsyncGRPOErrors as one line; a fallback RolloutProcessError would read differently)."""
    dead = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    lines = {}
    for mode in ("false", "true"):
        proc = train(dead, tmp_path / mode, *CHILD_RUN, "--rollout_process", mode, "--vllm_server_timeout", "2")
        code = proc.wait(timeout=240)
        log = (tmp_path / mode / "train.log").read_text()
        assert code == 2, log[-3000:]
        lines[mode] = _error_lines(log)
    assert len(lines["true"]) == 1 and dead in lines["true"][0]
    assert lines["true"] == lines["false"]


LISTENING = re.compile(r"\[rollout\] .* rollout server listening on (127\.0\.0\.1:\d+) ")
KEY = {ROLLOUT_KEY_ENV: "3c9e1f7a5b2d8046e1c3a9f7b5d2e804"}  # in both ends' environment (32 characters: the least)


def _rollout_serve(log_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`asyncgrpo rollout-serve --listen 127.0.0.1:0 *args` (output to `log_path`) and the address it logged."""
    server = subprocess.Popen([sys.executable, "-m", "asyncgrpo", "rollout-serve", "--listen", "127.0.0.1:0", *args],
                              cwd=REPO, env={**cpu_launch_env(), **KEY}, stdout=open(log_path, "w"),
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (found := LISTENING.search(log_path.read_text())):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(log_path.read_text()[-3000:])
        time.sleep(0.1)
    return server, found.group(1)


def test_a_run_trains_with_its_rollout_side_served_by_rollout_serve_which_exits_0_after_the_close(
        train_two_processes, client, tb_scalars, tmp_path, monkeypatch):
    """`asyncgrpo rollout-serve` as its own process (as on another host, over loopback TCP with the key of both ends'
    environment), with its own output_dir (a path override); the 2-process run connects to it by `rollout_address`."""
    remote_out, out = tmp_path / "rollout-host", tmp_path / "trainer"
    log_path = tmp_path / "rollout-serve.log"
    server, address = _rollout_serve(log_path, "--output_dir", str(remote_out))
    try:
        monkeypatch.setenv(ROLLOUT_KEY_ENV, KEY[ROLLOUT_KEY_ENV])  # the launch takes this process's environment
        summary, proc = train_two_processes(out, "--rollout_address", address, "--max_steps", "3",
                                            "--per_device_train_batch_size", "32", "--learning_rate", "5e-3")
        code = server.wait(timeout=60)  # it serves one run: the trainer's close ends it
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert summary["steps"] == 3 and summary["version"] == 3
    assert f"rollout side running at {address} (host " in proc.stderr  # connected, nothing spawned
    assert not CHILD.search(proc.stderr)
    assert re.search(r"\[rollout\] .* trainer connected from 127\.0\.0\.1:\d+", log)
    assert re.search(rf"\[rollout\] .* rollout side started in process {server.pid} ", log)
    # The stats went over TCP to the rollout host's writer, in the output_dir it was given, not the trainer's.
    assert summary["tensorboard"] == str((remote_out / "tensorboard").resolve())
    assert [v for _, v in tb_scalars(remote_out / "tensorboard", "policy/version")] == [1.0, 2.0, 3.0]
    staleness = [v for _, v in tb_scalars(remote_out / "tensorboard", "staleness/max")]
    assert len(staleness) == 3 and all(0 <= s <= 1 for s in staleness)  # batches carried their versions back
    assert not (out / "tensorboard").exists()
    # close(keep_final=True) went over the connection: the final version alone stays loaded.
    assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    assert run_adapters(client, summary) == [summary["adapter_name"]]


def test_sigterm_on_the_trainer_reaches_rollout_serve_which_resumes_a_paused_server_and_exits_1(vllm_server,
                                                                                               tmp_path):
    """No pid to signal: the trainer's halt shuts the connection down, and the rollout server, its version 1 sync held
    paused by the proxy, resumes the server at once and exits 1 (the run did not close)."""
    url = vllm_server.base_url
    server, address = _rollout_serve(tmp_path / "rollout-serve.log")
    with held_sync(url, tmp_path / "trainer", "--max_steps", "30", "--rollout_address", address, env=KEY,
                   others=(server,)) as (proxy_url, proc):
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        server_code = server.wait(timeout=120)
        paused_after = is_paused(url)
    log, remote_log = (tmp_path / "trainer" / "train.log").read_text(), (tmp_path / "rollout-serve.log").read_text()
    assert code == 143, log[-3000:]
    assert server_code == 1 and paused_after is False, remote_log[-3000:]
    assert re.search(rf"\[rollout\] .* resumed {re.escape(proxy_url)}, which a weight sync in progress had paused",
                     remote_log), remote_log[-3000:]
