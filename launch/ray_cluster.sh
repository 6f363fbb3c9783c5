# shellcheck shell=bash
# A Ray cluster over the current slurm allocation, and jobs submitted to it (sourced by launch/*.sbatch).
#
#   ray_cluster_up             head on the first node, then ONE batched srun for all other nodes; returns once
#                              every node joined (file handshakes in $LOG_DIR, then one check with Ray itself)
#   ray_job_submit CMD...      `ray job submit` CMD (run on the head, logs in $LOG_DIR/driver.log) while the
#                              liveness monitor watches every node; returns the job's exit status
#   ray_cluster_attach         keep the cluster up for interactive use; writes $LOG_DIR/attach.sh
#   ray_cluster_down           stop every node (ENDED file; each node stops its own Ray by pid)
#
# Fail fast: a node whose srun step dies, whose heartbeat goes stale, or that does not come up in time
# ends the job at once with an error naming the node (exit 1); nothing waits out a fixed sleep.
#
# Logs: $BASE_LOG_DIR/<jobid>-logs/ (-<n> appended on the n-th requeue: SLURM_RESTART_COUNT), on a filesystem
# every node sees (checked with a canary file): batch.log (this script), nodes/<node>.log (each node's
# Ray start-up and state), driver.log (the submitted job), ray-head.log / ray-workers.log (srun's own
# messages), cluster.env, driver_command.sh, attach.sh, and the handshake files (STARTED_RAY_HEAD,
# nodes/*.joined, nodes/*.beat, nodes/*.exit, ENDED).
#
# Settings (environment; defaults in brackets):
#   GPUS_PER_NODE [SLURM_GPUS_ON_NODE, else 0]   RAY_NUM_CPUS [SLURM_CPUS_ON_NODE]   PY [.venv/bin/python or python3]
#   BASE_LOG_DIR [$SLURM_SUBMIT_DIR/logs]   NET_IFNAME (pin Ray/NCCL/gloo to one interface, e.g. ib0)
#   NODE_IP_CMD (a command printing a node's IP; sees NODE and IDX)   ACCELERATOR [cuda] (musa: MCCL vars)
#   CONTAINER_IMAGE, CONTAINER_MOUNTS (pyxis/enroot; no container flags when unset)
#   Ports, all below the ephemeral range: PORT_GCS [6379->1200] PORT_CLIENT [1201] PORT_DASHBOARD [8265]
#   PORT_NODE_MANAGER [1301] PORT_OBJECT_MANAGER [1302] PORT_RUNTIME_ENV_AGENT [1303]
#   PORT_DASHBOARD_AGENT_GRPC [1304] PORT_DASHBOARD_AGENT_LISTEN [1305] PORT_METRICS [1306]
#   PORT_WORKER_MIN [2000] WORKER_PORT_COUNT [1000] PORT_STRIDE [0] (per-node offset, for nodes sharing a host)
#   Timeouts (s): HEAD_WAIT_S [600] BRINGUP_S [900] RAY_START_S [120] RAY_START_TRIES [3]
#   HEARTBEAT_S [5] LIVENESS_S [60] (a node whose heartbeat is older is dead)   OBJECT_STORE_BYTES
: "${PORT_GCS:=1200}" "${PORT_CLIENT:=1201}" "${PORT_DASHBOARD:=8265}"
: "${PORT_NODE_MANAGER:=1301}" "${PORT_OBJECT_MANAGER:=1302}" "${PORT_RUNTIME_ENV_AGENT:=1303}"
: "${PORT_DASHBOARD_AGENT_GRPC:=1304}" "${PORT_DASHBOARD_AGENT_LISTEN:=1305}" "${PORT_METRICS:=1306}"
: "${PORT_WORKER_MIN:=2000}" "${WORKER_PORT_COUNT:=1000}" "${PORT_STRIDE:=0}"
: "${HEAD_WAIT_S:=600}" "${BRINGUP_S:=900}" "${RAY_START_S:=120}" "${RAY_START_TRIES:=3}"
: "${HEARTBEAT_S:=5}" "${LIVENESS_S:=60}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
       TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0 \
       RAY_worker_register_timeout_seconds="${RAY_worker_register_timeout_seconds:-120}"

