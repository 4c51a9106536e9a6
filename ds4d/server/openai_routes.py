"""OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from aiohttp import web

from ds4d.contracts import (
    ChatRenderRequest,
    ConstrainingToolCallParser,
    KnownPrefix,
    RenderedPrompt,
    TokenConstraint,
    Tokenizer,
)
from ds4d.engine.client import EngineDead
from ds4d.engine.request import EngineRequest, SamplingParams, TokenLogprob
from ds4d.server.errors import ApiError, error_body, parse_json
from ds4d.server.generation import Generation
from ds4d.server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, _Sampling
from ds4d.server.sse import SseWriter
from ds4d.server.state import API_KEY, ServingState, serving_state

log = logging.getLogger("ds4d.requests")
routes = web.RouteTableDef()


def _state(request: web.Request) -> ServingState:
    return serving_state(request)


def _sampling(body: _Sampling, max_tokens: int, *, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        seed=body.seed,
        max_tokens=max_tokens,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


IMAGE_PARTS = ("image_url", "image", "input_image")


def _refuse_images(state: ServingState, messages: list) -> None:
    """A text-only model gets no image parts: a clear 400 rather than a prompt without the image."""
    if state.info.accepts_images:
        return
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                raise ApiError(400, f"{state.served_model_name} is a text-only model: messages[{i}].content[{j}] "
                               f"is an {part['type']} part", param=f"messages.{i}.content.{j}",
                               code="unsupported_content")


def _render(state: ServingState, messages: list, tools: list | None, kwargs: dict | None,
            effort: str | int | None, known_prefix: KnownPrefix | None = None) -> RenderedPrompt:
    _refuse_images(state, messages)
    kwargs = dict(kwargs or {})
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    drop = kwargs.get("drop_thinking")
    for key, value in (("thinking", thinking), ("drop_thinking", drop)):
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"chat_template_kwargs.{key} must be a boolean", param=f"chat_template_kwargs.{key}")
    req = ChatRenderRequest(
        messages=tuple(m.model_dump(exclude_none=True) for m in messages),
        tools=tuple(tools or ()),
        thinking=thinking, drop_thinking=drop, reasoning_effort=effort, template_kwargs=kwargs,
        known_prefix=known_prefix,
    )
    try:
        return state.encoder.render(req)
    except (ValueError, KeyError, TypeError) as exc:
        raise ApiError(400, f"cannot render the messages: {exc}", param="messages", code="invalid_messages") from None
    except Exception as exc:  # jinja2 errors raised by templates (raise_exception) land here
        if type(exc).__module__.startswith("jinja2"):
            raise ApiError(400, f"chat template error: {exc}", param="messages", code="invalid_messages") from None
        raise


def _logprob_entry(state: ServingState, lp: TokenLogprob) -> dict:
    def tok(i: int) -> str:
        return state.tokenizer.decode([i])

    text = tok(lp.token_id)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": tok(i), "logprob": v, "bytes": list(tok(i).encode())} for i, v in lp.top]}


def boundaries_within(rendered: RenderedPrompt, prompt_ids: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """The rendering's (``stable_prefix``, ``message_starts``) as far as ``prompt_ids`` still begin with its ids."""
    same = len(prompt_ids) if tuple(prompt_ids) == rendered.token_ids else next(
        (i for i, (a, b) in enumerate(zip(prompt_ids, rendered.token_ids)) if a != b), len(prompt_ids))
    return (rendered.stable_prefix * (rendered.stable_prefix <= same),
            tuple(p for p in rendered.message_starts if p <= same))


def _open(state: ServingState, request_id: str, prompt_ids: tuple[int, ...], params: SamplingParams, salt: str,
          rendered: RenderedPrompt | None = None):
    """Hand the request to the engine; ``rendered`` (chat) carries the prompt's volatile tail,
    kept only while the prompt still ends in those very tokens, and its message boundaries."""
    tail = rendered.volatile_tail if rendered is not None else 0
    if tail and tuple(prompt_ids[-tail:]) != rendered.token_ids[-tail:]:
        tail = 0
    stable, starts = boundaries_within(rendered, prompt_ids) if rendered is not None else (0, ())
    try:
        return state.client.submit(EngineRequest(request_id, prompt_ids, params, cache_salt=salt, volatile_tail=tail,
                                                 stable_prefix=stable, message_starts=starts))
    except EngineDead as exc:
        raise ApiError(503, f"the engine is not running: {exc}", type="server_error", code="engine_dead") from None


