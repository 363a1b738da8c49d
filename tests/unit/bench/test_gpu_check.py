"""scripts/gpu_check.sh: what it counts as a failure (`backend_check.failures`), its arguments, exit codes, results
file, deadlines and carried wheels. Its launches
run in tests/integration/test_gpu_check.py and, per backend, tests/integration/test_backend_step.py."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from lent_image import IMAGE_LACKS, as_on_the_image

from asyncgrpo.bench import gpu_check
from asyncgrpo.bench.backend_check import failures


def passing(**changes) -> dict:
    """A result that passes (fp32), with `changes`."""
    result = {"dtype": "float32", "micro": 2, "loss_on_policy": 0.1, "loss_a": 0.2, "loss_b": 0.2,
              "optimizer_steps_a": 1, "optimizer_steps_b": 1, "tokens_a": 40.0, "tokens_b": 40.0,
              "step_size": 1e-3, "max_abs_diff_a_b": 1e-8, "update_rel_diff_a_b": 1e-4, "chunked_vs_full_max_abs": 1e-6,
              "on_policy_max_abs_log_ratio": 0.0, "gathered_bytes": 1000, "adapter_bytes": 1000,
              "inv_freq_dtypes": ["torch.float32"], "device": "cpu", "peak_memory_gib": 1.0, "backend": "ddp",
              "mixed_precision": "no", "fsdp_reduce_dtype": "None", "deepspeed_gradient_clipping": None,
              "max_grad_norm": 0.05}
    return {**result, **changes}


def test_a_good_result_passes():
    assert failures(passing()) == []


@pytest.mark.parametrize("changes, says", [
    ({"loss_b": float("nan")}, "not finite"),
    ({"loss_a": float("inf")}, "not finite"),
    ({"optimizer_steps_b": 2}, "optimizer steps"),
    ({"tokens_b": 39.0}, "tokens counted"),
    ({"tokens_a": 0.0, "tokens_b": 0.0}, "tokens counted"),
    ({"step_size": 0.0}, "did not move"),
    ({"update_rel_diff_a_b": 0.011}, "micro-batches"),
    ({"chunked_vs_full_max_abs": 2e-4}, "chunked"),
    ({"on_policy_max_abs_log_ratio": 2e-4}, "on-policy"),
    ({"gathered_bytes": 1051}, "gather moved"),
    ({"inv_freq_dtypes": ["torch.bfloat16"]}, "inv_freq"),
    ({"peak_memory_gib": 3.01}, "peak memory"),
    ({"device": "cuda:0", "peak_memory_gib": 48.5}, "peak memory"),
    ({"backend": "fsdp2", "mixed_precision": "bf16", "fsdp_reduce_dtype": "torch.bfloat16"}, "reduces gradients"),
    ({"backend": "fsdp1", "mixed_precision": "bf16", "fsdp_reduce_dtype": "None"}, "reduces gradients"),
    ({"backend": "zero2", "deepspeed_gradient_clipping": 1.0}, "clips at 1.0"),
    ({"backend": "zero3", "deepspeed_gradient_clipping": "auto"}, "clips at auto"),
])
def test_each_kind_of_failure_is_named(changes, says):
    found = failures(passing(**changes))
    assert len(found) == 1 and says in found[0], found


def test_what_is_judged_per_backend_passes_where_it_is_right():
    assert failures(passing(device="cuda:0", peak_memory_gib=47.9)) == []
    assert failures(passing(backend="fsdp1", mixed_precision="bf16", fsdp_reduce_dtype="torch.float32")) == []
    assert failures(passing(backend="zero3", deepspeed_gradient_clipping=0.05)) == []


def test_bf16_bounds_are_looser():
    assert failures(passing(dtype="bfloat16", update_rel_diff_a_b=0.09, chunked_vs_full_max_abs=0.04)) == []
    assert failures(passing(dtype="bfloat16", update_rel_diff_a_b=0.11)) != []
    assert failures(passing(dtype="bfloat16", chunked_vs_full_max_abs=0.06)) != []


def test_the_gather_may_move_five_percent_more_than_the_adapter_and_no_more():
    assert failures(passing(gathered_bytes=1050)) == []
    assert failures(passing(gathered_bytes=1051)) != []


def test_defaults_are_the_real_shape_on_gpu_and_the_toy_on_cpu():
    gpu = gpu_check.parse_args([])
    assert (gpu.backends, gpu.model, gpu.dtype) == (["collectives", *gpu_check.BACKENDS], "shape:qwen2.5-1.5b",
                                                    "bfloat16")
    cpu = gpu_check.parse_args(["--cpu-smoke", "--backends", "ddp,zero3"])
    assert (cpu.backends, cpu.model, cpu.dtype) == (["ddp", "zero3"], "toy", "float32")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--backends", "fsdp3"])


def test_the_checks_whole_import_path_runs_without_what_the_lent_image_lacks():
    """The worker imports the trainer (recipe -> rollout factory -> ... -> transport/link.py); link's TLS alone needs
    `cryptography`, which the lent image lacks, so it is imported where a certificate is made."""
    modules = ["asyncgrpo.bench.gpu_check", "asyncgrpo.bench.backend_check", "asyncgrpo.trainer.recipe",
               "asyncgrpo.cli"]
    probe = f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; " \
            f"print(sorted(set({IMAGE_LACKS!r}) & {{m.partition('.')[0] for m in sys.modules}}))"
    proc = subprocess.run([sys.executable, "-c", probe], env=as_on_the_image(dict(os.environ)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def test_a_module_the_worker_needs_and_lacks_is_could_not_start_not_a_failure_per_backend(tmp_path):
    # cryptography imported again at link.py's top would do this on the lent image; `yaml` stands in for it here
    env = {**as_on_the_image(dict(os.environ)), "ASYNCGRPO_HIDE_MODULES": "yaml"}
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo.bench.gpu_check", "--cpu-smoke", "--backends", "ddp",
                           "--out", str(tmp_path), "--wheels", str(tmp_path / "none")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == gpu_check.COULD_NOT_START, proc.stderr[-3000:]
    line = json.loads(proc.stdout)
    assert line["started"] is False and "yaml" in line["why"]


def test_hidden_modules_are_really_hidden_from_the_child():
    proc = subprocess.run([sys.executable, "-c", "import cryptography"], env=as_on_the_image(dict(os.environ)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "No module named 'cryptography'" in proc.stderr


# ---- the run: exit codes, the results file, deadlines -------------------------------------------------------------
def run_main(tmp_path, capsys, *argv) -> tuple[int, list[dict], list[dict]]:
    """(exit code, the JSON lines on stdout, the lines of the results file)."""
    code = gpu_check.main([*argv, "--out", str(tmp_path / "out")])
    stdout = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    results = tmp_path / "out" / "results.jsonl"
    return code, stdout, [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []


def test_no_cuda_has_its_own_exit_code_and_says_so_in_a_json_line(tmp_path, capsys):
    # this host has no usable CUDA
    code, stdout, lines = run_main(tmp_path, capsys, "--backends", "ddp")
    assert code == gpu_check.NO_CUDA == 5
    assert len(stdout) == 1 and stdout[0]["started"] is False and "CUDA" in stdout[0]["why"]
    assert lines == stdout


def test_a_missing_module_is_could_not_start_with_a_json_line_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "NEEDED", gpu_check.NEEDED + ("asyncgrpo_no_such_module",))
    code, stdout, lines = run_main(tmp_path, capsys, "--cpu-smoke", "--wheels", str(tmp_path / "none"))
    assert code == gpu_check.COULD_NOT_START == 4
    assert len(stdout) == 1 and stdout[0]["started"] is False
    assert "asyncgrpo_no_such_module" in stdout[0]["why"] and "holds no wheels" in stdout[0]["why"]
    assert lines == stdout


def test_each_backends_line_is_written_as_it_ends_and_a_failure_has_its_own_exit_code(tmp_path, capsys,
                                                                                     monkeypatch):
    results = tmp_path / "out" / "results.jsonl"
    seen_before = {}

    def fake(backend, args, work, log, deadline_s):
        seen_before[backend] = [json.loads(x)["backend"] for x in results.read_text().splitlines()] \
            if results.exists() else []
        return {"ok": backend != "fsdp1", "failures": [] if backend != "fsdp1" else ["broken"]}

    monkeypatch.setattr(gpu_check, "check_backend", fake)
    code, stdout, lines = run_main(tmp_path, capsys, "--cpu-smoke", "--backends", "ddp,fsdp1,fsdp2")
    assert code == gpu_check.CHECK_FAILED == 3
    assert seen_before == {"ddp": [], "fsdp1": ["ddp"], "fsdp2": ["ddp", "fsdp1"]}
    assert [line.get("backend") for line in lines] == ["ddp", "fsdp1", "fsdp2", None]
    assert lines[-1] == stdout[0] and stdout[0]["passed"] is False and stdout[0]["exit_code"] == 3
    assert {b: r["ok"] for b, r in stdout[0]["backends"].items()} == {"ddp": True, "fsdp1": False, "fsdp2": True}


def test_all_passing_exits_0_and_each_launch_gets_the_budget_left_at_most(tmp_path, capsys, monkeypatch):
    deadlines = []

    def fake(backend, args, work, log, deadline_s):
        deadlines.append(deadline_s)
        time.sleep(0.5)
        return {"ok": True, "failures": []}

    monkeypatch.setattr(gpu_check, "check_backend", fake)
    code, stdout, _ = run_main(tmp_path, capsys, "--cpu-smoke", "--backends", "ddp,fsdp1",
                               "--budget", "60", "--timeout", "1000")
    assert code == gpu_check.PASSED == 0 and stdout[0]["passed"] is True
    assert 50 < deadlines[0] <= 60 and deadlines[1] <= deadlines[0] - 0.5


def test_backends_the_budget_does_not_reach_are_reported_as_not_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "check_backend", lambda *a: pytest.fail("no time was left to launch"))
    code, stdout, lines = run_main(tmp_path, capsys, "--cpu-smoke", "--backends", "ddp,zero3", "--budget", "1")
    assert code == gpu_check.CHECK_FAILED
    assert all(r["not_run"] and "budget" in r["failures"][0] for r in stdout[0]["backends"].values())
    assert [line.get("backend") for line in lines] == ["ddp", "zero3", None]


SPAWNS_A_WORKER_IN_ITS_OWN_SESSION = """
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_launch_past_its_deadline_is_ended_with_the_workers_it_put_in_sessions_of_their_own(tmp_path,
                                                                                             monkeypatch):
    # as torch's launcher does with its workers; this one even ignores SIGTERM, so SIGKILL must reach it
    monkeypatch.setattr(gpu_check, "GRACE_S", 1.0)
    pid_file = tmp_path / "worker.pid"
    started = time.monotonic()
    code = gpu_check.run_launch([sys.executable, "-c", SPAWNS_A_WORKER_IN_ITS_OWN_SESSION, str(pid_file)],
                                dict(os.environ), tmp_path / "launch.log", deadline_s=3.0)
    assert code is None
    assert time.monotonic() - started < 20
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)


