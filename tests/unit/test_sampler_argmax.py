"""The sampler's two-pass argmax (used on CUDA) gives ``torch.argmax``'s index, ties included."""

from __future__ import annotations

import torch

from ds4d.engine.sampler import ARGMAX_SEGMENT, greedy_tokens, two_pass_argmax


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
