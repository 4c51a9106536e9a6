"""A DeepSeek-V4 model's forward paths are fixed when it is built.

``ForwardPaths`` refuses values it does not know; the CPU's default is the
reference path; ``with_paths`` gives a model over the very same weights whose
logits equal the original's on the same path; a ``RoutingTally`` counts every
routed pair of the model it is given and nothing of the others; a decode graph
that fails to capture either runs eagerly from then on (logged, said by
``graph_failure``, the engine snapshot and ``/v1/ds4d/stats``) or raises, as
the paths decided.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.bench.random_v4 import bench_paths
from ds4d.cuda.graphs import EagerBuckets
from ds4d.engine.offline import OfflineEngine
from ds4d.engine.request import EngineRequest, SamplingParams
from ds4d.kernel import Kernel
from ds4d.models.deepseek_v4 import ForwardPaths, load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.moe import RoutingTally
from tests.unit.test_dsv4_model import Driver
from tests.unit.test_memory_plan import _build

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(i * 7919) % 30000 + 20 for i in range(40)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("paths"), seed=2, layers=[0, 4]))


def test_paths_refuse_unknown_values_and_default_to_the_reference_on_the_cpu(model):
    with pytest.raises(ValueError, match="hc_kernels"):
        ForwardPaths(hc_kernels="cuda")
    with pytest.raises(ValueError, match="decode_graphs"):
        ForwardPaths(decode_graphs="on")
    assert ForwardPaths.for_device("cpu", compile_decode=True) == ForwardPaths()
    assert model.paths == ForwardPaths() and model.info.extra["forward_paths"] == ForwardPaths().as_dict()
    with pytest.raises(ValueError, match="CUDA"):
        model.with_paths(ForwardPaths(fast_path=True, decode_graphs="cuda"))


@pytest.mark.parametrize("missing", ["", "route_triton", "decode_triton", "hc_triton"])
def test_on_cuda_the_paths_are_every_kernel_that_can_launch(monkeypatch, missing):
    """``for_device("cuda")`` turns each kernel path on where its module can launch and off where it cannot
    (the modules' ``available`` stood in for, so this runs without a GPU)."""
    from ds4d.cuda import attention_triton, decode_triton, hc_kernels, hc_triton, prefill_triton, route_triton

    modules = {"attention_triton": attention_triton, "decode_triton": decode_triton, "hc_kernels": hc_kernels,
               "hc_triton": hc_triton, "prefill_triton": prefill_triton, "route_triton": route_triton}
    for name, module in modules.items():
        monkeypatch.setattr(module, "available", lambda launch=name != missing: launch)
    paths = ForwardPaths.for_device("cuda")
    assert paths.fast_path and paths.decode_graphs == "cuda" and paths.fused_attention
    assert paths.route_kernel == (missing != "route_triton")
    assert paths.decode_kernel == (missing != "decode_triton")
    assert paths.hc_kernels == ("numba" if missing == "hc_triton" else "boundary")
    assert paths.fused_prefill == (missing != "hc_triton")
    assert not paths.shared_beside and not paths.compile_decode
    assert ForwardPaths.for_device("cuda", compile_decode=True).compile_decode


def test_the_bench_rows_name_the_hyper_connection_paths_they_run():
    """``bench model``'s rows each build their paths from the device's best: the default row keeps the
    two-launch boundary (``boundary``), ``triton-hc`` the Triton weight kernels alone, ``plain-hc`` torch."""
    best = ForwardPaths(fast_path=True, hc_kernels="boundary", decode_graphs="cuda")
    assert best.fused_hc == "boundary"
    rows = {path: bench_paths(path, best) for path in ("graphs", "triton-hc", "numba-hc", "plain-hc", "eager")}
    assert {path: p.hc_kernels for path, p in rows.items()} == {
        "graphs": "boundary", "triton-hc": "triton", "numba-hc": "numba", "plain-hc": "torch", "eager": "boundary"}
    assert rows["triton-hc"].decode_graphs == "cuda" and rows["eager"].decode_graphs == "off"
    assert bench_paths("triton-hc", best.replace(hc_kernels="numba")).hc_kernels == "numba"


def test_the_bench_rows_keep_the_default_decode_attention_but_their_own():
    """Every row decodes with the device's default decode attention (``decode_kernel``, on for CUDA) except the
    rows that name the other: ``torch-decode`` rows in torch's operators, ``decode-kernel`` rows in the kernels."""
    for default in (True, False):
        best = ForwardPaths(fast_path=True, hc_kernels="boundary", decode_graphs="cuda", decode_kernel=default)
        rows = {path: bench_paths(path, best).decode_kernel
                for path in ("graphs", "lookahead", "pdl", "shared-beside", "torch-decode", "torch-decode-lookahead",
                             "decode-kernel", "decode-kernel-lookahead")}
        assert rows == {"graphs": default, "lookahead": default, "pdl": default, "shared-beside": default,
                        "torch-decode": False, "torch-decode-lookahead": False, "decode-kernel": True,
                        "decode-kernel-lookahead": True}
    for default in (True, False):  # the same for the routing (``route_kernel``, on for CUDA)
        best = ForwardPaths(fast_path=True, decode_graphs="cuda", route_kernel=default)
        rows = {path: bench_paths(path, best).route_kernel
                for path in ("graphs", "lookahead", "torch-decode", "torch-route", "torch-route-lookahead",
                             "route-kernel", "route-kernel-lookahead")}
        assert rows == {"graphs": default, "lookahead": default, "torch-decode": default, "torch-route": False,
                        "torch-route-lookahead": False, "route-kernel": True, "route-kernel-lookahead": True}


def test_a_model_with_other_paths_shares_the_weights(model):
    grouped = model.with_paths(ForwardPaths(fast_path=True))
    assert grouped.weights is model.weights and grouped.paths.fast_path and not model.paths.fast_path
    assert torch.equal(model.with_paths().logits_for(PROMPT), model.logits_for(PROMPT))
    assert (grouped.logits_for(PROMPT) - model.logits_for(PROMPT)).abs().max().item() < 2e-4


def test_a_routing_tally_counts_the_pairs_of_its_model_only(model):
    cfg = model.cfg
    tally = RoutingTally(cfg.num_hidden_layers, cfg.n_routed_experts)
    model.with_paths(routing_tally=tally).logits_for(PROMPT)
    assert all(sum(row) == len(PROMPT) * cfg.num_experts_per_tok for row in tally.as_lists())
    model.logits_for(PROMPT)
    assert all(sum(row) == len(PROMPT) * cfg.num_experts_per_tok for row in tally.as_lists())
    assert model.routing_tally is None


def _decode_two_steps(model) -> list[torch.Tensor]:
    driver = Driver(model, num_blocks=8, max_seqs=2)
    driver.start("a")
    token = int(driver.prefill("a", PROMPT, chunk=len(PROMPT))[-1].argmax())
    rows = []
    for _ in range(2):
        rows.append(driver.step([("a", [token], 1)])[0])
        token = int(rows[-1][-1].argmax())
    return rows


def test_a_failed_capture_runs_eagerly_or_raises_as_decided(model, monkeypatch, caplog):
    want = _decode_two_steps(model.with_paths(ForwardPaths(fast_path=True)))

    def fail(self, key, *inputs):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(EagerBuckets, "run", fail)
    falling_back = model.with_paths(ForwardPaths(fast_path=True, decode_graphs="padded"))
    got = _decode_two_steps(falling_back)
    assert falling_back.graph_failure == "RuntimeError: capture refused"
    assert "decode graph capture failed" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    strict = model.with_paths(ForwardPaths(fast_path=True, decode_graphs="padded", graph_fallback=False))
    with pytest.raises(RuntimeError, match="capture refused"):
        _decode_two_steps(strict)


def test_a_fallback_to_eager_decode_shows_in_the_snapshot_and_the_stats(model, monkeypatch, tmp_path):
    def fail(self, key, *inputs):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(EagerBuckets, "run", fail)
    falling_back = model.with_paths(ForwardPaths(fast_path=True, decode_graphs="padded"))
    engine = OfflineEngine(falling_back, max_num_seqs=1, prefill_chunk=64, context_tokens=256)
    assert engine.snapshot().decode_graph_failure is None  # before any decode step
    engine.submit(EngineRequest("a", tuple(PROMPT), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    engine.run_until_idle()
    assert sum(len(o.new_token_ids) for o in engine.outputs) == 3
    assert engine.snapshot().decode_graph_failure == "RuntimeError: capture refused"
    assert OfflineEngine(model, max_num_seqs=1, prefill_chunk=64, context_tokens=256).snapshot() \
        .decode_graph_failure is None  # a model whose decode runs as built
    from ds4d.server.admin import snapshot

    _, state = _build(tmp_path, falling_back, Kernel.device_memory)
    assert snapshot(state)["model"]["decode_graph_fallback"] == "RuntimeError: capture refused"
