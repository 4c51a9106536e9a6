from __future__ import annotations

import openai
import pytest

from tests.daemon import Daemon


@pytest.fixture(scope="session")
def daemon():
    d = Daemon("--max-context", "1024", "--max-num-seqs", "8", "--threads", "2", "--kv-cache-tokens", "16384")
    yield d
    d.stop()


@pytest.fixture(scope="session")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_id(client) -> str:
    return client.models.list().data[0].id
