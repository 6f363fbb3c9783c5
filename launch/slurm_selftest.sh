#!/usr/bin/env bash
# A real slurm on this machine (Debian's slurmctld, slurmd, munge), several fake nodes (`slurmd -N nodeK`
# on one host, each with fake GPUs), and launch/slurm_train.sbatch run on it end to end:
#   1. a 2-node job trains the toy RL config through Ray (ray job submit) to its JSON summary;
#   2. a 2-node job whose worker is killed during bring-up fails fast, naming the node;
#   3. the same job requeued (scontrol requeue) logs to <jobid>-logs-1, keeps <jobid>-logs, comes up in
#      attach mode, and attach.sh runs a command on the worker node that sees both Ray nodes.
#
#   bash launch/slurm_selftest.sh        # last line: JSON {nodes, job_state, summary, failfast_seconds, ...}
#
# Needs root and apt (installs slurmctld slurmd slurm-client munge when missing); without them it prints
# {"skipped": "<why>"} and exits 0. Everything runs under a temp dir with its own munge socket, config, state
# and ports; one selftest at a time per machine (flock). KEEP=1 keeps the temp dir; SELFTEST_NODES (3) fake
# nodes; SELFTEST_TIMEOUT_S (420) bounds each job.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
: "${SELFTEST_NODES:=3}" "${SELFTEST_TIMEOUT_S:=420}" "${KEEP:=0}"
T0=$SECONDS

skip() { echo "[selftest] skipped: $1" >&2; printf '{"skipped": "%s"}\n' "$1"; exit 0; }
fail() { echo "[selftest] FAILED: $1" >&2; printf '{"error": "%s"}\n' "${1//\"/\'}"; exit 1; }
say() { echo "[selftest +$(( SECONDS - T0 ))s] $*" >&2; }

[ "$(id -u)" = 0 ] || skip "needs root (slurmd and munged run as root here)"
PY="${PY:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || skip "no project venv at $PY (run: source launch/_env.sh; ensure_venv)"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || skip "slurm is not installed and apt-get is not available"
  say "installing slurmctld slurmd slurm-client munge with apt"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge; } \
    >/tmp/slurm-selftest-apt.log 2>&1 || skip "apt-get install of slurm failed (log: /tmp/slurm-selftest-apt.log)"
fi

exec 9>/tmp/musacoder-slurm-selftest.lock
flock -w 900 9 || fail "another slurm selftest holds /tmp/musacoder-slurm-selftest.lock"

