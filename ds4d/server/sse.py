"""Server-sent events: headers go out at once, then JSON chunks, comments, [DONE]."""

from __future__ import annotations

import json

from aiohttp import web


class SseWriter:
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def start(cls, request: web.Request) -> "SseWriter":
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await response.prepare(request)
        return cls(response)

    async def send(self, obj: object) -> None:
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())

    async def comment(self, text: str) -> None:
        await self.response.write(f": {text}\n\n".encode())

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
