import pytest


@pytest.fixture(scope="session")
def qwen_tok_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer_cache")


@pytest.fixture(scope="session")
def qwen_tok(qwen_tok_cache):
    from megatron_rl.tokenizer import load_tokenizer

    return load_tokenizer("qwen3-offline", cache_dir=qwen_tok_cache)
