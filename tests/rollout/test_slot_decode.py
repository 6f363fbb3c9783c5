"""The embedded engine's slot decoder (slot_decode.py): the same tokens and logprobs as the DynamicCache path and
as a full forward, through joins, leaves, slot moves, a length growth mid-run, a memory budget smaller than the
batch, and memory release; its decode attention equals transformers' SDPA."""
import logging
import sys
import threading
import time
import types

import pytest
import torch

from megatron_rl.rollout import embedded_engine
from megatron_rl.rollout.embedded_engine import (FLA_ROWS_PER_BLOCK, EmbeddedEngine, EmbeddedEngineConfig,
                                                 prefill_warm_shapes)
from megatron_rl.rollout.sampling import RequestSampling
from megatron_rl.rollout import slot_decode
from megatron_rl.rollout.slot_decode import (batch_buckets, compile_blocks, grouped_decode_sdpa, supports_slots,
                                             uncompile_blocks)
from rollout_helpers import TINY, reference_logprobs
from test_rollout_hybrid import HYBRID


def _model(cfg, **over):
    from megatron_rl.rollout.embedded_server import load_model

    model, _ = load_model(None, hf_config=dict(cfg, **over), device=torch.device("cpu"), dtype=torch.float32,
                          init_seed=0)
    return model


def _sampling(n, seed, temperature=1.0, **kw):
    return RequestSampling(temperature=temperature, top_p=kw.get("top_p", 1.0), top_k=-1, min_p=0.0, max_new_tokens=n,
                           stop_token_ids=kw.get("stop", frozenset()), stop_strings=(), ignore_eos=True, seed=seed)


def _generate(engine, jobs, stagger_s=0.0, shutdown=True, top_p=None, stop=None):
    """Submit (prompt, max_new, seed) jobs (optionally one by one while others run); outputs in job order.
    `top_p`: {job index: top_p} for requests that sample with a filter; `stop`: {job index: stop token ids}."""
    outs, events = {}, []
    engine.start()
    try:
        for i, (prompt, n, seed) in enumerate(jobs):
            ev = threading.Event()

            def done(o, i=i, ev=ev):
                outs[i] = o
                ev.set()
            sampling = _sampling(n, seed, top_p=(top_p or {}).get(i, 1.0), stop=(stop or {}).get(i, frozenset()))
            engine.submit(engine.new_request(prompt, sampling, return_logprob=True, on_done=done))
            events.append(ev)
            if stagger_s:
                ev.wait(stagger_s)
        for ev in events:
            assert ev.wait(120)
    finally:
        if shutdown:
            engine.shutdown()
    return [outs[i] for i in range(len(jobs))]


