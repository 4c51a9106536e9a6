"""Expert routing counts from a calibration prompt set, for the hot-expert placement.

``ds4d calibrate --model PATH --prompts FILE --out counts.json`` loads the model
as ``serve`` would (expert offload included), prefills every prompt through the
engine and writes how many (token, expert) pairs each layer routed to each
expert.  ``expert_calibration = "counts.json"`` then seeds the placement policy
(``placement.py``) with those counts, so the first requests already find the
experts they are likely to need on the device; with ``expert_placement =
online`` the live traffic takes over from there.

Prompts file: ``.jsonl`` with one object per line, either ``{"prompt": "text"}``
or ``{"messages": [...]}`` (rendered with the model's chat encoder, as the chat
API would), or any other file with one prompt per non-empty line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ds4d.models.deepseek_v4.model import DeepseekV4Model
from ds4d.models.deepseek_v4.moe import RoutingTally

FORMAT = "ds4d-expert-calibration"


def can_count(model: Any) -> bool:
    """Whether ``model`` is one whose routing :func:`routing_counts` can count (a single-process V4 model)."""
    return isinstance(model, DeepseekV4Model)


def routing_counts(model: DeepseekV4Model, prompts: Sequence[Sequence[int]], *,
                   chunk: int = 2048) -> list[list[float]]:
    """Per layer and expert, the routed (token, expert) pairs of prefilling ``prompts`` one at a time
    (through a model over ``model``'s weights that counts them; ``model`` itself counts nothing)."""
    from ds4d.engine.offline import OfflineEngine
    from ds4d.engine.request import EngineRequest, SamplingParams

    cfg = model.cfg
    tally = RoutingTally(cfg.num_hidden_layers, cfg.n_routed_experts, model.device)
    counting = model.with_paths(routing_tally=tally)
    longest = max((len(p) for p in prompts), default=1)
    engine = OfflineEngine(counting, max_num_seqs=1, context_tokens=longest + 2, prefill_chunk=chunk,
                           prefix_caching=False, namespace=b"calibrate", publish=lambda outputs: None)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for number, ids in enumerate(prompts):
        if ids:
            engine.submit(EngineRequest(f"calibrate-{number}", tuple(ids), params))
            engine.run_until_idle()
    return tally.as_lists()


def read_prompts(path: Path, tokenizer: Any, render=None, *, max_tokens: int = 0) -> list[list[int]]:
    """Token ids of every prompt in ``path`` (see the module doc), cut to ``max_tokens`` when > 0."""
    prompts = []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        if path.suffix == ".jsonl":
            item = json.loads(line)
            if "messages" in item:
                if render is None:
                    raise ValueError(f"{path}:{number}: messages need a chat encoder")
                ids = list(render(item["messages"]))
            elif isinstance(item.get("prompt"), str):
                ids = tokenizer.encode(item["prompt"], add_special_tokens=True)
            else:
                raise ValueError(f'{path}:{number}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
        else:
            ids = tokenizer.encode(line, add_special_tokens=True)
        prompts.append(ids[:max_tokens] if max_tokens > 0 else ids)
    return prompts


def write_counts(path: Path, counts: list[list[float]], *, model_name: str, prompts: int) -> None:
    path.write_text(json.dumps({"format": FORMAT, "model": model_name, "prompts": prompts,
                                "pairs": sum(sum(row) for row in counts[:1]), "counts": counts}))


def read_counts(path: str | Path) -> list[list[float]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("counts"), list):
        raise ValueError(f"{path} is not an expert calibration file (written by `ds4d calibrate`)")
    return [[float(c) for c in row] for row in data["counts"]]
