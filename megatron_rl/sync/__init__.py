"""Weight sync from the Megatron actor to the rollout engines.

- `buckets`: per-dtype flattened buckets (one 1-D buffer per dtype + tensor metadata), exact round trip
- `transport`: wire formats (CUDA IPC, /dev/shm, flattened broadcasts), the stateless weight-update
  process group, and the trainer-side senders (colocated, distributed)
- `weight_sync`: the orchestration (export -> buckets -> engines; pause/flush/continue; atomic
  versions; recovery) and its timing report
"""
from .buckets import DEFAULT_BUCKET_BYTES, FlatBucket, TensorMeta, bucketize, flatten
from .transport import ColocatedSender, DistributedSender, WeightGroupSpec, WeightUpdateGroup

__all__ = [
    "DEFAULT_BUCKET_BYTES", "ColocatedSender", "DistributedSender", "FlatBucket", "TensorMeta", "WeightGroupSpec",
    "WeightUpdateGroup", "bucketize", "flatten",
]