W="$(mktemp -d /tmp/slurm-selftest.XXXXXX)"
PIDS=()
cleanup() {
  set +e
  if [ -n "${SLURM_CONF:-}" ]; then
    for j in ${JOBS:-}; do scancel "$j" 2>/dev/null; done
    sleep 1
  fi
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill -TERM "${PIDS[$i]}" 2>/dev/null; done
  for p in "${PIDS[@]}"; do for _ in $(seq 1 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.25; done; kill -KILL "$p" 2>/dev/null; done
  [ "$KEEP" = 1 ] && echo "[selftest] kept $W" >&2 || rm -rf "$W"
}
trap cleanup EXIT

free_port_block() {  # free_port_block N: a base port with N free consecutive ports below the ephemeral range
  "$PY" - "$1" <<'PYEOF'
import socket, sys, random
n = int(sys.argv[1])
for _ in range(200):
    base = random.randrange(10000, 30000 - n, 10)
    ok = True
    for p in range(base, base + n):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            ok = False
        finally:
            s.close()
        if not ok:
            break
    if ok:
        print(base)
        sys.exit(0)
sys.exit(1)
PYEOF
}

# ---- munge, with its own key and socket
mkdir -p "$W"/{munge,spool,state,log,dev,logs,runs,pydeps}
chmod 700 "$W/munge"
dd if=/dev/urandom of="$W/munge/munge.key" bs=1 count=1024 status=none
chmod 400 "$W/munge/munge.key"
munged --key-file="$W/munge/munge.key" --socket="$W/munge/munge.sock" --pid-file="$W/munge/munged.pid" \
       --log-file="$W/munge/munged.log" --seed-file="$W/munge/seed" --force
for _ in $(seq 1 50); do [ -s "$W/munge/munged.pid" ] && break; sleep 0.1; done
PIDS+=("$(cat "$W/munge/munged.pid")")

# ---- fake GPUs: character devices with /dev/null's numbers (gres needs devices, not files)
GPUS=2
GRES_OK=1
for g in $(seq 0 $(( GPUS - 1 ))); do mknod "$W/dev/fakegpu$g" c 1 3 2>/dev/null || GRES_OK=0; done

# ---- slurm.conf: one controller, SELFTEST_NODES slurmd on one host, distinct ports
SLURM_PORTS="$(free_port_block $(( SELFTEST_NODES + 2 )))" || fail "no free ports for slurm"
NODES_EXPR="node[1-$SELFTEST_NODES]"
cat > "$W/slurm.conf" <<EOF
ClusterName=selftest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$SLURM_PORTS
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$W/munge/munge.sock
CredType=cred/munge
StateSaveLocation=$W/state
SlurmdSpoolDir=$W/spool/%n
SlurmctldPidFile=$W/slurmctld.pid
SlurmdPidFile=$W/slurmd-%n.pid
SlurmctldLogFile=$W/log/slurmctld.log
SlurmdLogFile=$W/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
MinJobAge=3600
JobRequeue=1
KillWait=5
InactiveLimit=0
SlurmdTimeout=60
$( [ "$GRES_OK" = 1 ] && echo "GresTypes=gpu" )
NodeName=$NODES_EXPR NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(( SLURM_PORTS + 1 ))-$(( SLURM_PORTS + SELFTEST_NODES )) CPUs=4 RealMemory=4000 $( [ "$GRES_OK" = 1 ] && echo "Gres=gpu:$GPUS" ) State=UNKNOWN
PartitionName=batch Nodes=$NODES_EXPR Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
[ "$GRES_OK" = 1 ] && echo "NodeName=$NODES_EXPR Name=gpu File=$W/dev/fakegpu[0-$(( GPUS - 1 ))]" > "$W/gres.conf"
export SLURM_CONF="$W/slurm.conf"

slurmctld -f "$SLURM_CONF" -D -i >"$W/log/slurmctld.out" 2>&1 &
PIDS+=($!)
for n in $(seq 1 "$SELFTEST_NODES"); do
  slurmd -f "$SLURM_CONF" -N "node$n" -D >"$W/log/slurmd-node$n.out" 2>&1 &
  PIDS+=($!)
done
deadline=$(( SECONDS + 60 ))
until [ "$(sinfo -h -p batch -t idle -o '%D' 2>/dev/null | awk '{s+=$1} END {print s+0}')" = "$SELFTEST_NODES" ]; do
  [ $SECONDS -lt $deadline ] || fail "slurm did not bring $SELFTEST_NODES nodes up in 60s: $(sinfo -h -N -o '%N %T %E' 2>&1 | tr '\n' ';') $(tail -3 "$W/log/slurmctld.log" 2>/dev/null | tr '\n' ';')"
  sleep 0.5
done
say "slurm up: $(sinfo -h -N -o '%N:%T:%G' | tr '\n' ' ')"

# ---- Ray's dashboard (the cluster extra) for `ray job submit`, next to the venv, not in it
"$PY" - "$REPO" > "$W/cluster-extra.txt" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[1] + "/launch")
import lock
base = lock.read_pins(lock.ROOT / "requirements.lock")
for n, v in sorted(lock.read_pins(lock.ROOT / "requirements-cluster.lock").items()):
    if n not in base:
        print(f"{n}=={v}")
PYEOF
if ! "$PY" -c "import aiohttp_cors, opencensus, prometheus_client" 2>/dev/null; then
  "$PY" -m pip install -q --no-cache-dir --no-deps --target "$W/pydeps" -r "$W/cluster-extra.txt" \
    >"$W/log/pip.log" 2>&1 || fail "pip install of the cluster extra failed: $(tail -2 "$W/log/pip.log" | tr '\n' ' ')"
fi

