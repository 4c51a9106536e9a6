"""The cache namespace of a checkpoint follows every file it is read from.

Blocks saved on disk belong to the checkpoint that computed them: a file replaced
at the same path (size or modification time) gives another identity.  For a GGUF
split set served by its first shard, the later shards count too.
"""

from __future__ import annotations

import os

from ds4d.kernel import _checkpoint_identity


def _write(path, data: bytes, mtime_ns: int) -> None:
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_split_set_is_known_by_all_its_shards(tmp_path):
    first, second = tmp_path / "m-00001-of-00002.gguf", tmp_path / "m-00002-of-00002.gguf"
    _write(first, b"GGUF one", 10**18)
    _write(second, b"GGUF two", 10**18)
    identity = _checkpoint_identity(first)
    assert [entry[0] for entry in identity] == [first.name, second.name]
    _write(second, b"GGUF two, replaced", 10**18)
    assert _checkpoint_identity(first) != identity
    _write(second, b"GGUF two", 2 * 10**18)  # same bytes, touched
    assert _checkpoint_identity(first) != identity


def test_a_single_file_and_a_directory(tmp_path):
    single = tmp_path / "model.gguf"
    _write(single, b"GGUF", 10**18)
    (tmp_path / "other-00002-of-00002.gguf").write_bytes(b"not a first shard")
    assert [entry[0] for entry in _checkpoint_identity(single)] == ["model.gguf"]
    shard = tmp_path / "other-00002-of-00002.gguf"
    assert [entry[0] for entry in _checkpoint_identity(shard)] == [shard.name]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _write(folder / "config.json", b"{}", 10**18)
    _write(folder / "model.safetensors", b"x", 10**18)
    identity = _checkpoint_identity(folder)
    assert [entry[0] for entry in identity] == ["config.json", "model.safetensors"]
    _write(folder / "model.safetensors", b"y", 10**18 + 1)
    assert _checkpoint_identity(folder) != identity
