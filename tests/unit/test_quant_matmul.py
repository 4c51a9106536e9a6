"""The FP8 / MXFP4 weight kernels (``ds4d.cuda.quant_matmul``) in Triton's CPU interpreter.

Same kernel source as on the GPU (tests/gpu/test_quant_matmul_gpu.py runs it
compiled), here on float32 CPU tensors, against "decode the weight with
``quant.py``, then multiply" in plain torch.  Shapes that are not multiples of
the tiles or of the 128-wide scale blocks, rows sharing an expert, experts
with no rows, and an empty batch.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from ds4d.cuda import quant_matmul as qm
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4, quantize_fp8_block, quantize_mxfp4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA device is present: tests/gpu/test_quant_matmul_gpu.py checks the compiled kernels")
    assert qm.available()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6


def _fp8(n: int, k: int, gen: torch.Generator, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scales, the float32 values they stand for)."""
    weight, scale = quantize_fp8_block(torch.randn(n, k, generator=gen) * 3, (block, block))
    factors = scale.view(torch.uint8).int().sub(127).float().exp2()
    return weight, factors, dequant_fp8_block(weight, scale, (block, block))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 128), (3, 200, 300), (8, 20, 1100), (20, 33, 256), (70, 130, 129), (300, 70, 260)])
def test_fp8_linear_matches_decoded_matmul(m, n, k):
    gen = torch.Generator().manual_seed(m * 7 + n)
    weight, scale, values = _fp8(n, k, gen)
    x = torch.randn(m, k, generator=gen)
    _close(qm.fp8_linear(x, weight, scale), x @ values.T)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 70, 300), (20, 33, 64), (300, 70, 130)])
