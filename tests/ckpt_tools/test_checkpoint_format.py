"""Checkpoints of the bf16 hybrid with its optimizer.

- Its param groups mix dtypes (fp32 ``A_log`` / ``dt_bias`` among bf16 norms): every param's fp32 main copy and Adam
  moments come back to that param after a save and a load (megatron-core 0.19.2 mismatched them,
  `megatron_rl.actor.optim.align_mixed_dtype_group_order`).
- Format versions: a format-1 checkpoint of a Gated DeltaNet model saved before the plain gain landed held its output
  norms as ``w - 1`` (zero-centred like every other norm); loading it now gives HF's plain gain ``w`` in the model
  and in the optimizer's fp32 main copies. One saved after (format 2 came hours later) is loaded as it is. A
  checkpoint from a newer format is refused by name."""
import json

import pytest
import torch

from megatron_rl.checkpoint import CheckpointError, FORMAT_VERSION, load_checkpoint, save_checkpoint
from megatron_rl.parallel import spawn

NORM = "self_attention.out_norm.weight"


def _bf16_trainer(cfg, tp: int = 1):
    """bf16 params in DDP with the distributed optimizer's fp32 main copies, as the actor builds them (what a
    format-1 resume restores)."""
    from megatron_rl.actor.optim import OptimSettings, build_optimizer, wrap_ddp
    from megatron_rl.models import BuildOptions, ParallelSizes, build_model

    settings = OptimSettings(lr=1e-3, fused_adam=False)
    model = wrap_ddp(build_model(cfg, ParallelSizes(tp, 1), BuildOptions(params_dtype=torch.bfloat16)), settings)
    return model, build_optimizer(model, settings, torch.bfloat16)


def _norms(model):
    return {n: p for m in model for n, p in m.module.named_parameters() if n.endswith(NORM)}


def _mains(opt, params):
    """The fp32 main copy of each of `params` (name -> tensor)."""
    by_id = {id(p): n for n, p in params.items()}
    out = {}
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for halves, mains in zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups):
            for half, main in zip(halves, mains):
                if id(half) in by_id:
                    out[by_id[id(half)]] = main
    return out


def _trained_hybrid(tp: int = 1):
    """A tiny bf16 hybrid after one Adam step (an optimizer is saved once it has state), its grads finalised as the
    actor does (the TP sums keep replicated params equal across ranks)."""
    from megatron_rl.actor.actor import _finalize_grads_without_token_scaling
    from megatron_rl.bridge import get_bridge
    from tests.bridge.tiny_qwen3 import hf_tensors, tokens
    from tests.bridge.tiny_qwen3_5 import tiny_config, tiny_model

    cfg = tiny_config(layers=2, layer_types=["linear_attention", "full_attention"])
    hf = hf_tensors(tiny_model(cfg, seed=5))   # GDN output gains near 1, near 3.7 and near 1e-3
    model, opt = _bf16_trainer(cfg, tp)
    get_bridge(cfg).load_hf_into([m.module for m in model], hf)
    opt.reload_model_params()
    m, ids = model[0], tokens(cfg.vocab_size)
    m.zero_grad_buffer()
    opt.zero_grad()
    pos = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
    m(ids[:, :-1], pos, None, labels=ids[:, 1:]).float().mean().backward()
    _finalize_grads_without_token_scaling(model)
    opt.step()
    return cfg, model, opt


def _installed_state(model, opt):
    """param name -> (fp32 main shard, Adam moments), read in the order the optimizer installed its params (not
    through the map under test)."""
    names = {id(p): n for m in model for n, p in m.module.named_parameters()}
    out = {}
    for inner in opt.chained_optimizers:
        for group, (fp32s, halves) in enumerate(zip(inner.model_fp32_groups, inner.model_float16_groups)):
            for param, main in zip((*fp32s, *halves), inner.optimizer.param_groups[group]["params"]):
                st = inner.optimizer.state[main]
                out[names[id(param)]] = [main.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
    return out


def _mixed_groups_case(root: str, tp: int) -> None:
    from megatron_rl.parallel import init_parallel

    torch.set_num_threads(1)
    init_parallel(tp, 1)
    cfg, model, opt = _trained_hybrid(tp)
    kinds = {p.dtype for m in model for p in m.module.parameters()}
    assert kinds == {torch.bfloat16, torch.float32}, kinds
    before = _installed_state(model, opt)
    save_checkpoint(root, 1, model, opt, hf_config=cfg)
    fresh, fresh_opt = _bf16_trainer(cfg, tp)
    load_checkpoint(root, fresh, fresh_opt)
    after = _installed_state(fresh, fresh_opt)
    assert sorted(after) == sorted(before) and any(n.endswith("A_log") for n in before)
    for name, tensors in before.items():
        for want, got in zip(tensors, after[name]):
            assert torch.equal(want, got), name


def _format_one_case(root: str) -> None:
    from megatron_rl.parallel import init_parallel

    torch.set_num_threads(1)
    init_parallel(1, 1)
    cfg, model, opt = _trained_hybrid()
    norms = _norms(model)
    mains = _mains(opt, norms)
    assert len(norms) == 1 and sorted(mains) == sorted(norms)
    want = {n: p.detach().float().clone() for n, p in norms.items()}
    want_main = {n: m.detach().clone() for n, m in mains.items()}
    with torch.no_grad():   # what the format-1 code saved: w - 1 in the params and in their main copies
        for n in norms:
            norms[n].sub_(1.0)
            mains[n].sub_(1.0)
    save_checkpoint(root, 1, model, opt, hf_config=cfg)
    meta_path = f"{root}/iter_0000001/meta.json"
    meta = json.load(open(meta_path))
    assert meta["format_version"] == FORMAT_VERSION == 2
    meta["format_version"] = 1
    meta["saved_at"] = "2026-12-04T21:00:00-0500"   # 02:00 UTC on the 5th: after the plain gain landed
    json.dump(meta, open(meta_path, "w"))
    held = _bf16_trainer(cfg)[0]
    load_checkpoint(root, held, load_optimizer=False)   # such a format-1 checkpoint holds what it holds
    assert all(torch.equal(p, norms[n]) for n, p in _norms(held).items())
    meta["saved_at"] = "2026-12-04T20:30:00-0500"   # 01:30 UTC: before, so w - 1
    json.dump(meta, open(meta_path, "w"))

    fresh, fresh_opt = _bf16_trainer(cfg)
    load_checkpoint(root, fresh, fresh_opt)
    got, got_main = _norms(fresh), _mains(fresh_opt, _norms(fresh))
    for n in want:
        # bf16(bf16(w - 1) + 1): the bits the old form lost for gains far from 1 stay lost, nothing more
        assert (got[n].float() - want[n]).abs().max() <= 4e-3, n
        assert (got_main[n] - want_main[n]).abs().max() <= 1e-6, n
    weights_only, _ = _bf16_trainer(cfg)
    load_checkpoint(root, weights_only, load_optimizer=False)
    for n, p in _norms(weights_only).items():
        assert (p.float() - want[n]).abs().max() <= 4e-3, n

    meta["format_version"] = FORMAT_VERSION + 1
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match="format_version 3 is newer"):
        load_checkpoint(root, fresh, fresh_opt)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_dtype_groups_give_each_param_its_own_optimizer_state_back(tmp_path, tp):
    spawn(_mixed_groups_case, tp, str(tmp_path), tp)


@pytest.mark.slow
def test_format_one_gdn_output_norms_come_back_as_the_plain_gain(tmp_path):
    spawn(_format_one_case, 1, str(tmp_path))
