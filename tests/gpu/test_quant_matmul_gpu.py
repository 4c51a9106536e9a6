"""The FP8 / MXFP4 weight kernels compiled on a CUDA GPU, and DeepSeek-V4 with native weights.

Kernels: bf16 activations against the float32 product of the same decoded
weights (within 2e-2 of the largest output: bf16 output rounding), at V4-Flash
widths and at ragged shapes; a row's result does not depend on the other rows.
Model: a tiny checkpoint in bf16 with its FP8 linears and MXFP4 experts kept as
stored against the same checkpoint with every weight decoded, teacher-forced
(argmax agreement >= 90% and per-position relative error as bf16 allows), and
decode steps replayed from CUDA graphs give the eager steps' tokens.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.cuda import quant_matmul as qm
from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4, quantize_fp8_block, quantize_mxfp4
from ds4d.models.deepseek_v4.stored import Fp8Weight
from tests.unit.test_dsv4_model import Driver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want).abs().max().item() < 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("m", [1, 5, 16, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (1024, 4096), (200, 333)])
def test_fp8_linear(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    weight, scale = quantize_fp8_block(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
    factors = scale.view(torch.uint8).int().sub(127).float().exp2()
    values = dequant_fp8_block(weight, scale, (128, 128))
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    got = qm.fp8_linear(x, weight, factors)
    _check(got, x.float() @ values.T)
    for r in {0, m - 1}:
        alone = qm.fp8_linear(x[r:r + 1], weight, factors)[0]
        if m <= qm.TUNING["fp8_rows"]["most_rows"]:  # one row per program: the same sums
            assert torch.equal(alone, got[r])


@pytest.mark.parametrize(("first", "second", "k"), [(1024, 512, 4096), (2048, 2048, 4096)], ids=["wq_a+wkv", "w1+w3"])
def test_fp8_pair_in_one_gemv_is_each_alone_bit_for_bit(first, second, k):
    """``stored.fuse_rows`` of two FP8 linears of V4-Flash's widths: a batch-1 decode row through the fused
    weight (one launch) gives each weight's own product bit for bit; more rows multiply each alone."""
    from ds4d.models.deepseek_v4.ops import linear, linear_pair
    from ds4d.models.deepseek_v4.stored import fuse_rows

    gen = torch.Generator(device="cuda").manual_seed(first + second)
    weights = []
    for n in (first, second):
        w, s = quantize_fp8_block(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
        weights.append(Fp8Weight.from_stored(w, s, torch.bfloat16))
    inputs = [torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16) for rows in (1, 8)]
    want = [[linear(x, w) for w in weights] for x in inputs]
    both = fuse_rows(*weights)
    assert both is not None and both.data.shape == (first + second, k)
    for x, pair in zip(inputs, want, strict=True):
        assert both.takes_gemv(x) == (x.shape[0] <= qm.TUNING["fp8_rows"]["most_rows"])
        for got, expected in zip(linear_pair(x, *weights, both), pair, strict=True):
            assert torch.equal(got, expected)


def _bank(experts: int, n: int, k: int, gen):
    packed, scales, values = [], [], []
    for _ in range(experts):
        w, s = quantize_mxfp4(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
        packed.append(w.view(torch.uint8))
        scales.append(s.view(torch.uint8))
        values.append(dequant_mxfp4(w, s))
    return torch.stack(packed), torch.stack(scales), torch.stack(values)


@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 2048), (96, 160)])
def test_mxfp4_rows_and_grouped(n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    experts = 16
    packed, scales, values = _bank(experts, n, k, gen)
    for rows in (1, 6, 96, 700):
        of_row = torch.sort(torch.randint(0, experts - 3, (rows,), device="cuda", generator=gen)).values
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        want = torch.einsum("rnk,rk->rn", values[of_row], x.float())
        got_rows = qm.mxfp4_rows(x, packed, scales, of_row)
        _check(got_rows, want)
        assert torch.equal(qm.mxfp4_rows(x[-1:], packed, scales, of_row[-1:])[0], got_rows[-1])
        offsets = torch.cumsum(torch.bincount(of_row, minlength=experts), 0).to(torch.int32)
        _check(qm.mxfp4_grouped(x, packed, scales, offsets), want)


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_gated_mxfp4_rows_are_the_product_then_its_swiglu_bit_for_bit(rows, limit):
    """V4-Flash's routed gate/up bank (2 x 2048 rows of 4096): the SwiGLU in the GEMV's epilogue gives what the
    plain GEMV and ``prefill_triton.swiglu`` give, bit for bit, compiled."""
    from ds4d.cuda import prefill_triton

    gen = torch.Generator(device="cuda").manual_seed(rows)
    packed, scales = zip(*(quantize_mxfp4(torch.randn(4096, 4096, device="cuda", generator=gen) * 0.05)
                           for _ in range(3)))
    packed = torch.stack([p.view(torch.uint8) for p in packed])
    scales = torch.stack([s.view(torch.uint8) for s in scales])
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 3, (rows,), device="cuda", generator=gen)
    plain = qm.mxfp4_rows(x, packed, scales, ids)
    want = prefill_triton.swiglu(plain[:, :2048], plain[:, 2048:], limit)
    assert torch.equal(qm.mxfp4_rows(x, packed, scales, ids, gated=limit), want)


