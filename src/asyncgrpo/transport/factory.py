"""Where rank 0's rollout side runs: in this process (RolloutSide), in a child it spawns, or in an
`asyncgrpo rollout-serve` it connects to (both RolloutProcess, with a ChildPeer or a RemotePeer).
`open_rollout_side` is the one call the trainer makes; every form implements RolloutInterface.
"""

from __future__ import annotations

from asyncgrpo.transport.interface import RolloutInterface
from asyncgrpo.transport.process import RolloutProcess
from asyncgrpo.transport.remote import RemotePeer
from asyncgrpo.rollout.side import RolloutSide


def open_rollout_side(cfg, **kwargs) -> RolloutInterface:
    """Rank 0's rollout side: in this process, in a child process it spawns (`rollout_process: true`), or in an
    `asyncgrpo rollout-serve` it connects to (`rollout_address`). Same interface, same arguments (RolloutSide's)."""
    if cfg.rollout_address:
        return RolloutProcess(cfg, peer=RemotePeer(cfg.rollout_address), **kwargs)
    return RolloutProcess(cfg, **kwargs) if cfg.rollout_process else RolloutSide(cfg, **kwargs)
