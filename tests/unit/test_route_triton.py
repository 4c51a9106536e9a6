"""A decode step's routing in one launch (``ds4d.cuda.route_triton``) against ``moe.route``'s torch operators.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py); on a GPU machine the same checks run on
the device.  ``torch.topk(sorted=False)`` leaves the order of the picked experts to the implementation, so the
pairs (expert, weight) are compared as sets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

route_triton = pytest.importorskip("ds4d.cuda.route_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not route_triton.available(), reason="needs Triton (a GPU or the interpreter)")


def _reference(logits, k, scoring, scale, norm, bias=None, table=None, ids=None):
    scores = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid,
              "softmax": lambda x: x.softmax(dim=-1)}[scoring](logits)
    if table is not None:
        indices = table[ids]
    else:
        indices = torch.topk(scores + bias if bias is not None else scores, k, dim=-1).indices
    chosen = scores.gather(1, indices)
    if norm:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen * scale, indices


def _by_expert(weights, indices):
    order = indices.argsort(dim=-1)
    return weights.gather(1, order), indices.gather(1, order)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize(("tokens", "experts", "k"), [(1, 256, 6), (5, 384, 6), (3, 100, 3)])
def test_the_picked_experts_and_their_weights_are_torchs(scoring, tokens, experts, k):
    """Logits wide enough that softplus is past its threshold of 20 and far below zero are included; a
    bias reorders the pick but not the weights."""
    gen = torch.Generator().manual_seed(tokens * experts + k)
    logits = torch.randn(tokens, experts, generator=gen) * 4
    logits[0, 7], logits[-1, 3] = 25.0, -30.0
    bias = torch.randn(experts, generator=gen) * 0.5
    for with_bias, norm in ((True, True), (False, True), (True, False)):
        b = bias if with_bias else None
        got = route_triton.route(logits.to(DEVICE), k, scoring, 1.5, norm, None if b is None else b.to(DEVICE))
        want = _reference(logits, k, scoring, 1.5, norm, b)
        assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64 and got[1].shape == (tokens, k)
        got_w, got_i = _by_expert(*(t.cpu() for t in got))
        want_w, want_i = _by_expert(*want)
        assert torch.equal(got_i, want_i)
        torch.testing.assert_close(got_w, want_w, rtol=2e-6, atol=1e-7)
        # largest biased score first, as picked
        picked_scores = (logits.gather(1, got[1].cpu()))
        if scoring != "softmax" and not with_bias:
            assert torch.all(picked_scores[:, :-1] >= picked_scores[:, 1:])


def test_a_hash_layer_takes_its_experts_from_the_tokens_row():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 64, generator=gen)
    table = torch.randint(0, 64, (50, 6), generator=gen)
    ids = torch.tensor([0, 49, 7, 7])
    got = route_triton.route(logits.to(DEVICE), 6, "sqrtsoftplus", 2.5, True, None, table.to(DEVICE), ids.to(DEVICE))
    want = _reference(logits, 6, "sqrtsoftplus", 2.5, True, table=table, ids=ids)
    assert torch.equal(got[1].cpu(), want[1])  # the table's order, as torch's gather keeps it
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="token ids"):
        route_triton.route(logits, 6, "sqrtsoftplus", 2.5, True, None, table)


def test_equal_scores_pick_the_lowest_ids_and_a_rows_result_is_its_own():
    logits = torch.zeros(2, 32)
    logits[1, 20:] = 1.0
    weights, indices = route_triton.route(logits.to(DEVICE), 4, "sigmoid", 1.0, True)
    assert indices.cpu().tolist() == [[0, 1, 2, 3], [20, 21, 22, 23]]
    torch.testing.assert_close(weights.cpu(), torch.full((2, 4), 0.25))
    alone = route_triton.route(logits[1:].to(DEVICE), 4, "sigmoid", 1.0, True)
    assert torch.equal(alone[0], weights[1:]) and torch.equal(alone[1], indices[1:])


def test_usable_for_float32_logits_of_a_known_scoring():
    assert route_triton.usable(torch.zeros(2, 256), "sqrtsoftplus")
    assert not route_triton.usable(torch.zeros(2, 256, dtype=torch.bfloat16), "sqrtsoftplus")
    assert not route_triton.usable(torch.zeros(2, 256), "noaux")
    assert not route_triton.usable(torch.zeros(2, route_triton.MAX_EXPERTS + 1), "sigmoid")
    assert not route_triton.usable(torch.zeros(256, 2).t(), "sigmoid")


def test_the_kernel_compiles_for_sm90_without_spills():
    """``tests/gpu/route_compile.py`` in a process of its own (the tests run Triton's interpreter, which compiles
    nothing): at V4-Flash's and V4.1-Flash's expert counts, score-routed and hash-routed, no register spills."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
        pytest.skip("this Triton carries no NVIDIA tools")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(root / "tests" / "gpu" / "route_compile.py")], env=env,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    cases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {(c["experts"], c["hashed"]) for c in cases} == {(256, False), (256, True), (384, False)}
    for c in cases:
        assert c["spills"] == 0 and 0 < c["registers"] <= 255 and c["instructions"] > 0, c
