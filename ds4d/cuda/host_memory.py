"""Host memory for weights the device reads over PCIe, and the copy stream that moves them.

* :func:`host_empty` allocates anonymous memory (a private ``MAP_ANONYMOUS``
  mapping, never a file mapping), aligned to 2 MiB, and asks for transparent
  huge pages only when ``/proc/buddyinfo`` shows enough free 2 MiB blocks for
  the whole request (a fragmented host would otherwise stall in compaction).
* :class:`PinnedRegistry` page-locks such tensors with ``cudaHostRegister`` in
  several threads at once (registration is bound by page-table work, which
  scales with threads), so that copies from them are true asynchronous DMA;
  without CUDA it records nothing and every copy is a plain ``copy_``.
* :class:`HostSlots` carves such memory into equal slots (one expert each)
  handed out and taken back as experts move between device and host.
* :class:`CopyStream` issues host -> device copies on a side stream with events
  to order them against compute; on the CPU it copies at once and its events
  are ``None``, so callers need no device test.
"""

from __future__ import annotations

import mmap
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
_SMALL_BYTES = 4 * HUGE_PAGE_BYTES  # below this, plain torch allocations
_REGISTER_PIECE_BYTES = 1 << 30


def free_huge_pages(buddyinfo: str | None = None) -> int:
    """Free 2 MiB blocks the kernel's buddy allocator holds (orders >= 9 of 4 KiB pages)."""
    if buddyinfo is None:
        try:
            buddyinfo = Path("/proc/buddyinfo").read_text()
        except OSError:
            return 0
    total = 0
    for line in buddyinfo.splitlines():
        fields = line.split()
        if "zone" not in fields:
            continue
        counts = [int(v) for v in fields[fields.index("zone") + 2 :]]
        total += sum(count << (order - 9) for order, count in enumerate(counts) if order >= 9)
    return total


def huge_pages_fit(nbytes: int, buddyinfo: str | None = None) -> bool:
    return nbytes >= HUGE_PAGE_BYTES and free_huge_pages(buddyinfo) * HUGE_PAGE_BYTES >= nbytes


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class HostArena:
    """Owns the anonymous mappings behind :func:`host_empty` tensors (they live as long as it does)."""

    def __init__(self, huge_pages: bool = False) -> None:
        self.huge_pages = huge_pages
        self.regions: list[mmap.mmap] = []
        self.bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        self.bytes += nbytes
        if nbytes < _SMALL_BYTES:
            return torch.empty(shape, dtype=dtype)
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE)
        self.regions.append(region)
        raw = torch.frombuffer(region, dtype=torch.uint8)
        skip = -raw.data_ptr() % HUGE_PAGE_BYTES
        return raw[skip : skip + nbytes].view(dtype).view(shape)


