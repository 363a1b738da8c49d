#!/usr/bin/env bash
# Start the adapter receiver beside a vLLM server that cannot read the trainer's lora_adapter_path
# (`adapter_delivery: http`: containers, separate allocations, cloud inference nodes). Run it on the inference node,
# next to launch/vllm/serve.sh:
#
#   ADAPTER_DIR=/local/adapters RECEIVER_PORT=8001 VLLM_PORT=8000 launch/vllm/receiver.sh
#
# Then set in the training config `adapter_delivery: http` and `adapter_receiver_url: http://<this node>:8001`.
# The trainer uploads each version's files with its API key (ASYNCGRPO_VLLM_API_KEY, the same key in both
# environments; serve.sh's API_KEY is used when it is set). The receiver checks each file's size and sha256, renames
# the version into ADAPTER_DIR atomically and loads it into the vLLM at VLLM_PORT from there. It needs only this
# package's Python files plus `requests` and `pyyaml`, both in the vLLM image (`pip install --no-deps .`).
#
# SECURITY: on a private network, like vLLM. Without a key anyone who reaches RECEIVER_PORT could have an adapter
# loaded, so it refuses to start without one; ALLOW_NO_KEY=1 starts it keyless on 127.0.0.1 only (the trainer comes
# through an SSH tunnel), and the receiver itself refuses any other HOST without a key. Details: docs/delivery.md.
set -euo pipefail

: "${ADAPTER_DIR:?set ADAPTER_DIR to a local directory for received adapters, e.g. ADAPTER_DIR=/local/adapters}"
RECEIVER_PORT="${RECEIVER_PORT:-8001}"     # the port trainers upload to (adapter_receiver_url)
VLLM_PORT="${VLLM_PORT:-${PORT:-8000}}"    # the co-located vLLM (serve.sh's PORT)
KEEP="${KEEP:-8}"                          # versions kept on disk beyond those vLLM serves
PYTHON="${PYTHON:-python3}"

if [[ -z "${ASYNCGRPO_VLLM_API_KEY:-}" && -n "${API_KEY:-}" ]]; then
    export ASYNCGRPO_VLLM_API_KEY="$API_KEY"  # serve.sh's variable: one key for vLLM and its receiver
fi
if [[ -n "${ASYNCGRPO_VLLM_API_KEY:-}" ]]; then
    HOST="${HOST:-0.0.0.0}"                # all interfaces: the private network (see SECURITY)
elif [[ "${ALLOW_NO_KEY:-0}" == 1 ]]; then
    HOST="${HOST:-127.0.0.1}"              # no key: loopback only (the receiver refuses any other address)
else
    echo "receiver.sh: set ASYNCGRPO_VLLM_API_KEY (or API_KEY) to the trainer's key, or ALLOW_NO_KEY=1 to listen" \
         "on 127.0.0.1 only (reach it through an SSH tunnel)" >&2
    exit 2
fi
exec "$PYTHON" -m asyncgrpo.inference_node.receiver --dir "$ADAPTER_DIR" --host "$HOST" --port "$RECEIVER_PORT" \
    --vllm-url "http://127.0.0.1:$VLLM_PORT" --keep "$KEEP" "$@"
