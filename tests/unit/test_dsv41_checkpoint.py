"""DeepSeek-V4.1 checkpoints: the layout, the reader, the tiny writer.

Decoded weights are compared with a decode of the stored bytes written here from
the bit layouts (e4m3: sign, 4 exponent bits with bias 7, 3 mantissa bits; e2m1:
sign, 2 exponent bits with bias 1, 1 mantissa bit; ue8m0: 2^(byte - 127)), not
with the code's own tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4d.models.deepseek_v41.checkpoint import CheckpointError, OfficialCheckpoint, read_checkpoint
from ds4d.models.deepseek_v41.layout import DSPARK, GROUPS, TEXT, VISION, CheckpointLayout, hf_name
from ds4d.models.deepseek_v41.make_tiny import (
    DEFAULT_LAYERS,
    add_tiny_arguments,
    compressed_vocab_size,
    engram_table_rows,
    main,
    write_tiny,
)

RELEASE_CONFIG = {  # deepseek-ai/DeepSeek-V4.1-Flash config.json, the keys that shape the checkpoint
    "model_type": "deepseek_v41",
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "text_config": {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
        "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 384,
        "n_shared_experts": 1, "num_experts_per_tok": 6,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
        "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    },
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
                      "num_attention_heads": 16, "intermediate_size": 2816, "patch_size": 14, "downsample_ratio": 3},
}
INDEX = "model.safetensors.index.json"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("v41tiny"), seed=5)


@pytest.fixture(scope="module")
def tiny_config(tiny) -> dict:
    return json.loads((tiny / "config.json").read_text(encoding="utf-8"))


def _copy(tiny: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(tiny, out)
    return out


def _shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / INDEX).read_text())["weight_map"][name]


def _rewrite(path: Path, name: str, new: torch.Tensor | None) -> Path:
    """Replace (or with None, drop) one stored tensor, keeping the index in step."""
    shard = _shard_of(path, name)
    tensors = load_file(str(shard))
    if new is None:
        del tensors[name]
    else:
        tensors[name] = new
    save_file(tensors, str(shard))
    index = json.loads((path / INDEX).read_text())
    if new is None:
        del index["weight_map"][name]
    (path / INDEX).write_text(json.dumps(index))
    return shard


# ---------------------------------------------------------------------- by-hand decoders


def _e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def _e2m1(nibble: int) -> float:
    sign = -1.0 if nibble & 0x8 else 1.0
    exponent, mantissa = (nibble >> 1) & 0x3, nibble & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def _e8m0(byte: int) -> float:
    return math.nan if byte == 0xFF else 2.0 ** (byte - 127)


E4M3 = np.array([_e4m3(b) for b in range(256)], dtype=np.float64)
E2M1 = np.array([_e2m1(n) for n in range(16)], dtype=np.float64)
E8M0 = np.array([_e8m0(b) for b in range(256)], dtype=np.float64)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.uint8).numpy().astype(np.int64)


def _by_hand_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> np.ndarray:
    rows, cols = weight.shape
    factors = np.repeat(np.repeat(E8M0[_bytes(scale)], block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return E4M3[_bytes(weight)] * factors


def _by_hand_fp4(weight: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    packed = _bytes(weight)
    codes = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.int64)
    codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4  # low nibble first
    return E2M1[codes] * np.repeat(E8M0[_bytes(scale)], 32, axis=1)


def test_hand_tables_are_the_formats():
    assert E4M3[0x7E] == 448.0 and E4M3[0x01] == 2.0**-9 and math.isnan(E4M3[0xFF])
    assert sorted(set(np.abs(E2M1))) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E8M0[127] == 1.0 and E8M0[0] == 2.0**-127


@pytest.mark.parametrize("name", [
    "layers.3.engram.wkv.weight",  # FP8, 10 x 8 blocks of 32 x 32
    "layers.2.attn.wq_b.weight",  # FP8, one block column
    "layers.6.ffn.shared_experts.w2.weight",
    "layers.1.engram.embed.weight",  # FP8 table, one scale per row and 32 channels
])
def test_fp8_weights_decode_element_wise(tiny, name):
    ckpt = OfficialCheckpoint(tiny)
    spec = ckpt.layout[name]
    weight, scale = ckpt.stored(name), ckpt.stored(spec.scale_name)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    expected = _by_hand_fp8(weight, scale, spec.block)
    got = ckpt.dense(name)
    assert got.dtype == torch.float32 and tuple(got.shape) == spec.dense_shape
    np.testing.assert_array_equal(got.numpy().astype(np.float64), expected)
    assert np.abs(expected).max() > 0


@pytest.mark.parametrize("name", ["layers.0.ffn.experts.0.w1.weight", "layers.7.ffn.experts.3.w2.weight"])
def test_fp4_experts_decode_element_wise(tiny, name):
    ckpt = OfficialCheckpoint(tiny)
    spec = ckpt.layout[name]
    weight, scale = ckpt.stored(name), ckpt.stored(spec.scale_name)
    assert weight.dtype == torch.int8 and tuple(weight.shape) == (64, 32) and tuple(scale.shape) == (64, 2)
    got = ckpt.dense(name)
    assert tuple(got.shape) == (64, 64)
    np.testing.assert_array_equal(got.numpy().astype(np.float64), _by_hand_fp4(weight, scale))


# ---------------------------------------------------------------------- layout


def test_release_layout_follows_the_official_model():
    layout = CheckpointLayout(RELEASE_CONFIG)
    spec = layout["layers.0.attn.wq_a.weight"]
    assert (spec.shape, spec.dtype) == ((1280, 5120), "F8_E4M3")
    assert layout["layers.0.attn.wq_a.scale"].shape == (40, 160)
    assert (layout["layers.9.ffn.experts.383.w3.weight"].shape, layout["layers.9.ffn.experts.383.w3.scale"].shape) \
        == ((2304, 2560), (2304, 160))
    assert layout["layers.9.ffn.experts.0.w2.weight"].dtype == "I8"
    assert "layers.9.ffn.experts.384.w1.weight" not in layout
    assert layout["layers.0.attn.wo_a.weight"].shape == (8 * 1024, 64 * 512 // 8)
    assert layout["layers.0.hc_attn_fn"].shape == (24, 4 * 5120) and layout["layers.0.hc_attn_fn"].dtype == "F32"
    assert "hc_head_fn" not in layout  # single-pass mHC
    compressors = sorted({int(s.name.split(".")[1]) for s in layout if ".attn.compressor." in s.name})
    assert compressors == [2, 8, 14, 20]
    assert "layers.20.attn.compressor.wgate.weight" not in layout  # ratio 1: no gate
    assert layout["layers.14.attn.compressor.wgate.weight"].dtype == "BF16"
    indexers = sorted({int(s.name.split(".")[1]) for s in layout if ".attn.indexer.wq_b.weight" in s.name})
    assert indexers == [2, 8, 14, 20, 24, 28, 32, 36]
    owners = sorted({int(s.name.split(".")[1]) for s in layout if ".attn.indexer.wk." in s.name})
    assert owners == [2, 8, 14, 20]  # reindex layers score against their source's keys
    table = layout["layers.1.engram.embed.weight"]
    assert (table.shape, table.dtype, layout["layers.1.engram.embed.scale"].shape) == \
        ((384006168, 256), "F8_E4M3", (384006168, 8))
    assert layout["layers.14.engram.wkv.weight"].shape == (5 * 5120, 3 * 8 * 256)
    engram_gib = sum(s.nbytes for s in layout if ".engram.embed.weight" in s.name) / 2**30
    assert round(engram_gib) == 183  # README: about 183 GiB of FP8 in 768M rows
    assert layout["head.weight"].shape == (129280, 5120) and layout["head.weight"].dtype == "BF16"
    dspark = layout.select([DSPARK])
    assert {s.name.split(".")[1] for s in dspark} == {"0", "1", "2"}
    assert "mtp.0.ffn.experts.127.w1.weight" in layout and "mtp.0.ffn.experts.128.w1.weight" not in layout
    assert "mtp.0.main_proj.weight" in layout and "mtp.2.markov_head.head.weight" in layout
    assert "mtp.0.attn.compressor.wkv.weight" not in layout
    vision = layout.select([VISION])
    assert "vision.blocks.31.mlp.w1.weight" in {s.name for s in vision}
    assert layout["layers.3.ffn.gate.bias_vl"].group == VISION
    assert all(s.group == TEXT for s in layout if s.name.startswith("layers.") and "bias_vl" not in s.name)


def test_bare_text_config_has_no_vision(tiny_config):
    layout = CheckpointLayout(tiny_config["text_config"])  # no quantization_config: bf16 linears
    assert not layout.select([VISION])
    assert layout["layers.0.attn.wq_a.weight"].dtype == "BF16"
    assert "layers.0.attn.wq_a.scale" not in layout
    assert layout["layers.1.engram.embed.weight"].dtype == "F8_E4M3"  # the tables are FP8 regardless


def test_tiny_covers_every_layer_mode(tiny_config):
    text = tiny_config["text_config"]
    layout = CheckpointLayout(tiny_config)
    assert text["compress_ratios"][:8] == list(DEFAULT_LAYERS)
    assert text["kv_source_layer_ids"] == [2, 5] and text["index_source_layer_ids"] == [2, 4, 5, 7]
    assert text["candidate_source_layer_id"] == 5 and text["engram_layer_ids"] == [1, 3]
    has = {n: {s.name.removeprefix(f"layers.{n}.") for s in layout if s.name.startswith(f"layers.{n}.")}
           for n in range(8)}
    assert not any("compressor" in x or "indexer" in x for n in (0, 1, 3, 6) for x in has[n])
    assert "attn.compressor.wgate.weight" in has[2] and "attn.compressor.wgate.weight" not in has[5]
    assert "attn.indexer.wk.weight" in has[5] and "attn.indexer.wq_b.weight" in has[4]
    assert "attn.indexer.wk.weight" not in has[4] and "attn.indexer.wk.weight" not in has[7]
    assert layout["layers.1.engram.embed.weight"].shape == (240, 64)  # primes 53 + 59 + 61 + 67
    assert engram_table_rows(2, 3, 2, 50) == [53 + 59 + 61 + 67, 71 + 73 + 79 + 83]
    assert text["engram_compressed_vocab_size"] < text["vocab_size"]


# ---------------------------------------------------------------------- reading


def test_round_trip_gives_the_layout(tiny, tiny_config, caplog):
    layout = CheckpointLayout(tiny_config)
    with caplog.at_level(logging.INFO):
        stored = read_checkpoint(tiny, dequantize=False, groups=GROUPS)
    assert not [r for r in caplog.records if "skipped" in r.getMessage()]
    assert list(stored) == [s.name for s in layout]
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
              "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}
    for spec in layout:
        assert tuple(stored[spec.name].shape) == spec.shape, spec.name
        assert stored[spec.name].dtype == dtypes[spec.dtype], spec.name
    dense = read_checkpoint(tiny)
    text = [s for s in layout.select([TEXT]) if s.quant != "scale"]
    assert list(dense) == [s.name for s in text]
    for spec in text:
        assert tuple(dense[spec.name].shape) == (spec.dense_shape or spec.shape), spec.name
        if spec.is_quantized:
            assert dense[spec.name].dtype == torch.float32
    assert torch.equal(dense["embed.weight"], stored["embed.weight"])
    assert len({_shard_of(tiny, n).name for n in stored}) == 2


def test_same_seed_same_checkpoint(tiny, tmp_path):
    again = read_checkpoint(write_tiny(tmp_path / "again", seed=5), dequantize=False)
    first = read_checkpoint(tiny, dequantize=False)
    assert all(torch.equal(first[n].view(torch.uint8), again[n].view(torch.uint8)) for n in first
               if first[n].element_size() == 1)


def test_vision_and_dspark_are_skipped_with_one_line(tiny, caplog):
    with caplog.at_level(logging.INFO):
        tensors = read_checkpoint(tiny)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "vision" in lines[0] and "DSpark" in lines[0]
    assert not [n for n in tensors if n.startswith(("mtp.", "vision.", "aligner.", "image_")) or "bias_vl" in n]
    stored = json.loads((tiny / INDEX).read_text())["weight_map"]
    assert any(n.startswith("mtp.0.ffn.experts.") for n in stored) and "vision.norm.weight" in stored


def test_dspark_aliases_of_embed_and_head_are_skipped(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    shard = _shard_of(path, "mtp.0.norm.weight")
    tensors = load_file(str(shard))
    tensors["mtp.0.head.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, str(shard))
    index = json.loads((path / INDEX).read_text())
    index["weight_map"]["mtp.0.head.weight"] = shard.name
    (path / INDEX).write_text(json.dumps(index))
    ckpt = OfficialCheckpoint(path, groups=GROUPS)
    assert ckpt.skipped == {"mtp.0.head.weight": DSPARK} and "mtp.0.norm.weight" in ckpt.names()


def test_text_config_reads_a_composite_checkpoint(tiny, tiny_config):
    """A bare text config describes no vision tensors; those of the checkpoint are still skipped."""
    tensors = read_checkpoint(tiny, {**tiny_config["text_config"], "quantization_config":
                                     tiny_config["quantization_config"]})
    assert "layers.0.attn.wq_a.weight" in tensors and "layers.0.ffn.gate.bias_vl" not in tensors


def test_hf_names_read_the_same_tensors(tiny, tmp_path):
    hf = write_tiny(tmp_path / "hf", seed=5, hf_names=True)
    names = json.loads((hf / INDEX).read_text())["weight_map"]
    assert "lm_head.weight" in names and "model.layers.0.attn.wq_a.scale" in names and "head.weight" not in names
    official, renamed = read_checkpoint(tiny), read_checkpoint(hf)
    assert list(official) == list(renamed)
    assert all(torch.equal(official[n], renamed[n]) for n in official)


def test_float_weights_count_as_decoded(tiny, tmp_path):
    """An HF save in a float dtype: quantised linears as float [out, in], no scales."""
    dense = read_checkpoint(tiny, groups=GROUPS)
    out = tmp_path / "float"
    out.mkdir()
    for file in ("config.json", "tokenizer.json"):
        shutil.copy(tiny / file, out / file)
    save_file({hf_name(n): t.contiguous() for n, t in dense.items()}, str(out / "model.safetensors"))
    again = read_checkpoint(out)
    assert set(again) == {n for n in dense if CheckpointLayout(json.loads((tiny / "config.json").read_text()))[n]
                          .group == TEXT}
    assert all(torch.equal(again[n], dense[n]) for n in again)


def test_truncated_shard_names_tensor_and_file(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    shard = path / "model-00002-of-00002.safetensors"
    with shard.open("rb") as handle:
        header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
    header.pop("__metadata__", None)
    last = max(header, key=lambda n: header[n]["data_offsets"][1])
    size = shard.stat().st_size
    with shard.open("r+b") as handle:
        handle.truncate(size - 3)
    with pytest.raises(CheckpointError, match="truncated") as error:
        read_checkpoint(path)
    assert last in str(error.value) and shard.name in str(error.value)


def test_missing_tensor_is_named(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    _rewrite(path, "layers.5.attn.indexer.k_norm.weight", None)
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.5\.attn\.indexer\.k_norm\.weight'"):
        read_checkpoint(path)


def test_missing_scale_is_named(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    _rewrite(path, "layers.6.ffn.experts.2.w3.scale", None)
    with pytest.raises(CheckpointError, match=r"layers\.6\.ffn\.experts\.2\.w3\.scale"):
        read_checkpoint(path)


def test_wrong_shape_names_tensor_and_file(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    shard = _rewrite(path, "layers.2.attn.compressor.wgate.weight", torch.zeros(63, 64, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(path)
    assert "layers.2.attn.compressor.wgate.weight" in str(error.value) and shard.name in str(error.value)
    assert "[63, 64]" in str(error.value) and "[64, 64]" in str(error.value)


def test_wrong_scale_shape_names_tensor(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    scale = torch.full((240, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    _rewrite(path, "layers.1.engram.embed.scale", scale)
    with pytest.raises(CheckpointError, match=r"layers\.1\.engram\.embed\.scale"):
        read_checkpoint(path)


def test_tensor_outside_the_layout_is_an_error(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    shard = _shard_of(path, "embed.weight")
    tensors = load_file(str(shard))
    tensors["layers.0.attn.compressor.wkv.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
    save_file(tensors, str(shard))
    index = json.loads((path / INDEX).read_text())
    index["weight_map"]["layers.0.attn.compressor.wkv.weight"] = shard.name
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.compressor\.wkv\.weight.*not in the layout"):
        read_checkpoint(path)


def test_single_file_without_index(tiny, tmp_path):
    out = tmp_path / "one"
    out.mkdir()
    shutil.copy(tiny / "config.json", out / "config.json")
    stored = read_checkpoint(tiny, dequantize=False, groups=GROUPS)
    save_file({n: t.contiguous() for n, t in stored.items()}, str(out / "model.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(read_checkpoint(out).values(), read_checkpoint(tiny).values()))


# ---------------------------------------------------------------------- writer


def test_make_tiny_command(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_tiny_arguments(parser)
    assert main(parser.parse_args(["--out", str(tmp_path / "cli"), "--layers", "0,2,2,1", "--seed", "1"])) == 0
    assert "DeepSeek-V4.1" in capsys.readouterr().out
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["text_config"]["compress_ratios"] == [0, 2, 2, 1, 0]
    assert config["text_config"]["kv_source_layer_ids"] == [1, 3]
    assert len(read_checkpoint(tmp_path / "cli")) > 0


def test_tiny_tokenizer_matches_config(tiny, tiny_config):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = tiny_config["text_config"]
    assert tokenizer.get_vocab_size(with_added_tokens=True) == text["vocab_size"]
    assert compressed_vocab_size(tokenizer) == text["engram_compressed_vocab_size"]
    assert tokenizer.token_to_id("<｜deepseek_image｜>") == tiny_config["image_token_id"]
    ids = tokenizer.encode("<｜User｜>Hello the world").ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<｜User｜>Hello the world"


@pytest.mark.parametrize("layers", [[2], [1, 1, 1], [0]])
def test_make_tiny_other_schedules_read_back(tmp_path, layers):
    path = write_tiny(tmp_path / "other", layers=layers)
    layout = CheckpointLayout(json.loads((path / "config.json").read_text()))
    assert list(read_checkpoint(path, dequantize=False, groups=GROUPS)) == [s.name for s in layout]


def test_make_tiny_refuses_v4_ratios(tmp_path):
    with pytest.raises(ValueError, match="ratio 0, 1 or 2"):
        write_tiny(tmp_path / "v4", layers=[0, 4, 128])
