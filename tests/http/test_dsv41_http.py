"""A tiny DeepSeek-V4.1 checkpoint served over HTTP on the CPU, checked against the oracle's goldens.

The daemon picks the ``deepseek_v41`` family from config.json by itself.  For the
fixture's token-id prompt, /v1/completions with echo + logprobs must give every
prompt token the log-probability of the HF oracle's logits (tests/fixtures/dsv41,
written by tests/parity/make_dsv41_goldens.py), and greedy generation must give
the oracle's greedy tokens with their log-probabilities.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file

from ds4d.models.hf_tokenizer import HFTokenizer
from tests.daemon import Daemon

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41" / "tiny_b"


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.fixture(scope="module", params=["cpu", ON_CUDA])
def served(tmp_path_factory, request):
    """The daemon on the CPU, and (where there is one) on a CUDA device, in float32 both times."""
    path = tmp_path_factory.mktemp("tinyv41")
    for file in ("config.json", "model.safetensors", "tokenizer.json"):  # not the goldens file beside them
        (path / file).symlink_to(FIXTURE / file)
    daemon = Daemon("--model", str(path), "--threads", "1", "--kv-cache-tokens", "1024", "--max-num-seqs", "2",
                    "--prefill-chunk", "7", "--device", request.param, "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield daemon, client, client.models.list().data[0].id
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def golden():
    return load_file(str(FIXTURE / "goldens.safetensors"))


def test_the_family_is_detected_and_the_engram_choice_logged(served):
    daemon, _, _ = served
    assert "loading deepseek_v41 model from" in daemon.log
    assert "Engram tables:" in daemon.log and "read into host memory" in daemon.log
    with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as resp:
        stats = json.load(resp)
    assert stats["model"]["family"] == "deepseek_v41" and stats["model"]["engram_storage"] == "ram"
    assert {stats["plugins"][kind] for kind in ("chat_encoder", "reasoning_parser")} == {"deepseek_v41"}
    assert stats["plugins"]["tool_parser"] == "dsml_v41"
    paths = stats["model"]["forward_paths"]
    if stats["model"]["device"].startswith("cuda"):  # the GPU memory plan ran (its profiling step included)
        assert stats["memory_plan"] is not None and "GPU memory plan skipped" not in daemon.log
        assert paths == {"fused_hyper": True, "expert_rows": True, "grouped_experts": True, "window_kernel": True,
                         "batched_decode": True, "route_kernel": False, "decode_graphs": "cuda",
                         "compile_decode": False}
    else:
        assert stats["memory_plan"] is None
        assert paths.pop("decode_graphs") == "off" and not any(paths.values()) and len(paths) == 7
    assert "decode_graph_fallback" in stats["model"] and stats["model"]["decode_graph_fallback"] is None


def test_echo_logprobs_and_greedy_tokens_match_the_oracle(served, golden):
    _, client, model_id = served
    ids = golden["prompt_ids"].tolist()
    greedy = golden["greedy_ids"].tolist()[:12]
    resp = client.completions.create(model=model_id, prompt=ids, max_tokens=len(greedy), echo=True, logprobs=1,
                                     temperature=0, extra_body={"ignore_eos": True})
    logprobs = resp.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(ids) + len(greedy) and logprobs.token_logprobs[0] is None

    prompt_logp = torch.log_softmax(golden["prompt_logits"].double(), dim=-1)
    expected = [prompt_logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)

    tokenizer = HFTokenizer(FIXTURE / "tokenizer.json")
    assert logprobs.tokens[len(ids):] == [tokenizer.decode([t]) for t in greedy]
    steps = torch.cat([golden["prompt_logits"][-1:], golden["decode_logits"]]).double().log_softmax(dim=-1)
    expected = [steps[n, t].item() for n, t in enumerate(greedy)]
    assert logprobs.token_logprobs[len(ids):] == pytest.approx(expected, abs=1e-4)


def test_two_requests_at_once_give_what_each_gives_alone(served, golden):
    _, client, model_id = served
    ids = golden["prompt_ids"].tolist()
    prompts = [ids, ids[3:] + ids[:4]]

    def complete(prompt):
        return client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    alone = [complete(p) for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(complete, prompts))
    assert together == alone


def test_a_split_over_processes_is_refused_at_start(tmp_path):
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / file).symlink_to(FIXTURE / file)
    with pytest.raises(RuntimeError, match="exited during start") as failed:
        Daemon("--model", str(tmp_path), "--threads", "1", env={"DS4D_GPUS": "cpu:2"}, startup_timeout=60)
    assert "the deepseek_v41 model family cannot be split over processes" in str(failed.value)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_offloaded_experts_give_the_oracles_tokens_and_say_where_they_are(tmp_path, golden, device):
    """``--expert-vram-gib`` too small for one expert: every routed expert in host RAM, copied in when
    chosen (the CPU as the device: the same placement, skip and staging code), the oracle's greedy
    tokens all the same; /v1/ds4d/stats and /metrics count the experts and their traffic."""
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / file).symlink_to(FIXTURE / file)
    daemon = Daemon("--model", str(tmp_path), "--threads", "1", "--kv-cache-tokens", "1024", "--max-num-seqs", "2",
                    "--device", device, "--dtype", "float32", "--expert-vram-gib", "0.000001",
                    "--expert-placement", "static")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        greedy = golden["greedy_ids"].tolist()
        resp = client.completions.create(model=model_id, prompt=golden["prompt_ids"].tolist(), max_tokens=len(greedy),
                                         temperature=0, logprobs=0, extra_body={"ignore_eos": True})
        tokenizer = HFTokenizer(FIXTURE / "tokenizer.json")
        assert resp.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in greedy]
        with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as reply:
            experts = json.load(reply)["experts"]
        cfg = json.loads((FIXTURE / "config.json").read_text())["text_config"]
        total = cfg["num_hidden_layers"] * cfg["n_routed_experts"]
        assert experts["gpu_experts"] == 0 and experts["ram_experts"] == experts["host_experts"] == total
        assert experts["bytes_copied"] > 0 and experts["skipped_transfers"] > 0
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as reply:
            assert f"ds4d_experts_in_ram {total}" in reply.read().decode()
        assert any("memory plan:" in line and "host RAM, pinned" in line for line in daemon.log_lines)
    finally:
        daemon.stop()


def test_a_second_turn_reuses_the_first_and_continues_as_computed_cold(served, golden):
    _, client, model_id = served
    ids = golden["prompt_ids"].tolist()
    body = {"ignore_eos": True, "cache_salt": "turns"}
    first = client.completions.create(model=model_id, prompt=ids[:30], max_tokens=6, temperature=0, logprobs=0,
                                      extra_body=body)
    tokenizer = HFTokenizer(FIXTURE / "tokenizer.json")
    generated = [tokenizer.token_to_id(t) for t in first.choices[0].logprobs.tokens]
    assert None not in generated and tokenizer.decode(generated) == first.choices[0].text
    turn2 = ids[:30] + generated + ids[30:]
    warm = client.completions.create(model=model_id, prompt=turn2, max_tokens=6, temperature=0, extra_body=body)
    assert warm.usage.prompt_tokens_details.cached_tokens == 30 + 6 - 1
    cold = client.completions.create(model=model_id, prompt=turn2, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, "cache_salt": "cold"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].text == cold.choices[0].text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_daemon_by_default_keeps_the_weights_as_stored(tmp_path):
    """No dtype or weight_format given: on CUDA the daemon runs bf16 with the FP8 linears and FP4 experts
    of an official-format checkpoint as stored (``ds4d make-tiny``), serves chat and prompt logprobs, and a
    second turn reuses the first; its decode steps replay their graphs (no fallback)."""
    import math

    from ds4d.models.deepseek_v41.make_tiny import write_tiny

    path = write_tiny(tmp_path / "official", seed=7)
    daemon = Daemon("--model", str(path), "--device", "cuda", "--kv-cache-tokens", "1024", "--max-num-seqs", "2")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        assert "FP8 linears and FP4 experts as stored" in daemon.log
        chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hello there"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
        ids = list(range(5, 45))
        body = {"ignore_eos": True, "cache_salt": "native"}
        first = client.completions.create(model=model_id, prompt=ids, max_tokens=6, temperature=0, echo=True,
                                          logprobs=0, extra_body=body)
        assert all(math.isfinite(lp) and lp <= 0 for lp in first.choices[0].logprobs.token_logprobs[1:])
        again = client.completions.create(model=model_id, prompt=ids + [50, 51, 52], max_tokens=4, temperature=0,
                                          extra_body=body)
        assert again.usage.prompt_tokens_details.cached_tokens >= len(ids) - 16
        with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as resp:
            stats = json.load(resp)
        assert stats["model"]["stored_weights"] == ["fp8", "fp4"] and stats["model"]["dtype"] in ("bfloat16", "torch.bfloat16")
        assert stats["model"]["decode_graph_fallback"] is None and stats["memory_plan"] is not None
    finally:
        daemon.stop()
