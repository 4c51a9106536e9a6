"""Constrained decoding of DeepSeek-V4 / V4.1 DSML tool calls (``tool_choice``).

``tool_choice: "required"`` or ``{"type": "function", "function": {"name": ...}}``
promises the client a tool call.  :func:`build_tool_constraint` returns a
:class:`~ds4d.contracts.TokenConstraint` under which any model -- random
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

Under ``tool_choice`` "auto" (with ``tool_markup_guard``) :func:`build_block_guard`
leaves the text free until the model itself writes the block's opening tag: the marker
``｜DSML｜`` may appear only right after the tag's ``<``, and once it has, only the rest
of the tag may follow.  From there the block is written as above except that it may
hold several calls, each to a declared tool, naming declared parameters in any order
and each at most once; numbers, arrays and objects are free JSON text (the parser
keeps a value that is not JSON as a string).  So markup the model opens always
reaches the client as tool calls, never as broken content, and no stray DSML tag
either.  Under "none" the marker never appears, so no block opens.

Matching is on token *bytes* (:mod:`ds4d.plugins.dsml_grammar`), so any tokenization
of the markup is accepted (the model's own merges included).  With ``max_tokens`` the
call (or the block) always ends with end-of-sentence within ``max_tokens``.

Cost: the tokenizer's :class:`~ds4d.plugins.token_table.TokenTable` is built
once (about a second for the V4 vocabulary) and cached, so call these off the
event loop.  A step then costs well under a millisecond: a numpy mask copy and a
few dictionary lookups; outside a block the guard's mask (the tokens that would write
the marker) is cached per match state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ds4d.contracts import Tokenizer
from ds4d.plugins.dsml_format import DSML, THINK_END, V4_SPELLING, DsmlSpelling, to_json
from ds4d.plugins.dsml_grammar import Digits, End, Grammar, GrammarConstraint, Lit, Segment, Text
from ds4d.plugins.token_table import TokenTable, partial_match, token_table

_MAX_MERGED_OPTIONS = 64
"""Adjacent literal choices are multiplied out only up to this many alternatives."""


# --------------------------------------------------------------------------- call grammar


def _tool_function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, Mapping) else tool


def _value_segment(schema: Any, close: bytes) -> tuple[bool, Segment]:
    """(is a string value, segment) for one parameter's JSON schema."""
    if not isinstance(schema, Mapping):
        return True, Text()
    choices = schema.get("enum")
    if not choices and "const" in schema:
        choices = [schema["const"]]
    if choices:
        if all(isinstance(c, str) for c in choices):
            options = tuple(c.encode() for c in choices if close not in c.encode())
            if options:
                return True, Lit(options)
        else:
            return False, Lit(tuple(to_json(c).encode() for c in choices))
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    fixed = {"boolean": (b"true", b"false"), "null": (b"null",), "array": (b"[]",), "object": (b"{}",)}
    if kind in ("integer", "number"):
        return False, Digits()
    if kind in fixed:
        return False, Lit(fixed[kind])
    return True, Text()


def _required_parameters(parameters: Any) -> list[tuple[str, Any]]:
    if not isinstance(parameters, Mapping):
        return []
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), Mapping) else {}
    required = [r for r in parameters.get("required") or () if _valid_name(r)]
    ordered = [name for name in properties if name in required]
    ordered += [name for name in required if name not in properties]
    return [(name, properties.get(name)) for name in dict.fromkeys(ordered)]


def _append(program: list[Segment], segment: Segment) -> None:
    """Append, multiplying adjacent literals out while the alternatives stay few."""
    last = program[-1] if program else None
    if isinstance(segment, Lit) and isinstance(last, Lit) and \
            len(last.options) * len(segment.options) <= _MAX_MERGED_OPTIONS:
        program[-1] = Lit(tuple(a + b for a in last.options for b in segment.options))
    else:
        program.append(segment)


def _call_program(function: Mapping[str, Any], prefix: str, spelling: DsmlSpelling) -> tuple[Segment, ...]:
    name = function["name"]
    close = spelling.parameter_close.encode()
    program: list[Segment] = []
    _append(program, Lit(((prefix + spelling.invoke_open(name) + "\n").encode(),)))
    parameters = _required_parameters(function.get("parameters"))
    for param, schema in parameters:
        is_string, value = _value_segment(schema, close)
        _append(program, Lit((spelling.parameter_open(param, is_string).encode(),)))
        _append(program, value)
        _append(program, Lit((close + b"\n",)))
    if not parameters:
        _append(program, Lit((b"\n",)))
    _append(program, Lit((f"{spelling.invoke_close}\n{spelling.calls_close}".encode(),)))
    program.append(End())
    return tuple(program)


