"""Weight updates into the embedded engine over HTTP, through both transports, and their atomicity."""
import base64
import os
import pickle
import uuid

import pytest
import torch

from megatron_rl.rollout.client import EngineError
from megatron_rl.rollout.engine import EngineGroupError, HttpEngine
from megatron_rl.rollout.protocol import SamplingParams
from megatron_rl.sync.buckets import bucketize, flatten
from megatron_rl.sync.transport import ColocatedSender, DistributedSender, encode_shm
from megatron_rl.rollout.sglang_engine import free_port
from rollout_helpers import greedy_reference, reference_logprobs, run, tiny_model

PROMPT = [11, 22, 33, 44]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def _hf_tensors(model):
    return [(n, p.detach()) for n, p in model.named_parameters()]


async def _push(engine, sender, tensors, cap_bytes, version):
    """Send `tensors` as one atomic update, buckets in order (the final one carries the version)."""
    buckets = list(bucketize(tensors, cap_bytes=cap_bytes, allocate=sender.allocator))
    uid = uuid.uuid4().hex
    await sender.open([engine])
    try:
        for i, b in enumerate(buckets):
            await sender.send([engine], b, update_id=uid, last_bucket=i == len(buckets) - 1,
                              total_tensors=len(tensors), weight_version=version)
    finally:
        await sender.close([engine])
    return len(buckets)


def _check_now_serves(client, new_model):
    async def go():
        r = await client.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=6, seed=5))
        return await client.get_weight_version(), await client.generate(PROMPT, GREEDY), r

    version, greedy, sampled = run(go())
    assert greedy.token_ids == greedy_reference(new_model, PROMPT, 8)
    ref = reference_logprobs(new_model, PROMPT, sampled.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(ref, sampled.logprobs)) < 1e-5
    return version, greedy


@pytest.mark.parametrize("transport", ["colocated_shm", "distributed_gloo"])
def test_update_changes_outputs_and_bumps_version(served, transport):
    server, client, model = served
    new_model = tiny_model(seed=1)
    assert greedy_reference(new_model, PROMPT, 8) != greedy_reference(model, PROMPT, 8)
    engine = HttpEngine(server.url)
    sender = ColocatedSender("cpu") if transport == "colocated_shm" else \
        DistributedSender("127.0.0.1", free_port(), backend="gloo")
    n_buckets = run(_push(engine, sender, _hf_tensors(new_model), cap_bytes=40_000, version="1"), engine.client)
    assert n_buckets > 3  # a multi-bucket update
    version, greedy = _check_now_serves(client, new_model)
    assert version == "1" and greedy.weight_version == 1
    if transport == "colocated_shm":
        assert sender._shm.paths == {}  # every shared-memory file was unlinked after the engine answered


def test_a_first_collective_that_waits_for_every_rank_does_not_deadlock(served, monkeypatch):
    """NCCL creates its communicator on a group's first collective and blocks the launching thread until
    every rank has launched too. The engine launches its receive only after the trainer's HTTP request
    arrives, so the trainer must not launch on the event loop that sends that request. Here gloo gets the
    same first-collective rendezvous (through the group's store), so a launch that blocks the loop fails."""
    import time

    import torch.distributed as dist

    from megatron_rl.sync.transport import WeightUpdateGroup

    stock = WeightUpdateGroup.start_broadcast

    def nccl_like(self, tensor, src=0):
        if not getattr(self, "_communicator_ready", False):
            store = dist.PrefixStore("first-collective", self._store)
            store.add("arrived", 1)
            deadline = time.monotonic() + 20
            while int(store.add("arrived", 0)) < self.spec.world_size:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {self.rank}: the other ranks never launched the first collective")
                time.sleep(0.01)
            self._communicator_ready = True
        return stock(self, tensor, src)

    monkeypatch.setattr(WeightUpdateGroup, "start_broadcast", nccl_like)
    server, client, model = served
    new_model = tiny_model(seed=1)
    engine = HttpEngine(server.url)
    sender = DistributedSender("127.0.0.1", free_port(), backend="gloo")
    assert run(_push(engine, sender, _hf_tensors(new_model), cap_bytes=40_000, version="1"), engine.client) > 3
    version, _ = _check_now_serves(client, new_model)
    assert version == "1"


def test_buckets_before_the_final_one_change_nothing(served):
    server, client, model = served
    new_model = tiny_model(seed=1)
    engine = HttpEngine(server.url)
    sender = ColocatedSender("cpu")
    tensors = _hf_tensors(new_model)
    buckets = list(bucketize(tensors, cap_bytes=40_000, allocate=sender.allocator))
    before = greedy_reference(model, PROMPT, 8)

    async def go():
        uid = "update-A"
        for b in buckets[:-1]:  # everything but the last bucket
            await sender.send([engine], b, update_id=uid, last_bucket=False, total_tensors=None, weight_version="1")
        mid = (await client.generate(PROMPT, GREEDY), await client.get_weight_version())
        # a new update begins (e.g. the trainer retried): the unfinished one is discarded
        buckets2 = list(bucketize(tensors, cap_bytes=40_000, allocate=sender.allocator))
        for i, b in enumerate(buckets2):
            await sender.send([engine], b, update_id="update-B", last_bucket=i == len(buckets2) - 1,
                              total_tensors=len(tensors), weight_version="2")
        await sender.close([engine])  # the never-sent last bucket of update A
        return mid

    (mid_out, mid_version) = run(go(), client, engine.client)
    assert mid_out.token_ids == before and mid_version == "0"
    version, _ = _check_now_serves(client, new_model)
    assert version == "2"


