"""One GEMM for the sibling projections that read the same input (q/k/v, gate/up, a Gated DeltaNet layer's
in_proj_qkv/z/b/a), on the embedded engine's model, with the HF parameters left where they are.

Why: at one request a decode step is bound by reading the weights, and a small GEMM reads them at a fraction of the
bandwidth (an 8B layer's k_proj and v_proj are 8 MB each, a GDN layer's in_proj_b and in_proj_a 256 KB). On an
H100, the whole 8B model's decode GEMMs take 7.7 % less time grouped than one by one, the 9B hybrid's 10.9 %
(`bench/fused_projections.py`), and each step launches ~100 fewer kernels.

How, without changing what the rest of the engine sees:

* each group owns one fused weight (and bias); every member's ``nn.Parameter`` stays the same object under the
  same HF name, its ``.data`` now a row slice of the fused tensor. Weight updates (``param.data.copy_``) therefore
  land in the fused tensor, and ``named_parameters``/``state_dict`` are unchanged;
* an MLP whose forward is the gated ``down(act(gate(x)) * up(x))`` gets a forward that runs gate and up as one
  GEMM (checked on a probe input against the class's own forward before it is used; any other MLP is left alone);
* attention and GDN blocks keep transformers' forward: their member projections answer from one fused GEMM per
  input tensor (the first member called computes it; the others return their column slice of it while the input
  is the same tensor at the same version). A member called with another input computes its own slice alone.

Releasing the engine's weights moves each parameter to the host on its own; `drop_storage` then frees the fused
tensors and `fuse` rebuilds them after the weights come back. Library vs ours: the GEMMs are cuBLAS's through
``F.linear``; the grouping is ours.
"""
from __future__ import annotations

import logging
import threading
import types

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: sibling ``nn.Linear`` names that transformers' blocks apply to one input, in the fused weight's row order
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                     ("gate_proj", "up_proj"))
_GATED_MLP = ("gate_proj", "up_proj")


class _Group:
    """One fused weight (and bias) and the members whose parameters are its row slices."""

    def __init__(self, parent: torch.nn.Module, names: tuple[str, ...]):
        self.parent = parent
        self.names = names
        self.members = [getattr(parent, n) for n in names]
        sizes = [m.out_features for m in self.members]
        self.bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._clear()

    def _clear(self) -> None:
        # per thread, so that forwards on several threads never answer each other's inputs (the engine runs its
        # forwards on one thread under its model lock; other callers of the model may not)
        self._cache = threading.local()

    def _cached(self, x: torch.Tensor) -> torch.Tensor | None:
        c = self._cache
        if getattr(c, "x", None) is x and c.version == _version(x):   # `x` is kept alive by the cache, so `is`
            return c.out                                              # cannot match a new tensor at its address
        return None

    def fuse(self) -> None:
        """Copy the members' current values into one fused tensor and make their parameters slices of it."""
        with torch.no_grad():
            self.weight = torch.cat([m.weight.data for m in self.members])
            for m, (a, b) in zip(self.members, self.bounds):
                m.weight.data = self.weight[a:b]
            if self.members[0].bias is not None:
                self.bias = torch.cat([m.bias.data for m in self.members])
                for m, (a, b) in zip(self.members, self.bounds):
                    m.bias.data = self.bias[a:b]
        self._clear()

    def drop_storage(self) -> None:
        self.weight = self.bias = None
        self._clear()

    @torch.compiler.disable   # data pointers are not traceable: a compiled grouped MLP runs this check eagerly
    def fused(self) -> bool:
        """Whether the members' parameters are still the fused tensor's slices. Anything that gave them new storage
        (release before `drop_storage`, a ``model.to``) leaves the fused tensor stale: the members then compute
        alone, from their own parameters."""
        if self.weight is None:
            return False
        element = self.weight.element_size()
        if all(m.weight.data_ptr() == self.weight.data_ptr() + a * self.weight.stride(0) * element
               for m, (a, _) in zip(self.members, self.bounds)):
            return True
        log.warning("the parameters of %s's %s no longer share the fused weight; computing them one by one",
                    type(self.parent).__name__, "/".join(self.names))
        self.drop_storage()
        return False

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """Member `member`'s projection of `x`: its slice of the fused GEMM of `x`, computed once per input."""
        if not self.fused():   # between drop_storage and fuse, or the parameters were given new storage
            m = self.members[member]
            return F.linear(x, m.weight, m.bias)
        c = self._cache
        fused = self._cached(x)
        if fused is None:
            fused = F.linear(x, self.weight, self.bias)
            c.x, c.version, c.out, c.pending = x, _version(x), fused, set(range(len(self.members)))
        a, b = self.bounds[member]
        c.pending.discard(member)
        if not c.pending:
            c.x = c.out = None   # every member answered: nothing held between forwards
        return fused[..., a:b]


