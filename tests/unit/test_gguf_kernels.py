"""GGUF block kernels (``ds4d.cuda.gguf_matmul``) against the ``gguf`` package's numpy dequantisers.

Dequantisation, a GEMV (one matrix, or each row its expert's) and tensor-core tiles (a batch, or
rows grouped by expert).  Two sources of blocks per type: every tensor of that type in the tiny
V4 files llama.cpp's own ``llama-quantize`` wrote (tests/fixtures/gguf_v4), and random bytes
(every bit pattern of the codes, scales and signs) with finite float16 scale fields.  The decoded
values must be the numpy dequantiser's bit for bit; the products those of the dequantised values
within float32 summation order.  Triton's interpreter runs them here; on a CUDA machine the same
tests run the compiled kernels on the device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")

from ds4d.cuda import gguf_matmul  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf_v4"
FILES = {"Q8_0": "converted.gguf", "Q2_K": "quant-Q2_K.gguf", "IQ2_XXS": "quant-IQ2_XXS.gguf",
         "Q4_K": "quant-Q4_K_M.gguf", "Q6_K": "quant-Q6_K.gguf", "Q5_K": "quant-Q5_K_M.gguf",
         "Q3_K": "quant-Q3_K_M.gguf", "IQ4_XS": "quant-IQ4_XS.gguf", "IQ3_XXS": "quant-IQ3_XXS.gguf",
         "IQ2_XS": "quant-IQ2_XS.gguf", "MXFP4": "converted.gguf"}
"""A fixture holding tensors of each type (the converter's own file: Q8_0 linears, MXFP4 experts)."""
HALVES = {"Q8_0": (0,), "Q2_K": (80, 82), "IQ2_XXS": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_K": (0, 2),
          "Q3_K": (108,), "IQ4_XS": (0,), "IQ3_XXS": (0,), "IQ2_XS": (0,), "MXFP4": ()}
"""Byte offsets of each block's float16 fields."""

pytestmark = pytest.mark.skipif(not gguf_matmul.available(), reason="the Triton kernels cannot run here")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def numpy_values(raw: np.ndarray, qtype: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def fixture_tensors(qtype: str) -> list[np.ndarray]:
    """The raw blocks ``[rows, row_bytes]`` of every tensor of ``qtype`` in its fixture file."""
    reader = gguf.GGUFReader(FIXTURES / FILES[qtype])
    out = [np.array(t.data).reshape(t.data.shape[0], -1) for t in reader.tensors
           if t.tensor_type.name == qtype]
    assert out, f"{FILES[qtype]} holds no {qtype} tensor"
    return out


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    values, nbytes = gguf_matmul.block_shape(qtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for at in HALVES[qtype]:
        halves = rng.uniform(1e-3, 2e-2, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, at:at + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype == "MXFP4":  # a ue8m0 scale near 1 (the random tests' products stay finite); 0 and 1 as well
        raw[:, :, 0] = rng.integers(118, 134, size=raw.shape[:2])
        raw[0, :2, 0] = (0, 1)  # the two scales llama.cpp decodes apart (below the normal range)
    return raw.reshape(rows, -1)


def cases(qtype: str) -> list[np.ndarray]:
    return fixture_tensors(qtype)[:4] + [random_blocks(qtype, 24, 512, seed=len(qtype)),
                                         random_blocks(qtype, 5, 256, seed=3)]


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.TYPES))
def test_dequantize_is_the_numpy_dequantiser_bit_for_bit(qtype):
    for raw in cases(qtype):
        values, nbytes = gguf_matmul.block_shape(qtype)
        cols = raw.shape[1] // nbytes * values
        want = numpy_values(raw, qtype).reshape(raw.shape[0], cols)
        got = gguf_matmul.dequantize(torch.from_numpy(raw).to(device()), qtype, cols).cpu().numpy()
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)), qtype


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.TYPES))
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_is_the_product_with_the_dequantised_weight(qtype, rows):
    gen = torch.Generator().manual_seed(rows)
    for raw in cases(qtype)[-3:]:
        values, nbytes = gguf_matmul.block_shape(qtype)
        cols = raw.shape[1] // nbytes * values
        weight = torch.from_numpy(numpy_values(raw, qtype).reshape(raw.shape[0], cols).astype(np.float32))
        x = torch.randn(rows, cols, generator=gen)
        want = (x.double() @ weight.double().T).float()
        got = gguf_matmul.gemv(x.to(device()), torch.from_numpy(raw).to(device()), qtype).cpu()
        scale = (x.abs().double() @ weight.abs().double().T).float()  # the sum of magnitudes bounds the rounding
        assert got.shape == want.shape
        assert bool(((got - want).abs() <= 1e-5 * scale + 1e-30).all()), qtype


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.BLOCKWISE))
@pytest.mark.parametrize("cols, inputs", [(256, 2), (1280, 11)])
def test_blockwise_gemv_against_the_element_wise_one(qtype, cols, inputs):
    """The block-by-block GEMV (``gguf_gemv``) and the element-wise one give the product of the same
    decoded values, for a width that leaves a trip of the loop part full (1,280: five blocks of 256, or
    forty of 32 in trips of sixteen), a weight row count that leaves a program part full, and input rows
    that leave one (eleven: a program of eight, then one of three)."""
    raw = random_blocks(qtype, 21, cols, seed=cols)
    weight = torch.from_numpy(numpy_values(raw, qtype).reshape(21, cols).astype(np.float32))
    x = torch.randn(inputs, cols, generator=torch.Generator().manual_seed(11))
    raw_t = torch.from_numpy(raw).to(device())
    fast = gguf_matmul.gemv(x.to(device()), raw_t, qtype).cpu()
    plain = gguf_matmul.gemv(x.to(device()), raw_t, qtype, blockwise=False).cpu()
    assert within_rounding(fast, x, weight.expand(inputs, -1, -1))
    assert within_rounding(plain, x, weight.expand(inputs, -1, -1))
    if inputs > 8:  # a row's sums do not depend on the rows beside it (in a program of eight, or of three)
        assert torch.equal(gguf_matmul.gemv(x[:5].to(device()), raw_t, qtype).cpu(), fast[:5])
        assert torch.equal(gguf_matmul.gemv(x[8:].to(device()), raw_t, qtype).cpu()[1:], fast[9:])


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.BLOCKWISE))
def test_blockwise_gemv_with_its_trips_written_out_or_pipelined_sums_the_same(qtype, monkeypatch):
    """``stages`` 0 (no loop: every trip written out) and 3 (the loop pipelined) give the loop's sums bit for bit,
    for one input row and for three, a width of five trips and a part-full one."""
    cols = 1280 if qtype != "Q8_0" else 1312
    raw = torch.from_numpy(random_blocks(qtype, 21, cols, seed=cols + 2)).to(device())
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(13)).to(device())
    got = {}
    for stages in (1, 0, 3):
        monkeypatch.setitem(gguf_matmul.BLOCKWISE, qtype, dict(gguf_matmul.BLOCKWISE[qtype], stages=stages))
        got[stages] = [gguf_matmul.gemv(x[:rows], raw, qtype).cpu() for rows in (1, 3)]
    for stages in (0, 3):
        for mine, looped in zip(got[stages], got[1]):
            differ = (mine.view(torch.int32) != looped.view(torch.int32)).nonzero().tolist()
            assert not differ, (f"stages {stages}, {len(mine)} input rows: {len(differ)} sums differ, first at "
                                f"{differ[:4]}: {[(mine[i, j].item(), looped[i, j].item()) for i, j in differ[:4]]}")


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.BLOCKWISE))
def test_blockwise_dequantize_against_the_element_wise_one(qtype):
    """The block-wise decoders give the element-wise kernel's values bit for bit, for a width that is not
    a whole number of 256-value trips for Q8_0 and rows that leave a program part full."""
    cols = 288 if qtype == "Q8_0" else 512
    raw = torch.from_numpy(random_blocks(qtype, 21, cols, seed=cols + 1)).to(device())
    fast = gguf_matmul.dequantize(raw, qtype, cols)
    plain = gguf_matmul.dequantize(raw, qtype, cols, blockwise=False)
    assert torch.equal(fast.view(torch.int32), plain.view(torch.int32))


