#!/usr/bin/env bash
# Start torchft's lighthouse and GROUPS replica groups of pretrain_gpt.py on this machine, each a torchrun of NPROC
# processes with a store of its own, wait for them, then stop the lighthouse:
#   bash scripts/launch_replica_groups.sh GROUPS NPROC pretrain_gpt.py [flags...]
# Every group gets --fault-tolerance torchft --ft-replica-id G --ft-num-replica-groups GROUPS and the lighthouse's
# address ($TORCHFT_LIGHTHOUSE). A group that dies is restarted by running its torchrun line again (printed here);
# it takes the live state from a peer. On several machines, start the lighthouse once (torchft_lighthouse
# --min_replicas 1 --bind [::]:PORT) and each group's torchrun on its own nodes with TORCHFT_LIGHTHOUSE set.
# The lighthouse's settings, from the environment: FT_MIN_REPLICAS (default 1: the first group to start may train
# alone until the others join; GROUPS starts them together, and then a dead group stalls the others),
# FT_JOIN_TIMEOUT_MS (10000), FT_HEARTBEAT_TIMEOUT_MS (5000, torchft's: how long a dead group holds the step up),
# LIGHTHOUSE_PORT (29510), MASTER_PORT_BASE (29600: group G's store on MASTER_PORT_BASE + G).
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: bash scripts/launch_replica_groups.sh GROUPS NPROC pretrain_gpt.py [flags...]" >&2
  exit 2
fi
groups=$1
nproc=$2
shift 2
port=${LIGHTHOUSE_PORT:-29510}
base=${MASTER_PORT_BASE:-29600}
torchft_lighthouse --min_replicas "${FT_MIN_REPLICAS:-1}" --join_timeout_ms "${FT_JOIN_TIMEOUT_MS:-10000}" \
  --heartbeat_timeout_ms "${FT_HEARTBEAT_TIMEOUT_MS:-5000}" --bind "[::]:$port" &
lighthouse=$!
trap 'kill "$lighthouse" 2>/dev/null || true' EXIT
export TORCHFT_LIGHTHOUSE="http://localhost:$port"
pids=()
for ((group = 0; group < groups; group++)); do
  line=(torchrun --nproc-per-node "$nproc" --master-port $((base + group)) "$@" --fault-tolerance torchft
        --ft-replica-id "$group" --ft-num-replica-groups "$groups")
  echo "replica group $group: TORCHFT_LIGHTHOUSE=$TORCHFT_LIGHTHOUSE ${line[*]}" >&2
  "${line[@]}" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"
