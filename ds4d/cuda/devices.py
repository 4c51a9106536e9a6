"""Device discovery and memory queries (the only module that initialises CUDA).

On a machine without a GPU every function answers "none" without importing
any CUDA library, so CPU-only installs never touch the driver.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def to_device_async(host, device):
    """The CPU tensor ``host`` on ``device`` without waiting for the device: on CUDA it is copied from
    page-locked memory (a copy from pageable memory may wait for the work queued before it)."""
    import torch

    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def triton_launches_on(tensor) -> bool:
    """Triton kernels can take ``tensor``: it is on a CUDA device, or Triton runs in its interpreter
    (``TRITON_INTERPRET=1``, CPU tensors)."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


LAUNCH = {"pdl": False}
"""``pdl``: a decode step's GEMVs (FP8, MXFP4, float32 rows) and hyper-connection boundary kernels launched as
programmatic dependent launches where :func:`pdl_launch` allows: each may start while the kernel before it
drains, waiting (``griddepcontrol.wait``) before it reads anything an earlier kernel wrote or writes anything;
the GEMVs of fixed weights read their first weight tile before that wait.  The same arithmetic; off until
timed (``ds4d bench model --pdl``)."""


def pdl_launch(tensor) -> bool:
    """Whether a kernel on ``tensor``'s device launches as a programmatic dependent launch: ``LAUNCH["pdl"]``
    on, a CUDA device of compute capability 9 or more, not Triton's interpreter."""
    if not LAUNCH["pdl"] or not tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import torch

    return torch.version.hip is None and torch.cuda.get_device_capability(tensor.device)[0] >= 9


def pdl_options(pdl: bool) -> dict[str, bool]:
    """The launch options of a kernel launched as a programmatic dependent launch (``pdl``), none otherwise:
    a Triton whose backend lacks the option then never sees it."""
    return {"launch_pdl": True} if pdl else {}


def triton_can_launch(build: Callable[[], object]) -> bool:
    """``build()`` (importing Triton, defining kernels) succeeds and its kernels can launch here: on a
    CUDA device, or on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    try:
        build()
    except Exception:  # noqa: BLE001 - no triton, or one that cannot build here: callers take a torch path
        return False
    return cuda_available() or os.environ.get("TRITON_INTERPRET") == "1"


def gpu_memory() -> list[dict[str, Any]]:
    """Per-GPU used/total bytes as the driver reports them (empty without CUDA).

    Read through NVML when its numbering is torch's (PCI bus order, no
    ``CUDA_VISIBLE_DEVICES``), so asking about a GPU this process does not
    use (another rank's) does not open a CUDA context there."""
    if not cuda_available():
        return []
    import torch

    count = torch.cuda.device_count()
    driver = _nvml_memory(count)
    out = []
    for index in range(count):
        if driver is not None:
            used, total = driver[index]
        else:
            free, total = torch.cuda.mem_get_info(index)
            used = total - free
        out.append({
            "index": index,
            "name": torch.cuda.get_device_name(index),
            "used_bytes": used,
            "total_bytes": total,
            "torch_allocated_bytes": torch.cuda.memory_allocated(index),
            "torch_peak_allocated_bytes": torch.cuda.max_memory_allocated(index),
            "torch_reserved_bytes": torch.cuda.memory_reserved(index),
        })
    return out


def _nvml_memory(count: int) -> list[tuple[int, int]] | None:
    """(used, total) bytes of GPUs ``0 .. count - 1`` from NVML, or None where its order may differ from torch's."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None or os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML library or driver: fall back to the CUDA runtime
        return None
    try:
        if pynvml.nvmlDeviceGetCount() != count:
            return None
        out = []
        for index in range(count):
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            out.append((int(info.used), int(info.total)))
        return out
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
