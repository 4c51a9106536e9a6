"""DeepSeek-V4 GGUF files written by llama.cpp's converter (tests/fixtures/gguf_v4, see
tests/parity/make_gguf_v4_fixtures.py) load into the same model as the checkpoint they came from.

* ``bf16.gguf`` holds exactly the weights ds4d decodes from the tiny checkpoint (F32, BF16,
  MXFP4 as converted): every weight and every logit must be equal, bit for bit.
* Files with lossy types (``converted.gguf``: the FP8 linears as Q8_0; ``quant-*.gguf`` from
  llama-quantize): every weight must equal what ``gguf.quants.dequantize`` gives for its GGUF
  tensor, element for element, and the logits must equal those of ds4d's safetensors path on a
  float32 checkpoint of those dequantised weights, bit for bit.  Against the original
  checkpoint, a Q8_0 weight may be off by at most one step of its block (max|w| / 127).
* The split set loads like the single file; bad files are refused naming the tensor or key.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ds4d.models.deepseek_v4 import load_model
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.gguf_loader import GGUFSet, load_gguf_model, read_config
from ds4d.models.deepseek_v4.gguf_names import MetadataError, expert_gguf_name, gguf_name
from ds4d.models.deepseek_v4.loader import CheckpointError
from ds4d.models.gguf_tokenizer import GGUFTokenizer
from tests.parity.make_gguf_v4_fixtures import OUT as FIXTURES
from tests.parity.make_gguf_v4_fixtures import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [0, *range(3, 200, 3), *range(500, 300, -7)]  # 96 ids below the cut vocabulary's 512
QUANTIZED = sorted(p.name for p in FIXTURES.glob("quant-*.gguf"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-v4") / "tiny-v4")


@pytest.fixture(scope="module")
def checkpoint_model(checkpoint):
    return load_model(checkpoint)


def reference_weights(weights) -> dict[str, torch.Tensor]:
    """The loaded model's parameters under the GGUF names they come from (experts stacked)."""
    named = {"token_embd.weight": weights.embed, "output_norm.weight": weights.norm, "output.weight": weights.head,
             "output_hc_fn.weight": weights.head_hc.fn, "output_hc_base.weight": weights.head_hc.base,
             "output_hc_scale.weight": weights.head_hc.scale}

    def dense(linear):
        return linear.dense() if hasattr(linear, "dense") else linear

    for i, layer in enumerate(weights.layers):
        def put(reference: str, tensor, layer_index: int = i) -> None:
            named[gguf_name(f"layers.{layer_index}.{reference}")] = dense(tensor)

        put("attn_norm.weight", layer.attn_norm)
        put("ffn_norm.weight", layer.ffn_norm)
        for site, hyper in (("attn", layer.attn_hc), ("ffn", layer.ffn_hc)):
            for part in ("fn", "base", "scale"):
                put(f"hc_{site}_{part}", getattr(hyper, part))
        attn = layer.attn
        for part in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b"):
            put(f"attn.{part}.weight", getattr(attn, part))
        put("attn.attn_sink", attn.sink)
        for prefix, comp in (("attn.compressor.", attn.compressor),
                             ("attn.indexer.compressor.", attn.indexer.compressor if attn.indexer else None)):
            if comp is not None:
                for part in ("wkv", "wgate", "norm"):
                    put(f"{prefix}{part}.weight", getattr(comp, part))
                put(prefix + "ape", comp.ape)
        if attn.indexer is not None:
            put("attn.indexer.wq_b.weight", attn.indexer.wq_b)
            put("attn.indexer.weights_proj.weight", attn.indexer.weights_proj)
        ffn = layer.ffn
        put("ffn.gate.weight", ffn.gate)
        if ffn.bias is not None:
            put("ffn.gate.bias", ffn.bias)
        if ffn.tid2eid is not None:
            put("ffn.gate.tid2eid", ffn.tid2eid)
        for w in ("w1", "w2", "w3"):
            put(f"ffn.shared_experts.{w}.weight", getattr(ffn, f"shared_{w}"))
        gate_up, down = ffn.experts.dense()
        inter = gate_up.shape[1] // 2
        named[expert_gguf_name(i, "w1")] = gate_up[:, :inter]
        named[expert_gguf_name(i, "w3")] = gate_up[:, inter:]
        named[expert_gguf_name(i, "w2")] = down
    return named


