"""Constrained decoding that forces one DeepSeek-V4 / V4.1 DSML tool call (``tool_choice``).

``tool_choice: "required"`` or ``{"type": "function", "function": {"name": ...}}``
promises the client a tool call.  :func:`build_tool_constraint` returns a
:class:`~ds4d.engine.request.TokenConstraint` under which any model -- random
weights included -- writes exactly one call the ``dsml`` parser accepts::

    [</think>]\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>
    ...
    </｜DSML｜invoke>
    </｜DSML｜tool_calls><｜end▁of▁sentence｜>

(V4.1 spells the tags with a leading space, ``<｜DSML｜ calls>``; the constraint
takes the model's :class:`~ds4d.plugins.dsml_format.DsmlSpelling`.)  The markup is
byte-for-byte what the encoder renders for an assistant call, so the next turn
re-renders the same text.  The tool is the named one, or any of
``tools`` for ``"required"``.  The parameters are the tool's ``required`` ones,
in schema order; optional parameters are left out.  Values by JSON-schema type:

- string (or no type): free text that never contains ``</｜DSML｜parameter>``
  (other ``<`` are fine, so code can be written); the closing tag may come at
  any point, immediately included;
- string ``enum`` / ``const``: one of the listed values;
- integer, number: a non-negative JSON integer (digit tokens, no leading zero);
- boolean: ``true`` / ``false``; null: ``null``; array: ``[]``; object: ``{}``.

If the prompt leaves the model inside a reasoning block, ``</think>`` is forced
first: the call is what the client asked for, and reasoning of unbounded length
would make the promise depend on the model choosing to stop thinking.

Matching is on token *bytes*, so any tokenization of the markup is accepted (the
model's own merges included); literal text and markup never straddle a token,
except that a value may end with the first bytes of its closing tag.  With
``max_tokens`` the constraint also keeps the call finishable: once the budget
left is close to the fewest tokens that can still complete the call, only tokens
on such a shortest completion stay allowed, so the call always ends with
end-of-sentence within ``max_tokens``.

Cost: the tokenizer's :class:`~ds4d.plugins.token_table.TokenTable` is built
once (about a second for the V4 vocabulary) and cached, so call this off the
event loop.  A step then costs well under a millisecond: a numpy mask copy and a
few dictionary lookups.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ds4d.contracts import Tokenizer
from ds4d.plugins.dsml_format import THINK_END, V4_SPELLING, DsmlSpelling, to_json
from ds4d.plugins.token_table import DIGITS, TokenTable, partial_match, token_table

_MAX_MERGED_OPTIONS = 64
"""Adjacent literal choices are multiplied out only up to this many alternatives."""


# --------------------------------------------------------------------------- call grammar


@dataclass(frozen=True)
class _Lit:
    """Literal bytes; several options = one of them (all lead to the same next segment)."""

    options: tuple[bytes, ...]


@dataclass(frozen=True)
class _Text:
    """A string value: free text ended by the parameter's closing tag (the next segment's options
    start with it)."""


@dataclass(frozen=True)
class _Digits:
    """A non-negative JSON integer."""


@dataclass(frozen=True)
class _End:
    """End-of-sentence."""


_Segment = _Lit | _Text | _Digits | _End


def _tool_function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, Mapping) else tool


def _value_segment(schema: Any, close: bytes) -> tuple[bool, _Segment]:
    """(is a string value, segment) for one parameter's JSON schema."""
    if not isinstance(schema, Mapping):
        return True, _Text()
    choices = schema.get("enum")
    if not choices and "const" in schema:
        choices = [schema["const"]]
    if choices:
        if all(isinstance(c, str) for c in choices):
            options = tuple(c.encode() for c in choices if close not in c.encode())
            if options:
                return True, _Lit(options)
        else:
            return False, _Lit(tuple(to_json(c).encode() for c in choices))
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    fixed = {"boolean": (b"true", b"false"), "null": (b"null",), "array": (b"[]",), "object": (b"{}",)}
    if kind in ("integer", "number"):
        return False, _Digits()
    if kind in fixed:
        return False, _Lit(fixed[kind])
    return True, _Text()


def _required_parameters(parameters: Any) -> list[tuple[str, Any]]:
    if not isinstance(parameters, Mapping):
        return []
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), Mapping) else {}
    required = [r for r in parameters.get("required") or () if _valid_name(r)]
    ordered = [name for name in properties if name in required]
    ordered += [name for name in required if name not in properties]
    return [(name, properties.get(name)) for name in dict.fromkeys(ordered)]


def _append(program: list[_Segment], segment: _Segment) -> None:
    """Append, multiplying adjacent literals out while the alternatives stay few."""
    last = program[-1] if program else None
    if isinstance(segment, _Lit) and isinstance(last, _Lit) and \
            len(last.options) * len(segment.options) <= _MAX_MERGED_OPTIONS:
        program[-1] = _Lit(tuple(a + b for a in last.options for b in segment.options))
    else:
        program.append(segment)


