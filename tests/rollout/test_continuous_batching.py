"""Continuous batching in the embedded engine: a request arriving while others decode joins the running
batch at the next step (it does not wait for the longest one), and every request's logprobs still equal a
full forward pass, for the dense and the hybrid (Gated DeltaNet) model. With continuous_batching off, a
late request waits for the running wave (the old behaviour, kept as a switch)."""
import threading
import time

import pytest
import torch

from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.sampling import RequestSampling
from rollout_helpers import TINY, reference_logprobs
from test_rollout_hybrid import HYBRID


def _model(cfg):
    from megatron_rl.rollout.embedded_server import load_model

    model, _ = load_model(None, hf_config=cfg, device=torch.device("cpu"), dtype=torch.float32, init_seed=0)
    return model


def _sampling(n: int, seed: int) -> RequestSampling:
    return RequestSampling(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_new_tokens=n,
                           stop_token_ids=frozenset(), stop_strings=(), ignore_eos=True, seed=seed)


def _submit(engine, prompt, n, seed, done):
    ev = threading.Event()

    def on_done(out):
        done[tuple(prompt)] = (out, time.monotonic())
        ev.set()
    req = engine.new_request(prompt, _sampling(n, seed), return_logprob=True, on_done=on_done)
    engine.submit(req)
    return req, ev


@pytest.mark.parametrize("decode", ["slots", "dynamic"])
@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_late_requests_join_the_running_batch_with_exact_logprobs(cfg, decode):
    model = _model(cfg)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=8, gather_ms=0, decode=decode))
    engine.start()
    done: dict = {}
    try:
        long_a, ev_a = _submit(engine, [5, 17, 3, 9, 11], 150, 1, done)
        deadline = time.monotonic() + 60
        while len(long_a.tokens) < 10 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(long_a.tokens) >= 10 and not ev_a.is_set()
        late = [([200, 1, 2], 6, 2), ([42], 9, 3), ([7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], 4, 4)]
        events = [_submit(engine, p, n, seed, done)[1] for p, n, seed in late]
        for ev in events:
            assert ev.wait(60)
        assert not ev_a.is_set(), "the late short requests waited for the long one"
        assert ev_a.wait(120)
    finally:
        engine.shutdown()
    for prompt, n in [([5, 17, 3, 9, 11], 150)] + [(p, n) for p, n, _ in late]:
        out, _ = done[tuple(prompt)]
        lps = [lp for lp, _t, _ in out["meta_info"]["output_token_logprobs"]]
        assert len(out["output_ids"]) == n
        ref = reference_logprobs(model, prompt, out["output_ids"], 1.0)
        # the hybrid's decode runs GDN's recurrence, the reference its chunked form (see test_rollout_hybrid):
        # 3.6e-4 over this 150-token request, on both decode paths alike; a layout or padding bug is O(1)
        assert max(abs(a - b) for a, b in zip(ref, lps)) < (6e-4 if cfg is HYBRID else 1e-5), prompt


def test_without_continuous_batching_a_late_request_waits_for_the_wave():
    engine = EmbeddedEngine(_model(TINY), EmbeddedEngineConfig(max_batch_size=8, gather_ms=0,
                                                               continuous_batching=False))
    engine.start()
    done: dict = {}
    try:
        long_a, ev_a = _submit(engine, [5, 17, 3], 120, 1, done)
        while len(long_a.tokens) < 5:
            time.sleep(0.002)
        _, ev_b = _submit(engine, [9], 3, 2, done)
        assert ev_b.wait(60) and ev_a.is_set()
        assert done[(9,)][1] >= done[(5, 17, 3)][1]
    finally:
        engine.shutdown()
