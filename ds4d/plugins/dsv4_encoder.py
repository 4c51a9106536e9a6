"""DeepSeek-V4 chat encoding: OpenAI messages -> the exact prompt text the model was trained on.

The output must be byte-identical to the official ``encoding_dsv4.py`` for every
input it accepts (the vectors under ``reference/dsv4/encoding/`` pin this), because
the model only behaves well on its own format and because the prefix cache keys
on exact token ids: an agent's next request must re-render the earlier turns to
the same bytes.

Shape of a prompt::

    <｜begin▁of▁sentence｜>[effort prefix]SYSTEM[\\n\\n## Tools ...]
    <｜User｜>USER<｜Assistant｜><think>REASONING</think>CONTENT[\\n\\n<｜DSML｜tool_calls>...]<｜end▁of▁sentence｜>
    <｜User｜><tool_result>...</tool_result><｜Assistant｜><think>

Rules worth knowing (all from the official encoder):

- There is no tool role: ``role: "tool"`` messages become ``<tool_result>`` blocks
  inside a user turn, sorted into the order of the assistant's calls (clients
  may answer parallel calls in any order).  Consecutive user messages merge into
  one turn, parts joined by a blank line.
- In thinking mode every user turn ends with ``<｜Assistant｜><think>`` and each
  assistant turn carries ``REASONING</think>``.  With ``drop_thinking`` (the
  default) reasoning before the last user turn is dropped and those turns end in
  ``</think>`` instead -- unless any tools are declared, in which case history
  reasoning is kept, so agent loops re-render byte-stable prompts.
- Chat mode ends every user turn with ``<｜Assistant｜></think>``.
- ``reasoning_effort="max"`` (thinking mode) puts a fixed instruction before the
  first message; every other effort value renders like none.  ds4d also gives
  that instruction for ``"xhigh"`` and the integer 100 (the top of the numeric
  scale V4.1 uses), so one request shape means the same on both models.
- A user message with ``task`` (quick-instruction classification) ends in that
  task's special token instead of the normal hand-over.

Thinking mode default: **on**.  Three of the four official vectors are thinking
mode, DeepSeek-V4 is tuned to reason before calling tools, and OpenCode sends no
switch of its own (it replays ``reasoning_content`` it is given).  A request picks
the mode with ``chat_template_kwargs.thinking`` (``ChatRenderRequest.thinking``);
the plugin option / config key ``thinking_default`` changes the default.

Deliberate differences from the official encoder, all for inputs it rejects or
mangles: tool-call ``arguments`` that are empty render no parameters (instead of
one parameter called ``arguments``); ``content`` may be null or a list of text
parts (non-text parts render as ``[Unsupported <type>]``, as the official encoder
does for tool results); ``reasoning`` is accepted as an alias of
``reasoning_content``; role ``function`` is treated like ``tool``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ds4d.contracts import (
    ChatRenderRequest,
    ModelInfo,
    PluginContext,
    RenderedPrompt,
    Tokenizer,
)
from ds4d.plugins.dsml_format import THINK_END, THINK_START, V4_SPELLING, DsmlSpelling, to_json
from ds4d.plugins.known_prefix import encode_prompt

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
SPELLING = V4_SPELLING
TOOL_CALLS_OPEN = SPELLING.calls_open
TOOL_CALLS_CLOSE = SPELLING.calls_close
INVOKE_OPEN_PREFIX = SPELLING.invoke_open_prefix
INVOKE_CLOSE = SPELLING.invoke_close
PARAMETER_OPEN_PREFIX = SPELLING.parameter_open_prefix
PARAMETER_CLOSE = SPELLING.parameter_close

TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

REASONING_EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

RESPONSE_FORMAT_SECTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

_ROLES = {"system", "developer", "user", "assistant", "tool", "latest_reminder"}
# Roles that survive drop_thinking before the last user turn (assistants lose reasoning).
_KEPT_BEFORE_LAST_USER = {"system", "user", "tool", "latest_reminder"}


# --------------------------------------------------------------------------- normalising input


def content_text(content: Any, separator: str = "\n\n") -> str:
    """OpenAI ``content`` (string, null, or a list of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                parts.append(str(part.get("text") or ""))
            elif isinstance(part, Mapping):
                parts.append(f"[Unsupported {part.get('type')}]")
            else:
                raise ValueError(f"unsupported content part {part!r}")
        return separator.join(parts)
    raise ValueError(f"unsupported message content of type {type(content).__name__}")


def tool_function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function schema of an OpenAI tool object (bare function schemas pass through)."""
    function = tool.get("function")
    if isinstance(function, Mapping):
        return function
    if "name" in tool:
        return tool
    raise ValueError(f"tool without a function definition: {tool!r}")


def _call_arguments(call: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call without a name: {call!r}")
    raw = function.get("arguments")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return name, {}
    if isinstance(raw, Mapping):
        return name, raw
    try:
        parsed = json.loads(raw)
    except (TypeError, ValueError):
        parsed = None
    if not isinstance(parsed, dict):
        return name, {"arguments": raw}
    return name, parsed


def _normalise(message: Mapping[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    if role == "function":
        role = "tool"
    if role not in _ROLES:
        raise ValueError(f"unsupported message role {role!r}")
    out: dict[str, Any] = {"role": role}
    out["content"] = content_text(message.get("content"), "" if role == "assistant" else "\n\n")
    if role == "assistant":
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = message.get("reasoning")
        out["reasoning"] = content_text(reasoning, "") if reasoning is not None else None
        out["tool_calls"] = [
            {"id": call.get("id") or "", "call": _call_arguments(call)} for call in (message.get("tool_calls") or ())
        ]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id") or ""
    if message.get("tools"):
        out["tools"] = [tool_function(tool) for tool in message["tools"]]
    if message.get("response_format"):
        out["response_format"] = message["response_format"]
    task = message.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"unknown task {task!r}; known: {sorted(TASK_TOKENS)}")
        out["task"] = task
    if message.get("wo_eos"):
        out["wo_eos"] = True
    return out


def merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold tool results and consecutive user messages into user turns made of blocks."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        last = merged[-1] if merged else None
        if role == "tool":
            block = ("tool_result", message["tool_call_id"], message["content"])
            if last is not None and last["role"] == "user":
                last["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = ("text", "", message["content"])
            if last is not None and last["role"] == "user" and last.get("task") is None:
                last["blocks"].append(block)
            else:
                turn = {"role": "user", "blocks": [block]}
                for key in ("task", "wo_eos"):
                    if key in message:
                        turn[key] = message[key]
                merged.append(turn)
        else:
            merged.append(dict(message))
    _sort_tool_results(merged)
    return merged


def _sort_tool_results(messages: list[dict[str, Any]]) -> None:
    """Put tool results in the order of the latest assistant's calls (stable for unknown ids)."""
    call_order: dict[str, int] = {}
    for message in messages:
        if message["role"] == "assistant" and message["tool_calls"]:
            call_order = {c["id"]: i for i, c in enumerate(message["tool_calls"]) if c["id"]}
        elif message["role"] == "user":
            results = [b for b in message["blocks"] if b[0] == "tool_result"]
            if len(results) > 1 and call_order:
                ordered = iter(sorted(results, key=lambda b: call_order.get(b[1], 0)))
                message["blocks"] = [next(ordered) if b[0] == "tool_result" else b for b in message["blocks"]]


def _last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index]["role"] in ("user", "developer"):
            return index
    return -1


