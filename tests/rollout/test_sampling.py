"""The embedded engine's sampler: right distribution, filters respected, per-request reproducibility."""
import torch

from megatron_rl.rollout.sampling import RequestSampling, draw, sample


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


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
        tokens, lps = sample(logits, params, _gens([seed] * 4))
        assert tokens[0] == logits[0].argmax()
        assert int(tokens[1]) in top2
        # reported logprobs are the temperature-scaled ones before filtering (SGLang's semantics)
        assert torch.allclose(lps[1], torch.log_softmax(logits[1], -1)[tokens[1]])
        assert torch.allclose(lps[3], torch.log_softmax(logits[3] / 0.7, -1)[tokens[3]])
