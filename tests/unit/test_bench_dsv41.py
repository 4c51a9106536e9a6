"""`ds4d bench model --family deepseek_v41` on tiny widths, on the CPU: the table it prints and the
JSON it writes, and the floors it divides by (checked against a count made here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


def test_the_tiny_benchmark_runs_and_reports_every_row(tmp_path):
    out = tmp_path / "v41.json"
    run = subprocess.run(
        [sys.executable, "-m", "ds4d.cli", "bench", "model", "--family", "deepseek_v41", "--tiny", "--device", "cpu",
         "--dtype", "float32", "--decode-tokens", "2", "--batches", "1,2", "--route-kernel", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = [row["case"] for row in result["rows"]]
    routed = " (routing in one kernel)"  # --route-kernel: route_triton's kernel (Triton's interpreter here)
    assert cases[:5] == ["decode b1 @64", "decode b2 @64", f"decode b1 @64{routed}", f"decode b2 @64{routed}",
                         "prefill 128 (triangle)"]
    assert sum(case.startswith("engram lookup") for case in cases) == 6
    assert all(row["ds4d"] > 0 for row in result["rows"])
    assert all(row["floor"] > 0 for row in result["rows"][:5])
    assert result["layers"] == [0, 0, 2, 2, 1, 1] and result["family"] == "deepseek_v41"
    assert "| decode b1 @64 |" in run.stdout


def test_floors_count_the_dense_weights_and_the_routed_experts():
    from ds4d.bench.dsv41 import Floors, bench_config, random_tensors
    from ds4d.models.deepseek_v41.config import DeepseekV41Config
    from ds4d.models.deepseek_v41.model import DeepseekV41Model

    config, tokenizer = bench_config([0, 2], tiny=True, experts=0, engram_vocab=0)
    cfg = DeepseekV41Config.from_dict(config)
    tensors = random_tensors(torch, config, torch.device("cpu"), seed=1)
    model = DeepseekV41Model.from_tensors(cfg, tensors, tokenizer)
    experts = {k: v for k, v in tensors.items() if ".ffn.experts." in k}
    engram = {k: v for k, v in tensors.items() if ".engram.embed." in k}
    assert engram and all(v.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) for v in engram.values())
    dense = sum(v.numel() for k, v in tensors.items() if k not in experts and k not in engram and k != "embed.weight")
    floors = Floors(model, bandwidth=1e9, matmul=1e12)
    per_expert = sum(v.numel() for v in experts.values()) // (cfg.num_hidden_layers * cfg.n_routed_experts)
    assert floors.expert_params == per_expert
    # every tensor but the routed experts, the embedding (one row read) and the Engram tables (rows read)
    assert floors.dense_params == pytest.approx(dense, rel=0.01)
    k = cfg.num_experts_per_tok
    one = 2 * (floors.dense_params + cfg.num_hidden_layers * k * per_expert) / 1e9
    assert floors.decode(1) == pytest.approx(1 / one)


def test_native_floors_count_the_fp4_codes_and_scales():
    """``--native``: the FP8 linears and routed experts drawn as stored (e4m3 values, FP4 codes, e8m0
    scales), kept so, and counted at one byte per FP8 value and half a byte per FP4 parameter plus a
    scale byte per 32."""
    from ds4d.bench.dsv41 import Floors, bench_config, random_tensors
    from ds4d.models.deepseek_v41.config import DeepseekV41Config
    from ds4d.models.deepseek_v41.model import DeepseekV41Model

    config, tokenizer = bench_config([0, 2], tiny=True, experts=0, engram_vocab=0)
    cfg = DeepseekV41Config.from_dict(config)
    tensors = random_tensors(torch, config, torch.device("cpu"), seed=1, native=True)
    assert tensors["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert tensors["layers.0.ffn.experts.0.w1.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    model = DeepseekV41Model.from_tensors(cfg, tensors, tokenizer, stored_weights=True)
    assert model.weights.layers[0].ffn.banks.stored
    floors = Floors(model, bandwidth=1e9, matmul=1e12)
    assert floors.expert_bytes == floors.expert_params / 2 + floors.expert_params / 32
    fp8 = sum(v.numel() for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn and ".engram.embed." not in k)
    assert fp8 and floors.dense_bytes == pytest.approx(2 * floors.dense_params - fp8, rel=0.01)
    wq_b = model.weights.layers[0].attn.wq_b.dense()
    assert 0.3 < float(wq_b.float().pow(2).mean().sqrt()) * wq_b.shape[1] ** 0.5 < 3
    decoded = model.weights.layers[0].ffn.banks.expert(0).w1
    assert 0 < float(decoded.float().pow(2).mean().sqrt()) * cfg.hidden_size ** 0.5 < 2  # about unit rows
    k = cfg.num_experts_per_tok
    one = (floors.dense_bytes + cfg.num_hidden_layers * k * floors.expert_bytes) / 1e9
    assert floors.decode(1) == pytest.approx(1 / one)


def test_offloaded_floors_count_the_experts_once_and_the_link(tmp_path):
    """``--expert-gpu-fraction``: the first share of each layer's experts on the device, the rest in
    host RAM; the floors count the same bytes as without offload, and a step is held to the bytes it
    moved over the link at the link's rate when that is slower; one share only."""
    from ds4d.bench.dsv41 import Floors, _fraction, bench_config, offload_options, place_first, random_tensors
    from ds4d.models.deepseek_v41.config import DeepseekV41Config
    from ds4d.models.deepseek_v41.model import DeepseekV41Model

    config, tokenizer = bench_config([0, 2], tiny=True, experts=0, engram_vocab=0)
    cfg = DeepseekV41Config.from_dict(config)
    plain = DeepseekV41Model.from_tensors(cfg, random_tensors(torch, config, torch.device("cpu"), seed=1), tokenizer)
    model = DeepseekV41Model.from_tensors(cfg, random_tensors(torch, config, torch.device("cpu"), seed=1), tokenizer,
                                          offload=offload_options(cfg, 0.5, native=False))
    place_first(model, 0.5)
    half = cfg.n_routed_experts // 2
    assert model.expert_offload.hot_experts() == [list(range(half))] * cfg.num_hidden_layers
    floors, want = Floors(model, bandwidth=1e9, matmul=1e12), Floors(plain, bandwidth=1e9, matmul=1e12)
    assert (floors.expert_bytes, floors.dense_bytes) == (want.expert_bytes, want.dense_bytes)
    assert floors.decode(1, link_bytes=0) == want.decode(1)
    assert floors.decode(1, link_bytes=1e9, link_bandwidth=1e8) == pytest.approx(0.1)  # 10 s over the link
    assert _fraction("") is None and _fraction("0.25") == 0.25
    with pytest.raises(SystemExit):
        _fraction("1,0.5")


