"""A q2 GGUF file written by ``ds4d make-tiny --gguf q2`` served by a live daemon (``--model FILE.gguf``): the
deepseek_v4 family claims it, /v1/completions echoes the log-probabilities of the same file loaded in this
process, and a chat completion through the openai SDK runs to its token limit."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import openai
import pytest
import torch

from ds4d.models.deepseek_v4.gguf_loader import load_gguf_model
from tests.daemon import Daemon

PROMPT = [0, *range(1000, 1400, 9)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("written_gguf") / "tiny-q2.gguf"
    run = subprocess.run([sys.executable, "-m", "ds4d.cli", "make-tiny", "--family", "deepseek_v4", "--gguf", "q2",
                          "--out", str(path), "--layers", "0,4", "--seed", "5"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    daemon = Daemon("--model", str(path), "--threads", "1", "--kv-cache-tokens", "1024", "--max-num-seqs", "2",
                    "--prefill-chunk", "32")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield path, client, client.models.list().data[0].id, daemon
    finally:
        daemon.stop()


def test_echo_logprobs_are_those_of_the_written_file(served):
    path, client, model_id, daemon = served
    assert model_id == "tiny-q2"
    with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as response:
        plugins = json.load(response)["plugins"]
    assert plugins["model_family"] == "deepseek_v4" and plugins["chat_encoder"] == "deepseek_v4"
    resp = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    served_logprobs = resp.choices[0].logprobs.token_logprobs
    with torch.no_grad():
        logp = torch.log_softmax(load_gguf_model(path).logits_for(PROMPT).float(), dim=-1)
    expected = [logp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    assert served_logprobs[0] is None and served_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_a_chat_completion_comes_back(served):
    _, client, model_id, _ = served
    resp = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens > 3
    assert resp.choices[0].finish_reason == "length"