# --------------------------------------------------------------------------- chat


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = ChatCompletionRequest.model_validate(await parse_json(request))
    state.check_model(body.model)
    state.check_alive()
    salt = _salt(request, body)
    session = state.sessions.key(request.headers, salt)
    # an agent's next turn tokenises only what it adds to a remembered turn; a prompt that is not
    # one (0.2 s for 68K tokens) is rendered off the event loop, so other streams go on meanwhile
    rendered = await asyncio.to_thread(_render, state, body.messages, body.tools, body.chat_template_kwargs,
                                       body.reasoning_effort, state.sessions.prefix_finder(session))
    if rendered.prefix_tokens:
        prompt_ids = rendered.token_ids
        state.sessions.note_continued(rendered.prefix_tokens)
    else:
        prompt_ids = state.sessions.tokenize(session, rendered.text, rendered.token_ids).token_ids
    previous = state.sessions.closest(session, prompt_ids)
    max_tokens = state.output_budget(len(prompt_ids), body.output_limit())
    state.check_queue_room(len(prompt_ids))
    top = body.top_logprobs or 0
    params = _sampling(body, max_tokens, logprobs=top if body.logprobs else None, prompt_logprobs=None)
    forced = body.tool_choice not in FREE_TOOL_CHOICES
    constraint = await _tool_constraint(state, body, rendered, max_tokens, forced=forced)
    if constraint is not None:
        params = dataclasses.replace(params, constraint=constraint)
    request_id = state.new_id("chatcmpl")
    tools_stream = state.tools.stream(tools=body.tools or (), parallel_tool_calls=body.parallel_tool_calls) \
        if body.tools and body.tool_choice != "none" else None
    reasoning_stream = state.reasoning.stream(prompt_ends_in_reasoning=rendered.ends_in_reasoning)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]

    def finished(g: Generation) -> None:  # before the last chunk goes out: the agent's next turn may follow at once
        if state.client.capabilities.prefix_reuse:  # (when it is off, the startup log said why, once)
            state.sessions.explain(session, previous, request_id=request_id, messages=messages,
                                   prompt_ids=prompt_ids, cached_tokens=g.usage.cached_tokens,
                                   cache_note=g.cache_note, exact=state.client.capabilities.exact_reuse)
        state.sessions.remember(session, request_id, messages, rendered.text, prompt_ids, g.output_ids,
                                known=(rendered.prefix_tokens, rendered.prefix_chars))
        if g.tool_error:
            state.malformed_tool_calls_total += 1
            log.warning("%s: malformed tool-call markup returned as content: %s", request_id, g.tool_error)

    gen = Generation(_open(state, request_id, prompt_ids, params, salt, rendered), state.tokenizer,
                     prompt_tokens=len(prompt_ids), stops=[] if forced else body.stop_list(),
                     reasoning=reasoning_stream, tools=tools_stream, on_finish=finished)
    created = int(time.time())
    base = {"id": request_id, "created": created, "model": state.served_model_name}
    try:
        if body.stream:
            return await _chat_stream(request, state, body, gen, base)
        return await _chat_full(state, body, gen, base)
    finally:
        gen.stream.close()  # a client gone before the end (handler cancelled) aborts the request here


async def _chat_full(state: ServingState, body: ChatCompletionRequest, gen: Generation, base: dict) -> web.Response:
    reasoning, content, logprobs = [], [], []
    async for d in gen.deltas():
        reasoning.append(d.reasoning)
        content.append(d.content)
        logprobs.extend(d.logprobs)
    _raise_if_failed(gen)
    message: dict = {"role": "assistant", "content": "".join(content)}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if gen.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in gen.calls]
    choice = {"index": 0, "message": message, "finish_reason": gen.finish_reason,
              "logprobs": {"content": [_logprob_entry(state, lp) for lp in logprobs]} if body.logprobs else None}
    return web.json_response({**base, "object": "chat.completion", "choices": [choice], "usage": gen.usage.as_dict()})


