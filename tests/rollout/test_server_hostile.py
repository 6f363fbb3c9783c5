"""The embedded engine's HTTP server against malformed and hostile requests, through the SGLang client.

Every bad request gets a 400-class answer whose message names the field (SGLang's wording where
SGLang has one), a legitimate edge case gets a normal answer, and nothing a request sends can stop
the engine serving the next one. A weight update whose names, shapes or dtypes do not fit the model
is refused whole: the old weights keep serving under the old version.
"""
import asyncio
import json
import math
from unittest import mock

import pytest
import torch
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request

from megatron_rl.rollout.client import EngineError
from megatron_rl.rollout.protocol import SamplingParams
from megatron_rl.sync.buckets import bucketize, flatten
from megatron_rl.sync.transport import ColocatedSender, ShmAllocator, encode_shm
from rollout_helpers import greedy_reference, run, served_fixture, tiny_model

PROMPT = [11, 22, 33, 44]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def shared():
    """One engine for the read-only cases (each bad request must leave it serving anyway)."""
    yield from served_fixture()


def _sp(**kw):
    return {"input_ids": [1, 2], "sampling_params": kw}


BAD_GENERATE = [
    ({"input_ids": [1], "sampling_params": 5}, "sampling_params must be a JSON object"),
    ({"input_ids": [[1], [2]], "sampling_params": [1, 2]}, "sampling_params must be a JSON object"),
    ({"input_ids": [1], "sampling_params": [{}, {}]}, "sampling_params has 2 entries for 1 prompts"),
    (_sp(max_new_tokens=-1), "max_new_tokens must be >= 0"),
    (_sp(max_new_tokens=math.inf), "max_new_tokens=inf is not an integer"),
    (_sp(max_new_tokens=2.5), "max_new_tokens=2.5 is not an integer"),
    # SGLang's answer to a completion that cannot fit: 400, not minutes of decoding cut at the context
    (_sp(max_new_tokens=10**12), "exceeds the model's maximum context length of 512 tokens"),
    ({"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 12}}, "500 tokens from the input"),
    ({"input_ids": [1] * 512}, "The input (512 tokens) is longer than the model's context length (512 tokens)"),
    (_sp(temperature=math.inf), "temperature must be a non-negative finite number"),
    (_sp(temperature=math.nan), "temperature is NaN"),
    (_sp(top_p=1.5), "top_p must be in (0, 1]"),
    (_sp(top_p=math.nan), "top_p is NaN"),
    (_sp(top_k=-5), "top_k must be -1 (disabled) or >= 1"),
    (_sp(top_k=1.5), "top_k=1.5 is not an integer"),
    (_sp(min_p=2), "min_p must be in [0, 1]"),
    (_sp(stop_token_ids=5), "stop_token_ids must be a list of ints"),
    (_sp(stop_token_ids=[1.5]), "stop_token_ids must be a list of ints"),
    (_sp(sampling_seed=2**70), "sampling_seed=1180591620717411303424 is outside"),
    (_sp(ignore_eos="no"), "ignore_eos='no' is not a boolean"),
    ({"input_ids": [1], "return_logprob": "no"}, "return_logprob must be a boolean"),
    ({"input_ids": [1], "rid": {"a": 1}}, "rid must be a string"),
    ({"input_ids": [1.5, 2]}, "input_ids must be integers"),
    ({"input_ids": [True, 2]}, "input_ids must be integers"),
    ({"input_ids": [-1, 2]}, "outside [0, 256)"),
    ({"input_ids": [2**70]}, "outside [0, 256)"),
    ({"input_ids": [[1, 2], []]}, "input_ids is empty"),
    ({"input_ids": "abc"}, "input_ids must be a non-empty list"),
    ({"input_ids": [1], "stream": True}, "stream=true is not supported"),
    ([1, 2, 3], "request body must be a JSON object"),
]


def test_bad_generate_requests_get_400_naming_the_field_and_the_engine_keeps_serving(shared):
    server, client, model = shared

    async def go():
        answers = []
        for payload, _ in BAD_GENERATE:
            try:
                await client.generate_raw(payload)
                answers.append(None)
            except EngineError as e:
                answers.append(e)
        return answers, await client.health(), await client.generate(PROMPT, GREEDY)

    answers, healthy, after = run(go())
    for (payload, needle), err in zip(BAD_GENERATE, answers):
        assert err is not None, f"accepted: {payload}"
        assert err.status == 400 and needle in err.server_message, (payload, err.status, err.server_message)
    assert healthy and after.token_ids == greedy_reference(model, PROMPT, 6)
    assert server.engine.is_idle()  # a refused batch left nothing running


def test_edge_values_sglang_accepts_are_served(shared):
    server, client, model = shared
    vocab = model.config.vocab_size

    def sp(**kw):
        return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, **kw}}

    async def go():
        greedy = await client.generate_raw(sp(temperature=0))
        # top_k beyond the vocabulary (even beyond int64) means "no top-k": same draw as top_k = vocab
        huge_k = await client.generate_raw(sp(top_k=10**30, sampling_seed=3))
        vocab_k = await client.generate_raw(sp(top_k=vocab, sampling_seed=3))
        no_k = await client.generate_raw(sp(top_k=-1, top_p=1.0, sampling_seed=3))
        seeds = [await client.generate_raw(sp(sampling_seed=s)) for s in (-1, 2**64 - 1)]
        exact_fit = await client.generate_raw({"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 11}})
        batch = await client.generate_raw({"input_ids": [[5], [5, 17, 3, 9, 200, 1], [42, 42]],
                                           "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
        null_params = await client.generate_raw({"input_ids": [1], "sampling_params": None})
        return greedy, huge_k, vocab_k, no_k, seeds, exact_fit, batch, null_params

    greedy, huge_k, vocab_k, no_k, seeds, exact_fit, batch, null_params = run(go())
    assert greedy["output_ids"] == greedy_reference(model, PROMPT, 5)
    assert huge_k["output_ids"] == vocab_k["output_ids"] and len(no_k["output_ids"]) == 5
    assert all(len(s["output_ids"]) == 5 for s in seeds)
    assert exact_fit["meta_info"]["completion_tokens"] == 11  # 500 + 11 < 512
    assert [b["output_ids"] for b in batch] == [greedy_reference(model, p, 4) for p in ([5], [5, 17, 3, 9, 200, 1],
                                                                                         [42, 42])]
    assert null_params["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("handler,body,needle", [
    ("generate", b"{not json", "request body is not valid JSON"),
    ("generate", b"\xff\xfe\x00", "request body is not valid JSON"),
    ("update_from_tensor", b"garbage", "request body is not valid JSON"),
    ("release_memory", b'{"tags": 5}', "tags must be null or a list of strings"),
    ("release_memory", b'{"tags": "weights"}', "tags must be null or a list of strings"),
    ("abort_request", b'{"rid": [1]}', "rid must be a string"),
    ("init_group", b'{"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2}',
     "master_port must be an integer"),
])
def test_bodies_the_client_cannot_send_are_refused_with_a_message(shared, handler, body, needle):
    """Non-JSON and mistyped bodies, fed to the handlers directly (the SGLang client only sends valid JSON)."""
    server, _, _ = shared

    async def call():
        payload = streams.StreamReader(mock.Mock(_reading_paused=False), limit=2**16, loop=asyncio.get_running_loop())
        payload.feed_data(body)
        payload.feed_eof()
        request = make_mocked_request("POST", "/", headers={"Content-Type": "application/json",
                                                           "Content-Length": str(len(body))}, payload=payload)
        return await getattr(server, handler)(request)

    resp = asyncio.run(call())
    assert resp.status == 400
    doc = json.loads(resp.text)
    assert needle in doc["message"]


def test_a_handler_bug_answers_json_with_the_error(served, monkeypatch):
    server, client, _ = served
    monkeypatch.setattr(server.engine, "load", mock.Mock(side_effect=RuntimeError("boom")))
    with pytest.raises(EngineError) as ei:
        run(client.get_server_info())
    assert ei.value.status == 500 and "RuntimeError: boom" in ei.value.server_message


def test_a_failing_wave_ends_its_own_requests_not_the_engine(served, monkeypatch):
    """A wave that raises aborts its requests with the error; the next request is served. Only failure
    after failure (a broken engine) stops the scheduler, and then /health says so."""
    from megatron_rl.rollout import embedded_engine

    server, client, model = served
    real_sample, calls = embedded_engine.sample, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected sampler failure")
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(embedded_engine, "sample", flaky)

    async def go():
        first = await client.generate_raw({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
        return first, await client.generate(PROMPT, GREEDY), await client.health()

    first, second, healthy = run(go())
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected sampler failure" in first["meta_info"]["finish_reason"]["message"]
    assert second.token_ids == greedy_reference(model, PROMPT, 6) and healthy

    monkeypatch.setattr(embedded_engine, "sample", mock.Mock(side_effect=RuntimeError("broken")))

    async def broken():
        for _ in range(embedded_engine.MAX_WAVE_FAILURES):
            out = await client.generate_raw({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
        await asyncio.sleep(0.2)
        return await client.health()

    assert run(broken()) is False


# ---------------------------------------------------------------------------------------------- weights

def _tensors(model):
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _payload(named, alloc):
    """One SGLang-style flattened-bucket entry (shared-memory variant), outside any staged update."""
    bucket = flatten(named, allocate=alloc)
    (dt, buf), = bucket.buffers.items()
    return encode_shm(alloc.path_of(buf), buf, bucket.metas)


def test_mismatched_weight_updates_are_refused_whole(served):
    """Names, shapes or dtypes that do not fit the model: refused, old weights and version kept; then a
    good update still applies (nothing was left half-staged)."""
    server, client, model = served
    new = tiny_model(seed=1)
    before = greedy_reference(model, PROMPT, 6)
    assert greedy_reference(new, PROMPT, 6) != before
    good = _tensors(new)
    alloc = ShmAllocator()
    bad_updates = {
        "unknown name": good[:3] + [("model.layers.7.mlp.up_proj.weight", good[0][1])],
        "wrong shape": good[:3] + [(good[3][0], torch.zeros(3, 5))],
    }

    async def go():
        errors = {}
        for what, named in bad_updates.items():
            with pytest.raises(EngineError) as ei:
                await client.update_weights_from_tensor([_payload(named, alloc)], load_format="flattened_bucket",
                                                        weight_version="9")
            errors[what] = ei.value
        ints = [(good[0][0], torch.zeros(good[0][1].shape, dtype=torch.int32))]
        with pytest.raises(EngineError) as ei:
            await client.update_weights_from_tensor([_payload(ints, alloc)], load_format="flattened_bucket",
                                                    weight_version="9")
        errors["int dtype"] = ei.value
        mid = (await client.generate(PROMPT, GREEDY), await client.get_weight_version())
        await client.update_weights_from_tensor([_payload(good, alloc)], load_format="flattened_bucket",
                                                weight_version="1")
        return errors, mid, await client.generate(PROMPT, GREEDY), await client.get_weight_version()

    try:
        errors, (mid_out, mid_version), after, version = run(go())
    finally:
        alloc.release_all()
    assert "model.layers.7.mlp.up_proj.weight" in str(errors["unknown name"])
    assert "does not match the model's" in str(errors["wrong shape"])
    assert "int32" in str(errors["int dtype"])
    assert all(e.status == 400 for e in errors.values())
    assert mid_out.token_ids == before and mid_version == "0"
    assert after.token_ids == greedy_reference(new, PROMPT, 6) and version == "1"


def test_a_bad_bucket_in_the_middle_of_a_staged_update_discards_the_update(served):
    """Buckets 0..k staged, bucket k+1 has a wrong shape: refused; the final bucket of the same update,
    arriving later, must not commit what is left (the declared tensor count no longer matches)."""
    server, client, model = served
    new = tiny_model(seed=1)
    before = greedy_reference(model, PROMPT, 6)
    tensors = _tensors(new)
    sender = ColocatedSender("cpu")
    from megatron_rl.rollout.engine import EngineGroupError, HttpEngine

    engine = HttpEngine(server.url)
    buckets = list(bucketize(tensors, cap_bytes=40_000, allocate=sender.allocator))
    assert len(buckets) >= 4
    name, t = buckets[1].named_tensors()[0]
    broken = flatten([(name, torch.zeros(t.numel() + 1))] + buckets[1].named_tensors()[1:], allocate=sender.allocator)

    async def go():
        await sender.send([engine], buckets[0], update_id="u", last_bucket=False, total_tensors=None,
                          weight_version="1")
        with pytest.raises(EngineGroupError) as ei:
            await sender.send([engine], broken, update_id="u", last_bucket=False, total_tensors=None,
                              weight_version="1")
        for b in buckets[2:-1]:
            await sender.send([engine], b, update_id="u", last_bucket=False, total_tensors=None, weight_version="1")
        with pytest.raises(EngineGroupError) as final:
            await sender.send([engine], buckets[-1], update_id="u", last_bucket=True, total_tensors=len(tensors),
                              weight_version="1")
        await sender.close([engine])
        return ei.value, final.value, await client.generate(PROMPT, GREEDY), await client.get_weight_version()

    err, final_err, out, version = run(go(), client, engine.client)
    assert name in str(err) and "shape" in str(err)
    assert "nothing was applied" in str(final_err)
    assert out.token_ids == before and version == "0"
