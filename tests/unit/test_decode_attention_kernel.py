"""``decode_triton.decode_attention`` (the decode step's attention split over parts of each row's keys, the parts
merged with the sink by a second kernel) against the attention written out in torch, in float32: Triton's
interpreter on the CPU, the compiled kernels on a CUDA device.  The rows are chosen so that whole parts have no
live key: a ring not yet full, a row with no closed entry, entries past the visible ones in the block table, and
picks that name entries not yet visible."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ds4d.cuda import decode_triton
from ds4d.models.deepseek_v4.ops import apply_rope, rms_norm

HEADS, D, WINDOW, PER_BLOCK, RATIO = 16, 64, 128, 32, 4
POSITIONS = (2, 133, 300, 700)
"""A ring of 3 slots and no entry; a ring just wrapped and 33 entries (a last part of one); 75 entries; 175 of
the table's 192."""


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, ring, slots, positions, sink, scale, pool=None, table=None, picks=None):
    """Each row's softmax over its live window slots, its visible (or picked and visible) entries and the sink."""
    out = torch.empty_like(q)
    for b, pos in enumerate(positions.tolist()):
        j = torch.arange(WINDOW)
        held = pos - (pos - j) % WINDOW
        keys = [ring[slots[b]][held >= 0]]
        if pool is not None:
            entries = pool[table[b]].flatten(0, 1)
            ids = torch.arange(entries.shape[0]) if picks is None else picks[b].cpu()
            keys.append(entries[ids[ids < (pos + 1) // RATIO]])
        keys = torch.cat(keys)
        logits = torch.cat([q[b] @ keys.T * scale, sink[:, None]], dim=1)
        probs = torch.softmax(logits, dim=1)[:, :-1]
        out[b] = probs @ keys
    return out


@pytest.mark.parametrize("entries", ["none", "every", "picked"])
def test_the_parts_merged_give_the_whole_softmax(entries):
    gen = torch.Generator().manual_seed(len(entries))
    rows = len(POSITIONS)
    q = torch.randn(rows, HEADS, D, generator=gen)
    ring = torch.randn(rows + 1, WINDOW, D, generator=gen)
    slots = torch.tensor([3, 0, 4, 1])
    positions = torch.tensor(POSITIONS)
    sink = torch.randn(HEADS, generator=gen)
    pool = table = picks = None
    if entries != "none":
        pool = torch.randn(40, PER_BLOCK, D, generator=gen)
        table = torch.randperm(40, generator=gen)[: rows * 6].view(rows, 6)  # 192 entry slots a row
        if entries == "picked":
            picks = torch.stack([torch.randperm(192, generator=gen)[:48] for _ in range(rows)])
    scale = D**-0.5
    want = reference(q, ring, slots, positions, sink, scale, pool, table, picks)
    on = [t.to(device()) if t is not None else None for t in (q, ring, slots, positions, sink, pool, table, picks)]
    got = decode_triton.decode_attention(*on[:5], scale, pool=on[5], table=on[6], ratio=RATIO if pool is not None
                                         else 0, picks=on[7]).cpu()
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_parts_of_other_sizes_give_the_same_output(monkeypatch):
    """The part size is a launch setting: 32, 64 and 96 keys a part (96: parts that straddle the window's end)
    give the same output within float32 summation order."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, HEADS, D, generator=gen)
    ring = torch.randn(2, WINDOW, D, generator=gen)
    pool = torch.randn(12, PER_BLOCK, D, generator=gen)
    args = [t.to(device()) for t in (q, ring, torch.tensor([1, 0]), torch.tensor([130, 300]),
                                     torch.randn(HEADS, generator=gen))]
    table = torch.arange(12).view(2, 6).to(device())
    outs = []
    for chunk in (32, 64, 96):
        monkeypatch.setitem(decode_triton.DECODE_TUNING, "chunk", chunk)
        outs.append(decode_triton.decode_attention(*args, D**-0.5, pool=pool.to(device()), table=table,
                                                   ratio=RATIO).cpu())
    for out in outs[1:]:
        assert (out - outs[0]).abs().max().item() < 1e-5 * outs[0].abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * torch.cuda.is_available())
def test_the_output_rotated_back_in_the_merge_equals_the_inverse_rope_after_it(dtype):
    """``unrotate``: the merge rounds the output to its dtype and rotates its last columns back, the values of the
    output without it passed through ``ops.apply_rope(out, cos, -sin)`` (bit for bit in bfloat16; float32 within
    its rounding: on a GPU the two may contract a product and a sum differently).  bfloat16 on a GPU only:
    Triton's interpreter does not run the attention's bfloat16 products."""
    gen = torch.Generator().manual_seed(11)
    rows, pairs = 3, 8
    q = torch.randn(rows, HEADS, D, generator=gen).to(dtype)
    ring = torch.randn(rows, WINDOW, D, generator=gen).to(dtype)
    args = [t.to(device()) for t in (q, ring, torch.tensor([2, 0, 1]), torch.tensor([5, 140, 700]),
                                     torch.randn(HEADS, generator=gen))]
    angles = torch.rand(rows, pairs, generator=gen) * 6
    cos, sin = angles.cos().to(device()), angles.sin().to(device())
    plain = decode_triton.decode_attention(*args, D**-0.5)
    got = decode_triton.decode_attention(*args, D**-0.5, unrotate=(cos, sin))
    want = apply_rope(plain, cos, -sin)
    assert torch.equal(got[..., : D - 2 * pairs], plain[..., : D - 2 * pairs])
    if dtype == torch.float32:
        assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    else:
        assert torch.equal(got.cpu(), want.cpu())
    assert (got - plain).abs().max().item() > 1e-2 * plain.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * torch.cuda.is_available())
def test_the_query_and_kv_norms_in_one_launch_equal_the_operators(dtype):
    """``decode_qkv_norms``: the query's low-rank projection normed (returned) and the KV normed, rotated and
    written to its ring slot, against ``ops.rms_norm`` and ``ops.apply_rope`` (float32: within 1e-5 of the
    largest; bfloat16: nine values in ten the operators' and the others a step or two from them, the two taking
    the norm's inverse square root their own ways; on a GPU only: Triton's interpreter rounds to bfloat16 toward
    zero); nothing else in the rings changes."""
    gen = torch.Generator().manual_seed(12)
    rows, rank, pairs, eps = 3, 96, 8, 1e-6
    q_low = torch.randn(rows, rank, generator=gen).to(dtype)
    kv_low = (torch.randn(rows, D, generator=gen) * 3).to(dtype)
    q_norm, kv_norm = torch.rand(rank, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    angles = torch.rand(rows, pairs, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    ring = torch.randn(4, WINDOW, D, generator=gen).to(dtype)
    slots, positions = torch.tensor([3, 0, 2]), torch.tensor([7, 300, 128])
    on = [t.to(device()) for t in (q_low, kv_low, q_norm, kv_norm, cos, sin, ring.clone(), slots, positions)]
    got_q = decode_triton.decode_qkv_norms(*on, eps).cpu()
    got_ring = on[6].cpu()
    want_q = rms_norm(q_low, q_norm, eps)
    want_kv = apply_rope(rms_norm(kv_low, kv_norm, eps), cos, sin)
    want_ring = ring.clone()
    want_ring[slots, positions % WINDOW] = want_kv
    written = torch.zeros(ring.shape[:2], dtype=torch.bool)
    written[slots, positions % WINDOW] = True
    assert torch.equal(got_ring[~written], ring[~written])
    for got, want, steps in ((got_q.float(), want_q.float(), 1), (got_ring[written].float(), want_ring[written].float(), 2)):
        if dtype == torch.float32:
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        else:  # a bfloat16 step of x is at most 2**-7 |x|; a rotated value mixes two normed ones
            assert ((got - want).abs() <= steps * 2**-7 * torch.maximum(got.abs(), want.abs())).all()
            assert (got == want).float().mean().item() >= 0.9
    assert (got_ring[written] != ring[written]).any()


@pytest.mark.parametrize(("entries", "d"), [("none", D), ("picked", D), ("none", 4 * D), ("picked", 4 * D)])
def test_queries_normed_and_rotated_as_read_equal_those_written_first(entries, d):
    """``norm_rope``: the attention over queries as projected, each normed and rotated as the kernel reads it,
    against the attention over the queries ``prefill_triton.head_norm_rope`` wrote first (float32: within the
    order of the norm's sums); the queries themselves are left as they were.  Heads of ``4 * D`` columns are
    read in four pieces, only the last of which holds rotated columns."""
    from ds4d.cuda import prefill_triton

    gen = torch.Generator().manual_seed(13)
    rows, pairs, eps = 2, 8, 1e-6
    q = (torch.randn(rows, HEADS, d, generator=gen) * 4).to(device())
    ring = torch.randn(rows, WINDOW, d, generator=gen).to(device())
    slots, positions = torch.tensor([1, 0]).to(device()), torch.tensor([140, 700]).to(device())
    sink = torch.randn(HEADS, generator=gen).to(device())
    angles = torch.rand(rows, pairs, generator=gen) * 6
    cos, sin = angles.cos().to(device()), angles.sin().to(device())
    extra = {}
    if entries == "picked":
        extra = {"pool": torch.randn(12, PER_BLOCK, d, generator=gen).to(device()), "ratio": RATIO,
                 "table": torch.arange(12).view(2, 6).to(device()),
                 "picks": torch.stack([torch.randperm(192, generator=gen)[:48] for _ in range(rows)]).to(device())}
    before = q.clone()
    got = decode_triton.decode_attention(q, ring, slots, positions, sink, d**-0.5, norm_rope=(cos, sin, eps), **extra)
    assert torch.equal(q, before)
    want = decode_triton.decode_attention(prefill_triton.head_norm_rope(q.clone(), cos, sin, eps), ring, slots,
                                          positions, sink, d**-0.5, **extra)
    plain = decode_triton.decode_attention(q, ring, slots, positions, sink, d**-0.5, **extra)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    assert (plain - want).abs().max().item() > 1e-2 * want.abs().max().item()
