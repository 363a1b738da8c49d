"""Clients of the vLLM inference node, run by the rollout side: the HTTP client (client.py), the server checks
(checks.py) and the outage budget (recovery.py). What runs on the node itself is in inference_node/."""
