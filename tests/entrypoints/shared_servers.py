"""OpenAI servers shared by the server tests of every directory (pytest plugin, named in tests/conftest.py):
a server's start (its engine core's process imports torch and loads the model) costs seconds, so the tests
that need no flags of their own talk to one of these. A test that needs its own flags (an API key, limits,
faults, a stream interval, data parallelism) starts its own LiveServer."""
from __future__ import annotations

import pytest

# Room for 64 concurrent requests of up to 512 tokens.
SERVER_ENGINE = dict(max_model_len=512, num_kv_blocks=256, max_num_seqs=64)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _served(model: str, **engine):
    from entrypoints.live_server import LiveServer, one_torch_thread

    # The core's process takes one thread when it starts; this process keeps its own count between tests.
    with one_torch_thread():
        server = LiveServer(model, **engine).__enter__()
    try:
        yield server
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def plain_server(tiny_llama):
    """tiny_llama served with SERVER_ENGINE, without speculation."""
    yield from _served(str(tiny_llama[0]), **SERVER_ENGINE)


@pytest.fixture(scope="session")
def ngram_server(tiny_llama):
    """tiny_llama served with SERVER_ENGINE and n-gram drafts (NGRAM)."""
    yield from _served(str(tiny_llama[0]), speculative_config=NGRAM, **SERVER_ENGINE)
