"""The GEMV on int8-quantised inputs (``gguf_matmul.dot_gemv``, ``ds4d.cuda.gguf_dot``).

The inputs' rounding is checked on its own (each value within half its run's scale, the run sums those of the
codes); the product against float64 sums of the numpy dequantiser's weight values times the quantised inputs,
so that the only error allowed is float32's in adding the groups' scaled integer sums.  Blocks: random bytes
(every code, scale and sign pattern) and the tensors llama.cpp's ``llama-quantize`` wrote.  Triton's
interpreter runs them here (``dp4a`` by shifts and multiplies); on a CUDA machine, the compiled kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("triton")

from ds4d.cuda import gguf_matmul
from tests.unit.test_gguf_kernels import device, fixture_tensors, numpy_values, random_blocks

pytestmark = pytest.mark.skipif(not gguf_matmul.available(), reason="the Triton kernels cannot run here")

DOT_TYPES = sorted(gguf_matmul.DOT)


def test_inputs_are_rounded_to_int8_within_half_their_runs_scale():
    torch.manual_seed(0)
    x = torch.randn(3, 288) * torch.logspace(-3, 2, 288)
    x[1, 32:64] = 0.0  # a run of zeros: scale 0, codes 0
    x[2, 64] = -7.5  # a run whose largest magnitude is negative
    q, d, s = gguf_matmul.quantize_rows(x.to(device()))
    q, d, s = q.cpu(), d.cpu(), s.cpu()
    assert q.dtype == torch.int8 and d.shape == (3, 9) and s.shape == (3, 18)
    runs = x.view(3, 9, 32)
    assert torch.allclose(d, runs.abs().amax(dim=2) / 127, rtol=1e-6, atol=0)  # a GPU divides within 2 ulp
    codes = q.view(3, 9, 32).to(torch.float32)
    assert codes.abs().max() <= 127
    assert bool(((codes * d[:, :, None] - runs).abs() <= d[:, :, None] * (0.5 + 1e-5)).all())
    assert torch.equal(q[1, 32:64], torch.zeros(32, dtype=torch.int8)) and d[1, 1] == 0
    assert codes[2, 2, 0] == -127
    assert torch.equal(s, q.view(3, 18, 16).to(torch.int32).sum(dim=2))


def _reference(x: torch.Tensor, raw: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    """float64 sums of the dequantised weight values times ``x`` quantised as the kernel quantises it."""
    q, d, _ = gguf_matmul.quantize_rows(x.to(device()))
    inputs = (q.cpu().to(torch.float64).view(x.shape[0], -1, 32) * d.cpu().to(torch.float64)[:, :, None])
    weights = numpy_values(raw, qtype).reshape(raw.shape[0], cols).astype(np.float64)
    return inputs.view(x.shape[0], cols).numpy() @ weights.T


def _close(got: torch.Tensor, want: np.ndarray) -> None:
    got = got.cpu().numpy().astype(np.float64)
    assert got.shape == want.shape
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2e-6 * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("qtype", DOT_TYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_product_is_the_quantised_inputs_times_the_weight_values(qtype, rows):
    # 768 columns: a trip of two blocks of 256 runs past the row's end once
    for raw in [random_blocks(qtype, 24, 768, seed=7), fixture_tensors(qtype)[0]]:
        values, nbytes = gguf_matmul.block_shape(qtype)
        cols = raw.shape[1] // nbytes * values
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        got = gguf_matmul.dot_gemv(x.to(device()), torch.from_numpy(raw).to(device()), qtype)
        _close(got, _reference(x, raw, qtype, cols))


@pytest.mark.parametrize("qtype", DOT_TYPES)
def test_each_row_takes_its_experts_matrix(qtype):
    experts, n, cols = 5, 12, 512
    raw = random_blocks(qtype, experts * n, cols, seed=11)
    bank = torch.from_numpy(raw).view(experts, n, -1)
    chosen = torch.tensor([3, 0, 3, 4])
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(2))
    got = gguf_matmul.dot_gemv(x.to(device()), bank.to(device()), qtype, chosen.to(device()))
    for m, e in enumerate(chosen.tolist()):
        _close(got[m:m + 1], _reference(x[m:m + 1], bank[e].numpy(), qtype, cols))


@pytest.mark.parametrize("qtype", DOT_TYPES)
def test_matrices_found_by_address_give_the_banks_products(qtype):
    """``gemv_at`` (offloaded experts read in place) with ``int8_inputs``: matrices in separate tensors
    give what the same matrices stacked as a bank give by index, bit for bit with the addresses promised aligned."""
    raw = random_blocks(qtype, 3 * 12, 512, seed=13).reshape(3, 12, -1)
    apart = [torch.from_numpy(raw[e].copy()).to(device()) for e in range(3)]
    experts = torch.tensor([2, 0, 2, 1])
    addresses = torch.tensor([apart[e].data_ptr() for e in experts.tolist()], dtype=torch.int64).to(device())
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(13)).to(device())
    want = gguf_matmul.dot_gemv(x, torch.from_numpy(raw).to(device()), qtype, experts.to(device()))
    assert torch.equal(gguf_matmul.gemv_at(x, addresses, qtype, 12, aligned=True, int8_inputs=True), want)
    loose = gguf_matmul.gemv_at(x, addresses, qtype, 12, int8_inputs=True)
    assert torch.allclose(loose, want, rtol=0, atol=2e-6 * want.abs().max().item())


@pytest.mark.parametrize(("computed_signs", "selector_grid"), [(True, False), (False, True), (True, True)])
def test_iq2_xxs_signs_computed_and_grid_selectors_give_the_tables_sums_bit_for_bit(monkeypatch, computed_signs,
                                                                                   selector_grid):
    """``computed_signs`` (the sign bytes from the pattern's bits and its parity, no table read): every one of the
    128 patterns against the ``gguf`` package's ``ksigns``; ``selector_grid`` (the grid as 4-bit selectors of its
    three magnitudes): every entry's bytes against the grid's.  Then the GEMV's sums, one matrix and rows by
    expert, equal to the tables' bit for bit."""
    from gguf import quants

    from ds4d.cuda import gguf_dot

    table = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8).to(torch.int32)
    want = (table[:, None] >> torch.arange(8)) & 1
    if not torch.cuda.is_available():  # the interpreter: call the kernel's helper as a plain function
        low, high = gguf_dot.sign_bytes.fn(torch.arange(128, dtype=torch.int32), False)
        got = torch.stack([(word[:, None] >> (8 * torch.arange(4))) & 255 for word in (low, high)], 1).view(128, 8)
        assert torch.equal(got, want)
    selectors = gguf_matmul._grid_selectors(torch.device("cpu"))
    magnitudes = torch.tensor(quants.IQ2_XXS.grid_map)[(selectors[:, None] >> (4 * torch.arange(8))) & 15]
    assert torch.equal(magnitudes.to(torch.uint8).view(torch.int32), gguf_matmul._grid_words(torch.device("cpu")))
    experts, n, cols = 3, 16, 1024
    raw = torch.from_numpy(random_blocks("IQ2_XXS", experts * n, cols, seed=17)).to(device())
    bank, chosen = raw.view(experts, n, -1), torch.tensor([2, 0, 2, 1], device=device())
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(17)).to(device())
    launch = {key: gguf_matmul.DOT["IQ2_XXS"][key] for key in ("block_n", "groups", "warps")}
    monkeypatch.setitem(gguf_matmul.DOT, "IQ2_XXS", launch)  # both tables read
    before = [gguf_matmul.dot_gemv(x[:1], raw, "IQ2_XXS"), gguf_matmul.dot_gemv(x, bank, "IQ2_XXS", chosen)]
    monkeypatch.setitem(gguf_matmul.DOT, "IQ2_XXS", {**launch, "computed_signs": computed_signs,
                                                     "selector_grid": selector_grid})
    after = [gguf_matmul.dot_gemv(x[:1], raw, "IQ2_XXS"), gguf_matmul.dot_gemv(x, bank, "IQ2_XXS", chosen)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("qtype", DOT_TYPES)
def test_gated_products_are_the_product_then_its_swiglu_bit_for_bit(qtype, monkeypatch):
    """``gated`` (a feed-forward's gate rows over its up rows): the SwiGLU in the int8 GEMV's epilogue, one row of
    one matrix and rows by expert (also found by address), bit for bit the GEMV then ``prefill_triton.swiglu``;
    without the clamp at the type's launch, with it at a launch of one weight row a program (the gated one takes
    two)."""
    from ds4d.cuda import prefill_triton

    experts, half, cols, dtype = 3, 6, 256, torch.bfloat16
    raw = torch.from_numpy(random_blocks(qtype, experts * 2 * half, cols, seed=23)).to(device())
    bank, chosen = raw.view(experts, 2 * half, -1), torch.tensor([2, 0, 2], device=device())
    x = (torch.randn(3, cols, generator=torch.Generator().manual_seed(23)) * 3).to(device(), dtype)
    apart = [bank[e].clone() for e in range(experts)]  # each its own allocation: aligned addresses
    addresses = torch.tensor([apart[e].data_ptr() for e in chosen.tolist()], dtype=torch.int64).to(device())
    for launch, limit in ((gguf_matmul.DOT[qtype], 0.0), ({**gguf_matmul.DOT[qtype], "block_n": 1}, 1.0)):
        monkeypatch.setitem(gguf_matmul.DOT, qtype, launch)
        for rows, where in [(x[:1], {"raw": bank[1]}), (x, {"raw": bank, "experts": chosen})]:
            plain = gguf_matmul.dot_gemv(rows, out_dtype=dtype, qtype=qtype, **where)
            want = prefill_triton.swiglu(plain[:, :half], plain[:, half:], limit)
            got = gguf_matmul.dot_gemv(rows, out_dtype=dtype, qtype=qtype, gated=limit, **where)
            assert got.shape == (rows.shape[0], half) and torch.equal(got, want)
        at = gguf_matmul.gemv_at(x, addresses, qtype, 2 * half, aligned=True, out_dtype=dtype, int8_inputs=True,
                                 gated=limit)
        assert torch.equal(at, got)
    with pytest.raises(ValueError, match="gated"):
        gguf_matmul.gemv_at(x, addresses, qtype, 2 * half, out_dtype=dtype, gated=0.0)  # float inputs: no kernel


@pytest.mark.parametrize("qtype", DOT_TYPES)
def test_inputs_read_sixteen_bytes_a_load_give_the_same_sums_bit_for_bit(qtype, monkeypatch):
    """``wide_inputs`` (``gguf_dot.input_words``: two of the quantised inputs' 64-bit words in one load): one row,
    rows by expert and a gated product, bit for bit the launch that reads a word a load."""
    experts, n, cols = 3, 8, 512
    raw = torch.from_numpy(random_blocks(qtype, experts * n, cols, seed=31)).to(device())
    bank, chosen = raw.view(experts, n, -1), torch.tensor([2, 0, 2], device=device())
    x = (torch.randn(3, cols, generator=torch.Generator().manual_seed(31)) * 2).to(device())
    cases = [(x[:1], {"raw": bank[1]}, {}), (x, {"raw": bank, "experts": chosen}, {}),
             (x, {"raw": bank, "experts": chosen}, {"gated": 0.0, "out_dtype": torch.bfloat16})]
    launch = {**gguf_matmul.DOT[qtype], "block_n": 4, "groups": 4}  # few programs: the interpreter is slow
    for wide in (False, True):
        monkeypatch.setitem(gguf_matmul.DOT, qtype, {**launch, "wide_inputs": wide})
        got = [gguf_matmul.dot_gemv(rows, qtype=qtype, **where, **options) for rows, where, options in cases]
        if not wide:
            want = got
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    _close(got[0], _reference(x[:1].cpu(), bank[1].cpu().numpy(), qtype, cols))


def test_q8_0_rows_of_one_matrix_share_a_program_and_give_each_rows_product():
    """``DOT_ROWS``: up to eight input rows of one Q8_0 matrix in a program (each weight word read once for all of
    them): nine rows (a program of eight and one of one row, seven rows dead) give the quantised inputs' product,
    the same sums bit for bit as each row alone; 17 blocks a row, so a trip takes one block (the launch's groups
    fall back to a divisor of the row's blocks); ``gemv`` with ``int8_inputs`` takes this kernel for rows of one
    Q8_0 matrix."""
    raw = random_blocks("Q8_0", 20, 544, seed=17)
    weight = torch.from_numpy(raw).to(device())
    x = torch.randn(9, 544, generator=torch.Generator().manual_seed(17)).to(device())
    got = gguf_matmul.dot_gemv(x, weight, "Q8_0")
    _close(got, _reference(x.cpu(), raw, "Q8_0", 544))
    alone = torch.cat([gguf_matmul.dot_gemv(x[i:i + 1], weight, "Q8_0") for i in range(9)])
    assert torch.equal(got, alone)
    assert torch.equal(gguf_matmul.gemv(x[:5], weight, "Q8_0", int8_inputs=True), got[:5])


def test_the_float_gemv_and_the_int8_one_differ_by_the_inputs_rounding():
    """Against float32 inputs the error is the inputs' rounding to 8 bits: small, and not zero."""
    raw = random_blocks("IQ2_XXS", 16, 1024, seed=5)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(5))
    exact = gguf_matmul.gemv(x.to(device()), torch.from_numpy(raw).to(device()), "IQ2_XXS").cpu()
    got = gguf_matmul.dot_gemv(x.to(device()), torch.from_numpy(raw).to(device()), "IQ2_XXS").cpu()
    error = (got - exact).abs().max() / exact.abs().max()
    assert 0 < error < 2e-2


