"""Bridge on real megatron-core models over gloo: HF logit parity and bitwise export round trips.

Each spawned run covers several parallel layouts (init_parallel rebuilds the groups in place), so
the process start-up cost is paid once per world size.
"""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_rl.parallel import spawn

# (tp, pp, vpp, tied, kv_heads, layers, source)
CASES_2 = [
    (1, 1, None, False, 2, 2, "dict"),   # dp=2
    (2, 1, None, False, 2, 2, "lazy"),
    (2, 1, None, True, 1, 2, "dict"),    # tp > num_kv_heads
    (1, 2, None, True, 2, 2, "lazy"),    # tied + PP: last stage holds a copy of the embedding
    (1, 2, 2, False, 2, 4, "dict"),      # virtual pipeline chunks
]
CASES_4 = [
    (2, 2, None, True, 2, 2, "lazy"),
    (2, 2, None, False, 2, 4, "dict"),
]


def _check_case(case, hf_root):
    from ckpt_tools.forward import megatron_logits
    from megatron_rl.bridge import LazyHFState, get_bridge
    from megatron_rl.models import BuildOptions, ParallelSizes, build_model
    from megatron_rl.parallel import init_parallel
    from tests.bridge.tiny_qwen3 import hf_tensors, tiny_config, tiny_model, tokens

    tp, pp, vpp, tied, kv, layers, source = case
    init_parallel(tp, pp, vpp=vpp)
    cfg = tiny_config(tied=tied, kv_heads=kv, layers=layers)
    hf = tiny_model(cfg, seed=layers + kv)
    ref = hf_tensors(hf)
    if source == "lazy":
        path = os.path.join(hf_root, "_".join(map(str, case)))
        if dist.get_rank() == 0:
            hf.save_pretrained(path, max_shard_size="40KB")  # several shards + index
        dist.barrier()
        state = LazyHFState(path)
        assert len(list(os.scandir(path))) > 3, "expected a sharded checkpoint"
    else:
        state = ref

    chunks = build_model(cfg, ParallelSizes(tp, pp, vpp), BuildOptions(perform_initialization=False))
    bridge = get_bridge(cfg)
    bridge.load_hf_into(chunks, state)
    for c in chunks:
        c.eval()

    ids = tokens(cfg.vocab_size)
    got = megatron_logits(chunks, ids)
    with torch.no_grad():
        want = hf(ids).logits
    assert got.shape[-1] >= cfg.vocab_size and got.shape[-1] % 128 == 0
    diff = (got[..., : cfg.vocab_size] - want).abs().max().item()
    assert diff < 1e-4, f"{case}: max logit diff {diff}"

    exported = list(bridge.export_hf(chunks))
    assert [n for n, _ in exported] == bridge.hf_param_names(cfg), case
    for name, t in exported:
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), f"{case}: {name} differs"

    # the stream never aliases a live parameter, and `dtype=` casts
    name0, t0 = next(iter(bridge.export_hf(chunks, dtype=torch.bfloat16)))
    assert t0.dtype == torch.bfloat16 and torch.equal(t0, ref[name0].to(torch.bfloat16))
    for _, t in bridge.export_hf(chunks):
        t.zero_()
    again = dict(bridge.export_hf(chunks))
    assert all(torch.equal(again[n], ref[n]) for n in ref)


def _run_cases(cases, hf_root, load_errors=False):
    torch.set_num_threads(1)
    for case in cases:
        _check_case(case, hf_root)
    if load_errors:
        _load_errors()


@pytest.mark.slow
def test_bridge_world2(tmp_path):
    spawn(_run_cases, 2, CASES_2, str(tmp_path), True)


@pytest.mark.slow
def test_bridge_tp2_pp2(tmp_path):
    spawn(_run_cases, 4, CASES_4, str(tmp_path))


def _load_errors():
    """A tied lm_head that differs from the embedding, and a missing tensor, are named errors."""
    from megatron_rl.bridge import BridgeError, get_bridge
    from megatron_rl.models import BuildOptions, ParallelSizes, build_model
    from megatron_rl.parallel import init_parallel
    from tests.bridge.tiny_qwen3 import hf_tensors, tiny_config, tiny_model

    init_parallel(2, 1)
    cfg = tiny_config(tied=True)
    state = hf_tensors(tiny_model(cfg))
    chunks = build_model(cfg, ParallelSizes(2, 1), BuildOptions())
    bridge = get_bridge(cfg)
    bridge.load_hf_into(chunks, {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()})
    bad = state["model.embed_tokens.weight"].clone()
    bad[3, 0] += 1  # row 3 lives on TP rank 0 only: rank 1 cannot see the mismatch
    if dist.get_rank() == 0:
        with pytest.raises(BridgeError, match="lm_head.weight"):
            bridge.load_hf_into(chunks, {**state, "lm_head.weight": bad})
    missing = dict(state)
    missing.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(BridgeError, match="model.layers.1.mlp.down_proj.weight"):
        bridge.load_hf_into(chunks, missing)
