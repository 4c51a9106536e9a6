"""The QAT roundings of the V4.1 forward: FP8 window KV, FP4 compressed KV and indexer q/k."""

from __future__ import annotations

import torch

from ds4d.models.deepseek_v41.qat import pow2_ceil, round_e2m1, round_fp4_blocks, round_fp8_blocks


def test_pow2_ceil_is_exact():
    t = torch.tensor([1.0, 1.5, 2.0**-20, 3.0, 0.75, 448.0])
    assert pow2_ceil(t).tolist() == [1.0, 2.0, 2.0**-20, 4.0, 1.0, 512.0]


def test_e2m1_rounds_ties_to_the_even_code():
    q = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, -0.75, -2.5, 6.0])
    assert round_e2m1(q).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, -1.0, -2.0, 6.0]


def test_e2m1_is_the_nearest_code_with_ties_to_even_everywhere():
    """Every float32 in [-6, 6] on a fine grid (all the midpoints on it, and their neighbours one ulp
    away) against the nearest of the eight magnitudes by distance, a tie going to the even code."""
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    grid = torch.linspace(0, 6, 48_001)
    q = torch.cat([grid, torch.nextafter(grid, torch.tensor(7.0)), torch.nextafter(grid, torch.tensor(-1.0))])
    q = torch.cat([q, -q]).clamp(-6, 6)
    distance = (q.abs().unsqueeze(-1) - magnitudes).abs()
    nearest = distance == distance.min(-1, keepdim=True).values
    odd = torch.arange(8) % 2 == 1
    code = torch.where(nearest & ~odd, 0, 1).argmin(-1)  # an even code among the nearest if there is one
    code = torch.where(nearest.sum(-1) > 1, code, nearest.int().argmax(-1))
    assert torch.equal(round_e2m1(q), torch.copysign(magnitudes[code], q))


def test_fp4_with_power_of_two_scales():
    x = torch.zeros(32)
    x[:4] = torch.tensor([12.0, 1.0, -3.0, 5.0])  # amax 12 -> scale 2: 6, 0.5, -1.5, 2.5 -> 2
    out = round_fp4_blocks(x, 32)
    assert out[:4].tolist() == [12.0, 1.0, -3.0, 4.0] and not out[4:].any()


def test_fp4_with_e4m3_scales_per_16():
    x = torch.zeros(2, 16)
    x[0, :3] = torch.tensor([3.0, 1.3, -0.2])  # scale 0.5: 6, 2.6 -> 3 (1.5), -0.4 -> -0.5 (-0.25)
    x[1, 0] = 7.0  # 7/6 rounds to e4m3 1.125: 7/1.125 = 6.22 -> clamped 6 -> 6.75
    out = round_fp4_blocks(x, 16, e4m3_scales=True)
    assert out[0, :3].tolist() == [3.0, 1.5, -0.25]
    assert out[1, 0].item() == 6.75


def test_fp8_block_scale_and_round_to_nearest_even():
    x = torch.zeros(64)
    x[0], x[1] = 100.0, 1.0  # scale 2^-2: 400 lies between e4m3 384 and 416 -> 384 (even)
    x[32] = 448.0
    out = round_fp8_blocks(x)
    assert out[0].item() == 96.0 and out[1].item() == 1.0 and out[32].item() == 448.0


def test_widths_that_do_not_split_into_blocks_pass_through():
    x = torch.randn(3, 24)
    assert round_fp8_blocks(x) is x and round_fp4_blocks(x, 16) is x


def test_roundings_keep_the_input_dtype_and_are_idempotent():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for rounding in (round_fp8_blocks, lambda t: round_fp4_blocks(t, 32)):
        once = rounding(x)
        assert once.dtype == x.dtype and torch.equal(rounding(once), once)
