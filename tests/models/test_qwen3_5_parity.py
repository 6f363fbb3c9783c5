"""Qwen3.5 hybrid on real megatron-core (GatedDeltaNet + gated attention) over gloo: HF logit parity at
TP 1/2 and PP 1/2, packed (thd) equal to unpacked, both HF layouts, and bitwise export round trips.

Each spawned run covers several layouts (init_parallel rebuilds the groups in place), so process
start-up is paid once per world size. The GDN kernels are megatron's calls into the CPU references of
`megatron_rl.parallel.cpu_compat`.
"""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_rl.parallel import spawn

# (tp, pp, layout, packed)
CASES_2 = [
    (1, 1, "text", True),       # dp=2
    (2, 1, "multimodal", True),
    (1, 2, "text", False),
]
CASES_4 = [(2, 2, "multimodal", False)]
# fp32 logits against HF's torch path: on CPU both sides run torch; on a GPU both run fla's Triton kernels, whose
# dot products are TF32 (unit roundoff 2^-11), called with different layouts and l2norm placement. Measured on
# an H200 (2026-12-02): 2.4e-3 max over the 2x70 logits of the tiny model; a wrong weight or mask is O(0.1-1)
TOL = 1e-4 if not torch.cuda.is_available() else 5e-3


def _packed_logits(chunks, cfg, seqs):
    """One thd micro-batch of `seqs` (positions restart per sequence) -> per-sequence logits."""
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.attention import install_sdpa_attention, install_sync_free_thd_rope
    from megatron_rl.actor.forward import thd_packed_seq_params
    from megatron_rl.actor.batching import MicroBatch  # noqa: F401  (documents where thd params come from)

    install_sdpa_attention(chunks)
    install_sync_free_thd_rope()
    device = next(chunks[0].parameters()).device   # the GPU test runs this same check on CUDA
    ids = torch.cat(seqs)[None].to(device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)

    class _MB:  # the two fields thd_packed_seq_params reads
        segment_lengths = [len(s) for s in seqs]
        input_ids = ids

    with torch.no_grad():
        out = chunks[0](ids, pos, None, packed_seq_params=thd_packed_seq_params(_MB))
    logits = out.float()
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    logits = logits.reshape(-1, logits.shape[-1])[:, : cfg.vocab_size]
    return list(torch.split(logits, [len(s) for s in seqs]))


def _check_case(case, root):
    from ckpt_tools.forward import megatron_logits
    from megatron_rl.bridge import LazyHFState, get_bridge
    from megatron_rl.models import BuildOptions, ParallelSizes, build_model
    from megatron_rl.parallel import init_parallel
    from tests.bridge.tiny_qwen3_5 import hf_tensors, multimodal_config, multimodal_tensors, tiny_config, tiny_model

    tp, pp, layout, packed = case
    init_parallel(tp, pp)
    text_cfg = tiny_config()
    hf = tiny_model(text_cfg, seed=tp * 10 + pp)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if layout == "multimodal":
        cfg = multimodal_config(text_cfg)
        ref = multimodal_tensors(hf, cfg)
        path = os.path.join(root, "_".join(map(str, case)))
        if dist.get_rank() == 0:
            from safetensors.torch import save_file
            os.makedirs(path, exist_ok=True)
            save_file(ref, os.path.join(path, "model.safetensors"))
            cfg.save_pretrained(path)
        dist.barrier()
        state = LazyHFState(path)
    else:
        cfg, ref = text_cfg, hf_tensors(hf)
        state = ref
    bridge = get_bridge(cfg)
    missing, unexpected = bridge.check_hf_names(list(ref))
    assert not missing and not unexpected, (missing, unexpected)

    chunks = build_model(cfg, ParallelSizes(tp, pp), BuildOptions(perform_initialization=False))
    for c in chunks:
        for name, p in c.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                assert p.dtype == torch.float32, name
    bridge.load_hf_into(chunks, state)
    for c in chunks:
        c.eval()

    ids = torch.randint(0, text_cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(3))
    got = megatron_logits(chunks, ids)[..., : text_cfg.vocab_size]
    with torch.no_grad():  # transformers runs fla's kernels too when they are installed: HF on the same device
        want = hf.to(device)(ids.to(device)).logits.cpu()
        hf.cpu()
    diff = (got.cpu() - want).abs().max().item()
    assert diff <= TOL, f"{case}: max logit diff {diff}"

    exported = list(bridge.export_hf(chunks))
    names = [n for n, _ in exported]
    assert names == bridge.hf_param_names(cfg) and len(set(names)) == len(names)
    lm = {n: t for n, t in ref.items() if n not in bridge.passthrough_hf_names(list(ref))}
    assert set(names) == set(lm), set(names) ^ set(lm)
    for name, t in exported:
        # export yields on the params' device (the GPU in test_qwen3_5_gpu.py); the reference is on the host
        assert t.dtype == ref[name].dtype and torch.equal(t.cpu(), ref[name]), f"{case}: {name} differs after export"

    if packed and pp == 1:
        seqs = [ids[0, :37], ids[1, :5], ids[0, 40:63], ids[1, 10:11]]
        per_seq = _packed_logits(chunks, text_cfg, seqs)
        for s, logits in zip(seqs, per_seq):
            with torch.no_grad():
                alone = hf.to(device)(s[None].to(device)).logits[0].cpu()
            d = (logits.cpu() - alone).abs().max().item()
            assert d <= TOL, f"{case}: packed sequence of {len(s)} differs from HF alone by {d}"


def _run_cases(cases, root):
    torch.set_num_threads(1)
    for case in cases:
        _check_case(case, root)


@pytest.mark.slow
def test_qwen3_5_world2(tmp_path):
    spawn(_run_cases, 2, CASES_2, str(tmp_path))


@pytest.mark.slow
def test_qwen3_5_tp2_pp2(tmp_path):
    spawn(_run_cases, 4, CASES_4, str(tmp_path))