def test_fp8_linear_with_32_by_32_scale_blocks(m, n, k):
    """DeepSeek-V4.1's FP8 layout: a scale per 32 x 32 weights, on each of the three paths (GEMV,
    tiles, decode-then-matmul), with edges that end mid-block."""
    gen = torch.Generator().manual_seed(m * 11 + n)
    weight, scale, values = _fp8(n, k, gen, block=32)
    assert scale.shape == (-(-n // 32), -(-k // 32))
    x = torch.randn(m, k, generator=gen)
    _close(qm.fp8_linear(x, weight, scale, block=32), x @ values.T)
    assert torch.equal(qm.fp8_dequant(weight, scale, torch.float32, block=32), values)
    with pytest.raises(ValueError, match="scale blocks"):
        qm.fp8_linear(x, weight, scale, block=48)


def _mxfp4_bank(experts: int, n: int, k: int, gen: torch.Generator):
    """(packed uint8 [E, N, K/2], scale bytes [E, N, K/32], float32 values [E, N, K])."""
    packed, scales, values = [], [], []
    for _ in range(experts):
        w, s = quantize_mxfp4(torch.randn(n, k, generator=gen))
        packed.append(w.view(torch.uint8))
        scales.append(s.view(torch.uint8))
        values.append(dequant_mxfp4(w, s))
    return torch.stack(packed), torch.stack(scales), torch.stack(values)


@pytest.mark.parametrize(("experts", "n", "k", "rows"), [(4, 10, 96, 5), (3, 7, 1056, 2), (2, 4, 32, 1)])
def test_mxfp4_rows_match_decoded_matmul(experts, n, k, rows):
    gen = torch.Generator().manual_seed(experts + n + k)
    packed, scales, values = _mxfp4_bank(experts, n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    ids = torch.randint(0, experts, (rows,), generator=gen)
    _close(qm.mxfp4_rows(x, packed, scales, ids), torch.einsum("rnk,rk->rn", values[ids], x))


def test_mxfp4_row_does_not_depend_on_the_others():
    gen = torch.Generator().manual_seed(5)
    packed, scales, _ = _mxfp4_bank(3, 6, 64, gen)
    x = torch.randn(4, 64, generator=gen)
    ids = torch.tensor([0, 2, 2, 1])
    together = qm.mxfp4_rows(x, packed, scales, ids)
    for r in range(4):
        assert torch.equal(qm.mxfp4_rows(x[r:r + 1], packed, scales, ids[r:r + 1])[0], together[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("half", "k", "limit", "block_n"), [(10, 96, 0.0, None), (7, 64, 1.5, None), (5, 32, 0.7, 2),
                                                             (6, 1056, 2.0, 4), (5, 64, 1.0, 1)])
def test_gated_mxfp4_rows_equal_the_product_then_its_swiglu(monkeypatch, dtype, half, k, limit, block_n):
    """``gated``: the SwiGLU of the gate rows' and up rows' products in the GEMV's own launch, bit for bit the
    plain GEMV then ``prefill_triton.swiglu`` (the clamp at ``limit``; output widths that end mid-program, the
    kernel's own setting, narrower ones, and one row a program, whose gated launch takes two)."""
    from ds4d.cuda import prefill_triton

    if block_n is not None:
        monkeypatch.setitem(qm.TUNING, "mxfp4_rows_shapes", {f"{2 * half}x{k}": {
            "block_n": block_n, "block_b": 16, "warps": 1, "ptx_decode": True}})
    gen = torch.Generator().manual_seed(half * 31 + k)
    packed, scales, _ = _mxfp4_bank(3, 2 * half, k, gen)
    x = (torch.randn(4, k, generator=gen) * 2).to(dtype)
    ids = torch.tensor([2, 0, 2, 1])
    plain = qm.mxfp4_rows(x, packed, scales, ids)
    want = prefill_triton.swiglu(plain[:, :half], plain[:, half:], limit)
    got = qm.mxfp4_rows(x, packed, scales, ids, gated=limit)
    assert got.shape == (4, half) and got.dtype == dtype
    assert torch.equal(got, want)
    if limit:  # the clamp bites on these values, so the check above covers it
        assert not torch.equal(want, prefill_triton.swiglu(plain[:, :half], plain[:, half:], 0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("half", "k", "limit", "block_n"), [(128, 256, 0.0, None), (40, 300, 1.5, 1), (24, 128, 0.5, 4)])
def test_gated_fp8_rows_equal_the_product_then_its_swiglu(monkeypatch, dtype, half, k, limit, block_n):
    """The FP8 GEMV's ``gated`` launch (a shared expert's ``w1`` rows over its ``w3`` rows): bit for bit the plain
    GEMV then ``prefill_triton.swiglu``; a shape's own setting of one row a program takes two gated."""
    from ds4d.cuda import prefill_triton

    if block_n is not None:
        monkeypatch.setitem(qm.TUNING, "fp8_rows_shapes", {f"{2 * half}x{k}": {
            "most_rows": 1, "block_n": block_n, "block_k": 128, "warps": 1}})
    gen = torch.Generator().manual_seed(half + k)
    weight, scale, _ = _fp8(2 * half, k, gen)
    x = (torch.randn(1, k, generator=gen) * 0.3).to(dtype)
    plain = qm.fp8_linear(x, weight, scale)
    want = prefill_triton.swiglu(plain[:, :half], plain[:, half:], limit)
    got = qm.fp8_linear(x, weight, scale, gated=limit)
    assert got.shape == (1, half) and torch.equal(got, want)
    assert qm.fp8_gated_fits(1, 2 * half) and not qm.fp8_gated_fits(2, 2 * half) and not qm.fp8_gated_fits(1, 7)
    with pytest.raises(ValueError, match="gated"):
        qm.fp8_linear(torch.cat([x, x]), weight, scale, gated=limit)


def test_gated_mxfp4_rows_refuse_an_odd_matrix():
    gen = torch.Generator().manual_seed(2)
    packed, scales, _ = _mxfp4_bank(1, 7, 32, gen)
    with pytest.raises(ValueError, match="gated"):
        qm.mxfp4_rows(torch.randn(1, 32), packed, scales, torch.tensor([0]), gated=0.0)


class _Launches:
    """A kernel whose launches are recorded (their block sizes) and then run."""

    def __init__(self, kernel) -> None:
        self.kernel, self.blocks = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.blocks.append({k: v for k, v in kwargs.items() if k.startswith("block_")})
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_settings_of_one_shape_replace_the_kernels_own_for_that_shape_only(monkeypatch):
    gen = torch.Generator().manual_seed(13)
    fp8 = _Launches(qm._kernels().fp8_rows_kernel)
    mxfp4 = _Launches(qm._kernels().mxfp4_rows_kernel)
    monkeypatch.setattr(qm._kernels(), "fp8_rows_kernel", fp8)
    monkeypatch.setattr(qm._kernels(), "mxfp4_rows_kernel", mxfp4)
    monkeypatch.setitem(qm.TUNING, "fp8_rows_shapes", {"40x256": {"most_rows": 1, "block_n": 8, "block_k": 128,
                                                                  "warps": 1}})
    monkeypatch.setitem(qm.TUNING, "mxfp4_rows_shapes", {"6x64": {"block_n": 2, "block_b": 16, "warps": 1,
                                                                  "ptx_decode": True}})
    x = torch.randn(1, 256, generator=gen)
    for n in (40, 24):
        weight, scale, values = _fp8(n, 256, gen)
        _close(qm.fp8_linear(x, weight, scale), x @ values.T)
    default = qm.TUNING["fp8_rows"]
    assert fp8.blocks == [{"block_n": 8, "block_k": 128}, {"block_n": default["block_n"], "block_k": default["block_k"]}]
    x = torch.randn(2, 64, generator=gen)
    ids = torch.tensor([1, 0])
    for n in (6, 5):
        packed, scales, values = _mxfp4_bank(2, n, 64, gen)
        _close(qm.mxfp4_rows(x, packed, scales, ids), torch.einsum("rnk,rk->rn", values[ids], x))
    default = qm.TUNING["mxfp4_rows"]
    assert mxfp4.blocks == [{"block_n": 2, "block_b": 16},
                            {"block_n": default["block_n"], "block_b": default["block_b"]}]


def test_expert_tiles_cover_each_group_once():
    counts = torch.tensor([3, 0, 9, 4, 0])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    expert, first, end = qm.expert_tiles(offsets, int(counts.sum()), 4)
    assert expert.shape[0] == 16 // 4 + 5
    covered = []
    for e, a, b in zip(expert.tolist(), first.tolist(), end.tolist()):
        if a == b:
            continue
        assert 0 < b - a <= 4
        lo = int(offsets[e] - counts[e])
        assert lo <= a and b <= int(offsets[e])
        covered.extend(range(a, b))
    assert covered == list(range(16))
    live = [(e, a, b) for e, a, b in zip(expert.tolist(), first.tolist(), end.tolist()) if a < b]
    assert [e for e, _, _ in live] == [0, 2, 2, 2, 3]


@pytest.mark.parametrize(("counts", "n", "k"), [([5, 0, 70, 1, 14], 70, 160), ([0, 0, 3], 20, 64)])
def test_mxfp4_grouped_matches_decoded_matmul(counts, n, k):
    gen = torch.Generator().manual_seed(sum(counts) + n)
    experts = len(counts)
    packed, scales, values = _mxfp4_bank(experts, n, k, gen)
    of_row = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    x = torch.randn(of_row.shape[0], k, generator=gen)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    _close(qm.mxfp4_grouped(x, packed, scales, offsets), torch.einsum("rnk,rk->rn", values[of_row], x))


def test_empty_batches():
    gen = torch.Generator().manual_seed(9)
    weight, scale, _ = _fp8(16, 128, gen)
    assert qm.fp8_linear(torch.zeros(0, 128), weight, scale).shape == (0, 16)
    packed, scales, _ = _mxfp4_bank(2, 4, 32, gen)
    assert qm.mxfp4_rows(torch.zeros(0, 32), packed, scales, torch.zeros(0, dtype=torch.long)).shape == (0, 4)
    assert qm.mxfp4_grouped(torch.zeros(0, 32), packed, scales, torch.tensor([0, 0], dtype=torch.int32)).shape == (0, 4)


def test_gather_cold_copies_only_rows_on_the_host():
    """Each row whose expert sits on the host gets that expert's words, whole (a length that is not
    a multiple of the kernel's block); rows of device experts keep what scratch held."""
    torch.manual_seed(0)
    words = 4096 * 2 + 123
    experts = torch.randint(-2**62, 2**62, (5, words), dtype=torch.int64)
    table = torch.tensor([experts[e].data_ptr() for e in range(5)], dtype=torch.int64)
    on_host = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int64)
    rows = torch.tensor([4, 1, 0, 4, 3, 2], dtype=torch.int64)
    dst = torch.full((8, words), -1, dtype=torch.int64)
    qm.gather_cold(table, on_host, rows, dst)
    for r, e in enumerate(rows.tolist()):
        if on_host[e]:
            assert torch.equal(dst[r], experts[e])
        else:
            assert (dst[r] == -1).all()
    assert (dst[len(rows):] == -1).all()


@pytest.mark.parametrize("programs", [0, 1, 3])
def test_fetch_rows_copies_the_rows_asked_for_in_any_number_of_programs(programs):
    """``fetch_rows``: each row whose flag is set gets its expert's words whole, however many programs
    share a row (0: one per 4,096 words; 1: one program loops over the row; 3: parts that end inside a
    block); the other rows keep what was there."""
    torch.manual_seed(1)
    words = 4096 * 3 + 77
    experts = torch.randint(-2**62, 2**62, (4, words), dtype=torch.int64)
    table = torch.tensor([experts[e].data_ptr() for e in range(4)], dtype=torch.int64)
    rows = torch.tensor([3, 3, 0, 2, 1], dtype=torch.int64)
    need = torch.tensor([True, False, True, True, False])
    dst = torch.full((6, words), -1, dtype=torch.int64)
    qm.fetch_rows(table, need, rows, dst, programs=programs)
    for r, e in enumerate(rows.tolist()):
        assert torch.equal(dst[r], experts[e]) if need[r] else (dst[r] == -1).all()
    assert (dst[len(rows):] == -1).all()
