"""One Ray placement group for the whole job, its bundles sorted by (node IP, GPU id).

Sorting makes rank i land on a predictable GPU: consecutive ranks share a node (TP stays inside a
node) and, within a node, follow the GPU order. Colocated runs put the train rank and the rollout
engine of bundle i on the same GPU; disaggregated runs use the first bundles for training and the
rest for rollout. On a CPU-only machine bundles hold a small CPU share so the same code path runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Placement:
    pg: Any                       # ray.util.placement_group.PlacementGroup
    order: list[int]              # bundle index of logical slot i (sorted by node IP, GPU id)
    node_ips: list[str]           # per logical slot
    gpu_ids: list[int]            # per logical slot (-1 on CPU)

    def __len__(self) -> int:
        return len(self.order)


def _probe():
    import os

    import ray

    gpus = ray.get_gpu_ids()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    gpu = int(gpus[0]) if gpus else (int(visible.split(",")[0]) if visible else -1)
    return ray.util.get_node_ip_address(), gpu


def create_placement(num_slots: int, use_gpu: bool, timeout_s: float = 600.0) -> Placement:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 0.01}
    pg = placement_group([dict(bundle) for _ in range(num_slots)], strategy="PACK")
    if not pg.wait(timeout_seconds=timeout_s):
        raise RuntimeError(f"could not reserve {num_slots} bundles of {bundle} within {timeout_s:.0f}s; "
                           f"cluster resources: {ray.cluster_resources()}")
    probe = ray.remote(_probe)
    infos = ray.get([
        probe.options(num_cpus=0.001 if not use_gpu else 0, num_gpus=0.01 if use_gpu else 0,
                      scheduling_strategy=PlacementGroupSchedulingStrategy(
                          placement_group=pg, placement_group_bundle_index=i)).remote()
        for i in range(num_slots)])
    order = sorted(range(num_slots), key=lambda i: (_ip_key(infos[i][0]), infos[i][1]))
    return Placement(pg=pg, order=order, node_ips=[infos[i][0] for i in order],
                     gpu_ids=[infos[i][1] for i in order])


def _ip_key(ip: str):
    try:
        return tuple(int(x) for x in ip.split("."))
    except ValueError:
        return (ip,)


def bundle_options(placement: Placement | None, slot: int, use_gpu: bool, num_gpus: float) -> dict:
    """Ray actor options pinning an actor into logical slot `slot` of the placement group."""
    if placement is None:
        return {"num_cpus": 0, "num_gpus": num_gpus if use_gpu else 0}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": 0.001 if not use_gpu else 0,
        "num_gpus": num_gpus if use_gpu else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement.pg, placement_group_bundle_index=placement.order[slot]),
    }