RAY_PORTS="$(free_port_block 600)" || fail "no free ports for Ray"
common_env=(
  "PY=$PY" "PYTHONPATH=$W/pydeps" "BASE_LOG_DIR=$W/logs" "RAY_TMP_BASE=$W"
  "NODE_IP_CMD=echo 127.0.0.\$(( IDX + 2 ))" "RAY_NUM_CPUS=2" "OBJECT_STORE_BYTES=80000000"
  "PORT_GCS=$RAY_PORTS" "PORT_CLIENT=$(( RAY_PORTS + 1 ))" "PORT_DASHBOARD=$(( RAY_PORTS + 2 ))"
  "PORT_NODE_MANAGER=$(( RAY_PORTS + 10 ))" "PORT_OBJECT_MANAGER=$(( RAY_PORTS + 11 ))"
  "PORT_RUNTIME_ENV_AGENT=$(( RAY_PORTS + 12 ))" "PORT_DASHBOARD_AGENT_GRPC=$(( RAY_PORTS + 13 ))"
  "PORT_DASHBOARD_AGENT_LISTEN=$(( RAY_PORTS + 14 ))" "PORT_METRICS=$(( RAY_PORTS + 15 ))"
  "PORT_WORKER_MIN=$(( RAY_PORTS + 100 ))" "WORKER_PORT_COUNT=100" "PORT_STRIDE=200"
  "HEARTBEAT_S=1" "LIVENESS_S=10" "HEAD_WAIT_S=120" "BRINGUP_S=180" "RAY_START_S=90" "OMP_NUM_THREADS=1"
)
GPU_FLAG=("--gpus-per-node=$GPUS")
[ "$GRES_OK" = 1 ] || GPU_FLAG=(--gpus-per-node=0)

