"""DeepSeek-V4.1 forward: the per-sequence state carries everything between steps.

On the oracle fixtures' tiny models (tests/fixtures/dsv41/): a prompt fed in
chunks of any size gives the logits of the one-shot prefill, a decode step
after a prompt several windows long gives the logits of recomputing the whole
sequence, and a cloned state continues exactly like the original.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4d.models.deepseek_v41 import DeepseekV41Config, DeepseekV41Model
from ds4d.models.deepseek_v41.weights import official_names, read_safetensors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module", params=("tiny_a", "tiny_b"))
def model(request) -> DeepseekV41Model:
    return DeepseekV41Model.from_pretrained(FIXTURES / request.param)


def prompt(model: DeepseekV41Model, length: int, seed: int = 5) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.vocab_size, (length,), generator=gen).tolist()


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_chunked_prefill_equals_one_shot(model, chunk):
    ids = prompt(model, 31)
    whole = model.prefill(model.new_state(), ids)
    state = model.new_state()
    chunked = model.prefill(state, ids, chunk_size=chunk)
    assert state.position == len(ids)
    assert relative_error(chunked, whole) < 1e-5


def test_decode_after_a_long_prompt_equals_recompute(model):
    ids = prompt(model, 7 * model.cfg.sliding_window + 3, seed=9)
    assert len(ids) > 5 * model.cfg.sliding_window
    assert len(ids) // 2 > model.cfg.index_topk  # both top-k levels select
    state = model.new_state()
    step = model.prefill(state, ids)[-1]
    for _ in range(6):
        ids.append(int(step.argmax()))
        step = model.decode(state, ids[-1])
        recomputed = model.prefill(model.new_state(), ids)[-1]
        assert relative_error(step, recomputed) < 1e-5


def test_a_cloned_state_continues_like_the_original(model):
    ids = prompt(model, 23, seed=3)
    state = model.new_state()
    model.prefill(state, ids[:-3])
    copy = state.clone()
    first = model.prefill(state, ids[-3:])
    second = model.prefill(copy, ids[-3:])
    assert torch.equal(first, second)


def test_index_scores_in_query_slices_equal_one_pass(model, monkeypatch):
    """A step whose per-head index scores would pass INDEX_SCORE_BYTES scores its queries in slices:
    the same logits bit for bit (here one query a slice, over a prompt where the top-k selects)."""
    from ds4d.models.deepseek_v41 import attention

    ids = prompt(model, 4 * model.cfg.sliding_window + 3)
    want = model.prefill(model.new_state(), ids)
    sliced = []
    score = attention.index_scores

    def counted(q, keys, head_weights):
        sliced.append(q.shape[0])
        return score(q, keys, head_weights)

    monkeypatch.setattr(attention, "index_scores", counted)
    monkeypatch.setattr(attention, "INDEX_SCORE_BYTES", 1)
    got = model.prefill(model.new_state(), ids)
    assert max(sliced) > 1 and torch.equal(got, want)


def test_official_and_hf_names_build_the_same_model():
    directory = FIXTURES / "tiny_a"
    hf_named = read_safetensors(directory)
    assert any(name.startswith("model.") for name in hf_named) and "lm_head.weight" in hf_named
    official = official_names(hf_named)
    assert "head.weight" in official and "layers.2.attn.compressor.wgate.weight" in official
    cfg = DeepseekV41Config.from_file(directory)
    reference = DeepseekV41Model.from_pretrained(directory)
    rebuilt = DeepseekV41Model.from_tensors(cfg, official, hasher=reference.hasher)
    ids = prompt(reference, 12)
    assert torch.equal(reference.prefill(reference.new_state(), ids), rebuilt.prefill(rebuilt.new_state(), ids))


def test_a_missing_tensor_is_named():
    directory = FIXTURES / "tiny_b"
    tensors = read_safetensors(directory)
    del tensors["layers.3.attn.indexer.wk.weight"]
    model = DeepseekV41Model.from_pretrained(directory)
    with pytest.raises(KeyError, match="layers.3.attn.indexer.wk.weight"):
        DeepseekV41Model.from_tensors(model.cfg, tensors, hasher=model.hasher)


def test_engram_layers_need_the_hasher():
    directory = FIXTURES / "tiny_b"
    cfg = DeepseekV41Config.from_file(directory)
    with pytest.raises(ValueError, match="EngramHasher"):
        DeepseekV41Model.from_tensors(cfg, read_safetensors(directory))


def test_an_fp8_engram_table_gives_what_its_decoded_values_give():
    directory = FIXTURES / "tiny_b"
    reference = DeepseekV41Model.from_pretrained(directory)
    quantized, decoded = read_safetensors(directory), read_safetensors(directory)
    for layer in reference.cfg.engram_layer_ids:
        name = f"layers.{layer}.engram.embed"
        table = quantized[f"{name}.weight"]
        scale = torch.exp2(torch.ceil(torch.log2(table.abs().unflatten(-1, (-1, 32)).amax(-1) / 448)))
        codes = (table / scale.repeat_interleave(32, dim=1)).to(torch.float8_e4m3fn)
        quantized[f"{name}.weight"], quantized[f"{name}.scale"] = codes, scale.to(torch.float8_e8m0fnu)
        decoded[f"{name}.weight"] = codes.float() * scale.repeat_interleave(32, dim=1)
    fp8 = DeepseekV41Model.from_tensors(reference.cfg, quantized, hasher=reference.hasher)
    assert fp8.weights.layers[0].engram.table.dtype == torch.float8_e4m3fn
    widened = DeepseekV41Model.from_tensors(reference.cfg, decoded, hasher=reference.hasher)
    ids = prompt(reference, 15)
    assert torch.equal(fp8.prefill(fp8.new_state(), ids), widened.prefill(widened.new_state(), ids))
