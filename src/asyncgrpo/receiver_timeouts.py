"""How long the trainer's client of an adapter receiver (rollout/delivery.py) waits on each call.

They live here, low in the import order, because two layers read them: the client, and the `ddp_timeout` check
(inference/recovery.py), which counts the longest delivery they allow.
"""

CONNECT_TIMEOUT_S = 5.0  # a reachable receiver accepts a connection in milliseconds
HEALTH_TIMEOUT_S = 5.0  # /health answers in milliseconds; a slower one counts as down
UPLOAD_TIMEOUT_S = 600.0  # one file's upload: a ~1 GB adapter over a slow (~20 MB/s) link, with margin
ADMIN_TIMEOUT_S = 120.0  # commit (sha256 of the files, fsync) and load (vLLM's own: seconds from local disk)
ADAPTER_FILES = 2  # uploaded per version: the weights and adapter_config.json (store.py's manifest lists both)