async def _chat_stream(request: web.Request, state: ServingState, body: ChatCompletionRequest, gen: Generation,
                       base: dict) -> web.StreamResponse:
    sse = await SseWriter.start(request)
    chunk = {**base, "object": "chat.completion.chunk"}

    def choice(delta: dict, finish: str | None = None, logprobs: list | None = None) -> dict:
        c: dict = {"index": 0, "delta": delta, "finish_reason": finish}
        if body.logprobs:
            c["logprobs"] = {"content": [_logprob_entry(state, lp) for lp in logprobs or []]}
        return {**chunk, "choices": [c]}

    try:
        await sse.send(choice({"role": "assistant", "content": ""}))
        async for d in gen.deltas():
            if d.keepalive:
                await sse.comment("keepalive")
                continue
            delta: dict = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.content:
                delta["content"] = d.content
            if d.tool_calls:
                delta["tool_calls"] = [_tool_delta(t) for t in d.tool_calls]
            if delta or d.logprobs:
                await sse.send(choice(delta, logprobs=d.logprobs))
        if gen.error:
            await _send_error(sse, gen)
        else:
            await sse.send(choice({}, gen.finish_reason))
            if body.stream_options and body.stream_options.include_usage:
                await sse.send({**chunk, "choices": [], "usage": gen.usage.as_dict()})
        await sse.done()
    except ConnectionResetError:
        pass  # client went away; leaving the generator aborted the request
    return sse.response


FREE_TOOL_CHOICES = (None, "auto", "none")
"""``tool_choice`` values that leave the model free to call a tool or not."""


async def _tool_constraint(state: ServingState, body: ChatCompletionRequest, rendered: RenderedPrompt,
                           max_tokens: int, *, forced: bool) -> TokenConstraint | None:
    """The tool parser's constraint: ``tool_choice`` "required" or a named function forces one
    valid call; under auto and "none", ``tool_markup_guard`` keeps markup out of the content."""
    guard = state.config.tool_markup_guard
    parser = state.tools
    constraint = None
    if isinstance(parser, ConstrainingToolCallParser) and (forced or guard):
        try:  # the first call builds the tokenizer's byte table (about a second): keep it off the event loop
            constraint = await asyncio.to_thread(
                parser.constraint, state.tokenizer, tools=body.tools or (), tool_choice=body.tool_choice,
                prompt_ends_in_reasoning=rendered.ends_in_reasoning, max_tokens=max_tokens, guard_markup=guard)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tool_choice", code="invalid_tool_choice") from None
    if forced and constraint is None:
        raise ApiError(400, f"tool_choice {body.tool_choice!r} needs a tool parser that constrains decoding "
                       f"(the {parser.name!r} parser does not)", param="tool_choice", code="unsupported_tool_choice")
    return constraint


async def _send_error(sse: SseWriter, gen: Generation) -> None:
    """A stream that fails after its headers went out ends with an OpenAI error event, then [DONE]."""
    await sse.send(error_body(504 if gen.error_code == "timeout" else 500, gen.error or "generation failed",
                              "server_error", None, gen.error_code))


def _raise_if_failed(gen: Generation) -> None:
    if gen.error:
        status = 504 if gen.error_code == "timeout" else 500
        raise ApiError(status, gen.error, type="server_error", code=gen.error_code)


def _tool_delta(t) -> dict:
    d: dict = {"index": t.index}
    if t.id is not None:
        d["id"] = t.id
        d["type"] = "function"
    fn: dict = {}
    if t.name is not None:
        fn["name"] = t.name
    fn["arguments"] = t.arguments
    d["function"] = fn
    return d


def _salt(request: web.Request, body: _Sampling) -> str:
    key = request.get(API_KEY) or ""
    return f"{key}\x00{body.cache_salt or ''}" if (key or body.cache_salt) else ""


