"""The triangular prefill: after the last KV source a layer runs only the rows the last logits and the
state depend on, and gives what running every row gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4d.models.deepseek_v41 import DeepseekV41Config, DeepseekV41Model
from ds4d.models.deepseek_v41.model import row_plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_row_plan_of_the_release():
    cfg = DeepseekV41Config.from_file(FIXTURES / "release_config.json")
    plan = row_plan(cfg, 8192)
    assert plan[39] == (128, 1) and plan[38] == (255, 128)
    assert plan[21] == (1 + 19 * 127, 1 + 18 * 127)
    assert plan[20] == (8192, plan[21][0]) and plan[:20] == [(8192, 8192)] * 20
    assert row_plan(cfg, 100)[30] == (100, 100)  # never more rows than the step has


@pytest.fixture(scope="module", params=("tiny_a", "tiny_b"))
def model(request) -> DeepseekV41Model:
    return DeepseekV41Model.from_pretrained(FIXTURES / request.param)


def same_state(a, b) -> None:
    assert a.position == b.position and torch.equal(a.engram_ids, b.engram_ids)
    for ring_a, ring_b in zip(a.windows, b.windows, strict=True):
        torch.testing.assert_close(ring_a, ring_b, rtol=1e-5, atol=1e-6)
    for source, group in a.groups.items():
        other = b.groups[source]
        torch.testing.assert_close(group.entries.view(), other.entries.view(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(group.index_keys.view(), other.index_keys.view(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(group.tail_kv, other.tail_kv)


@pytest.mark.parametrize("chunk", [None, 9])
def test_triangular_prefill_equals_every_row(model, chunk):
    ids = torch.randint(3, model.cfg.vocab_size, (6 * model.cfg.sliding_window + 1,),
                        generator=torch.Generator().manual_seed(8)).tolist()
    last_source = max(model.cfg.kv_source_layer_ids)
    assert row_plan(model.cfg, len(ids))[-1][0] < len(ids)  # layers after the last source do skip rows
    assert last_source < model.cfg.num_hidden_layers - 1
    full_state, tri_state = model.new_state(), model.new_state()
    full = model.prefill(full_state, ids, chunk)[-1:]
    tri = model.prefill(tri_state, ids, chunk, last_only=True)
    assert tri.shape == (1, model.cfg.vocab_size)
    torch.testing.assert_close(tri, full, rtol=1e-5, atol=1e-5)
    same_state(tri_state, full_state)
    token = int(full.argmax())
    torch.testing.assert_close(model.decode(tri_state, token), model.decode(full_state, token), rtol=1e-5, atol=1e-5)
