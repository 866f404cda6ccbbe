"""A fake OpenAI/vLLM engine that answers instantly: the P/D wire protocol without a model.

It plays both roles of the NIXL protocol (kv-protocol.md):
- prefill (``kv_transfer_params.do_remote_decode``): a non-streaming one-token answer whose
  ``kv_transfer_params`` point at itself (pull) or carry its identity (push, ``transfer_mode: push``);
  given a decode engine's stored params, it reports ``remote_prefill_cached_tokens`` as a real engine does;
- decode: ``max_tokens`` tokens, streamed (SSE) or not, and, bi-directional, its own params at the end
  (the final SSE chunk, as turnkv's connector does, or the unary body).

Faults for tests and the fault-and-load script: ``POST /fault`` with ``{"status": 500}`` (answer with that
status), ``{"hang": true}`` (never answer), ``{"die_after_first": true}`` (decode: close the stream after its
first token), ``{"delay": 0.05}`` (seconds before the first token), ``{}`` to clear. ``GET /stats`` returns
counters, including requests aborted by a client that went away. Several engines can run in one process
(``serve_many``). Run: ``python -m bench.fake_engine --port 28100 --role prefill``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta")


@dataclass
class FakeEngine:
    port: int
    role: str = "both"
    engine_id: str = ""
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    mode: str = "pull"
    bidirectional: bool = True
    expiry_ttl: float = 480.0
    fault: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=lambda: {"requests": 0, "prefill": 0, "decode": 0, "running": 0,
                                                           "aborted": 0, "pulled": 0, "errors": 0,
                                                           "wrong_reuse": 0})
    seen_request_ids: list[str] = field(default_factory=list)
    seen_params: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine_id = self.engine_id or f"fake-{self.port}"
        self.side_channel_port = self.side_channel_port or self.port + 1000
        self._ids = itertools.count()

    # -- protocol ---------------------------------------------------------------------------------

    def _prefill_params(self, request_id: str, tokens: int) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[next(self._ids)]],
                "remote_engine_id": self.engine_id, "remote_request_id": request_id, "remote_host": self.host,
                "remote_port": self.side_channel_port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": tokens, "remote_blocks_expiry_time": None, "transfer_mode": self.mode}

    def _decode_params(self, request_id: str, tokens: int) -> dict[str, Any]:
        return {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[next(self._ids)]],
                "remote_engine_id": self.engine_id, "remote_request_id": request_id, "remote_host": self.host,
                "remote_port": self.side_channel_port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": tokens, "remote_blocks_expiry_time": time.time() + self.expiry_ttl,
                "transfer_mode": "pull"}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.stats["requests"] += 1
        self.stats["running"] += 1
        try:
            return await self._answer(request)
        except asyncio.CancelledError:
            self.stats["aborted"] += 1
            raise
        finally:
            self.stats["running"] -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        request_id = request.headers.get("X-Request-Id", "req")
        self.seen_request_ids.append(request_id)
        kv = body.get("kv_transfer_params")
        self.seen_params.append(kv)
        del self.seen_request_ids[:-1000], self.seen_params[:-1000]
        fault = self.fault
        if fault.get("hang"):
            await asyncio.sleep(3600)
        if fault.get("status"):
            self.stats["errors"] += 1
            return web.json_response({"error": {"message": "injected fault", "code": fault["status"]}},
                                     status=int(fault["status"]))
        if fault.get("delay"):
            await asyncio.sleep(float(fault["delay"]))
        chat = request.path.endswith("chat/completions")
        prompt = body.get("messages") if chat else body.get("prompt")
        prompt_tokens = max(1, len(orjson.dumps(prompt)) // 4)
        created = int(time.time())
        if isinstance(kv, dict) and kv.get("do_remote_decode"):  # prefill leg
            self.stats["prefill"] += 1
            params = self._prefill_params(request_id, prompt_tokens)
            if kv.get("remote_block_ids"):  # a pull of the previous turn's KV from a decode engine
                # decode wrote its request id into its reply: the history must contain the reply whose KV is pulled
                if f"rid-{kv.get('remote_request_id')} " not in orjson.dumps(prompt).decode():
                    self.stats["wrong_reuse"] += 1
                cached = max(0, min(int(kv.get("remote_num_tokens") or 0), prompt_tokens) - 1)
                params["remote_prefill_cached_tokens"] = cached
                self.stats["pulled"] += cached
            choice = ({"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": "x", "finish_reason": "length"})
            return web.Response(body=orjson.dumps({
                "id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": body.get("model", "fake"), "choices": [choice], "kv_transfer_params": params,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                          "total_tokens": prompt_tokens + 1}}), content_type="application/json")
        self.stats["decode"] += 1
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        words = [f"rid-{request_id} "] + [WORDS[i % len(WORDS)] + " " for i in range(1, n)]
        out_params = self._decode_params(request_id, prompt_tokens + n) if self.bidirectional and kv else None
        if not body.get("stream"):
            message = ({"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                        "finish_reason": "length"} if chat else
                       {"index": 0, "text": "".join(words), "finish_reason": "length"})
            result: dict[str, Any] = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": body.get("model", "fake"), "choices": [message],
                                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                "total_tokens": prompt_tokens + n}}
            if out_params:
                result["kv_transfer_params"] = out_params
            return web.Response(body=orjson.dumps(result), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": body.get("model", "fake")}
        parts = []
        for i, word in enumerate(words):
            if chat:
                choice = {"index": 0, "delta": ({"role": "assistant", "content": word} if i == 0 else
                                                {"content": word}), "finish_reason": None}
            else:
                choice = {"index": 0, "text": word, "finish_reason": None}
            parts.append(b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n")
            if i == 0 and fault.get("die_after_first"):
                await response.write(parts[0])
                await asyncio.sleep(0.01)
                request.transport.close()  # type: ignore[union-attr]
                return response
            if fault.get("token_delay"):
                await response.write(b"".join(parts))
                parts.clear()
                await asyncio.sleep(float(fault["token_delay"]))
        if out_params:
            parts.append(b"data: " + orjson.dumps({**head, "choices": [], "kv_transfer_params": out_params})
                         + b"\n\n")
        parts.append(b"data: [DONE]\n\n")
        await response.write(b"".join(parts))
        await response.write_eof()
        return response

    # -- app --------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)

        async def health(_: web.Request) -> web.Response:
            if self.fault.get("unhealthy"):
                return web.Response(status=503)
            return web.Response(text="")

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        async def set_fault(request: web.Request) -> web.Response:
            self.fault = orjson.loads(await request.read() or b"{}")
            return web.json_response(self.fault)

        async def stats(_: web.Request) -> web.Response:
            return web.json_response(self.stats)

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=f"vllm:num_requests_running {self.stats['running']}\n"
                                     f"fake:aborted_total {self.stats['aborted']}\n")

        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/fault", set_fault)
        app.router.add_get("/stats", stats)
        app.router.add_get("/metrics", metrics)
        return app


async def start(engines: list[FakeEngine]) -> list[web.AppRunner]:
    runners = []
    for engine in engines:
        runner = web.AppRunner(engine.app(), access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, engine.host, engine.port, backlog=4096).start()
        runners.append(runner)
    return runners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, action="append", required=True, help="repeatable: one engine per port")
    parser.add_argument("--mode", default="pull", choices=("pull", "push"))
    parser.add_argument("--no-bidirectional", action="store_true")
    args = parser.parse_args()
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()

    async def run() -> None:
        engines = [FakeEngine(p, mode=args.mode, bidirectional=not args.no_bidirectional) for p in args.port]
        await start(engines)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
