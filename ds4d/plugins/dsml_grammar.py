"""Byte grammars for constrained decoding, matched on token bytes.

A :class:`Grammar` is a graph of segments -- literal bytes (one of several options),
free text ended by a closing tag, a JSON integer, end-of-sentence -- each followed by
the segments listed for it; a straight line for one forced call, a loop for a whole
tool-call block.  :class:`GrammarConstraint` is the TokenConstraint that walks one or
more grammars at once: the tokens allowed next are those whose bytes some path can
still read, which admits any tokenization of the markup (the model's own merges
included, also across two literals).  Values never share a token with the markup before
them; a free-text value may end with the first bytes of its closing tag.

With a token budget the constraint keeps the text finishable: once the budget left is
close to the fewest tokens that can still complete the grammar, only tokens on such a
shortest completion stay allowed, so it always ends with end-of-sentence in time.  The
fewest tokens are a fixpoint over the graph (loops cost at least one pass); the
"anything goes" shortcut needs an upper bound, which only straight grammars have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ds4d.plugins.token_table import DIGITS, TokenTable, partial_match


@dataclass(frozen=True)
class Lit:
    """Literal bytes; several options = one of them (all lead to the same next segments)."""

    options: tuple[bytes, ...]


@dataclass(frozen=True)
class Text:
    """A string value: free text ended by the constraint's closing tag (the options of every
    segment after it start with it)."""


@dataclass(frozen=True)
class Digits:
    """A non-negative JSON integer."""


@dataclass(frozen=True)
class End:
    """End-of-sentence."""


Segment = Lit | Text | Digits | End


@dataclass(frozen=True)
class Grammar:
    """Segments, the segments each may be followed by (none after :class:`End`) and where to start."""

    segments: tuple[Segment, ...]
    next: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...] = (0,)
    param: tuple[str | None, ...] = ()
    """The parameter a segment opens (None: none); a call names each parameter once."""
    opens_call: tuple[bool, ...] = ()
    """Segments that start a call (its parameters so far are forgotten)."""

    @staticmethod
    def line(program: Sequence[Segment]) -> "Grammar":
        """Each segment followed by the next: one forced call."""
        count = len(program)
        return Grammar(tuple(program), tuple((i + 1,) if i + 1 < count else () for i in range(count)))

    def param_of(self, segment: int) -> str | None:
        return self.param[segment] if self.param else None


@dataclass(frozen=True)
class _Path:
    """One way the output so far can still be read: position inside one grammar."""

    program: int
    segment: int
    offset: int = 0
    """Bytes matched in a literal; closing-tag bytes matched at the end of a text value; digits so far."""
    live: tuple[bytes, ...] = ()
    """A literal's options still consistent with the output."""
    leading_zero: bool = False
    used: frozenset[str] = frozenset()
    """Parameters the current call has named."""