def bank(qtype: str, experts: int, rows: int, cols: int) -> tuple[np.ndarray, torch.Tensor]:
    """(raw ``[E, rows, row_bytes]``, its values ``[E, rows, cols]`` by the numpy dequantiser)."""
    raw = np.stack([random_blocks(qtype, rows, cols, seed=100 + e) for e in range(experts)])
    values = np.stack([numpy_values(r, qtype).reshape(rows, cols) for r in raw])
    return raw, torch.from_numpy(values.astype(np.float32))


def within_rounding(got: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, tolerance: float = 1e-5) -> bool:
    """``got [M, N]`` against ``x[m] @ weights[m].T`` (``weights [M, N, K]``), by the magnitudes summed."""
    want = torch.einsum("mk,mnk->mn", x.double(), weights.double())
    scale = torch.einsum("mk,mnk->mn", x.abs().double(), weights.abs().double())
    return got.shape == want.shape and bool(((got.double() - want).abs() <= tolerance * scale + 1e-30).all())


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.TYPES))
def test_gemv_by_expert_takes_each_rows_own_matrix(qtype):
    """A decode step's (row, expert) pairs: each row times its expert's matrix from a bank of four."""
    raw, values = bank(qtype, 4, 24, 512)
    experts = torch.tensor([3, 0, 3, 1, 2])
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
    got = gguf_matmul.gemv(x.to(device()), torch.from_numpy(raw).to(device()), qtype, experts.to(device())).cpu()
    assert within_rounding(got, x, values[experts])


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.TYPES))
def test_gemv_by_address_is_the_gemv_by_expert_bit_for_bit(qtype):
    """Each row's matrix found by address (zero-copy decode of offloaded experts): here matrices in three
    separate tensors, one of them twice, give what the same matrices stacked as a bank give by index,
    bit for bit when the addresses are promised aligned, and within float32 rounding when not."""
    raw, values = bank(qtype, 3, 24, 512)
    apart = [torch.from_numpy(raw[e].copy()).to(device()) for e in range(3)]
    experts = torch.tensor([2, 0, 2, 1, 1])
    addresses = torch.tensor([apart[e].data_ptr() for e in experts.tolist()], dtype=torch.int64)
    assert all(a % 16 == 0 for a in addresses.tolist())
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6)).to(device())
    want = gguf_matmul.gemv(x, torch.from_numpy(raw).to(device()), qtype, experts.to(device()))
    got = gguf_matmul.gemv_at(x, addresses.to(device()), qtype, 24, aligned=True)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    loose = gguf_matmul.gemv_at(x, addresses.to(device()), qtype, 24)
    assert within_rounding(loose.cpu(), x.cpu(), values[experts])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_linear_decodes_a_large_weight_a_slice_of_rows_at_a_time(qtype):
    """``linear`` past its GEMV rows with ``decoded_rows`` (a GGUF output head): the weight decoded 7 rows
    at a time (the last slice part-full), the same product as the weight decoded whole."""
    raw, values = bank(qtype, 1, 30, 256)
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(8))
    weight = torch.from_numpy(raw[0]).to(device())
    got = gguf_matmul.linear(x.to(device()), weight, qtype, gemv_rows=4, decoded_rows=7).cpu()
    assert within_rounding(got, x, values[0].expand(12, -1, -1))
    whole = gguf_matmul.linear(x.to(device()), weight, qtype, gemv_rows=4).cpu()
    assert within_rounding(whole, x, values[0].expand(12, -1, -1))


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.TYPES))
def test_tiles_for_a_batch_and_grouped_by_expert(qtype):
    """Tensor-core tiles in float32 (IEEE, not TF32): a batch of 40 rows times one matrix, and 70 rows
    sorted by expert (groups of 0, 33, 1 and 36 rows: a group past one tile, an empty one) times a bank."""
    raw, values = bank(qtype, 4, 40, 256)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 256, generator=gen)
    got = gguf_matmul.tiles(x.to(device()), torch.from_numpy(raw[1]).to(device()), qtype).cpu()
    assert within_rounding(got, x, values[1].expand(40, -1, -1))
    counts = [0, 33, 1, 36]
    of_row = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    x = torch.randn(sum(counts), 256, generator=gen)
    got = gguf_matmul.tiles(x.to(device()), torch.from_numpy(raw).to(device()), qtype, offsets.to(device())).cpu()
    assert within_rounding(got, x, values[of_row])


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.BLOCKWISE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_tiles_against_the_element_wise_ones(qtype, dtype):
    """The block-wise tiles (each trip's values decoded once for a tile of rows) and the element-wise ones give
    the product of the same decoded values, in float32 and from bfloat16 rows (the weights rounded to bfloat16
    as the element-wise tiles round them): groups of 0, 150 (past a tile of 64 or 128 rows), 1 and 36 rows over a
    width of two trips (Q8_0: 288, a trip and a part), weight rows that leave a program part full, and spare
    tiles."""
    if dtype != torch.float32 and device() == "cpu":
        pytest.skip("Triton's interpreter multiplies bfloat16 tiles wrongly (the element-wise tiles as well)")
    cols = 288 if qtype == "Q8_0" else 512
    raw, values = bank(qtype, 4, 40, cols)
    counts = [0, 150, 1, 36]
    of_row = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device())
    x = torch.randn(sum(counts), cols, generator=torch.Generator().manual_seed(12)).to(dtype)
    raw_t = torch.from_numpy(raw).to(device())
    fast = gguf_matmul.tiles(x.to(device()), raw_t, qtype, offsets).cpu()
    plain = gguf_matmul.tiles(x.to(device()), raw_t, qtype, offsets, blockwise=False).cpu()
    weights = values[of_row].to(dtype).float()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16 on CUDA: the tensor cores' own sums
    assert within_rounding(fast, x.float(), weights, tolerance)
    assert within_rounding(plain, x.float(), weights, tolerance)


