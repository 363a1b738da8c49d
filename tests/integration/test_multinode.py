"""Two "nodes" on one host: two separate `torchrun --nnodes 2` invocations (one process each, static rendezvous on
127.0.0.1, DDP over gloo) train together against the real vLLM server, as two trainer nodes of a cluster job would.

Each node gets its own output_dir (node-local disk) and both share lora_adapter_path (the shared filesystem the
inference node reads). Only global rank 0 may write: node 1, whose only process is its node's local rank 0, must
leave its output_dir untouched, so code that keyed file writes on the local rank would fail here.
"""

import json
import subprocess
import sys
from pathlib import Path

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference_node.vllm_server import find_free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 600  # both nodes together; a 2-step toy run takes ~10-20 s on 2 cores


def node_command(node_rank: int, master_port: int, out: Path, adapters: Path, server_url: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(master_port),
            "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml", "--max_steps", "2",
            "--per_device_train_batch_size", "16", "--output_dir", str(out), "--lora_adapter_path", str(adapters),
            "--vllm_server_base_url", server_url, "--ddp_timeout", "200", "--vllm_server_timeout", "30",
            "--vllm_request_timeout", "40"]


def test_two_torchrun_nodes_train_together_and_only_global_rank_0_writes(vllm_server, client, tmp_path):
    env = cpu_launch_env("ddp")  # ACCELERATE_USE_CPU: a launch of several ranks runs on CPU only when asked
    port = find_free_port()
    adapters = tmp_path / "shared" / "adapters"
    outs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
    procs = [subprocess.Popen(node_command(i, port, outs[i], adapters, vllm_server.base_url), cwd=REPO, env=env,
                              stdout=logs[i], stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    output = []
    for log in logs:
        log.seek(0)
        output.append(log.read())
        log.close()
    assert codes == [0, 0], f"node 0:\n{output[0][-4000:]}\nnode 1:\n{output[1][-4000:]}"

    summaries = sorted(tmp_path.rglob("run_summary.json"))
    assert summaries == [outs[0] / "run_summary.json"]  # exactly one, from global rank 0's node
    assert not outs[1].exists()  # node 1 (local rank 0, global rank 1) wrote nothing of its own
    summary = json.loads(summaries[0].read_text())
    assert summary["version"] == 2 and summary["steps"] == 2
    assert Path(summary["adapter_path"]).parent.parent == adapters.resolve()  # <lora_adapter_path>/<run id>/v2
    assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    assert "[rank1]" not in output[0] and "[rank0]" not in output[1]  # each node ran the rank it was given
    assert output[0].count("asyncgrpo.trainer.recipe: done") == 1 and "asyncgrpo.trainer.recipe: done" not in output[1]