JOBS = [([5, 17, 3, 9, 11], 40, 1), ([200, 1, 2], 7, 2), ([42], 25, 3), (list(range(1, 30)), 12, 4),
        ([7, 7, 7], 1, 5), ([9, 8], 33, 6), ([100, 101, 102, 103], 18, 7)]


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_slots_match_dynamic_and_a_full_forward_through_joins_leaves_and_moves(cfg):
    """max_batch 3 with 7 requests of different lengths: requests queue, join as slots free up, and the last slot
    moves into every hole; every token and logprob equals the DynamicCache path's."""
    model = _model(cfg)
    kw = dict(max_batch_size=3, gather_ms=0)
    slots_engine = EmbeddedEngine(model, EmbeddedEngineConfig(decode="slots", **kw))
    slots = _generate(slots_engine, JOBS, stagger_s=0.01)
    dynamic_engine = EmbeddedEngine(model, EmbeddedEngineConfig(decode="dynamic", **kw))
    dynamic = _generate(dynamic_engine, JOBS, stagger_s=0.01)
    assert slots_engine.decode_info()["decode"] == "slots"
    # the engine's own accounting: every prompt prefilled once, every later token one decode row
    for engine in (slots_engine, dynamic_engine):
        st = engine.decode_info()["engine_stats"]
        assert st["prefill_requests"] == len(JOBS) and st["prefill_tokens"] == sum(len(p) for p, _, _ in JOBS)
        assert st["decode_rows"] == sum(n - 1 for _, n, _ in JOBS)
        assert 0 < st["decode_steps"] <= st["decode_rows"] and st["decode_s"] > 0 and st["prefill_s"] > 0
    tol = 6e-4 if cfg is HYBRID else 1e-5
    for (prompt, n, _), a, b in zip(JOBS, slots, dynamic):
        assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == n
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4
        ref = reference_logprobs(model, prompt, a["output_ids"])
        assert max(abs(x - y) for x, y in zip(ref, lp_a)) < tol, prompt


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_overlapped_decode_launches_the_next_step_first_and_changes_no_output(cfg):
    """overlap_decode: step k+1 is launched before step k's tokens are recorded. Through joins, leaves (the last
    slot, which the step in flight wrote, moves into each hole), stop tokens and a slot-length growth, every token
    and logprob equals the one-step-at-a-time path's (logprobs to rounding); rows computed for requests that had
    already stopped are counted as discarded, not as decoded."""
    model = _model(cfg)
    jobs = JOBS + [(list(range(10, 200)), 60, 8)]   # needs 250 tokens: the slots grow while others decode
    kw = dict(max_batch_size=3, gather_ms=0, decode="slots")
    plain = _generate(EmbeddedEngine(model, EmbeddedEngineConfig(overlap_decode=False, **kw)), jobs, 0.01)
    stop = {0: frozenset([plain[0]["output_ids"][9]]), 5: frozenset([plain[5]["output_ids"][20]])}
    runs = {}
    for overlap in (False, True):
        engine = EmbeddedEngine(model, EmbeddedEngineConfig(overlap_decode=overlap, **kw))
        launches = {"total": 0, "ahead": 0}
        step = engine._slots.step

        def counted_step(engine=engine, launches=launches, step=step):
            launches["total"] += 1
            launches["ahead"] += engine._inflight is not None   # the step before has not been recorded yet
            return step()
        engine._slots.step = counted_step
        runs[overlap] = (_generate(engine, jobs, 0.01, stop=stop), launches, engine.decode_info()["engine_stats"])
    (sync_out, sync_launches, sync_stats), (over_out, over_launches, over_stats) = runs[False], runs[True]
    assert sync_launches["ahead"] == 0 and over_launches["ahead"] >= over_launches["total"] // 2
    for a, b in zip(sync_out, over_out):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        # (a stopped request's extra row, and when the staggered requests join, change some steps' batch size, hence
        # the kernels' rounding; the bound of the slots-against-dynamic test above)
        lp_a, lp_b = ([x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in (a, b))
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4
    assert sync_out[0]["meta_info"]["finish_reason"]["type"] == "stop" and len(sync_out[0]["output_ids"]) <= 10
    assert over_stats["decode_rows"] == sync_stats["decode_rows"] == sum(len(o["output_ids"]) - 1 for o in sync_out)
    assert sync_stats["decode_rows_discarded"] == 0 and over_stats["decode_rows_discarded"] > 0


def test_an_abort_or_a_pause_meets_the_overlapped_step_recorded():
    """With a step in flight, an abort records it first (the request keeps every token it computed, a prefix of
    what it would have drawn), and a pause in place returns once the scheduler holds requests whose tokens are all
    recorded; after continuing they finish with the tokens they would have drawn without the pause."""
    model = _model(TINY)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=4, gather_ms=0, decode="slots"))
    full = _generate(engine, [([5, 6, 7], 500, 1), ([8, 9], 500, 2)], shutdown=False)
    step, stepped = engine._slots.step, threading.Event()

    def slow_step():   # 500 steps take seconds: the pause lands mid-run
        time.sleep(0.005)
        stepped.set()
        return step()
    engine._slots.step = slow_step
    outs, done = {}, {i: threading.Event() for i in range(2)}
    for i, (prompt, seed) in enumerate([([5, 6, 7], 1), ([8, 9], 2)]):
        engine.submit(engine.new_request(prompt, _sampling(500, seed), return_logprob=True,
                                         on_done=lambda o, i=i: (outs.__setitem__(i, o), done[i].set())))
    assert stepped.wait(60)
    engine.pause("in_place")   # returns once the scheduler holds
    held = [len(r.tokens) for r in engine._running]
    time.sleep(0.3)
    # held: the step that was in flight is recorded, and nothing is launched or recorded while paused
    assert engine._inflight is None and [len(r.tokens) for r in engine._running] == held
    engine.abort(engine._running[0].rid)
    engine.continue_generation()
    assert done[0].wait(60) and done[1].wait(60)
    engine.shutdown()
    aborted = outs[0]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["output_ids"] == full[0]["output_ids"][: len(aborted["output_ids"])]
    assert outs[1]["output_ids"] == full[1]["output_ids"]