_log() { echo "[ray-slurm $(date -u +%T)] $*"; }
_die() { echo "[ray-slurm $(date -u +%T)] error: $*" >&2; [ -n "${LOG_DIR:-}" ] && echo "error: $*" >> "$LOG_DIR/FAILED"; ray_cluster_down; exit 1; }

_container_flags() {  # pyxis/enroot flags, only when a container is asked for
  CONTAINER_FLAGS=()
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    CONTAINER_FLAGS=(--container-image="$CONTAINER_IMAGE" --container-name=musacoder-ray
                     --container-workdir="$REPO_DIR" --no-container-mount-home)
    [ -n "${CONTAINER_MOUNTS:-}" ] && CONTAINER_FLAGS+=(--container-mounts="$CONTAINER_MOUNTS")
  fi
}

ray_cluster_setup() {  # allocation facts, log dir, ports; writes $LOG_DIR/cluster.env
  : "${SLURM_JOB_ID:?not inside a slurm job (SLURM_JOB_ID unset)}" "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST unset}"
  REPO_DIR="$(pwd)"
  if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY="$REPO_DIR/.venv/bin/python"; else PY="${PYTHON:-python3}"; fi
  fi
  # `ray job submit` and the job server live in Ray's dashboard (ray[default]): fail now, not after bring-up
  "$PY" -c "import aiohttp_cors, opencensus, prometheus_client" 2>/dev/null || {
    echo "error: $PY lacks Ray's dashboard (ray[default]); install requirements-cluster.lock on the nodes or use the images in docker/" >&2
    exit 1; }
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  local want="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-${#NODES[@]}}}"
  [ "${#NODES[@]}" -ge 1 ] && [ "${#NODES[@]}" -eq "$want" ] \
    || { echo "error: node list '$SLURM_JOB_NODELIST' expands to ${#NODES[@]} nodes, the job has $want" >&2; exit 1; }
  HEAD_NODE="${NODES[0]}"
  : "${GPUS_PER_NODE:=${SLURM_GPUS_ON_NODE:-0}}"
  : "${RAY_NUM_CPUS:=${SLURM_CPUS_ON_NODE:-$(nproc)}}"
  local floor last top=$(( PORT_WORKER_MIN + (${#NODES[@]} - 1) * PORT_STRIDE + WORKER_PORT_COUNT - 1 ))
  read -r floor last < /proc/sys/net/ipv4/ip_local_port_range || floor=32768
  for p in "$PORT_GCS" "$PORT_CLIENT" "$PORT_DASHBOARD" "$PORT_METRICS" "$top"; do
    [ "$p" -lt "$floor" ] || { echo "error: port $p is inside the ephemeral range ($floor-$last): lower the PORT_* settings" >&2; exit 1; }
  done
  RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"
  local base="${BASE_LOG_DIR:-${SLURM_SUBMIT_DIR:-$REPO_DIR}/logs}"
  LOG_DIR="$base/${SLURM_JOB_ID}-logs"
  [ "$RESTART_COUNT" -gt 0 ] && LOG_DIR="$LOG_DIR-$RESTART_COUNT"
  [ -e "$LOG_DIR" ] && { echo "error: log dir $LOG_DIR exists already (a restart without SLURM_RESTART_COUNT?)" >&2; exit 1; }
  mkdir -p "$LOG_DIR/nodes"
  export LOG_DIR
  exec > >(tee -a "$LOG_DIR/batch.log") 2>&1
  date -u +%FT%TZ > "$LOG_DIR/.shared_fs_canary"
  # Ray >= 2.5x authenticates every connection with a token (RAY_AUTH_MODE=token). One per job, made here and
  # read by every node, the driver and attach.sh from the shared log dir (owner-only).
  if [ "${RAY_AUTH_MODE:-token}" = token ]; then
    (umask 077; "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$LOG_DIR/.ray_auth_token") \
      || { echo "error: could not write the Ray auth token" >&2; exit 1; }
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$LOG_DIR/.ray_auth_token"
  fi

  {
    declare -p PY REPO_DIR HEAD_NODE GPUS_PER_NODE RAY_NUM_CPUS RESTART_COUNT
    echo "CLUSTER_NODES=(${NODES[*]})"
    for v in PORT_GCS PORT_CLIENT PORT_DASHBOARD PORT_NODE_MANAGER PORT_OBJECT_MANAGER PORT_RUNTIME_ENV_AGENT \
             PORT_DASHBOARD_AGENT_GRPC PORT_DASHBOARD_AGENT_LISTEN PORT_METRICS PORT_WORKER_MIN WORKER_PORT_COUNT \
             PORT_STRIDE HEAD_WAIT_S RAY_START_S RAY_START_TRIES HEARTBEAT_S; do declare -p "$v"; done
    for v in NET_IFNAME NODE_IP_CMD ACCELERATOR OBJECT_STORE_BYTES RAY_TMP_BASE; do
      [ -n "${!v:-}" ] && declare -p "$v"
    done
    for v in RAY_AUTH_MODE RAY_AUTH_TOKEN_PATH; do
      [ -n "${!v:-}" ] && echo "export $v=$(printf %q "${!v}")"
    done
  } > "$LOG_DIR/cluster.env"
  _container_flags
  _log "job $SLURM_JOB_ID (restart $RESTART_COUNT): ${#NODES[@]} node(s) [${NODES[*]}] x $GPUS_PER_NODE GPU(s), $RAY_NUM_CPUS CPU(s) for Ray; logs in $LOG_DIR"
}

_node_problem() {  # the first node that is dead or late, as "NODE: why"; empty if all are fine
  local n now age
  now=$(date +%s)
  for n in "$@"; do
    if [ -f "$LOG_DIR/nodes/$n.exit" ]; then
      echo "$n: its Ray node ended ($(cat "$LOG_DIR/nodes/$n.exit")); see $LOG_DIR/nodes/$n.log"; return
    fi
    if [ -f "$LOG_DIR/nodes/$n.beat" ]; then
      age=$(( now - $(stat -c %Y "$LOG_DIR/nodes/$n.beat") ))
      if [ "$age" -gt "$LIVENESS_S" ]; then
        echo "$n: no heartbeat for ${age}s (killed or hung); see $LOG_DIR/nodes/$n.log"; return
      fi
    fi
  done
}

_check_steps() {  # die naming the node when a step died or a node stopped beating
  local p
  p="$(_node_problem "${NODES[@]}")"
  [ -z "$p" ] || _die "node $p"
  if ! kill -0 "$HEAD_SRUN" 2>/dev/null; then
    _die "node $HEAD_NODE: the head's srun step exited; see $LOG_DIR/nodes/$HEAD_NODE.log and $LOG_DIR/ray-head.log"
  fi
  if [ -n "${WORKER_SRUN:-}" ] && ! kill -0 "$WORKER_SRUN" 2>/dev/null; then
    sleep 1  # let a dying node's exit file land
    p="$(_node_problem "${NODES[@]:1}")"
    local n missing=()
    for n in "${NODES[@]:1}"; do [ -f "$LOG_DIR/nodes/$n.exit" ] || missing+=("$n"); done
    [ -n "$p" ] || p="${missing[*]:-${NODES[*]:1}}: killed (the worker step ended without a word from the node)"
    _die "node $p; srun's messages in $LOG_DIR/ray-workers.log"
  fi
}

ray_cluster_up() {
  [ -n "${LOG_DIR:-}" ] || ray_cluster_setup
  local t0=$SECONDS n
  srun --overlap --nodes=1 --ntasks=1 -w "$HEAD_NODE" --kill-on-bad-exit=1 "${CONTAINER_FLAGS[@]}" \
       -o "$LOG_DIR/ray-head.log" bash "$REPO_DIR/launch/ray_node.sh" head &
  HEAD_SRUN=$!
  _log "head step started on $HEAD_NODE; waiting for $LOG_DIR/STARTED_RAY_HEAD"
  local deadline=$(( SECONDS + HEAD_WAIT_S ))
  until [ -f "$LOG_DIR/STARTED_RAY_HEAD" ]; do
    _check_steps
    [ $SECONDS -lt $deadline ] || _die "node $HEAD_NODE: the Ray head did not start within ${HEAD_WAIT_S}s; see $LOG_DIR/nodes/$HEAD_NODE.log"
    sleep 0.5
  done
  HEAD_IP="$(cat "$LOG_DIR/head.ip")"
  export RAY_ADDRESS="$HEAD_IP:$PORT_GCS" RAY_DASHBOARD_URL="http://$HEAD_IP:$PORT_DASHBOARD" HEAD_IP
  _log "head up at $RAY_ADDRESS after $(( SECONDS - t0 ))s"
  WORKER_SRUN=""
  local nw=$(( ${#NODES[@]} - 1 ))
  if [ "$nw" -gt 0 ]; then  # one step for all workers: no per-node srun fan-out against slurmctld
    srun --overlap --nodes="$nw" --ntasks="$nw" --ntasks-per-node=1 --exclude="$HEAD_NODE" --kill-on-bad-exit=1 \
         "${CONTAINER_FLAGS[@]}" -o "$LOG_DIR/ray-workers.log" bash "$REPO_DIR/launch/ray_node.sh" worker &
    WORKER_SRUN=$!
  fi
  deadline=$(( SECONDS + BRINGUP_S ))
  while :; do
    _check_steps
    local waiting=()
    for n in "${NODES[@]}"; do [ -f "$LOG_DIR/nodes/$n.joined" ] || waiting+=("$n"); done
    [ ${#waiting[@]} -gt 0 ] || break
    [ $SECONDS -lt $deadline ] || _die "node ${waiting[*]}: not joined within ${BRINGUP_S}s; see $LOG_DIR/nodes/${waiting[0]}.log"
    sleep 0.5
  done
  # The handshake says every raylet started; Ray itself must agree before a job is submitted.
  local seen
  seen="$(timeout 120 "$PY" - "$RAY_ADDRESS" "${#NODES[@]}" <<'PYEOF' 2>&1 | tail -1
import sys, time
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
want, deadline = int(sys.argv[2]), time.time() + 60
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.time() > deadline:
        break
    time.sleep(0.5)
res = ray.cluster_resources()
print(f"nodes={len(alive)} cpus={int(res.get('CPU', 0))} gpus={int(res.get('GPU', 0))}")
PYEOF
)"
  [[ "$seen" == "nodes=${#NODES[@]} "* ]] || _die "Ray reports '$seen', expected nodes=${#NODES[@]} (all nodes wrote their handshake)"
  echo "$(( SECONDS - t0 ))" > "$LOG_DIR/bringup_seconds"
  _log "cluster up in $(( SECONDS - t0 ))s: $seen; dashboard $RAY_DASHBOARD_URL"
}

ray_job_submit() {  # ray_job_submit CMD... : run CMD as a Ray job on the head; its exit status
  local script="$LOG_DIR/driver_command.sh" id="slurm-${SLURM_JOB_ID}-${RESTART_COUNT}"
  # the driver runs under Ray's job server, not this shell: the requeue count it reads (the lock wait) goes with it
  { echo "#!/usr/bin/env bash"; echo "cd $(printf %q "$REPO_DIR")"; echo "export SLURM_RESTART_COUNT=$RESTART_COUNT"
    printf '%q ' "$@"; echo; } > "$script"
  bash -n "$script" || _die "the generated $script does not parse"
  _log "ray job submit ($id): $*"
  "$PY" -m ray.scripts.scripts job submit --address="$RAY_DASHBOARD_URL" --submission-id="$id" \
        -- bash "$script" > "$LOG_DIR/driver.log" 2>&1 &
  local submit=$!
  while kill -0 "$submit" 2>/dev/null; do
    _check_steps
    sleep 1
  done
  local rc=0
  wait "$submit" || rc=$?
  local status
  status="$("$PY" - "$RAY_DASHBOARD_URL" "$id" <<'PYEOF' 2>/dev/null
import json, os, sys, urllib.request
req = urllib.request.Request(f"{sys.argv[1]}/api/jobs/{sys.argv[2]}")
token_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
if os.environ.get("RAY_AUTH_MODE") == "token" and token_path:
    req.add_header("Authorization", "Bearer " + open(token_path).read().strip())
with urllib.request.urlopen(req, timeout=30) as r:
    print(json.load(r).get("status", "UNKNOWN"))
PYEOF
)" || status=UNKNOWN
  _log "job $id: $status (ray job submit exit $rc); its output: $LOG_DIR/driver.log"
  echo "$status" > "$LOG_DIR/job_status"
  [ "$status" = SUCCEEDED ] && return 0
  return 1
}

ray_cluster_attach() {  # keep the cluster for interactive use until ENDED, scancel or the time limit
  local a="$LOG_DIR/attach.sh"
  {
    echo "#!/usr/bin/env bash"
    echo "# bash $a [NODE_INDEX [COMMAND...]]: a shell (or COMMAND) on node NODE_INDEX (0 = head) of job $SLURM_JOB_ID,"
    echo "# with RAY_ADDRESS set. 'touch $LOG_DIR/ENDED' releases the allocation."
    echo "nodes=(${NODES[*]})"
    echo "i=\"\${1:-0}\"; shift \$(( \$# > 0 ? 1 : 0 ))"
    echo "[ -n \"\${nodes[\$i]:-}\" ] || { echo \"no node \$i (job has \${#nodes[@]})\" >&2; exit 2; }"
    if [ ${#CONTAINER_FLAGS[@]} -gt 0 ]; then printf 'flags=(%s)\n' "$(printf '%q ' "${CONTAINER_FLAGS[@]}")"; else echo "flags=()"; fi
    echo "if [ \$# -eq 0 ]; then set -- bash -l; pty=(--pty); else pty=(); fi"
    echo "exec srun --overlap --jobid $SLURM_JOB_ID --nodes=1 --ntasks=1 -w \"\${nodes[\$i]}\" \"\${flags[@]}\" \"\${pty[@]}\" \\"
    echo "  env RAY_ADDRESS=$RAY_ADDRESS RAY_DASHBOARD_URL=$RAY_DASHBOARD_URL RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} \\"
    echo "      RAY_AUTH_TOKEN_PATH=$(printf %q "${RAY_AUTH_TOKEN_PATH:-}") PYTHONPATH=$(printf %q "$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}") \"\$@\""
  } > "$a.tmp" && mv "$a.tmp" "$a" && chmod +x "$a"
  bash -n "$a" || _die "the generated $a does not parse"
  _log "attach mode: bash $a [node-index] (0 = head $HEAD_NODE); submit with: $PY -m ray.scripts.scripts job submit --address=$RAY_DASHBOARD_URL -- CMD"
  _log "release the allocation with: touch $LOG_DIR/ENDED (or scancel $SLURM_JOB_ID)"
  until [ -f "$LOG_DIR/ENDED" ]; do
    _check_steps
    sleep 1
  done
}

ray_cluster_down() {
  [ -n "${LOG_DIR:-}" ] || return 0
  touch "$LOG_DIR/ENDED"
  local p
  for p in ${HEAD_SRUN:-} ${WORKER_SRUN:-}; do  # each node stops its own Ray, then its step ends
    for _ in $(seq 1 30); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
    kill -TERM "$p" 2>/dev/null || true
  done
  for p in ${HEAD_SRUN:-} ${WORKER_SRUN:-}; do wait "$p" 2>/dev/null || true; done
}
