"""The verifier farm on Ray: compile actors (``num_cpus``) and one device actor per GPU (``num_gpus=1``).

``RayVerifierFarm`` is ``VerifierFarm`` with its worker slots swapped for Ray actors, so retries,
the result cache, backpressure and the exactly-one-verdict guarantee are the same code. The driver
keeps the queues; actors only run ``build_fn`` / ``run_fn``. A dead actor (``RayActorError``) or one
that misses its deadline is killed and replaced, and its item re-queued as ``infra``.

Ray is imported lazily: importing this module, or using the in-process farm, never needs Ray.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from .farm import FarmConfig, VerifierFarm
from .farm_workers import SlotCrashed, SlotError, SlotWedged

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class RayFarmOptions:
    compile_num_cpus: float = 1.0     # CPUs reserved per compile actor (one build at a time each)
    device_num_cpus: float = 1.0      # CPUs reserved per device actor
    num_gpus: int | None = None       # device actors on GPU backends; None: every GPU in the cluster
    init_if_needed: bool = True       # ray.init() a local cluster when none is connected


class _SlotActorImpl:
    """Runs one stage function. On GPU it owns exactly one device (Ray's ``num_gpus=1``)."""

    def __init__(self, fn: Callable[..., Any], backend: str, is_device: bool):
        self.fn = fn
        self.device_index: int | None = None
        if is_device and backend in ("cuda", "musa"):
            self.device_index = _claim_ray_device(backend)

    def call(self, *args: Any) -> Any:
        if self.device_index is not None:
            args = (*args[:-1], self.device_index)  # the device stage's last argument is the index
        return self.fn(*args)

    def pid(self) -> int:
        return os.getpid()


def _claim_ray_device(backend: str) -> int:
    """The device index to hand the verifier core inside a GPU actor: always 0.

    Ray pins the actor by setting ``CUDA_VISIBLE_DEVICES`` to its one GPU. The core maps a logical
    index through the parent's mask (``DeviceBackend.physical_id``) when it pins its sandboxed
    children, so index 0 is that GPU for both the actor and its children. torch_musa reads
    ``MUSA_VISIBLE_DEVICES``, so the same mask is mirrored there on MUSA nodes.
    """
    import ray
    ids = ray.get_gpu_ids()
    if len(ids) != 1:
        raise RuntimeError(f"device actor expected exactly one GPU from Ray, got {ids}")
    if backend == "musa" and "MUSA_VISIBLE_DEVICES" not in os.environ:
        os.environ["MUSA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", str(ids[0]))
    return 0


class RayActorSlot:
    """A worker slot backed by one Ray actor; replaced on death, hang, or after ``recycle_after`` calls."""

    kind = "ray"

    def __init__(self, fn: Callable[..., Any], name: str, options: dict[str, Any], backend: str,
                 is_device: bool, recycle_after: int = 0):
        self.fn = fn
        self.name = name
        self.options = options
        self.backend = backend
        self.is_device = is_device
        self.recycle_after = recycle_after
        self.calls = 0
        self.starts = 0
        self._actor: Any = None

    def _ensure(self) -> Any:
        import ray
        if self._actor is not None and self.recycle_after and self.calls >= self.recycle_after:
            self.restart()
        if self._actor is None:
            cls = ray.remote(_SlotActorImpl)
            self._actor = cls.options(max_restarts=0, **self.options).remote(self.fn, self.backend, self.is_device)
            self.calls = 0
            self.starts += 1
        return self._actor

    def call(self, args: tuple, deadline_s: float | None) -> Any:
        import ray
        actor = self._ensure()
        self.calls += 1
        ref = actor.call.remote(*args)
        ready, _ = ray.wait([ref], timeout=deadline_s)
        if not ready:
            self.restart()
            raise SlotWedged(f"{self.name}: no answer within {deadline_s:.0f}s; actor killed")
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise SlotError(f"{self.name}: {type(cause).__name__}: {cause}") from e
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._actor = None
            raise SlotCrashed(f"{self.name}: actor died mid-call ({type(e).__name__})") from e

    def pid(self) -> int:
        import ray
        return ray.get(self._ensure().pid.remote())

    def restart(self) -> None:
        import ray
        if self._actor is not None:
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._actor = None

    def close(self) -> None:
        self.restart()


class RayVerifierFarm(VerifierFarm):
    """``VerifierFarm`` whose compile and device workers are Ray actors (same submit/verify surface)."""

    def __init__(self, cfg: Any, farm: FarmConfig | None = None, ray_options: RayFarmOptions | None = None):
        import ray
        self.ray_options = ray_options or RayFarmOptions()
        if not ray.is_initialized():
            if not self.ray_options.init_if_needed:
                raise RuntimeError("Ray is not initialized; call ray.init() first")
            ray.init(runtime_env={"env_vars": {"PYTHONPATH": _pythonpath_with_repo()}})
        farm = dataclasses.replace(farm) if farm is not None else FarmConfig()
        if farm.compile_workers is None:
            cpus = int(ray.cluster_resources().get("CPU", 1))
            farm.compile_workers = max(1, int((cpus - self._n_device_actors(cfg, farm)) //
                                              max(self.ray_options.compile_num_cpus, 1e-3)))
        super().__init__(cfg, farm)

    def _n_device_actors(self, cfg: Any, farm: FarmConfig) -> int:
        import ray
        if getattr(cfg, "backend", "cpu") == "cpu":
            return farm.device_workers or farm.cpu_device_workers
        if farm.device_workers is not None:
            return farm.device_workers
        n = self.ray_options.num_gpus
        if n is None:
            n = int(ray.cluster_resources().get("GPU", 0))
        return n * farm.workers_per_device

    def _gpu_share(self) -> float:
        """GPUs per device actor: ``workers_per_device`` actors share a GPU (and its device lock)."""
        return 1.0 if self.farm.device_workers is not None else 1.0 / self.farm.workers_per_device

    def _device_groups(self) -> list:
        if self.backend == "cpu":
            return super()._device_groups()
        # Ray places the actors; slots are counted per GPU for the occupancy figure, in order
        per = max(1, round(1 / self._gpu_share()))
        return [i // per for i in range(len(self._device_indices))]

    def _resolve_devices(self) -> list[int | None]:
        n = self._n_device_actors(self.cfg, self.farm)
        if n < 1:
            raise RuntimeError(f"backend {self.backend!r}: the Ray cluster has no GPUs for device actors")
        return [None] * n  # each GPU actor learns its physical index from Ray

    def _detect_device_type(self) -> str:
        if self.backend == "cpu":
            return super()._detect_device_type()
        import ray
        kinds = sorted(k.split(":", 1)[1] for k in ray.cluster_resources() if k.startswith("accelerator_type:"))
        return f"{self.backend}:{kinds[0]}" if len(kinds) == 1 else self.backend

    def _make_compile_slot(self, i: int) -> RayActorSlot:
        return RayActorSlot(self._build_fn, f"ray-compile-{i}", {"num_cpus": self.ray_options.compile_num_cpus},
                            self.backend, is_device=False, recycle_after=self.farm.recycle_after)

    def _make_device_slot(self, i: int, device_index: int | None) -> RayActorSlot:
        opts: dict[str, Any] = {"num_cpus": self.ray_options.device_num_cpus}
        if self.backend in ("cuda", "musa"):
            opts["num_gpus"] = self._gpu_share()
        return RayActorSlot(self._run_fn, f"ray-device-{i}", opts, self.backend, is_device=True,
                            recycle_after=self.farm.recycle_after)


def _pythonpath_with_repo() -> str:
    parts = [_REPO_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))
