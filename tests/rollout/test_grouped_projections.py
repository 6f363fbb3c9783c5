"""grouped_projections.py: sibling projections answer from one fused GEMM while the model's HF parameters stay the
same objects (as slices of the fused weight), so the engine's tokens, weight updates and memory release are
unchanged; MLPs that are not the gated kind and projections someone else wrapped are left alone."""
import pytest
import torch
import torch.nn.functional as F

from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.grouped_projections import PROJECTION_GROUPS, group_projections
from megatron_rl.rollout.slot_decode import compile_blocks, uncompile_blocks
from rollout_helpers import TINY
from test_rollout_hybrid import HYBRID
from test_slot_decode import JOBS, _generate, _model

INPUTS = [(3, 9), (1, 1), (4, 1), (2, 7)]


def _logits(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return [model(torch.randint(1, 200, shape)).logits for shape in INPUTS]


def _members(model):
    return [getattr(parent, n) for parent in model.modules() for names in PROJECTION_GROUPS
            if all(hasattr(parent, n) for n in names) for n in names]


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_grouped_projections_keep_the_parameters_and_the_logits(cfg):
    model = _model(cfg)
    before = _logits(model)
    params = dict(model.named_parameters())
    groups = group_projections(model)
    layers = cfg["num_hidden_layers"]
    assert len(groups) == 2 * layers   # q/k/v (or a GDN layer's in_proj_*) and gate/up, in every layer
    # same names, same Parameter objects; each member's storage is the fused tensor's
    assert dict(model.named_parameters()) == params
    for group in groups.groups:
        for m, (a, b) in zip(group.members, group.bounds):
            assert m.weight.data_ptr() == group.weight[a:b].data_ptr()
    for x, y in zip(before, _logits(model)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    groups.undo()
    ptrs = [m.weight.data_ptr() for m in _members(model)]
    assert len(set(ptrs)) == len(ptrs) and not any("forward" in m.__dict__ for m in model.modules())
    for x, y in zip(before, _logits(model)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_a_weight_written_into_a_member_parameter_is_what_the_fused_gemm_reads(cfg):
    """The engine's weight updates copy into each HF parameter: the grouped model must compute with the new values,
    exactly as an ungrouped model that got the same update."""
    grouped, plain = _model(cfg), _model(cfg)
    groups = group_projections(grouped)
    _logits(grouped)   # a forward before the update, so that nothing computed earlier may answer after it
    torch.manual_seed(5)
    update = {name: torch.randn_like(p) * 0.3 for name, p in plain.named_parameters()
              if name.endswith(("k_proj.weight", "up_proj.weight", "in_proj_b.weight"))}
    assert update
    with torch.no_grad():
        for model in (grouped, plain):
            named = dict(model.named_parameters())
            for name, t in update.items():
                named[name].data.copy_(t)
    groups.invalidate()
    for x, y in zip(_logits(plain), _logits(grouped)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


def test_a_member_answers_a_changed_or_different_input_with_its_own_projection():
    model = _model(TINY)
    attn = model.model.layers[0].self_attn
    group_projections(model)
    x = torch.randn(2, 5, TINY["hidden_size"])
    q = attn.q_proj(x)
    x.add_(1.0)   # the same tensor, changed in place: k must not come from the GEMM of the old values
    torch.testing.assert_close(attn.k_proj(x), F.linear(x, attn.k_proj.weight), rtol=0, atol=1e-6)
    other = torch.randn(2, 5, TINY["hidden_size"])
    torch.testing.assert_close(attn.v_proj(other), F.linear(other, attn.v_proj.weight), rtol=0, atol=1e-6)
    torch.testing.assert_close(q, F.linear(x - 1.0, attn.q_proj.weight), rtol=0, atol=1e-5)


def test_only_gated_mlps_and_plain_unwrapped_linears_are_grouped():
    """An MLP computing something else from gate/up/down keeps its forward; a projection with a forward on its
    instance (an adapter's hook) keeps its group separate."""
    class OtherMLP(torch.nn.Module):   # act on up, not on gate: the gated fusion would change its numbers
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(8, 16, bias=False)
            self.down_proj, self.act_fn = torch.nn.Linear(16, 8, bias=False), torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))

    mlp = OtherMLP()
    assert len(group_projections(mlp)) == 0 and "forward" not in mlp.__dict__

    model = _model(TINY)
    hooked = model.model.layers[0].self_attn.k_proj
    own = hooked.forward = lambda x: F.linear(x, hooked.weight)
    groups = group_projections(model)
    assert len(groups) == 2 * TINY["num_hidden_layers"] - 1 and hooked.forward is own


def test_release_and_resume_rebuild_the_fused_weights(caplog):
    """Releasing weights gives every parameter its own (host) storage and frees the fused tensors; the model still
    computes the same logits then, and again after `fuse` rebuilt the groups from the parameters. Parameters given
    new storage behind the groups' back (a ``model.to``) are noticed: the members compute alone, with a warning."""
    model = _model(HYBRID)
    before = _logits(model)
    groups = group_projections(model)
    assert group_projections(model) is groups   # a second engine on the model shares the handle
    originals = {name: p.data.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():   # as release_memory on a GPU or a model.to: each parameter copied on its own
            p.data = p.data.clone() * 1.5
    scaled = _model(HYBRID)
    with torch.no_grad():
        for p in scaled.parameters():
            p.mul_(1.5)
    with caplog.at_level("WARNING", logger="megatron_rl.rollout.grouped_projections"):
        for x, y in zip(_logits(scaled), _logits(model)):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert "no longer share the fused weight" in caplog.text
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = originals[name].clone()
    groups.drop_storage()
    assert all(g.weight is None for g in groups.groups)
    for x, y in zip(before, _logits(model)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    groups.fuse()
    for group in groups.groups:
        assert group.members[-1].weight.data_ptr() == group.weight[group.bounds[-1][0]:].data_ptr()
    for x, y in zip(before, _logits(model)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_the_engine_with_grouped_projections_gives_the_same_tokens(cfg):
    model = _model(cfg)
    kw = dict(max_batch_size=3, gather_ms=0, decode="slots")
    plain = _generate(EmbeddedEngine(model, EmbeddedEngineConfig(group_projections=False, **kw)), JOBS, 0.01)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(group_projections=True, **kw))
    assert engine.decode_info()["grouped_projections"] == 2 * cfg["num_hidden_layers"]
    grouped = _generate(engine, JOBS, 0.01)
    for a, b in zip(plain, grouped):
        assert a["output_ids"] == b["output_ids"]
        lp_a, lp_b = ([x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in (a, b))
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_compile_blocks_compiles_grouped_mlps_and_rope_once_for_every_layer(cfg):
    """With projections grouped, compile_blocks compiles the grouped MLP forward and RoPE's function in
    transformers' module once for all layers (the same frame count for 4 and 8 layers), and uncompile_blocks
    restores both."""
    from torch._dynamo.testing import CompileCounter

    import sys
    frames = {}
    for layers in (4, 8):
        torch._dynamo.reset()
        model = _model(cfg, num_hidden_layers=layers)
        before = _logits(model)
        groups = group_projections(model)
        rope_module = sys.modules[type(model.model.layers[-1].mlp).__module__]
        original = rope_module.apply_rotary_pos_emb
        counter = CompileCounter()
        blocks = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
        assert compile_blocks(model, backend=counter) == len(blocks) + 1   # the blocks and apply_rotary_pos_emb
        assert rope_module.apply_rotary_pos_emb is not original
        for x, y in zip(before, _logits(model)):   # a GEMM over more rows rounds its fp32 sums differently
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
        frames[layers] = counter.frame_count
        _logits(model, seed=1)   # the same shapes again, other values: nothing new to compile, in any layer
        assert counter.frame_count == frames[layers]
        uncompile_blocks(model)
        assert rope_module.apply_rotary_pos_emb is original
        mlp = model.model.layers[0].mlp
        assert mlp.forward.__func__.__name__ == "_grouped_mlp_forward"
        groups.undo()
        assert not any("forward" in m.__dict__ for m in model.modules())
    assert 0 < frames[4] == frames[8] <= 24, frames


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_a_grouped_forward_runs_one_gemm_per_group_and_none_per_member(cfg, monkeypatch):
    """The point of grouping: each layer's k/v (or in_proj_z/b/a) and gate/up weights are read by one GEMM over
    the fused weight, never by one of their own."""
    model = _model(cfg)
    groups = group_projections(model)
    shapes = []
    linear = F.linear

    def counting(x, weight, bias=None):
        shapes.append(tuple(weight.shape))
        return linear(x, weight, bias)
    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    with torch.no_grad():
        model(torch.randint(1, 200, (2, 5)))
    fused = [tuple(g.weight.shape) for g in groups.groups]
    members = {tuple(m.weight.shape) for g in groups.groups for m in g.members[1:]} - set(fused) - {
        tuple(m.weight.shape) for name, m in model.named_modules() if name.endswith(("o_proj", "out_proj", "down_proj"))}
    assert sorted(s for s in shapes if s in set(fused)) == sorted(fused)   # every group once, in one forward
    assert members and not [s for s in shapes if s in members]


def test_engines_sharing_a_model_share_its_groups_and_rebuild_them_after_moving_weights():
    """An engine that did not ask for grouping, on a model another engine grouped, still frees and rebuilds the
    fused tensors when it moves the weights (its release and resume on a GPU)."""
    model = _model(TINY)
    first = EmbeddedEngine(model, EmbeddedEngineConfig(decode="slots", group_projections=True))
    second = EmbeddedEngine(model, EmbeddedEngineConfig(decode="slots", group_projections=False))
    assert second.projection_groups is first.projection_groups and len(second.projection_groups) > 0
    before = _logits(model)
    old = [g.weight for g in first.projection_groups.groups]
    second._move_weights(torch.device("cpu"))   # every parameter copied on its own, then the groups rebuilt
    for g, previous in zip(first.projection_groups.groups, old):
        assert g.weight.data_ptr() != previous.data_ptr() and g.fused()
    for x, y in zip(before, _logits(model)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    first.projection_groups.undo()
    third = EmbeddedEngine(model, EmbeddedEngineConfig(decode="slots", group_projections=False))
    assert third.projection_groups is None and not any("forward" in m.__dict__ for m in model.modules())


def test_threads_projecting_different_inputs_never_get_each_others_outputs():
    """Two engines may share one model, each forward under its own engine's lock: a group's cached GEMM is per
    thread, so concurrent projections of different inputs stay each thread's own."""
    import sys
    import threading

    model = _model(dict(TINY, hidden_size=256, num_attention_heads=8, head_dim=32))
    attn = model.model.layers[0].self_attn
    group_projections(model)
    wrong, errors = [0] * 4, []

    def worker(index):
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for _ in range(1500):
                x = torch.randn(1, 2, 256, generator=generator)
                try:
                    outs = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
                except Exception as e:   # noqa: BLE001 - any failure is the finding
                    errors.append(repr(e))
                    continue
                wrong[index] += sum(not torch.allclose(y, F.linear(x, m.weight), atol=1e-4)
                                    for m, y in zip((attn.q_proj, attn.k_proj, attn.v_proj), outs))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as possible
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == [0] * 4 and not errors, (wrong, errors[:2])


def test_forcing_grouped_projections_with_a_compiled_step_is_refused():
    with pytest.raises(ValueError, match="group_projections and compile_decode"):
        EmbeddedEngine(_model(TINY), EmbeddedEngineConfig(decode="slots", compile_decode=True, group_projections=True))
