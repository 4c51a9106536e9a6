"""The ``disk`` cache tier: one file per block in a directory, under a byte budget.

Layout: ``<cache_disk_dir>/<first 8 bytes of the compatibility hash, hex>/<key hex>.blk``,
so daemons serving different models (or the same model with another dtype or
block size) can share a directory without touching each other's files.

File format (little-endian), written to ``<name>.tmp`` and renamed into place,
so a crash never leaves a half-written ``.blk`` file::

    magic     8 bytes   b"DS4DBLK\\x00"
    version   u16       FORMAT_VERSION
    reserved  u16       0
    compat    32 bytes  model compatibility hash (namespace without salt)
    key       32 bytes  the block's chained hash (salt included)
    ntokens   u32       token ids covered
    nbytes    u64       payload length
    checksum  32 bytes  SHA-256 over the token bytes and the payload
    tokens    ntokens x i32
    payload   nbytes

A file that is truncated, fails its checksum, has another magic, version,
compatibility hash or key, is a miss: it is deleted and logged, never served.

Writes run on a writer thread of the tier's own (``background_writes``, on by
default), so a demotion costs the engine step only the bookkeeping: ``put``
indexes the block at once and queues it; until its file is in place, ``get``
serves it from the queued payload and ``evict`` simply drops it.  At most
``max_pending_bytes`` wait at a time; past that ``put`` writes synchronously.
``close`` (at shutdown) waits until every queued block is on disk.

At start, leftover ``.tmp`` files are removed and the index is rebuilt from the
headers (least recently used first, by modification time); a hit refreshes the
file's modification time, so the LRU order survives a restart.

Reads of blocks a waiting request will promote run on reader threads of the
tier too (``read_ahead``, on by default; ``ReadAheadCacheTier``): a thread
reads the file and checks its header and checksum, and the promotion's ``get``
then only compares the token ids and takes the payload.  At most
``max_read_bytes`` (config ``cache_disk_read_ahead_gib``) are held by reads in
flight or loaded and not yet taken; past that ``read_ahead`` declines and
``get`` reads the file itself.  A damaged file found by a reader is deleted and
logged by the ``get`` that takes the result, as a damaged file read
synchronously is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ds4d.cache.tiers import option, payload_nbytes, payload_view
from ds4d.config import GIB
from ds4d.contracts import CacheEntry

MAGIC = b"DS4DBLK\x00"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHH32s32sIQ32s")

log = logging.getLogger("ds4d.cache.disk")


@dataclass(frozen=True)
class _Loaded:
    """One block file read and checked (by a reader thread or the engine thread)."""

    tokens: list[int] | None = None
    payload: bytes | None = None
    file_bytes: int = 0
    problem: str | None = None
    """Why the file cannot be served (it is then deleted and logged by ``get``)."""


class DiskTier:
    name = "disk"

    def __init__(self, ctx: Any, options: Mapping[str, Any]) -> None:
        directory = str(option(ctx, options, "directory", "cache_disk_dir", "") or "")
        if "budget_bytes" in options:
            self.budget_bytes = int(options["budget_bytes"])
        else:
            self.budget_bytes = int(float(option(ctx, options, "budget_gib", "cache_disk_gib", 0.0)) * GIB)
        self.compat_hash = hashlib.sha256(bytes(options.get("compat_hash", b""))).digest()
        self.root: Path | None = None
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self.bytes = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.evictions = 0
        self.damaged = 0
        self._evicted: list[CacheEntry] = []
        self.background = bool(options.get("background_writes", True))
        self.max_pending_bytes = int(options.get("max_pending_bytes", 256 * 2**20))
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[tuple[int, ...], Any, int]] = {}  # key -> (tokens, payload, file bytes)
        self._pending_bytes = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if "max_read_bytes" in options:
            self.max_read_bytes = int(options["max_read_bytes"])
        else:
            self.max_read_bytes = int(float(option(ctx, options, "read_ahead_gib", "cache_disk_read_ahead_gib", 1.0))
                                      * GIB)
        if not options.get("background_reads", True):
            self.max_read_bytes = 0
        self.read_threads = int(options.get("read_threads", 2))
        self._readers: ThreadPoolExecutor | None = None
        self._reads: dict[bytes, tuple[Future[_Loaded], int]] = {}  # key -> (read ahead, bytes reserved)
        self._read_reserved = 0  # bytes of reads ahead in flight or loaded (under self._lock)
        self.reads_ahead_done = 0
        self.read_ahead_bytes = 0
        if not directory:
            self.budget_bytes = 0
            return
        self.root = Path(directory).expanduser() / self.compat_hash[:8].hex()
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    # ------------------------------------------------------------------ start

    def _rebuild_index(self) -> None:
        assert self.root is not None
        found = []
        for path in self.root.iterdir():
            if path.suffix == ".tmp":
                log.info("removing leftover temporary cache file %s", path)
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".blk":
                continue
            try:
                key = bytes.fromhex(path.stem)
                stat = path.stat()
                with path.open("rb") as fh:
                    header = fh.read(HEADER.size)
                problem = self._check_header(header, key, stat.st_size)
            except (ValueError, OSError) as exc:
                problem = f"unreadable ({exc})"
                key, stat = b"", None
            if problem:
                self._discard(path, problem)
                continue
            found.append((stat.st_mtime_ns, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.bytes += size
        if self.bytes > self.budget_bytes:
            self.evict(self.bytes - self.budget_bytes)
            self._evicted.clear()
        log.info("disk cache %s: %d blocks, %.2f GiB of %.2f GiB", self.root, len(self._index), self.bytes / GIB,
                 self.budget_bytes / GIB)

    def _check_header(self, header: bytes, key: bytes, file_size: int) -> str | None:
        if len(header) < HEADER.size:
            return "truncated header"
        magic, version, _, compat, stored_key, ntokens, nbytes, _ = HEADER.unpack(header)
        if magic != MAGIC:
            return "not a ds4d cache block (bad magic)"
        if version != FORMAT_VERSION:
            return f"format version {version}, expected {FORMAT_VERSION}"
        if compat != self.compat_hash:
            return "written for another model (compatibility hash differs)"
        if stored_key != key:
            return "key in the header does not match the file name"
        if file_size != HEADER.size + 4 * ntokens + nbytes:
            return f"truncated or padded ({file_size} bytes, header says {HEADER.size + 4 * ntokens + nbytes})"
        return None

    def _discard(self, path: Path, why: str) -> None:
        self.damaged += 1
        log.warning("disk cache: deleting %s: %s", path.name, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("disk cache: cannot delete %s: %s", path, exc)

    def _path(self, key: bytes) -> Path:
        assert self.root is not None
        return self.root / f"{key.hex()}.blk"

    # ------------------------------------------------------------------ tier

    def put(self, key: bytes, token_ids: Sequence[int], payload: Any) -> bool:
        if self.root is None:
            return False
        if key in self._index:
            self._index.move_to_end(key)
            return True
        size = HEADER.size + 4 * len(token_ids) + payload_nbytes(payload)
        if size > self.budget_bytes:
            return False
        if self.bytes + size > self.budget_bytes:
            self.evict(self.bytes + size - self.budget_bytes)
        if self.background and self._pending_bytes + size <= self.max_pending_bytes:
            with self._lock:
                self._pending[key] = (tuple(token_ids), payload, size)
                self._pending_bytes += size
            self._start_writer()
            self._queue.put(key)
        elif not self._write(key, token_ids, payload):
            return False
        self._index[key] = size
        self.bytes += size
        self.bytes_in += size
        return True

    def _write(self, key: bytes, token_ids: Sequence[int], payload: Any, *, queued: bool = False) -> bool:
        """Write one block file (temporary file, then rename).  ``queued``: only if the key is still
        pending when the file is complete (an eviction meanwhile drops it), then mark it written."""
        tokens = np.asarray(token_ids, dtype="<i4").tobytes()
        data = payload_view(payload)
        checksum = hashlib.sha256(tokens)
        checksum.update(data)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, self.compat_hash, key, len(token_ids), len(data),
                             checksum.digest())
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            with tmp.open("wb") as fh:
                fh.write(header)
                fh.write(tokens)
                fh.write(data)
            if not queued:
                os.replace(tmp, path)
                return True
            with self._lock:
                item = self._pending.pop(key, None)
                if item is not None:
                    self._pending_bytes -= item[2]
                    os.replace(tmp, path)
            if item is None:
                tmp.unlink(missing_ok=True)
            return True
        except OSError as exc:
            log.warning("disk cache: cannot write %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            if queued:
                self._forget_pending(key)
            return False

    def _start_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_queued, name="ds4d-disk-cache", daemon=True)
            self._writer.start()

    def _write_queued(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                with self._lock:
                    item = self._pending.get(key)
                if item is not None:
                    self._write(key, item[0], item[1], queued=True)
            finally:
                self._queue.task_done()

    def _forget_pending(self, key: bytes) -> None:
        with self._lock:
            item = self._pending.pop(key, None)
            if item is not None:
                self._pending_bytes -= item[2]

    def drain(self) -> None:
        """Wait until every queued block is on disk (or dropped)."""
        if self._writer is not None:
            self._queue.join()

    def get(self, key: bytes, token_ids: Sequence[int]) -> bytes | None:
        if key not in self._index:
            return None
        with self._lock:
            queued = self._pending.get(key)
        if queued is not None:  # not on disk yet: serve the payload waiting to be written
            tokens, payload, size = queued
            if tokens != tuple(token_ids):
                return None
            self._index.move_to_end(key)
            self.bytes_out += size
            return bytes(payload_view(payload))
        ahead = self._reads.pop(key, None)
        if ahead is not None:  # read ahead: done, unless the caller did not wait for it
            loaded = ahead[0].result()
            self._unreserve(ahead[1])
        else:
            loaded = self._load(key)
        path = self._path(key)
        if loaded.problem is not None:
            self._drop(key, path, loaded.problem)
            return None
        if loaded.tokens != list(token_ids):
            return None  # a hash collision: the file is fine, it just holds other tokens
        self._index.move_to_end(key)
        try:
            os.utime(path)
        except OSError:
            pass
        self.bytes_out += loaded.file_bytes
        return loaded.payload

    def _load(self, key: bytes) -> _Loaded:
        """Read one block file and check it (any thread: touches no index)."""
        try:
            raw = self._path(key).read_bytes()
        except OSError as exc:
            return _Loaded(problem=f"unreadable ({exc})")
        problem = self._check_header(raw[:HEADER.size], key, len(raw))
        if problem is not None:
            return _Loaded(problem=problem)
        _, _, _, _, _, ntokens, _, checksum = HEADER.unpack(raw[:HEADER.size])
        body = memoryview(raw)[HEADER.size:]
        if hashlib.sha256(body).digest() != checksum:
            return _Loaded(problem="checksum mismatch")
        tokens = np.frombuffer(body[:4 * ntokens], dtype="<i4").tolist()
        return _Loaded(tokens, bytes(body[4 * ntokens:]), len(raw))

    # ------------------------------------------------------------------ reads ahead

    def read_ahead(self, key: bytes) -> Future[_Loaded] | None:
        """Start reading ``key``'s file on a reader thread (``ReadAheadCacheTier``)."""
        ahead = self._reads.get(key)
        if ahead is not None:
            return ahead[0]
        size = self._index.get(key)
        if size is None or self.max_read_bytes <= 0:
            return None
        with self._lock:
            if key in self._pending or self._read_reserved + size > self.max_read_bytes:
                return None  # served from the write queue, or over the cap: get reads it
            self._read_reserved += size
        if self._readers is None:
            self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="ds4d-disk-read")
        future = self._readers.submit(self._load_ahead, key)
        self._reads[key] = (future, size)
        return future

    def _load_ahead(self, key: bytes) -> _Loaded:
        loaded = self._load(key)
        with self._lock:
            self.reads_ahead_done += 1
            self.read_ahead_bytes += loaded.file_bytes
        return loaded

    def cancel_read(self, key: bytes) -> None:
        """Drop a read ahead nobody will take; its bytes count against the cap until it ends."""
        ahead = self._reads.pop(key, None)
        if ahead is None:
            return
        future, size = ahead
        future.cancel()
        future.add_done_callback(lambda _: self._unreserve(size))

    def _unreserve(self, size: int) -> None:
        with self._lock:
            self._read_reserved -= size

    def _drop(self, key: bytes, path: Path, why: str) -> None:
        self.cancel_read(key)
        self.bytes -= self._index.pop(key, 0)
        self._discard(path, why)

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def evict(self, nbytes: int) -> int:
        freed = 0
        while freed < nbytes and self._index:
            key, size = self._index.popitem(last=False)
            self._forget_pending(key)
            self.cancel_read(key)
            self._path(key).unlink(missing_ok=True)
            freed += size
            self.bytes -= size
            self.evictions += 1
            self._evicted.append(CacheEntry(key, (), None))
        return freed

    def take_evicted(self) -> list[CacheEntry]:
        """Keys dropped for good (payload None: nothing is below this tier)."""
        out, self._evicted = self._evicted, []
        return out

    def entries(self) -> list[CacheEntry]:
        return [CacheEntry(key, (), None) for key in self._index]

    def close(self) -> None:
        """Drop the reads ahead, finish the queued writes, stop the tier's threads."""
        for key in list(self._reads):
            self.cancel_read(key)
        if self._readers is not None:
            self._readers.shutdown(wait=True, cancel_futures=True)
            self._readers = None
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._writer = None

    def stats(self) -> Mapping[str, Any]:
        return {"bytes": self.bytes, "blocks": len(self._index), "budget_bytes": self.budget_bytes,
                "evictions": self.evictions, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "damaged_files": self.damaged, "persistent": True, "pending_writes": len(self._pending),
                "pending_reads": len(self._reads), "background_reads": self.reads_ahead_done,
                "background_read_bytes": self.read_ahead_bytes,
                "directory": str(self.root) if self.root else ""}
