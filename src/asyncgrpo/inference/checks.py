"""Start-up checks of an inference server against the trainer's needs; each failure names the flag to change."""

from __future__ import annotations

import logging

from ..errors import InferenceServerError

log = logging.getLogger(__name__)


def check_lora_serving(client, *, lora_r: int, adapters_needed: int) -> None:
    """Fail before the first step if the server cannot serve this run's adapters.

    `adapters_needed`: versions that may be loaded at once (the current one, those requests in flight still
    use, and the one being loaded). Reads the engine config from `/server_info` (a dev-mode route); a server
    without it is only warned about, since versioned mode does not need dev mode."""
    config = client.server_config()
    if config is None:
        log.warning("%s has no /server_info (VLLM_SERVER_DEV_MODE unset): cannot check its LoRA limits",
                    client.base_url)
        return
    lora = config.get("lora_config")
    if not lora:
        raise InferenceServerError(f"{client.base_url} serves no LoRA adapters. Fix: start it with --enable-lora "
                                   f"--max-lora-rank {max(8, lora_r)} --max-loras {adapters_needed}")
    if lora.get("max_lora_rank", 0) < lora_r:
        raise InferenceServerError(f"{client.base_url} was started with --max-lora-rank {lora.get('max_lora_rank')}, "
                                   f"below lora_r={lora_r}. Fix: restart it with --max-lora-rank {lora_r} (vLLM "
                                   f"accepts 1, 8, 16, 32, 64, ...), or lower lora_r")
    if lora.get("max_loras", 0) < adapters_needed:
        raise InferenceServerError(f"{client.base_url} was started with --max-loras {lora.get('max_loras')}, but "
                                   f"this run may serve {adapters_needed} adapter versions at once (max_staleness "
                                   f"+ 2). Fix: restart it with --max-loras {adapters_needed}, or lower max_staleness")
