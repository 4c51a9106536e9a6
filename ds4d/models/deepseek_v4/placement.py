"""Which routed experts live on the device: routing counts in, hot sets out.

Plain bookkeeping, no tensors.  The device holds ``capacity`` experts over all
layers together (:func:`capacity_for_budget`); :func:`plan_placement` gives
them to the (layer, expert) pairs that received the most tokens, so a layer
whose routing is skewed gets more device slots than one that spreads evenly.
Before any count is known (or on ties) slots go round-robin over layers, the
lowest expert ids first, so an unmeasured model still has every layer covered
evenly.

:class:`PlacementPolicy` keeps decayed counts per layer.  ``static`` plans once
(from calibration counts when given); ``online`` re-plans every
``replan_tokens`` routed tokens, and adopts the new plan only when it would
have caught ``min_gain`` more of the recent hits than the current one, so
placement does not churn on noise.
"""

from __future__ import annotations

from collections.abc import Sequence

PLACEMENTS = ("static", "online")


def capacity_for_budget(budget_bytes: int, expert_bytes: int, staging_bytes: int, total_experts: int) -> int:
    """Experts that fit on the device in ``budget_bytes`` after the staging buffers."""
    if expert_bytes <= 0:
        return total_experts
    return max(0, min(total_experts, (budget_bytes - staging_bytes) // expert_bytes))


def plan_placement(counts: Sequence[Sequence[float]], capacity: int) -> list[list[int]]:
    """Hot expert ids per layer (sorted): the ``capacity`` most-routed (layer, expert) pairs.

    Order of preference: more tokens first; then the pair's rank inside its
    layer (so ties spread evenly over layers); then the lower layer, the lower
    expert id."""
    ranked = []
    for layer, per_expert in enumerate(counts):
        order = sorted(range(len(per_expert)), key=lambda e: (-per_expert[e], e))
        ranked.extend((-per_expert[e], rank, layer, e) for rank, e in enumerate(order))
    ranked.sort()
    hot: list[list[int]] = [[] for _ in counts]
    for _, _, layer, expert in ranked[: max(0, capacity)]:
        hot[layer].append(expert)
    return [sorted(h) for h in hot]


def hits(counts: Sequence[Sequence[float]], hot: Sequence[Sequence[int]]) -> float:
    return sum(counts[layer][e] for layer, experts in enumerate(hot) for e in experts)


class PlacementPolicy:
    """Routing counts per layer and the decision when to move experts."""

    def __init__(
        self,
        layers: int,
        experts: int,
        capacity: int,
        *,
        mode: str = "online",
        replan_tokens: int = 8192,
        min_gain: float = 0.05,
        decay: float = 0.5,
        calibration: Sequence[Sequence[float]] | None = None,
    ) -> None:
        if mode not in PLACEMENTS:
            raise ValueError(f"expert placement {mode!r}: use one of {', '.join(PLACEMENTS)}")
        self.layers, self.experts, self.capacity = layers, experts, capacity
        self.mode, self.replan_tokens, self.min_gain, self.decay = mode, replan_tokens, min_gain, decay
        self.counts = [[0.0] * experts for _ in range(layers)]
        self.tokens_since_plan = 0
        self.replans = 0
        if calibration is not None:
            self.add_counts(calibration)
            self.tokens_since_plan = 0

    def add_counts(self, counts: Sequence[Sequence[float]]) -> None:
        for layer, per_expert in enumerate(counts):
            self.observe(layer, per_expert)

    def observe(self, layer: int, per_expert: Sequence[float]) -> None:
        row = self.counts[layer]
        for expert, count in enumerate(per_expert):
            if count:
                row[expert] += count
        if layer == 0:
            self.tokens_since_plan += int(sum(per_expert))

    def initial(self) -> list[list[int]]:
        return plan_placement(self.counts, self.capacity)

    def due(self) -> bool:
        return self.mode == "online" and self.tokens_since_plan >= self.replan_tokens

    def replan(self, current: Sequence[Sequence[int]]) -> list[list[int]] | None:
        """A new placement worth moving to, or None; either way the counts age by ``decay``."""
        self.tokens_since_plan = 0
        proposal = plan_placement(self.counts, self.capacity)
        now, then = hits(self.counts, current), hits(self.counts, proposal)
        for row in self.counts:
            for expert in range(len(row)):
                row[expert] *= self.decay
        if then <= now * (1 + self.min_gain) or [sorted(h) for h in current] == proposal:
            return None
        self.replans += 1
        return proposal
