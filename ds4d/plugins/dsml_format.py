"""DSML, DeepSeek's tool-call markup, in the two spellings the models were trained on.

A tool-call block is the same tree in DeepSeek-V4 and V4.1; only the tag names
differ (V4.1's have a leading space)::

    V4                                   V4.1
    <｜DSML｜tool_calls>                 <｜DSML｜ calls>
    <｜DSML｜invoke name="f">            <｜DSML｜ invoke name="f">
    <｜DSML｜parameter name="p" ...>v</｜DSML｜parameter>
                                         <｜DSML｜ parameter name="p" ...>v</｜DSML｜ parameter>
    </｜DSML｜invoke>                    </｜DSML｜ invoke>
    </｜DSML｜tool_calls>                </｜DSML｜ calls>

A :class:`DsmlSpelling` holds one spelling; the encoders render assistant calls
and the tools section of the system prompt through it, the streaming parser and
the constrained decoder match against it, so the four always agree on the bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

DSML = "｜DSML｜"
THINK_START = "<think>"
THINK_END = "</think>"


def partial_suffix_length(text: str, markers: Sequence[str], start: int = 0, max_newlines: int = 0) -> int:
    """Length of the longest suffix of ``text[start:]`` that may still grow into a marker.

    The suffix is up to ``max_newlines`` newlines followed by a proper prefix of one
    of ``markers`` (newlines alone count when ``max_newlines`` > 0).
    """
    end = len(text)
    longest = max(len(m) for m in markers) - 1 + max_newlines
    for cut in range(max(start, end - longest), end):
        tail = text[cut:]
        core = tail.lstrip("\n")
        if len(tail) - len(core) > max_newlines:
            continue
        if not core or any(len(core) < len(m) and m.startswith(core) for m in markers):
            return end - cut
    return 0


def to_json(value: Any) -> str:
    """JSON as the official encoders write it (``", "``/``": "`` separators, UTF-8 kept)."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class DsmlSpelling:
    """The tag names of one DSML spelling (``block`` wraps the calls of one turn), and whether
    its tool names carry namespaces."""

    block: str
    invoke: str
    parameter: str
    namespaces: bool = False
    """Tool names may be namespaced, ``ns::name`` (V4.1)."""

    @property
    def calls_open(self) -> str:
        return f"<{DSML}{self.block}>"

    @property
    def calls_close(self) -> str:
        return f"</{DSML}{self.block}>"

    @property
    def invoke_open_prefix(self) -> str:
        return f"<{DSML}{self.invoke}"

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def parameter_open_prefix(self) -> str:
        return f"<{DSML}{self.parameter}"

    @property
    def parameter_close(self) -> str:
        return f"</{DSML}{self.parameter}>"

    def invoke_open(self, name: str) -> str:
        return f'{self.invoke_open_prefix} name="{name}">'

    def parameter_open(self, name: str, is_string: bool) -> str:
        return f'{self.parameter_open_prefix} name="{name}" string="{"true" if is_string else "false"}">'

    @cached_property
    def invoke_tag(self) -> re.Pattern[str]:
        """An invoke opening tag, group 1 the tool name (the parser is lenient on blanks)."""
        return re.compile(re.escape(self.invoke_open_prefix) + r'\s+name="([^"<>]+)"\s*>')

    @cached_property
    def parameter_tag(self) -> re.Pattern[str]:
        """A parameter opening tag: group 1 the name, group 2 ``true``/``false`` (optional)."""
        return re.compile(re.escape(self.parameter_open_prefix) + r'\s+name="([^"<>]+)"(?:\s+string="(true|false)")?\s*>')

    def render_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        """Assistant tool calls ``(name, arguments)`` as one block (without the blank line before it)."""
        invokes = []
        for name, arguments in calls:
            params = []
            for key, value in arguments.items():
                is_string = isinstance(value, str)
                params.append(self.parameter_open(key, is_string) + (value if is_string else to_json(value))
                              + self.parameter_close)
            invokes.append(self.invoke_open(name) + "\n" + "\n".join(params) + "\n" + self.invoke_close)
        return self.calls_open + "\n" + "\n".join(invokes) + "\n" + self.calls_close

    def tools_section(self, functions: Sequence[Mapping[str, Any]]) -> str:
        """The ``## Tools`` part of a system prompt declaring ``functions`` (JSON schemas)."""
        example = "\n".join((
            self.calls_open,
            self.invoke_open("$TOOL_NAME"),
            self.parameter_open_prefix + ' name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
            + self.parameter_close,
            "...",
            self.invoke_close,
            self.invoke_open("$TOOL_NAME2"),
            "...",
            self.invoke_close,
            self.calls_close,
        ))
        schemas = "\n".join(to_json(f) for f in functions)
        return (
            "## Tools\n\n"
            "You have access to a set of tools to help answer the user's question. "
            f'You can invoke tools by writing a "{self.calls_open}" block like the following:\n\n'
            f"{example}\n\n"
            "String parameters should be specified as is and set `string=\"true\"`. For all other types "
            "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
            f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning "
            f"inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
            f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
            "### Available Tool Schemas\n\n"
            f"{schemas}\n\n"
            "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
        )


V4_SPELLING = DsmlSpelling(block="tool_calls", invoke="invoke", parameter="parameter")
V41_SPELLING = DsmlSpelling(block=" calls", invoke=" invoke", parameter=" parameter", namespaces=True)
