"""What a run leaves behind: temporary directories of killed writers are removed at start (not those of a writer
still alive), and a run unloads the adapter versions it loaded except the one it keeps. The server is a recording
fake (tests/fakes.py's FakeVLLM); tests/integration/test_paused_server.py checks a real server after a finished and a
signalled run."""

import os
import subprocess
import sys

from fakes import FakeVLLM

from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.store import clean_stale_temporaries


def test_temporary_dirs_of_dead_writers_in_any_run_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: the killed writer
    killed = tmp_path / "run-a" / f".tmp-v000004-{dead.pid}"
    writing = tmp_path / "run-b" / f".tmp-v000002-{os.getpid()}"  # a live writer (another run sharing the dir)
    version = tmp_path / "run-a" / "v000003"
    for d in (killed, writing, version):
        d.mkdir(parents=True)
    assert clean_stale_temporaries(tmp_path) == [killed]
    assert not killed.exists() and writing.exists() and version.exists()


def servers_holding(tmp_path, *held: list[int] | None) -> list[FakeVLLM]:
    """A FakeVLLM at http://a:<i+1> for each list of versions (a dead one, down for good, for None) serving those."""
    servers = []
    for i, versions in enumerate(held):
        server = FakeVLLM(f"http://a:{i + 1}", back_at=None if versions is None else 0.0)
        server.served = {f"run-v{v}": str(tmp_path / f"v{v}") for v in versions or ()}
        servers.append(server)
    return servers


def unloaded(server: FakeVLLM) -> list[str]:
    return [call[1] for call in server.calls if call[0] == "unload"]  # asked, whether it was served there or not


def test_unload_all_keeps_only_the_named_version_and_skips_a_dead_server(tmp_path, caplog):
    import logging

    servers = servers_holding(tmp_path, [1, 2, 3], [2, 3], None)  # :2 restarted after v1; :3 is dead
    publisher = AdapterPublisher(servers, "run")
    publisher.loaded = {f"run-v{i}": tmp_path / f"v{i}" for i in (1, 2, 3)}
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.rollout.publish"):
        assert publisher.unload_all(keep="run-v3") == ["run-v1", "run-v2", "run-v2"]
    assert unloaded(servers[0]) == ["run-v1", "run-v2"] and list(servers[0].served) == ["run-v3"]
    assert unloaded(servers[1]) == ["run-v1", "run-v2"] and list(servers[1].served) == ["run-v3"]
    assert "was not unloaded" not in caplog.text  # v1's 404 on :2 is not an error
    assert servers[2].health_polls == [0.0] and "http://a:3 does not answer" in caplog.text  # not waited for
    assert list(publisher.loaded) == ["run-v3"]
    publisher.unload_all(keep=None)  # a failed run keeps nothing
    assert unloaded(servers[0])[-1] == "run-v3" and publisher.loaded == {}
    assert servers[0].served == {} and servers[1].served == {}


