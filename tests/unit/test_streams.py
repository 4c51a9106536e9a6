"""``ds4d.cuda.streams`` off CUDA: the side stream's calls are plain calls (the model tests run the
second stream on a GPU: ``tests/gpu/test_dsv4_fast_path.py``)."""

from __future__ import annotations

import torch

from ds4d.cuda import streams


def test_off_cuda_work_beside_runs_where_it_is_called_and_rejoins_as_it_is():
    cpu = torch.device("cpu")
    seen = []

    def add(a, b):
        seen.append(len(seen))
        return a + b

    result = streams.beside(add, cpu, torch.ones(3), torch.arange(3.0))
    assert seen == [0]  # already run, before rejoin
    assert streams.rejoin(result, cpu) is result
    assert torch.equal(result, torch.tensor([1.0, 2.0, 3.0]))
