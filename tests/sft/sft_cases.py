"""Checks that run in a spawned process (megatron's parallel state lives there, not in pytest's)."""
from __future__ import annotations

import json
import os


def packing_case(model_dir: str, out: str) -> None:
    """One SFT step on the same batch, packed into one micro-batch and one sample per micro-batch: the loss, the
    gradient norm and the updated weights agree. The model is the Qwen3.5 hybrid, so packing also has to keep the
    recurrent (Gated DeltaNet) state from running across the samples of a packed row."""
    import torch
    from transformers import AutoConfig

    from megatron_rl.actor import ActorConfig, MegatronActor, SFTLoss
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.types import TrainSample

    g = torch.Generator().manual_seed(0)
    samples = []
    for n, prompt in ((37, 20), (64, 30), (23, 5), (50, 49)):
        toks = torch.randint(0, 1000, (n,), generator=g).tolist()
        samples.append(TrainSample(tokens=toks, loss_mask=[0] * prompt + [1] * (n - prompt)))
    hf = AutoConfig.from_pretrained(model_dir)
    results = {}
    for name, batching in (("packed", {"max_tokens_per_gpu": 4096}),
                           ("unpacked", {"max_tokens_per_gpu": None, "micro_batch_size": 1})):
        init_parallel(1, 1)
        # adam_eps >> |g|: Adam's first step is ~ lr * g / eps, so the weights compare the gradients linearly
        # (with a small eps it is ~ lr * sign(g), and a gradient of ~0 may flip sign on rounding)
        actor = MegatronActor(ActorConfig(params_dtype="float32", attention_backend="sdpa", lr=1e-2, adam_eps=10.0,
                                          clip_grad=0.0, **batching), hf)
        actor.load_hf(model_dir)
        m = actor.train_step(samples, SFTLoss())
        weights = {n: t.detach().clone() for n, t in actor.export_hf()}
        results[name] = (m, weights)
        destroy_parallel()
    (pm, pw), (um, uw) = results["packed"], results["unpacked"]
    assert pm["num_micro_batches"] == 1 and um["num_micro_batches"] == 4, (pm, um)
    assert abs(pm["loss"] - um["loss"]) < 1e-5, (pm["loss"], um["loss"])
    assert abs(pm["grad_norm"] - um["grad_norm"]) < 1e-5 * max(1.0, um["grad_norm"]), (pm, um)
    diff = max((pw[n] - uw[n]).abs().max().item() for n in pw)
    assert diff < 1e-7, diff   # one float32 ulp of the largest weights (norms at 1.0)
    with open(out, "w") as f:
        json.dump({"loss": [pm["loss"], um["loss"]], "max_weight_diff": diff}, f)


def resume_case(repo: str, data: str, tmp: str, out: str) -> None:
    """`megatron_rl.sft.run` three steps straight, and killed after its step-2 checkpoint then resumed: the same
    losses step for step (weights, optimizer, LR schedule, RNG and data position come back)."""
    from megatron_rl.sft import InjectedFault, load_sft_config, run

    os.chdir(repo)
    base = ["cluster.backend=local", f"data.files=['{data}']", "train.steps=3", "train.global_batch_size=2",
            "train.save_interval=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
            "actor.lr_warmup_steps=1"]
    full = run(load_sft_config("configs/sft_tiny.yaml", base + [f"train.log_dir={tmp}/full"]))
    try:
        run(load_sft_config("configs/sft_tiny.yaml", base + [f"train.log_dir={tmp}/cut", "train.kill_at_step=2",
                                                             "train.export=false"]))
        raise AssertionError("kill_at_step did not stop the run")
    except InjectedFault:
        pass
    resumed = run(load_sft_config("configs/sft_tiny.yaml", base + [f"train.log_dir={tmp}/cut"]), resume=True)
    with open(out, "w") as f:
        json.dump({"full": full, "resumed": resumed}, f)


def release_layout_case(repo: str, model_dir: str, data: str, tmp: str, out: str) -> None:
    """One SFT step from `model_dir` with its HF export: what the export writes is read by the test."""
    from megatron_rl.sft import load_sft_config, run

    os.chdir(repo)
    summary = run(load_sft_config("configs/sft_tiny.yaml", [
        "cluster.backend=local", f"model.path={model_dir}", f"data.files=['{data}']", "train.steps=1",
        "train.global_batch_size=2", f"train.log_dir={tmp}/run"]))
    with open(out, "w") as f:
        json.dump(summary, f)
