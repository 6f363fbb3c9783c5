"""The embedded engine's sampler: right distribution, filters respected, per-request reproducibility."""
import pytest
import torch

from megatron_rl.rollout.sampling import RequestSampling, draw, request_uniforms, sample, seed_tensor


def _gens(seeds, step=0):
    """Each row's uniform for its token number `step`, as the engine draws them."""
    seeds = list(seeds)
    return request_uniforms(seed_tensor(seeds, "cpu"), torch.full((len(seeds),), step))


def test_draw_follows_the_weights_and_never_picks_zero_weight_tokens():
    n = 20000
    weights = torch.tensor([[5.0, 3.0, 0.0, 2.0]]).expand(n, 4)
    tokens = draw(weights, _gens(range(n)))
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert freq[2] == 0
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.0, 0.2], dtype=torch.float64), atol=0.015), freq


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    alone = draw(logits[:1].softmax(-1), _gens([7]))
    batched = draw(logits.softmax(-1), _gens([7, 8, 9]))
    assert alone[0] == batched[0]


def test_filters_and_greedy_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 500)
    top2 = set(logits[1].topk(2).indices.tolist())
    params = [RequestSampling.from_sglang({"temperature": 0.0}),
              RequestSampling.from_sglang({"temperature": 1.0, "top_k": 2}),
              RequestSampling.from_sglang({"temperature": 1.0}),
              RequestSampling.from_sglang({"temperature": 0.7, "top_p": 0.5})]
    for seed in range(50):
        tokens, lps = sample(logits, params, _gens([seed] * 4, step=seed))
        assert tokens[0] == logits[0].argmax()
        assert int(tokens[1]) in top2
        # reported logprobs are the temperature-scaled ones before filtering (SGLang's semantics)
        assert torch.allclose(lps[1], torch.log_softmax(logits[1], -1)[tokens[1]])
        assert torch.allclose(lps[3], torch.log_softmax(logits[3] / 0.7, -1)[tokens[3]])


def test_request_uniforms_are_uniform_independent_and_depend_only_on_seed_and_step():
    n = 200_000
    seeds = seed_tensor([3] * n, "cpu")
    u = request_uniforms(seeds, torch.arange(n))
    assert u.dtype == torch.float64 and 0 <= float(u.min()) and float(u.max()) < 1
    # each decile holds a tenth (binomial sd ~0.0007 at this n) and neighbouring steps are uncorrelated
    deciles = torch.bincount((u * 10).long(), minlength=10).double() / n
    assert torch.allclose(deciles, torch.full((10,), 0.1, dtype=torch.float64), atol=0.004), deciles
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01
    # across seeds at one step, too (seed 0 included: no fixed point at zero); the whole seed range is valid,
    # and a seed means its 64 bits (-1 and 2**64 - 1 are one seed, as for torch.Generator.manual_seed)
    many = request_uniforms(seed_tensor(list(range(n)), "cpu"), torch.zeros(n, dtype=torch.long))
    assert abs(float(many.mean()) - 0.5) < 0.003 and float(many[0]) > 1e-3
    edge = request_uniforms(seed_tensor([-(2**63), -1, 0, 1, 2**63 - 1, 2**64 - 1], "cpu"), torch.zeros(6, dtype=torch.long))
    assert len(set(edge.tolist())) == 5 and edge[1] == edge[5]
    # a row's value does not depend on what else is computed with it
    assert request_uniforms(seeds[:1], torch.tensor([17]))[0] == u[17]


def test_uniforms_carry_53_random_bits():
    """Two independent hashes feed the 53 bits: a million seeds give a million distinct uniforms (with 32 bits of
    entropy about 116 would collide)."""
    n = 1_000_000
    u = request_uniforms(seed_tensor(list(range(n)), "cpu"), torch.full((n,), 7))
    assert u.unique().numel() == n


def test_an_unfiltered_request_draws_the_same_whatever_filtered_request_shares_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(2, 5000) * 3
    plain = RequestSampling.from_sglang({"temperature": 1.0})
    nucleus = RequestSampling.from_sglang({"temperature": 0.8, "top_p": 0.5, "top_k": 40})
    no_top_k = RequestSampling.from_sglang({"temperature": 1.0, "top_k": 2**40})   # above any vocabulary: no filter
    for seed in range(200):
        u = _gens([seed, seed + 1000], step=seed)
        alone, _ = sample(logits[:1], [plain], u[:1])
        mixed, _ = sample(logits, [plain, nucleus], u)
        assert alone[0] == mixed[0]
        assert sample(logits[:1], [no_top_k], u[:1])[0][0] == alone[0]


