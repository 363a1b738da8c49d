"""Run under `accelerate launch` by test_backend_step.py (not a test itself): gpu_check's own worker
(asyncgrpo.bench.backend_check: the trainer's step on whichever backend was launched, no inference server), with
step B run inside `DeviceAudit`, which records every tensor asyncgrpo hands to torch.distributed. Rank 0 writes
`result.json` (and `update.safetensors`) to --out.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "gather", "broadcast", "reduce", "scatter", "reduce_scatter",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "send", "recv", "isend", "irecv")


class DeviceAudit:
    """Makes the collective device `meta` (a device that is not the CPU, as a GPU is under NCCL) and records the
    device of every tensor that code in asyncgrpo hands to a torch.distributed collective. Tensors moved through
    `asyncgrpo.distributed.to_collective` get a CPU twin that the real (gloo) collective runs on, and `to_host`
    returns the twin: code that follows the rule keeps working; a CPU tensor handed straight to a collective is
    recorded as `cpu`, and a meta result read without `to_host` fails loudly."""

    def __init__(self):
        self.records: list[dict] = []
        self._twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, cpu twin)

    def __enter__(self):
        import asyncgrpo.distributed as D

        self._module = D
        self._saved = {"collective_device": D.collective_device, "_transfer": D._transfer}
        self._saved_dist = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        D.collective_device = lambda: torch.device("meta")
        D._transfer = self._transfer
        for name, original in self._saved_dist.items():
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(self._module, name, original)
        for name, original in self._saved_dist.items():
            setattr(dist, name, original)

    def _keep(self, meta: torch.Tensor, twin: torch.Tensor) -> torch.Tensor:
        self._twins[id(meta)] = (meta, twin)
        return meta

    def _transfer(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return self._keep(torch.empty_like(tensor, device="meta"), tensor.detach().to("cpu", copy=True))
        if tensor.device.type == "meta":
            return self._twin(tensor).to(device)
        return tensor.to(device)

    def _twin(self, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
            return tensor
        if id(tensor) not in self._twins:  # an output buffer the code made on the collective device
            self._keep(tensor, torch.zeros(tensor.shape, dtype=tensor.dtype))
        return self._twins[id(tensor)][1]

    def _map(self, value):
        if isinstance(value, (list, tuple)):
            return type(value)(self._twin(v) for v in value)
        return self._twin(value)

    def _wrap(self, name, original):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith("asyncgrpo"):  # accelerate/torch/DeepSpeed internals manage their own devices
                return original(*args, **kwargs)
            tensors = [t for v in (*args, *kwargs.values()) for t in (v if isinstance(v, (list, tuple)) else [v])
                       if isinstance(t, torch.Tensor)]
            self.records.append({"op": name, "caller": caller, "devices": sorted({str(t.device) for t in tensors})})
            return original(*[self._map(a) for a in args], **{k: self._map(v) for k, v in kwargs.items()})

        return call


if __name__ == "__main__":
    from asyncgrpo.bench.backend_check import main

    main(sys.argv[1:], audit=DeviceAudit)
