"""fp32 logits from bf16 weights (`megatron_rl.models.fp32_logits`), on the actor's and the engine's side.

The forward must be the GEMM's unrounded result; the backward must equal the plain bf16 path's (bf16 logits, then
``.float()``), so turning it on changes the logits' rounding and nothing else in training."""
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.actor.logprobs import _output_logits
from megatron_rl.config import RLConfig, validate
from megatron_rl.models.fp32_logits import fp32_output_linear, plain_lm_head, use_fp32_lm_head

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/tests/rollout")
from rollout_helpers import TINY  # noqa: E402


def _inputs(seed=0, rows=6, hidden=32, vocab=50):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 1, hidden, generator=g) * 3).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=g) * 2).to(torch.bfloat16)
    return x, w


def test_forward_is_the_unrounded_gemm_and_backward_equals_the_bf16_path():
    x, w = _inputs()
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp32_output_linear(x1, w1)
    assert out.dtype == torch.float32 and out.shape == (6, 1, 50)
    assert torch.equal(out, F.linear(x.float(), w.float()))
    # these logits are large: bf16 rounding moves them by up to half of 0.0625..0.25
    assert (F.linear(x, w).float() - out).abs().max() > 1e-2
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    plain = F.linear(x2, w2).float()
    g = torch.randn(plain.shape, generator=torch.Generator().manual_seed(1))
    (out * g).sum().backward()
    (plain * g).sum().backward()
    assert x1.grad.dtype == torch.bfloat16 and w1.grad.dtype == torch.bfloat16
    assert torch.equal(x1.grad, x2.grad) and torch.equal(w1.grad, w2.grad)


def test_fp32_inputs_take_the_plain_linear():
    x, w = _inputs()
    assert torch.equal(fp32_output_linear(x.float(), w.float()), F.linear(x.float(), w.float()))


def test_actor_output_logits_fp32_or_the_layers_own_output():
    x, w = _inputs()
    calls = []

    class OutputLayer:     # the attributes chunked_logprobs reads from megatron's ColumnParallelLinear
        tp_group = None
        bias = None
        weight = w
        sequence_parallel = False
        gradient_accumulation_fusion = False

        def __call__(self, hidden, weight=None, runtime_gather_output=None):
            calls.append(weight)
            return F.linear(hidden, weight if weight is not None else self.weight), None

    layer = OutputLayer()
    assert torch.equal(_output_logits(x, None, layer, fp32=True), F.linear(x.float(), w.float()))
    w_shared = w * 2     # a tied embedding's weight, passed in
    assert torch.equal(_output_logits(x, w_shared, layer, fp32=True), F.linear(x.float(), w_shared.float()))
    assert not calls
    assert _output_logits(x, None, layer, fp32=False).dtype == torch.bfloat16 and len(calls) == 1
    layer.bias = torch.zeros(50, dtype=torch.bfloat16)   # not the GPT output layer's shape: left to the layer
    assert _output_logits(x, None, layer, fp32=True).dtype == torch.bfloat16 and len(calls) == 2


def _bf16_model():
    from megatron_rl.rollout.embedded_server import load_model

    model, _ = load_model(None, hf_config=dict(TINY), device=torch.device("cpu"), dtype=torch.bfloat16, init_seed=0)
    return model


def test_engine_model_returns_fp32_logits_that_follow_weight_updates():
    model = _bf16_model()
    ids = torch.tensor([[3, 17, 42, 9]])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        rounded = model(ids).logits
        assert rounded.dtype == torch.bfloat16
        assert use_fp32_lm_head(model) and use_fp32_lm_head(model)   # idempotent
        logits = model(ids).logits
        assert logits.dtype == torch.float32
        assert torch.equal(logits, F.linear(hidden.float(), model.lm_head.weight.float()))
        model.lm_head.weight.mul_(2)    # weight updates copy into the same parameter
        assert torch.equal(model(ids).logits, F.linear(hidden.float(), model.lm_head.weight.float()))
        copy = __import__("copy").deepcopy(model)      # a copy's head reads the copy's weight
        copy.lm_head.weight.zero_()
        assert torch.equal(copy(ids).logits, torch.zeros_like(logits))
        plain_lm_head(model)
        assert model(ids).logits.dtype == torch.bfloat16
    assert "lm_head.weight" in dict(model.named_parameters())


def test_engine_decodes_with_fp32_logits_and_refuses_a_head_it_cannot_serve():
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.sampling import RequestSampling
    from rollout_helpers import reference_logprobs

    model = _bf16_model()
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(gather_ms=0, fp32_lm_head=True))
    done, finished = [], threading.Event()
    sampling = RequestSampling(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_new_tokens=8,
                               stop_token_ids=frozenset(), stop_strings=(), ignore_eos=True, seed=5)
    engine.start()
    try:
        engine.submit(engine.new_request([5, 6, 7, 8], sampling, return_logprob=True,
                                         on_done=lambda o: (done.append(o), finished.set())))
        assert finished.wait(60)
    finally:
        engine.shutdown()
    out = done[0]
    tokens = out["output_ids"]
    lps = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
    ref = reference_logprobs(model, [5, 6, 7, 8], tokens)   # the same model: its full forward, fp32 logits too
    assert len(tokens) == 8 and max(abs(a - b) for a, b in zip(lps, ref)) < 5e-2

    biased = _bf16_model()
    biased.lm_head = torch.nn.Linear(64, 256, bias=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32_lm_head"):
        EmbeddedEngine(biased, EmbeddedEngineConfig(fp32_lm_head=True))


def test_config_refuses_an_engine_setting_that_differs_from_the_actors():
    cfg = RLConfig()
    cfg.rollout.sglang = {"enable-fp32-lm-head": False}
    with pytest.raises(ValueError, match="actor.fp32_lm_head"):
        validate(cfg)
    cfg.rollout.sglang = {"enable_fp32_lm_head": "false"}   # would reach SGLang as a flag with a value
    with pytest.raises(ValueError, match="actor.fp32_lm_head"):
        validate(cfg)
    cfg.rollout.sglang = {"enable_fp32_lm_head": True}
    validate(cfg)


def test_the_trainer_starts_its_engines_with_the_actors_setting():
    from megatron_rl.cluster.rollout_manager import RolloutManager

    for fp32 in (True, False):
        cfg = RLConfig()
        cfg.actor.fp32_lm_head = fp32
        manager = RolloutManager.__new__(RolloutManager)   # only the config is read
        manager.cfg = cfg
        assert manager._numerics_args() == ({"enable_fp32_lm_head": True} if fp32 else {})


def test_embedded_server_takes_sglangs_flag():
    from megatron_rl.rollout.embedded_server import build_arg_parser

    base = ["--hf-config", "{}"]
    assert build_arg_parser().parse_args(base + ["--enable-fp32-lm-head"]).enable_fp32_lm_head
    assert not build_arg_parser().parse_args(base).enable_fp32_lm_head
