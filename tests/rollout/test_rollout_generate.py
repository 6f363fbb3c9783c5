"""The embedded engine through the HTTP client: batching, logprob parity, sampling, stop conditions."""
import asyncio

import pytest

from megatron_rl.rollout.client import EngineError
from megatron_rl.rollout.protocol import SamplingParams
from rollout_helpers import greedy_reference, reference_logprobs, run, start_server, tiny_model

PROMPTS = [[5, 17, 3], [9], [200, 1, 2, 3, 4, 5, 6, 7], [42, 42]]


def test_batched_logprobs_match_full_forward_at_temperature_one(served):
    """Concurrent requests of different lengths (left-padded into one wave, KV-cached decode) give the
    same per-token logprobs as a full forward pass over prompt + completion."""
    server, client, model = served

    async def go():
        return await asyncio.gather(*[
            client.generate(p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=100 + i))
            for i, p in enumerate(PROMPTS)])

    results = run(go())
    for p, r in zip(PROMPTS, results):
        assert r.finish_reason == "length" and len(r.token_ids) == 12 and r.prompt_tokens == len(p)
        ref = reference_logprobs(model, p, r.token_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(ref, r.logprobs)) < 1e-5


def test_logprob_semantics_temperature_scaled_before_filtering(served):
    """Reported logprob = log_softmax(logits / T) of the sampled token, before top-k/top-p filtering:
    with top_k=1 the tokens are the greedy ones but the logprobs are not 0."""
    server, client, model = served
    prompt = PROMPTS[0]
    greedy = greedy_reference(model, prompt, 8)
    r = run(client.generate(prompt, SamplingParams(temperature=0.5, top_k=1, max_new_tokens=8, seed=1)))
    assert r.token_ids == greedy
    ref = reference_logprobs(model, prompt, r.token_ids, 0.5)
    assert max(abs(a - b) for a, b in zip(ref, r.logprobs)) < 1e-5
    assert min(r.logprobs) < -1e-3  # not the filtered (renormalised, = 0) distribution

    # temperature 0 = greedy, reported under temperature 1
    g = run(client.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=8)))
    assert g.token_ids == greedy
    ref1 = reference_logprobs(model, prompt, greedy, 1.0)
    assert max(abs(a - b) for a, b in zip(ref1, g.logprobs)) < 1e-5


def test_greedy_and_seeded_sampling_are_reproducible(served):
    server, client, model = served
    sp = lambda seed: SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed)  # noqa: E731

    async def go():
        alone = await client.generate(PROMPTS[2], sp(7))
        batch = await asyncio.gather(client.generate(PROMPTS[2], sp(7)), client.generate(PROMPTS[2], sp(7)),
                                     client.generate(PROMPTS[2], sp(8)), client.generate(PROMPTS[1], sp(7)))
        g1 = await client.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_new_tokens=10))
        g2 = await client.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_new_tokens=10))
        return alone, batch, g1, g2

    alone, batch, g1, g2 = run(go())
    assert batch[0].token_ids == alone.token_ids == batch[1].token_ids
    assert batch[2].token_ids != alone.token_ids  # another seed, another sample
    assert g1.token_ids == g2.token_ids == greedy_reference(model, PROMPTS[3], 10)


def test_stop_token_and_length_finish_reasons(served):
    server, client, model = served
    greedy = greedy_reference(model, PROMPTS[0], 6)
    stop_tok = greedy[3]
    first = greedy.index(stop_tok)
    r = run(client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=50, stop_token_ids=[stop_tok])))
    assert r.finish_reason == "stop" and r.token_ids == greedy[:first + 1]  # the stop token is kept
    r = run(client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=4)))
    assert r.finish_reason == "length" and r.token_ids == greedy[:4]
    r = run(client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=0)))
    assert r.finish_reason == "length" and r.token_ids == []


def test_model_eos_stops_unless_ignore_eos():
    from megatron_rl.rollout.client import EngineClient

    base = tiny_model(0)
    first = greedy_reference(base, PROMPTS[0], 1)[0]
    model = tiny_model(0, eos_token_id=first)
    server = start_server(model)
    try:
        client = EngineClient(server.url)
        r = run(client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=5)), client)
        assert r.finish_reason == "stop" and r.token_ids == [first]
        r = run(client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)),
                client)
        assert r.finish_reason == "length" and len(r.token_ids) == 5
    finally:
        server.stop()


def test_raw_sglang_response_shape_and_batch_input(served):
    server, client, model = served
    out = run(client.generate_raw({"input_ids": [PROMPTS[0], PROMPTS[1]], "return_logprob": True,
                                   "sampling_params": {"temperature": 0, "max_new_tokens": 3}}))
    assert isinstance(out, list) and len(out) == 2
    meta = out[0]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3 and meta["weight_version"] == "0"
    assert [len(x) for x in meta["output_token_logprobs"]] == [3, 3, 3]
    lp, tok, text = meta["output_token_logprobs"][0]
    assert isinstance(lp, float) and tok == out[0]["output_ids"][0] and text is None


@pytest.mark.parametrize("payload,needle", [
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"input_ids": [1, 9999]}, "outside [0, 256)"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "hello"}, "tokenizer"),
    ({"sampling_params": {}}, "input_ids or text"),
    ({"input_ids": list(range(10)) * 60}, "context length"),
])
def test_bad_requests_get_400_naming_the_problem(served, payload, needle):
    server, client, model = served
    with pytest.raises(EngineError) as ei:
        run(client.generate_raw(payload))
    assert ei.value.status == 400 and needle in str(ei.value) and "/generate" in str(ei.value)


def test_client_error_for_unreachable_engine():
    from megatron_rl.rollout.client import ClientConfig, EngineClient, EngineConnectionError
    from megatron_rl.rollout.sglang_engine import free_port

    client = EngineClient(f"127.0.0.1:{free_port()}", ClientConfig(retries=2, backoff_s=0.01))
    with pytest.raises(EngineConnectionError, match="/get_weight_version"):
        run(client.get_weight_version(), client)
    assert run(client.health(), client) is False
