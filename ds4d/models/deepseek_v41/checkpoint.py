"""Reads an official DeepSeek-V4.1 checkpoint directory into ``{official name: tensor}``.

Accepted directories: one ``*.safetensors`` file or several, sharded with
``model.safetensors.index.json``; tensors under the official names (``layers.3.attn.
wq_a.weight`` + ``.scale``) or under the names HF transformers' ``save_pretrained``
writes (``model.`` + official name, ``lm_head.weight`` for ``head.weight``; an FP8
scale may be called ``weight_scale_inv``).  What the directory must hold comes from
:class:`~ds4d.models.deepseek_v41.layout.CheckpointLayout` for its config.json.

Everything is checked before a byte of tensor data is read: every shard's header
against the file's size (a truncated download names the tensors it cut off and
the file), every tensor the layout lists for the groups asked for (missing, wrong
shape, wrong dtype: the error names the tensor and its file), and every stored
tensor against the layout (one the config does not describe is an error, except
vision and DSpark tensors, which are skipped with one log line).

Each shard is memory-mapped once, copy-on-write: tensors kept as stored are views
of the file (the Engram tables stay on disk until their rows are touched), and
decoding reads one tensor at a time.  FP8 weights are decoded with their
32 x 32 (Engram: 1 x 32) block scales and FP4 experts with their per-32 scales by
the V4 decoders, whose formats these are.  A weight stored as a float of its
decoded shape (an HF save in bf16) is taken as already decoded; a scale stored
beside it is not applied.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from ds4d.models.deepseek_v4.loader import CheckpointError
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4
from ds4d.models.deepseek_v41.layout import (
    DSPARK,
    FP4,
    FP8,
    PLAIN,
    SCALE,
    TEXT,
    VISION,
    CheckpointLayout,
    LayoutConfig,
    TensorSpec,
    official_name,
    skippable_group,
)

__all__ = ["CheckpointError", "OfficialCheckpoint", "ShardedSafetensors", "read_checkpoint"]

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"

TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
FP8_WEIGHT_DTYPES = {"F8_E4M3"}
FP4_WEIGHT_DTYPES = {"I8", "U8"}
SCALE_DTYPES = {"F8_E8M0", "U8", "F32"}


class ShardedSafetensors:
    """Name -> tensor over the safetensors shards of a directory, each shard mapped once.

    The maps are private (copy-on-write): pages are read from the file when touched and a
    write to a tensor never reaches the file.  Under strict overcommit
    (``vm.overcommit_memory = 2``) each map counts against the commit limit."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._file: dict[str, Path] = {}
        self._info: dict[str, dict] = {}
        self._data_start: dict[Path, int] = {}
        self._maps: dict[Path, np.memmap] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index}: not a safetensors index ({error})") from error
            headers = {}
            for file in sorted(set(weight_map.values())):
                shard = self.directory / file
                if not shard.is_file():
                    first = next(name for name, f in weight_map.items() if f == file)
                    raise CheckpointError(f"{shard}: shard named in {INDEX_FILE} (for tensor {first!r}) is missing")
                headers[shard] = self._read_header(shard)
            for name, file in weight_map.items():
                shard = self.directory / file
                if name not in headers[shard]:
                    raise CheckpointError(f"tensor {name!r}: {INDEX_FILE} names {file}, which does not hold it")
                self._file[name], self._info[name] = shard, headers[shard][name]
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.directory}: no *.safetensors files (to serve random weights of its "
                                      "config.json: load_format = random)")
            for shard in shards:
                for name, info in self._read_header(shard).items():
                    if name in self._file:
                        raise CheckpointError(f"tensor {name!r} is in both {self._file[name].name} and {shard.name}")
                    self._file[name], self._info[name] = shard, info

    def _read_header(self, shard: Path) -> dict[str, dict]:
        size = shard.stat().st_size
        with shard.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{shard}: truncated before the safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if 8 + header_len > size:
                raise CheckpointError(f"{shard}: truncated inside the safetensors header")
            try:
                header = json.loads(handle.read(header_len))
            except ValueError as error:
                raise CheckpointError(f"{shard}: unreadable safetensors header ({error})") from error
        header.pop("__metadata__", None)
        start = 8 + header_len
        self._data_start[shard] = start
        cut = sorted((info["data_offsets"][1], name) for name, info in header.items()
                     if start + info["data_offsets"][1] > size)
        if cut:
            names = ", ".join(repr(name) for _, name in cut[:5])
            more = f" and {len(cut) - 5} more" if len(cut) > 5 else ""
            raise CheckpointError(f"{shard}: file is truncated at {size} bytes; tensor {names}{more} "
                                  f"extend past its end (it needs {start + cut[-1][0]} bytes)")
        for name, info in header.items():
            begin, end = info["data_offsets"]
            dtype = TORCH_DTYPES.get(info["dtype"])
            if dtype is None:
                continue  # a dtype this reader cannot map; an error only if the tensor is read
            if end - begin != math.prod(info["shape"]) * dtype.itemsize:
                raise CheckpointError(f"tensor {name!r} in {shard}: header gives {end - begin} bytes for "
                                      f"{info['dtype']} {info['shape']}")
        return header

    def names(self) -> list[str]:
        return list(self._file)

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def file_of(self, name: str) -> Path:
        return self._file[name]

    def dtype_of(self, name: str) -> str:
        return self._info[name]["dtype"]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored: a view of the shard's copy-on-write map (writes stay private)."""
        shard, info = self._file[name], self._info[name]
        dtype = TORCH_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} in {shard.name}: unsupported dtype {info['dtype']}")
        mapped = self._maps.get(shard)
        if mapped is None:
            mapped = self._maps[shard] = np.memmap(shard, dtype=np.uint8, mode="c")
        begin, end = (self._data_start[shard] + offset for offset in info["data_offsets"])
        raw = torch.from_numpy(mapped[begin:end])
        return raw.view(dtype).reshape(info["shape"])

    def close(self) -> None:
        """Drop the maps (tensors handed out keep theirs alive)."""
        self._maps.clear()


