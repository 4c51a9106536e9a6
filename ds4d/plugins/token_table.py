"""The bytes of every token of a vocabulary, for grammar-constrained decoding.

A constraint that forces text (markup, a JSON literal) must know which tokens
spell which bytes.  ``tokenizer.decode([id])`` gives that for tokens that are
whole characters; tokens holding part of a UTF-8 character decode to U+FFFD, so
their bytes are read from the vocabulary entry instead (the byte-level BPE
alphabet of GPT-2-style vocabularies, or SentencePiece ``<0xNN>`` byte tokens).
Decoding is assumed to concatenate token bytes, as byte-level BPE does.

Special tokens (control tokens such as begin/end of sentence: decoded text that
vanishes under ``skip_special_tokens``) and tokens whose bytes cannot be recovered
get no bytes, so no constraint ever allows them as text.

Building a table decodes the whole vocabulary once (about a second for the
129,280-token DeepSeek-V4 vocabulary), so :func:`token_table` caches one per
tokenizer; build it off the event loop.  Masks are numpy arrays: single-threaded
and cheap to combine in the engine step.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ds4d.contracts import Tokenizer

DIGITS = frozenset(b"0123456789")
_MAX_CACHED_DISTANCES = 4096


def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte -> printable character map, inverted (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _raw_token_bytes(piece: str | None, alphabet: Mapping[str, int]) -> bytes:
    """Bytes of a token that does not decode to whole characters on its own (b"" if unknown)."""
    if piece is None:
        return b""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    if all(ch in alphabet for ch in piece):
        return bytes(alphabet[ch] for ch in piece)
    return b""


def _suffix_prefix_lengths(text: bytes, terminator: bytes) -> list[int]:
    """Lengths m >= 1 such that ``text`` ends with ``terminator[:m]``."""
    return [m for m in range(1, min(len(text), len(terminator)) + 1) if text.endswith(terminator[:m])]


def partial_match(text: bytes, terminator: bytes) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``terminator``."""
    for m in range(min(len(text), len(terminator) - 1), 0, -1):
        if text.endswith(terminator[:m]):
            return m
    return 0


class TokenTable:
    """Token bytes of one tokenizer, with lookups and masks derived from them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        vocab = tokenizer.vocab_size
        alphabet = _byte_level_alphabet()
        special = set(tokenizer.eos_token_ids)
        if tokenizer.bos_token_id is not None:
            special.add(tokenizer.bos_token_id)
        token_bytes: list[bytes] = []
        for token_id in range(vocab):
            text = tokenizer.decode([token_id])
            if "\ufffd" in text:
                token_bytes.append(_raw_token_bytes(tokenizer.id_to_token(token_id), alphabet))
                continue
            if len(text) > 2 and text[0] == "<" and text[-1] == ">" and \
                    not tokenizer.decode([token_id], skip_special_tokens=True):
                special.add(token_id)
            token_bytes.append(text.encode())
        for token_id in special:
            if 0 <= token_id < vocab:
                token_bytes[token_id] = b""
        self.vocab_size = vocab
        self.token_bytes = token_bytes
        """Bytes of each token; empty for special tokens and tokens that cannot be used as text."""
        self.eos_ids = tuple(sorted(tokenizer.eos_token_ids))
        self.by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(token_bytes):
            if data:
                self.by_bytes.setdefault(data, []).append(token_id)
        self.every_byte_is_a_token = all(bytes([b]) in self.by_bytes for b in range(256))
        """Then any byte string is spelled by at most one token per byte."""
        self._longest_from: dict[bytes, int] = {}
        """Longest token starting with each 1- and 2-byte head (bounds the lookups in :meth:`prefixes`)."""
        for data in self.by_bytes:
            for head in (data[:1], data[:2]):
                self._longest_from[head] = max(self._longest_from.get(head, 0), len(data))
        self._sorted_bytes = sorted(self.by_bytes)
        self.text_mask = self.mask_of(t for ids in self.by_bytes.values() for t in ids)
        """Every token usable as text."""
        digit_tokens = [b for b in self.by_bytes if set(b) <= DIGITS]
        self.digit_mask = self.mask_of(t for b in digit_tokens for t in self.by_bytes[b])
        self.first_digit_mask = self.mask_of(t for b in digit_tokens if b[:1] != b"0" or b == b"0"
                                             for t in self.by_bytes[b])
        """Digit tokens that may start a JSON number (no leading zero)."""
        self._free_text_masks: dict[tuple[bytes, int], np.ndarray] = {}
        self._containing: dict[bytes, list[int]] = {}
        self._distances: dict[bytes, list[float]] = {}
        self._lock = threading.Lock()

    def mask_of(self, ids: Iterable[int]) -> np.ndarray:
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[np.fromiter(ids, dtype=np.int64)] = True
        return mask

    def prefixes(self, data: bytes, start: int = 0) -> list[tuple[int, list[int]]]:
        """``(length, ids)`` for every token whose bytes are ``data[start:start + length]``."""
        found = []
        longest = self._longest_from.get(data[start : start + 2], 1) if len(data) - start >= 2 else 1
        for length in range(1, min(len(data) - start, max(longest, 1)) + 1):
            ids = self.by_bytes.get(data[start : start + length])
            if ids:
                found.append((length, ids))
        return found

    def starting_with(self, prefix: bytes) -> list[int]:
        """Ids of the tokens whose bytes start with ``prefix``."""
        ids: list[int] = []
        index = bisect.bisect_left(self._sorted_bytes, prefix)
        while index < len(self._sorted_bytes) and self._sorted_bytes[index].startswith(prefix):
            ids.extend(self.by_bytes[self._sorted_bytes[index]])
            index += 1
        return ids

    def free_text_mask(self, terminator: bytes, matched: int) -> np.ndarray:
        """Tokens that keep a text free of ``terminator`` when it ends with ``terminator[:matched]``.

        Excluded: tokens containing the terminator, and tokens that complete it
        from any partial match at the end of the text.  Cached; do not modify.
        """
        key = (terminator, matched)
        with self._lock:
            mask = self._free_text_masks.get(key)
            if mask is None:
                mask = self.text_mask.copy()
                banned = self._containing.get(terminator)
                if banned is None:
                    banned = [t for data, ids in self.by_bytes.items() if terminator in data for t in ids]
                    self._containing[terminator] = banned
                banned = list(banned)
                for m in _suffix_prefix_lengths(terminator[:matched], terminator):
                    banned.extend(self.starting_with(terminator[m:]))
                mask[np.asarray(banned, dtype=np.int64)] = False
                self._free_text_masks[key] = mask
            return mask

    def shortest(self, data: bytes) -> list[float]:
        """``dist[i]``: fewest tokens spelling ``data[i:]`` (inf where impossible); cached."""
        with self._lock:
            dist = self._distances.get(data)
        if dist is not None:
            return dist
        dist = [math.inf] * (len(data) + 1)
        dist[-1] = 0
        for start in range(len(data) - 1, -1, -1):
            dist[start] = 1 + min((dist[start + n] for n, _ in self.prefixes(data, start)), default=math.inf)
        with self._lock:
            if len(self._distances) >= _MAX_CACHED_DISTANCES:
                self._distances.clear()
            self._distances[data] = dist
        return dist


_TABLES: weakref.WeakKeyDictionary[Any, TokenTable] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def token_table(tokenizer: Tokenizer) -> TokenTable:
    """The cached :class:`TokenTable` of ``tokenizer`` (built on first use)."""
    with _TABLES_LOCK:
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = TokenTable(tokenizer)
        return table
