"""Qwen3.5 hybrid on a GPU: megatron's GatedDeltaNet on fla's kernels against HF's torch path, and a bf16
training step through the distributed optimizer with the GDN decay parameters in fp32, across an
offload/restore cycle (their fp32 main params are views into the DDP buffer), then a checkpoint save and load of
that optimizer on CUDA (its groups mix dtypes: `megatron_rl.actor.optim.align_mixed_dtype_group_order`)."""
import pytest
import torch

from megatron_rl.parallel import spawn
from tests.ckpt_tools.test_checkpoint_format import _installed_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_hybrid_parity_on_fla_kernels(tmp_path):
    from tests.models.test_qwen3_5_parity import _run_cases

    spawn(_run_cases, 1, [(1, 1, "text", True), (1, 1, "multimodal", True)], str(tmp_path))


def _train_bf16(root: str):
    from megatron_rl.actor import ActorConfig, MegatronActor, SFTLoss
    from megatron_rl.parallel import init_parallel
    from megatron_rl.types import TrainSample
    from tests.bridge.tiny_qwen3_5 import hf_tensors, tiny_config, tiny_model

    init_parallel(1, 1)
    cfg = tiny_config(layers=4, vocab=250)
    actor_cfg = ActorConfig(params_dtype="bfloat16", lr=1e-2, lr_warmup_steps=0)
    actor = MegatronActor(actor_cfg, cfg)
    actor.load_hf(hf_tensors(tiny_model(cfg, seed=3)))
    a_log = [p for n, p in actor.model[0].named_parameters() if n.endswith("A_log")][0]
    assert a_log.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randint(0, 250, (40,), generator=g).tolist(), [0] + [1] * 39) for _ in range(4)]
    before = a_log.detach().clone()
    m1 = actor.train_step(samples, SFTLoss())
    after_first = a_log.detach().clone()
    assert not m1["skipped"] and not torch.equal(before, after_first)
    actor.state_offload()
    actor.state_onload()
    m2 = actor.train_step(samples, SFTLoss())
    assert not m2["skipped"] and not torch.equal(after_first, a_log.detach())  # the view still reaches the model
    assert m2["loss"] < m1["loss"]

    # every param's fp32 main copy and Adam moments come back to that param (0.19.2 swapped them between the
    # fp32 GDN decay params and the bf16 norms of a group: a crash on shape, or silently another param's state)
    actor.save(root, 2)
    fresh = MegatronActor(actor_cfg, cfg)
    fresh.load(root, 2)
    want, got = _installed_state(actor.model, actor.optimizer), _installed_state(fresh.model, fresh.optimizer)
    assert sorted(got) == sorted(want) and any(n.endswith("A_log") for n in want)
    for name, tensors in want.items():
        for a, b in zip(tensors, got[name]):
            assert torch.equal(a, b), name
    m3, m3_fresh = actor.train_step(samples, SFTLoss()), fresh.train_step(samples, SFTLoss())
    assert abs(m3["loss"] - m3_fresh["loss"]) <= 1e-6 * abs(m3["loss"]), (m3["loss"], m3_fresh["loss"])


def test_bf16_step_keeps_gdn_decay_fp32_across_offload_and_a_checkpoint(tmp_path):
    spawn(_train_bf16, 1, str(tmp_path))


def test_fla_gated_delta_rule_matches_torch_reference_forward_and_backward():
    """fla's chunked kernel (what megatron's GatedDeltaNet calls on a GPU) against the torch reference that
    transformers uses, on Qwen3.5's head sizes with packed sequences: outputs and every gradient. This is the
    guard for the Hopper/Triton miscompilation fla's issue #640 reports for BK=64 tiles."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from megatron_rl.parallel.cpu_compat import gdn_chunk_gated_delta_rule

    torch.manual_seed(0)
    dev, heads, dk, dv = "cuda", 2, 128, 128
    lens = [200, 64, 1, 129]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev, dtype=torch.long)
    t = sum(lens)
    leaves = dict(
        q=torch.nn.functional.normalize(torch.randn(1, t, heads, dk, device=dev), dim=-1),
        k=torch.nn.functional.normalize(torch.randn(1, t, heads, dk, device=dev), dim=-1),
        v=torch.randn(1, t, heads, dv, device=dev),
        g=-torch.rand(1, t, heads, device=dev) * 0.5 - 0.01,
        beta=torch.rand(1, t, heads, device=dev))
    grad_out = torch.randn(1, t, heads, dv, device=dev)
    results = {}
    for name, fn in (("fla", chunk_gated_delta_rule), ("torch", gdn_chunk_gated_delta_rule)):
        # megatron feeds q, k, v and beta in the params dtype (bf16) and g in fp32; the reference computes in fp32
        low = ("q", "k", "v", "beta") if name == "fla" else ()
        x = {k: v.detach().to(torch.bfloat16 if k in low else torch.float32).requires_grad_()
             for k, v in leaves.items()}
        out, _ = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], cu_seqlens=cu)
        (out.float() * grad_out).sum().backward()
        results[name] = (out.float(), {k: x[k].grad.float() for k in x})
    (o_fla, g_fla), (o_ref, g_ref) = results["fla"], results["torch"]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(o_fla, o_ref) < 2e-2, rel(o_fla, o_ref)
    for k in g_ref:
        assert rel(g_fla[k], g_ref[k]) < 5e-2, (k, rel(g_fla[k], g_ref[k]))
