"""Call a role the same way with and without Ray: ``handle.method.remote(...)``, then `resolve`.

With Ray a role is an actor handle and ``.remote`` returns an object reference. Without Ray
(``cluster.backend=local``) `local_handle` wraps the in-process object so that ``.remote`` runs the
method at once and returns its result wrapped; `resolve` unwraps either. The driver and the train
group therefore call every role through its named methods, with one code path.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any


@dataclasses.dataclass
class _Done:
    value: Any


class _LocalMethod:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs) -> _Done:
        return _Done(self._fn(*args, **kwargs))


class LocalHandle:
    """An in-process object behind the actor-handle calling convention."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._obj, name))


def local_handle(obj) -> LocalHandle:
    return LocalHandle(obj)


def _is_ref(x) -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(x, ray.ObjectRef)


def resolve(x):
    """The value of a ``.remote`` result (or a list of them): `ray.get` for references."""
    if isinstance(x, list):
        if x and all(_is_ref(v) for v in x):
            import ray

            return ray.get(x)
        return [resolve(v) for v in x]
    if isinstance(x, _Done):
        return x.value
    if _is_ref(x):
        import ray

        return ray.get(x)
    return x


def call_all(calls: list) -> Any:
    """One call per rank of a collective: wait for all of them, return rank 0's answer."""
    return resolve(calls)[0]