@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_gated_fp8_gemv_is_the_product_then_its_swiglu_bit_for_bit(limit):
    """V4-Flash's shared expert, ``w1`` over ``w3`` (4096 rows of 4096) in FP8: the SwiGLU in the batch-1 GEMV's
    epilogue gives the plain GEMV and ``prefill_triton.swiglu`` bit for bit, compiled (the shape's own setting
    takes one row a program, the gated launch two)."""
    from ds4d.cuda import prefill_triton

    gen = torch.Generator(device="cuda").manual_seed(3)
    weight, scale = quantize_fp8_block(torch.randn(4096, 4096, device="cuda", generator=gen) * 0.05)
    factors = scale.view(torch.uint8).int().sub(127).float().exp2()
    x = torch.randn(1, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    plain = qm.fp8_linear(x, weight, factors)
    want = prefill_triton.swiglu(plain[:, :2048], plain[:, 2048:], limit)
    assert torch.equal(qm.fp8_linear(x, weight, factors, gated=limit), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_rows_ptx_decode_equals_the_plain_decode(dtype, monkeypatch):
    """Every byte value (both nibbles, signs, the subnormal code) under every scale byte from 100 to
    140: the PTX decode and the integer decode give the same outputs bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    experts, n, k = 4, 64, 2048
    packed = torch.arange(256, device="cuda", dtype=torch.uint8).repeat(experts * n * k // 512).view(experts, n, k // 2)
    packed = packed[:, :, torch.randperm(k // 2, device="cuda", generator=gen)].contiguous()
    scales = torch.randint(100, 141, (experts, n, k // 32), device="cuda", dtype=torch.uint8, generator=gen)
    x = torch.randn(6, k, device="cuda", generator=gen).to(dtype)
    of_row = torch.tensor([0, 1, 1, 2, 3, 3], device="cuda")
    outs = {}
    for ptx in (False, True):
        monkeypatch.setitem(qm.TUNING, "mxfp4_rows", {**qm.TUNING["mxfp4_rows"], "ptx_decode": ptx})
        outs[ptx] = qm.mxfp4_rows(x, packed, scales, of_row)
    assert torch.equal(outs[True], outs[False])
    values = torch.stack([dequant_mxfp4(packed[e], scales[e]) for e in range(experts)])
    want = torch.einsum("rnk,rk->rn", values[of_row].float(), x.float())
    assert (outs[True].float() - want).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2) * want.abs().max()


def _loads_of_one_call(call) -> tuple[torch.Tensor, list[dict[str, int]]]:
    """``call()``'s result, and the global loads of the MXFP4 rows kernel variants it compiles or finds
    (the kernel's in-memory cache emptied first, so only those)."""
    from ds4d.bench.kernels import global_loads

    kernel = qm._kernels().mxfp4_rows_kernel
    kernel.device_caches.clear()
    result = call()
    torch.cuda.synchronize()
    loads = [global_loads(compiled.asm["ptx"]) for cache in kernel.device_caches.values()
             for compiled in cache[0].values()]
    return result, loads


def test_mxfp4_rows_reads_aligned_experts_in_16_byte_vectors():
    """Experts at 16-byte aligned addresses are read in 16-byte vectors (the kernel takes them as
    offsets from an aligned pointer); told nothing, the same kernel reads bytes.  Same results."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    experts, n, k = 8, 512, 1024
    packed, scales, _ = _bank(experts, n, k, gen)
    x = torch.randn(6, k, device="cuda", generator=gen).to(torch.bfloat16)
    of_row = torch.tensor([0, 1, 3, 3, 5, 7], device="cuda")
    w_table, s_table = qm.expert_table(packed), qm.expert_table(scales)
    vectors, aligned = _loads_of_one_call(
        lambda: qm.mxfp4_rows_at(x, w_table, s_table, of_row, n, k // 2, k // 32, aligned=True))
    bytewise, unaligned = _loads_of_one_call(
        lambda: qm.mxfp4_rows_at(x, w_table, s_table, of_row, n, k // 2, k // 32, aligned=False))
    assert torch.equal(vectors, bytewise)
    assert torch.equal(qm.mxfp4_rows(x, packed, scales, of_row), vectors)
    assert len(aligned) == 1 and len(unaligned) == 1, (aligned, unaligned)
    assert any(w.startswith("v4") for w in aligned[0]) and not any(w.endswith(("b8", "u8")) for w in aligned[0]), aligned
    assert any(w.endswith(("b8", "u8")) for w in unaligned[0]), unaligned


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3, layers=[0, 4, 128, 4])
    native = load_model(path, dtype=torch.bfloat16, device="cuda")  # weight_format auto: native here
    dense = load_model(path, dtype=torch.bfloat16, device="cuda", weight_format="dense")
    return native, dense


def test_native_is_the_default_on_cuda_bf16(models):
    native, dense = models
    assert native.native_weights and not dense.native_weights
    assert isinstance(native.weights.layers[0].attn.wq_a, Fp8Weight)
    assert native.info.parameter_bytes < dense.info.parameter_bytes


def test_native_against_decoded(models):
    native, dense = models
    prompt = [(i * 7919) % 20000 + 10 for i in range(400)]
    got, want = native.logits_for(prompt), dense.logits_for(prompt)
    rel = (got - want).abs().max(dim=-1).values / want.abs().max()
    assert rel.median().item() < 2e-2 and rel.quantile(0.9).item() < 6e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def _decode_tokens_and_logits(model, steps: int = 8) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and logits of ``steps`` decode steps after a 150-token prompt."""
    driver = Driver(model, seed=1)
    driver.start("a")
    last = driver.prefill("a", [(i * 31) % 9000 + 10 for i in range(150)], chunk=150)[-1:]
    tokens, logits = [], []
    for _ in range(steps):
        tokens.append(int(last[-1].argmax()))
        last = driver.step([("a", tokens[-1:], 1)])[0]
        logits.append(last)
    return tokens, torch.cat(logits)


def test_native_graph_decode_equals_eager(models):
    native, _ = models
    runs = [_decode_tokens_and_logits(native.with_paths(native.paths.replace(decode_graphs=graphs)))
            for graphs in ("cuda", "off")]
    assert runs[0][0] == runs[1][0]
    assert (runs[0][1] - runs[1][1]).abs().max().item() < 1e-2 * runs[1][1].abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch: compute capability 9 and up")
@pytest.mark.parametrize("compile_decode", [False, True])
def test_gemvs_launched_as_programmatic_dependents_decode_as_without(models, monkeypatch, compile_decode):
    """``devices.LAUNCH["pdl"]``: a decode step's GEMVs and hyper-connection boundary kernels launched as
    programmatic dependent launches (each waits for the kernel before it, the GEMVs of fixed weights after
    reading their first weight tile) give, replayed from CUDA graphs, the same logits bit for bit as launched
    plainly; the batch-1 FP8 and MXFP4 kernels compiled for it carry the wait."""
    from ds4d.cuda import devices

    native, _ = models
    paths = native.paths.replace(decode_graphs="cuda", compile_decode=compile_decode, graph_fallback=False)
    runs = {}
    for pdl in (False, True):
        monkeypatch.setitem(devices.LAUNCH, "pdl", pdl)
        runs[pdl] = _decode_tokens_and_logits(native.with_paths(paths))
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])
    for kernel in (qm._kernels().fp8_rows_kernel, qm._kernels().mxfp4_rows_kernel):
        waits = [compiled.asm["ptx"].count("griddepcontrol.wait") for cache in kernel.device_caches.values()
                 for compiled in cache[0].values()]
        assert 1 in waits and 0 in waits, (kernel, waits)


def test_gather_cold_reads_page_locked_host_memory():
    """Rows whose expert is on the host get its words from page-locked host memory (read by the
    kernel at the host address); rows of device experts are left alone; in a CUDA graph too."""
    words = 13_369_344 // 8  # one V4-Flash MXFP4 expert
    host = torch.randint(-2**62, 2**62, (3, words), dtype=torch.int64).pin_memory()
    device = torch.randint(-2**62, 2**62, (2, words), dtype=torch.int64, device="cuda")
    table = torch.tensor([host[0].data_ptr(), device[0].data_ptr(), host[1].data_ptr(), host[2].data_ptr(),
                          device[1].data_ptr()], dtype=torch.int64, device="cuda")
    on_host = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int64, device="cuda")
    rows = torch.tensor([3, 1, 0, 4, 2, 3], dtype=torch.int64, device="cuda")
    dst = torch.full((8, words), -1, dtype=torch.int64, device="cuda")
    qm.gather_cold(table, on_host, rows, dst)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qm.gather_cold(table, on_host, rows, dst)
    dst.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    source = {0: host[0], 2: host[1], 3: host[2]}
    for r, e in enumerate(rows.tolist()):
        if e in source:
            assert torch.equal(dst[r].cpu(), source[e])
        else:
            assert bool((dst[r] == -1).all())
