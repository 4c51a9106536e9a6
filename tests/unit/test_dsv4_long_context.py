"""Long-context arithmetic of V4's CSA layers against the short-context form, on the tiny checkpoint.

At long contexts a CSA chunk scores the indexer in query blocks
(``SCORE_BLOCK_BYTES``) and attends to each query's picked entries gathered per
query (``SPARSE_FROM``) instead of to every entry through a ``[queries,
entries]`` mask.  Forcing both on a short prompt must give the same logits as
the default path (to float32 rounding: the softmax sums run over fewer
masked-out terms) and the same greedy choices.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.models.deepseek_v4 import attention, load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.paths import ForwardPaths

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=4, layers=[4, 0, 4])
    return load_model(path)


@pytest.mark.parametrize("local_window", [False, True])
def test_blocked_sparse_csa_equals_dense(model, monkeypatch, local_window):
    model = model.with_paths(ForwardPaths(fast_path=local_window))  # the block-by-block window path, as on the GPU
    prompt = [(i * 104729) % 30000 + 20 for i in range(700)]  # 175 CSA entries, 700 > the 128-token window
    dense = model.logits_for(prompt)
    calls = []
    real = attention._indexer_topk
    monkeypatch.setattr(attention, "_indexer_topk", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(attention, "SPARSE_FROM", 0)
    monkeypatch.setattr(attention, "SCORE_BLOCK_BYTES", 4 * 8 * 175 * 100)  # 8 index heads: blocks of 100 queries
    sparse = model.logits_for(prompt)
    assert calls, "the CSA layers went through the indexer"
    assert (sparse - dense).abs().max().item() < 1e-5 * dense.abs().max().item()
    assert torch.equal(sparse.argmax(-1), dense.argmax(-1))


@pytest.mark.parametrize("local_window", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_attention_in_query_blocks_equals_one_block(model, monkeypatch, local_window, sparse):
    """A chunk whose scores would pass ``ATTEND_BLOCK_BYTES`` attends in query blocks (single queries,
    or whole windows on the block-by-block window path), with shared or per-query compressed entries."""
    model = model.with_paths(ForwardPaths(fast_path=local_window))
    if sparse:
        monkeypatch.setattr(attention, "SPARSE_FROM", 0)
    prompt = [(i * 7919) % 30000 + 20 for i in range(600)]
    whole = model.logits_for(prompt)
    blocks = []
    real = attention._query_blocks
    monkeypatch.setattr(attention, "_query_blocks", lambda *a, **k: blocks.append(real(*a, **k)) or blocks[-1])
    monkeypatch.setattr(attention, "ATTEND_BLOCK_BYTES", 1)
    blocked = model.logits_for(prompt)
    window = model.cfg.sliding_window
    assert max(map(len, blocks)) == (-(-600 // window) if local_window else 600)
    assert (blocked - whole).abs().max().item() < 1e-5 * whole.abs().max().item()
    assert torch.equal(blocked.argmax(-1), whole.argmax(-1))
