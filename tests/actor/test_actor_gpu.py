"""The actor on a CUDA device: HF parity in fp32 and bf16 (varlen flash attention), offload/onload."""
import pytest

from megatron_rl.parallel import spawn

pytestmark = pytest.mark.gpu


def _gpu_checks():
    import torch

    from megatron_rl.actor import ActorConfig, MegatronActor, SFTLoss
    from megatron_rl.parallel import init_parallel
    from tests.actor import reference as ref

    init_parallel(1, 1)
    samples = ref.make_samples(lengths=(70, 120, 50, 200, 90, 30))
    cfg = ref.tiny_config()
    hf = ref.tiny_model(cfg, seed=2)
    want = [ref.hf_logprobs_entropy(hf, s)[0] for s in samples]

    def build(dtype, backend):
        actor = MegatronActor(ActorConfig(params_dtype=dtype, attention_backend=backend, lr=3e-3,
                                          max_tokens_per_gpu=256, logprob_chunk_size=64), cfg)
        actor.load_hf(ref.hf_state(hf))
        return actor

    # fp32: exact parity (per-sample SDPA path), both attention backends
    for backend in ("sdpa", "local"):
        got = build("float32", backend).compute_logprobs(samples)
        d = max((g.double() - w).abs().max().item() for g, w in zip(got, want))
        assert d < 1e-4, f"fp32 {backend}: logprobs differ from HF by {d}"

    # bf16: varlen flash attention on packed micro-batches, within bf16 noise of HF fp32
    actor = build("bfloat16", "sdpa")
    got = actor.compute_logprobs(samples)
    err = torch.cat([(g.double() - w).abs()[1:] for g, w in zip(got, want)])
    assert err.mean().item() < 0.05 and err.max().item() < 0.5, (err.mean().item(), err.max().item())
    local = build("bfloat16", "local").compute_logprobs(samples)
    d = max((a - b).abs().max().item() for a, b in zip(got, local))
    assert d < 0.5, f"bf16 sdpa vs local attention differ by {d}"

    losses = [actor.train_step(samples, SFTLoss())["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses

    # offload/onload, twice (the second reuses the pinned host buffers): device memory is released and the
    # weights and the optimizer state come back bitwise
    def optimizer_state():
        inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
        return [t.detach().cpu().clone() for opt in inner for st in opt.state.values() for t in st.values()
                if torch.is_tensor(t)]

    before = {n: t.clone() for n, t in actor.export_hf()}
    state_before = optimizer_state()
    assert state_before
    for cycle in range(2):
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated()
        actor.state_offload()
        freed = used - torch.cuda.memory_allocated()
        with pytest.raises(RuntimeError, match="offloaded"):
            actor.compute_logprobs(samples)
        actor.state_onload()
        after = dict(actor.export_hf())
        assert all(torch.equal(before[k], after[k]) for k in before), cycle
        assert all(torch.equal(a, b) for a, b in zip(state_before, optimizer_state())), cycle
        assert freed > 0.5 * sum(t.numel() * t.element_size() for t in before.values()), (cycle, freed)
    assert actor._host_stash.pinned_bytes > 0
    m = actor.train_step(samples, SFTLoss())
    assert not m["skipped"] and m["loss"] < losses[0]


def test_actor_on_gpu():
    spawn(_gpu_checks, 1)


def test_wgrad_fusion_functions_accumulate_in_place():
    import torch

    from megatron_rl.parallel import wgrad_fusion

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 40, 64, device="cuda", generator=g).bfloat16()       # [s, b, in]
    dy = torch.randn(3, 40, 96, device="cuda", generator=g).bfloat16()      # [s, b, out]
    main = torch.randn(96, 64, device="cuda", generator=g)
    want = main + dy.reshape(-1, 96).float().t() @ x.reshape(-1, 64).float()
    ptr = main.data_ptr()
    wgrad_fusion.wgrad_gemm_accum_fp32(x, dy, main)
    assert main.data_ptr() == ptr and main.dtype == torch.float32
    assert (main - want).abs().max().item() < 1e-3
    half = main.bfloat16()
    want16 = (half.float() + dy.reshape(-1, 96).float().t() @ x.reshape(-1, 64).float())
    wgrad_fusion.wgrad_gemm_accum_fp16(x, dy, half)
    assert (half.float() - want16).abs().max().item() < 0.1 * want16.abs().max().item() / 8


def _wgrad_fusion_step():
    import torch

    from megatron_rl.actor import ActorConfig, MegatronActor, SFTLoss
    from megatron_rl.parallel import init_parallel
    from tests.actor import reference as ref

    init_parallel(1, 1)
    samples = ref.make_samples(lengths=(70, 120, 50, 200))
    cfg = ref.tiny_config()
    hf = ref.tiny_model(cfg, seed=2)
    results = {}
    for fused in (False, True):
        actor = MegatronActor(ActorConfig(params_dtype="bfloat16", lr=1e-3, max_tokens_per_gpu=256,
                                          megatron={"gradient_accumulation_fusion": fused}), cfg)
        actor.load_hf(ref.hf_state(hf))
        m = actor.train_step(samples, SFTLoss())
        results[fused] = (m, {n: t.float().clone() for n, t in actor.export_hf()})
    (m0, w0), (m1, w1) = results[False], results[True]
    assert m0["loss"] == m1["loss"]                                 # same forward
    assert abs(m0["grad_norm"] - m1["grad_norm"]) <= 1e-2 * m0["grad_norm"], (m0["grad_norm"], m1["grad_norm"])
    # Norms over all weights, not maxima: the exported weights are bf16, so a last-bit difference in
    # one fp32 master weight can flip its rounding by a whole bf16 ulp (~1e-3 here, as large as the step).
    start = {k: t.float().cuda() for k, t in ref.hf_state(hf).items() if k in w0}
    moved = sum(((w0[k] - start[k]) ** 2).sum().item() for k in start) ** 0.5
    diff = sum(((w0[k] - w1[k]) ** 2).sum().item() for k in start) ** 0.5
    assert moved > 0 and diff <= 0.1 * moved, (diff, moved)


def test_wgrad_fusion_trains_like_the_unfused_path():
    spawn(_wgrad_fusion_step, 1)