job_state() { scontrol show job -o "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
wait_state() {  # wait_state JOB STATES_REGEX TIMEOUT: the state once it matches
  local s deadline=$(( SECONDS + $3 ))
  while :; do
    s="$(job_state "$1")"
    [[ "$s" =~ ^($2)$ ]] && { echo "$s"; return 0; }
    [ $SECONDS -lt $deadline ] || { echo "${s:-UNKNOWN}"; return 1; }
    sleep 0.5
  done
}
submit() {  # submit NAME ARGS...: job id
  env "${common_env[@]}" sbatch --parsable -N 2 "${GPU_FLAG[@]}" --job-name="$1" --chdir="$REPO" \
      --output="$W/logs/$1-%j.out" "${@:2}" | cut -d';' -f1
}

# ---- 1. the toy RL job, 2 nodes
JOBS=""
if [ "${SELFTEST_SKIP_TOY:-0}" = 1 ]; then  # debugging the failure cases only; never in CI
  summary='{"skipped": true}'; bringup=null; state=COMPLETED
else
A="$(submit toy launch/slurm_train.sbatch --config configs/toy_learn.yaml train.steps=2 data.prompts_per_step=4 \
     "train.log_dir=$W/runs/toy")" || fail "sbatch refused the toy job"
JOBS="$A"
say "toy job $A submitted"
state="$(wait_state "$A" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY' "$SELFTEST_TIMEOUT_S")" || true
LA="$W/logs/$A-logs"
summary="$(grep -E '^\{.*"steps"' "$LA/driver.log" 2>/dev/null | tail -1)" || true
if [ "$state" != COMPLETED ] || [ -z "$summary" ]; then
  tail -25 "$LA/batch.log" "$LA/driver.log" "$LA"/nodes/*.log >&2 2>/dev/null || true
  fail "toy job $A ended $state with summary '${summary:-none}' (logs $LA)"
fi
bringup="$(cat "$LA/bringup_seconds" 2>/dev/null || echo null)"
say "toy job $A: $state, cluster up in ${bringup}s, summary $summary"
fi

# ---- 2. a worker killed during bring-up: the job fails fast and names the node
B="$(submit failfast --requeue launch/slurm_train.sbatch --attach)" || fail "sbatch refused the fail-fast job"
JOBS="$JOBS $B"
LB="$W/logs/$B-logs"
deadline=$(( SECONDS + 120 ))
victim=""
while [ -z "$victim" ]; do
  head_node="$(sed -n 's/^declare -- HEAD_NODE="\(.*\)"$/\1/p' "$LB/cluster.env" 2>/dev/null || true)"
  for f in "$LB"/nodes/*.pid; do
    [ -n "$head_node" ] && [ -f "$f" ] || continue
    n="$(basename "$f" .pid)"
    [ "$n" = "$head_node" ] && continue
    [ -f "$LB/nodes/$n.joined" ] && fail "worker $n joined before it could be killed: bring-up is not observable"
    victim="$n"
  done
  [ $SECONDS -lt $deadline ] || fail "job $B: no worker started within 120s (state $(job_state "$B"))"
  [ -n "$victim" ] || sleep 0.2
done
kill -KILL "$(cat "$LB/nodes/$victim.pid")"
t_kill=$(date +%s.%N)
say "killed the Ray node wrapper of worker $victim (job $B) during bring-up"
state="$(wait_state "$B" 'FAILED|COMPLETED|CANCELLED|TIMEOUT' 180)" || true
t_end=$(date +%s.%N)
failfast="$("$PY" -c "print(round($t_end - $t_kill, 1))")"
detect="$("$PY" -c "import os; print(round(os.path.getmtime('$LB/FAILED') - $t_kill, 1))" 2>/dev/null || echo null)"
[ "$state" = FAILED ] || fail "job $B with a killed worker ended $state, not FAILED"
grep -q "$victim" "$LB/FAILED" 2>/dev/null || fail "job $B failed without naming node $victim: $(cat "$LB/FAILED" 2>/dev/null)"
say "job $B named the dead node ${detect}s after the kill and ended FAILED after ${failfast}s: $(head -1 "$LB/FAILED")"

# ---- 3. requeued: a new log dir, the old one kept; attach mode; a command on the worker via attach.sh
scontrol requeue "$B" || fail "scontrol requeue $B refused"
# slurmctld holds a requeued job back ~2 minutes; start it now (after the nodes let go of its first run:
# a slurmd refuses to launch a job id it killed a moment ago)
sleep "${REQUEUE_SETTLE_S:-5}"
scontrol update JobId="$B" StartTime=now >/dev/null 2>&1 || true
LB1="$W/logs/$B-logs-1"
deadline=$(( SECONDS + SELFTEST_TIMEOUT_S ))
until [ -x "$LB1/attach.sh" ]; do
  s="$(job_state "$B")"
  [[ "$s" =~ ^(PENDING|CONFIGURING|RUNNING|REQUEUED)$ ]] || fail "requeued job $B is $s before attach mode (logs $LB1)"
  [ $SECONDS -lt $deadline ] || fail "requeued job $B did not reach attach mode"
  sleep 0.5
done
attach_out="$(timeout 120 bash "$LB1/attach.sh" 1 "$PY" -c \
  "import os, ray; ray.init(address=os.environ['RAY_ADDRESS'], logging_level='ERROR'); print('attach-nodes', len([n for n in ray.nodes() if n['Alive']]), os.environ.get('SLURMD_NODENAME'))" \
  > "$W/attach.out" 2>&1; grep attach-nodes "$W/attach.out" | tail -1)" || true
touch "$LB1/ENDED"
state1="$(wait_state "$B" 'COMPLETED|FAILED|CANCELLED|TIMEOUT' 120)" || true
[ -f "$LB/FAILED" ] && [ -f "$LB/nodes/$victim.log" ] || fail "the first run's logs of $B are gone"
[ "$state1" = COMPLETED ] || fail "requeued job $B ended $state1"
attach_nodes="$(echo "$attach_out" | awk '{print $2}')"
[ "$attach_nodes" = 2 ] || fail "attach.sh on the worker saw '${attach_out:-nothing}', expected 2 Ray nodes: $(tail -5 "$W/attach.out" | tr '\n' ' ')"
say "requeued job $B: logs in $(basename "$LB") and $(basename "$LB1"), attach on $(echo "$attach_out" | awk '{print $3}') saw $attach_nodes nodes; $state1"

"$PY" - "$summary" "$failfast" "$bringup" "$victim" "$attach_nodes" "$(basename "$LB")" "$(basename "$LB1")" \
       "$(( SECONDS - T0 ))" "$SELFTEST_NODES" "$detect" <<'PYEOF'
import json, sys
summary, failfast, bringup, victim, attach, d0, d1, wall, fake, detect = sys.argv[1:]
print(json.dumps({"nodes": 2, "job_state": "COMPLETED", "summary": json.loads(summary),
                  "failfast_seconds": float(failfast), "killed_node": victim,
                  "failfast_detect_seconds": None if detect == "null" else float(detect),
                  "bringup_seconds": None if bringup == "null" else float(bringup),
                  "requeue_log_dirs": [d0, d1], "attach_nodes": int(attach), "fake_nodes": int(fake),
                  "wall_seconds": int(wall)}))
PYEOF