def test_a_launch_that_ends_in_time_gives_its_exit_code_and_its_output_in_the_log(tmp_path):
    code = gpu_check.run_launch([sys.executable, "-c", "print('hello'); raise SystemExit(7)"], dict(os.environ),
                                tmp_path / "launch.log", deadline_s=60)
    assert code == 7 and "hello" in (tmp_path / "launch.log").read_text()


# ---- carried wheels -----------------------------------------------------------------------------------------------
def make_wheel(folder: Path, name: str) -> Path:
    """A minimal valid wheel holding one module `name` that defines VALUE = 42."""
    files = {f"{name}.py": b"VALUE = 42\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          b"Tag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()}"
                     f",{len(data)}\n" for path, data in files.items()) + f"{name}-1.0.dist-info/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in {**files, f"{name}-1.0.dist-info/RECORD": record.encode()}.items():
            archive.writestr(path, data)
    return wheel


@pytest.mark.parametrize("with_pip", [True, False])
def test_a_missing_module_is_installed_from_the_wheels_into_a_private_folder_only(tmp_path, monkeypatch, with_pip):
    make_wheel(tmp_path / "wheels", "asyncgrpo_carried_probe")
    monkeypatch.setattr(gpu_check, "NEEDED", ("json", "asyncgrpo_carried_probe"))
    if not with_pip:  # an image whose python has no pip: the wheels are unzipped
        monkeypatch.setattr(gpu_check, "has_pip", lambda: False)
    args = gpu_check.parse_args(["--cpu-smoke", "--backends", "ddp", "--wheels", str(tmp_path / "wheels")])
    carried, why = gpu_check.prepare_environment(args, tmp_path / "site")
    assert (carried, why) == ([str(tmp_path / "site")], None)
    assert (tmp_path / "site" / "asyncgrpo_carried_probe.py").read_text() == "VALUE = 42\n"
    assert gpu_check.importlib.util.find_spec("asyncgrpo_carried_probe") is None  # this interpreter: untouched