def test_depth_full_is_the_release_pattern():
    """``bench model --depth full``: V4-Flash's 43 layers as its config.json lists them (without the MTP
    layer's entry), V4.1's 40 as its release config does."""
    from pathlib import Path

    from ds4d.bench.model import full_depth_layers
    from ds4d.models.deepseek_v41.config import RELEASE_RATIOS

    flash = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "dsv4" /
                        "config.flash.json").read_text())
    v4 = [int(x) for x in full_depth_layers("deepseek_v4").split(",")]
    assert v4 == flash["compress_ratios"][: flash["num_hidden_layers"]] and len(v4) == 43
    v41 = [int(x) for x in full_depth_layers("deepseek_v41").split(",")]
    assert v41 == list(RELEASE_RATIOS) and len(v41) == 40


def test_the_oracle_peer_gets_the_official_tensors_under_hf_names_decoded(tmp_path):
    """``--oracle``: names as the HF model's parameters, stored weights decoded as ds4d decodes them,
    and a directory without the model files named."""
    from ds4d.bench.dsv41_oracle import decoded, hf_name, import_oracle
    from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4, quantize_fp8_block, quantize_mxfp4

    assert hf_name("head.weight") == "lm_head.weight"
    assert hf_name("layers.3.attn.wq_a.weight") == "model.layers.3.attn.wq_a.weight"
    values = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    fp8, fp8_scale = quantize_fp8_block(values, (32, 32))
    fp4, fp4_scale = quantize_mxfp4(values)
    tensors = {"a.weight": fp8, "a.scale": fp8_scale, "b.weight": fp4, "b.scale": fp4_scale, "c.weight": values}
    assert torch.equal(decoded(fp8, "a.weight", tensors), dequant_fp8_block(fp8, fp8_scale, (32, 32)))
    assert torch.equal(decoded(fp4, "b.weight", tensors), dequant_mxfp4(fp4, fp4_scale))
    assert decoded(values, "c.weight", tensors) is values
    with pytest.raises(FileNotFoundError, match="configuration_deepseek_v41.py"):
        import_oracle(tmp_path)


def test_the_table_sets_the_oracle_beside_ds4d(capsys):
    from argparse import Namespace

    from ds4d.bench.dsv41 import Row, _print

    rows = [Row("decode b1 @1024", ds4d=150.0, floor=600.0, oracle=10.0), Row("decode b8 @1024", ds4d=600.0)]
    _print(rows, [0, 2], Namespace(dtype="bfloat16", native=False), "cuda")
    out = capsys.readouterr().out
    assert "| oracle | ds4d / oracle |" in out
    assert "| decode b1 @1024 | 150 tok/s | 600.0 | 0.25x | 10.00 | 15.00x |" in out
    assert "| decode b8 @1024 | 600 tok/s | - | - | - | - |" in out
