"""`asyncgrpo doctor`, and `train`'s check before its first step: every inference server and the adapter directory
against a config, one line each.

    asyncgrpo doctor --config configs/demo.yaml --vllm_server_base_url http://10.0.0.5:8000

The server checks are in inference/checks.py; this module adds the adapter directory's and the probe adapter, runs
them all, and for `train` (`require_healthy_setup`) first resumes a server left paused. docs/running.md lists them.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

from asyncgrpo.config import AsyncGRPOConfig, ModelSettings
from asyncgrpo.data import resolve_model_path
from asyncgrpo.distributed import without_zero3_init
from asyncgrpo.errors import InferenceServerError
from asyncgrpo.inference.checks import SERVER_CHECKS, CheckResult, ServerContext, check_receiver, paused_state, title
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.lora import with_lora
from asyncgrpo.rollout.delivery import make_delivery
from asyncgrpo.store import AdapterStore

log = logging.getLogger(__name__)


# ---- the adapter directory -------------------------------------------------------------------------------

def check_adapter_dir_writable(model: ModelSettings) -> CheckResult:
    root = Path(model.lora_adapter_path).resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".asyncgrpo-doctor-"):
            pass
    except OSError as exc:
        return CheckResult("adapter directory writable", False, f"cannot write in {root} ({exc})",
                           "set lora_adapter_path to a writable directory the inference server can read")
    return CheckResult("adapter directory writable", True, str(root))


def write_probe_adapter(cfg, model_path: str, directory: Path) -> Path:
    """A zero LoRA (rank `lora_r`, `lora_target_modules`) with the shapes of `model_path`, built on the meta
    device (no weights read), written like a published version; returns its directory."""
    # heavy: transformers and peft (seconds to import), needed only when a probe adapter is built
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"), without_zero3_init():
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        model, lora = with_lora(cfg, base)  # the trainer's own LoRA wrapping (lora.py)
    tensors = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in get_peft_model_state_dict(model).items()}
    return AdapterStore(directory).write(0, tensors, lora, base_model=model_path)


# ---- running them ----------------------------------------------------------------------------------------

def run_checks(cfg, clients, model_path: str) -> list[tuple[str, CheckResult]]:
    """Every check, as (scope, result): scope is the server's URL or `adapter directory`. A server that is not
    reachable gets its other checks skipped; a check that raises is a failure quoting the error."""
    results = [("adapter directory", check_adapter_dir_writable(cfg))]
    probe_root = None
    if results[0][1].ok:
        probe_root = Path(cfg.lora_adapter_path).resolve() / f"doctor-{uuid.uuid4().hex[:8]}"
    delivery = make_delivery(cfg)  # http: the probe goes through each server's receiver, as versions will
    try:
        probe_dir = _probe(cfg, model_path, probe_root, results) if probe_root else None
        for client in clients:
            ctx = ServerContext(cfg, client, model_path, probe_dir=probe_dir, delivery=delivery)
            results += [(client.base_url, r) for r in _server_results(ctx)]
    finally:
        if probe_root is not None:
            shutil.rmtree(probe_root, ignore_errors=True)
    return results


def _probe(cfg, model_path: str, root: Path, results: list) -> Path | None:
    """Write the probe adapter; a model whose config cannot be read here is a failure of its own."""
    try:
        return write_probe_adapter(cfg, model_path, root)
    except Exception as exc:  # noqa: BLE001 - transformers/PEFT raise many types for an unusable model
        results.append(("adapter directory", CheckResult(
            "probe adapter", False, f"cannot build a rank-{cfg.lora_r} adapter for {model_path} ({exc})",
            "set model_name_or_path to a model directory (or hub id) readable here, and lora_target_modules to "
            "module names it has")))
        return None


def _server_results(ctx: ServerContext) -> list[CheckResult]:
    out = []
    for check in SERVER_CHECKS:
        if out and out[0].ok is False:
            if check is not check_receiver or getattr(ctx.delivery, "name", None) == "http":  # none with shared_fs
                out.append(CheckResult(title(check), None, "not checked: the server is not reachable"))
            continue
        try:
            result = check(ctx)
            if result is not None:  # None: the check does not apply to this config (e.g. no receiver with shared_fs)
                out.append(result)
        except InferenceServerError as exc:
            out.append(CheckResult(title(check), False, str(exc), "see the message"))
    return out


def report(results: list[tuple[str, CheckResult]]) -> str:
    lines, scope = [], None
    for where, result in results:
        if where != scope:
            lines.append(f"{where}:")
            scope = where
        lines.append(f"  {result.line()}")
    failed = sum(r.ok is False for _, r in results)
    lines.append(f"{failed} check(s) failed" if failed else "all checks passed")
    return "\n".join(lines)


def resume_paused_servers(clients) -> list[str]:
    """For `train`: resume every server found paused (a run killed during a weight sync leaves it so, and it then
    holds every request); returns their URLs. The server is ours to use, so this run resumes it, and says so."""
    resumed = []
    for client in clients:
        if paused_state(client):
            client.resume()
            resumed.append(client.base_url)
            log.warning("%s was paused (GET /is_paused answered true), most likely by a run killed during a weight "
                        "sync; this run resumed it (POST /resume) to use it", client.base_url)
    return resumed


def require_healthy_setup(cfg, clients, model_path: str) -> None:
    """For `train` (rank 0, before the first step): resume a server left paused, run every check; raise
    InferenceServerError listing all failures with their fixes. Skipped checks are logged as warnings."""
    resume_paused_servers(clients)
    results = run_checks(cfg, clients, model_path)
    for where, r in results:
        if r.ok is None:
            log.warning("%s: %s", where, r.line())
    failures = [f"{where}: {r.line()}" for where, r in results if r.ok is False]
    if failures:
        raise InferenceServerError("the inference setup cannot run this config (`asyncgrpo doctor --config ...` "
                                   "checks it without training):\n  " + "\n  ".join(failures))


def run_doctor(args, overrides: list[str]) -> int:
    """`asyncgrpo doctor --config FILE [--key value ...]`: print one line per check; 1 if any failed."""
    logging.basicConfig(level=logging.WARNING)
    cfg = AsyncGRPOConfig.load(args.config, overrides)
    clients = [InferenceClient(url, api_key=cfg.api_key, timeout_s=cfg.vllm_request_timeout, connect_retries=0)
               for url in cfg.server_urls]
    results = run_checks(cfg, clients, resolve_model_path(cfg))
    print(report(results))
    for client in clients:
        client.close()
    return 1 if any(r.ok is False for _, r in results) else 0
