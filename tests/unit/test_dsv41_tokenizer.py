"""The V4.1 tokenizer derived from V4's for checkpoints without a tokenizer.json, and tiny
checkpoints sized for it."""

from __future__ import annotations

import json
import logging

import pytest

from ds4d.models.deepseek_v41.family import load_model
from ds4d.models.deepseek_v41.make_tiny import write_tiny
from ds4d.models.deepseek_v41.tokenizer import ASSUMED_IDS, DERIVED_SOURCE, load_tokenizer
from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

TEXT = "<｜begin▁of▁sentence｜><｜System｜>Be terse.<｜User｜>def f(x):\n    return x<｜Assistant｜><think>"


@pytest.fixture(scope="module")
def derived(tmp_path_factory):
    return load_tokenizer(tmp_path_factory.mktemp("no-tokenizer"))


def test_v41_names_on_v4_ids(derived):
    tokenizer, source = derived
    v4 = deepseek_v4_tokenizer()
    assert tokenizer.vocab_size == v4.vocab_size == 129280
    assert tokenizer.token_to_id("<｜System｜>") == 128799 == ASSUMED_IDS["<｜System｜>"]
    assert tokenizer.token_to_id("<｜deepseek_image｜>") == 129264 == v4.token_to_id("<｜image2｜>")
    assert tokenizer.token_to_id("<｜image2｜>") is None and tokenizer.token_to_id("<｜place▁holder▁no▁799｜>") is None
    assert tokenizer.encode(TEXT)[:2] == [0, 128799]
    # every other id is V4's
    plain = TEXT.replace("<｜System｜>", "")
    assert tokenizer.encode(plain) == v4.encode(plain)
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (0, frozenset({1}))
    assert source.source == DERIVED_SOURCE and source.assumed_ids == {"<｜System｜>": 128799}
    assert "ASSUMED" in source.describe() and "128799" in source.describe()


def test_a_checkpoints_own_tokenizer_wins(tmp_path):
    path = write_tiny(tmp_path, layers=[0, 2, 1])
    tokenizer, source = load_tokenizer(path)
    assert source.source == "checkpoint" and source.assumed_ids == {}
    assert tokenizer.vocab_size < 1000 and tokenizer.path == path / "tokenizer.json"


def test_a_tiny_checkpoint_sized_for_the_real_vocabulary(tmp_path, caplog):
    path = write_tiny(tmp_path, layers=[0, 2, 1], tokenizer="v4")
    assert not (path / "tokenizer.json").exists()
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    text = config["text_config"]
    assert (text["vocab_size"], text["engram_compressed_vocab_size"]) == (129280, 99092)
    assert (config["image_token_id"], text["dspark_noise_token_id"]) == (129264, 128799)
    with caplog.at_level(logging.INFO, logger="ds4d"):
        model = load_model(path, available_bytes=2**34)
    assert model.info.extra["tokenizer"]["assumed_ids"] == {"<｜System｜>": 128799}
    assert model.model.weights.embed.shape[0] == 129280
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "ASSUMED" in r.getMessage()]
    assert len(warned) == 1
    state = model.model.new_state()
    logits = model.model.prefill(state, model.tokenizer.encode(TEXT))
    assert logits.shape[-1] == 129280


def test_an_unknown_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tiny, v4"):
        write_tiny(tmp_path, tokenizer="v5")
