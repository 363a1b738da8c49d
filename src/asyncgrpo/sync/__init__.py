"""Weight sync: gather the LoRA tensors (gather.py), write and activate them on the server (publish.py)."""
