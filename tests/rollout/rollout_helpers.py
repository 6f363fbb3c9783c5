"""Helpers for the rollout and sync tests: a tiny random Qwen3 served by the embedded engine over real HTTP."""
import asyncio

import torch

TINY = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None,
            tie_word_embeddings=False)


def tiny_model(seed: int = 0, **overrides):
    """fp32 random Qwen3; a large init std makes the next-token distribution peaked (greedy is meaningful)."""
    from megatron_rl.rollout.embedded_server import load_model

    cfg = dict(TINY, **overrides)
    model, _ = load_model(None, hf_config=cfg, device=torch.device("cpu"), dtype=torch.float32, init_seed=seed)
    return model


def start_server(model, **engine_kw):
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import EmbeddedServer

    server = EmbeddedServer(EmbeddedEngine(model, EmbeddedEngineConfig(**engine_kw)))
    server.start_in_thread()
    return server


def served_fixture():
    """(server, client, model) with a fresh engine per test."""
    from megatron_rl.rollout.client import EngineClient

    model = tiny_model(0)
    server = start_server(model, max_batch_size=8)
    client = EngineClient(server.url)
    _current_clients.append(client)
    try:
        yield server, client, model
    finally:
        _current_clients.remove(client)
        server.stop()


def run(coro, *clients):
    """asyncio.run that also closes the clients' sessions on that loop (default: the served client)."""
    async def main():
        try:
            return await coro
        finally:
            for c in clients or _current_clients:
                await c.close()
    return asyncio.run(main())


_current_clients: list = []


@torch.no_grad()
def reference_logprobs(model, prompt, tokens, temperature=1.0):
    """Full forward pass over prompt+tokens: logprob of each generated token under logits/temperature."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = model(ids).logits[0].float()
    t = 1.0 if temperature < 1e-6 else temperature
    lp = torch.log_softmax(logits / t, dim=-1)
    return [float(lp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(tokens)]


@torch.no_grad()
def greedy_reference(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