def test_types_without_an_int8_kernel_are_refused():
    with pytest.raises(ValueError, match="no int8-input GEMV for Q4_K"):
        gguf_matmul.dot_gemv(torch.zeros(1, 256), torch.zeros(1, 144, dtype=torch.uint8), "Q4_K")


def test_int8_inputs_sends_a_types_one_row_gemv_to_the_int8_kernel():
    raw = torch.from_numpy(random_blocks("Q2_K", 8, 512, seed=9)).to(device())
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(9)).to(device())
    floats = gguf_matmul.gemv(x, raw, "Q2_K")
    got = gguf_matmul.gemv(x[:1], raw, "Q2_K", int8_inputs=True)
    assert torch.equal(got, gguf_matmul.dot_gemv(x[:1], raw, "Q2_K")) and not torch.equal(got, floats[:1])
    # rows of one matrix: decoded once, in float32
    assert torch.equal(gguf_matmul.gemv(x, raw, "Q2_K", int8_inputs=True), floats)
    # the element-wise kernel stays float
    element_wise = gguf_matmul.gemv(x, raw, "Q2_K", blockwise=False, int8_inputs=True)
    assert torch.allclose(element_wise, floats, rtol=1e-5, atol=1e-5 * floats.abs().max().item())


def test_the_int8_kernels_compile_for_sm90_to_a_dp4a_every_four_values_and_fewer_instructions():
    """Compiled for an H200 on this machine (``gguf_sass_count.py --dot --json``, a process of its own: the tests
    run Triton's interpreter, which compiles nothing): each kernel's loop at its default launch issues one ``dp4a``
    per four weight values (the inline PTX survived), spills nothing, and issues fewer instructions a value than
    the float GEMV's loop at its default launch."""
    tools = Path(sys.modules["triton"].__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tools.exists():
        pytest.skip("this Triton carries no NVIDIA tools")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(root / "tests" / "gpu" / "gguf_sass_count.py"), "--dot", "--json"],
                         env=env, capture_output=True, text=True, check=True, timeout=600).stdout
    cases = {case["qtype"]: case for case in map(json.loads, out.splitlines())}
    assert set(cases) == set(DOT_TYPES)
    for case in cases.values():
        assert case["dp4a"] == 0.25 and case["spills"] == 0, case
        assert case["instructions"] < 0.6 * case["float_instructions"], case