def _drop_history_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last_user = _last_user_index(messages)
    kept = []
    for index, message in enumerate(messages):
        if message["role"] in _KEPT_BEFORE_LAST_USER or index >= last_user:
            kept.append(message)
        elif message["role"] == "assistant":
            kept.append({**message, "reasoning": None})
        # developer turns before the last user turn are dropped, as upstream does
    return kept


# --------------------------------------------------------------------------- rendering


def render_tools(functions: Sequence[Mapping[str, Any]]) -> str:
    return SPELLING.tools_section(functions)


def render_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """Assistant tool calls as a DSML block (without the leading blank line)."""
    return SPELLING.render_calls(calls)


def system_extras(message: Mapping[str, Any], spelling: DsmlSpelling = SPELLING) -> str:
    """What a system message adds after its text: the tools section, the response format."""
    text = ""
    if message.get("tools"):
        text += "\n\n" + spelling.tools_section(message["tools"])
    if message.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT_SECTION.format(schema=to_json(message["response_format"]))
    return text


def _render_one(
    index: int,
    messages: Sequence[Mapping[str, Any]],
    thinking: bool,
    drop_thinking: bool,
    last_user: int,
    hand_over: bool,
) -> str:
    message = messages[index]
    role = message["role"]
    if role == "system":
        text = message["content"] + system_extras(message)
    elif role == "developer":
        text = USER + message["content"] + system_extras(message)
    elif role == "user":
        text = USER + "\n\n".join(
            block[2] if block[0] == "text" else f"<tool_result>{block[2]}</tool_result>" for block in message["blocks"]
        )
    elif role == "latest_reminder":
        text = LATEST_REMINDER + message["content"]
    else:  # assistant
        after_task = index > 0 and messages[index - 1].get("task") is not None
        reasoning = ""
        if thinking and not after_task and (not drop_thinking or index > last_user):
            reasoning = (message["reasoning"] or "") + THINK_END
        calls = ""
        if message["tool_calls"]:
            calls = "\n\n" + render_tool_calls([c["call"] for c in message["tool_calls"]])
        text = reasoning + message["content"] + calls + ("" if message.get("wo_eos") else EOS)

    if not hand_over:
        return text
    if index + 1 < len(messages) and messages[index + 1]["role"] not in (
        "assistant",
        "latest_reminder",
    ):
        return text
    task = message.get("task")
    if task is not None:
        if task == "action":
            text += ASSISTANT + (THINK_START if thinking else THINK_END)
        text += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        opens_reasoning = thinking and (not drop_thinking or index >= last_user)
        text += ASSISTANT + (THINK_START if opens_reasoning else THINK_END)
    return text