def test_filtered_and_unfiltered_requests_decode_together():
    """A top-p request in the batch: the step's in-graph unfiltered draw is replaced by the filtered one for the
    whole batch; every request still draws what the dynamic path draws, and top-p tokens stay inside the nucleus."""
    model = _model(TINY)
    kw = dict(max_batch_size=4, gather_ms=0)
    top_p = {1: 0.5, 3: 0.8}
    a = _generate(EmbeddedEngine(model, EmbeddedEngineConfig(decode="slots", **kw)), JOBS, 0.01, top_p=top_p)
    b = _generate(EmbeddedEngine(model, EmbeddedEngineConfig(decode="dynamic", **kw)), JOBS, 0.01, top_p=top_p)
    for (prompt, n, _), x, y in zip(JOBS, a, b):
        assert x["output_ids"] == y["output_ids"] and len(x["output_ids"]) == n
    prompt, _, _ = JOBS[1]
    with torch.no_grad():
        for i, tok in enumerate(a[1]["output_ids"]):
            probs = model(torch.tensor([prompt + a[1]["output_ids"][:i]])).logits[0, -1].softmax(-1)
            sorted_p, idx = probs.sort(descending=True)
            nucleus = idx[: int((sorted_p.cumsum(0) - sorted_p < 0.5).sum())].tolist()
            assert tok in nucleus


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_a_longer_request_grows_the_slots_while_others_decode(cfg):
    model = _model(cfg)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=4, gather_ms=0, decode="slots"))
    short = ([3, 1, 4], 120, 11)                       # needs 123 tokens: slots of 256
    long = (list(range(10, 200)), 150, 12)             # needs 340 tokens: grows to 512 while `short` runs
    outs = _generate(engine, [short, long], stagger_s=0.05)
    info = engine.decode_info()
    assert info["resizes"] >= 1 and info["max_len"] >= 340
    for (prompt, n, _), out in zip([short, long], outs):
        assert len(out["output_ids"]) == n
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        ref = reference_logprobs(model, prompt, out["output_ids"])
        assert max(abs(x - y) for x, y in zip(ref, lps)) < (6e-4 if cfg is HYBRID else 3e-5)  # fp32, 340 tokens


def test_a_memory_budget_smaller_than_the_batch_queues_requests_and_refuses_what_never_fits():
    model = _model(TINY)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=8, gather_ms=0, decode="slots"))
    # TINY holds 2 layers x 2 KV heads x (16 + 16) x 4 bytes = 512 bytes per token; 256-token slots = 128 KiB each
    engine._slots.cpu_budget_bytes = 3 * 256 * 512
    jobs = [([i + 1, 2, 3], 30, i) for i in range(6)]
    outs = _generate(engine, jobs)
    assert engine.decode_info()["slots"] == 3
    for (prompt, n, _), out in zip(jobs, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == n
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(reference_logprobs(model, prompt, out["output_ids"]), lps)) < 1e-5
    # a request longer than the whole budget is refused with a reason, and the engine keeps serving
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=8, gather_ms=0, decode="slots"))
    engine._slots.cpu_budget_bytes = 300 * 512
    too_long, fine = _generate(engine, [([1, 2, 3], 400, 0), ([4, 5], 20, 1)], stagger_s=0.5)
    assert too_long["meta_info"]["finish_reason"]["type"] == "abort"
    assert "KV cache memory budget" in too_long["meta_info"]["finish_reason"]["message"]
    assert len(fine["output_ids"]) == 20