def test_bad_shapes_and_types_are_refused():
    raw = torch.zeros(2, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiples of 32"):
        gguf_matmul.dequantize(raw, "Q8_0", 40)
    with pytest.raises(ValueError, match=r"uint8 \[N, 68\]"):
        gguf_matmul.dequantize(raw, "Q8_0", 64)
    with pytest.raises(ValueError, match="no GGUF kernel for IQ1_S"):
        gguf_matmul.block_shape("IQ1_S")
    with pytest.raises(ValueError, match="a bank"):
        gguf_matmul.gemv(torch.zeros(1, 32), raw, "Q8_0", torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.BLOCKWISE))
def test_blockwise_kernels_refuse_blocks_off_a_word(qtype):
    """The block-wise kernels read blocks in 16-bit words (and 32-bit for Q2_K): blocks that start off such a
    word are refused with a message (and the element-wise kernels still decode them, to the same values)."""
    values, nbytes = gguf_matmul.block_shape(qtype)
    raw = random_blocks(qtype, 2, values, seed=9)
    word = gguf_matmul.WORD_BYTES[qtype]
    store = torch.zeros(raw.size + word, dtype=torch.uint8, device=device())
    for offset in range(1, word):
        shifted = store[offset:offset + raw.size].view(2, nbytes)  # off an allocation's start, so off a word
        shifted.copy_(torch.from_numpy(raw))
        with pytest.raises(ValueError, match=f"multiple of {word} bytes"):
            gguf_matmul.dequantize(shifted, qtype, values)
        with pytest.raises(ValueError, match=f"multiple of {word} bytes"):
            gguf_matmul.gemv(torch.ones(1, values, device=shifted.device), shifted, qtype)
        plain = gguf_matmul.dequantize(shifted, qtype, values, blockwise=False).cpu().numpy()
        assert np.array_equal(plain, numpy_values(raw, qtype).reshape(2, values).astype(np.float32))
    rows = torch.from_numpy(random_blocks(qtype, 3, values, seed=10)).to(device())
    assert torch.equal(gguf_matmul.dequantize(rows[1:], qtype, values),  # a slice of whole rows is on a word
                       gguf_matmul.dequantize(rows, qtype, values)[1:])


