"""Read GGUF checkpoints: metadata values and tensors as dense torch tensors.

GGUF is llama.cpp's single-file format: a key/value metadata table (architecture
hyper-parameters, the tokenizer vocabulary, the chat template) followed by tensors,
many of them block-quantised.  The file is memory-mapped through ``gguf.GGUFReader``
and tensors are converted one at a time, so loading never holds more than one
dequantised tensor beyond what the caller keeps.

Shapes: GGUF lists dimensions innermost first (``ne[0]`` is the row length); this
module returns tensors in torch order (``[rows, row_length]`` for a matrix), which
for a linear layer is the usual ``[out_features, in_features]``.

Float types (F32, F16, BF16) are converted exactly with torch.  Block-quantised
types go through ``gguf.quants.dequantize`` (Q8_0, Q4_0, Q4_1, Q5_x, K-quants, ...);
a type it cannot decode raises ``NotImplementedError`` naming the tensor.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import gguf
import numpy as np
import torch

GGUF_MAGIC_BYTES = b"GGUF"
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
"""llama.cpp's names for the shards of a split set: ``NAME-00001-of-00003.gguf`` ..."""

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a config dtype name (``float32``, ``bfloat16``, ``float16``) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_TORCH_DTYPES)}") from None


def is_gguf_file(path: Path) -> bool:
    """True if ``path`` is a regular file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC_BYTES
    except OSError:
        return False


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING_TYPE, _ARRAY_TYPE = 8, 9


def peek_string(path: Path, key: str) -> str | None:
    """Read one string metadata value without parsing the whole file.

    ``can_load`` checks run on every candidate file; ``general.architecture`` is
    normally the first key, so this reads a few hundred bytes instead of the
    vocabulary.  Returns None if the key is absent or not a string.
    """
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC_BYTES:
                return None
            _version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))

            def read_str() -> bytes:
                (length,) = struct.unpack("<Q", f.read(8))
                return f.read(length)

            def skip_value(value_type: int) -> None:
                if value_type == _STRING_TYPE:
                    read_str()
                elif value_type == _ARRAY_TYPE:
                    item_type, count = struct.unpack("<IQ", f.read(12))
                    if item_type in _SCALAR_BYTES:
                        f.seek(_SCALAR_BYTES[item_type] * count, 1)
                    else:
                        for _ in range(count):
                            skip_value(item_type)
                else:
                    f.seek(_SCALAR_BYTES[value_type], 1)

            for _ in range(n_kv):
                name = read_str().decode("utf-8", "replace")
                (value_type,) = struct.unpack("<I", f.read(4))
                if name == key:
                    return read_str().decode("utf-8") if value_type == _STRING_TYPE else None
                skip_value(value_type)
    except (OSError, struct.error, KeyError, UnicodeDecodeError):
        return None
    return None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    quant_type: str
    """GGML type name (``F32``, ``Q4_1``, ...)."""
    shape: tuple[int, ...]
    """Torch order (outermost first)."""
    n_bytes: int


class _PlainArrayReader(gguf.GGUFReader):
    """``GGUFReader`` that slices a plain ndarray view of its memory map.

    Slicing an ``np.memmap`` runs ``memmap.__array_finalize__`` for every metadata
    value; a vocabulary of 50k strings makes that several seconds.  A plain view of
    the same mapping parses five times faster and still reads the file lazily.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        item_dtype = np.dtype(dtype)
        start = int(offset)
        values = plain[start : start + item_dtype.itemsize * int(count)].view(item_dtype)
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))


class GGUFFile:
    """One memory-mapped GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = _PlainArrayReader(self.path, "r")
        self._tensors = {t.name: t for t in self._reader.tensors}

    # ------------------------------------------------------------------ metadata

    def keys(self) -> list[str]:
        return list(self._reader.fields)

    def __contains__(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """The value of one metadata key as plain Python (str, int, float, bool, list)."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            raise KeyError(f"{self.path.name}: metadata key {key!r} is missing")
        return field.contents()

    def get_array(self, key: str) -> np.ndarray | None:
        """A numeric array value as one numpy array (fast path for long token tables)."""
        field = self._reader.fields.get(key)
        if field is None:
            return None
        if field.types[-1] == gguf.GGUFValueType.STRING:
            raise TypeError(f"{key!r} holds strings; use get()")
        if not field.data:
            return np.zeros(0)
        return np.concatenate([field.parts[i] for i in field.data])

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", ""))

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """``<architecture>.<suffix>``, e.g. ``arch_get("block_count")``."""
        return self.get(f"{self.architecture}.{suffix}", default)

    # ------------------------------------------------------------------ tensors

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._get_tensor(name)
        return TensorInfo(
            name=name,
            quant_type=t.tensor_type.name,
            shape=tuple(int(d) for d in reversed(t.shape.tolist())),
            n_bytes=int(t.n_bytes),
        )

    def tensor_infos(self) -> Iterator[TensorInfo]:
        for name in self._tensors:
            yield self.tensor_info(name)

    def tensor(self, name: str, dtype: str | torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantise one tensor into a new dense CPU tensor of ``dtype`` (torch order)."""
        t = self._get_tensor(name)
        out_dtype = torch_dtype(dtype)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        qtype = t.tensor_type
        Q = gguf.GGMLQuantizationType
        if qtype in (Q.F32, Q.F16):
            dense = torch.from_numpy(np.array(t.data, copy=True))
        elif qtype == Q.BF16:
            raw = np.array(t.data, copy=True).view(np.int16)
            dense = torch.from_numpy(raw).view(torch.bfloat16)
        else:
            try:
                dense = torch.from_numpy(gguf.quants.dequantize(t.data, qtype))
            except NotImplementedError:
                raise NotImplementedError(
                    f"{self.path.name}: tensor {name!r} has type {qtype.name}, which cannot be decoded"
                ) from None
        return dense.reshape(shape).to(out_dtype)

    def _get_tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path.name}: tensor {name!r} not found") from None

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Drop the memory map (tensors already returned stay valid: they are copies)."""
        self._tensors = {}
        self._reader = None  # type: ignore[assignment]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_set_files(path: Path) -> list[Path]:
    """The shard files of the split set whose first shard is ``path`` (those that exist, in order),
    or ``[path]`` for a file that is not a split set's first shard."""
    match = SPLIT_NAME.match(path.name)
    if match is None or int(match.group("no")) != 1:
        return [path]
    count = int(match.group("count"))
    shards = (path.with_name(f"{match.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    return [shard for shard in shards if shard.is_file()]
