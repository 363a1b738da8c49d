#!/usr/bin/env bash
# Run launch/slurm/train.sbatch under a real Slurm on this one host: its CPU variant, 2 steps on the toy model.
#
#   sudo make slurm-check          # or: sudo VENV=/path/to/.venv scripts/slurm_check.sh
#
# Needs root (it installs Debian's slurm-wlm and munge with apt-get when missing, and runs munged, slurmctld and
# slurmd). It writes a one-host slurm.conf (this host, its CPUs and memory, cons_tres, no cgroups) under
# SLURM_CHECK_DIR, starts the daemons with their logs there, waits for the node to be idle, submits the sbatch with
# CPU=1 (the vLLM CPU server and the trainers share the node), waits for the job, prints the tail of its output and
# exits non-zero unless the job COMPLETED with exit code 0 and printed its last line. The daemons it started are
# stopped on exit. What a single host cannot show: docs/gpus.md, "Slurm, run for real on one host".
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$root/.venv}"
STATE="${SLURM_CHECK_DIR:-/tmp/asyncgrpo-slurm-check}"
NODE_TIMEOUT="${NODE_TIMEOUT:-120}"     # seconds for the node to become idle
JOB_TIMEOUT="${JOB_TIMEOUT:-1200}"      # seconds for the job, from submission to its end
say() { echo "slurm_check: $*" >&2; }

if [[ $EUID -ne 0 ]]; then
    say "must run as root: it installs slurm-wlm and munge (apt-get) and runs munged, slurmctld and slurmd." \
        "Run: sudo VENV=$VENV $0"
    exit 2
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    say "no Python environment at $VENV (make setup, or set VENV=/path/to/.venv)"
    exit 2
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi

# ---- config: one node, this host -------------------------------------------------------------------------------
host="$(hostname -s)"
cpus="$(nproc)"
mem_mb="$(free -m | awk '/^Mem:/ {print $2}')"
rm -rf "$STATE/ctld" "$STATE/slurmd" "$STATE/shared"
mkdir -p "$STATE/ctld" "$STATE/slurmd" "$STATE/shared"
export SLURM_CONF="$STATE/slurm.conf"
cat > "$SLURM_CONF" <<EOF
# One-host cluster for scripts/slurm_check.sh (written by it; rewritten on every run).
ClusterName=asyncgrpo-check
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
# No cgroups in a container: processes tracked through /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=check Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

# ---- daemons ------------------------------------------------------------------------------------------------------
started=()   # pid files of the daemons this run started, in start order
job=""
job_state() { scontrol show job -o "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
wait_job_end() {   # job, seconds: poll until the job has left the queue's active states
    local end=$(( SECONDS + $2 ))
    while [[ "$(job_state "$1")" =~ ^(PENDING|CONFIGURING|RUNNING|COMPLETING|SUSPENDED)$ ]]; do
        (( SECONDS < end )) || return 1
        sleep 2
    done
}
stop_daemons() {   # the job first (its steps hold the vLLM server), then the daemons in reverse order
    local i pid end
    if [[ -n "$job" ]] && ! wait_job_end "$job" 0; then
        scancel "$job" 2>/dev/null || true
        wait_job_end "$job" 90 || say "job $job did not end within 90 s of scancel"
    fi
    for (( i = ${#started[@]} - 1; i >= 0; i-- )); do
        pid="$(cat "${started[i]}" 2>/dev/null || true)"
        [[ -n "$pid" ]] || continue
        kill "$pid" 2>/dev/null || continue
        end=$(( SECONDS + 30 ))
        while kill -0 "$pid" 2>/dev/null && (( SECONDS < end )); do sleep 1; done
        kill -9 "$pid" 2>/dev/null || true
    done
}
trap stop_daemons EXIT

if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [[ -s /etc/munge/munge.key ]] || { mungekey --create 2>/dev/null || create-munge-key -f; }
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- munged
    started+=(/run/munge/munged.pid)
fi
for daemon in slurmctld slurmd; do
    pidfile="$STATE/$daemon.pid"
    if [[ -s "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        kill "$(cat "$pidfile")"    # left by an earlier run that did not finish: restart with this config
    fi
done
slurmctld -f "$SLURM_CONF" && started+=("$STATE/slurmctld.pid")
slurmd -f "$SLURM_CONF" && started+=("$STATE/slurmd.pid")

deadline=$(( SECONDS + NODE_TIMEOUT ))
until [[ "$(sinfo -h -n "$host" -o %t 2>/dev/null)" == idle ]]; do
    if (( SECONDS >= deadline )); then
        say "node $host not idle after ${NODE_TIMEOUT} s: $(sinfo -h -N -o '%N %t %E' 2>&1)"
        tail -n 20 "$STATE/slurmctld.log" "$STATE/slurmd.log" >&2 || true
        exit 1
    fi
    sleep 1
done
say "node $host idle ($cpus CPUs, $mem_mb MB) after $SECONDS s"

# ---- the job: the real train.sbatch, CPU variant --------------------------------------------------------------------
world="$(PYTHONPATH="${PYTHONPATH:-}" "$VENV/bin/python" -m asyncgrpo.toy.world)"
model_dir="$("$VENV/bin/python" -c 'import json, sys; print(json.loads(sys.argv[1])["model_dir"])' "$world")"
free_port() {
    "$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 ACCELERATE_USE_CPU=true
export CPU=1 CONFIG=configs/demo.yaml MODEL="$model_dir" SHARED_DIR="$STATE/shared" RUN_NAME=check
export ACCELERATE_CONFIG=launch/accelerate/ddp_cpu.yaml GPUS_PER_NODE=2 VLLM_BIND=127.0.0.1
export VLLM_PORT="$(free_port)" MASTER_PORT="$(free_port)" MAX_LORA_RANK=8 MAX_MODEL_LEN=256 VLLM_START_TIMEOUT=600
export EXTRA_ARGS="--max_steps 2"
out="$STATE/job-%j.out"
job="$(cd "$root" && sbatch --parsable --nodes 1 --gpus-per-node=0 --time 30 --chdir "$root" --output "$out" \
       launch/slurm/train.sbatch)"
out="${out//%j/$job}"
say "submitted job $job (output $out)"

if ! wait_job_end "$job" "$JOB_TIMEOUT"; then
    say "job $job still $(job_state "$job") after ${JOB_TIMEOUT} s: cancelling"
    scancel "$job" || true
    wait_job_end "$job" 90 || true
fi
info="$(scontrol show job -o "$job")"
state="$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$info")"
exit_code="$(sed -n 's/.*ExitCode=\([0-9:]*\).*/\1/p' <<<"$info")"
say "job $job: $state, exit code $exit_code"
echo "---- tail of $out ----" >&2
tail -n 25 "$out" >&2 || true
if [[ "$state" != COMPLETED || "$exit_code" != 0:0 ]] || ! grep -q "^asyncgrpo: done" "$out"; then
    say "FAILED; logs: $out, $STATE/shared/check/vllm-*.log, $STATE/slurmctld.log, $STATE/slurmd.log"
    exit 1
fi
say "OK: train.sbatch ran to its end under Slurm in $SECONDS s"
