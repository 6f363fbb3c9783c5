"""Per-dtype flattened buckets: exact round trips, the byte cap, and the shared-memory wire format."""
import os

import pytest
import torch

from megatron_rl.sync.buckets import FlatBucket, TensorMeta, bucketize, dtype_from_name, flatten
from megatron_rl.sync.transport import ShmAllocator, decode_payload, encode_shm


def _mixed_tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 10, generator=g)
    return [
        ("a.weight", torch.randn(4, 3, generator=g)),
        ("b.bf16", torch.randn(5, 7, generator=g).to(torch.bfloat16)),
        ("c.int", torch.randint(-2**40, 2**40, (9,), generator=g, dtype=torch.int64)),
        ("d.transposed", big.t()),                      # non-contiguous source
        ("e.scalar", torch.tensor(3.25)),               # 0-dim
        ("f.empty", torch.empty(0, 4)),                 # zero elements
        ("g.mask", torch.rand(11, generator=g) > 0.5),  # bool
        ("h.fp16", torch.tensor([float("nan"), float("inf"), -0.0, 65504.0], dtype=torch.float16)),
    ]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_round_trip_is_bitwise_exact_for_every_dtype():
    tensors = _mixed_tensors()
    bucket = flatten(tensors)
    assert set(bucket.buffers) == {torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16}
    assert all(b.dim() == 1 and b.is_contiguous() for b in bucket.buffers.values())
    back = bucket.named_tensors()
    assert [n for n, _ in back] == [n for n, _ in tensors]
    for (n, t), (_, u) in zip(tensors, back):
        assert u.dtype == t.dtype and u.shape == t.shape, n
        assert _bits(u) == _bits(t), n
    # offsets are per dtype buffer and tile it exactly
    for dt, buf in bucket.buffers.items():
        metas = bucket.metas_of(dt)
        assert sum(m.numel for m in metas) == buf.numel()
        assert [m.offset for m in metas] == [sum(x.numel for x in metas[:i]) for i in range(len(metas))]


def test_bucketize_respects_the_cap_and_keeps_order():
    tensors = [(f"w{i}", torch.full((256,), float(i))) for i in range(10)]  # 1 KiB each
    buckets = list(bucketize(iter(tensors), cap_bytes=3 * 1024))
    assert [len(b.metas) for b in buckets] == [3, 3, 3, 1]
    assert all(b.nbytes <= 3 * 1024 for b in buckets)
    names = [n for b in buckets for n in b.names]
    assert names == [n for n, _ in tensors]
    for b in buckets:
        for n, t in b.named_tensors():
            assert torch.equal(t, dict(tensors)[n])


def test_oversized_tensor_gets_its_own_bucket():
    tensors = [("small", torch.zeros(10)), ("huge", torch.zeros(1000)), ("tail", torch.zeros(10))]
    buckets = list(bucketize(tensors, cap_bytes=100))
    assert [b.names for b in buckets] == [["small"], ["huge"], ["tail"]]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="twice"):
        flatten([("x", torch.zeros(1)), ("x", torch.zeros(2))])
    with pytest.raises(ValueError, match="empty"):
        flatten([])
    with pytest.raises(TypeError, match="'w'"):
        list(bucketize([("w", [1, 2, 3])]))
    with pytest.raises(ValueError, match="complex"):
        flatten([("z", torch.zeros(2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("float128")
    with pytest.raises(ValueError, match="exceed"):
        FlatBucket({torch.float32: torch.zeros(4)}, [TensorMeta("x", torch.float32, (5,), 0, 5)]).named_tensors()


def test_shared_memory_payload_round_trip_and_release():
    tensors = _mixed_tensors()
    shm = ShmAllocator()
    bucket = flatten(tensors, allocate=shm)
    seen = {}
    for dt, buf in bucket.buffers.items():
        if buf.numel() == 0:
            continue
        path = shm.path_of(buf)
        assert os.path.exists(path) and os.path.getsize(path) == buf.numel() * buf.element_size()
        decoded = decode_payload(encode_shm(path, buf, bucket.metas_of(dt)), shm_dir=shm.dir)
        for n, t in decoded.tensors:
            seen[n] = t.clone()
    shm.release_all()
    assert not any(os.path.exists(p) for p in shm.paths.values())
    for n, t in tensors:
        if t.numel():
            assert _bits(seen[n]) == _bits(t), n