def test_nothing_is_carried_when_nothing_is_missing(tmp_path):
    args = gpu_check.parse_args(["--cpu-smoke", "--backends", "ddp", "--wheels", str(tmp_path / "none")])
    assert gpu_check.prepare_environment(args, tmp_path / "site") == ([], None)


def _saved_update(work: Path, backend: str, before: dict, after: dict) -> None:
    from safetensors.torch import save_file

    (work / backend).mkdir(parents=True)
    save_file(before, str(work / backend / "before.safetensors"))
    save_file(after, str(work / backend / "update.safetensors"))


def test_backends_updates_are_compared_with_ddps_as_a_relative_distance(tmp_path):
    import torch

    before = {"a": torch.zeros(4), "b": torch.ones(2)}
    step = {"a": torch.tensor([3.0, 0.0, 0.0, 0.0]), "b": torch.tensor([0.0, 4.0])}  # DDP's update: norm 5
    _saved_update(tmp_path, "ddp", before, {k: before[k] + step[k] for k in before})
    near = {**step, "a": step["a"] + torch.tensor([0.0, 0.004, 0.0, 0.0])}  # 0.004 / 5 = 8e-4
    far = {**step, "b": step["b"] + torch.tensor([0.006, 0.0])}  # 1.2e-3
    _saved_update(tmp_path, "fsdp2", before, {k: before[k] + near[k] for k in before})
    _saved_update(tmp_path, "zero3", before, {k: before[k] + far[k] for k in before})
    done = {b: {"ok": True} for b in ("ddp", "fsdp2", "zero3")}
    compared = gpu_check.compare_updates(tmp_path, done, "float32")
    assert compared["update_rel_diff_vs_ddp"] == pytest.approx({"fsdp2": 8e-4, "zero3": 1.2e-3}, rel=1e-3)
    assert not compared["ok"] and len(compared["failures"]) == 1 and "zero3" in compared["failures"][0]
    assert gpu_check.compare_updates(tmp_path, done, "bfloat16")["ok"]  # 0.25 in bf16
    assert gpu_check.compare_updates(tmp_path, {**done, "ddp": {"ok": False}}, "float32") is None  # no reference