def test_releasing_the_kv_cache_frees_the_slots_and_the_next_request_reallocates():
    model = _model(HYBRID)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=4, gather_ms=0, decode="slots"))
    first = _generate(engine, [([5, 6, 7], 10, 1)], shutdown=False)
    assert engine.decode_info()["slots"] > 0
    engine.release_memory(["kv_cache"])
    assert engine.decode_info()["slots"] == 0 and not engine._slots.allocated
    engine.resume_memory(["kv_cache"])
    again = _generate(engine, [([5, 6, 7], 10, 1)])
    assert again[0]["output_ids"] == first[0]["output_ids"]   # same seed, same tokens after reallocation


@pytest.mark.parametrize("decode", ["slots", "dynamic"])
def test_a_slow_prefill_is_logged_with_its_shape(decode, monkeypatch, caplog):
    """Per-rollout sums hide one slow forward; the engine names each one over the threshold with its batch shape."""
    monkeypatch.setattr(embedded_engine, "SLOW_PREFILL_S", 0.0)
    engine = EmbeddedEngine(_model(TINY), EmbeddedEngineConfig(max_batch_size=4, gather_ms=0, decode=decode))
    with caplog.at_level(logging.INFO, logger=embedded_engine.__name__):
        _generate(engine, [([5, 6, 7], 3, 1)])
    assert "slow prefill: 1 requests x 3 tokens (left-padded)" in caplog.text


@pytest.mark.parametrize("key_heads,value_heads,max_tokens,context", [(16, 32, 16384, 32768), (16, 32, 16384, 4096),
                                                                    (16, 48, 5000, 1000), (4, 4, 300, 4096), (2, 1, 8, 5)])
