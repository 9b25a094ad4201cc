"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per chunk,
ending with `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any], exclude: Any = None) -> bytes:
    """One event; `exclude` is pydantic's (a set of field names, or a nested dict)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=exclude)
    else:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + body.encode("utf-8") + b"\n\n"


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that always runs `on_close` once the
    response is over, whether the stream finished, failed, was cancelled by a
    client disconnect, or never started (the client left before the headers
    went out, so the body generator's own `finally` would never run)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                self._on_close()