def drops_history_reasoning(messages: Sequence[Mapping[str, Any]], drop_thinking: bool) -> bool:
    """Whether reasoning before the last user turn is left out: ``drop_thinking`` and no tools
    declared (``messages`` normalised, tools attached to a system message)."""
    return drop_thinking and not any(m.get("tools") for m in messages)


MAX_EFFORTS = ("max", "xhigh", 100)
"""Efforts that get the V4 maximum-effort instruction; V4 knows no other level."""


def effort_is_max(reasoning_effort: str | int | None) -> bool:
    return reasoning_effort in MAX_EFFORTS and not isinstance(reasoning_effort, bool)


def render_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking_mode: bool | str = True,
    drop_thinking: bool = True,
    reasoning_effort: str | int | None = None,
    *,
    add_generation_prompt: bool = True,
    add_bos: bool = True,
) -> str:
    """Render OpenAI-style messages into DeepSeek-V4 prompt text.

    ``thinking_mode`` is a bool or the official names ``"thinking"`` / ``"chat"``.
    ``tools`` (OpenAI tool objects) attach to a leading system message, or to an
    empty system message inserted first.  With ``add_generation_prompt=False`` the
    last message gets no hand-over to the assistant.
    """
    if isinstance(thinking_mode, str):
        if thinking_mode not in ("thinking", "chat"):
            raise ValueError(f"thinking_mode must be 'thinking' or 'chat', not {thinking_mode!r}")
        thinking = thinking_mode == "thinking"
    else:
        thinking = bool(thinking_mode)

    normalised = [_normalise(m) for m in messages]
    if tools:
        functions = [tool_function(t) for t in tools]
        if normalised and normalised[0]["role"] == "system":
            normalised[0]["tools"] = list(normalised[0].get("tools") or ()) + functions
        else:
            normalised.insert(0, {"role": "system", "content": "", "tools": functions})

    turns = merge_tool_results(normalised)
    drop = drops_history_reasoning(turns, drop_thinking)
    if thinking and drop:
        turns = _drop_history_reasoning(turns)

    last_user = _last_user_index(turns)
    prompt = BOS if add_bos else ""
    if turns and thinking and effort_is_max(reasoning_effort):
        prompt += REASONING_EFFORT_MAX_PREFIX
    for index in range(len(turns)):
        hand_over = add_generation_prompt or index + 1 < len(turns)
        prompt += _render_one(index, turns, thinking, drop, last_user, hand_over)
    return prompt


# --------------------------------------------------------------------------- plugin