def _valid_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and not any(ch in name for ch in '"<>')


# --------------------------------------------------------------------------- entry point


def _declared_functions(tools: Sequence[Mapping[str, Any]], spelling: DsmlSpelling) -> dict[str, Mapping[str, Any]]:
    """The request's functions by the name the model writes (``ns::name`` for a namespaced V4.1 tool)."""
    functions: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = _tool_function(tool)
        name = function.get("name")
        if spelling.namespaces and isinstance(name, str) and "::" not in name:
            namespace = tool.get("namespace") if tool.get("namespace") is not None else function.get("namespace")
            namespace = namespace.get("name") if isinstance(namespace, Mapping) else namespace
            if isinstance(namespace, str) and namespace:
                name = f"{namespace}::{name}"
        if _valid_name(name):
            functions.setdefault(name, {**function, "name": name})
    return functions


def _forced_functions(tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                      spelling: DsmlSpelling) -> list[Mapping[str, Any]] | None:
    """The functions a call may go to, or None when ``tool_choice`` forces nothing."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = _declared_functions(tools, spelling)
    if tool_choice == "required":
        if not functions:
            raise ValueError('tool_choice "required" needs at least one tool with a valid name')
        return list(functions.values())
    if isinstance(tool_choice, Mapping):
        chosen = tool_choice.get("function") if isinstance(tool_choice.get("function"), Mapping) else tool_choice
        name = chosen.get("name")
        if tool_choice.get("type", "function") == "function" and isinstance(name, str):
            bare = [f for qualified, f in functions.items() if qualified.rpartition("::")[2] == name]
            if name in functions:
                return [functions[name]]
            if len(bare) == 1:  # a namespaced tool named without its namespace
                return bare
            raise ValueError(f"tool_choice names function {name!r}, which is not among the request's tools")
    raise ValueError(f"unsupported tool_choice {tool_choice!r}")


def build_tool_constraint(tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, *,
                          prompt_ends_in_reasoning: bool, max_tokens: int | None = None,
                          table: TokenTable | None = None,
                          spelling: DsmlSpelling = V4_SPELLING) -> GrammarConstraint | None:
    """A constraint forcing one DSML call, or None for ``tool_choice`` "auto", "none" or absent.

    Raises ValueError (a client error) for a ``tool_choice`` that names no tool of
    the request, and when ``max_tokens`` is too small for any call to fit.
    ``table`` defaults to the cached table of ``tokenizer``; ``spelling`` is the model's DSML
    (V4's or V4.1's).
    """
    functions = _forced_functions(tools or (), tool_choice, spelling)
    if functions is None:
        return None
    prefix = (THINK_END if prompt_ends_in_reasoning else "") + "\n\n" + spelling.calls_open + "\n"
    grammars = [Grammar.line(_call_program(f, prefix, spelling)) for f in functions]
    constraint = GrammarConstraint(table or token_table(tokenizer), grammars,
                                   close=spelling.parameter_close.encode(), max_tokens=max_tokens)
    if max_tokens is not None and constraint.min_tokens > max_tokens:
        raise ValueError(f"max_tokens={max_tokens} is too small for the forced tool call, "
                         f"which needs at least {int(constraint.min_tokens)} tokens")
    return constraint


# --------------------------------------------------------------------------- tool_choice auto / none


def _block_values(schema: Any, close: bytes) -> list[tuple[bool, Segment]]:
    """The ``(string flag, value)`` forms a parameter may take inside a block the model opened:
    strings, enums, booleans and null as for a forced call; numbers, arrays and objects as free
    JSON text (the parser keeps a value that is not JSON as a string); both flags when the schema
    names no single type."""
    is_string, value = _value_segment(schema, close)
    if isinstance(value, Text):
        typed = isinstance(schema, Mapping) and schema.get("type") == "string"
        return [(True, value)] if typed else [(True, value), (False, Text())]
    if isinstance(value, Digits) or (not is_string and value in (Lit((b"[]",)), Lit((b"{}",)))):
        return [(False, Text())]
    return [(is_string, value)]


def _block_grammar(functions: Sequence[Mapping[str, Any]], spelling: DsmlSpelling) -> Grammar:
    """A whole tool-call block after its opening tag: one or more calls to ``functions``, each
    naming declared parameters at most once, then the closing tag and end-of-sentence."""
    segments: list[Segment] = []
    nexts: list[list[int]] = []
    params: list[str | None] = []
    opens: list[bool] = []

    def add(segment: Segment, param: str | None = None, opens_call: bool = False) -> int:
        segments.append(segment)
        nexts.append([])
        params.append(param)
        opens.append(opens_call)
        return len(segments) - 1

    close = spelling.parameter_close.encode()
    end = add(End())
    block_close = add(Lit((f"\n{spelling.calls_close}".encode(),)))
    nexts[block_close].append(end)
    headers, call_ends = [], []
    for function in functions:
        header = add(Lit((f"\n{spelling.invoke_open(function['name'])}\n".encode(),)), opens_call=True)
        headers.append(header)
        empty_end = add(Lit((f"\n{spelling.invoke_close}".encode(),)))
        value_end = add(Lit((close + f"\n{spelling.invoke_close}".encode(),)))
        nexts[header].append(empty_end)
        call_ends += [empty_end, value_end]
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        values: list[int] = []
        follow: list[int] = []
        for name, schema in (properties.items() if isinstance(properties, Mapping) else ()):
            if not _valid_name(name):
                continue
            for is_string, value in _block_values(schema, close):
                first = add(Lit((spelling.parameter_open(name, is_string).encode(),)), param=name)
                later = add(Lit((close + b"\n" + spelling.parameter_open(name, is_string).encode(),)), param=name)
                node = add(value)
                nexts[header].append(first)
                nexts[first].append(node)
                nexts[later].append(node)
                values.append(node)
                follow.append(later)
        for node in values:
            nexts[node] += [*follow, value_end]
    for call_end in call_ends:
        nexts[call_end] += [*headers, block_close]
    return Grammar(tuple(segments), tuple(tuple(n) for n in nexts), tuple(headers), tuple(params), tuple(opens))


class DsmlBlockGuard:
    """TokenConstraint for ``tool_choice`` "auto" and "none": DSML never reaches the content.

    Outside a block the marker ``｜DSML｜`` may appear only as part of the block's opening tag:
    with ``block`` (auto) a token may write it right after the tag's ``<`` (while a block could
    still close within the token budget), and from there only the rest of the tag may follow;
    the rest of the block is then written by ``block`` (declared tools and parameters, valid
    markup, closed within the token budget).  Without (none) the marker never appears, so no
    block opens.  Any other text is free.  The mask is a cached array per match state; the
    engine decodes a constrained request without look-ahead."""

    def __init__(self, table: TokenTable, opening: bytes, block: GrammarConstraint | None,
                 max_tokens: int | None = None, marker: bytes = DSML.encode()) -> None:
        if marker not in opening:
            raise ValueError(f"the opening tag {opening!r} does not hold the marker {marker!r}")
        self._table = table
        self._opening = opening
        self._marker = marker
        self._committed = opening.index(marker) + len(marker)
        """Bytes of the opening after which the text is inside the tag (its marker written)."""
        self._block = block
        self._in_block = False
        self._matched = 0
        """Bytes of the opening tag the text ends with."""
        self._marker_matched = 0
        """Bytes of the marker the text ends with."""
        self._left = math.inf if max_tokens is None else max_tokens
        self._completing: dict[int, list[int]] = {}
        self._banned: dict[tuple[int, int], np.ndarray] = {}
        self._entering: dict[tuple[int, int], list[tuple[int, int]]] = {}
        """Per match state: the tokens that write the marker as the tag's, with the tag bytes then matched."""

    def _completing_tokens(self, matched: int) -> list[int]:
        """Tokens that complete the opening tag after ``matched`` of its bytes (or hold all of it)."""
        ids = self._completing.get(matched)
        if ids is None:
            table = self._table
            free = table.free_text_mask(self._opening, matched)
            ids = np.flatnonzero(table.text_mask & ~free).tolist()
            self._completing[matched] = ids
        return ids

    def _tokens_to_finish(self, matched: int) -> int:
        """Tokens that write the opening tag's bytes after ``matched`` (greedy longest pieces: an upper bound)."""
        count, at = 0, matched
        while at < len(self._opening):
            pieces = self._table.prefixes(self._opening, at)
            at += pieces[-1][0] if pieces else len(self._opening)
            count += 1
        return count

    def _rest_after_opening(self, token_id: int) -> bytes:
        text = self._opening[: self._matched] + self._table.token_bytes[token_id]
        found = text.find(self._opening)
        return text[found + len(self._opening) :]

    def _static_banned(self) -> np.ndarray:
        """Tokens refused in this match state whatever the budget (a bool mask over the table; cached)."""
        key = (self._matched, self._marker_matched)
        banned = self._banned.get(key)
        if banned is not None:
            return banned
        table = self._table
        text = table.text_mask
        entering: list[tuple[int, int]] = []
        if self._block is not None and self._matched >= self._committed:
            # inside the tag: only its rest may follow (a completing token's tail is the block's)
            banned = np.ones_like(text)
            for _, ids in table.prefixes(self._opening, self._matched):
                banned[ids] = False
            banned[self._completing_tokens(self._matched)] = False
        else:
            banned = text & ~table.free_text_mask(self._marker, self._marker_matched)
            if self._block is not None:
                head = self._opening[: self._matched]
                for token_id in np.flatnonzero(banned).tolist():
                    grown = partial_match(head + table.token_bytes[token_id], self._opening)
                    if grown >= self._committed:  # writes the marker as the tag's: allowed (budget permitting)
                        banned[token_id] = False
                        entering.append((token_id, grown))
                banned[self._completing_tokens(self._matched)] = False
        self._banned[key] = banned
        self._entering[key] = entering
        return banned

    def allowed_mask(self, vocab_size: int) -> torch.Tensor | None:
        if self._in_block:
            return self._block.allowed_mask(vocab_size)
        static = self._static_banned()
        late = []
        if self._block is not None:
            late = [t for t in self._completing_tokens(self._matched)
                    if not self._block.fits_after(self._rest_after_opening(t), self._left - 1)]
            # enter the tag, or write more of it, only while its rest and a block can still be written
            if self._matched >= self._committed:
                growing = [(ids, self._matched + length) for length, ids in self._table.prefixes(self._opening,
                                                                                                  self._matched)]
            else:
                growing = [([t], grown) for t, grown in self._entering[(self._matched, self._marker_matched)]]
            late += [t for ids, grown in growing if grown < len(self._opening) and
                     not self._block.fits_after(b"", self._left - 1 - self._tokens_to_finish(grown)) for t in ids]
        if not late and not static.any():
            return None
        mask = np.ones(max(vocab_size, self._table.vocab_size), dtype=bool)
        mask[: self._table.vocab_size] &= ~static
        if self._block is not None and self._matched >= self._committed:
            mask[self._table.vocab_size :] = False
        if late:
            mask[np.asarray(late, dtype=np.int64)] = False
        return torch.from_numpy(mask[:vocab_size])

    def accept(self, token_id: int) -> None:
        self._left -= 1
        if self._in_block:
            self._block.accept(token_id)
            return
        data = self._table.token_bytes[token_id] if 0 <= token_id < self._table.vocab_size else b""
        text = self._opening[: self._matched] + data
        found = text.find(self._opening) if data else -1
        if found >= 0 and self._block is not None:
            self._in_block = True
            self._block.set_budget(self._left)
            self._block.feed(text[found + len(self._opening):])
            return
        self._matched = partial_match(text, self._opening) if data else 0
        marker_text = self._marker[: self._marker_matched] + data
        self._marker_matched = partial_match(marker_text, self._marker) if data else 0

    @property
    def in_block(self) -> bool:
        return self._in_block


def build_block_guard(tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, *,
                      spelling: DsmlSpelling = V4_SPELLING, max_tokens: int | None = None,
                      table: TokenTable | None = None) -> DsmlBlockGuard | None:
    """The guard for ``tool_choice`` "auto" (absent counts as auto) with tools, or "none"; None for
    a forced choice (see :func:`build_tool_constraint`) and for auto without tools."""
    if tool_choice not in (None, "auto", "none") or (tool_choice != "none" and not tools):
        return None
    table = table or token_table(tokenizer)
    opening = spelling.calls_open.encode()
    if tool_choice == "none":
        return DsmlBlockGuard(table, opening, None, max_tokens)
    functions = _declared_functions(tools, spelling)
    block = None
    if functions:
        block = GrammarConstraint(table, [_block_grammar(list(functions.values()), spelling)],
                                  close=spelling.parameter_close.encode())
    return DsmlBlockGuard(table, opening, block, max_tokens)
