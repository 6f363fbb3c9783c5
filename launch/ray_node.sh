#!/usr/bin/env bash
# One Ray node of a slurm allocation: `bash launch/ray_node.sh head|worker`, run by launch/ray_cluster.sh
# inside an `srun` step (one task per node). Not meant to be run by hand.
#
# Reads $LOG_DIR/cluster.env (written by the batch script), logs to $LOG_DIR/nodes/<node>.log, and talks
# to the batch script through files in $LOG_DIR, so no step ever sleeps a fixed time waiting for another:
#   nodes/<node>.beat     touched every HEARTBEAT_S while this node's Ray runs (liveness)
#   nodes/<node>.joined   this node's raylet is up (head: STARTED_RAY_HEAD + head.ip as well)
#   nodes/<node>.exit     how this node's Ray ended (exit code, reason); absent if the node was killed
#   ENDED                 written by the batch script: stop Ray here and exit 0
# Ray runs in a node-local temp dir of its own and is stopped by process id: never `ray stop`, which
# would kill every Ray process of the user on the host.
set -uo pipefail
role="${1:?usage: ray_node.sh head|worker}"
: "${LOG_DIR:?LOG_DIR is not set}"
# shellcheck source=/dev/null
source "$LOG_DIR/cluster.env"
NODE="${SLURMD_NODENAME:-$(hostname -s)}"
mkdir -p "$LOG_DIR/nodes"
exec >>"$LOG_DIR/nodes/$NODE.log" 2>&1
echo "$$" > "$LOG_DIR/nodes/$NODE.pid"
echo "[node $NODE] $role, slurm step ${SLURM_STEP_ID:-?} task ${SLURM_PROCID:-?}, $(date -u +%FT%TZ)"

if [ ! -f "$LOG_DIR/.shared_fs_canary" ]; then
  echo "[node $NODE] error: $LOG_DIR/.shared_fs_canary is not visible here: LOG_DIR must be on a filesystem shared by all nodes"
  echo "rc=2 reason=log dir not shared" > "$LOG_DIR/nodes/$NODE.exit"
  exit 2
fi

# Node index in the allocation: ports are offset by index * PORT_STRIDE (0 on a real cluster, where every
# node has its own host; the local selftest runs several nodes on one host).
IDX=-1
for i in "${!CLUSTER_NODES[@]}"; do [ "${CLUSTER_NODES[$i]}" = "$NODE" ] && IDX=$i; done
if [ "$IDX" -lt 0 ]; then
  echo "[node $NODE] error: not in the allocation's node list (${CLUSTER_NODES[*]})"
  echo "rc=2 reason=unknown node" > "$LOG_DIR/nodes/$NODE.exit"; exit 2
fi
off=$(( IDX * PORT_STRIDE ))

node_ip() {  # this node's address for Ray, NCCL and gloo
  local ip=""
  if [ -n "${NODE_IP_CMD:-}" ]; then
    ip="$(NODE="$NODE" IDX="$IDX" bash -c "$NODE_IP_CMD" 2>/dev/null | head -1)"
  elif [ -n "${NET_IFNAME:-}" ]; then
    ip="$(ip -4 -o addr show dev "$NET_IFNAME" 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -1)"
  elif [ "$role" = worker ] && command -v ip >/dev/null 2>&1; then  # the interface that routes to the head
    ip="$(ip route get "$(cat "$LOG_DIR/head.ip")" 2>/dev/null | sed -n 's/.* src \([0-9a-f.:]*\).*/\1/p' | head -1)"
  fi
  [ -n "$ip" ] || ip="$(getent hosts "$(hostname)" 2>/dev/null | awk '{print $1}' | grep -v '^127\.' | head -1)"
  [ -n "$ip" ] || ip="$(hostname -I 2>/dev/null | awk '{print $1}')"
  echo "$ip"
}

finish() {  # finish RC REASON: record how this node ended, stop our Ray by pid, exit
  local rc="$1" reason="$2"
  echo "rc=$rc reason=$reason" > "$LOG_DIR/nodes/$NODE.exit.tmp" && mv "$LOG_DIR/nodes/$NODE.exit.tmp" "$LOG_DIR/nodes/$NODE.exit"
  if [ -n "${RAY_PID:-}" ] && kill -0 "$RAY_PID" 2>/dev/null; then
    kill -TERM "$RAY_PID" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$RAY_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$RAY_PID" 2>/dev/null
  fi
  rm -rf "$TEMP_DIR"
  echo "[node $NODE] $reason (rc=$rc), $(date -u +%FT%TZ)"
  exit "$rc"
}
trap 'finish 143 "terminated by a signal"' TERM INT

TEMP_DIR="${RAY_TMP_BASE:-/tmp}/ray_${SLURM_JOB_ID:-0}_${RESTART_COUNT}_${IDX}"   # node-local, short: unix socket paths
rm -rf "$TEMP_DIR"
for f in /dev/shm/nccl-*; do [ -O "$f" ] && rm -f "$f"; done 2>/dev/null   # stale NCCL segments of earlier jobs