# --------------------------------------------------------------------------- completions


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = CompletionRequest.model_validate(await parse_json(request))
    state.check_model(body.model)
    state.check_alive()
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_ids = tuple(await asyncio.to_thread(state.tokenizer.encode, prompt, add_special_tokens=True))
        prompt_text = prompt
    else:
        bad = [t for t in prompt if not 0 <= t < state.info.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt", code="invalid_token")
        prompt_ids = tuple(prompt)
        prompt_text = state.tokenizer.decode(prompt_ids)
    if not prompt_ids:
        raise ApiError(400, "prompt is empty after tokenisation", param="prompt")
    scoring_only = body.max_tokens == 0
    max_tokens = state.output_budget(len(prompt_ids), 1 if scoring_only else body.max_tokens)
    state.check_queue_room(len(prompt_ids))
    want_prompt_lp = body.echo and body.logprobs is not None
    params = _sampling(body, max_tokens, logprobs=body.logprobs,
                       prompt_logprobs=(body.logprobs or 0) if want_prompt_lp else None)
    request_id = state.new_id("cmpl")
    gen = Generation(_open(state, request_id, prompt_ids, params, _salt(request, body)), state.tokenizer,
                     prompt_tokens=len(prompt_ids), stops=body.stop_list(), drop_output_tokens=scoring_only)
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": state.served_model_name}
    try:
        if body.stream:
            return await _completion_stream(request, body, gen, base, prompt_text)
        return await _completion_full(state, body, gen, base, prompt_ids, prompt_text, scoring_only)
    finally:
        gen.stream.close()  # a client gone before the end (handler cancelled) aborts the request here


async def _completion_full(state: ServingState, body: CompletionRequest, gen: Generation, base: dict,
                           prompt_ids: tuple[int, ...], prompt_text: str, scoring_only: bool) -> web.Response:
    text, lps, prompt_lps = [], [], []
    async for d in gen.deltas():
        text.append(d.content)
        lps.extend(d.logprobs)
        prompt_lps.extend(d.prompt_logprobs)
    _raise_if_failed(gen)
    out_text = "".join(text)
    logprobs = None
    if body.logprobs is not None:
        entries = (list(zip(prompt_ids, prompt_lps)) if body.echo else []) + [(lp.token_id, lp) for lp in lps]
        logprobs = _completion_logprobs(state.tokenizer, entries)
    choice = {"index": 0, "text": (prompt_text if body.echo else "") + out_text,
              "finish_reason": gen.finish_reason, "logprobs": logprobs}
    if scoring_only:
        gen.usage.completion_tokens = 0
    return web.json_response({**base, "choices": [choice], "usage": gen.usage.as_dict()})


def _completion_logprobs(tokenizer: Tokenizer, entries: list[tuple[int, TokenLogprob | None]]) -> dict:
    tokens, token_lps, tops, offsets, pos = [], [], [], [], 0
    for token_id, lp in entries:
        text = tokenizer.decode([token_id])
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {tokenizer.decode([i]): v for i, v in lp.top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _completion_stream(request: web.Request, body: CompletionRequest, gen: Generation, base: dict,
                             prompt_text: str) -> web.StreamResponse:
    sse = await SseWriter.start(request)
    try:
        if body.echo:
            await sse.send({**base, "choices": [{"index": 0, "text": prompt_text, "finish_reason": None,
                                                 "logprobs": None}]})
        async for d in gen.deltas():
            if d.keepalive:
                await sse.comment("keepalive")
            elif d.content:
                await sse.send({**base, "choices": [{"index": 0, "text": d.content, "finish_reason": None,
                                                     "logprobs": None}]})
        if gen.error:
            await _send_error(sse, gen)
        else:
            await sse.send({**base, "choices": [{"index": 0, "text": "", "finish_reason": gen.finish_reason,
                                                 "logprobs": None}]})
            if body.stream_options and body.stream_options.include_usage:
                await sse.send({**base, "choices": [], "usage": gen.usage.as_dict()})
        await sse.done()
    except ConnectionResetError:
        pass
    return sse.response


# --------------------------------------------------------------------------- models, tokenize


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    state = _state(request)
    return web.json_response({"object": "list", "data": [{
        "id": state.served_model_name, "object": "model", "created": int(state.started_at), "owned_by": "ds4d",
        "max_model_len": state.max_context_tokens}]})


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    state = _state(request)
    body = TokenizeRequest.model_validate(await parse_json(request))
    state.check_model(body.model)
    if body.messages is not None:
        rendered = await asyncio.to_thread(_render, state, body.messages, body.tools, body.chat_template_kwargs,
                                           body.reasoning_effort)
        ids, text = list(rendered.token_ids), rendered.text
    elif body.prompt is not None:
        ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        text = body.prompt
    else:
        raise ApiError(400, "give either prompt or messages", param="prompt")
    return web.json_response({"tokens": ids, "count": len(ids), "prompt": text,
                              "max_model_len": state.max_context_tokens})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    state = _state(request)
    body = DetokenizeRequest.model_validate(await parse_json(request))
    state.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < state.info.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens", code="invalid_token")
    return web.json_response({"prompt": state.tokenizer.decode(body.tokens)})

