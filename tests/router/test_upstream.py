"""The engine legs' HTTP client (router.upstream) against real servers on loopback: aiohttp for answers vLLM's
uvicorn gives, raw asyncio servers for what a dying or misbehaving engine does."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from router import upstream
from tests.conftest import free_port


async def serve(app: web.Application) -> tuple[str, web.AppRunner]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


def echo_app(seen: list) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.copy(), await request.read(), request.transport))
        return web.json_response({"ok": True, "n": len(seen)})

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(int(request.query.get("events", "3"))):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(float(request.query.get("gap", "0")))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/echo", echo)
    app.router.add_post("/v1/stream", stream)
    return app


async def test_a_json_answer_then_the_connection_is_reused():
    seen: list = []
    url, runner = await serve(echo_app(seen))
    client = upstream.LegClient()
    try:
        for n in (1, 2):
            resp = await client.post(url, "/v1/echo", b'{"a": 1}', {"X-Request-Id": f"leg-{n}",
                                                                   "Content-Type": "application/json"})
            assert resp.status == 200 and await resp.read() == f'{{"ok": true, "n": {n}}}'.encode()
            resp.release()
        (path, headers, body, first), (_, _, _, second) = seen
        assert path == "/v1/echo" and body == b'{"a": 1}' and headers["X-Request-Id"] == "leg-1"
        assert first is second  # one keep-alive connection for both legs
    finally:
        client.close()
        await runner.cleanup()


async def test_a_body_in_parts_arrives_as_one_body():
    """A large leg body comes as parts (router.encoded: the shared bytes, a comma, the leg's fields): one body, its
    Content-Length the parts' bytes."""
    seen: list = []
    url, runner = await serve(echo_app(seen))
    client = upstream.LegClient()
    try:
        shared = b'{"prompt":"' + "é".encode() * 20_000 + b'"}'
        resp = await client.post(url, "/v1/echo", (memoryview(shared)[:-1], b",", b'"n":1}'), {})
        assert resp.status == 200
        resp.release()
        [(_, headers, body, _)] = seen
        assert body == shared[:-1] + b',"n":1}' and int(headers["Content-Length"]) == len(body)
    finally:
        client.close()
        await runner.cleanup()


async def test_a_chunked_stream_arrives_whole_and_in_order():
    url, runner = await serve(echo_app([]))
    client = upstream.LegClient()
    try:
        resp = await client.post(url + "/", "/v1/stream?events=50", b"{}", {}, read_timeout=5)
        body = b"".join([chunk async for chunk in resp.iter_any()])
        assert body == b"".join(f"data: {i}\n\n".encode() for i in range(50)) + b"data: [DONE]\n\n"
        resp.release()
    finally:
        client.close()
        await runner.cleanup()


async def test_an_engine_that_cannot_be_reached_is_a_connect_error():
    client = upstream.LegClient()
    with pytest.raises(upstream.EngineConnectError):
        await client.post(f"http://127.0.0.1:{free_port()}", "/v1/echo", b"{}", {})
    with pytest.raises(ValueError):  # a header that would split the request
        await client.post("http://127.0.0.1:1", "/v1/echo", b"{}", {"Authorization": "Bearer x\r\nX-Evil: 1"})


async def test_a_silent_stream_times_out_and_closing_it_closes_the_connection():
    url, runner = await serve(echo_app([]))
    client = upstream.LegClient()
    try:
        resp = await client.post(url, "/v1/stream?events=3&gap=2", b"{}", {}, read_timeout=0.3)
        assert await resp.readany() == b"data: 0\n\n"
        with pytest.raises(TimeoutError):
            await resp.readany()
        resp.close()
        prefill = await client.post(url, "/v1/stream?events=3&gap=2", b"{}", {}, total_timeout=0.5)
        with pytest.raises(TimeoutError):
            await prefill.read()  # a total bound holds however steadily bytes arrive
        prefill.close()
    finally:
        client.close()
        await runner.cleanup()


async def raw_server(handler) -> tuple[str, asyncio.AbstractServer]:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    return f"http://127.0.0.1:{port}", server


async def test_an_engine_dying_mid_answer_is_a_disconnect_not_a_connect_error():
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 0\n\n\r\n")
        await writer.drain()
        writer.close()

    url, server = await raw_server(dies)
    client = upstream.LegClient()
    try:
        resp = await client.post(url, "/v1/stream", b"{}", {}, read_timeout=5)
        assert resp.status == 200 and await resp.readany() == b"data: 0\n\n"
        with pytest.raises(upstream.EngineDisconnected) as err:
            await resp.readany()
        assert not isinstance(err.value, upstream.EngineConnectError)
    finally:
        server.close()


async def test_an_idle_connection_the_engine_closed_is_replaced_without_failing_the_leg():
    """uvicorn closes idle keep-alive connections (5 s): a request sent on one as it closes never reached the
    engine, so it is sent again on a new connection, once."""
    answered = []

    async def once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        answered.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # keep-alive announced, then closed while idle

    url, server = await raw_server(once_then_close)
    client = upstream.LegClient()
    try:
        for _ in range(2):
            resp = await client.post(url, "/x", b"{}", {}, total_timeout=5)
            assert await resp.read() == b"ok"
            resp.release()
            await asyncio.sleep(0.2)
        assert len(answered) == 2
    finally:
        client.close()
        server.close()


async def test_what_is_not_http_is_a_disconnect():
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    url, server = await raw_server(garbage)
    client = upstream.LegClient()
    try:
        with pytest.raises(upstream.EngineDisconnected, match="not HTTP"):
            await client.post(url, "/x", b"{}", {}, total_timeout=5)
    finally:
        server.close()