if [ "$role" = worker ]; then  # the head's address comes through the shared log dir
  deadline=$(( SECONDS + HEAD_WAIT_S ))
  until [ -f "$LOG_DIR/STARTED_RAY_HEAD" ]; do
    [ -f "$LOG_DIR/ENDED" ] && finish 0 "job ended before the head started"
    [ $SECONDS -lt $deadline ] || finish 3 "head did not start within ${HEAD_WAIT_S}s"
    touch "$LOG_DIR/nodes/$NODE.beat"; sleep 0.5
  done
fi
IP="$(node_ip)"
[ -n "$IP" ] || finish 2 "could not determine this node's IP address"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-${NET_IFNAME:-}}" GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-${NET_IFNAME:-}}"
[ -n "$NCCL_SOCKET_IFNAME" ] || unset NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME
if [ "${ACCELERATOR:-cuda}" = musa ] && [ -n "${NET_IFNAME:-}" ]; then export MCCL_SOCKET_IFNAME="$NET_IFNAME"; fi

args=(--node-ip-address="$IP" --temp-dir="$TEMP_DIR" --disable-usage-stats --block
      --num-cpus="$RAY_NUM_CPUS" --num-gpus="$GPUS_PER_NODE"
      --node-manager-port=$(( PORT_NODE_MANAGER + off )) --object-manager-port=$(( PORT_OBJECT_MANAGER + off ))
      --runtime-env-agent-port=$(( PORT_RUNTIME_ENV_AGENT + off ))
      --dashboard-agent-grpc-port=$(( PORT_DASHBOARD_AGENT_GRPC + off ))
      --dashboard-agent-listen-port=$(( PORT_DASHBOARD_AGENT_LISTEN + off ))
      --metrics-export-port=$(( PORT_METRICS + off ))
      --min-worker-port=$(( PORT_WORKER_MIN + off )) --max-worker-port=$(( PORT_WORKER_MIN + off + WORKER_PORT_COUNT - 1 ))
      --resources="{\"node:slurm_$IDX\": 1}")
[ -n "${OBJECT_STORE_BYTES:-}" ] && args+=(--object-store-memory="$OBJECT_STORE_BYTES")
if [ "$role" = head ]; then
  args+=(--head --port="$PORT_GCS" --ray-client-server-port="$PORT_CLIENT" --include-dashboard=true
         --dashboard-host="$IP" --dashboard-port="$PORT_DASHBOARD")
else
  args+=(--address="$(cat "$LOG_DIR/head.ip"):$PORT_GCS")
fi
echo "[node $NODE] ip $IP, ray start ${args[*]}"

start_once() {  # start Ray (blocking form, in the background); 0 once this node's raylet is up
  "$PY" -m ray.scripts.scripts start "${args[@]}" &
  RAY_PID=$!
  local deadline=$(( SECONDS + RAY_START_S ))
  while kill -0 "$RAY_PID" 2>/dev/null; do
    # the raylet writes its socket once registered with the GCS
    if compgen -G "$TEMP_DIR/session_latest/sockets/raylet*" >/dev/null; then return 0; fi
    [ $SECONDS -lt $deadline ] || { kill -TERM "$RAY_PID" 2>/dev/null; wait "$RAY_PID" 2>/dev/null; return 1; }
    touch "$LOG_DIR/nodes/$NODE.beat"; sleep 0.5
  done
  wait "$RAY_PID" 2>/dev/null
  return 1
}

ok=0
for attempt in $(seq 1 "$RAY_START_TRIES"); do
  if start_once; then ok=1; break; fi
  echo "[node $NODE] ray start attempt $attempt failed"
  rm -rf "$TEMP_DIR"; RAY_PID=""
  [ -f "$LOG_DIR/ENDED" ] && finish 0 "job ended during start-up"
  sleep "$attempt"
done
[ "$ok" = 1 ] || finish 4 "ray start failed $RAY_START_TRIES times (see the lines above)"

if [ "$role" = head ]; then
  echo "$IP" > "$LOG_DIR/head.ip.tmp" && mv "$LOG_DIR/head.ip.tmp" "$LOG_DIR/head.ip"
  touch "$LOG_DIR/STARTED_RAY_HEAD"
fi
echo "$IP" > "$LOG_DIR/nodes/$NODE.joined"
echo "[node $NODE] ray is up, $(date -u +%FT%TZ)"

while kill -0 "$RAY_PID" 2>/dev/null; do
  [ -f "$LOG_DIR/ENDED" ] && finish 0 "stopped at the end of the job"
  touch "$LOG_DIR/nodes/$NODE.beat"
  sleep "$HEARTBEAT_S"
done
wait "$RAY_PID"; rc=$?
RAY_PID=""
[ -f "$LOG_DIR/ENDED" ] && finish 0 "stopped at the end of the job"
finish "$(( rc == 0 ? 5 : rc ))" "ray exited unexpectedly (exit $rc)"