def register_pieces(start: int, nbytes: int, unit: int = 1) -> list[tuple[int, int]]:
    """(address, bytes) pieces of about 1 GiB covering ``nbytes`` from ``start``, each a whole number
    of ``unit`` bytes except perhaps the last."""
    step = max(_REGISTER_PIECE_BYTES // unit, 1) * unit
    return [(at, min(step, start + nbytes - at)) for at in range(start, start + nbytes, step)]


class PinnedRegistry:
    """Page-locks host tensors for DMA, in parallel threads; a no-op without CUDA.

    The registered tensors are held until they are unregistered (:meth:`close`, or when the registry
    is collected), so their memory cannot be freed and handed out again while still registered: a
    later registration of the same addresses would fail (and its error would surface at the next
    CUDA call)."""

    def __init__(self, threads: int = 8) -> None:
        self.threads = max(1, threads)
        self.enabled = torch.cuda.is_available()
        self._registered: list[tuple[int, int]] = []
        self._held: list[torch.Tensor] = []
        self.bytes = 0
        self.seconds = 0.0
        self._finalizer = weakref.finalize(self, _unregister, self._registered, self._held, self.enabled)

    def pin(self, tensors: list[torch.Tensor], unit: int = 1) -> None:
        """Register ``tensors`` in pieces of about 1 GiB, each a whole number of ``unit`` bytes: a copy
        may not span two registrations, so no ``unit``-sized record (a slot) is split between two."""
        pieces: list[tuple[int, int]] = []
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            self.bytes += nbytes
            pieces.extend(register_pieces(tensor.data_ptr(), nbytes, unit))
        if not self.enabled or not pieces:
            return
        self._held.extend(tensors)
        cudart = torch.cuda.cudart()
        began = time.perf_counter()

        def register(piece: tuple[int, int]) -> tuple[int, int] | Exception:
            err = cudart.cudaHostRegister(piece[0], piece[1], 0)
            if int(err) != 0:
                return RuntimeError(f"cudaHostRegister of {piece[1]} bytes at {piece[0]:#x} failed: "
                                    f"error {int(err)}")
            return piece

        with ThreadPoolExecutor(self.threads) as pool:
            results = list(pool.map(register, pieces))
        self._registered.extend(r for r in results if not isinstance(r, Exception))
        self.seconds += time.perf_counter() - began
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            _clear_last_error()  # or the next CUDA call would report it as its own
            raise failed[0]

    def close(self) -> None:
        _unregister(self._registered, self._held, self.enabled)


def _unregister(registered: list[tuple[int, int]], held: list[torch.Tensor], enabled: bool) -> None:
    """Unregister ``registered`` pieces, then let their tensors go (``held``)."""
    if enabled and registered:
        cudart = torch.cuda.cudart()
        for address, _ in registered:
            cudart.cudaHostUnregister(address)
    registered.clear()
    held.clear()


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error (cuda-python), where that can be done."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            return
    runtime.cudaGetLastError()


class HostSlots:
    """Equal slots of page-locked host memory, each holding one set of named tensors (one expert's
    stored parts): grown in chunks from a :class:`HostArena`, pinned by a :class:`PinnedRegistry`,
    handed out and taken back one slot at a time.

    ``template`` gives the parts' shapes and dtypes; each part starts at a
    multiple of ``align`` bytes inside its slot.  A slot is ``(chunk, row)``;
    :meth:`parts` returns views, so copies into and out of them need no staging."""

    def __init__(self, template: dict[str, torch.Tensor], arena: HostArena, pinned: PinnedRegistry,
                 align: int = 256) -> None:
        self.arena, self.pinned = arena, pinned
        self.layout: list[tuple[str, tuple[int, ...], torch.dtype, int, int]] = []
        at = 0
        for name, tensor in template.items():
            nbytes = tensor.numel() * tensor.element_size()
            self.layout.append((name, tuple(tensor.shape), tensor.dtype, at, nbytes))
            at += -(-nbytes // align) * align
        self.slot_bytes = at
        self.chunks: list[dict[str, torch.Tensor]] = []
        self.free: list[tuple[int, int]] = []
        self.slots = 0

    @property
    def bytes(self) -> int:
        return self.slots * self.slot_bytes

    def grow(self, count: int) -> None:
        """``count`` more free slots, in one new chunk (allocated and page-locked now)."""
        if count <= 0:
            return
        raw = self.arena.empty((count, self.slot_bytes), torch.uint8)
        raw.zero_()  # touch the pages in torch's threads: registering untouched memory faults it in slowly
        self.pinned.pin([raw], unit=self.slot_bytes)
        chunk = len(self.chunks)
        self.chunks.append({name: raw[:, at : at + nbytes].view(dtype).view(count, *shape)
                            for name, shape, dtype, at, nbytes in self.layout})
        self.free.extend((chunk, row) for row in reversed(range(count)))
        self.slots += count

    def reserve(self, count: int) -> None:
        """At least ``count`` free slots."""
        self.grow(count - len(self.free))

    def take(self) -> tuple[int, int]:
        if not self.free:
            self.grow(1)
        return self.free.pop()

    def give(self, slot: tuple[int, int]) -> None:
        self.free.append(slot)

    def parts(self, slot: tuple[int, int]) -> dict[str, torch.Tensor]:
        chunk, row = slot
        return {name: view[row] for name, view in self.chunks[chunk].items()}


class CopyStream:
    """Host -> device copies on a side stream (CUDA) or at once (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def wait(self, event) -> None:
        """The copy stream waits for ``event`` (recorded on the compute stream)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def record(self):
        """An event after the copies issued so far (None on the CPU)."""
        return self.stream.record_event() if self.stream is not None else None

    def compute_waits(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def compute_event(self):
        return torch.cuda.current_stream(self.device).record_event() if self.stream is not None else None

    def synchronize(self) -> None:
        if self.stream is not None:
            torch.cuda.synchronize(self.device)


def host_pointers_usable(device: torch.device) -> bool:
    """Whether kernels on ``device`` may read page-locked (registered) host memory at its host address
    (``cudaDevAttrCanUseHostPointerForRegisteredMem``); False when that cannot be asked."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            return False
    try:
        err, value = runtime.cudaDeviceGetAttribute(
            runtime.cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem, index)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return int(err) == 0 and int(value) == 1
