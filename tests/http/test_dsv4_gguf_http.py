"""A DeepSeek-V4 GGUF file of llama.cpp's converter served by a live daemon (``--model FILE.gguf``).

The deepseek_v4 family must claim the file on its own (no ``--model-family``); the echoed
log-probabilities of /v1/completions must be those of the same file loaded in this process,
and greedy decoding must continue with the tokens those logits pick.
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch

from ds4d.models.deepseek_v4.gguf_loader import load_gguf_model
from tests.daemon import Daemon
from tests.parity.make_gguf_v4_fixtures import OUT as FIXTURES

FILE = FIXTURES / "converted.gguf"
PROMPT = [0, *range(10, 400, 5)]


@pytest.fixture(scope="module")
def served():
    daemon = Daemon("--model", str(FILE), "--threads", "1", "--kv-cache-tokens", "1024", "--max-num-seqs", "2",
                    "--prefill-chunk", "32")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield daemon, client, client.models.list().data[0].id
    finally:
        daemon.stop()


def test_the_file_is_served_by_the_deepseek_v4_family(served):
    daemon, _, model_id = served
    assert model_id == "converted"
    with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as response:
        plugins = json.load(response)["plugins"]
    assert plugins["model_family"] == "deepseek_v4" and plugins["chat_encoder"] == "deepseek_v4"


def test_echo_logprobs_are_those_of_the_file(served):
    _, client, model_id = served
    resp = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    served_logprobs = resp.choices[0].logprobs.token_logprobs
    assert len(served_logprobs) == len(PROMPT) and served_logprobs[0] is None
    with torch.no_grad():
        logp = torch.log_softmax(load_gguf_model(FILE).logits_for(PROMPT).float(), dim=-1)
    expected = [logp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    assert served_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_greedy_completion_follows_the_logits(served):
    _, client, model_id = served
    resp = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 4
    model = load_gguf_model(FILE)
    ids = list(PROMPT)
    for _ in range(4):
        ids.append(int(model.logits_for(ids)[-1].argmax()))
    assert resp.choices[0].logprobs.tokens == [model.tokenizer.decode([t]) for t in ids[len(PROMPT):]]
