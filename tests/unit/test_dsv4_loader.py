"""Official-format checkpoint reading: configs, FP8 / MXFP4 decoding, broken files, HF layouts.

The decoders under test are checked against a by-hand decode of the stored
bytes written here from the bit layouts (e4m3: 1 sign, 4 exponent bits with
bias 7, 3 mantissa bits; e2m1: 1 sign, 2 exponent bits with bias 1, 1 mantissa
bit; ue8m0: 2^(byte - 127)), not against the code's own lookup tables.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ds4d.models.deepseek_v4 import DeepseekV4Config, load_model, main_make_tiny, write_tiny_checkpoint
from ds4d.models.deepseek_v4.config import FLASH_WIDTHS, QuantizationConfig
from ds4d.models.deepseek_v4.loader import (
    CheckpointError,
    SafetensorsCheckpoint,
    WeightReader,
    stored_to_reference_name,
)
from ds4d.models.deepseek_v4.make_tiny import tiny_config

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "dsv4"  # the release configs


pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3, layers=[4, 128])


def _raw(path: Path, name: str) -> tuple[list[int], list[int]]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(path / index[name]), "pt") as handle:
        tensor = handle.get_tensor(name)
    return tensor.view(torch.uint8).flatten().tolist(), list(tensor.shape)


def _e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * (mantissa / 8) * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def _e2m1(nibble: int) -> float:
    sign = -1.0 if nibble & 0x8 else 1.0
    exponent, mantissa = (nibble >> 1) & 0x3, nibble & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def _ue8m0(byte: int) -> float:
    return 2.0 ** (byte - 127)


def _reader(path: Path) -> WeightReader:
    return WeightReader(SafetensorsCheckpoint(path), DeepseekV4Config.from_file(path))


# ---------------------------------------------------------------------- configs


@pytest.mark.parametrize("variant, layers, hidden, experts", [("flash", 43, 4096, 256), ("pro", 61, 7168, 384)])
def test_published_configs_parse(variant, layers, hidden, experts):
    cfg = DeepseekV4Config.from_file(REFERENCE / f"config.{variant}.json")
    raw = json.loads((REFERENCE / f"config.{variant}.json").read_text())
    assert cfg.num_hidden_layers == layers and cfg.hidden_size == hidden and cfg.n_routed_experts == experts
    assert cfg.compress_ratios == tuple(raw["compress_ratios"][:layers])  # MTP entry dropped
    assert set(cfg.compress_ratios) <= {0, 4, 128}
    assert cfg.num_hash_layers == 3 and cfg.qk_rope_head_dim == 64 and cfg.head_dim == 512
    assert cfg.yarn is not None and cfg.yarn.factor == 16 and cfg.compress_rope_theta == 160000
    assert cfg.quantization == QuantizationConfig(expert_dtype="fp4")
    assert cfg.block_size_tokens == 128
    assert cfg.routed_scaling_factor == raw["routed_scaling_factor"]


def test_hf_style_config_keys_parse():
    cfg = DeepseekV4Config.from_dict(
        {
            **{
                k: v
                for k, v in json.loads((REFERENCE / "config.flash.json").read_text()).items()
                if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling")
            },
            "layer_types": ["sliding_attention", "compressed_sparse_attention"] + ["heavily_compressed_attention"] * 41,
            "mlp_layer_types": ["hash_moe"] * 2 + ["moe"] * 41,
            "partial_rotary_factor": 0.125,
            "rope_parameters": {
                "main": {"rope_theta": 10000.0},
                "compress": {
                    "rope_type": "yarn",
                    "rope_theta": 160000.0,
                    "factor": 16,
                    "original_max_position_embeddings": 65536,
                },
            },
        }
    )
    assert cfg.compress_ratios[:3] == (0, 4, 128) and cfg.num_hash_layers == 2
    assert cfg.qk_rope_head_dim == 64 and cfg.yarn is not None


# ---------------------------------------------------------------------- decoding


def test_fp8_block_dequant_matches_bytes(tiny):
    name = "layers.0.attn.wq_b"
    weight_bytes, (rows, cols) = _raw(tiny, name + ".weight")
    scale_bytes, (_, scale_cols) = _raw(tiny, name + ".scale")
    decoded = _reader(tiny).tensor(name + ".weight")
    expected = torch.tensor(
        [
            _e4m3(weight_bytes[r * cols + c]) * _ue8m0(scale_bytes[(r // 128) * scale_cols + c // 128])
            for r in range(rows)
            for c in range(cols)
        ]
    ).view(rows, cols)
    assert decoded.shape == (rows, cols)
    assert torch.equal(decoded, expected)
    assert expected.abs().max() > 0


def test_mxfp4_expert_dequant_matches_nibbles(tiny):
    name = "layers.1.ffn.experts.5.w2"
    packed, (rows, half) = _raw(tiny, name + ".weight")
    scale_bytes, (_, groups) = _raw(tiny, name + ".scale")
    assert groups == 2 * half // 32
    values = []
    for r in range(rows):
        for c in range(2 * half):
            byte = packed[r * half + c // 2]
            nibble = byte & 0xF if c % 2 == 0 else byte >> 4  # low nibble first
            values.append(_e2m1(nibble) * _ue8m0(scale_bytes[r * groups + c // 32]))
    expected = torch.tensor(values).view(rows, 2 * half)
    assert torch.equal(_reader(tiny).expert(1, 5, "w2"), expected)
    assert len(set(values)) > 8  # many codes and scales were exercised


def test_plain_tensors_and_index_tables(tiny):
    reader = _reader(tiny)
    with safe_open(
        str(
            tiny
            / json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]["layers.0.attn.wo_a.weight"]
        ),
        "pt",
    ) as handle:
        stored = handle.get_tensor("layers.0.attn.wo_a.weight")
        table = handle.get_tensor("layers.0.ffn.gate.tid2eid")
    assert stored.dtype == torch.bfloat16
    assert torch.equal(reader.tensor("layers.0.attn.wo_a.weight"), stored.float())
    assert torch.equal(reader.index("layers.0.ffn.gate.tid2eid"), table.long())


def test_checkpoint_is_sharded_and_complete(tiny):
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2
    assert any(name.startswith("mtp.") for name in index)
    reader = _reader(tiny)
    reader.check_complete()
    assert not any(name.startswith("mtp.") for name in reader.stored.values())
    for name in ("tokenizer.json", "config.json"):
        assert (tiny / name).is_file()


# ---------------------------------------------------------------------- broken checkpoints


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_truncated_shard_names_the_cut_tensor(tiny, tmp_path):
    broken = _copy(tiny, tmp_path / "broken")
    shard = sorted(broken.glob("*.safetensors"))[1]
    with shard.open("rb") as handle:
        header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
    header.pop("__metadata__", None)
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    with shard.open("r+b") as handle:
        handle.truncate(shard.stat().st_size - 10)
    with pytest.raises(CheckpointError, match="truncated") as error:
        load_model(broken)
    assert repr(last) in str(error.value) and shard.name in str(error.value)


def test_missing_tensor_is_named(tiny, tmp_path):
    broken = _copy(tiny, tmp_path / "missing")
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["layers.1.attn.compressor.ape"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.attn\.compressor\.ape'"):
        load_model(broken)


def test_missing_scale_is_named(tiny, tmp_path):
    broken = _copy(tiny, tmp_path / "noscale")
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["layers.0.ffn.experts.2.w3.scale"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.experts\.2\.w3\.scale"):
        load_model(broken)


# ---------------------------------------------------------------------- HF layouts


def test_hf_names_normalise_to_reference_names():
    cases = {
        "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight": "layers.3.attn.indexer.weights_proj.weight",
        "model.layers.3.self_attn.compressor.indexer.kv_norm.weight": "layers.3.attn.indexer.compressor.norm.weight",
        "model.layers.3.self_attn.compressor.gate_proj.weight": "layers.3.attn.compressor.wgate.weight",
        "model.layers.3.self_attn.kv_norm.weight": "layers.3.attn.kv_norm.weight",
        "model.layers.3.attn.norm.weight": "layers.3.attn.kv_norm.weight",
        "model.layers.3.mlp.shared_experts.up_proj.weight": "layers.3.ffn.shared_experts.w3.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias": "layers.3.ffn.gate.bias",
        "model.layers.3.attn_hc.fn": "layers.3.hc_attn_fn",
        "model.hc_head.hc_scale": "hc_head_scale",
        "lm_head.weight": "head.weight",
    }
    for stored, reference in cases.items():
        assert stored_to_reference_name(stored) == reference
        assert stored_to_reference_name(reference) == reference


@pytest.mark.parametrize("original_format", [True, False])
def test_hf_save_pretrained_loads_identically(tiny, tmp_path, original_format):
    pytest.importorskip("transformers")
    from ds4d.models.deepseek_v4.hf_compat import hf_model

    saved = tmp_path / "hf"
    hf_model(tiny).save_pretrained(saved, save_original_format=original_format)
    ours, theirs = load_model(tiny), load_model(saved)
    assert theirs.cfg.compress_ratios == ours.cfg.compress_ratios
    ids = list(range(1000, 1140))
    assert torch.equal(ours.logits_for(ids), theirs.logits_for(ids))


def test_make_tiny_entry_point(tmp_path, capsys):
    main_make_tiny(tmp_path / "cli", seed=7, layers=[128, 0])
    assert "compress ratios [128, 0]" in capsys.readouterr().out
    cfg = DeepseekV4Config.from_file(tmp_path / "cli")
    assert cfg.compress_ratios == (128, 0) and cfg.num_hash_layers == 2
    with pytest.raises(ValueError, match="compress ratios"):
        write_tiny_checkpoint(tmp_path / "bad", layers=[3])


def test_flash_widths_are_the_release_widths():
    release = json.loads((REFERENCE / "config.flash.json").read_text())
    assert FLASH_WIDTHS == {k: release[k] for k in FLASH_WIDTHS}
    cfg = tiny_config([0, 0, 4], **FLASH_WIDTHS)
    assert cfg["hidden_size"] == 4096 and cfg["n_routed_experts"] == 256 and cfg["num_hidden_layers"] == 3
    with pytest.raises(ValueError, match="widths"):
        write_tiny_checkpoint("/nonexistent/never-written", layers=[0], widths="pro")


def test_parameter_bytes_count_the_routed_experts(tiny):
    model = load_model(tiny)
    cfg = model.cfg
    assert {layer.ffn.experts.kind for layer in model.weights.layers} == {"mxfp4"}  # kept as stored
    matrix = cfg.moe_intermediate_size * cfg.hidden_size // 2 + cfg.moe_intermediate_size * cfg.hidden_size // 32
    experts = cfg.num_hidden_layers * cfg.n_routed_experts * 3 * matrix  # e2m1 pairs + ue8m0 scales
    total = model.info.parameter_bytes
    for layer in model.weights.layers:  # without the banks' matrices, exactly the experts' bytes less
        layer.ffn.experts = dataclasses.replace(layer.ffn.experts, weights={}, scales={}, gate_up=None, native=None)
    assert total - model.weights.parameter_bytes() == experts