def _version(x: torch.Tensor) -> int:
    # inference-mode tensors keep no version counter: the identity of the tensor alone then keys the cache
    return -2 if x.is_inference() else x._version


def _member_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    group, index = self._megatron_rl_group
    return group.output(index, x)


def _grouped_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    group: _Group = self._megatron_rl_gate_up
    if not group.fused():
        gate, up = self.gate_proj(x), self.up_proj(x)
    else:
        gate, up = F.linear(x, group.weight, group.bias).split(
            [group.members[0].out_features, group.members[1].out_features], dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _groupable(parent: torch.nn.Module, names: tuple[str, ...]) -> bool:
    members = [getattr(parent, n, None) for n in names]
    if not all(type(m) is torch.nn.Linear and "forward" not in m.__dict__ for m in members):
        return False   # missing, a subclass (quantized, LoRA) or someone else's forward on it: left alone
    w0 = members[0].weight
    return all(m.in_features == members[0].in_features and m.weight.dtype == w0.dtype and
               m.weight.device == w0.device and (m.bias is None) == (members[0].bias is None) for m in members)


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    """Whether `module`'s own forward is ``down(act(gate(x)) * up(x))``, checked on a probe input (any other
    composition of the same projections gives different numbers)."""
    if not (callable(getattr(module, "act_fn", None)) and type(getattr(module, "down_proj", None)) is torch.nn.Linear
            and "forward" not in module.__dict__):
        return False
    w = module.gate_proj.weight
    generator = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(2, module.gate_proj.in_features, generator=generator, device=w.device, dtype=torch.float32)
    x = x.to(w.dtype)
    with torch.no_grad():
        expected = module(x)
        gate, up = module.gate_proj(x), module.up_proj(x)
        got = module.down_proj(module.act_fn(gate) * up)
    return expected.shape == got.shape and torch.equal(expected, got)


class ProjectionGroups:
    """Every groupable projection set of `model`, fused. `undo` gives the model its separate weights back."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.groups: list[_Group] = []
        self._mlps: list[torch.nn.Module] = []
        for parent in model.modules():
            for names in PROJECTION_GROUPS:
                if not _groupable(parent, names):
                    continue
                if names == _GATED_MLP and not _is_gated_mlp(parent):
                    continue
                group = _Group(parent, names)
                if names == _GATED_MLP:
                    parent._megatron_rl_gate_up = group
                    parent._megatron_rl_base_forward = _grouped_mlp_forward   # compile_blocks compiles this one
                    parent.forward = types.MethodType(_grouped_mlp_forward, parent)
                    self._mlps.append(parent)
                else:
                    for i, m in enumerate(group.members):
                        m._megatron_rl_group = (group, i)
                        m.forward = types.MethodType(_member_forward, m)
                self.groups.append(group)
        self.fuse()

    def __len__(self) -> int:
        return len(self.groups)

    def fuse(self) -> None:
        for g in self.groups:
            g.fuse()
        if any(g.weight is not None and g.weight.is_cuda for g in self.groups):
            # the separate tensors just freed stay in the caching allocator otherwise, and the engine sizes its
            # K/V slots from the memory the driver reports free (2.3 GB of 12 8B-shaped layers)
            torch.cuda.empty_cache()

    def drop_storage(self) -> None:
        """Forget the fused tensors: call after every parameter got its own storage (moved to the host)."""
        for g in self.groups:
            g.drop_storage()

    def invalidate(self) -> None:
        """Drop any cached output (after a weight update)."""
        for g in self.groups:
            g._clear()

    def undo(self) -> None:
        """Separate weights and the classes' own forwards again."""
        with torch.no_grad():
            for g in self.groups:
                for m in g.members:
                    m.weight.data = m.weight.data.clone()
                    if m.bias is not None:
                        m.bias.data = m.bias.data.clone()
                    for attr in ("_megatron_rl_group", "forward"):
                        m.__dict__.pop(attr, None)
                g.drop_storage()
        for mlp in self._mlps:
            for attr in ("_megatron_rl_gate_up", "_megatron_rl_base_forward", "forward", "_megatron_rl_compiled"):
                mlp.__dict__.pop(attr, None)
        self.groups, self._mlps = [], []
        self.model.__dict__.pop("_megatron_rl_projection_groups", None)


def grouped(model: torch.nn.Module) -> ProjectionGroups | None:
    """The handle of `model`'s fused projections, or None when it has none (never grouped, or undone)."""
    handle = model.__dict__.get("_megatron_rl_projection_groups")
    return handle if handle else None


def group_projections(model: torch.nn.Module) -> ProjectionGroups:
    """Fuse `model`'s sibling projections (see the module docstring); returns the handle that undoes it. A model
    already grouped returns its handle: engines sharing one model share it, so any of them releases and rebuilds
    the same fused tensors."""
    handle = grouped(model)
    if handle is None:
        handle = ProjectionGroups(model)
        model._megatron_rl_projection_groups = handle
    return handle

