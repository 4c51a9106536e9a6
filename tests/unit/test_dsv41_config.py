"""DeepSeek-V4.1 config: the release's composite config.json, the bare text config, per-layer modes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ds4d.models.deepseek_v41 import DeepseekV41Config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"
RELEASE = FIXTURES / "release_config.json"


@pytest.fixture(scope="module")
def release() -> DeepseekV41Config:
    return DeepseekV41Config.from_file(RELEASE)


def test_release_config(release):
    assert release.num_hidden_layers == 40 and release.hidden_size == 5120
    assert release.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20  # the 3 DSpark entries dropped
    assert release.kv_source_layer_ids == (2, 8, 14, 20)
    assert release.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert release.candidate_source_layer_id == 20
    assert (release.candidate_topk_blocks, release.candidate_block_size, release.index_topk) == (2048, 8, 512)
    assert release.engram_layer_ids == (1, 14) and release.engram_pad_id == 2
    assert release.engram_num_embeddings == (384006168, 384016682)
    assert release.rms_norm_eps == 1e-20 and release.image_token_id == 129264
    assert release.yarn is not None and release.yarn.original_max_position_embeddings == 65536
    assert release.quantization.weight_block_size == (32, 32) and release.quantization.expert_dtype == "fp4"
    assert release.num_nextn_predict_layers == 3


def test_bare_text_config_parses_like_the_composite(release):
    data = json.loads(RELEASE.read_text())
    text = DeepseekV41Config.from_dict(data["text_config"], name=release.name)
    assert text == replace(release, quantization=None, image_token_id=None)


def test_layer_modes_of_the_release(release):
    plan = release.plan()
    assert plan[0].ratio == 0 and plan[0].kv_source is None and not plan[0].is_index_source
    assert plan[2].is_kv_source and plan[2].is_index_source and plan[2].ratio == 2
    assert plan[3].kv_source == 2 and not plan[3].is_index_source  # reuses 2's entries and top-k
    assert plan[13].kv_source == 8 and plan[14].is_kv_source
    assert plan[20].is_candidate_source and not plan[20].uses_candidates
    assert plan[21].kv_source == 20 and not plan[21].is_index_source
    assert plan[24].is_index_source and not plan[24].is_kv_source and plan[24].uses_candidates  # reindex
    assert plan[39].kv_source == 20 and plan[39].ratio == 1
    assert [p.engram_slot for p in plan if p.engram_slot is not None] == [0, 1]
    assert plan[1].engram_slot == 0 and plan[14].engram_slot == 1


def test_hf_saved_text_config_reads_rope_parameters():
    cfg = DeepseekV41Config.from_file(FIXTURES / "tiny_a")
    assert cfg.yarn is not None and cfg.yarn.factor == 16 and cfg.compress_rope_theta == 160000.0
    assert cfg.qk_rope_head_dim == 16 and cfg.engram_layer_ids == (1, 3)


def tiny(**changes) -> dict:
    data = {
        "model_type": "deepseek_v41_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 6,
        "num_attention_heads": 2, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 16, "o_groups": 2,
        "o_lora_rank": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "index_head_dim": 32, "compress_ratios": [0, 2, 2, 1, 1, 1],
        "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5], "candidate_source_layer_id": 3,
    }
    data.update(changes)
    return data


def test_default_sources_are_the_first_layer_of_each_ratio_run():
    cfg = DeepseekV41Config.from_dict(tiny(kv_source_layer_ids=None, index_source_layer_ids=None,
                                           candidate_source_layer_id=None))
    assert cfg.kv_source_layer_ids == (1, 3) and cfg.index_source_layer_ids == (1, 3)
    assert cfg.candidate_source_layer_id == 3


@pytest.mark.parametrize("changes, message", [
    ({"compress_ratios": [0, 4, 4, 1, 1, 1]}, "0, 1 or 2"),
    ({"index_source_layer_ids": [3, 5]}, "must also be an index source"),
    ({"kv_source_layer_ids": [1, 4], "index_source_layer_ids": [1, 4, 5], "candidate_source_layer_id": -1},
     "reads KV source"),
    ({"compress_ratios": [1, 2, 2, 1, 1, 1]}, "no KV source"),
    ({"candidate_source_layer_id": 1}, "share its KV source"),
    ({"candidate_source_layer_id": 4}, "must be an index source"),
    ({"model_type": "deepseek_v4"}, "is not one of"),
])
def test_inconsistent_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV41Config.from_dict(tiny(**changes))