def test_the_prefill_warm_up_meets_every_key_fla_autotunes_on(key_heads, value_heads, max_tokens, context):
    """Every prefill chunk of up to `max_tokens` padded tokens and up to max_batch rows has its NB bucket (fla's
    norm kernels, key and value heads) and its row count (fla's chunk cumsum) met by one of the warm-up's
    shapes, none longer than the context; attention-only models get no warm-up."""
    hybrid = types.SimpleNamespace(layer_types=["linear_attention", "full_attention"],
                                   linear_num_key_heads=key_heads, linear_num_value_heads=value_heads)
    shapes = prefill_warm_shapes(hybrid, max_tokens=max_tokens, context_length=context, max_batch=32)
    assert all(1 <= n < context for _, n in shapes) and len(set(shapes)) == len(shapes)
    assert max(r * n for r, n in shapes) <= max_tokens

    def nb(tokens, heads):
        return -(-tokens * heads // FLA_ROWS_PER_BLOCK)
    for heads in (key_heads, value_heads):
        met = {nb(r * n, heads) for r, n in shapes}
        assert {nb(n, heads) for n in range(1, max_tokens + 1)} <= met
    assert {r for r, _ in shapes} >= set(range(1, min(32, max_tokens) + 1))
    multimodal = types.SimpleNamespace(get_text_config=lambda: hybrid)
    assert prefill_warm_shapes(multimodal, max_tokens=max_tokens, context_length=context, max_batch=32) == shapes
    dense = types.SimpleNamespace(layer_types=["full_attention"])
    assert prefill_warm_shapes(dense, max_tokens=max_tokens, context_length=context, max_batch=32) == []
    assert prefill_warm_shapes(hybrid, max_tokens=max_tokens, context_length=1, max_batch=32) == []


def test_decode_choice_is_validated():
    model = _model(TINY)
    with pytest.raises(ValueError, match="decode must be one of"):
        EmbeddedEngine(model, EmbeddedEngineConfig(decode="paged"))
    with pytest.raises(ValueError, match="kv_cache_fraction"):
        EmbeddedEngine(model, EmbeddedEngineConfig(kv_cache_fraction=0.0))
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        EmbeddedEngine(_model(HYBRID), EmbeddedEngineConfig(compile_decode=True))
    sliding = _model(TINY, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert supports_slots(sliding) is not None
    with pytest.raises(ValueError, match="cannot serve this model"):
        EmbeddedEngine(sliding, EmbeddedEngineConfig(decode="slots"))
    assert EmbeddedEngine(sliding, EmbeddedEngineConfig()).decode_info()["decode"] == "dynamic"
    # the flag on, but max_window_layers past the last layer: transformers windows no layer, so slots serve it
    unwindowed = _model(TINY, use_sliding_window=True, sliding_window=16, max_window_layers=99)
    assert set(unwindowed.config.layer_types) == {"full_attention"} and supports_slots(unwindowed) is None


def test_grouped_decode_attention_equals_sdpa_with_repeated_kv():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)

    class Attn(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True

    b, hkv, length, d = 3, 2, 37, 16
    q = torch.randn(b, hkv * 4, 1, d)
    k, v = torch.randn(b, hkv, length, d), torch.randn(b, hkv, length, d)
    lengths = torch.tensor([5, 37, 20])
    mask = (torch.arange(length).view(1, -1) < lengths.view(-1, 1)).view(b, 1, 1, length)
    ours, _ = grouped_decode_sdpa(Attn(), q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.25)
    assert ours.shape == ref.shape == (b, 1, hkv * 4, d)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # a longer query goes to transformers' own path unchanged
    q3 = torch.randn(b, hkv * 4, 3, d)
    mask3 = torch.ones(b, 1, 3, length, dtype=torch.bool)
    torch.testing.assert_close(grouped_decode_sdpa(Attn(), q3, k, v, mask3)[0], sdpa_attention_forward(Attn(), q3, k, v, mask3)[0])


def _varlen_reference(q, k, v, *, cu_seq_q, cu_seq_k, max_k, seqused_k, scale):
    """Flash varlen semantics in plain torch: sequence i is query row i and K/V rows cu_seq_k[i] onwards, of which
    seqused_k[i] are read; GQA by head groups. Stands in for the GPU kernel on the CPU."""
    n, hq, d = q.shape
    assert cu_seq_q.dtype == cu_seq_k.dtype == seqused_k.dtype == torch.int32
    assert cu_seq_q.tolist() == list(range(n + 1)) and seqused_k.shape == (n,)
    assert all(int(cu_seq_k[i + 1] - cu_seq_k[i]) == max_k for i in range(n))
    out = []
    for i in range(n):
        start, used = int(cu_seq_k[i]), int(seqused_k[i])
        assert 1 <= used <= max_k
        ks, vs = k[start:start + used], v[start:start + used]
        groups = hq // ks.shape[1]
        ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].float(), ks.float()) * (scale or d ** -0.5), dim=-1)
        out.append(torch.einsum("hl,lhd->hd", p, vs.float()))
    return torch.stack(out).to(q.dtype)


