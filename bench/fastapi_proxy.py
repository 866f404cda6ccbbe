"""Baseline: a plain FastAPI + httpx P/D proxy in the style of vLLM's disaggregated-serving example
(``toy_proxy_server.py``): prefill with ``max_tokens=1`` and ``do_remote_decode``, then decode with the
returned ``kv_transfer_params``, streamed back with ``StreamingResponse``. No reuse, no retries.

Run: ``PREFILL=http://127.0.0.1:28100 DECODE=http://127.0.0.1:28200 uvicorn bench.fastapi_proxy:app --port 28002``.
"""

from __future__ import annotations

import itertools
import os
import uuid
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from turnkv import wire

PREFILL = os.environ.get("PREFILL", "http://127.0.0.1:28100").split(",")
DECODE = os.environ.get("DECODE", "http://127.0.0.1:28200").split(",")
_p, _d = itertools.cycle(PREFILL), itertools.cycle(DECODE)
clients: dict[str, httpx.AsyncClient] = {}


@asynccontextmanager
async def lifespan(app: FastAPI):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients["c"] = httpx.AsyncClient(timeout=None, limits=limits)
    yield
    await clients["c"].aclose()


app = FastAPI(lifespan=lifespan)


async def _handle(request: Request, path: str):
    body = await request.json()
    headers = {"X-Request-Id": str(uuid.uuid4())}
    client = clients["c"]
    prefill_body = dict(body, max_tokens=1, stream=False,
                        kv_transfer_params={wire.DO_REMOTE_DECODE: True, wire.DO_REMOTE_PREFILL: False,
                                            wire.REMOTE_ENGINE_ID: None, wire.REMOTE_BLOCK_IDS: None,
                                            wire.REMOTE_HOST: None, wire.REMOTE_PORT: None})
    prefill_body.pop("stream_options", None)
    resp = await client.post(next(_p) + path, json=prefill_body, headers=headers)
    resp.raise_for_status()
    decode_body = dict(body, kv_transfer_params=resp.json().get("kv_transfer_params"))
    url = next(_d) + path
    if not body.get("stream"):
        r = await client.post(url, json=decode_body, headers=headers)
        return JSONResponse(r.json(), status_code=r.status_code)

    async def generate():
        async with client.stream("POST", url, json=decode_body, headers=headers) as r:
            async for chunk in r.aiter_bytes():
                yield chunk

    return StreamingResponse(generate(), media_type="text/event-stream")


@app.post("/v1/chat/completions")
async def chat(request: Request):
    return await _handle(request, "/v1/chat/completions")


@app.post("/v1/completions")
async def completions(request: Request):
    return await _handle(request, "/v1/completions")


@app.get("/health")
async def health():
    return {"status": "ok"}