class GrammarConstraint:
    """TokenConstraint walking ``grammars`` (e.g. one per tool a call may go to): the tokens
    allowed next are those some grammar can still read.  ``close`` ends every :class:`Text`."""

    def __init__(self, table: TokenTable, grammars: Sequence[Grammar], *, close: bytes,
                 max_tokens: int | None = None) -> None:
        self._table = table
        self._close = close
        self._programs = list(grammars)
        self._rest = [self._rest_costs(g) for g in self._programs]
        self._after = [self._after_costs(g, rest, min, 0.0) for g, rest in zip(self._programs, self._rest)]
        self._upper = [self._rest_upper(g) for g in self._programs]
        self._upper_after = [self._after_costs(g, up, max, 0.0) for g, up in zip(self._programs, self._upper)]
        self._paths = {p for index, g in enumerate(self._programs) for s in g.starts
                       for p in self._enter(index, s, b"", frozenset())}
        self._left = math.inf if max_tokens is None else max_tokens
        self.finished = False
        self.min_tokens = min(self._cost(p) for p in self._paths)
        """Fewest tokens that complete a grammar from the start."""

    # ------------------------------------------------------------------ costs

    def _shortest(self, data: bytes) -> list[float]:
        return self._table.shortest(data)

    def _own_cost(self, seg: Segment) -> float:
        if isinstance(seg, Lit):
            return min(self._shortest(o)[0] for o in seg.options)
        return 0 if isinstance(seg, Text) else 1

    def _rest_costs(self, grammar: Grammar) -> list[float]:
        """rest[i]: fewest tokens to finish from the start of segment i (a fixpoint: blocks loop)."""
        rest = [math.inf] * len(grammar.segments)
        changed = True
        while changed:
            changed = False
            for i in range(len(rest) - 1, -1, -1):
                after = min((rest[k] for k in grammar.next[i]), default=0.0)
                cost = self._own_cost(grammar.segments[i]) + after
                if cost < rest[i]:
                    rest[i], changed = cost, True
        return rest

    @staticmethod
    def _after_costs(grammar: Grammar, costs: list[float], pick, none: float) -> list[float]:
        return [pick((costs[k] for k in grammar.next[i]), default=none) for i in range(len(costs))]

    def _rest_upper(self, grammar: Grammar) -> list[float]:
        """Like :meth:`_rest_costs` but counting a token per byte and the longest way (an upper
        bound when every byte is a token; infinite for a grammar that loops)."""
        count = len(grammar.segments)
        straight = all(n in ((i + 1,), ()) for i, n in enumerate(grammar.next))
        if not self._table.every_byte_is_a_token or not straight:
            return [math.inf] * count
        upper = [0.0] * (count + 1)
        for i in range(count - 1, -1, -1):
            seg = grammar.segments[i]
            own = max(len(o) for o in seg.options) if isinstance(seg, Lit) else 0 if isinstance(seg, Text) else 1
            upper[i] = own + (upper[i + 1] if grammar.next[i] else 0)
        return upper[:count]

    def _cost(self, path: _Path) -> float:
        grammar = self._programs[path.program]
        seg = grammar.segments[path.segment]
        after = self._after[path.program]
        if isinstance(seg, Lit):
            return min(self._shortest(o)[path.offset] for o in path.live) + after[path.segment]
        if isinstance(seg, Text):
            return min(self._shortest(o)[path.offset] + after[k] for k in grammar.next[path.segment]
                       for o in grammar.segments[k].options)
        if isinstance(seg, Digits):
            return (0 if path.offset else 1) + after[path.segment]
        return 1  # End

    def _upper_cost(self, path: _Path) -> float:
        seg = self._programs[path.program].segments[path.segment]
        if isinstance(seg, Lit):
            return max(len(o) for o in path.live) - path.offset + self._upper_after[path.program][path.segment]
        return self._upper[path.program][path.segment]

    # ------------------------------------------------------------------ moving along a grammar

    def _enter(self, program: int, segment: int, data: bytes, used: frozenset[str]) -> list[_Path]:
        """Paths after ``data`` was written from the start of ``segment`` (data stays inside it)."""
        grammar = self._programs[program]
        if grammar.opens_call and grammar.opens_call[segment]:
            used = frozenset()
        param = grammar.param_of(segment)
        if param is not None:
            if param in used:
                return []
            used = used | {param}
        seg = grammar.segments[segment]
        if isinstance(seg, Lit):
            return self._in_literal(program, segment, 0, seg.options, data, used)
        if not data:
            return [_Path(program, segment, used=used)]
        return []  # a token never straddles into a value

    def _enter_next(self, program: int, segment: int, data: bytes, used: frozenset[str]) -> list[_Path]:
        return [p for k in self._programs[program].next[segment] for p in self._enter(program, k, data, used)]

    def _in_literal(self, program: int, segment: int, offset: int, live: tuple[bytes, ...],
                    data: bytes, used: frozenset[str]) -> list[_Path]:
        end = offset + len(data)
        paths: list[_Path] = []
        matching = tuple(o for o in live if o[offset:end] == data and len(o) >= end)
        if any(len(o) == end for o in matching):
            paths.extend(self._enter_next(program, segment, b"", used))
        longer = tuple(o for o in matching if len(o) > end)
        if longer:
            paths.append(_Path(program, segment, end, longer, used=used))
        for option in live:  # data running on into the literal that follows
            if len(option) < end and data.startswith(option[offset:]):
                paths.extend(self._enter_next(program, segment, data[len(option) - offset :], used))
        return paths

    def _advance(self, path: _Path, data: bytes) -> list[_Path]:
        seg = self._programs[path.program].segments[path.segment]
        if isinstance(seg, Lit):
            return self._in_literal(path.program, path.segment, path.offset, path.live, data, path.used)
        if isinstance(seg, Text):
            text = self._close[: path.offset] + data
            found = text.find(self._close)
            if found < 0:
                return [_Path(path.program, path.segment, partial_match(text, self._close), used=path.used)]
            return self._enter_next(path.program, path.segment, text[found:], path.used)
        if isinstance(seg, Digits):
            if not set(data) <= DIGITS:
                return self._enter_next(path.program, path.segment, data, path.used) if path.offset else []
            if path.leading_zero or (not path.offset and data[0] == ord("0") and data != b"0"):
                return []  # JSON numbers have no leading zeros
            return [_Path(path.program, path.segment, path.offset + len(data),
                          leading_zero=path.leading_zero or (not path.offset and data == b"0"), used=path.used)]
        return []

    def _successor_literals(self, path: _Path) -> list[bytes]:
        grammar = self._programs[path.program]
        return [o for k in grammar.next[path.segment] if isinstance(grammar.segments[k], Lit)
                for o in grammar.segments[k].options]

    def _successor_options(self, path: _Path) -> list[bytes]:
        grammar = self._programs[path.program]
        return [o for k in grammar.next[path.segment] for o in grammar.segments[k].options]

    # ------------------------------------------------------------------ TokenConstraint

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        table = self._table
        mask = np.zeros(max(vocab_size, table.vocab_size), dtype=bool)
        ids: list[int] = []
        if self.finished or not self._paths:
            ids.extend(table.eos_ids)
        for path in self._paths:
            free = self._upper_cost(path) <= self._left - 1
            self._collect(path, free, mask, ids)
        mask[np.asarray(ids, dtype=np.int64)] = True
        return torch.from_numpy(mask[:vocab_size])

    def _fits(self, paths: list[_Path]) -> bool:
        return any(self._cost(p) <= self._left - 1 for p in paths)

    def fits_after(self, data: bytes, left: float) -> bool:
        """Whether ``data`` written from the start leaves a way to finish in ``left`` tokens."""
        paths = [n for p in self._paths for n in self._advance(p, data)]
        return any(self._cost(p) <= left for p in paths)

    def _collect(self, path: _Path, free: bool, mask: np.ndarray, ids: list[int]) -> None:
        """Add the tokens ``path`` allows (only budget-safe ones unless ``free``)."""
        table = self._table
        seg = self._programs[path.program].segments[path.segment]
        if isinstance(seg, End):
            ids.extend(table.eos_ids)
            return
        if isinstance(seg, Lit):
            follows = self._successor_literals(path)
            for option in path.live:
                for length, token_ids in table.prefixes(option, path.offset):
                    if free or self._fits(self._advance(path, option[path.offset : path.offset + length])):
                        ids.extend(token_ids)
                rest = option[path.offset :]
                for follow in follows:  # tokens running on into the literal that follows
                    for length, token_ids in table.prefixes(rest + follow):
                        if length > len(rest):
                            after = self._advance(path, (rest + follow)[:length])
                            if after and (free or self._fits(after)):
                                ids.extend(token_ids)
            return
        if isinstance(seg, Text):
            worst = max(self._cost(_Path(path.program, path.segment, k)) for k in range(len(self._close)))
            if free or worst <= self._left - 1:
                mask[: table.vocab_size] |= table.free_text_mask(self._close, path.offset)
            for option in self._successor_options(path):
                for length, token_ids in table.prefixes(option, path.offset):
                    if free or self._fits(self._advance(path, option[path.offset : path.offset + length])):
                        ids.extend(token_ids)
            return
        # Digits
        rest = self._after[path.program][path.segment]
        if not path.offset:
            mask[: table.vocab_size] |= table.first_digit_mask
            return
        if not path.leading_zero and (free or rest <= self._left - 1):
            mask[: table.vocab_size] |= table.digit_mask
        for option in self._successor_options(path):
            for length, token_ids in table.prefixes(option):
                if free or self._fits(self._advance(path, option[:length])):
                    ids.extend(token_ids)

    def accept(self, token_id: int) -> None:
        self._left -= 1
        if self.finished:
            return
        if token_id in self._table.eos_ids:
            self.finished = True
            self._paths = set()
            return
        data = self._table.token_bytes[token_id] if 0 <= token_id < self._table.vocab_size else b""
        if not data:  # a control token or one without bytes: no grammar reads it
            self._paths = set()
            return
        self.feed(data)

    def feed(self, data: bytes) -> None:
        """Move on by ``data`` (also written without a token of its own: the end of the token that
        opened the block)."""
        self._paths = {n for p in self._paths for n in self._advance(p, data)}

    def set_budget(self, left: float) -> None:
        self._left = left
