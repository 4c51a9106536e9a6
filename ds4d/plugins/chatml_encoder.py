"""ChatML chat encoding (``<|im_start|>role ... <|im_end|>``), with tools.

For checkpoints trained on ChatML (SmolLM2, Qwen, many fine-tunes) whose chat
template is missing or cannot be trusted.  Every message becomes one turn::

    <|im_start|>ROLE
    CONTENT<|im_end|>

followed by ``<|im_start|>assistant\\n`` when a reply is wanted.  Roles are kept
(``system``, ``user``, ``assistant``, ``tool``), except that ``developer`` renders
as ``system`` and ``function`` as ``tool``.  Consecutive messages of one role stay
separate turns; content given as a list of parts is joined (text parts only,
others as ``[Unsupported <type>]``); null content is empty.

Tools use the widespread Hermes convention, so a ChatML model that knows tools at
all most likely knows this one.  They are described at the end of the system
turn (a system turn holding only the description is added first when the
request has no system message)::

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {...}}
    </tools>

    For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

An assistant message's ``tool_calls`` render after its content, each as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` on its own line
(JSON with ``", "`` and ``": "`` separators, non-ASCII kept), and a ``tool``
message's content is the turn's text.  Reasoning (``reasoning_content``) of
earlier assistant turns is not rendered: ChatML has no place for it.

Rendering depends only on the messages and tools, so an agent's next request
re-renders its earlier turns to the same bytes and reuses the prefix cache.

Options: ``default_system`` (text of a system turn to add when the request has
none; default: none added) and ``add_bos`` (prepend the tokenizer's BOS id;
default false, as ChatML templates do not).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ds4d.contracts import ChatRenderRequest, ModelInfo, PluginContext, RenderedPrompt, Tokenizer
from ds4d.plugins.dsv4_encoder import content_text
from ds4d.plugins.known_prefix import encode_prompt

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
               "tool": "tool", "function": "tool"}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def message_text(content: Any) -> str:
    """OpenAI ``content`` (string, null or a list of parts) as one string, parts joined directly."""
    return content_text(content, "")

def _tool_object(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """An OpenAI tool object (a bare function schema is wrapped as one)."""
    if isinstance(tool.get("function"), Mapping):
        return tool
    if "name" in tool:
        return {"type": "function", "function": tool}
    raise ValueError(f"tool without a function definition: {tool!r}")


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    return TOOLS_SECTION.format(tools="\n".join(_json(_tool_object(t)) for t in tools))


def render_tool_call(call: Mapping[str, Any]) -> str:
    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call without a name: {call!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # not JSON: kept as the string it is
    elif arguments is None:
        arguments = {}
    return f"<tool_call>\n{_json({'name': name, 'arguments': arguments})}\n</tool_call>"


def _turn(role: str, text: str) -> str:
    return f"{IM_START}{role}\n{text}{IM_END}\n"


def render_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (), *,
                    add_generation_prompt: bool = True, default_system: str | None = None) -> str:
    """ChatML text for OpenAI-style ``messages`` and ``tools`` (see the module docstring)."""
    turns: list[tuple[str, str]] = []
    for message in messages:
        role = _ROLE_NAMES.get(message.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ValueError(f"unsupported message role {message.get('role')!r}")
        text = message_text(message.get("content"))
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(render_tool_call(c) for c in message["tool_calls"])
            text = f"{text}\n{calls}" if text else calls
        turns.append((role, text))
    if (not turns or turns[0][0] != "system") and (default_system is not None or tools):
        turns.insert(0, ("system", default_system or ""))
    if tools:
        system = turns[0][1]
        turns[0] = ("system", (system + "\n\n" if system else "") + render_tools(tools))
    text = "".join(_turn(role, body) for role, body in turns)
    if add_generation_prompt:
        text += f"{IM_START}assistant\n"
    return text


class ChatMLEncoder:
    """ChatEncoder plugin ``chatml`` (see the module docstring for the format and options)."""

    name = "chatml"

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None, tokenizer: Tokenizer,
                 model_info: ModelInfo | None = None) -> None:
        options = options or {}
        self._tokenizer = tokenizer
        default_system = options.get("default_system")
        self.default_system: str | None = None if default_system is None else str(default_system)
        self.add_bos = bool(options.get("add_bos", False)) and tokenizer.bos_token_id is not None
        for marker in (IM_START, IM_END):
            if tokenizer.token_to_id(marker) is None:
                ctx.log.warning("chatml encoder: %s is not a token of this vocabulary; it is encoded as text",
                                marker)

    def render(self, request: ChatRenderRequest) -> RenderedPrompt:
        text = render_messages(request.messages, request.tools, add_generation_prompt=request.add_generation_prompt,
                               default_system=self.default_system)
        ids, known = encode_prompt(self._tokenizer, text, request.known_prefix)
        if self.add_bos and not known[0]:  # a known prefix starts with the BOS it was given
            ids = [self._tokenizer.bos_token_id, *ids]  # type: ignore[list-item]
        return RenderedPrompt(text=text, token_ids=tuple(ids), ends_in_reasoning=False, prefix_tokens=known[0],
                              prefix_chars=known[1])
