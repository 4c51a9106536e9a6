"""Tokenising a rendered prompt whose leading part the session memory already knows as ids."""

from __future__ import annotations

from ds4d.contracts import KnownPrefix, Tokenizer


def encode_prompt(tokenizer: Tokenizer, text: str,
                  known_prefix: KnownPrefix | None) -> tuple[list[int], tuple[int, int]]:
    """``text`` as ids, plus (ids, characters) of the leading part ``known_prefix`` supplied
    ((0, 0): tokenised whole)."""
    found = known_prefix(text) if known_prefix is not None else None
    if found is None:
        return tokenizer.encode(text, add_special_tokens=False), (0, 0)
    chars, head = found
    rest = tokenizer.encode(text[chars:], add_special_tokens=False) if chars < len(text) else []
    return [*head, *rest], (len(head), chars)
