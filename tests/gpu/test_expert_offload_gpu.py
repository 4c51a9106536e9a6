"""Expert offload on a GPU: staged and device-bank experts give the all-in-VRAM logits bit for bit.

Routed experts live in pinned host RAM with part of them in device banks; every
step of a mixed prefill / decode run must equal (``torch.equal``) the run with
every expert in VRAM on the same path (grouped experts, no graphs).  Host-computed
experts (decode) round differently from the GPU and are held to a tolerance.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.offload import OffloadOptions
from ds4d.models.deepseek_v4.paths import ForwardPaths
from tests.unit.test_expert_offload import LAYERS, _steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("offload_gpu"), seed=7, layers=LAYERS)


def _reference(checkpoint, dtype):
    return _steps(load_model(checkpoint, dtype=dtype, device="cuda", paths=_without_graphs()))


def _without_graphs() -> ForwardPaths:
    return ForwardPaths.for_device("cuda").replace(decode_graphs="off")


def _half(offload) -> None:
    offload.set_placement([[e for e in range(8) if (e + layer) % 2] for layer in range(len(LAYERS))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_and_device_experts_are_bit_identical(checkpoint, dtype):
    """bf16 runs the grouped kernel: bit for bit.  float32 falls back to bmm, whose cuBLAS kernel depends on the
    batch size, so there the rows agree to float32 rounding."""
    want = _reference(checkpoint, dtype)
    model = load_model(checkpoint, dtype=dtype, device="cuda",
                       offload=OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="copy"),
                       paths=_without_graphs())  # eager, as the reference (graphs pad the batch: test_zero_copy_...)
    offload = model.expert_offload
    assert offload.pinned.enabled
    _half(offload)
    got = _steps(model)
    for index, (a, b) in enumerate(zip(got, want)):
        if dtype == torch.bfloat16:
            assert torch.equal(a, b), f"step {index}: max |diff| {(a - b).abs().max().item():.3e}"
        else:
            assert (a - b).abs().max().item() < 1e-4 and torch.equal(a.argmax(-1), b.argmax(-1))
    stats = offload.expert_stats()
    assert stats["bytes_copied"] > 0 and offload.pcie_bytes_s > 0
    if offload.zero_copy:  # bf16 with native MXFP4 experts: decode reads cold experts in place
        assert stats["host_read_bytes"] > 0
    else:  # decode copies the routed cold experts and skips the rest
        assert stats["skipped_transfers"] > 0
    offload.close()


def test_host_experts_in_decode_match_within_rounding(checkpoint):
    want = _reference(checkpoint, torch.float32)
    model = load_model(checkpoint, device="cuda",
                       offload=OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="cpu", cpu_threads=2))
    _half(model.expert_offload)
    got = _steps(model)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-3
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert all(row["cpu_experts"] > 0 for row in model.expert_stats()["layers"])
    model.expert_offload.close()


@pytest.mark.parametrize("start", ["all cold", "all hot"])
def test_zero_copy_decode_in_graphs_is_bit_identical(checkpoint, start):
    """bf16 with native MXFP4 experts: half the experts stay in host RAM, decode steps read them in
    place through the address tables inside CUDA graphs; every step equals the all-on-device model
    (also with graphs) bit for bit.  Starting all hot, the host holds only spare slots and the move
    to half copies the leaving experts' device bytes back into them (pinned, page-locked slots)."""
    reference = load_model(checkpoint, dtype=torch.bfloat16, device="cuda")
    want = _steps(reference)
    vram = 0 if start == "all cold" else 1 << 40
    model = load_model(checkpoint, dtype=torch.bfloat16, device="cuda",
                       offload=OffloadOptions(vram_bytes=vram, stage_experts=2, decode_cold="copy"))
    offload = model.expert_offload
    assert offload.native and not offload.keeps_all
    if not offload.zero_copy:
        pytest.skip("this GPU cannot read registered host memory at its host address (or cuda-python is missing)")
    assert offload.host_experts() == (0 if start == "all hot" else len(LAYERS) * 8)
    _half(offload)
    assert offload.host_experts() == len(LAYERS) * 4
    assert (offload.demoted_bytes > 0) == (start == "all hot")
    got = _steps(model)
    for index, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {index}: max |diff| {(a - b).abs().max().item():.3e}"
    assert len(model._graphs) > 0  # decode steps were captured and replayed
    stats = offload.expert_stats()
    assert stats["host_read_bytes"] > 0 and stats["bytes_copied"] > 0
    offload.close()


@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled graphs"])
def test_cold_experts_fetched_ahead_on_a_side_stream_are_bit_identical(checkpoint, compiled):
    """``fetch_ahead``: each decode layer's predicted cold experts are copied on a side stream, forked from and
    joined back into the captured step; every step equals the all-on-device model bit for bit, and the hash
    layers' cold experts (known from the token) were all read from the copies fetched ahead."""
    paths = ForwardPaths.for_device("cuda").replace(compile_decode=compiled)
    want = _steps(load_model(checkpoint, dtype=torch.bfloat16, device="cuda", paths=paths))
    model = load_model(checkpoint, dtype=torch.bfloat16, device="cuda", paths=paths,
                       offload=OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="copy", fetch_ahead=8))
    offload = model.expert_offload
    if not offload.zero_copy:
        pytest.skip("this GPU cannot read registered host memory at its host address (or cuda-python is missing)")
    _half(offload)
    got = _steps(model)
    for index, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {index}: max |diff| {(a - b).abs().max().item():.3e}"
    assert len(model._graphs) > 0 and model.graph_failure is None
    stats = offload.expert_stats()
    hashed = stats["layers"][:model.cfg.num_hash_layers]
    assert sum(row["host_read_pairs"] for row in hashed) > 0
    assert all(row["fetched_ahead_pairs"] == row["host_read_pairs"] for row in hashed)
    offload.close()
