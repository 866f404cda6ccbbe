"""One benchmark request: an OpenAI chat completion, streamed, timed to the first content token."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson

from turnkv import wire


@dataclass(kw_only=True)
class Reply:
    """What one request measured: the fields every benchmark's record shares (``Result``, ``agent_bench.Record``),
    filled by :func:`chat`."""

    ttft_ms: float | None = None
    latency_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: Prompt tokens prefill pulled from decode (the router's X-TurnKV-Reused-Tokens).
    reused_tokens: int = 0
    #: Prompt tokens prefill found in its own prefix cache (the router's X-TurnKV-Prefill-Cached-Tokens).
    prefill_cached_tokens: int = 0
    reuse_outcome: str = ""
    reply: str = ""
    reply_sha: str = ""
    error: str | None = None


@dataclass
class Result(Reply):
    """One turn of a conversation benchmark (bench.runner, capacity, pressure)."""

    conversation: int
    turn: int
    arm: str

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("reply")
        return data


#: The router's headers (turnkv.wire); a router that does not send one reads as 0 / "".
REUSED_TOKENS_HEADER = wire.REUSED_TOKENS_HEADER
REUSE_OUTCOME_HEADER = wire.REUSE_OUTCOME_HEADER
PREFILL_CACHED_HEADER = wire.PREFILL_CACHED_HEADER
#: The headers of a request with reuse switched off.
REUSE_OFF_HEADERS = {wire.REUSE_HEADER: wire.REUSE_OFF}


def int_header(headers: Any, name: str) -> int:
    """A router's count header as an int (0 when absent or not a number)."""
    try:
        return int(headers.get(name, 0) or 0)
    except ValueError:
        return 0


async def chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
               result: Reply, timeout: float) -> Reply:
    """POST a streaming chat completion and fill ``result`` (any :class:`Reply`; errors are recorded, not
    raised)."""
    started = time.perf_counter()
    parts: list[str] = []
    try:
        async with session.post(url.rstrip("/") + "/v1/chat/completions", data=orjson.dumps(body),
                                headers={"Content-Type": "application/json", **headers},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            result.reused_tokens = int_header(resp.headers, REUSED_TOKENS_HEADER)
            result.prefill_cached_tokens = int_header(resp.headers, PREFILL_CACHED_HEADER)
            result.reuse_outcome = resp.headers.get(REUSE_OUTCOME_HEADER, "")
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    break
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if result.ttft_ms is None:
                            result.ttft_ms = (time.perf_counter() - started) * 1000
                        parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.completion_tokens = usage.get("completion_tokens")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.latency_ms = (time.perf_counter() - started) * 1000
    result.reply = "".join(parts)
    result.reply_sha = hashlib.sha256(result.reply.encode()).hexdigest()[:16]
    if result.error is None and result.ttft_ms is None:
        result.error = "no content token in the stream"
    return result
