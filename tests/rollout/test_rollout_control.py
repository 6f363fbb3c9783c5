"""SGLang control semantics of the embedded engine: pause/continue, flush, abort, memory release."""
import asyncio

import pytest

from megatron_rl.rollout.client import EngineError
from megatron_rl.rollout.protocol import SamplingParams
from rollout_helpers import greedy_reference, run

LONG = SamplingParams(temperature=1.0, max_new_tokens=400, seed=3, ignore_eos=True)


async def _wait_load(client, key, n, timeout=60.0):
    """Poll /get_server_info until `key` (running|waiting) reaches n."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        info = await client.get_server_info()
        if info[key] == n:
            return info
        await asyncio.sleep(0.02)
    raise AssertionError(f"{key} never reached {n}: {info}")


def test_pause_abort_ends_running_and_queues_new_until_continue(served):
    server, client, model = served

    async def go():
        running = asyncio.create_task(client.generate([1, 2, 3], LONG))
        await _wait_load(client, "running", 1)
        await client.pause_generation("abort")
        aborted = await running
        queued = asyncio.create_task(client.generate([4, 5], SamplingParams(temperature=0.0, max_new_tokens=3)))
        info = await _wait_load(client, "waiting", 1)
        assert info["paused"] == "abort" and not queued.done()
        with pytest.raises(EngineError) as ei:  # a waiting request means not idle
            await client.flush_cache()
        assert ei.value.status == 400 and "/flush_cache" in str(ei.value)
        await client.continue_generation()
        return aborted, await queued

    aborted, done = run(go())
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 400
    assert len(aborted.logprobs) == len(aborted.token_ids)
    assert done.finish_reason == "length" and done.token_ids == greedy_reference(model, [4, 5], 3)


def test_pause_in_place_freezes_then_resumes_to_completion(served):
    server, client, model = served
    sp = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)

    async def go():
        task = asyncio.create_task(client.generate([7, 8, 9], sp))
        await _wait_load(client, "running", 1)
        await client.pause_generation("in_place")
        info = await client.get_server_info()
        assert info["paused"] == "in_place" and info["running"] == 1 and not task.done()
        with pytest.raises(EngineError) as ei:  # not idle: SGLang answers 400
            await client.flush_cache()
        assert ei.value.status == 400
        await client.continue_generation()
        return await task

    r = run(go())
    assert r.finish_reason == "length" and len(r.token_ids) == 300
    assert r.token_ids[:20] == greedy_reference(model, [7, 8, 9], 20)


def test_flush_while_busy_is_refused_and_retry_succeeds_when_idle(served):
    server, client, model = served

    async def go():
        task = asyncio.create_task(client.generate([1], SamplingParams(temperature=0.0, max_new_tokens=150,
                                                                        ignore_eos=True)))
        await _wait_load(client, "running", 1)
        with pytest.raises(EngineError) as ei:
            await client.flush_cache()
        await client.flush_cache(retries=200, interval_s=0.05)  # succeeds once the request finished
        return ei.value, await task

    err, r = run(go())
    assert err.status == 400 and "running" in err.server_message
    assert r.finish_reason == "length"


def test_abort_request_by_rid(served):
    server, client, model = served

    async def go():
        task = asyncio.create_task(client.generate([1, 2], LONG, rid="victim"))
        await _wait_load(client, "running", 1)
        await client.abort_request(rid="victim")
        return await task

    r = run(go())
    assert r.finish_reason == "abort" and len(r.token_ids) < 400


def test_release_and_resume_memory(served):
    server, client, model = served
    sp = SamplingParams(temperature=0.0, max_new_tokens=5)

    async def go():
        before = await client.generate([3, 1, 4], sp)
        await client.release_memory_occupation(["weights"])
        await client.release_memory_occupation(["weights"])  # idempotent
        with pytest.raises(EngineError) as ei:
            await client.generate([3, 1, 4], sp)
        assert ei.value.status == 400 and "released" in str(ei.value)
        with pytest.raises(EngineError) as bad:
            await client.release_memory_occupation(["gpu_everything"])
        assert "gpu_everything" in str(bad.value)
        assert (await client.get_server_info())["released"] == ["weights"]
        await client.resume_memory_occupation(["weights"])
        await client.release_memory_occupation(None)  # all tags
        assert set((await client.get_server_info())["released"]) == {"weights", "kv_cache", "cuda_graph"}
        await client.resume_memory_occupation(None)
        assert await client.health_generate()
        return before, await client.generate([3, 1, 4], sp)

    before, after = run(go())
    assert before.token_ids == after.token_ids


def test_release_refused_while_busy(served):
    server, client, model = served

    async def go():
        task = asyncio.create_task(client.generate([1], SamplingParams(temperature=0.0, max_new_tokens=200,
                                                                        ignore_eos=True)))
        await _wait_load(client, "running", 1)
        with pytest.raises(EngineError) as ei:
            await client.release_memory_occupation(["kv_cache"])
        await client.abort_request(abort_all=True)
        await task
        return ei.value

    err = run(go())
    assert err.status == 400 and "running" in str(err)


def test_an_answered_request_leaves_the_engine_idle_before_its_wave_ends(monkeypatch):
    """Requests are answered as they finish, before their wave's bookkeeping ends: a client that has its
    answer must be able to release memory or flush at once (it raced in the full suite before)."""
    import threading

    from megatron_rl.rollout.client import EngineClient
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine
    from rollout_helpers import start_server, tiny_model

    wave_done, hold = threading.Event(), threading.Event()
    real = EmbeddedEngine._run_wave

    def slow_wave_end(self, wave):
        real(self, wave)
        wave_done.set()
        hold.wait(30)                    # the wave's requests are answered; the wave itself has not ended

    monkeypatch.setattr(EmbeddedEngine, "_run_wave", slow_wave_end)
    server = start_server(tiny_model(0), max_batch_size=8)
    client = EngineClient(server.url)

    async def go():
        try:
            await client.generate([3, 1, 4], SamplingParams(temperature=0.0, max_new_tokens=5))
            assert wave_done.wait(30) and not hold.is_set()
            assert (await client.get_server_info())["running"] == 0
            await client.flush_cache()
            await client.release_memory_occupation(["kv_cache"])
            await client.resume_memory_occupation(["kv_cache"])
        finally:
            hold.set()
            await client.close()

    try:
        run(go())
    finally:
        hold.set()
        server.stop()