def test_varlen_decode_attention_reads_each_rows_length_of_the_token_major_slots(monkeypatch):
    """The flash branch's packing (slot buffers `[slots, len, heads, dim]` viewed as `[n, heads, len, dim]`, the
    `[3, n + 1]` int32 mask) gives SDPA's answer under the equivalent boolean mask."""
    monkeypatch.setattr(slot_decode, "varlen_attention", _varlen_reference)
    torch.manual_seed(0)

    class Attn(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True

    n, hkv, length, d = 3, 2, 37, 16
    keys, values = torch.randn(5, length, hkv, d), torch.randn(5, length, hkv, d)
    q = torch.randn(n, hkv * 4, 1, d)
    used = torch.tensor([5, 37, 20], dtype=torch.int32)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    varlen = torch.stack([torch.cat([used, used.new_ones(1)]), offsets, offsets * length])
    k, v = keys[:n].transpose(1, 2), values[:n].transpose(1, 2)
    ours, _ = grouped_decode_sdpa(Attn(), q, k, v, varlen, scaling=0.25)
    mask = (torch.arange(length).view(1, -1) < used.view(-1, 1)).view(n, 1, 1, length)
    ref, _ = grouped_decode_sdpa(Attn(), q, k.contiguous(), v.contiguous(), mask, scaling=0.25)
    assert ours.shape == ref.shape == (n, 1, hkv * 4, d)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_the_varlen_decode_path_gives_the_dynamic_paths_tokens(cfg, monkeypatch):
    """The engine's flash-varlen decode (forced on the CPU with a torch stand-in for the kernel) through joins,
    leaves, slot moves and a length growth: the DynamicCache path's tokens and logprobs."""
    monkeypatch.setattr(slot_decode, "varlen_attention", _varlen_reference)
    model = _model(cfg)
    kw = dict(max_batch_size=3, gather_ms=0)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(decode="slots", **kw))
    assert engine._slots.flash_reason == "not on a CUDA device"
    engine._slots.flash = True
    jobs = JOBS + [([(7 * i) % 250 + 1 for i in range(290)], 20, 8)]   # grows the slots past one length quantum
    varlen = _generate(engine, jobs, stagger_s=0.01)
    assert engine.decode_info()["resizes"] >= 1 and engine.decode_info()["decode_attention"] == "flash varlen"
    dynamic = _generate(EmbeddedEngine(model, EmbeddedEngineConfig(decode="dynamic", **kw)), jobs, stagger_s=0.01)
    for (prompt, n, _), a, b in zip(jobs, varlen, dynamic):
        assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == n
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_compiled_blocks_share_one_graph_per_shape_across_layers_and_give_the_same_logits(cfg):
    """`compile_blocks` compiles norm and MLP blocks once per class and shape, not once per layer (the frame count
    is the same for 4 and 8 layers), with RoPE's function in transformers' module, the logits do not change, and
    `uncompile_blocks` restores the class forwards and the function."""
    from torch._dynamo.testing import CompileCounter

    frames = {}
    for layers in (4, 8):
        torch._dynamo.reset()
        model = _model(cfg, num_hidden_layers=layers)
        rope = sys.modules[type(model).__module__].apply_rotary_pos_emb
        blocks = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
        inputs = [torch.randint(1, 200, shape) for shape in ((3, 9), (1, 1), (4, 1), (5, 1), (2, 7))]
        with torch.no_grad():
            eager = [model(ids).logits for ids in inputs]
            counter = CompileCounter()
            assert compile_blocks(model, backend=counter) == len(blocks) + 1 and len(blocks) >= 3 * layers
            compiled = [model(ids).logits for ids in inputs]
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        frames[layers] = counter.frame_count
        uncompile_blocks(model)
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert sys.modules[type(model).__module__].apply_rotary_pos_emb is rope
    assert 0 < frames[4] == frames[8] <= 24, frames


def test_compile_blocks_leaves_a_forward_someone_else_put_on_an_instance():
    """A block whose instance already has its own forward (an accelerate hook) keeps it through compile_blocks and
    uncompile_blocks; the others are compiled, and compiling twice rebinds ours."""
    from torch._dynamo.testing import CompileCounter

    model = _model(TINY)
    hooked = model.model.norm
    own = hooked.forward = lambda x: x
    n = compile_blocks(model, backend=CompileCounter())
    blocks = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    assert hooked.forward is own and n == len(blocks) - 1 + 1   # all blocks but the hooked one, and RoPE's function
    assert compile_blocks(model, backend=CompileCounter()) == n
    uncompile_blocks(model)
    assert hooked.forward is own and sum("forward" in m.__dict__ for m in model.modules()) == 1


def test_batch_buckets_cover_every_batch_size():
    for max_batch in (1, 3, 8, 33, 64, 100, 256, 300):
        buckets = batch_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
        assert all(any(b >= n for b in buckets) for n in range(1, max_batch + 1))
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 24]