def _optional_bool(value: Any) -> bool | None:
    if value is None:
        return None
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("thinking", "true", "1", "yes", "on"):
            return True
        if lowered in ("chat", "false", "0", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    return bool(value)


def _single_id(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class DeepseekV4ChatEncoder:
    """ChatEncoder plugin ``deepseek_v4``: :func:`render_messages` plus tokenization.

    Options: ``thinking_default`` (bool, falls back to ``config.thinking_default``,
    then True) and ``drop_thinking_default`` (bool, default True).
    """

    name = "deepseek_v4"
    reasoning_parser = "deepseek_v4"
    tool_parser = "dsml"

    def __init__(
        self,
        ctx: PluginContext,
        options: Mapping[str, Any] | None,
        tokenizer: Tokenizer,
        model_info: ModelInfo | None = None,
    ) -> None:
        options = options or {}
        self._ctx = ctx
        self._tokenizer = tokenizer
        self._model_info = model_info
        self.thinking_default = bool(options.get("thinking_default", getattr(ctx.config, "thinking_default", True)))
        self.drop_thinking_default = bool(options.get("drop_thinking_default", True))
        self._think_start_ids = tuple(tokenizer.encode(THINK_START, add_special_tokens=False))
        self._user_id = _single_id(tokenizer, USER)
        self._eos_id = _single_id(tokenizer, EOS)

    def resolve_thinking(self, request: ChatRenderRequest) -> bool:
        """Thinking mode for a request: explicit field, then template kwargs, then default."""
        if request.thinking is not None:
            return bool(request.thinking)
        kwargs = request.template_kwargs or {}
        for key in ("thinking", "enable_thinking", "thinking_mode"):
            value = _optional_bool(kwargs.get(key))
            if value is not None:
                return value
        return self.thinking_default

    def resolve_drop_thinking(self, request: ChatRenderRequest) -> bool:
        drop = request.drop_thinking
        if drop is None:
            drop = _optional_bool((request.template_kwargs or {}).get("drop_thinking"))
        return self.drop_thinking_default if drop is None else drop

    def render_text(self, request: ChatRenderRequest) -> str:
        return render_messages(
            request.messages,
            request.tools,
            self.resolve_thinking(request),
            self.resolve_drop_thinking(request),
            request.reasoning_effort,
            add_generation_prompt=request.add_generation_prompt,
        )

    def render(self, request: ChatRenderRequest) -> RenderedPrompt:
        text = self.render_text(request)
        ids, known = encode_prompt(self._tokenizer, text, request.known_prefix)
        token_ids = tuple(ids)
        return RenderedPrompt(
            text=text,
            token_ids=token_ids,
            prefix_tokens=known[0],
            prefix_chars=known[1],
            ends_in_reasoning=text.endswith(THINK_START),
            volatile_tail=self._volatile_tail(request, text, token_ids),
            **self._boundaries(token_ids),
        )

    def _boundaries(self, token_ids: tuple[int, ...]) -> dict[str, Any]:
        """Where messages begin (each ``<｜User｜>``, and after each ``<｜end▁of▁sentence｜>``), and
        where the system prompt and tools end: the first user message, when something precedes
        it beyond the BOS token.  Both markers are single special tokens, so the positions are
        exact (no merge across them)."""
        if self._user_id is None:
            return {}
        user, eos = self._user_id, self._eos_id
        starts = [i for i, t in enumerate(token_ids) if t == user and i > 0]
        starts += [i + 1 for i, t in enumerate(token_ids) if t == eos and i + 1 < len(token_ids)]
        starts = sorted(set(starts))
        stable = starts[0] if starts and starts[0] > 1 and token_ids[starts[0]] == user else 0
        return {"stable_prefix": stable, "message_starts": tuple(starts)}

    def _volatile_tail(self, request: ChatRenderRequest, text: str, token_ids: tuple[int, ...]) -> int:
        """The ``<think>`` that hands over to this turn's reasoning, when history reasoning is
        dropped: the next request renders this (then past) turn with ``</think>`` there."""
        tail = self._think_start_ids
        if not text.endswith(ASSISTANT + THINK_START) or token_ids[-len(tail):] != tail or request.tools:
            return 0
        return len(tail) if drops_history_reasoning(request.messages, self.resolve_drop_thinking(request)) else 0