def _call_program(function: Mapping[str, Any], prefix: str, spelling: DsmlSpelling) -> tuple[_Segment, ...]:
    name = function["name"]
    close = spelling.parameter_close.encode()
    program: list[_Segment] = []
    _append(program, _Lit(((prefix + spelling.invoke_open(name) + "\n").encode(),)))
    parameters = _required_parameters(function.get("parameters"))
    for param, schema in parameters:
        is_string, value = _value_segment(schema, close)
        _append(program, _Lit((spelling.parameter_open(param, is_string).encode(),)))
        _append(program, value)
        _append(program, _Lit((close + b"\n",)))
    if not parameters:
        _append(program, _Lit((b"\n",)))
    _append(program, _Lit((f"{spelling.invoke_close}\n{spelling.calls_close}".encode(),)))
    program.append(_End())
    return tuple(program)


def _valid_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and not any(ch in name for ch in '"<>')


# --------------------------------------------------------------------------- the constraint


@dataclass(frozen=True)
class _Path:
    """One way the output so far can still be read: position inside one program."""

    program: int
    segment: int
    offset: int = 0
    """Bytes matched in a literal; closing-tag bytes matched at the end of a text value; digits so far."""
    live: tuple[bytes, ...] = ()
    """A literal's options still consistent with the output."""
    leading_zero: bool = False


class DsmlCallConstraint:
    """TokenConstraint forcing one DSML call to one of ``functions`` (see the module docstring)."""

    def __init__(self, table: TokenTable, functions: Sequence[Mapping[str, Any]], *, prefix: str,
                 max_tokens: int | None = None, spelling: DsmlSpelling = V4_SPELLING) -> None:
        self._table = table
        self._close = spelling.parameter_close.encode()
        self._programs = [_call_program(f, prefix, spelling) for f in functions]
        self._rest = [self._rest_costs(p) for p in self._programs]
        self._upper = [self._rest_upper(p) for p in self._programs]
        self._paths = {p for index in range(len(self._programs)) for p in self._enter(index, 0, b"")}
        self._left = math.inf if max_tokens is None else max_tokens
        self.finished = False
        self.min_tokens = min(self._cost(p) for p in self._paths)
        """Fewest tokens that complete the call from the start."""

    # ------------------------------------------------------------------ costs

    def _shortest(self, data: bytes) -> list[float]:
        return self._table.shortest(data)

    def _rest_costs(self, program: tuple[_Segment, ...]) -> list[float]:
        """rest[i]: fewest tokens to finish from the start of segment i."""
        rest = [0.0] * (len(program) + 1)
        for i in range(len(program) - 1, -1, -1):
            seg = program[i]
            own = min(self._shortest(o)[0] for o in seg.options) if isinstance(seg, _Lit) else \
                0 if isinstance(seg, _Text) else 1
            rest[i] = own + rest[i + 1]
        return rest

    def _rest_upper(self, program: tuple[_Segment, ...]) -> list[float]:
        """Like :meth:`_rest_costs` but counting a token per byte (an upper bound when every byte is a token)."""
        if not self._table.every_byte_is_a_token:
            return [math.inf] * (len(program) + 1)
        upper = [0.0] * (len(program) + 1)
        for i in range(len(program) - 1, -1, -1):
            seg = program[i]
            own = max(len(o) for o in seg.options) if isinstance(seg, _Lit) else 0 if isinstance(seg, _Text) else 1
            upper[i] = own + upper[i + 1]
        return upper

    def _cost(self, path: _Path) -> float:
        seg = self._programs[path.program][path.segment]
        rest = self._rest[path.program]
        if isinstance(seg, _Lit):
            return min(self._shortest(o)[path.offset] for o in path.live) + rest[path.segment + 1]
        if isinstance(seg, _Text):
            closing = self._programs[path.program][path.segment + 1].options
            return min(self._shortest(o)[path.offset] for o in closing) + rest[path.segment + 2]
        if isinstance(seg, _Digits):
            return (0 if path.offset else 1) + rest[path.segment + 1]
        return 1  # _End

    def _upper_cost(self, path: _Path) -> float:
        seg = self._programs[path.program][path.segment]
        upper = self._upper[path.program]
        if isinstance(seg, _Lit):
            return max(len(o) for o in path.live) - path.offset + upper[path.segment + 1]
        return upper[path.segment]

    # ------------------------------------------------------------------ moving along a program

    def _enter(self, program: int, segment: int, data: bytes) -> list[_Path]:
        """Paths after ``data`` was written from the start of ``segment`` (data stays inside it)."""
        seg = self._programs[program][segment]
        if isinstance(seg, _Lit):
            return self._in_literal(program, segment, 0, seg.options, data)
        if not data:
            return [_Path(program, segment)]
        return []  # a token never straddles into a value

    def _in_literal(self, program: int, segment: int, offset: int, live: tuple[bytes, ...],
                    data: bytes) -> list[_Path]:
        end = offset + len(data)
        paths: list[_Path] = []
        matching = tuple(o for o in live if o[offset:end] == data and len(o) >= end)
        if any(len(o) == end for o in matching):
            paths.extend(self._enter(program, segment + 1, b""))
        longer = tuple(o for o in matching if len(o) > end)
        if longer:
            paths.append(_Path(program, segment, end, longer))
        return paths

    def _advance(self, path: _Path, data: bytes) -> list[_Path]:
        seg = self._programs[path.program][path.segment]
        if isinstance(seg, _Lit):
            return self._in_literal(path.program, path.segment, path.offset, path.live, data)
        if isinstance(seg, _Text):
            text = self._close[: path.offset] + data
            found = text.find(self._close)
            if found < 0:
                return [_Path(path.program, path.segment, partial_match(text, self._close))]
            return self._enter(path.program, path.segment + 1, text[found:])
        if isinstance(seg, _Digits):
            if not set(data) <= DIGITS:
                return self._enter(path.program, path.segment + 1, data) if path.offset else []
            if path.leading_zero or (not path.offset and data[0] == ord("0") and data != b"0"):
                return []  # JSON numbers have no leading zeros
            return [_Path(path.program, path.segment, path.offset + len(data),
                          leading_zero=path.leading_zero or (not path.offset and data == b"0"))]
        return []

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

    def _collect(self, path: _Path, free: bool, mask: np.ndarray, ids: list[int]) -> None:
        """Add the tokens ``path`` allows (only budget-safe ones unless ``free``)."""
        table = self._table
        seg = self._programs[path.program][path.segment]
        if isinstance(seg, _End):
            ids.extend(table.eos_ids)
            return
        if isinstance(seg, _Lit):
            for option in path.live:
                for length, token_ids in table.prefixes(option, path.offset):
                    if free or self._fits(self._advance(path, option[path.offset : path.offset + length])):
                        ids.extend(token_ids)
            return
        if isinstance(seg, _Text):
            closing = self._programs[path.program][path.segment + 1].options
            worst = max(self._cost(_Path(path.program, path.segment, k)) for k in range(len(self._close)))
            if free or worst <= self._left - 1:
                mask[: table.vocab_size] |= table.free_text_mask(self._close, path.offset)
            for option in closing:
                for length, token_ids in table.prefixes(option, path.offset):
                    if free or self._fits(self._advance(path, option[path.offset : path.offset + length])):
                        ids.extend(token_ids)
            return
        # _Digits
        rest = self._rest[path.program][path.segment + 1]
        if not path.offset:
            mask[: table.vocab_size] |= table.first_digit_mask
            return
        if not path.leading_zero and (free or rest <= self._left - 1):
            mask[: table.vocab_size] |= table.digit_mask
        for option in self._programs[path.program][path.segment + 1].options:
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
        self._paths = {n for p in self._paths for n in self._advance(p, data)} if data else set()


