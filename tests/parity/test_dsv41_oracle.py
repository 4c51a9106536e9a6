"""DeepSeek-V4.1 forward pass against the Hugging Face ``deepseek_v41`` model's cache path.

The fixtures under tests/fixtures/dsv41/ were written by
tests/parity/make_dsv41_goldens.py from the oracle (prefill with a
DynamicCache, then one token per step) on two tiny random configs: ``tiny_a``
(saved by ``save_pretrained``: HF names, bare text config) and ``tiny_b``
(official names, composite config).  Between them: ratio 0/1/2 layers, two KV
sources with reuse and reindex layers each, a candidate source, two Engram
layers, windows shorter than the prompt and top-k that really selects.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ds4d.models.deepseek_v41 import DeepseekV41Model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"
NAMES = ("tiny_a", "tiny_b")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    directory = FIXTURES / request.param
    return DeepseekV41Model.from_pretrained(directory), load_file(str(directory / "goldens.safetensors"))


def test_prompt_logits_match_the_oracle(case):
    model, golden = case
    logits = model.prefill(model.new_state(), golden["prompt_ids"].tolist())
    assert logits.shape == golden["prompt_logits"].shape
    assert relative_error(logits, golden["prompt_logits"]) < 1e-4


def test_greedy_tokens_and_decode_logits_match_the_oracle(case):
    model, golden = case
    state = model.new_state()
    step = model.prefill(state, golden["prompt_ids"].tolist())[-1]
    tokens, decode_logits = [], []
    for _ in range(golden["greedy_ids"].numel()):
        tokens.append(int(step.argmax()))
        step = model.decode(state, tokens[-1])
        decode_logits.append(step)
    assert tokens == golden["greedy_ids"].tolist()
    assert relative_error(torch.stack(decode_logits), golden["decode_logits"]) < 1e-4


def test_the_fixtures_cover_what_they_claim(case):
    """Windows shorter than the prompt, both top-k levels selecting, decode steps inside a ratio-2 pair
    (where the official code's decode path scores against stale index keys; see the model's docstring)."""
    model, golden = case
    cfg, length = model.cfg, golden["prompt_ids"].numel()
    assert length > 3 * cfg.sliding_window
    assert {1, 2} <= set(cfg.compress_ratios) and 0 in cfg.compress_ratios and len(cfg.engram_layer_ids) == 2
    assert length // 2 > cfg.index_topk and length > cfg.candidate_topk_blocks * cfg.candidate_block_size
    assert any(p.is_index_source and not p.is_kv_source for p in model.plans)  # reindex
    assert any(p.ratio and not p.is_index_source for p in model.plans)  # reuse
    assert any(p.uses_candidates for p in model.plans)
    assert length % 2 == 1 or golden["greedy_ids"].numel() > 1  # some decode step leaves a pair open


def test_engram_row_ids_match_the_oracle(case):
    model, golden = case
    assert torch.equal(model.hasher.token_map, golden["token_map"])
    nothing_before = torch.empty(0, dtype=torch.long)
    rows = torch.stack([model.hasher.row_ids(nothing_before, stream) for stream in golden["engram_tokens"]])
    assert torch.equal(rows, golden["engram_rows"])
