"""What runs on the inference node, beside vLLM: starting a vLLM server with the flags LoRA hot reload needs
(vllm_server.py) and the adapter receiver of `adapter_delivery: http` (receiver.py)."""
