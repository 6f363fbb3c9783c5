# Bring a Ray cluster up over the current slurm allocation (sourced by launch/*.sbatch).
#
# Node 0 runs the head, every other node one worker, each as a long-lived `srun` step that holds
# its node's GPUs. `ray_cluster_up` returns once the cluster reports every node's GPUs, or fails
# with the tail of the Ray logs after RAY_WAIT_S (300 s).
: "${GPUS_PER_NODE:=8}" "${RAY_PORT:=6379}" "${RAY_WAIT_S:=300}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
       TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
if [ -n "${NET_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME="$NET_IFNAME" NCCL_SOCKET_IFNAME="$NET_IFNAME"
fi
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY="$(pwd)/.venv/bin/python"; else PY="${PYTHON:-python3}"; fi
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"

_srun() {  # _srun NODE CMD... : one step on one node (inside the container when one is set)
  local node="$1"; shift
  local extra=()
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    extra+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$(pwd)")
    [ -n "${CONTAINER_MOUNTS:-}" ] && extra+=(--container-mounts="$CONTAINER_MOUNTS")
  fi
  srun --overlap --nodes=1 --ntasks=1 -w "$node" "${extra[@]}" "$@"
}

ray_cluster_up() {
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  HEAD_NODE="${NODES[0]}"
  HEAD_IP="${MASTER_IP:-$(_srun "$HEAD_NODE" hostname --ip-address | awk '{print $1}')}"
  export RAY_ADDRESS="$HEAD_IP:$RAY_PORT" HEAD_NODE HEAD_IP
  echo "[ray] head $HEAD_NODE ($RAY_ADDRESS), ${#NODES[@]} node(s) x $GPUS_PER_NODE GPU(s)"
  _srun "$HEAD_NODE" "$PY" -m ray.scripts.scripts start --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT" \
        --num-gpus="$GPUS_PER_NODE" --disable-usage-stats --block &
  sleep 10
  for node in "${NODES[@]:1}"; do
    _srun "$node" "$PY" -m ray.scripts.scripts start --address="$RAY_ADDRESS" --num-gpus="$GPUS_PER_NODE" \
          --disable-usage-stats --block &
  done
  local want=$(( ${#NODES[@]} * GPUS_PER_NODE )) deadline=$(( SECONDS + RAY_WAIT_S ))
  until [ "$(_srun "$HEAD_NODE" "$PY" -c "import ray; ray.init(address='$RAY_ADDRESS', logging_level='ERROR'); print(int(ray.cluster_resources().get('GPU', 0)))" 2>/dev/null | tail -1)" = "$want" ]; do
    if [ $SECONDS -gt $deadline ]; then
      echo "[ray] error: the cluster did not reach $want GPUs within ${RAY_WAIT_S}s" >&2
      _srun "$HEAD_NODE" bash -c 'tail -n 50 /tmp/ray/session_latest/logs/raylet.err 2>/dev/null' >&2 || true
      return 1
    fi
    sleep 5
  done
  echo "[ray] cluster up: $want GPUs"
}

run_on_head() {
  _srun "$HEAD_NODE" "$@"
}

ray_cluster_down() {
  for node in "${NODES[@]}"; do
    _srun "$node" "$PY" -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
  done
}