@pytest.mark.parametrize("qtype", sorted(gguf_matmul.BLOCKWISE))
def test_products_stored_in_another_dtype_are_the_float32_ones_rounded(qtype):
    """``out_dtype``: each kernel rounds its float32 sums once as it stores them, giving what ``.to(out_dtype)``
    of its float32 result gives, bit for bit (the model's linears ask for their activations' dtype, so no cast
    runs after them): the block-wise and element-wise GEMVs, by expert, on int8 inputs, and both tiles."""
    raw, _ = bank(qtype, 3, 24, 512)
    bank_t, matrix = torch.from_numpy(raw).to(device()), torch.from_numpy(raw[1]).to(device())
    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(5, 512, generator=gen) * 3).to(device())
    experts = torch.tensor([2, 0, 2, 1, 1]).to(device())
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32).to(device())
    products = {
        "block-wise GEMV": lambda **o: gguf_matmul.gemv(x[:3], matrix, qtype, **o),
        "element-wise GEMV": lambda **o: gguf_matmul.gemv(x[:1], matrix, qtype, blockwise=False, **o),
        "GEMV by expert": lambda **o: gguf_matmul.gemv(x, bank_t, qtype, experts, **o),
        "int8 inputs": lambda **o: gguf_matmul.dot_gemv(x, bank_t, qtype, experts, **o),
        "tiles": lambda **o: gguf_matmul.tiles(x, bank_t, qtype, offsets, **o),
        "element-wise tiles": lambda **o: gguf_matmul.tiles(x, bank_t, qtype, offsets, blockwise=False, **o),
    }
    for name, product in products.items():
        wide, got = product(), product(out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16, name
        assert torch.equal(got.cpu().view(torch.int16), wide.to(torch.bfloat16).cpu().view(torch.int16)), name
