"""RAM and disk cache tiers on their own: budgets, exact LRU order, integrity of disk files."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from ds4d.cache.disk import HEADER, DiskTier
from ds4d.cache.ram import RamTier


def key(i: int) -> bytes:
    return bytes([i]) * 32


def payload(i: int, n: int = 100) -> bytes:
    return bytes([i % 256]) * n


# --------------------------------------------------------------------------- ram


def test_ram_roundtrip_verifies_tokens_and_counts_bytes():
    ram = RamTier(None, {"budget_bytes": 1000})
    assert ram.put(key(1), [1, 2], payload(1))
    assert bytes(ram.get(key(1), [1, 2]).numpy()) == payload(1)
    assert ram.get(key(1), [1, 3]) is None          # same key, other tokens: never served
    assert ram.get(key(2), [1, 2]) is None
    s = ram.stats()
    assert (s["bytes"], s["blocks"], s["bytes_in"], s["bytes_out"]) == (100, 1, 100, 100)
    assert ram.put(key(1), [1, 2], payload(9))      # already there: kept, not rewritten
    assert bytes(ram.get(key(1), [1, 2]).numpy()) == payload(1)


def test_ram_budget_evicts_least_recently_used_in_order():
    ram = RamTier(None, {"budget_bytes": 300})
    for i in range(3):
        ram.put(key(i), [i], payload(i))
    ram.get(key(0), [0])                            # 0 becomes most recent: order 1, 2, 0
    ram.put(key(3), [3], payload(3))
    ram.put(key(4), [4], payload(4))
    assert [e.key for e in ram.take_evicted()] == [key(1), key(2)]
    assert ram.take_evicted() == []
    assert [e.key for e in ram.entries()] == [key(0), key(3), key(4)]
    assert ram.stats()["bytes"] == 300 and ram.stats()["evictions"] == 2
    assert not ram.put(key(5), [5], payload(5, 301))  # bigger than the whole budget
    assert ram.contains(key(0)) and ram.stats()["blocks"] == 3


def test_ram_takes_tensor_payloads_and_evict_frees_bytes():
    ram = RamTier(None, {"budget_bytes": 1000})
    t = torch.arange(10, dtype=torch.int64).view(torch.uint8)
    ram.put(key(1), [1], t)
    t.zero_()                                        # the tier holds its own copy
    assert ram.get(key(1), [1]).view(torch.int64).tolist() == list(range(10))
    assert ram.evict(1) == 80 and ram.stats()["blocks"] == 0


def test_ram_budget_from_config_gib():
    cfg = type("C", (), {"cache_ram_gib": 0.5, "device": "cpu"})()
    ram = RamTier(type("Ctx", (), {"config": cfg})(), {})
    assert ram.budget_bytes == 512 * 1024**2 and not ram.pin_memory


# --------------------------------------------------------------------------- disk


def disk(tmp_path, budget=10_000, compat=b"model-a", background=False) -> DiskTier:
    """Synchronous writes and reads by default, so a test can look at the files right after put()."""
    return DiskTier(None, {"directory": str(tmp_path), "budget_bytes": budget, "compat_hash": compat,
                           "background_writes": background, "background_reads": background})


def file_of(tier: DiskTier, k: bytes):
    return tier.root / f"{k.hex()}.blk"


def test_disk_roundtrip_and_file_layout(tmp_path):
    d = disk(tmp_path)
    assert d.put(key(1), [5, 6, 7], payload(1))
    f = file_of(d, key(1))
    assert f.stat().st_size == HEADER.size + 3 * 4 + 100
    assert f.read_bytes()[:8] == b"DS4DBLK\x00"
    assert d.get(key(1), [5, 6, 7]) == payload(1)
    assert d.get(key(1), [5, 6, 8]) is None and f.exists()   # other tokens: a miss, the file is fine
    assert not list(d.root.glob("*.tmp"))


def test_disk_restart_rebuilds_index_in_lru_order(tmp_path):
    d = disk(tmp_path, budget=3 * (HEADER.size + 4 + 100))
    for i in range(3):
        d.put(key(i), [i], payload(i))
        os.utime(file_of(d, key(i)), ns=(time.time_ns(), 1_000_000_000 * (i + 1)))
    os.utime(file_of(d, key(0)), ns=(time.time_ns(), 9_000_000_000))  # 0 used last
    again = disk(tmp_path, budget=3 * (HEADER.size + 4 + 100))
    assert again.stats()["blocks"] == 3
    assert again.get(key(2), [2]) == payload(2)
    again.put(key(3), [3], payload(3))
    assert [e.key for e in again.take_evicted()] == [key(1)]  # oldest by mtime, 2 was just read
    assert not file_of(again, key(1)).exists()


def test_disk_budget_is_enforced(tmp_path):
    one = HEADER.size + 4 + 100
    d = disk(tmp_path, budget=2 * one + 10)
    for i in range(5):
        assert d.put(key(i), [i], payload(i))
        assert d.stats()["bytes"] <= 2 * one + 10
    assert sorted(p.name for p in d.root.iterdir()) == sorted(f"{key(i).hex()}.blk" for i in (3, 4))
    assert not d.put(key(9), [9], payload(9, 3 * one))
    assert [e.key for e in d.take_evicted()] == [key(0), key(1), key(2)]


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "foreign", "header_key"])
def test_disk_damaged_file_is_a_logged_miss_and_deleted(tmp_path, caplog, damage):
    d = disk(tmp_path)
    d.put(key(1), [1, 2], payload(1))
    f = file_of(d, key(1))
    raw = bytearray(f.read_bytes())
    if damage == "flip":
        raw[-1] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-7]
    elif damage == "magic":
        raw[:8] = b"NOTMINE!"
    elif damage == "foreign":
        raw[12:44] = bytes(32)                      # another model's compatibility hash
    elif damage == "header_key":
        raw[44:76] = key(2)
    f.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="ds4d.cache.disk"):
        assert d.get(key(1), [1, 2]) is None
    assert not f.exists()
    assert "deleting" in caplog.text
    assert not d.contains(key(1)) and d.stats()["bytes"] == 0 and d.stats()["damaged_files"] == 1


def test_disk_start_removes_temp_files_and_damaged_ones(tmp_path, caplog):
    d = disk(tmp_path)
    d.put(key(1), [1], payload(1))
    d.put(key(2), [2], payload(2))
    (d.root / f"{key(3).hex()}.tmp").write_bytes(b"half a block")
    f2 = file_of(d, key(2))
    f2.write_bytes(f2.read_bytes()[:50])            # truncated inside the header
    (d.root / f"{key(4).hex()}.blk").write_bytes(b"\x00" * 300)
    with caplog.at_level(logging.WARNING, logger="ds4d.cache.disk"):
        again = disk(tmp_path)
    assert sorted(p.name for p in again.root.iterdir()) == [f"{key(1).hex()}.blk"]
    assert again.stats()["blocks"] == 1 and again.get(key(1), [1]) == payload(1)
    assert again.stats()["damaged_files"] == 2


def test_disk_other_model_uses_another_subdirectory(tmp_path):
    a = disk(tmp_path, compat=b"model-a")
    a.put(key(1), [1], payload(1))
    b = disk(tmp_path, compat=b"model-b")
    assert not b.contains(key(1)) and b.root != a.root
    assert a.get(key(1), [1]) == payload(1)


def test_background_writes_serve_queued_blocks_and_finish_on_close(tmp_path, monkeypatch):
    d = disk(tmp_path, background=True)
    gate = threading.Event()
    write = DiskTier._write

    def held_write(self, *args, **kwargs):  # the writer thread waits until the test lets it go
        gate.wait(10)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "_write", held_write)
    for i in range(3):
        assert d.put(key(i), [i, i + 1], payload(i))
    assert all(d.contains(key(i)) for i in range(3)) and d.stats()["pending_writes"] >= 2
    assert not file_of(d, key(1)).exists()
    assert d.get(key(1), [1, 2]) == payload(1)           # served from the queue, before its file exists
    assert d.get(key(1), [1, 3]) is None                  # and verified like a file
    d.evict(1)                                            # drops block 0 (least recently used)
    gate.set()
    d.close()
    assert d.stats()["pending_writes"] == 0
    assert sorted(p.name for p in d.root.iterdir()) == sorted(f"{key(i).hex()}.blk" for i in (1, 2))
    again = disk(tmp_path)
    assert again.get(key(2), [2, 3]) == payload(2) and not again.contains(key(0))


def test_background_writes_fall_back_to_synchronous_past_the_queue_cap(tmp_path):
    d = DiskTier(None, {"directory": str(tmp_path), "budget_bytes": 10_000, "compat_hash": b"model-a",
                        "max_pending_bytes": 0})
    assert d.put(key(1), [1], payload(1)) and file_of(d, key(1)).exists() and d.stats()["pending_writes"] == 0


def test_read_ahead_loads_off_thread_and_get_takes_it(tmp_path, monkeypatch):
    d = disk(tmp_path)
    d.put(key(1), [1, 2], payload(1))
    d.put(key(2), [3, 4], payload(2))
    size = HEADER.size + 8 + 100
    d.max_read_bytes = 10 * size                          # reads ahead on; both files are written
    gate = threading.Event()
    load = DiskTier._load_ahead

    def held_load(self, k):
        gate.wait(10)
        return load(self, k)

    monkeypatch.setattr(DiskTier, "_load_ahead", held_load)
    first = d.read_ahead(key(1))
    assert first is not None and not first.done() and d.read_ahead(key(1)) is first
    assert d.read_ahead(bytes(32)) is None                # unknown: nothing to read
    second = d.read_ahead(key(2))
    assert d.stats()["pending_reads"] == 2 and d._read_reserved == 2 * size
    d.cancel_read(key(2))
    assert d.stats()["pending_reads"] == 1 and second is not None
    gate.set()
    assert d.get(key(1), [1, 2]) == payload(1)            # taken from the read ahead
    s = d.stats()
    assert s["pending_reads"] == 0 and s["bytes_out"] == size
    assert s["background_reads"] >= 1 and s["background_read_bytes"] >= size
    assert d.get(key(2), [3, 4]) == payload(2)            # cancelled: read at once, still exact
    d.read_ahead(key(1)).result(10)
    assert d.get(key(1), [1, 9]) is None and file_of(d, key(1)).exists()  # other tokens: a miss
    d.close()                                             # waits for the reader threads
    assert d._read_reserved == 0


def test_read_ahead_declines_past_the_cap_and_for_queued_writes(tmp_path, monkeypatch):
    d = disk(tmp_path)
    d.put(key(1), [1], payload(1))
    d.put(key(2), [2], payload(2))
    assert d.read_ahead(key(1)) is None                   # reads ahead off (background=False)
    d.max_read_bytes = HEADER.size + 4 + 100              # room for one block
    assert d.read_ahead(key(1)) is not None and d.read_ahead(key(2)) is None
    assert d.get(key(2), [2]) == payload(2)               # read synchronously
    d.evict(1)                                            # key 1 (LRU) goes, its read ahead with it
    assert d.stats()["pending_reads"] == 0
    d.close()
    assert d._read_reserved == 0
    w = disk(tmp_path / "w", background=True)
    monkeypatch.setattr(DiskTier, "_start_writer", lambda self: None)
    w.put(key(3), [3], payload(3))                        # queued for a writer that never runs
    assert w.read_ahead(key(3)) is None and w.get(key(3), [3]) == payload(3)


def test_disk_off_without_directory():
    d = DiskTier(None, {"directory": "", "budget_bytes": 100})
    assert d.stats()["budget_bytes"] == 0 and not d.put(key(1), [1], payload(1)) and d.get(key(1), [1]) is None
