"""The adapter receiver's refusals and its commit, over real HTTP on 127.0.0.1, with no vLLM behind it (the loads
are in tests/integration/test_delivery.py): a request it refuses writes nothing under its directory, and what failed
uploads leave expires. Attacks on it (stalls, floods, malformed requests, symlinks): tests/security/test_receiver.py."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
from pathlib import Path

import pytest
import requests

from asyncgrpo.inference_node.receiver import MANIFEST_NAME, AdapterReceiver, serve

KEY = "receiver-test-key"
FILES = {"adapter_model.safetensors": b"\x00weights" * 100, "adapter_config.json": b'{"r": 8}'}


def manifest(files: dict[str, bytes]) -> dict:
    return {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}


@pytest.fixture()
def receiver(tmp_path):
    rec = AdapterReceiver(tmp_path / "adapters", vllm=None, max_file_bytes=4096)
    server = serve(rec, "127.0.0.1", 0, KEY)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    session = requests.Session()
    session.trust_env = False
    session.headers["Authorization"] = f"Bearer {KEY}"
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield rec, url, session
    server.shutdown()
    server.server_close()


def upload(url, session, name, files):
    for filename, data in files.items():
        resp = session.put(f"{url}/adapters/{name}/{filename}", data=data)
        assert resp.status_code == 200, resp.text
    return session.post(f"{url}/adapters/{name}/commit", json=manifest(files))


def entries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_complete_upload_is_committed_with_its_manifest_and_a_retry_rewrites_nothing(receiver):
    rec, url, session = receiver
    resp = upload(url, session, "policy-ab-v1", FILES)
    assert resp.status_code == 200, resp.text
    final = rec.root / "policy-ab-v1"
    assert resp.json() == {"path": str(final), "written": True}
    assert {p.name: p.read_bytes() for p in final.iterdir() if p.name != MANIFEST_NAME} == FILES
    assert json.loads((final / MANIFEST_NAME).read_text()) == manifest(FILES)
    mtime = (final / "adapter_model.safetensors").stat().st_mtime_ns
    again = upload(url, session, "policy-ab-v1", FILES)  # the trainer's retry of the same version
    assert again.json() == {"path": str(final), "written": False}
    assert (final / "adapter_model.safetensors").stat().st_mtime_ns == mtime
    assert entries(rec.root) == sorted(["policy-ab-v1", *(f"policy-ab-v1/{n}" for n in [*FILES, MANIFEST_NAME])])
    assert session.get(f"{url}/adapters").json() == {"committed": ["policy-ab-v1"]}


def test_the_same_name_with_other_files_is_a_conflict_and_the_committed_version_stays(receiver):
    rec, url, session = receiver
    upload(url, session, "v1", FILES)
    other = {**FILES, "adapter_config.json": b'{"r": 16}'}
    resp = upload(url, session, "v1", other)
    assert resp.status_code == 409 and "immutable" in resp.json()["error"]
    assert (rec.root / "v1" / "adapter_config.json").read_bytes() == b'{"r": 8}'


@pytest.mark.parametrize("corrupt", ["content", "size", "missing"])
def test_a_corrupted_upload_is_refused_naming_the_file_and_leaves_nothing(receiver, corrupt):
    rec, url, session = receiver
    sent = dict(FILES)
    if corrupt == "content":
        sent["adapter_model.safetensors"] = b"\x01weights" + FILES["adapter_model.safetensors"][8:]  # same size
    elif corrupt == "size":
        sent["adapter_model.safetensors"] = FILES["adapter_model.safetensors"][:-1]
    else:
        del sent["adapter_model.safetensors"]
    for filename, data in sent.items():
        session.put(f"{url}/adapters/v1/{filename}", data=data)
    resp = session.post(f"{url}/adapters/v1/commit", json=manifest(FILES))  # the trainer's true manifest
    assert resp.status_code == 422
    assert "adapter_model.safetensors" in resp.json()["error"]
    assert entries(rec.root) == []  # not committed, and the staging directory is gone


def test_without_the_api_key_every_route_but_health_is_refused(receiver):
    rec, url, session = receiver
    plain = requests.Session()
    plain.trust_env = False
    assert plain.get(f"{url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        put = plain.put(f"{url}/adapters/v1/adapter_config.json", data=b"{}", headers=headers)
        commit = plain.post(f"{url}/adapters/v1/commit", json=manifest(FILES), headers=headers)
        load = plain.post(f"{url}/adapters/v1/load", headers=headers)
        listing = plain.get(f"{url}/adapters", headers=headers)
        assert [r.status_code for r in (put, commit, load, listing)] == [401] * 4
        assert "ASYNCGRPO_VLLM_API_KEY" in put.json()["error"]
    assert entries(rec.root) == []


@pytest.mark.parametrize("route", [
    "/adapters/..%2F..%2Fetc/adapter_config.json",  # an encoded traversal stays one path segment, and is refused
    "/adapters/../adapter_config.json",
    "/adapters/.hidden/adapter_config.json",
    "/adapters/v1/..",
    "/adapters/v1/.part-x",
    f"/adapters/v1/{MANIFEST_NAME}",  # only the receiver writes the manifest
])
def test_names_that_could_leave_the_directory_or_hide_in_it_are_refused(receiver, route):
    rec, url, session = receiver
    resp = session.put(f"{url}{route}", data=b"x")
    assert resp.status_code in (400, 404), (route, resp.status_code, resp.text)
    assert entries(rec.root) == []


def test_a_manifest_naming_a_path_outside_is_refused_before_anything_is_read(receiver, tmp_path):
    rec, url, session = receiver
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not yours")
    resp = session.post(f"{url}/adapters/v1/commit", json={"../../secret.txt": {"size": 9, "sha256": "0" * 64}})
    assert resp.status_code == 400 and "not a valid file name" in resp.json()["error"]
    assert entries(rec.root) == []


def test_a_file_over_the_size_limit_is_refused_before_its_body_is_read(receiver):
    rec, url, session = receiver
    resp = session.put(f"{url}/adapters/v1/adapter_model.safetensors", data=b"x" * 5000)  # limit 4096
    assert resp.status_code == 413
    assert entries(rec.root) == []


def test_loading_needs_a_committed_version(tmp_path):
    class NeverCalled:  # stands in for vLLM: the refusal must come before any call to it
        def __getattr__(self, name):
            raise AssertionError(f"vLLM was called ({name}) for a version that was never committed")

    rec = AdapterReceiver(tmp_path, vllm=NeverCalled())
    with pytest.raises(Exception) as info:
        rec.load("policy-v1")
    assert info.value.status == 404 and "not committed" in str(info.value)


def test_the_directory_keeps_the_newest_versions_and_every_one_vllm_serves(tmp_path):
    rec = AdapterReceiver(tmp_path, vllm=None, keep=2)
    for i in range(1, 6):
        d = tmp_path / f"v{i}"
        d.mkdir()
        (d / MANIFEST_NAME).write_text("{}")
        os.utime(d, (i, i))
    rec._prune(in_use={str(tmp_path / "v1")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1", "v4", "v5"]


def test_leftovers_go_at_start_and_an_abandoned_staging_directory_expires_at_the_next_commit(tmp_path):
    root = tmp_path / "adapters"
    (root / ".incoming-v0").mkdir(parents=True)  # what a receiver killed midway leaves: a staging directory
    (root / ".part-0123abcd").write_bytes(b"x")  # and an upload's partial file
    (root / "v0").mkdir()
    (root / "v0" / MANIFEST_NAME).write_text("{}")
    rec = AdapterReceiver(root, vllm=None, stage_max_age_s=600)
    assert entries(root) == ["v0", f"v0/{MANIFEST_NAME}"]  # committed versions stay
    rec.put_file("old", "adapter_config.json", 2, io.BytesIO(b"{}"))
    rec.put_file("fresh", "adapter_config.json", 2, io.BytesIO(b"{}"))
    os.utime(root / ".incoming-old", (time.time() - 3600, time.time() - 3600))  # an hour untouched: abandoned
    for filename, data in FILES.items():
        rec.put_file("v1", filename, len(data), io.BytesIO(data))
    assert rec.commit("v1", manifest(FILES))["written"] is True
    assert not (root / ".incoming-old").exists()
    assert (root / ".incoming-fresh" / "adapter_config.json").read_bytes() == b"{}"  # younger than the limit: kept
    assert not list(root.glob(".part-*"))  # every upload's .part was renamed into staging, none left
