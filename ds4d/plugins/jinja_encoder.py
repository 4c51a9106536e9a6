"""Chat encoder that renders the model's own Jinja chat template.

Most checkpoints (every GGUF with ``tokenizer.chat_template``, every HF repo with a
``chat_template``) describe their chat format as a Jinja template written for the HF
``apply_chat_template`` conventions.  This encoder reproduces that environment so
such templates render byte-for-byte as they do there:

* a sandboxed, immutable Jinja environment with ``trim_blocks`` and ``lstrip_blocks``,
  the ``loopcontrols`` extension and a pass-through ``{% generation %}`` block;
* ``raise_exception(msg)`` and ``strftime_now(fmt)`` globals, a ``tojson`` filter that
  keeps non-ASCII text as is (``ensure_ascii=False``) and accepts ``indent``;
* variables ``messages``, ``tools`` (None when there are none), ``add_generation_prompt``,
  ``bos_token``, ``eos_token``, then the request's ``template_kwargs`` (which win).

OpenAI messages are adapted the way HF templates expect: content given as a list of
parts becomes one string (absent content becomes None), and tool-call ``arguments``
given as JSON text become a mapping (templates usually apply ``tojson`` to them).

The options table may set ``chat_template`` to override the checkpoint's template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ds4d.contracts import ChatRenderRequest, ModelInfo, PluginContext, RenderedPrompt, Tokenizer
from ds4d.plugins.known_prefix import encode_prompt

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Used when neither the checkpoint nor the options provide a template."""

REASONING_OPEN_TAGS = ("<think>", "<|channel|>analysis<|message|>")


class TemplateRenderError(ValueError):
    """The chat template refused the request (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateRenderError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker) renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def flatten_content(content: Any) -> Any:
    """OpenAI content parts -> one string; strings and None pass through."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type", "text") == "text":
                    texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
        return "".join(texts)
    return content


def _adapt_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    adapted = dict(call)
    function = call.get("function")
    if isinstance(function, Mapping):
        function = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                function["arguments"] = parsed
        adapted["function"] = function
    return adapted


def adapt_message(message: Mapping[str, Any]) -> dict[str, Any]:
    adapted = dict(message)
    adapted["content"] = flatten_content(adapted.get("content"))
    tool_calls = adapted.get("tool_calls")
    if tool_calls:
        adapted["tool_calls"] = [_adapt_tool_call(c) for c in tool_calls]
    return adapted


class JinjaChatEncoder:
    """``ChatEncoder`` named ``jinja``: the checkpoint's template, rendered HF-style."""

    name = "jinja"

    def __init__(
        self,
        ctx: PluginContext,
        options: Mapping[str, Any],
        tokenizer: Tokenizer,
        model_info: ModelInfo,
    ) -> None:
        self._log = ctx.log
        self._tokenizer = tokenizer
        source = options.get("chat_template") or model_info.chat_template
        if not source:
            self._log.warning("model %s has no chat template: using ChatML", model_info.name)
            source = CHATML_TEMPLATE
        self.template_source: str = source
        self._template = compile_template(source)
        self._special_tokens = {
            "bos_token": self._token_text(tokenizer, "bos_token", tokenizer.bos_token_id),
            "eos_token": self._token_text(tokenizer, "eos_token", self._primary_eos_id(tokenizer)),
        }

    @staticmethod
    def _primary_eos_id(tokenizer: Tokenizer) -> int | None:
        eos_id = getattr(tokenizer, "eos_token_id", None)
        if eos_id is None and tokenizer.eos_token_ids:
            eos_id = min(tokenizer.eos_token_ids)
        return eos_id

    @staticmethod
    def _token_text(tokenizer: Tokenizer, attr: str, token_id: int | None) -> str:
        text = getattr(tokenizer, attr, None)
        if text is None and token_id is not None:
            text = tokenizer.id_to_token(token_id)
        return text or ""

    def render_text(self, request: ChatRenderRequest) -> str:
        variables: dict[str, Any] = dict(self._special_tokens)
        variables["messages"] = [adapt_message(m) for m in request.messages]
        variables["tools"] = [dict(t) for t in request.tools] if request.tools else None
        variables["add_generation_prompt"] = request.add_generation_prompt
        if request.thinking is not None:
            variables["enable_thinking"] = request.thinking
            variables["thinking"] = request.thinking
        if request.reasoning_effort is not None:
            variables["reasoning_effort"] = request.reasoning_effort
        variables.update(request.template_kwargs)
        try:
            return self._template.render(**variables)
        except TemplateRenderError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TemplateRenderError(f"chat template failed: {exc}") from exc

    def render(self, request: ChatRenderRequest) -> RenderedPrompt:
        text = self.render_text(request)
        token_ids, known = encode_prompt(self._tokenizer, text, request.known_prefix)
        tail = text.rstrip()
        return RenderedPrompt(
            text=text,
            token_ids=tuple(token_ids),
            prefix_tokens=known[0],
            prefix_chars=known[1],
            ends_in_reasoning=any(tail.endswith(tag) for tag in REASONING_OPEN_TAGS),
        )
