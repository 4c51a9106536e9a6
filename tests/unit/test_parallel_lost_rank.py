"""A split model names a lost worker process even when the peer's socket reset arrives before its exit is seen
(``ParallelDeepseekV4Model._ranks_alive``)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ds4d.models.deepseek_v4 import parallel
from ds4d.models.deepseek_v4.parallel import ParallelDeepseekV4Model, ParallelRankLost


class _Worker:
    """A worker process as ``multiprocessing.Process`` shows it: ``exiting`` still looks alive before the
    command and when its error comes, and is gone after (its sentinel ready from the start, as a killed
    process's is once it has exited)."""

    def __init__(self, exiting: bool) -> None:
        self.looks, self.exiting, self.exitcode = 0, exiting, -9 if exiting else None
        read, self._write = os.pipe()
        self.sentinel = read
        if exiting:
            os.write(self._write, b"x")

    def is_alive(self) -> bool:
        self.looks += 1
        return not (self.exiting and self.looks > 2)


def _model(*workers: _Worker) -> ParallelDeepseekV4Model:
    model = object.__new__(ParallelDeepseekV4Model)
    model.workers = list(workers)
    model.groups = SimpleNamespace(device=torch.device("cpu"))
    return model


def test_a_reset_from_a_peer_still_exiting_is_named_as_its_loss():
    model = _model(_Worker(exiting=False), _Worker(exiting=True))
    named = pytest.raises(ParallelRankLost, match=r"rank 2 \(CPU\) exited with code -9")
    with named as lost, model._ranks_alive():
        raise RuntimeError("Read error: Connection reset by peer")
    assert isinstance(lost.value.__cause__, RuntimeError)
    assert model.workers[1].looks == 3  # gone only at the look after the wait


def test_a_failed_collective_with_every_worker_running_is_passed_on(monkeypatch):
    monkeypatch.setattr(parallel, "LOST_RANK_WAIT_S", 0.01)
    model = _model(_Worker(exiting=False))
    with pytest.raises(RuntimeError, match="timed out") as raised, model._ranks_alive():
        raise RuntimeError("timed out")
    assert not isinstance(raised.value, ParallelRankLost)