def _whole_row_draw(weights, uniforms):
    """The search `draw` replaced: one fp64 cumulative sum over the whole row."""
    cdf = weights.double().cumsum(dim=-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)
    bad = weights.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    return torch.where(bad, weights.argmax(dim=-1), idx)


def test_two_level_draw_finds_the_whole_row_searchs_token():
    from megatron_rl.rollout.sampling import DRAW_BLOCK

    g = torch.Generator().manual_seed(0)
    # below one block, a multiple of it, and a tail block (152k-like); peaked and flat rows; zeroed stretches,
    # including whole blocks and the tail
    for vocab in (7, DRAW_BLOCK, 3 * DRAW_BLOCK, 5 * DRAW_BLOCK + 389):
        rows = 600
        logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.1, 12, rows).unsqueeze(-1)
        weights = logits.softmax(-1)
        weights[::3, vocab // 3: vocab // 3 + DRAW_BLOCK + 5] = 0.0
        tail = vocab % DRAW_BLOCK if vocab > DRAW_BLOCK else 0
        weights[1::5, -(tail or 3):] = 0.0
        uniforms = _gens(range(rows), step=vocab)
        tokens = draw(weights, uniforms)
        assert torch.equal(tokens, _whole_row_draw(weights, uniforms)), vocab
        assert (weights.gather(-1, tokens[:, None]) > 0).all()
    # the edges of the unit interval
    weights = torch.rand(2, 5 * DRAW_BLOCK + 3, generator=g)
    weights[:, -1] = 0.0
    for u in (0.0, 1.0 - 2 ** -53):
        uniforms = torch.full((2,), u, dtype=torch.float64)
        assert torch.equal(draw(weights, uniforms), _whole_row_draw(weights, uniforms))


def test_draw_at_block_boundaries_stays_on_a_weighted_token_next_to_the_target():
    """Targets within a few ulp of a block's end, with zero-weight tokens around it: the token drawn has weight and
    its stretch of the CDF holds the target (the whole-row search's token, or a neighbour within rounding), never
    the row's argmax fallback."""
    import math

    from megatron_rl.rollout.sampling import DRAW_BLOCK

    g = torch.Generator().manual_seed(1)
    vocab = 4 * DRAW_BLOCK + 77
    for _ in range(20):
        w = torch.rand(1, vocab, generator=g) ** 8
        for b in range(1, vocab // DRAW_BLOCK + 1):
            w[0, b * DRAW_BLOCK - 3: b * DRAW_BLOCK + 3] = 0.0
        cdf = w.double().cumsum(-1)[0]
        total = cdf[-1].item()
        us = []
        for b in range(1, vocab // DRAW_BLOCK + 1):
            for k in range(-4, 5):
                t = cdf[b * DRAW_BLOCK - 1].item()
                for _ in range(abs(k)):
                    t = math.nextafter(t, math.inf if k > 0 else -math.inf)
                us.append(t / total)
        uniforms = torch.tensor(us, dtype=torch.float64)
        weights = w.expand(len(us), vocab)
        tokens, ref = draw(weights, uniforms), _whole_row_draw(weights, uniforms)
        assert (weights.gather(-1, tokens[:, None]) > 0).all()
        # the token's stretch of the whole-row CDF holds the target, up to a few ulp of the row's total (the old
        # fallback landed on the argmax, thousands of tokens away)
        target = uniforms * total
        lo = torch.where(tokens > 0, cdf[(tokens - 1).clamp(min=0)], torch.zeros_like(target))
        slack = 16 * math.ulp(total)
        assert ((lo - slack <= target) & (target <= cdf[tokens] + slack)).all()
        assert (tokens == ref).double().mean() > 0.5


@pytest.mark.gpu
def test_draw_on_cuda_inside_a_cuda_graph_matches_the_whole_row_search():
    """The two-level search as the slot decoder runs it: captured once in a CUDA graph, replayed on new weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 151936
    weights = torch.empty(rows, vocab, device="cuda")
    uniforms = torch.empty(rows, dtype=torch.float64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        weights.copy_(torch.randn(rows, vocab, generator=g).softmax(-1))
        uniforms.copy_(_gens(range(rows)))
        draw(weights, uniforms)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draw(weights, uniforms)
    for step in range(3):
        logits = torch.randn(rows, vocab, generator=g) * (1 + 4 * step)
        weights.copy_(logits.softmax(-1))
        uniforms.copy_(_gens(range(rows), step=step))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), _whole_row_draw(weights.cpu(), uniforms.cpu()))
