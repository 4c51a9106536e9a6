"""HFTokenizer: the real DeepSeek-V4 vocabulary and how eos/bos ids are read from config files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers

from ds4d.contracts import Tokenizer
from ds4d.models.hf_tokenizer import HFTokenizer, deepseek_v4_tokenizer

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(os.environ.get("DS4D_REFERENCE_DIR", REPO / "tests" / "fixtures" / "reference"))

V4_SINGLE_ID_TOKENS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<｜latest_reminder｜>": 128828,
    "<｜action｜>": 128829,
}


@pytest.fixture(scope="module")
def v4() -> HFTokenizer:
    return deepseek_v4_tokenizer()


def test_v4_vocabulary_and_special_ids(v4: HFTokenizer) -> None:
    assert isinstance(v4, Tokenizer)
    assert v4.vocab_size == 129280
    assert v4.bos_token_id == 0
    assert v4.eos_token_ids == frozenset({1})
    for text, token_id in V4_SINGLE_ID_TOKENS.items():
        assert v4.token_to_id(text) == token_id
        assert v4.encode(text) == [token_id], text
        assert v4.id_to_token(token_id) == text
    for name in ("query", "authority", "domain", "title", "read_url"):
        assert len(v4.encode(f"<｜{name}｜>")) == 1
    assert v4.token_to_id("<no such token>") is None
    assert v4.id_to_token(129280) is None and v4.id_to_token(-1) is None


def test_v4_dsml_markup_tokenizes_around_the_marker(v4: HFTokenizer) -> None:
    ids = v4.encode('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read">')
    assert ids.count(128825) == 2
    assert v4.decode(ids) == '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read">'


def test_v4_roundtrip_of_an_official_prompt(v4: HFTokenizer) -> None:
    path = REFERENCE / "dsv4" / "encoding" / "test_output_1.txt"
    if not path.is_file():
        pytest.skip(f"reference vectors not found at {path.parent} (set DS4D_REFERENCE_DIR)")
    text = path.read_text(encoding="utf-8")
    ids = v4.encode(text)
    assert ids[0] == 0 and ids[-1] == 1
    assert 128821 in ids and 128822 in ids
    assert v4.decode(ids) == text
    assert v4.encode(text, add_special_tokens=True) == ids  # V4 adds no BOS by itself


def test_v4_decode_keeps_markup_even_when_skipping_special_tokens(v4: HFTokenizer) -> None:
    ids = v4.encode("<｜begin▁of▁sentence｜><think>a</think>b<｜end▁of▁sentence｜>")
    assert v4.decode(ids, skip_special_tokens=True) == "<think>a</think>b"


def test_v4_incomplete_utf8_decodes_to_replacement_char(v4: HFTokenizer) -> None:
    ids = v4.encode("𝔘")
    assert len(ids) > 1
    assert v4.decode(ids[:1]).endswith("\ufffd")
    assert v4.decode(ids) == "𝔘"


def _tiny_tokenizer(directory: Path) -> Path:
    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.add_special_tokens(["<s>", "</s>", "<eot>"])
    path = directory / "tokenizer.json"
    rust.save(str(path))
    return path


def test_config_files_choose_bos_and_eos(tmp_path: Path) -> None:
    path = _tiny_tokenizer(tmp_path)
    bare = HFTokenizer(path)
    assert bare.bos_token_id is None and bare.eos_token_ids == frozenset()
    assert bare.vocab_size == 6

    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    configured = HFTokenizer(path)
    assert configured.bos_token_id == 0
    assert configured.eos_token_ids == frozenset({1, 2})
    assert configured.encode("hello world") == [3, 4]
    assert configured.encode("hello world", add_special_tokens=True) == [0, 3, 4]
    assert configured.encode("hello</s>") == [3, 1]


def test_explicit_tokenizer_config_path(tmp_path: Path) -> None:
    path = _tiny_tokenizer(tmp_path)
    elsewhere = tmp_path / "cfg.json"
    elsewhere.write_text(json.dumps({"eos_token": "<eot>"}))
    assert HFTokenizer(path, elsewhere).eos_token_ids == frozenset({2})
