"""Which GPU plays which rank: a device grid of ``stages x expert-parallel ranks``.

Expert parallelism is the chattiest traffic of a step (one all-reduce of the
hidden state per MoE layer, in every layer), pipeline stages the quietest (one
send of the hyper-connection streams per stage boundary).  So the expert-parallel
groups go where the links are fastest: :func:`plan_placement` takes a link
matrix (``links[i][j]``: how good the link between GPU ``i`` and GPU ``j`` is;
0 none, 1 PCIe peer-to-peer, 2 NVLink; any larger number is a faster link) and
partitions the GPUs into stages so that the links inside the groups sum to the
most, then orders stages and members so that rank ``e`` of stage ``s`` and
rank ``e`` of stage ``s + 1`` (which exchange the streams) share a link where
they can.  The search is exhaustive, which is fine for the GPUs of one host
(at most 8); larger sets keep the given order.

:func:`read_link_matrix` fills the matrix from NVML (``nvidia-ml-py``, an
optional import); ``python -m ds4d.parallel.topology --gpus 0,1,2,3`` prints the
plan.  NVML numbers GPUs in PCI bus order: start workers with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA indices mean the same GPUs.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

LinkMatrix = Sequence[Sequence[int]]
NO_LINK, PCIE, NVLINK = 0, 1, 2
EXHAUSTIVE_MAX_GPUS = 8


@dataclass(frozen=True)
class Placement:
    """``grid[stage][ep_rank]`` is the GPU of global rank ``stage * ep_size + ep_rank``."""

    grid: tuple[tuple[int, ...], ...]
    ep_link_score: int = 0
    """Sum of the links inside the expert-parallel groups (what the plan maximises first)."""
    stage_link_score: int = 0
    """Sum of the links between matching ranks of neighbouring stages (second)."""

    @property
    def stages(self) -> int:
        return len(self.grid)

    @property
    def ep_size(self) -> int:
        return len(self.grid[0])

    @property
    def world_size(self) -> int:
        return self.stages * self.ep_size

    def device_of(self, rank: int) -> int:
        return self.grid[rank // self.ep_size][rank % self.ep_size]

    @property
    def devices(self) -> tuple[int, ...]:
        """GPU of each global rank, in rank order."""
        return tuple(gpu for stage in self.grid for gpu in stage)


def parse_layout(layout: str, gpus: int, links: LinkMatrix | None = None) -> tuple[int, int]:
    """``auto`` | ``ep`` | ``pp`` | ``SxE`` (e.g. ``2x2``) -> (stages, expert-parallel size)."""
    layout = layout.strip().lower()
    if layout == "ep":
        return 1, gpus
    if layout == "pp":
        return gpus, 1
    if layout == "auto":
        return _auto_layout(gpus, links)
    try:
        stages, ep = (int(part) for part in layout.split("x"))
    except ValueError:
        raise ValueError(f"parallel layout {layout!r}: use auto, ep, pp or STAGESxEP such as 2x2") from None
    if stages < 1 or ep < 1 or stages * ep != gpus:
        raise ValueError(f"parallel layout {layout!r} needs {stages * ep} GPUs, {gpus} given")
    return stages, ep


def _auto_layout(gpus: int, links: LinkMatrix | None) -> tuple[int, int]:
    """The widest expert parallelism whose groups can all be NVLink cliques; stages for the rest."""
    if links is None:
        return 1, gpus
    for ep in sorted((d for d in range(1, gpus + 1) if gpus % d == 0), reverse=True):
        best = plan_placement(links, gpus // ep, ep)
        if ep == 1 or _all_nvlink(best, links):
            return gpus // ep, ep
    return gpus, 1


def _all_nvlink(placement: Placement, links: LinkMatrix) -> bool:
    return all(links[a][b] >= NVLINK for stage in placement.grid for a, b in itertools.combinations(stage, 2))


def plan_placement(links: LinkMatrix, stages: int, ep_size: int, gpus: Sequence[int] | None = None) -> Placement:
    """Place ``stages x ep_size`` ranks on ``gpus`` (indices into ``links``; default all of them)."""
    gpus = list(range(len(links))) if gpus is None else list(gpus)
    if stages * ep_size != len(gpus):
        raise ValueError(f"{stages} stages x {ep_size} expert-parallel ranks need {stages * ep_size} GPUs")
    if len(gpus) > EXHAUSTIVE_MAX_GPUS:
        grid = tuple(tuple(gpus[s * ep_size : (s + 1) * ep_size]) for s in range(stages))
        return Placement(grid, _ep_score(grid, links), _stage_score(grid, links))
    best: Placement | None = None
    for groups in _partitions(gpus, ep_size):
        ep_score = sum(_ep_score((group,), links) for group in groups)
        if best is not None and ep_score < best.ep_link_score:
            continue
        grid, stage_score = _order_stages(groups, links)
        candidate = Placement(grid, ep_score, stage_score)
        if best is None or (ep_score, stage_score) > (best.ep_link_score, best.stage_link_score):
            best = candidate
    assert best is not None
    return best


def _ep_score(grid: Sequence[Sequence[int]], links: LinkMatrix) -> int:
    return sum(links[a][b] for group in grid for a, b in itertools.combinations(group, 2))


def _stage_score(grid: Sequence[Sequence[int]], links: LinkMatrix) -> int:
    return sum(links[a][b] for upper, lower in itertools.pairwise(grid) for a, b in zip(upper, lower))


def _partitions(items: list[int], size: int):
    """Every split of ``items`` into groups of ``size`` (unordered groups, sorted members)."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = [x for x in rest if x not in others]
        for tail in _partitions(remaining, size):
            yield ((first, *others), *tail)


