"""A group of requests sent at once (the agent loop's pattern) decodes as one wave, not 1 + the rest."""
import asyncio

from rollout_helpers import start_server, tiny_model


def _count_forwards(model):
    calls = {"n": 0}
    forward = model.forward

    def counted(*a, **k):
        ids = k.get("input_ids", a[0] if a else None)
        calls["n"] += int(ids is None or ids.shape[0] > 1)   # not the slot decoder's one-row layout probe
        return forward(*a, **k)

    model.forward = counted
    return calls


def _run_group(gather_ms: float, n: int = 6, new_tokens: int = 5) -> int:
    from megatron_rl.rollout.client import EngineClient
    from megatron_rl.rollout.protocol import SamplingParams

    model = tiny_model(0)
    calls = _count_forwards(model)
    server = start_server(model, max_batch_size=8, gather_ms=gather_ms)

    async def go():
        client = EngineClient(server.url)
        try:
            sp = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i, ignore_eos=True) for i in range(n)]
            outs = await asyncio.gather(*(client.generate([1 + i, 2, 3], sp[i]) for i in range(n)))
        finally:
            await client.close()
        assert all(len(o.token_ids) == new_tokens for o in outs)

    try:
        asyncio.run(go())
    finally:
        server.stop()
    return calls["n"]


def test_a_group_sent_at_once_decodes_as_one_wave():
    # one prefill + 4 decode steps for all six requests, and one more step launched before the stops were read back
    # (the overlapped schedule's, whose rows are discarded)
    assert _run_group(gather_ms=200.0) == 6

