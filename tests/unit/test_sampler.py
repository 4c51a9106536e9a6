"""The sampler: its two-pass argmax (used on CUDA) gives ``torch.argmax``'s index, ties included;
sampled rows, drawn together by the exponential race, follow the softmax of the scaled logits within
their top-k / top-p, reproducibly per seed and whatever else shares the batch."""

from __future__ import annotations

import torch

from ds4d.engine.request import SamplingParams
from ds4d.engine.sampler import ARGMAX_SEGMENT, Sampler, greedy_tokens, two_pass_argmax

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.25])


def test_two_pass_argmax_is_argmax():
    gen = torch.Generator().manual_seed(3)
    for width in (129_280, 4 * ARGMAX_SEGMENT, 5 * ARGMAX_SEGMENT + 17):
        logits = torch.randn(6, width, generator=gen)
        logits[1] = 0.0  # all tied: the first index
        logits[2, [7, 300, width - 1]] = 50.0  # tied maxima in different segments: the first of them
        logits[3, [ARGMAX_SEGMENT + 3, ARGMAX_SEGMENT + 9]] = 50.0  # tied within one segment
        logits[4, :width // 2] = float("-inf")
        logits[5, -1] = 99.0  # the maximum in the padded last segment
        want = torch.argmax(logits, dim=-1)
        assert torch.equal(two_pass_argmax(logits), want), width
        assert torch.equal(greedy_tokens(logits), want)
    assert two_pass_argmax(torch.zeros(3, 2 * ARGMAX_SEGMENT)).tolist() == [0, 0, 0]


def _draw(params: SamplingParams, rows: int, prefix: str = "r") -> torch.Tensor:
    sampler = Sampler()
    return sampler.draw(LOGITS.repeat(rows, 1), [(f"{prefix}{i}", params) for i in range(rows)])


def test_sampled_rows_follow_the_scaled_softmax():
    for temperature in (1.0, 0.5):
        tokens = _draw(SamplingParams(temperature=temperature), 20_000)
        freq = torch.bincount(tokens, minlength=len(LOGITS)).float() / len(tokens)
        want = torch.softmax(LOGITS / temperature, dim=-1)
        assert (freq - want).abs().max().item() < 0.015, (temperature, freq, want)


def test_top_k_and_top_p_keep_their_tokens_in_proportion():
    tokens = _draw(SamplingParams(temperature=1.0, top_k=3), 12_000)
    keep = torch.tensor([0, 6, 1])  # the three largest logits
    assert set(tokens.tolist()) == set(keep.tolist())
    freq = torch.bincount(tokens, minlength=len(LOGITS)).float()[keep] / len(tokens)
    assert (freq - torch.softmax(LOGITS[keep], dim=-1)).abs().max().item() < 0.02
    probs = torch.softmax(LOGITS, dim=-1)
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) - probs[order] < 0.7).sum())]  # smallest set reaching 0.7
    tokens = _draw(SamplingParams(temperature=1.0, top_p=0.7), 12_000)
    assert set(tokens.tolist()) == set(nucleus.tolist())
    freq = torch.bincount(tokens, minlength=len(LOGITS)).float()[nucleus] / len(tokens)
    assert (freq - probs[nucleus] / probs[nucleus].sum()).abs().max().item() < 0.02


def test_mixed_rows_seeds_and_batch_independence():
    sampler = Sampler()
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_k=5, top_p=0.9, seed=11)
    rows = [("g", greedy), ("s", seeded), ("k", SamplingParams(temperature=0.8, top_k=2))]
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 2])
    first = [sampler.draw(logits, rows).tolist() for _ in range(6)]
    assert all(t[0] == 0 for t in first) and all(t[2] in (0, 6) for t in first)  # argmax; row 3's top two
    alone = Sampler()
    again = [alone.draw(logits[1:2], [("s2", seeded)]).tolist()[0] for _ in range(6)]
    assert [t[1] for t in first] == again  # the same seed, drawn alone: the same tokens
    assert len(set(again)) > 1


def test_a_zero_noise_draw_never_picks_a_cut_token(monkeypatch):
    """The exponential noise may come out exactly 0; a token cut by top-k must still never be drawn."""
    real = torch.Tensor.exponential_

    def with_zeros(self, *a, **k):
        real(self, *a, **k)
        return self.index_fill_(-1, torch.tensor([5, 7]), 0.0)  # exact zeros on two tokens top-k cuts

    monkeypatch.setattr(torch.Tensor, "exponential_", with_zeros)
    tokens = _draw(SamplingParams(temperature=1.0, top_k=3), 200)  # the race on scaled logits - log(noise)
    assert set(tokens.tolist()) <= {0, 6, 1}
    tokens = _draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.99), 200)  # the race on probs / noise
    assert set(tokens.tolist()) <= {0, 6, 1}