def _order_stages(groups: Sequence[tuple[int, ...]], links: LinkMatrix) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Order the groups as stages and their members as ranks to maximise the stage-boundary links."""
    best_grid, best_score = tuple(groups), -1
    for stage_order in itertools.permutations(groups):
        rows = [stage_order[0]]  # first stage keeps sorted members; later stages are permuted to match
        score = 0
        for group in stage_order[1:]:
            row = max(itertools.permutations(group), key=lambda p: sum(links[a][b] for a, b in zip(rows[-1], p)))
            score += sum(links[a][b] for a, b in zip(rows[-1], row))
            rows.append(tuple(row))
        if score > best_score:
            best_grid, best_score = tuple(rows), score
    return best_grid, best_score


def describe(placement: Placement, links: LinkMatrix | None = None) -> str:
    """A few lines saying which GPU each rank gets and over which links the groups talk."""
    names = {NO_LINK: "none", PCIE: "PCIe", NVLINK: "NVLink"}
    lines = [f"parallel plan: {placement.stages} stage(s) x {placement.ep_size} expert-parallel rank(s)"]
    for stage, row in enumerate(placement.grid):
        ranks = ", ".join(f"rank {stage * placement.ep_size + e} -> GPU {gpu}" for e, gpu in enumerate(row))
        kind = ""
        if links is not None and len(row) > 1:
            worst = min(links[a][b] for a, b in itertools.combinations(row, 2))
            kind = f"; expert-parallel links: {names.get(worst, f'level {worst}')}"
        lines.append(f"  stage {stage}: {ranks}{kind}")
    if links is not None and placement.stages > 1:
        lines.append(f"  stage-boundary link score {placement.stage_link_score}")
    return "\n".join(lines)


def read_link_matrix(gpus: Sequence[int]) -> list[list[int]] | None:
    """Link levels between ``gpus`` (NVML indices) from NVML, or None where NVML is absent."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpus]
        matrix = [[0] * len(gpus) for _ in gpus]
        for i, j in itertools.combinations(range(len(gpus)), 2):
            level = NO_LINK
            if _p2p(pynvml, handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK):
                level = NVLINK
            elif _p2p(pynvml, handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_READ):
                level = PCIE
            matrix[i][j] = matrix[j][i] = level
        return matrix
    finally:
        pynvml.nvmlShutdown()


def _p2p(pynvml, a, b, capability) -> bool:
    try:
        return pynvml.nvmlDeviceGetP2PStatus(a, b, capability) == pynvml.NVML_P2P_STATUS_OK
    except pynvml.NVMLError:
        return False


def plan_for_gpus(gpus: Sequence[int], layout: str = "auto") -> tuple[Placement, list[list[int]] | None]:
    """The placement for ``gpus`` under ``layout``, from NVML links where NVML answers."""
    links = read_link_matrix(gpus)
    stages, ep = parse_layout(layout, len(gpus), links)
    local = plan_placement(links or _flat(len(gpus)), stages, ep)
    grid = tuple(tuple(gpus[i] for i in row) for row in local.grid)
    return Placement(grid, local.ep_link_score, local.stage_link_score), links


def _flat(n: int) -> list[list[int]]:
    return [[0] * n for _ in range(n)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the rank -> GPU plan for a multi-GPU deployment.")
    parser.add_argument("--gpus", required=True, help="comma-separated GPU indices, e.g. 0,1,2,3")
    parser.add_argument("--layout", default="auto", help="auto, ep, pp or STAGESxEP (e.g. 2x2)")
    args = parser.parse_args(argv)
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    placement, links = plan_for_gpus(gpus, args.layout)
    if links is None:
        print("NVML unavailable (pip install nvidia-ml-py): placing in the given order")
    local_links = None if links is None else _remap(links, gpus, placement)
    print(describe(placement, local_links))


def _remap(links: LinkMatrix, gpus: Sequence[int], placement: Placement) -> dict[int, dict[int, int]]:
    """``links`` indexed by GPU id instead of by position in ``gpus`` (for :func:`describe`)."""
    position = {gpu: i for i, gpu in enumerate(gpus)}
    return {a: {b: links[position[a]][position[b]] for b in gpus} for a in gpus}


if __name__ == "__main__":
    main()