def test_incomplete_or_invalid_updates_are_rejected_whole(served):
    server, client, model = served
    new_model = tiny_model(seed=1)
    engine = HttpEngine(server.url)
    sender = ColocatedSender("cpu")
    tensors = _hf_tensors(new_model)
    before = greedy_reference(model, PROMPT, 8)

    async def go():
        # 1) a bucket went missing in the middle: the final bucket declares more tensors than arrived
        buckets = list(bucketize(tensors, cap_bytes=40_000, allocate=sender.allocator))
        for b in buckets[:1] + buckets[2:-1]:  # bucket 1 is lost
            await sender.send([engine], b, update_id="u1", last_bucket=False, total_tensors=None, weight_version="1")
        with pytest.raises(EngineGroupError) as err1:
            await sender.send([engine], buckets[-1], update_id="u1", last_bucket=True, total_tensors=len(tensors),
                              weight_version="1")
        err1 = err1.value
        # 2) an unknown parameter name in the middle of an update
        bad = [(n, t) for n, t in tensors[:3]] + [("model.layers.99.mlp.up_proj.weight", tensors[0][1])]
        with pytest.raises(EngineGroupError) as err2:
            await sender.send([engine], flatten(bad, allocate=sender.allocator), update_id="u2", last_bucket=True,
                              total_tensors=4, weight_version="1")
        # 3) a wrong shape
        wrong = [(tensors[0][0], torch.zeros(3, 3))]
        with pytest.raises(EngineGroupError) as err3:
            await sender.send([engine], flatten(wrong, allocate=sender.allocator), update_id="u3", last_bucket=True,
                              total_tensors=1, weight_version="1")
        await sender.close([engine])  # the lost bucket 1
        return err1, err2.value, err3.value, await client.generate(PROMPT, GREEDY), await client.get_weight_version()

    err1, err2, err3, out, version = run(go(), client, engine.client)
    assert "declared with" in str(err1) and "nothing was applied" in str(err1)
    assert "model.layers.99.mlp.up_proj.weight" in str(err2)
    assert "shape" in str(err3)
    assert out.token_ids == before and version == "0"


def test_distributed_update_recovers_after_a_failed_group(served):
    """A trainer that vanishes before broadcasting leaves the engine serving the old weights."""
    server, client, model = served

    async def go():
        with pytest.raises(EngineError) as ei:
            await client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]],
                                                         group_name="nope", load_format="flattened_bucket")
        return ei.value, await client.get_weight_version()

    err, version = run(go())
    assert "does not exist" in str(err) and version == "0"


def test_hostile_payloads_are_refused(served, tmp_path):
    server, client, model = served

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/pwned",))

    evil = base64.b64encode(pickle.dumps({"flattened_tensor": Evil(), "metadata": []})).decode()
    secret = tmp_path / "mrl-wsync-secret"
    secret.write_bytes(b"\0" * 64)
    outside = encode_shm(str(secret), torch.zeros(16), flatten([("model.norm.weight", torch.zeros(16))]).metas)

    async def go():
        errs = []
        for payload in (evil, outside, "not base64!!"):
            with pytest.raises(EngineError) as ei:
                await client.update_weights_from_tensor([payload], load_format="flattened_bucket")
            errs.append(ei.value)
        return errs, await client.get_weight_version()

    errs, version = run(go())
    assert "not allowed" in str(errs[0]) and not (tmp_path / "pwned").exists()
    assert "not a weight-sync file" in str(errs[1])
    assert "base64" in str(errs[2])
    assert all(e.status == 400 for e in errs) and version == "0"


def test_a_refused_bucket_is_not_retried_and_the_engine_keeps_its_weights(served):
    """Names or shapes that do not fit the engine's model are refused (HTTP 400) whatever the attempt:
    WeightSync gives up after the first export instead of repeating it, and the engine keeps serving its
    previous weights under its previous version."""
    from megatron_rl.rollout.engine import EngineManager
    from megatron_rl.sync.weight_sync import WeightSync, WeightSyncConfig, WeightSyncError

    server, client, model = served
    before = run(client.get_weight_version())
    exports = []

    def export(dtype):
        exports.append(1)
        for name, t in _hf_tensors(tiny_model(seed=1)):
            yield name, (t[:-1] if name.endswith("embed_tokens.weight") else t)   # one row short

    sync = WeightSync(export, EngineManager([HttpEngine(server.url)]), WeightSyncConfig(max_attempts=3))
    try:
        with pytest.raises(WeightSyncError, match="not retried"):
            sync.sync()
    finally:
        sync.close()
    assert len(exports) == 1
    assert run(client.get_weight_version()) == before
    assert run(client.generate(PROMPT, GREEDY)).token_ids == greedy_reference(model, PROMPT, 8)