def gguf_reference(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor of a GGUF file (or split set) as the gguf package decodes it: name -> (type, values)."""
    paths = sorted(path.parent.glob(path.name.replace("00001-of", "*-of"))) if "-00001-of-" in path.name else [path]
    out = {}
    for shard in paths:
        for t in gguf.GGUFReader(shard).tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if t.tensor_type.name == "I32":
                values = torch.from_numpy(np.array(t.data, dtype=np.int64))
            elif t.tensor_type.name == "BF16":  # stored as raw 16-bit words
                values = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).float()
            else:
                values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            out[t.name] = (t.tensor_type.name, values.reshape(shape))
    return out


def test_the_deepseek_v4_family_alone_claims_v4_gguf_files_and_leaves_other_gguf_files(tmp_path):
    import logging

    from ds4d.config import Config
    from ds4d.contracts import PluginContext
    from ds4d.registry import available

    ctx = PluginContext(Config(device="cpu", dtype="float32", threads=1), logging.getLogger("t"))
    families = {name: spec.load()(ctx, {}) for name, spec in available("model_family").items()}
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(other, arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    for path, owners in ((FIXTURES / "converted.gguf", ["deepseek_v4"]),
                         (FIXTURES / "bf16-00001-of-00003.gguf", ["deepseek_v4"]),
                         (FIXTURES / "bf16-00002-of-00003.gguf", []),  # a later shard: no metadata of its own
                         (other, ["llama"])):
        assert sorted(name for name, family in families.items() if family.can_load(path)) == owners, path


def test_config_comes_from_the_metadata(checkpoint):
    from_gguf = read_config(GGUFSet(FIXTURES / "converted.gguf"))
    original = DeepseekV4Config.from_file(checkpoint)
    assert from_gguf.num_nextn_predict_layers == 0 and from_gguf.quantization is None  # MTP not converted
    for field in ("raw", "name", "num_nextn_predict_layers", "quantization"):
        original = _without(original, field)
        from_gguf = _without(from_gguf, field)
    assert from_gguf == original


def _without(cfg: DeepseekV4Config, field: str) -> dict:
    data = cfg if isinstance(cfg, dict) else dict(cfg.__dict__)
    return {k: v for k, v in data.items() if k != field}


def test_bf16_file_holds_the_checkpoint_weights_and_gives_its_logits_exactly(checkpoint_model):
    model = load_gguf_model(FIXTURES / "bf16.gguf")
    expected, got = reference_weights(checkpoint_model.weights), reference_weights(model.weights)
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name].float(), expected[name].float()), name
    assert torch.equal(model.logits_for(PROMPT), checkpoint_model.logits_for(PROMPT))


def test_converted_file_is_the_checkpoint_up_to_one_q8_0_step(checkpoint_model):
    model = load_gguf_model(FIXTURES / "converted.gguf")
    stored = gguf_reference(FIXTURES / "converted.gguf")
    expected, got = reference_weights(checkpoint_model.weights), reference_weights(model.weights)
    q8 = 0
    for name, (kind, _) in stored.items():
        want, have = expected[name].float(), got[name].float()
        if kind == "Q8_0":  # the checkpoint's FP8 linears: re-blocked by 32 along the rows
            q8 += 1
            blocks = want.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            assert ((have.reshape(-1, 32) - blocks).abs() <= step).all(), name
        else:
            assert torch.equal(have, want), f"{name} ({kind})"
    assert q8 == 7 * 3 + 1  # four attention and three shared-expert linears a layer, the indexer's wq_b


@pytest.mark.parametrize("file", ["converted.gguf", *QUANTIZED])
def test_lossy_files_give_the_float32_forward_of_the_gguf_dequantised_weights(file, checkpoint, tmp_path):
    model = load_gguf_model(FIXTURES / file)
    stored = gguf_reference(FIXTURES / file)
    got = reference_weights(model.weights)
    assert set(got) == set(stored)
    for name, (kind, values) in stored.items():
        assert torch.equal(got[name].float() if kind != "I32" else got[name], values), f"{name} ({kind})"
    float_checkpoint = _float_checkpoint(stored, checkpoint, tmp_path / "dequantised")
    assert torch.equal(model.logits_for(PROMPT), load_model(float_checkpoint).logits_for(PROMPT))


def _float_checkpoint(stored: dict[str, tuple[str, torch.Tensor]], original: Path, out: Path) -> Path:
    """A float32 safetensors checkpoint (reference names) of the dequantised GGUF tensors."""
    out.mkdir()
    config = json.loads((original / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    by_gguf = {}
    for layer in range(config["num_hidden_layers"]):
        for which in ("w1", "w2", "w3"):
            by_gguf[expert_gguf_name(layer, which)] = (layer, which)
    names = {}
    from ds4d.models.deepseek_v4.loader import expected_tensors

    for reference in expected_tensors(DeepseekV4Config.from_dict(config)):
        if ".ffn.experts." not in reference:
            names[gguf_name(reference)] = reference
    tensors = {}
    for name, (_, values) in stored.items():
        if name in by_gguf:
            layer, which = by_gguf[name]
            for expert, matrix in enumerate(values):
                tensors[f"layers.{layer}.ffn.experts.{expert}.{which}.weight"] = matrix.contiguous()
        else:
            tensors[names[name]] = values.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_a_split_set_loads_like_the_single_file():
    single, split = GGUFSet(FIXTURES / "bf16.gguf"), GGUFSet(FIXTURES / "bf16-00001-of-00003.gguf")
    assert len(split.files) == 3 and sorted(split.tensor_names) == sorted(single.tensor_names)
    for name in single.tensor_names:
        assert torch.equal(split.tensor(name), single.tensor(name)), name
    a, b = load_gguf_model(FIXTURES / "bf16.gguf"), load_gguf_model(FIXTURES / "bf16-00001-of-00003.gguf")
    assert torch.equal(a.logits_for(PROMPT), b.logits_for(PROMPT))


def test_an_incomplete_split_set_names_the_missing_shard(tmp_path):
    for shard in ("bf16-00001-of-00003.gguf", "bf16-00002-of-00003.gguf"):
        (tmp_path / shard).write_bytes((FIXTURES / shard).read_bytes())
    with pytest.raises(CheckpointError, match="missing bf16-00003-of-00003.gguf"):
        GGUFSet(tmp_path / "bf16-00001-of-00003.gguf")
    with pytest.raises(CheckpointError, match="serve the first shard, bf16-00001-of-00003.gguf"):
        GGUFSet(tmp_path / "bf16-00002-of-00003.gguf")


def rewrite(source: Path, out: Path, *, tensors: dict | None = None, drop: tuple = (), keys: dict | None = None) -> Path:
    """A copy of GGUF ``source``: ``tensors`` {name: (uint8 bytes [rows, row_bytes], GGML type)} replaced or
    added, tensors ``drop`` left out, metadata ``keys`` {key: (value, GGUFValueType, sub type)} set."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, arch=reader.fields["general.architecture"].contents())
    keys = dict(keys or {})
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value, vtype, sub = keys.pop(field.name, (field.contents(), field.types[0], sub))
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for key, (value, vtype, sub) in keys.items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    data = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors if t.name not in drop}
    data.update(tensors or {})
    for name, (array, kind) in data.items():
        writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for array, _ in data.values():
        writer.write_tensor_data(array)
    writer.close()
    return out