def test_a_file_named_like_a_temporary_is_not_a_writers_directory(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run-a").mkdir()
    lookalike = tmp_path / "run-a" / f".tmp-v000004-{dead.pid}"
    lookalike.write_text("a file someone left, not a version being written")
    assert clean_stale_temporaries(tmp_path) == []
    assert lookalike.exists()


def test_checking_whether_a_writer_is_alive_sends_it_no_signal(tmp_path):
    # another run, writing: it echoes lines back, which it cannot do if it was signalled (SIGHUP etc. end it). It sets
    # SIGHUP (signal 1, what a mutated 0 becomes) back to its default first: under nohup it inherits it ignored.
    echo = ("import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
            "[(sys.stdout.write(sys.stdin.readline()), sys.stdout.flush()) for _ in range(2)]; sys.stdin.readline()")
    writer = subprocess.Popen([sys.executable, "-c", echo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        live = tmp_path / "run-b" / f".tmp-v000002-{writer.pid}"
        live.mkdir(parents=True)
        writer.stdin.write("ready\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "ready\n"  # its own SIGHUP disposition is in place
        assert clean_stale_temporaries(tmp_path) == []
        assert live.exists()
        writer.stdin.write("still writing\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "still writing\n"  # alive and untouched
    finally:
        writer.kill()
        writer.wait()


def test_a_writer_of_another_user_counts_as_alive(tmp_path, monkeypatch):
    # Stub: the tests run as one user (often root, who may signal anyone), so os.kill's PermissionError for another
    # user's process cannot be produced for real here.
    from asyncgrpo import store

    def not_permitted(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(store.os, "kill", not_permitted)
    theirs = tmp_path / "run-c" / ".tmp-v000001-4194000"
    theirs.mkdir(parents=True)
    assert clean_stale_temporaries(tmp_path) == [] and theirs.exists()


def test_unload_all_returns_what_it_unloaded_and_tries_every_server_after_a_dead_one(tmp_path, caplog):
    import logging

    servers = servers_holding(tmp_path, None, [1, 2], [2])  # :1 is dead, :3 restarted after v1
    publisher = AdapterPublisher(servers, "run")
    publisher.loaded = {f"run-v{i}": tmp_path / f"v{i}" for i in (1, 2)}
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.rollout.publish"):
        assert publisher.unload_all(keep=None) == ["run-v1", "run-v2", "run-v2"]  # v1 was not on :3 (a 404)
    assert unloaded(servers[1]) == ["run-v1", "run-v2"] and unloaded(servers[2]) == ["run-v1", "run-v2"]
    assert servers[1].served == {} and servers[2].served == {}
    assert "run-v1 was not unloaded" not in caplog.text  # a 404 is no failure to report
    assert publisher.unload_all(keep=None) == []  # nothing loaded any more


def test_temporaries_carry_host_and_pid_and_only_this_hosts_dead_writers_or_a_day_old_others_are_gone(tmp_path,
                                                                                                      monkeypatch):
    import time

    from asyncgrpo import store

    monkeypatch.setattr(store.socket, "gethostname", lambda: "node-1")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def tmp(name, age_s=0.0):
        path = tmp_path / name
        path.mkdir()
        then = time.time() - age_s
        os.utime(path, (then, then))
        return path

    day = store.OTHER_HOST_TMP_AGE_S
    assert day == 24 * 3600
    gone = [tmp(f".tmp-v000001-node-1-{dead.pid}"), tmp(f".tmp-v000002-{dead.pid}"),  # this host's (old name too)
            tmp(f".tmp-v000003-node-2-{os.getpid()}", age_s=day + 5)]  # another host's, a day old: pid ignored
    kept = [tmp(f".tmp-v000004-node-1-{os.getpid()}", age_s=day + 5),  # alive here, however old
            tmp(f".tmp-v000005-node-2-{dead.pid}", age_s=day - 5),  # another host's, not yet a day old: pid ignored
            tmp(f".tmp-v000006-node-{dead.pid}", age_s=day - 5)]  # host "node" is another host, not "node-1"
    assert [store.writer_is_gone(p) for p in gone] == [True, True, True]
    assert [store.writer_is_gone(p) for p in kept] == [False, False, False]
    assert store.writer_is_gone(tmp_path / ".tmp-v000007-node-2-1") is False  # gone meanwhile: nothing to remove
    assert store.writer_is_gone(tmp(".tmp-x-1")) is False  # not a version temporary
    assert store.AdapterStore(tmp_path).clean_partial() == []  # the store cleaned at construction already
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-v000004-node-1-" + str(os.getpid()),
                                                          f".tmp-v000005-node-2-{dead.pid}",
                                                          f".tmp-v000006-node-{dead.pid}", ".tmp-x-1"]


def test_another_hosts_temporary_is_gone_only_once_older_than_a_day(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from asyncgrpo import store

    monkeypatch.setattr(store.socket, "gethostname", lambda: "node-1")
    theirs = tmp_path / ".tmp-v000003-node-2-1"
    theirs.mkdir()
    os.utime(theirs, (1_000_000, 1_000_000))  # whole seconds: the ages below are exact
    day = store.OTHER_HOST_TMP_AGE_S
    for now, gone in ((1_000_000 + day, False), (1_000_000 + day + 1, True)):  # exactly a day old: not yet
        monkeypatch.setattr(store, "time", SimpleNamespace(time=lambda now=now: float(now)))
        assert store.writer_is_gone(theirs) is gone, now - 1_000_000


def test_another_hosts_temporary_renamed_away_while_it_is_checked_is_not_gone(tmp_path, monkeypatch):
    # Stub: its writer finishing (renaming the temporary away) between writer_is_gone's is_dir and its stat cannot be
    # timed for real; this path removes itself just after answering is_dir, as that rename would.
    from asyncgrpo import store

    class RenamedAfterIsDir(type(tmp_path)):
        def is_dir(self):
            answer = super().is_dir()
            os.rmdir(self)
            return answer

    monkeypatch.setattr(store.socket, "gethostname", lambda: "node-1")
    theirs = tmp_path / ".tmp-v000003-node-2-1"
    theirs.mkdir()
    os.utime(theirs, (1_000_000, 1_000_000))  # decades old: had its stat answered, it would count as gone
    assert store.writer_is_gone(RenamedAfterIsDir(theirs)) is False  # nothing left to remove
    assert not theirs.exists()


def test_the_host_in_a_temporary_name_is_one_path_component(monkeypatch):
    from asyncgrpo import store

    monkeypatch.setattr(store.socket, "gethostname", lambda: "gpu-7.cluster/a b")
    assert store.host_name() == "gpu-7.cluster_a_b"
    monkeypatch.setattr(store.socket, "gethostname", lambda: "NodeA")
    assert store.host_name() == "NodeA"  # kept as it is: NodeA and NodeB must not both become one name
    monkeypatch.setattr(store.socket, "gethostname", lambda: "")
    assert store.host_name() == "_"


def test_a_write_names_its_temporary_after_this_host_and_pid(tmp_path, monkeypatch):
    import torch
    from peft import LoraConfig

    from asyncgrpo import store

    monkeypatch.setattr(store.socket, "gethostname", lambda: "node-1")
    made = []
    real_mkdir = store.Path.mkdir
    monkeypatch.setattr(store.Path, "mkdir", lambda self, *a, **k: made.append(self.name) or real_mkdir(self, *a, **k))
    store.AdapterStore(tmp_path / "run").write(3, {"a.lora_A.weight": torch.ones(2, 2)}, LoraConfig(r=2),
                                               base_model="b")
    assert made[-1] == f".tmp-v000003-node-1-{os.getpid()}"
