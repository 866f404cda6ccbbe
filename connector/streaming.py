"""Streamed responses carry ``kv_transfer_params`` too (what vLLM PR #40186 proposes).

vLLM 0.32 attaches the engine's ``kv_transfer_params`` only to non-streaming responses, so a
streaming agent's turns are never reused. This patch wraps the chat and completion stream
generators: it watches the engine outputs go by and, just before ``data: [DONE]``, emits one more
chunk with empty ``choices`` and the final ``kv_transfer_params`` (the shape the upstream example
proxy and llm-d read). Clients that ignore unknown fields are unaffected; the turnkv router strips
the field before anything reaches a client.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

DONE = "data: [DONE]\n\n"


class _Tap:
    """Pass engine outputs through, remembering the last ``kv_transfer_params`` seen."""

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source = source
        self.kv_transfer_params: dict[str, Any] | None = None

    def __aiter__(self) -> _Tap:
        return self

    async def __anext__(self) -> Any:
        item = await self._source.__anext__()
        output = item[1] if isinstance(item, tuple) else item
        params = getattr(output, "kv_transfer_params", None)
        if params:
            self.kv_transfer_params = params
        return item

    async def aclose(self) -> None:
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()


def final_chunk(request_id: str, object_type: str, model: str, params: dict[str, Any]) -> str:
    body = {"id": request_id, "object": object_type, "created": int(time.time()), "model": model,
            "choices": [], "kv_transfer_params": params}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _wrap(original: Callable[..., Any], object_type: str, model_arg: int) -> Callable[..., Any]:
    @functools.wraps(original)
    async def generator(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        args_list = list(args)
        # The engine-output iterator is the first positional argument after request for chat, and the
        # second (after the engine inputs) for completions.
        index = 0 if object_type == "chat.completion.chunk" else 1
        tap = _Tap(args_list[index])
        args_list[index] = tap
        request_id = args_list[index + 1]
        model = args_list[model_arg]
        async for chunk in original(self, request, *args_list, **kwargs):
            if chunk == DONE and tap.kv_transfer_params:
                yield final_chunk(request_id, object_type, model, tap.kv_transfer_params)
            yield chunk

    generator._turnkv_wrapped = True  # type: ignore[attr-defined]
    return generator


def apply() -> list[str]:
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except ImportError:  # an engine-core or worker process without the API server's modules
        return []
    applied = []
    chat = OpenAIServingChat.chat_completion_stream_generator
    if not getattr(chat, "_turnkv_wrapped", False):
        # (request, result_generator, request_id, model_name, ...)
        OpenAIServingChat.chat_completion_stream_generator = _wrap(chat, "chat.completion.chunk", 2)
        applied.append("stream-kv-params(chat)")
    completion = OpenAIServingCompletion.completion_stream_generator
    if not getattr(completion, "_turnkv_wrapped", False):
        # (request, engine_inputs, result_generator, request_id, created_time, model_name, ...)
        OpenAIServingCompletion.completion_stream_generator = _wrap(completion, "text_completion", 4)
        applied.append("stream-kv-params(completion)")
    return applied