def with_the_v4_vocabulary(source: Path, out: Path, seed: int = 0) -> Path:
    """A copy of the fixture GGUF ``source`` (cut to 512 ids) for the real DeepSeek-V4 vocabulary: the
    tokenizer metadata of the converter's ``--vocab-only`` file (129,280 ids) and the embedding, head
    and hash-routing tables grown to it, their rows drawn from the fixture's (BF16 tables)."""
    import lzma

    vocab = out.with_name(out.stem + ".vocab-only.gguf")
    vocab.write_bytes(lzma.decompress((FIXTURES / "vocab-only.gguf.xz").read_bytes()))
    keys = {}
    for field in gguf.GGUFReader(vocab).fields.values():
        if field.name.startswith("tokenizer.ggml."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            keys[field.name] = (field.contents(), field.types[0], sub)
    vocab.unlink()
    size = len(keys["tokenizer.ggml.tokens"][0])
    rng = np.random.default_rng(seed)
    tensors = {}
    for tensor in gguf.GGUFReader(source).tensors:
        if tensor.name in ("token_embd.weight", "output.weight"):
            assert tensor.tensor_type == gguf.GGMLQuantizationType.BF16, tensor.name
            rows = np.array(tensor.data).reshape(-1, tensor.data.shape[-1])
            tensors[tensor.name] = (rows[rng.integers(0, rows.shape[0], size)], tensor.tensor_type)
        elif tensor.name.endswith("ffn_gate_tid2eid.weight"):  # a hash layer's expert ids per token
            experts = int(np.array(tensor.data).max()) + 1
            tensors[tensor.name] = (rng.integers(0, experts, (size, tensor.data.shape[-1])).astype(np.int32),
                                    tensor.tensor_type)
    return rewrite(source, out, tensors=tensors, keys=keys)


def test_a_type_the_gguf_package_cannot_decode_is_refused_naming_the_tensor(tmp_path):
    Q = gguf.GGMLQuantizationType
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    q8k = np.zeros((32, 256 // block * size), dtype=np.uint8)  # attn_q_a is [32, 256]
    bad = rewrite(FIXTURES / "bf16.gguf", tmp_path / "q8k.gguf", tensors={"blk.0.attn_q_a.weight": (q8k, Q.Q8_K)})
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.attn_q_a\.weight' has type Q8_K"):
        load_gguf_model(bad)


def test_missing_and_unknown_tensors_are_named(tmp_path):
    missing = rewrite(FIXTURES / "bf16.gguf", tmp_path / "missing.gguf", drop=("blk.2.exp_probs_b.bias",))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.2\.exp_probs_b\.bias'"):
        load_gguf_model(missing)
    extra = np.zeros((4, 256 * 4), dtype=np.float32)
    unknown = rewrite(FIXTURES / "bf16.gguf", tmp_path / "mtp.gguf",
                      tensors={"blk.3.nextn.eh_proj.weight": (extra, gguf.GGMLQuantizationType.F32)})
    with pytest.raises(CheckpointError, match=r"'blk\.3\.nextn\.eh_proj\.weight' not used"):
        load_gguf_model(unknown)


@pytest.mark.parametrize(("key", "value", "vtype", "sub", "message"), [
    ("deepseek4.attention.head_count_kv", 2, gguf.GGUFValueType.UINT32, None, "one KV head"),
    ("deepseek4.swiglu_clamp_exp", [10.0, 7.0, 10.0], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32,
     "one limit"),
    ("deepseek4.rope.scaling.type", "linear", gguf.GGUFValueType.STRING, None, "YaRN or no RoPE scaling"),
])
def test_metadata_ds4d_cannot_serve_is_refused_naming_the_key(tmp_path, key, value, vtype, sub, message):
    bad = rewrite(FIXTURES / "bf16.gguf", tmp_path / "bad.gguf", keys={key: (value, vtype, sub)})
    with pytest.raises(MetadataError, match=f"{key} = .*{message}"):
        load_gguf_model(bad)


NEXTN = {"deepseek4.nextn_predict_layers": (1, gguf.GGUFValueType.UINT32, None)}


def test_a_next_token_prediction_count_without_its_block_serves_the_file(tmp_path):
    """ds4's files: ``nextn_predict_layers`` = 1 copied from the converter that dropped the MTP block, no MTP
    tensor, ``block_count`` the main model's.  Served as the main model, the same logits as without the key."""
    plain = load_gguf_model(FIXTURES / "bf16.gguf")
    ds4_like = load_gguf_model(rewrite(FIXTURES / "bf16.gguf", tmp_path / "ds4-like.gguf", keys=NEXTN))
    assert ds4_like.cfg.num_hidden_layers == plain.cfg.num_hidden_layers
    assert torch.equal(ds4_like.logits_for(PROMPT), plain.logits_for(PROMPT))


def test_an_mtp_block_after_the_main_ones_is_left_unused_and_an_mtp_only_file_refused(tmp_path):
    """An export with its MTP block: one more block (``blk.L.*``, a whole layer's tensors and ``blk.L.nextn.*``),
    ``block_count`` L + 1.  The main L blocks are served, the same logits; a file of the MTP block alone (no
    main block) is refused naming the key, and so is one named as ds4's MTP file (``mtp.0.*``)."""
    reader = gguf.GGUFReader(FIXTURES / "bf16.gguf")
    layers = int(reader.fields["deepseek4.block_count"].contents())
    last = f"blk.{layers - 1}."
    extra = {t.name.replace(last, f"blk.{layers}.", 1): (np.array(t.data), t.tensor_type)
             for t in reader.tensors if t.name.startswith(last)}
    extra[f"blk.{layers}.nextn.eh_proj.weight"] = (np.zeros((4, 8), dtype=np.float32), gguf.GGMLQuantizationType.F32)
    ratios = [int(r) for r in reader.fields["deepseek4.attention.compress_ratios"].contents()]
    keys = dict(NEXTN, **{"deepseek4.block_count": (layers + 1, gguf.GGUFValueType.UINT32, None),
                          "deepseek4.attention.compress_ratios": (ratios[:layers] + [0], gguf.GGUFValueType.ARRAY,
                                                                  gguf.GGUFValueType.UINT32)})
    with_mtp = load_gguf_model(rewrite(FIXTURES / "bf16.gguf", tmp_path / "with-mtp.gguf", tensors=extra, keys=keys))
    assert with_mtp.cfg.num_hidden_layers == layers
    assert torch.equal(with_mtp.logits_for(PROMPT), load_gguf_model(FIXTURES / "bf16.gguf").logits_for(PROMPT))
    main = tuple(t.name for t in reader.tensors if t.name.startswith("blk."))
    alone = rewrite(FIXTURES / "bf16.gguf", tmp_path / "mtp-only.gguf", tensors=extra, keys=keys, drop=main)
    with pytest.raises(MetadataError, match=r"deepseek4\.nextn_predict_layers = 1: an MTP-only export"):
        load_gguf_model(alone)
    named_apart = {name.replace(f"blk.{layers}.", "mtp.0.", 1): value for name, value in extra.items()}
    ds4_mtp = rewrite(FIXTURES / "bf16.gguf", tmp_path / "ds4-mtp.gguf", tensors=named_apart, drop=main)
    with pytest.raises(CheckpointError, match=r"its tensors are mtp\.\* and it has no main block"):
        load_gguf_model(ds4_mtp)  # ds4's MTP file names its block mtp.0.*, with or without the key
    short = rewrite(FIXTURES / "bf16.gguf", tmp_path / "short.gguf", tensors=extra, keys=keys,
                    drop=("blk.1.attn_q_a.weight",))  # a main block short of a tensor is not the model's end
    with pytest.raises(MetadataError, match=r"block_count = .*: block 1 has no attn_q_a tensor"):
        load_gguf_model(short)


def test_the_cut_vocabulary_gives_a_tokenizer_from_the_file():
    model = load_gguf_model(FIXTURES / "bf16.gguf")
    assert isinstance(model.tokenizer, GGUFTokenizer) and model.tokenizer.vocab_size == 512
    assert model.tokenizer.bos_token_id == 0 and 1 in model.tokenizer.eos_token_ids


def test_native_weights_need_cuda():
    with pytest.raises(ValueError, match="weight_format native"):
        load_gguf_model(FIXTURES / "bf16.gguf", weight_format="native")


TEXTS = [
    "Hello, world! It's 12345 o'clock.\n\n  def f(x):\n\treturn x**2  # 注释 日本語のテキスト カタカナ",
    "<｜begin▁of▁sentence｜><｜User｜>Hi there<｜Assistant｜><think>ok</think>done<｜end▁of▁sentence｜>",
    "Ünïcödé façade — “quotes” ... !!! ??? 3.14159 1,000,000 $5 @user #tag https://x.org/a?b=c&d=e",
    "   leading spaces\r\nCRLF\n\n\nand tabs\t\tend   ",
]


@pytest.fixture(scope="module")
def vocab_only(tmp_path_factory) -> Path:
    """The converter's ``--vocab-only`` file of the V4 tokenizer (129,280 ids), stored xz-compressed."""
    import lzma

    path = tmp_path_factory.mktemp("vocab") / "vocab-only.gguf"
    path.write_bytes(lzma.decompress((FIXTURES / "vocab-only.gguf.xz").read_bytes()))
    return path


def test_the_v4_vocabulary_gets_the_v4_tokenizer(vocab_only):
    from ds4d.models.deepseek_v4.gguf_loader import load_tokenizer
    from ds4d.models.hf_tokenizer import HFTokenizer

    tokenizer = load_tokenizer(GGUFSet(vocab_only))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == 129280


def test_the_tokenizer_rebuilt_from_the_metadata_gives_the_v4_ids(vocab_only):
    from ds4d.models.gguf_file import GGUFFile
    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

    with GGUFFile(vocab_only) as file:
        assert file.get("tokenizer.ggml.pre") == "joyai-llm"  # the V4 pre-tokenizer's hash, as the converter names it
        rebuilt = GGUFTokenizer.from_gguf(file)
    v4 = deepseek_v4_tokenizer()
    for text in TEXTS:
        assert rebuilt.encode(text) == v4.encode(text), text
    assert rebuilt.bos_token_id == 0 and rebuilt.eos_token_id == 1 and 1 in v4.eos_token_ids


def test_an_f16_tensor_is_decoded_exactly(tmp_path):
    """llama-quantize's F16 file type keeps the BF16 tensors; an F16 tensor is written here instead."""
    single = GGUFSet(FIXTURES / "bf16.gguf")
    values = single.tensor("blk.0.attn_q_a.weight").numpy().astype(np.float16)
    f16 = rewrite(FIXTURES / "bf16.gguf", tmp_path / "f16.gguf",
                  tensors={"blk.0.attn_q_a.weight": (values, gguf.GGMLQuantizationType.F16)})
    model = load_gguf_model(f16)
    assert torch.equal(model.weights.layers[0].attn.wq_a, torch.from_numpy(values.astype(np.float32)))


def test_expert_shapes_that_disagree_with_the_metadata_are_named(tmp_path):
    bad = rewrite(FIXTURES / "bf16.gguf", tmp_path / "ffn.gguf",
                  keys={"deepseek4.expert_feed_forward_length": (128, gguf.GGUFValueType.UINT32, None)})
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \(4, 64, 256\)"):
        load_gguf_model(bad)
