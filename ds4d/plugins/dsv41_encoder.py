"""DeepSeek-V4.1 chat encoding: OpenAI messages -> the exact prompt text of the V4.1 release.

Byte-identical to the official V4.1 ``encoding.py`` for every input it accepts
(the vectors in ``tests/fixtures/dsv41_encoding.json`` pin this), for the same
reasons as V4 (:mod:`ds4d.plugins.dsv4_encoder`): the model behaves well only on
its own format, and the prefix cache keys on exact token ids.

Shape of a prompt::

    <｜begin▁of▁sentence｜><｜System｜>[Reasoning Effort: N (...)\\n\\n]SYSTEM[\\n\\n## Tools ...]
    <｜User｜>USER<｜Assistant｜><think>REASONING</think>CONTENT[\\n\\n<｜DSML｜ calls>...]<｜end▁of▁sentence｜>
    <｜System｜>LATER SYSTEM<｜Assistant｜><think>

What V4.1 changes against V4 (everything else -- tool results folded into user
turns, history reasoning dropped unless tools are declared, task tokens, the
latest reminder -- is V4's, and shares its code):

- DSML tags are spelt with a leading space (:data:`~ds4d.plugins.dsml_format.V41_SPELLING`).
- ``<｜System｜>`` opens the first message when it is a system message or when a
  reasoning-effort line is rendered, and opens every later system message; a
  later system message hands over to the assistant like a user turn and counts
  as the last user turn for dropping history reasoning.
- Thinking mode starts with ``Reasoning Effort: N (range 1-100, ...)``, N an
  integer 1-100 or a level: low 50, high 75 (the default), max 100 -- the
  release's table.  ds4d adds medium 62 (halfway between low and high, rounded
  down) and xhigh, an alias of max.  Chat mode renders no effort line.
- Tool names may be namespaced, ``ns::name``: a tool's ``namespace`` (a string,
  or ``{"name", "description"}`` whose description goes before the tool's own)
  qualifies its name in the schema, and a call's ``namespace`` (or a
  ``ns::name`` name) in the call's ``invoke`` tag.
- Image content parts render as ``<｜deepseek_image｜>``, one per image, as text
  parts of their own; a text that already holds the placeholder is refused.
  (A text-only model never gets here: the server refuses image parts first.)

Deliberate differences from the official encoder, all for inputs it rejects or
mangles: tool-call ``arguments`` that are empty render no parameters (as for
V4); ``content`` may be null; ``reasoning`` is accepted as an alias of
``reasoning_content``; role ``developer`` is treated as ``system`` (the official
encoder has no such role; OpenAI clients send it for reasoning models) and
``function`` as ``tool``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ds4d.contracts import ChatRenderRequest, ModelInfo, PluginContext, Tokenizer
from ds4d.plugins.dsml_format import THINK_END, THINK_START, V41_SPELLING
from ds4d.plugins.dsv4_encoder import (
    ASSISTANT,
    BOS,
    EOS,
    LATEST_REMINDER,
    TASK_TOKENS,
    USER,
    DeepseekV4ChatEncoder,
    drops_history_reasoning,
    merge_tool_results,
    system_extras,
    tool_function,
)

SYSTEM = "<｜System｜>"
IMAGE = "<｜deepseek_image｜>"
SPELLING = V41_SPELLING

EFFORT_LEVELS = {"low": 50, "medium": 62, "high": 75, "max": 100, "xhigh": 100}
"""Named reasoning efforts as V4.1 budgets (low/high/max from the release, medium/xhigh ds4d's)."""
DEFAULT_EFFORT = 75
EFFORT_LINE = "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

_ROLES = {"system", "developer", "user", "assistant", "tool", "function", "latest_reminder"}
_IMAGE_PARTS = ("image_url", "image")


def effort_budget(reasoning_effort: str | int | None) -> int:
    """The V4.1 budget (1-100) of a request's ``reasoning_effort``; ValueError if it has none."""
    if reasoning_effort is None:
        return DEFAULT_EFFORT
    if isinstance(reasoning_effort, int) and not isinstance(reasoning_effort, bool):
        if 1 <= reasoning_effort <= 100:
            return reasoning_effort
    elif isinstance(reasoning_effort, str) and reasoning_effort in EFFORT_LEVELS:
        return EFFORT_LEVELS[reasoning_effort]
    raise ValueError(
        f"reasoning_effort {reasoning_effort!r}: give one of {', '.join(EFFORT_LEVELS)} or an integer from 1 to 100"
    )


# --------------------------------------------------------------------------- normalising input


def _no_placeholder(text: str, where: str) -> str:
    if IMAGE in text:
        raise ValueError(f"{where} contains {IMAGE}; send images as image content parts")
    return text


def _parts(content: Any, *, keep_other: bool) -> list[str]:
    """``content`` as text parts: images become the placeholder; other non-text parts become
    ``[Unsupported <type>]`` (``keep_other``, a user turn's blocks) or are left out."""
    if content is None:
        return [""]
    if isinstance(content, str):
        return [_no_placeholder(content, "message content")]
    if not isinstance(content, Sequence):
        raise ValueError(f"unsupported message content of type {type(content).__name__}")
    parts = []
    for part in content:
        if not isinstance(part, Mapping):
            raise ValueError(f"unsupported content part {part!r}")
        kind = part.get("type", "text")
        if kind == "text":
            parts.append(_no_placeholder(str(part.get("text") or ""), "a text part"))
        elif kind in _IMAGE_PARTS:
            parts.append(IMAGE)
        elif keep_other:
            parts.append(f"[Unsupported {kind}]")
    return parts


def split_tool_name(name: str, namespace: str | None = None) -> tuple[str | None, str]:
    """``(namespace, bare name)`` of a possibly ``ns::name`` qualified tool name."""
    prefix, separator, bare = name.partition("::")
    if separator:
        if namespace not in (None, prefix):
            raise ValueError(f"tool {name!r} is in namespace {prefix!r}, not {namespace!r}")
        namespace, name = prefix, bare
    if "::" in name or (namespace is not None and "::" in namespace):
        raise ValueError(f"tool name {name!r} or namespace {namespace!r} holds more than one '::'")
    return namespace, name


def _qualified(name: str, namespace: str | None) -> str:
    namespace, name = split_tool_name(name, namespace)
    return name if namespace is None else f"{namespace}::{name}"


def _tool_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The function schema the model sees: name qualified by the tool's namespace, the
    namespace's description before the tool's own."""
    schema = dict(tool_function(tool))
    namespace = tool.get("namespace") if tool.get("namespace") is not None else schema.get("namespace")
    schema.pop("namespace", None)
    namespace_name = namespace.get("name") if isinstance(namespace, Mapping) else namespace
    schema["name"] = _qualified(str(schema.get("name")), namespace_name)
    if isinstance(namespace, Mapping) and namespace.get("description"):
        schema["description"] = namespace["description"] + "\n" + (schema.get("description") or "")
    return schema


def _call(call: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(qualified name, arguments)`` of an assistant tool call."""
    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call without a name: {call!r}")
    name = _qualified(name, call.get("namespace") or function.get("namespace"))
    raw = function.get("arguments")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return name, {}
    arguments = raw
    for _ in range(2):  # JSON text, possibly encoded twice
        if not isinstance(arguments, str):
            break
        try:
            arguments = json.loads(arguments)
        except ValueError:
            break
    if not isinstance(arguments, Mapping):
        return name, {"arguments": raw}
    return name, arguments


def _normalise(message: Mapping[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    if role not in _ROLES:
        raise ValueError(f"unsupported message role {role!r}")
    role = {"developer": "system", "function": "tool"}.get(role, role)
    out: dict[str, Any] = {"role": role, "content": "\n\n".join(_parts(message.get("content"), keep_other=role == "user"))}
    if role == "assistant":
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = message.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            reasoning = "".join(_parts(reasoning, keep_other=False))
        out["reasoning"] = None if reasoning is None else _no_placeholder(reasoning, "reasoning_content")
        out["tool_calls"] = [
            {"id": call.get("id") or (call.get("function") or {}).get("id") or "", "call": _call(call)}
            for call in (message.get("tool_calls") or ())
        ]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id") or ""
    if message.get("tools"):
        out["tools"] = [_tool_schema(tool) for tool in message["tools"]]
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


def _opens_user_turn(messages: Sequence[Mapping[str, Any]], index: int) -> bool:
    """A user turn, or a system message after the first: both hand over to the assistant."""
    role = messages[index]["role"]
    return role == "user" or (role == "system" and index > 0)


def _last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if _opens_user_turn(messages, index):
            return index
    return -1


def _drop_history_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant turns before the last user turn lose their reasoning (merged turns only have
    roles the official encoder keeps, so no turn is dropped)."""
    last_user = _last_user_index(messages)
    return [{**m, "reasoning": None} if m["role"] == "assistant" and i < last_user else m
            for i, m in enumerate(messages)]


# --------------------------------------------------------------------------- rendering


def _render_one(
    index: int,
    messages: Sequence[Mapping[str, Any]],
    thinking: bool,
    drop_thinking: bool,
    last_user: int,
    hand_over: bool,
    effort_line: str,
) -> str:
    message = messages[index]
    role = message["role"]
    text = SYSTEM + effort_line if index == 0 and (effort_line or role == "system") else ""
    if role == "system":
        text += (SYSTEM if index > 0 else "") + message["content"] + system_extras(message, SPELLING)
    elif role == "user":
        text += USER + "\n\n".join(
            block[2] if block[0] == "text" else f"<tool_result>{block[2]}</tool_result>" for block in message["blocks"]
        )
    elif role == "latest_reminder":
        text += LATEST_REMINDER + message["content"]
    else:  # assistant
        after_task = index > 0 and messages[index - 1].get("task") is not None
        if thinking and not after_task and (not drop_thinking or index > last_user):
            text += (message["reasoning"] or "") + THINK_END
        text += message["content"]
        if message["tool_calls"]:
            text += "\n\n" + SPELLING.render_calls([c["call"] for c in message["tool_calls"]])
        text += "" if message.get("wo_eos") else EOS

    if not hand_over:
        return text
    if index + 1 < len(messages) and messages[index + 1]["role"] not in ("assistant", "latest_reminder"):
        return text
    task = message.get("task")
    if task is not None:
        if task == "action":
            text += ASSISTANT + (THINK_START if thinking else THINK_END)
        text += TASK_TOKENS[task]
    elif _opens_user_turn(messages, index):
        opens_reasoning = thinking and (not drop_thinking or index >= last_user)
        text += ASSISTANT + (THINK_START if opens_reasoning else THINK_END)
    return text


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
    """Render OpenAI-style messages into DeepSeek-V4.1 prompt text.

    Arguments as for :func:`ds4d.plugins.dsv4_encoder.render_messages`;
    ``reasoning_effort`` is a level name or an integer 1-100 (:func:`effort_budget`).
    """
    if isinstance(thinking_mode, str):
        if thinking_mode not in ("thinking", "chat"):
            raise ValueError(f"thinking_mode must be 'thinking' or 'chat', not {thinking_mode!r}")
        thinking = thinking_mode == "thinking"
    else:
        thinking = bool(thinking_mode)
    budget = effort_budget(reasoning_effort)

    normalised = [_normalise(m) for m in messages]
    if tools:
        schemas = [_tool_schema(t) for t in tools]
        if normalised and normalised[0]["role"] == "system":
            normalised[0]["tools"] = list(normalised[0].get("tools") or ()) + schemas
        else:
            normalised.insert(0, {"role": "system", "content": "", "tools": schemas})

    turns = merge_tool_results(normalised)
    drop = drops_history_reasoning(turns, drop_thinking)
    if thinking and drop:
        turns = _drop_history_reasoning(turns)

    last_user = _last_user_index(turns)
    effort_line = EFFORT_LINE.format(budget=budget) if thinking else ""
    prompt = BOS if add_bos else ""
    for index in range(len(turns)):
        hand_over = add_generation_prompt or index + 1 < len(turns)
        prompt += _render_one(index, turns, thinking, drop, last_user, hand_over, effort_line)
    return prompt


# --------------------------------------------------------------------------- plugin


class DeepseekV41ChatEncoder(DeepseekV4ChatEncoder):
    """ChatEncoder plugin ``deepseek_v41``: :func:`render_messages` plus tokenization.

    Options as for ``deepseek_v4``; parsers ``deepseek_v41`` and ``dsml_v41`` read the output.
    Tokenization is the model's own tokenizer's; when
    it does not know ``<｜System｜>`` as one token (V4's tokenizer, used with this
    encoder before a V4.1 tokenizer is at hand) the text still renders exactly, the
    ids are not the model's, and a warning says so at start.
    """

    name = "deepseek_v41"
    reasoning_parser = "deepseek_v41"
    tool_parser = "dsml_v41"

    def __init__(
        self,
        ctx: PluginContext,
        options: Mapping[str, Any] | None,
        tokenizer: Tokenizer,
        model_info: ModelInfo | None = None,
    ) -> None:
        super().__init__(ctx, options, tokenizer, model_info)
        if len(tokenizer.encode(SYSTEM, add_special_tokens=False)) != 1:
            ctx.log.warning("chat encoder deepseek_v41: the tokenizer splits %s into several tokens; "
                            "prompts render as V4.1 text but are not tokenised as the V4.1 model was trained", SYSTEM)

    def render_text(self, request: ChatRenderRequest) -> str:
        return render_messages(
            request.messages,
            request.tools,
            self.resolve_thinking(request),
            self.resolve_drop_thinking(request),
            request.reasoning_effort,
            add_generation_prompt=request.add_generation_prompt,
        )
