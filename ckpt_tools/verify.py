"""HF vs Megatron logit parity for a converted checkpoint (the `verify` command).

The HF model (transformers, eager attention) runs in this process first and is freed; then tp*pp
ranks build the Megatron model from the checkpoint, run the same tokens (`megatron_logits`), and
rank 0 hands its logits back through a temp file. Comparing in the parent keeps at most one
model in memory per process.

Compute dtype: on a CPU host a half-precision checkpoint runs in float32 on both sides by default when two
float32 copies of it fit in the host's available memory (``compute_dtype="auto"``): its weights widen
exactly, so the comparison sees layout errors only, not bf16 rounding (which, on a small or randomly
initialised model whose logits are near zero, exceeds any bound relative to the logits). On a GPU `auto`
keeps the checkpoint's dtype: float32 would double the device memory, and fla's GDN kernels round float32
products to TF32 (2.4e-3 on the H200), beyond the float32 bound. ``checkpoint`` and ``float32`` force one.
Either way the HF model runs on the weights the checkpoint holds: a checkpoint converted to a narrower dtype than
the release (``hf-to-mcore --dtype bfloat16`` of float32 weights) is compared with the release's weights rounded
to that dtype, as loading the release in the checkpoint's dtype does (`round_weights`).

Tolerance: `tol` is an absolute bound on max |logit_hf - logit_megatron|. Default: 1e-4 when computing in
fp32; in bf16/fp16 5% of the largest |HF logit| (at least 0.05), because half-precision rounding grows
with the logit scale while a layout bug produces errors of the logits' own size.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import torch

from megatron_rl.bridge import get_bridge
from megatron_rl.bridge.hf_dir import load_hf_config
from megatron_rl.checkpoint import CheckpointError, check_files, read_meta, resolve_checkpoint
from megatron_rl.models import ParallelSizes, spec_for, text_config
from verifier.inputs import host_available_bytes   # MemAvailable, capped by the cgroup's limit

from .convert import INPUT_ERRORS
from .hf_io import config_from_dict, parse_dtype
from .ranks import ToolError, limit_threads, run_ranks

FP32_TOL = 1e-4
HALF_REL_TOL = 0.05


@dataclasses.dataclass(frozen=True)
class VerifyJob:
    hf_dir: str
    ckpt_dir: str
    tp: int = 1
    pp: int = 1
    tol: float | None = None
    batch: int = 2
    seq_len: int = 32
    seed: int = 0
    iteration: int | None = None
    compute_dtype: str = "auto"   # auto | checkpoint | float32 (see the module docstring)


#: what `VerifyJob.compute_dtype` accepts
COMPUTE_DTYPES = ("auto", "checkpoint", "float32")


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    max_abs_logit_diff: float
    tol: float
    ok: bool
    max_abs_logit: float
    top1_agreement: float
    dtype: str                    # the dtype both models ran in
    checkpoint_dtype: str
    tp: int
    pp: int
    tokens: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def default_tol(dtype: torch.dtype, max_abs_logit: float) -> float:
    if dtype == torch.float32:
        return FP32_TOL
    return HALF_REL_TOL * max(1.0, max_abs_logit)


def choose_compute_dtype(choice: str, ckpt_dtype: torch.dtype, n_params: int, available_bytes: int | None,
                         on_gpu: bool = False) -> torch.dtype:
    """The dtype both models run in (module docstring): float32 for `auto` on a CPU host when two float32
    copies of the `n_params` weights fit in `available_bytes` (unknown: assumed to fit)."""
    if choice not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={choice!r}: expected one of {', '.join(COMPUTE_DTYPES)}")
    if choice == "float32" or ckpt_dtype == torch.float32:
        return torch.float32
    if choice == "checkpoint" or on_gpu:
        return ckpt_dtype
    fits = available_bytes is None or 2 * 4 * n_params <= available_bytes
    return torch.float32 if fits else ckpt_dtype


def verify(job: VerifyJob) -> VerifyReport:
    par = ParallelSizes(job.tp, job.pp)
    try:
        if job.batch < 1 or job.seq_len < 1:
            raise ValueError(f"batch={job.batch} and seq_len={job.seq_len} must be positive")
        _it, ckpt = resolve_checkpoint(job.ckpt_dir, job.iteration)
        meta = read_meta(ckpt)
        if not meta.get("hf_config"):
            raise CheckpointError(f"{ckpt / 'meta.json'}: has no hf_config")
        check_files(ckpt)
        ckpt_cfg = config_from_dict(meta["hf_config"])
        get_bridge(ckpt_cfg).validate(par)
        hf_cfg = load_hf_config(job.hf_dir)
        if ckpt_cfg.model_type != hf_cfg.model_type:
            raise CheckpointError(f"{ckpt}: model_type {ckpt_cfg.model_type!r} but {job.hf_dir} has "
                                  f"{hf_cfg.model_type!r}")
        _check_same_shapes(ckpt, ckpt_cfg, job.hf_dir, hf_cfg)
        ckpt_dtype = parse_dtype(meta.get("params_dtype", "float32"))
        n_params = sum(math.prod(shape) for shape in get_bridge(ckpt_cfg).hf_shapes().values() if shape)
        dtype = choose_compute_dtype(job.compute_dtype, ckpt_dtype, n_params, host_available_bytes(),
                                     on_gpu=torch.cuda.is_available())
    except INPUT_ERRORS as e:
        raise ToolError(str(e)) from None

    gen = torch.Generator().manual_seed(job.seed)
    tokens = torch.randint(0, int(text_config(hf_cfg).vocab_size), (job.batch, job.seq_len), generator=gen)
    # the HF side runs on the weights the checkpoint holds: a checkpoint converted to a narrower dtype than the HF
    # release (``hf-to-mcore --dtype bfloat16`` of float32 weights) compared in float32 against the unrounded release
    # would differ by that rounding alone and fail a correct conversion
    hf_logits = hf_forward(job.hf_dir, tokens, dtype, weights_dtype=ckpt_dtype,
                           keep_fp32=spec_for(ckpt_cfg).fp32_params)

    with tempfile.TemporaryDirectory(prefix="ckpt_verify_") as tmp:
        tok_path, out_path = Path(tmp) / "tokens.pt", Path(tmp) / "logits.pt"
        torch.save(tokens, tok_path)
        run_ranks(_verify_rank, job.tp * job.pp, str(Path(job.ckpt_dir).absolute()), job.iteration,
                  job.tp, job.pp, str(tok_path), str(out_path), str(dtype).removeprefix("torch."))
        mg_logits = torch.load(out_path)

    vocab = hf_logits.shape[-1]
    mg_logits = mg_logits[..., :vocab]
    diff = (mg_logits - hf_logits).abs().max().item()
    max_logit = hf_logits.abs().max().item()
    tol = job.tol if job.tol is not None else default_tol(dtype, max_logit)
    agree = (mg_logits.argmax(-1) == hf_logits.argmax(-1)).float().mean().item()
    ok = bool(diff <= tol) and torch.isfinite(mg_logits).all().item()
    return VerifyReport(max_abs_logit_diff=diff, tol=tol, ok=ok, max_abs_logit=max_logit,
                        top1_agreement=agree, dtype=str(dtype).removeprefix("torch."),
                        checkpoint_dtype=str(ckpt_dtype).removeprefix("torch."), tp=job.tp,
                        pp=job.pp, tokens=int(tokens.numel()))


def _check_same_shapes(ckpt, ckpt_cfg, hf_dir, hf_cfg) -> None:
    """Models whose tensors differ in shape cannot be run on the same tokens: say which config
    fields differ instead of failing inside a forward pass (an out-of-range token id, say)."""
    want, have = get_bridge(ckpt_cfg).hf_shapes(), get_bridge(hf_cfg).hf_shapes()
    if want == have:
        return
    a, b = ckpt_cfg.to_dict(), hf_cfg.to_dict()
    fields = sorted(k for k in set(a) | set(b) if k not in _META_FIELDS and a.get(k) != b.get(k))
    diff = "; ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in fields[:8])
    tensors = [f"{n} {want.get(n)} vs {have.get(n)}" for n in sorted(set(want) | set(have))
               if want.get(n) != have.get(n)]
    raise CheckpointError(f"{ckpt} and {hf_dir} are different architectures (checkpoint vs --hf): "
                          f"{diff or 'config fields agree'}; tensors: {', '.join(tensors[:3])}"
                          f"{' ...' if len(tensors) > 3 else ''}")


_META_FIELDS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "_commit_hash"}


@torch.no_grad()
def hf_forward(hf_dir: str, tokens: torch.Tensor, dtype: torch.dtype, weights_dtype: torch.dtype | None = None,
               keep_fp32: tuple[str, ...] = ()) -> torch.Tensor:
    """float32 CPU logits of the transformers model in `dtype` (eager attention).

    `weights_dtype`: the dtype the compared checkpoint holds its weights in. Where it is narrower than `dtype`,
    every weight is first rounded to it (and widened back exactly), as the checkpoint's were, except those whose
    last name component is in `keep_fp32` (the architecture keeps them in float32 whatever its params dtype)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="eager",
                                                           output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ToolError(f"{hf_dir}: transformers cannot load the model ({type(e).__name__}: {e})") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would fill them with random values and the comparison would be meaningless
        raise ToolError(f"{hf_dir}: HF weights missing, transformers would initialise them randomly: "
                        f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model = model.to(device).eval()
    if weights_dtype is not None and weights_dtype.itemsize < dtype.itemsize:
        round_weights(model, weights_dtype, keep_fp32)
    try:
        # no cache: one full forward needs none, and transformers' cache cannot report a sequence length for a
        # model whose layers are all linear attention (its forward raises instead)
        logits = model(tokens.to(device), use_cache=False).logits.float().cpu()
    except Exception as e:  # noqa: BLE001 - a failed forward is bad input (exit 2), not a logit mismatch (exit 1)
        raise ToolError(f"{hf_dir}: the transformers forward failed ({type(e).__name__}: {e})") from None
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return logits


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype, keep_fp32: tuple[str, ...] = ()) -> None:
    """Round `model`'s floating parameters to `dtype` in place, keeping their own dtype (names in `keep_fp32` by
    their last component are left alone)."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and name.rsplit(".", 1)[-1] not in keep_fp32:
            p.copy_(p.to(dtype))


def megatron_forward(chunks, tokens: torch.Tensor, ckpt) -> torch.Tensor:
    """`megatron_logits`, with a failure raised as a ToolError naming the checkpoint: `run_ranks` reports a rank's
    last traceback line, which alone would not say which side of the comparison failed."""
    from .forward import megatron_logits

    try:
        return megatron_logits(chunks, tokens)
    except Exception as e:  # noqa: BLE001 - megatron raises many kinds
        raise ToolError(f"{ckpt}: the Megatron forward failed ({type(e).__name__}: {e})") from None


def _verify_rank(ckpt_root, iteration, tp, pp, tok_path, out_path, compute_dtype):
    import torch.distributed as dist

    from megatron_rl.checkpoint import load_checkpoint
    from megatron_rl.models import BuildOptions, build_model
    from megatron_rl.parallel import init_parallel

    limit_threads(tp * pp)
    init_parallel(tp, pp)
    _it, ckpt = resolve_checkpoint(ckpt_root, iteration)
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["hf_config"])
    chunks = build_model(cfg, ParallelSizes(tp, pp),
                         BuildOptions(params_dtype=parse_dtype(compute_dtype),   # loading widens half weights
                                      perform_initialization=False))
    load_checkpoint(ckpt_root, chunks, iteration=iteration, load_optimizer=False)
    for c in chunks:
        c.eval()
    logits = megatron_forward(chunks, torch.load(tok_path), ckpt)
    if dist.get_rank() == 0:
        torch.save(logits.cpu(), out_path)