_GROUP_LABELS = ((VISION, "vision"), (DSPARK, "DSpark"), (TEXT, "text"))


class OfficialCheckpoint:
    """A checked V4.1 checkpoint: the tensors of ``groups``, by official name, one at a time."""

    def __init__(
        self,
        directory: str | Path,
        config: Mapping | LayoutConfig | CheckpointLayout | None = None,
        *,
        groups: Iterable[str] = (TEXT,),
        log: logging.Logger | None = None,
    ) -> None:
        self.directory = Path(directory)
        if config is None:
            config_file = self.directory / "config.json"
            if not config_file.is_file():
                raise CheckpointError(f"{self.directory}: no config.json")
            config = json.loads(config_file.read_text(encoding="utf-8"))
        self.layout = config if isinstance(config, CheckpointLayout) else CheckpointLayout(config)
        self.groups = tuple(groups)
        self.shards = ShardedSafetensors(self.directory)
        self._stored: dict[str, str] = {}
        """Official name -> stored name, for every stored tensor."""
        for stored in self.shards.names():
            name = official_name(stored)
            if name in self._stored:
                raise CheckpointError(f"tensor {name!r} is stored twice: as {self._stored[name]!r} and {stored!r}")
            self._stored[name] = stored
        self.specs = self.layout.select(self.groups)
        self.skipped = self._classify()
        self._dense: set[str] = set()
        """Quantised weights stored already decoded (float, decoded shape)."""
        for spec in self.specs:
            self._check(spec)
        if self.skipped:
            groups = list(self.skipped.values())
            parts = [f"{groups.count(group)} {label}" for group, label in _GROUP_LABELS if group in groups]
            (log or logger).info("%s: skipped %s tensors (not read)", self.directory, " and ".join(parts))

    def _classify(self) -> dict[str, str]:
        """Stored tensors not read, by official name -> group; raise on a text tensor the layout
        does not know.  A vision or DSpark tensor outside the layout (a config without a
        vision_config; ``mtp.K.embed`` / ``mtp.K.head``, the reference's aliases of the shared
        embedding and head) is skipped."""
        skipped, unknown = {}, []
        wanted = set(self.groups)
        for name in self._stored:
            if name in self.layout:
                group = self.layout[name].group
                if group not in wanted:
                    skipped[name] = group
                continue
            group = skippable_group(name)
            if group is None:
                unknown.append(name)
            else:
                skipped[name] = group
        if unknown:
            listed = ", ".join(f"{self._stored[n]!r} ({self.shards.file_of(self._stored[n]).name})"
                               for n in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise CheckpointError(f"{self.directory}: tensor {listed}{more} not in the layout of its config.json "
                                  "(config and checkpoint disagree)")
        return skipped

    def _where(self, name: str) -> str:
        stored = self._stored[name]
        alias = f" (stored as {stored!r})" if stored != name else ""
        return f"tensor {name!r}{alias} in {self.shards.file_of(stored)}"

    def _require(self, name: str) -> str:
        if name not in self._stored:
            files = len({self.shards.file_of(stored) for stored in self._stored.values()})
            raise CheckpointError(f"{self.directory}: missing tensor {name!r} (in none of its {files} "
                                  f"safetensors file{'s' if files > 1 else ''})")
        return self._stored[name]

    def _check(self, spec: TensorSpec) -> None:
        if self._is_unused_scale(spec):
            return
        stored = self._require(spec.name)
        dtype, shape = self.shards.dtype_of(stored), self.shards.shape_of(stored)
        if spec.quant == PLAIN:
            ok = shape == spec.shape and (dtype == spec.dtype or {dtype, spec.dtype} <= FLOAT_DTYPES)
        elif spec.is_quantized:
            if dtype in FLOAT_DTYPES and shape == spec.dense_shape:
                self._dense.add(spec.name)
                return
            kinds = FP8_WEIGHT_DTYPES if spec.quant == FP8 else FP4_WEIGHT_DTYPES
            ok = shape == spec.shape and dtype in kinds
            if ok:
                self._require(spec.scale_name)
        else:  # the scale of a weight stored quantised
            ok = shape == spec.shape and dtype in SCALE_DTYPES
        if not ok:
            raise CheckpointError(f"{self._where(spec.name)}: stored {dtype} {list(shape)}, the layout wants "
                                  f"{spec.dtype} {list(spec.shape)}")

    # ------------------------------------------------------------------ access

    def names(self) -> list[str]:
        """Official names of the tensors read, scales included, in layout order."""
        return [spec.name for spec in self.specs if not self._is_unused_scale(spec)]

    def _is_unused_scale(self, spec: TensorSpec) -> bool:
        return spec.quant == SCALE and spec.name.removesuffix("scale") + "weight" in self._dense

    def stored(self, name: str) -> torch.Tensor:
        """The tensor as the file holds it (FP8 as float8_e4m3fn, FP4 as int8 pairs, scales as
        float8_e8m0fnu), a view of the memory-mapped shard."""
        return self.shards.get(self._require(name))

    def dense(self, name: str) -> torch.Tensor:
        """A quantised weight decoded to float32 ``[out, in]``; any other tensor as stored."""
        if name not in self.layout:
            raise CheckpointError(f"tensor {name!r} is not in the layout of {self.directory}")
        spec = self.layout[name]
        if not spec.is_quantized or name in self._dense:
            return self.stored(name)
        weight, scale = self.stored(name), self.stored(spec.scale_name)
        try:
            if spec.quant == FP4:
                return dequant_mxfp4(weight, scale)
            return dequant_fp8_block(weight, scale, spec.block)
        except ValueError as error:
            raise CheckpointError(f"{self._where(name)}: {error}") from error

    def read(self, dequantize: bool = True) -> dict[str, torch.Tensor]:
        if not dequantize:
            return {name: self.stored(name) for name in self.names()}
        return {spec.name: self.dense(spec.name) for spec in self.specs if spec.quant != SCALE}


def read_checkpoint(
    directory: str | Path,
    config: Mapping | LayoutConfig | CheckpointLayout | None = None,
    *,
    dequantize: bool = True,
    groups: Iterable[str] = (TEXT,),
    log: logging.Logger | None = None,
) -> dict[str, torch.Tensor]:
    """``{official name: tensor}`` of an official (or HF-named) V4.1 checkpoint directory.

    ``config``: the config.json dict (default: the directory's own).  ``dequantize``: FP8
    and FP4 weights come back decoded to float32 under their ``.weight`` names, without
    their ``.scale`` entries; with False every tensor comes back as stored, scales
    included (the release's Engram tables, 98 GB each as FP8, want that: they stay
    memory-mapped).  Plain tensors come back as stored (bf16 or f32) either way.  ``groups``:
    which of ``text``, ``vision``, ``dspark`` to read; the others are skipped."""
    return OfficialCheckpoint(directory, config, groups=groups, log=log).read(dequantize)
