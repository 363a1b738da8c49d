"""Between the trainer and its rollout side: the interface both implement, the proxy rank 0 holds (process.py: a
spawned child or, via remote.py, `rollout-serve` on another host), the link's TLS and keys (link.py, throttle.py), the
wire format (wire.py) and the rollout process's request loop (rollout_server.py)."""