@pytest.mark.slow
def test_compiled_decode_matches_eager_and_compiles_once_for_every_batch_size_above_one():
    """torch.compile of the slot step (dense models): the same tokens as the eager step, and the first compile
    (batch 2, equal to TINY's KV heads: duck sizing would tie the two and compile again at batch 3) serves every
    batch size above one (on the H200 each compile of the 8B step takes ~40 s)."""
    from torch._dynamo.utils import counters

    model = _model(TINY)
    kw = dict(max_batch_size=8, gather_ms=50, decode="slots")
    compiled = EmbeddedEngine(model, EmbeddedEngineConfig(compile_decode=True, **kw))
    eager = EmbeddedEngine(model, EmbeddedEngineConfig(**kw))
    graphs = []
    for n in (2, 3, 5, 8, 3):
        # the last wave asks for 300 tokens: the slots grow past one length quantum (a reallocation)
        jobs = [([i + 1, 2, 3], 6 if len(graphs) < 4 else 300, i) for i in range(n)]
        a = _generate(compiled, jobs, shutdown=False)
        graphs.append(counters["stats"]["unique_graphs"])
        b = _generate(eager, jobs, shutdown=False)
        for x, y in zip(a, b):
            assert x["output_ids"] == y["output_ids"]
            lx = [v[0] for v in x["meta_info"]["output_token_logprobs"]]
            ly = [v[0] for v in y["meta_info"]["output_token_logprobs"]]
            assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4
    compiled.shutdown()
    eager.shutdown()
    assert graphs[1:] == [graphs[0]] * 4, graphs
    assert compiled.decode_info()["compiled"] and compiled.decode_info()["max_len"] > 256
    # with CUDA graphs, one row decodes in the batch-2 graph: batch 1 would be dynamo's one specialised compile
    slots = compiled._slots
    slots.cuda_graphs, slots._min_bucket = True, 2
    assert [slots.bucket(n) for n in (1, 2, 3)] == [2, 2, 4]


def test_a_longer_request_that_would_shrink_the_slots_below_a_chunk_waits_for_room():
    """4 slots fit at 256 tokens but only 2 at 512: a 512-token request arriving with three short ones must not
    shrink the slots under the three already taken (it waits, then runs alone)."""
    model = _model(TINY)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=8, gather_ms=50, decode="slots"))
    engine._slots.cpu_budget_bytes = 4 * 256 * 512
    jobs = [([1, 2, 3], 20, 1), ([4, 5], 20, 2), ([6], 20, 3), (list(range(1, 100)), 400, 4)]
    outs = _generate(engine, jobs)
    for (prompt, n, _), out in zip(jobs, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == n, out["meta_info"]
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(reference_logprobs(model, prompt, out["output_ids"]), lps)) < 3e-5


@pytest.mark.parametrize("cfg", [TINY, HYBRID], ids=["dense", "hybrid"])
def test_warm_up_serves_one_request_and_leaves_the_seed_stream_alone(cfg):
    """The server's start-up request (SGLang's warm-up): one prefill and a few decode steps, through the path
    the engine serves with; a seeded engine then answers exactly as one that was never warmed up."""
    model = _model(cfg)
    warm = EmbeddedEngine(model, EmbeddedEngineConfig(seed=7, gather_ms=0))
    assert warm.warm_up(timeout_s=120) > 0
    st = warm.decode_info()["engine_stats"]
    assert st["prefill_requests"] == 1 and st["decode_rows"] == 3
    cold = EmbeddedEngine(model, EmbeddedEngineConfig(seed=7, gather_ms=0))

    def unseeded(engine):
        outs, ev = {}, threading.Event()
        sampling = _sampling(6, None)
        engine.start()
        try:
            engine.submit(engine.new_request([3, 1, 4, 1, 5], sampling, return_logprob=True,
                                             on_done=lambda o: (outs.update(o), ev.set())))
            assert ev.wait(120)
        finally:
            engine.shutdown()
        return outs["output_ids"]

    assert unseeded(warm) == unseeded(cold)