# --------------------------------------------------------------------------- entry point


def _forced_functions(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> list[Mapping[str, Any]] | None:
    """The functions a call may go to, or None when ``tool_choice`` forces nothing."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = _tool_function(tool)
        if _valid_name(function.get("name")):
            functions.setdefault(function["name"], function)
    if tool_choice == "required":
        if not functions:
            raise ValueError('tool_choice "required" needs at least one tool with a valid name')
        return list(functions.values())
    if isinstance(tool_choice, Mapping):
        chosen = tool_choice.get("function") if isinstance(tool_choice.get("function"), Mapping) else tool_choice
        name = chosen.get("name")
        if tool_choice.get("type", "function") == "function" and isinstance(name, str):
            if name not in functions:
                raise ValueError(f"tool_choice names function {name!r}, which is not among the request's tools")
            return [functions[name]]
    raise ValueError(f"unsupported tool_choice {tool_choice!r}")


def build_tool_constraint(tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, *,
                          prompt_ends_in_reasoning: bool, max_tokens: int | None = None,
                          table: TokenTable | None = None,
                          spelling: DsmlSpelling = V4_SPELLING) -> DsmlCallConstraint | None:
    """A constraint forcing one DSML call, or None for ``tool_choice`` "auto", "none" or absent.

    Raises ValueError (a client error) for a ``tool_choice`` that names no tool of
    the request, and when ``max_tokens`` is too small for any call to fit.
    ``table`` defaults to the cached table of ``tokenizer``; ``spelling`` is the model's DSML
    (V4's or V4.1's).
    """
    functions = _forced_functions(tools or (), tool_choice)
    if functions is None:
        return None
    prefix = (THINK_END if prompt_ends_in_reasoning else "") + "\n\n" + spelling.calls_open + "\n"
    constraint = DsmlCallConstraint(table or token_table(tokenizer), functions, prefix=prefix,
                                    max_tokens=max_tokens, spelling=spelling)
    if max_tokens is not None and constraint.min_tokens > max_tokens:
        raise ValueError(f"max_tokens={max_tokens} is too small for the forced tool call, "
                         f"which needs at least {int(constraint.min_tokens)} tokens")
    return constraint
