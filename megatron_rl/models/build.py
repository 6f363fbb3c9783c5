"""Instantiate this rank's model chunk(s) for an HF config under the current parallel state."""
from __future__ import annotations

import torch

from .spec import BuildOptions, ParallelSizes, spec_for

#: attribute `build_model` sets on parameters whose gradients `sum_tp_partial_grads` adds up over TP
TP_PARTIAL_GRAD = "tp_partial_grad"


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_model(hf_config, par: ParallelSizes, opt: BuildOptions | None = None, *, wrap_ddp: bool = False):
    """Returns the list of GPTModel chunks this rank owns (one per virtual PP stage).

    `megatron_rl.parallel.init_parallel` must have run with the same (tp, pp).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    opt = opt or BuildOptions()
    spec = spec_for(hf_config)
    spec.validate(hf_config, par)
    if ps.get_tensor_model_parallel_world_size() != par.tp or ps.get_pipeline_model_parallel_world_size() != par.pp:
        raise RuntimeError(
            f"parallel state is tp={ps.get_tensor_model_parallel_world_size()} "
            f"pp={ps.get_pipeline_model_parallel_world_size()}, model asked for tp={par.tp} pp={par.pp}"
        )
    use_te = te_available() if opt.use_te is None else opt.use_te
    if opt.extra.get("gradient_accumulation_fusion"):
        # megatron's own ColumnParallelLinear (the output layer, also under the TE spec) asks for apex's
        # extension; provide it (or the same cuBLAS GEMM through torch) before the model is built
        from megatron_rl.parallel import wgrad_fusion
        wgrad_fusion.install()
    if not torch.cuda.is_available():
        opt = BuildOptions(**{**opt.__dict__, "use_cpu_initialization": True})
    config = spec.transformer_config(hf_config, par, opt)
    kwargs = spec.gpt_model_kwargs(hf_config, par, opt)

    vpp = par.vpp or 1
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = []
    for vp_stage in range(vpp):
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec.layer_spec(config, use_te, vp_stage if par.vpp else None, pp_rank),
            pre_process=pre,
            post_process=post,
            vp_stage=vp_stage if par.vpp else None,
            **kwargs,
        )
        _cast_floating_params(model, opt.params_dtype, keep_fp32=spec.fp32_params)
        for name, p in model.named_parameters():
            if spec.tp_partial_grad_params and name.endswith(spec.tp_partial_grad_params):
                setattr(p, TP_PARTIAL_GRAD, True)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _cast_floating_params(model: torch.nn.Module, dtype: torch.dtype, keep_fp32: tuple[str, ...] = ()) -> None:
    """Every floating parameter in ``params_dtype``, as Megatron-LM's Float16Module does for bf16 training.

    The local spec's torch norms ignore ``config.params_dtype`` and come out fp32: left alone they would
    export as fp32 tensors, and under the distributed optimizer fp32 params get main-param views into the
    DDP buffer instead of copies (`megatron_rl.actor.optim` offloads those with their buffer).
    `keep_fp32`: parameter names (last component) the architecture keeps in fp32 (GDN's ``A_log`` and
    ``dt_bias``, which HF also computes with in fp32)."""
    for name, p in model.named_parameters():
        want = torch.float32 if name.rsplit(".", 1)[-1] in keep_fp32 else dtype
        if p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)


def sum_tp_partial_grads(model_chunks) -> int:
    """Sum over the TP group the gradients of params marked `TP_PARTIAL_GRAD` (``main_grad`` under megatron DDP),
    after megatron's own grad finalisation and before the optimizer reads them; returns how many were summed.

    Why: such a param (Qwen3.5's GDN output norm) is replicated on every TP rank but each rank applies it to its
    own heads only, so each rank's gradient covers its heads. Left alone the replicas drift apart, the update is
    not the model's gradient, and an export takes one rank's copy. megatron-core 0.19 sums only q/k layernorm grads
    by name (``finalize_model_grads``); this does the same for the architecture's listed params."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if ps.get_tensor_model_parallel_world_size() == 1:
        return 0
    grads = []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if getattr(p, TP_PARTIAL_GRAD, False) and p.requires_grad:
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:
                    grads.append(g.data)
    if grads:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
        for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(summed)
    return len(grads)
