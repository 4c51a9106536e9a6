"""`ds4d serve --gpus cpu:2`: one tiny DeepSeek-V4 split over two processes (gloo) behind the daemon.

The served greedy tokens and their log-probabilities must equal the
single-process model's on the same checkpoint, for expert parallel (with
expert offload on both ranks) and for a layer split.  The next turn (the prompt plus the reply plus more) reuses the
first turn's KV after its blocks were pushed out of the pool into the RAM tier
by another prompt, and still continues as the single-process model does.  A
graceful shutdown must take the worker processes with it.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest
import torch

from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.knobs import check_split_knobs
from ds4d.models.deepseek_v4.loader import load_tokenizer
from ds4d.parallel.gpus import parse_gpus
from ds4d.registry import PluginError
from tests.daemon import Daemon

PROMPT = list(range(2000, 2150))  # > 128 tokens: crosses an HCA window
NEW_TOKENS = 8
MORE = list(range(3000, 3020))  # the next turn: prompt + reply + these
OTHER = list(range(5000, 5900))  # a prompt long enough to push the first turn's blocks out of the pool


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tinyv4-parallel"), layers=[0, 4, 128, 4], seed=11)


def _greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(NEW_TOKENS):
        logp = torch.log_softmax(model.logits_for(ids)[-1].float(), dim=-1)
        nxt = int(logp.argmax())
        logprobs.append(logp[nxt].item())
        ids.append(nxt)
    return ids[len(prompt):], logprobs


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy continuations and their log-probabilities from the single-process model: first and next turn."""
    model = load_model(checkpoint)
    tokens, logprobs = _greedy(model, PROMPT)
    return (tokens, logprobs), _greedy(model, PROMPT + tokens + MORE)


def _workers_of(daemon: Daemon) -> list[psutil.Process]:
    return psutil.Process(daemon.proc.pid).children(recursive=True)


@pytest.mark.parametrize("layout", ["ep", "pp"])
def test_two_process_daemon_equals_one_process(checkpoint, reference, layout):
    # expert parallel also with expert offload: each rank's experts in host RAM, a few hot on its "device"
    offload = ("--expert-vram-gib", "0.0005") if layout == "ep" else ()
    d = Daemon("--model", str(checkpoint), "--gpus", "cpu:2", "--parallel-layout", layout, "--threads", "1",
               "--kv-cache-tokens", "1024", "--max-num-seqs", "1", "--prefill-chunk", "64", "--cache-ram-gib", "0.5",
               *offload)
    try:
        workers = _workers_of(d)
        assert workers, "no worker process was started"
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        tok = load_tokenizer(checkpoint)

        def complete(prompt: list[int], expected: tuple[list[int], list[float]]):
            resp = client.completions.create(model=model_id, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                             logprobs=0, extra_body={"ignore_eos": True})
            tokens, logprobs = expected
            assert resp.choices[0].logprobs.tokens == [tok.decode([t]) for t in tokens]
            # the daemon prefills in 64-token chunks, the reference in one pass: fp32 rounding differs
            assert resp.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=2e-3, rel=1e-3)
            return resp.usage

        first, after = reference
        complete(PROMPT, first)
        client.completions.create(model=model_id, prompt=OTHER, max_tokens=1)
        usage = complete(PROMPT + first[0] + MORE, after)
        by_tier = usage.model_dump()["ds4d"]["cached_tokens_by_tier"]
        # reused up to the checkpoint at the end of the first reply (its last token was never fed back)
        assert usage.prompt_tokens_details.cached_tokens == len(PROMPT) + NEW_TOKENS - 1, usage
        assert by_tier["ram"] >= 128, by_tier
        with urllib.request.urlopen(d.url + "/v1/ds4d/stats", timeout=10) as r:
            plan = json.loads(r.read())["model"]["parallel"]
        assert (plan["stages"], plan["ep_size"]) == {"ep": (1, 2), "pp": (2, 1)}[layout], plan
        layers = sorted(tuple(rank["layers"]) for rank in plan["ranks"])
        assert layers == ([(0, 4), (0, 4)] if layout == "ep" else [(0, 2), (2, 4)]), plan
        with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        if offload:  # both ranks' counters, per layer and rank
            assert 'ds4d_expert_bytes_copied_total{layer="3",rank="1"}' in metrics, metrics
        else:
            assert "ds4d_experts_in_ram" not in metrics
    finally:
        assert d.stop() == 0, d.log
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, [p.cmdline() for p in alive]


def test_torchrun_job_serves_the_split_model(checkpoint, reference):
    """``torchrun --nproc-per-node 2 -m ds4d.cli serve --gpus torchrun``: rank 0 serves, rank 1 follows."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    d = Daemon("--model", str(checkpoint), "--gpus", "torchrun", "--device", "cpu", "--parallel-layout", "auto",
               "--threads", "1", "--kv-cache-tokens", "1024", "--max-num-seqs", "1", "--prefill-chunk", "64",
               launcher=torchrun, env={"OMP_NUM_THREADS": "1"})
    try:
        processes = _workers_of(d)
        assert len([p for p in processes if "ds4d.cli" in " ".join(p.cmdline())]) == 2, processes
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120)
        resp = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                         max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})
        (tokens, logprobs), _ = reference
        tok = load_tokenizer(checkpoint)
        assert resp.choices[0].logprobs.tokens == [tok.decode([t]) for t in tokens]
        assert resp.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=2e-3, rel=1e-3)
        with urllib.request.urlopen(d.url + "/v1/ds4d/stats", timeout=10) as r:
            plan = json.loads(r.read())["model"]["parallel"]
        # one host: auto makes it one stage whose two ranks split the experts
        assert (plan["stages"], plan["ep_size"]) == (1, 2), plan
    finally:
        d.stop()
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert any("torchrun rank 1 of 2: worker" in line for line in d.log_lines), d.log


def test_gpus_knob_parsing():
    assert parse_gpus("0,1,2,3") == [0, 1, 2, 3]
    assert parse_gpus(" 3, 1 ") == [3, 1]
    assert parse_gpus("cpu:2") == 2
    assert parse_gpus("torchrun") == "torchrun"
    for bad in ("cpu:0", "cpu:x", "0,0", "a,b", "-1"):
        with pytest.raises(PluginError):
            parse_gpus(bad)


def test_knobs_a_split_model_cannot_honour_are_refused():
    from ds4d.config import Config

    check_split_knobs(Config(gpus="0,1"))  # the defaults are fine
    check_split_knobs(Config(gpus="0,1", weight_format="native"))
    check_split_knobs(Config(gpus="0,1", expert_vram_gib=8.0))
    with pytest.raises(PluginError, match="weight_format=int4"):
        check_split_knobs(Config(gpus="0,1", weight_format="int4"))


def test_a_lost_worker_is_named_and_the_daemon_stops_serving(checkpoint):
    d = Daemon("--model", str(checkpoint), "--gpus", "cpu:2", "--parallel-layout", "pp", "--threads", "1",
               "--kv-cache-tokens", "1024", "--max-num-seqs", "1")
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=60)
        model_id = client.models.list().data[0].id
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2)
        (worker,) = [p for p in _workers_of(d) if "spawn_main" in " ".join(p.cmdline())]
        worker.kill()
        deadline = time.monotonic() + 10  # the daemon reaps it, so here it only turns into a zombie
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.InternalServerError, match="rank 1 .CPU. exited with code -9"):
            client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2)
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(d.url + "/health", timeout=10)
        assert health.value.code == 503
    finally:
        assert d.stop() == 0, d.log
    assert not any("shutdown hook" in line for line in d.log_lines), d.log
