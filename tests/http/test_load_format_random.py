"""``ds4d serve --load-format random``: a daemon over random weights for a directory's config.json.

The directories hold a tiny config.json and its tokenizer and no weights: the
daemon must come up with the family the config names, say loudly that the
weights are random (log and /v1/ds4d/stats), and serve; the same directory
without the knob must refuse to start, naming what is missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import openai
import pytest
import torch

from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.loader import load_tokenizer
from ds4d.models.deepseek_v41.make_tiny import write_tiny
from tests.daemon import Daemon


def config_only(source, target):
    target.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, target / name)
    return target


@pytest.fixture(scope="module", params=["deepseek_v41", "deepseek_v4"])
def bare(request, tmp_path_factory):
    """(family, a directory with config.json and tokenizer.json only)."""
    made = tmp_path_factory.mktemp("made")
    source = write_tiny(made / "ckpt") if request.param == "deepseek_v41" else write_tiny_checkpoint(
        made / "ckpt", layers=[0, 4, 128], seed=2)
    return request.param, config_only(source, tmp_path_factory.mktemp("bare") / "model")


def test_a_daemon_serves_random_weights_and_says_so(bare):
    family, path = bare
    daemon = Daemon("--model", str(path), "--load-format", "random", "--threads", "1", "--kv-cache-tokens", "512",
                    "--max-num-seqs", "2", "--device", "cpu", "--dtype", "float32")
    try:
        assert "RANDOM WEIGHTS" in daemon.log and f"loading {family} model from" in daemon.log
        with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as resp:
            stats = json.load(resp)
        assert stats["model"]["family"] == family and stats["model"]["load_format"] == "random"
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens > 0
    finally:
        daemon.stop()


def test_without_the_knob_the_missing_weights_stop_the_start(bare):
    _, path = bare
    result = subprocess.run([sys.executable, "-m", "ds4d.cli", "serve", "--model", str(path), "--threads", "1",
                             "--device", "cpu", "--port", "0"], check=False, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "no *.safetensors files (to serve random weights of its config.json: load_format = random)" in " ".join(
        (result.stderr + result.stdout).split())


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "experts-offloaded"])
def test_a_daemon_serves_random_gguf_q2_blocks(tmp_path, offload):
    """``--load-format random-q2`` (DeepSeek-V4): the linears and routed experts in random GGUF blocks of the
    ds4 q2 recipe, kept as stored where the kernels run (Triton's interpreter here); offloaded, every routed
    expert in host RAM in its blocks, copied as stored for the steps that use it."""
    path = config_only(write_tiny_checkpoint(tmp_path / "ckpt", layers=[0, 4, 128], seed=2), tmp_path / "model")
    more = ["--expert-vram-gib", "0.000001", "--expert-placement", "static"] if offload else []
    daemon = Daemon("--model", str(path), "--load-format", "random-q2", "--threads", "1", "--kv-cache-tokens", "512",
                    "--max-num-seqs", "2", "--device", "cpu", "--dtype", "float32", *more)
    try:
        assert "load_format = random-q2: RANDOM WEIGHTS" in daemon.log
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "hi"}],
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
        with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as resp:
            stats = json.load(resp)
        assert stats["model"]["load_format"] == "random-q2"
        if offload:
            experts = stats["experts"]
            assert experts["gpu_experts"] == 0 and experts["ram_experts"] == experts["host_experts"] > 0
            assert experts["bytes_copied"] > 0 and experts["form"] == "gguf Q8_0/Q8_0"  # tiny widths: narrower than IQ2_XXS and Q2_K blocks
    finally:
        daemon.stop()


PROMPT = list(range(2000, 2150))  # > 128 tokens: crosses an HCA window
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def bare_v4(tmp_path_factory):
    made = tmp_path_factory.mktemp("made-split")
    source = write_tiny_checkpoint(made / "ckpt", layers=[0, 4, 128, 4], seed=5)
    return config_only(source, tmp_path_factory.mktemp("bare-split") / "model")


@pytest.fixture(scope="module")
def one_process(bare_v4):
    """Greedy tokens and their log-probabilities of the one-process model over the same random weights."""
    model = load_model(bare_v4, load_format="random")
    ids, logprobs = list(PROMPT), []
    for _ in range(NEW_TOKENS):
        logp = torch.log_softmax(model.logits_for(ids)[-1].float(), dim=-1)
        ids.append(int(logp.argmax()))
        logprobs.append(logp[ids[-1]].item())
    return ids[len(PROMPT):], logprobs


@pytest.mark.parametrize("gpus", ["cpu:2", "torchrun"])
def test_a_split_daemon_draws_the_one_process_models_random_weights(bare_v4, one_process, gpus):
    """``--load-format random --gpus ...``: each rank draws its own layers (a layer split over CPU processes) or
    experts (a torchrun job, expert parallel) of the same random model one process draws, so the daemon's greedy
    tokens are that model's (log-probabilities within float32 summation order)."""
    split = (["--gpus", "cpu:2", "--parallel-layout", "pp"] if gpus == "cpu:2" else
             ["--gpus", "torchrun", "--device", "cpu", "--parallel-layout", "auto"])
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                if gpus == "torchrun" else None)
    daemon = Daemon("--model", str(bare_v4), "--load-format", "random", *split, "--threads", "1",
                    "--kv-cache-tokens", "512", "--max-num-seqs", "1", "--prefill-chunk", "64", launcher=launcher,
                    env={"OMP_NUM_THREADS": "1"})
    try:
        assert "RANDOM WEIGHTS" in daemon.log and "each rank drawing its own layers and experts" in daemon.log
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        assert model == "model"  # named after the directory, as one process names it
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                          logprobs=0, extra_body={"ignore_eos": True})
        tokens, logprobs = one_process
        tokenizer = load_tokenizer(bare_v4)
        assert reply.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
        # the daemon prefills in 64-token chunks, the reference in one pass: float32 rounding differs
        assert reply.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=2e-3, rel=1e-3)
        with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as resp:
            stats = json.load(resp)
        assert stats["model"]["load_format"] == "random"
        plan = stats["model"]["parallel"]
        assert (plan["stages"], plan["ep_size"]) == ((2, 1) if gpus == "cpu:2" else (1, 2)), plan
    finally:
        daemon.stop()

