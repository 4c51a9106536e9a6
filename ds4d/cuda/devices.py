"""Device discovery and memory queries (the only module that initialises CUDA).

On a machine without a GPU every function answers "none" without importing
any CUDA library, so CPU-only installs never touch the driver.
"""

from __future__ import annotations

from typing import Any


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def gpu_memory() -> list[dict[str, Any]]:
    """Per-GPU used/total bytes as the driver reports them (empty without CUDA)."""
    if not cuda_available():
        return []
    import torch

    out = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        out.append({
            "index": index,
            "name": torch.cuda.get_device_name(index),
            "used_bytes": total - free,
            "total_bytes": total,
            "torch_allocated_bytes": torch.cuda.memory_allocated(index),
        })
    return out
