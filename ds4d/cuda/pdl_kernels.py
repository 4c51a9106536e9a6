"""The Triton side of programmatic dependent launch (``ds4d.cuda.devices.LAUNCH["pdl"]``), shared by the
kernels launched that way; imported on first use, with them."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Hopper on; absent from older Triton, and never called with ``pdl`` off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_then_release(pdl: tl.constexpr):
    """With ``pdl``: wait until the kernel before has finished and its writes are visible, then let the next
    kernel launch.  A kernel calls it before its first read of anything an earlier kernel wrote and before its
    first write; without ``pdl`` it is nothing."""
    if pdl:
        gdc_wait()
        gdc_launch_dependents()
