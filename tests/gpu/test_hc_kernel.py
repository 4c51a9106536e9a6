"""The hyper-connection mixing kernel (``ds4d.cuda.hc_kernels``) against the torch reference.

Runs the Numba kernel under the CUDA simulator on the CPU (in a subprocess,
since the simulator must be chosen before numba.cuda is imported), and on the
real device when there is one.  Skipped where Numba is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("numba")

CHECK = r"""
import numpy as np, torch
from ds4d.cuda import hc_kernels
from ds4d.models.deepseek_v4.hyper import _mixes, hc_pre
from ds4d.models.deepseek_v4.weights import HyperWeights
gen = torch.Generator().manual_seed(0)
for m, tokens, iters in ((4, 37, 20), (2, 5, 7), (3, 20, 4)):
    d = 16
    streams = torch.randn(tokens, m, d, generator=gen)
    weights = HyperWeights(fn=torch.randn((2 + m) * m, m * d, generator=gen) * (m * d) ** -0.5,
                           base=torch.randn((2 + m) * m, generator=gen) * 0.5,
                           scale=1 + 0.2 * torch.randn(3, generator=gen))
    collapsed, post, comb = hc_pre(streams, weights, iters, 1e-6, 1e-6)
    mixes = _mixes(streams, weights.fn, 1e-6).numpy()
    pre_k, post_k = np.zeros((tokens, m), np.float32), np.zeros((tokens, m), np.float32)
    comb_k = np.zeros((tokens, m, m), np.float32)
    hc_kernels.launch(mixes, weights.base.numpy(), weights.scale.numpy(), 1e-6, iters, m, pre_k, post_k, comb_k)
    collapsed_k = (torch.from_numpy(pre_k).unsqueeze(-1) * streams).sum(dim=-2)
    for name, got, want in (("collapsed", collapsed_k, collapsed), ("post", torch.from_numpy(post_k), post),
                            ("comb", torch.from_numpy(comb_k), comb)):
        err = (got - want).abs().max().item()
        assert err < 1e-5, (name, m, err)
print("ok")
"""


def test_kernel_matches_reference_in_the_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", CHECK], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_reference_on_the_device():
    from ds4d.cuda.hc_kernels import available
    from ds4d.models.deepseek_v4.hyper import hc_pre
    from ds4d.models.deepseek_v4.weights import HyperWeights

    assert available()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, d, tokens = 4, 256, 300
    streams = torch.randn(tokens, m, d, generator=gen, device="cuda")
    weights = HyperWeights(fn=torch.randn((2 + m) * m, m * d, generator=gen, device="cuda") * (m * d) ** -0.5,
                           base=torch.randn((2 + m) * m, generator=gen, device="cuda") * 0.5,
                           scale=1 + 0.2 * torch.randn(3, generator=gen, device="cuda"))
    reference = hc_pre(streams, weights, 20, 1e-6, 1e-6)
    fused = hc_pre(streams, weights, 20, 1e-6, 1e-6, fused=True)
    for got, want in zip(fused, reference):
        assert (got - want).abs().max().item() < 1e-4
