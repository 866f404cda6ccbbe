"""A fake OpenAI/vLLM engine that answers instantly: the P/D wire protocol without a model.

It plays both roles of the NIXL protocol (kv-protocol.md):
- prefill (``kv_transfer_params.do_remote_decode``): a non-streaming one-token answer whose
  ``kv_transfer_params`` point at itself (pull) or carry its identity (push, ``transfer_mode: push``);
  given a decode engine's stored params, it reports ``remote_prefill_cached_tokens`` as a real engine does;
- decode: ``max_tokens`` tokens, streamed (SSE) or not, and, bi-directional, its own params at the end
  (the final SSE chunk, as turnkv's connector does, or the unary body).

Faults for tests and the fault-and-load script: ``POST /fault`` with ``{"status": 500}`` (answer with that
status), ``{"hang": true}`` (never answer), ``{"die_after_first": true}`` (decode: close the stream after its
first token), ``{"delay": 0.05}`` (seconds before the first token), ``{"status": 400, "echo": true}`` (an
error whose message echoes the request's ``kv_transfer_params``, as vLLM's validation errors do),
``{"midstream_error": true}`` (an in-stream error event after the second token), ``{"sse_nospace": true}``
(the params chunk as ``data:{...}``), ``{"endless_line": N}`` (N bytes of a line that never ends), ``{}`` to clear.
``GET /stats`` returns counters, including requests aborted by a client that went away. Several engines can run
in one process. Run: ``python -m bench.fake_engine --port 28100 --role prefill``. By default it answers at once;
``--compute NAME`` (``bench.engine_clock``) gives it a modelled GPU engine's time instead: prefill legs wait for their
tokens' steps, decode streams one token per batched step.

It returns what real vLLM + turnkv's connector return, and keeps what they keep, so router tests mean something:
- decode's ``remote_blocks_expiry_time`` is decode's ``perf_counter`` plus the TTL (with a per-engine origin, as
  on another host), not Unix time; turnkv's connector adds the wall-clock ``turnkv_expires_at`` and signs the
  offer (``turnkv.wire``) with the deployment's secret;
- prefill reads an offer only when its signature verifies, it has not expired on prefill's wall clock (minus a
  skew margin), a router cleared it and its read-by instant has not passed, and it was not read before
  (``refused_offers`` counts the others);
- decode's retained blocks live in a fabric shared by the engines of one process: a read of blocks whose TTL
  ran out, or that were read already, counts in ``stale_reads`` (what real NIXL would read silently);
- push mode pairs decode's registration with prefill's KV by request id, as upstream does (a second
  registration under the same id replaces the first), so colliding ids cross KV between requests;
- decode's reply names the KV it decoded from (``kv-<digest of the prompt>``): a crossed push shows;
- ``min_tokens`` above ``max_tokens`` is refused with 400, as vLLM does;
- a stream asked for usage (``stream_options.include_usage``) ends with vLLM's usage-only chunk.

It answers one prompt and one sequence per request (a list prompt is one prompt to it, ``n`` is not read): the router
must split lists and keep ``n`` from P/D pairs itself (``router.choices``), and tests check what the engines were sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from bench.engine_clock import ComputeModel, DecodeClock, PrefillClock, compute_model
from turnkv import params as catalog
from turnkv import wire

#: The offer secret fake engines sign and verify with unless told otherwise (turnkv local up generates one).
FAKE_SECRET = b"fake-offer-secret"
FAKE_MODEL = "fake-model-fingerprint"
#: (decode engine id, block id) -> wall-clock instant decode frees it: the engines of this process.
RETAINED: dict[tuple[str, int], float] = {}
#: (engine id, block) -> when decode's host-tier copy of that block is done: a READ before then reads a slot not
#: yet written (host_copy_delay).
COPIED_AT: dict[tuple[str, int], float] = {}
#: (decode engine id, block) -> when a fork-readable turn was first read (its fork window runs from then).
FORK_READ_AT: dict[tuple[str, int], float] = {}
LOCAL_ENGINES: set[str] = set()
#: Push mode, by request id: decode's registrations waiting for prefill's KV, and KV waiting for a registration.
PUSH_REGISTRATIONS: dict[str, asyncio.Future[str]] = {}
PUSH_PENDING: dict[str, str] = {}


def prompt_digest(prompt: Any) -> str:
    return hashlib.blake2b(orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS), digest_size=4).hexdigest()


def _id(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little") % 100_000


def prompt_ids(prompt: Any, count: int) -> list[int]:
    """The fake tokenizer: a token-id prompt is itself; anything else maps to ``count`` ids derived from it."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    seed = prompt_digest(prompt)
    return [_id(f"{seed}:{i}") for i in range(count)]


def next_token(sequence: list[int]) -> int:
    """Greedy decoding of the fake model: the next id is a function of the whole sequence so far."""
    return _id(f"{len(sequence)}:{sum(sequence)}:{sequence[-8:]}")


def token_text(token: int, *, request_id: str = "", kv_from: str = "") -> str:
    return f"rid-{request_id} " if request_id else f"kv-{kv_from} " if kv_from else f"w{token} "


@dataclass
class FakeEngine:
    port: int
    role: str = "both"
    engine_id: str = ""
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    mode: str = "pull"
    bidirectional: bool = True
    expiry_ttl: float = float(catalog.get("decoder_kv_blocks_ttl").default)
    offer_secret: bytes | None = FAKE_SECRET
    expiry_skew: float = 1.0
    #: Decode: most turns retained at once (0: no bound); above it the oldest is evicted as turnkv's connector
    #: does (connector.retention): announced on the evictions feed, its blocks freed ``eviction_grace`` later.
    retain_limit: int = 0
    eviction_grace: float = float(catalog.get("retention_eviction_grace").default)
    #: Decode: offer every retained turn from a host tier (connector.host_tier), its copy done this long after the
    #: turn ends (a real decode copies at its next step); listed on the feed as hosted from then. None: device.
    host_copy_delay: float | None = None
    #: Decode keeps a read turn readable for forks this long (the connector's ``fork_window``; 0: single use, the
    #: first read frees the blocks). Its offers then say so (``wire.FORK_WINDOW``) and each reader's clearance is
    #: read once.
    fork_window: float = 0.0
    push_wait: float = 2.0
    #: False: prefill reads any offer, as upstream vLLM does (no signature, wall-clock expiry or replay check).
    verify_offers: bool = True
    #: False: prefill reads valid offers no router cleared (``TURNKV_REQUIRE_CLEARED_OFFERS=0``).
    require_cleared: bool = True
    fault: dict[str, Any] = field(default_factory=dict)
    #: False: a fresh reply starts with a word of the prompt's digest instead of the request id, so the same prompt
    #: always gets the same answer (greedy decoding, as a real engine at temperature 0: what `turnkv smoke` checks).
    request_marker: bool = True
    #: one write per SSE event with a yield between them, as a real engine emits one event per step; otherwise a
    #: whole stream goes out in one write (the cheapest case for whoever relays it)
    event_writes: bool = False
    #: Engine time (``bench.engine_clock``): prefill legs wait for their tokens' steps and decode streams a token per
    #: step, as on the modelled GPU engine. None: answers at once (the CPU is the only capacity).
    compute: ComputeModel | None = None
    #: Decode sequences running at once under ``compute`` (vLLM's ``max_num_seqs``; 0: no bound); the others wait.
    max_num_seqs: int = 0
    stats: dict[str, int] = field(default_factory=lambda: {"requests": 0, "prefill": 0, "decode": 0, "running": 0,
                                                           "aborted": 0, "pulled": 0, "errors": 0,
                                                           "wrong_reuse": 0, "stale_reads": 0, "push_timeouts": 0})
    seen_request_ids: list[str] = field(default_factory=list)
    seen_params: list[Any] = field(default_factory=list)
    seen_bodies: list[dict[str, Any]] = field(default_factory=list)
    refused_offers: dict[str, int] = field(default_factory=dict)
    #: the client address of every connection a request came on (a keep-alive connection reused is one)
    peers: set[Any] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.engine_id = self.engine_id or f"fake-{self.port}"
        self.side_channel_port = self.side_channel_port or self.port + 1000
        self._ids = itertools.count()
        self._read: set[str] = set()
        self._held: list[tuple[str, int, float]] = []  # retained turns, oldest first: (request id, block, expiry)
        self._evicted: dict[str, tuple[int, float]] = {}  # the evictions feed: request id -> (number, expiry)
        self._hosted: dict[str, tuple[float, float]] = {}  # host tier: request id -> (copy done at, offer expiry)
        self._epoch = f"{random.getrandbits(48):012x}"
        # perf_counter's origin differs per host: make it differ per engine, as on separate machines
        self.clock_origin = random.uniform(1e4, 1e6)
        LOCAL_ENGINES.add(self.engine_id)
        self._prefill_clock = PrefillClock(self.compute) if self.compute else None
        self._decode_clock = DecodeClock(self.compute, self.max_num_seqs) if self.compute else None

    def monotonic(self) -> float:
        return time.perf_counter() + self.clock_origin

    # -- protocol ---------------------------------------------------------------------------------

    def _prefill_params(self, request_id: str, tokens: int) -> dict[str, Any]:
        return {wire.DO_REMOTE_PREFILL: True, wire.DO_REMOTE_DECODE: False,
                wire.REMOTE_BLOCK_IDS: [[next(self._ids)]], wire.REMOTE_ENGINE_ID: self.engine_id,
                wire.REMOTE_REQUEST_ID: request_id, wire.REMOTE_HOST: self.host,
                wire.REMOTE_PORT: self.side_channel_port, wire.TP_SIZE: 1, wire.DCP_SIZE: 1, wire.PP_SIZE: 1,
                wire.REMOTE_NUM_TOKENS: tokens, wire.REMOTE_BLOCKS_EXPIRY_TIME: None, wire.TRANSFER_MODE: self.mode}

    def _decode_params(self, request_id: str, tokens: int, tenant: str | None = None) -> dict[str, Any]:
        block = next(self._ids)
        RETAINED[(self.engine_id, block)] = time.time() + self.expiry_ttl
        params = {wire.DO_REMOTE_PREFILL: False, wire.DO_REMOTE_DECODE: True, wire.REMOTE_BLOCK_IDS: [[block]],
                  wire.REMOTE_ENGINE_ID: self.engine_id, wire.REMOTE_REQUEST_ID: request_id,
                  wire.REMOTE_HOST: self.host, wire.REMOTE_PORT: self.side_channel_port,
                  wire.TP_SIZE: 1, wire.DCP_SIZE: 1, wire.PP_SIZE: 1,
                  wire.REMOTE_NUM_TOKENS: tokens, wire.REMOTE_BLOCKS_EXPIRY_TIME: self.monotonic() + self.expiry_ttl,
                  wire.TRANSFER_MODE: "pull", wire.BOOT: f"boot-{self.engine_id}"}
        if self.host_copy_delay is not None:
            params[wire.HOST_TIER] = {"tier": "host", "bases": [0x1000], "blocks": 1 << 20}
            self._hosted[request_id] = (time.time() + self.host_copy_delay, time.time() + self.expiry_ttl)
            COPIED_AT[(self.engine_id, block)] = time.time() + self.host_copy_delay
        elif self.fork_window > 0:
            params[wire.FORK_WINDOW] = self.fork_window
        if tenant is not None:  # as turnkv's decode: the retain request's tenant, signed
            params[wire.TENANT] = tenant
        if self.offer_secret is not None:
            wire.sign_offer(self.offer_secret, params, time.time() + self.expiry_ttl, FAKE_MODEL)
        if self.retain_limit:
            self._held.append((request_id, block, time.time() + self.expiry_ttl))
            while len(self._held) > self.retain_limit:
                self._evict(*self._held.pop(0))
        return params

    def _evict(self, request_id: str, block: int, until: float) -> None:
        key = (self.engine_id, block)
        if key in RETAINED:
            until = max(until, RETAINED[key])  # a renewed lease
            RETAINED[key] = min(RETAINED[key], time.time() + self.eviction_grace)
        self._evicted[request_id] = (len(self._evicted) + 1, until)
        self.stats["evicted"] = self.stats.get("evicted", 0) + 1

    def _admit_offer(self, kv: dict[str, Any]) -> str:
        """What turnkv's connector checks before a READ: signature, wall-clock expiry, a router's clearance and
        read-by instant, single use. ``"ok"`` or the reason the offer is refused (``turnkv.wire.OFFER_REFUSALS``)."""
        if not self.verify_offers:
            return "ok"
        reason = wire.offer_verdict(self.offer_secret, kv, FAKE_MODEL, time.time(), self.expiry_skew,
                                    require_cleared=self.require_cleared, engine_id=self.engine_id)
        if reason == "ok" and wire.replay_key(kv) in self._read:
            reason = "replayed"
        if reason != "ok":
            self.refused_offers[reason] = self.refused_offers.get(reason, 0) + 1
            return reason
        self._read.add(wire.replay_key(kv))
        return "ok"

    def _read_blocks(self, kv: dict[str, Any]) -> None:
        """The READ itself: blocks decode no longer holds give whatever is in them now."""
        engine = str(wire.KVParams(kv).engine_id)
        if engine not in LOCAL_ENGINES:
            return
        window = wire.fork_window(kv)
        for group in wire.KVParams(kv).block_ids or ():
            for block in group:
                if window > 0:  # kept for forks: evicted once the window passed, freed after the grace
                    deadline = RETAINED.get((engine, block))
                    if deadline is not None and deadline > time.time():
                        first = FORK_READ_AT.setdefault((engine, block), time.time())
                        RETAINED[(engine, block)] = min(deadline, first + window + wire.FORK_READ_SLACK
                                                        + self.expiry_skew)
                        continue
                deadline = RETAINED.pop((engine, block), None)
                copied = COPIED_AT.pop((engine, block), 0.0)
                if deadline is None or deadline <= time.time() or copied > time.time():
                    self.stats["stale_reads"] += 1  # freed, or a host slot read before decode's copy

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.stats["requests"] += 1
        self.stats["running"] += 1
        if request.transport is not None:
            self.peers.add(request.transport.get_extra_info("peername"))
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
        self.seen_bodies.append(body)
        del self.seen_request_ids[:-1000], self.seen_params[:-1000], self.seen_bodies[:-100]
        fault = self.fault
        if fault.get("hang"):
            await asyncio.sleep(3600)
        if fault.get("delay"):
            await asyncio.sleep(float(fault["delay"]))
        if fault.get("status"):
            self.stats["errors"] += 1
            message = "injected fault"
            if fault.get("echo"):
                message = f"invalid request on {self.host}:{self.port}: kv_transfer_params={orjson.dumps(kv).decode()}"
            return web.json_response({"error": {"message": message, "code": fault["status"]}},
                                     status=int(fault["status"]))
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if body.get("min_tokens") and max_tokens is not None and int(body["min_tokens"]) > int(max_tokens):
            return web.json_response({"error": {"message": f"min_tokens must be less than or equal to max_tokens="
                                                           f"{max_tokens}, got {body['min_tokens']}.",
                                                "type": "BadRequestError", "code": 400}}, status=400)
        chat = request.path.endswith("chat/completions")
        prompt = body.get("messages") if chat else body.get("prompt")
        prompt_tokens = max(1, len(orjson.dumps(prompt)) // 4)
        ids = prompt_ids(prompt, prompt_tokens)
        prompt_tokens = len(ids)
        with_ids = bool(body.get("return_token_ids"))
        created = int(time.time())
        view = wire.KVParams(kv) if isinstance(kv, dict) else wire.KVParams({})
        if view.do_remote_decode:  # prefill leg
            self.stats["prefill"] += 1
            params = self._prefill_params(request_id, prompt_tokens)
            verdict = self._admit_offer(kv) if view.block_ids else None
            if verdict not in (None, "ok"):  # refused before any read: prefill says why, as the connector does
                params[wire.VERDICT] = {"offered": view.num_tokens, "verified": 0, "reason": verdict}
            if verdict == "ok":  # a pull of the previous turn's KV from decode
                self._read_blocks(kv)
                # decode wrote its request id into its reply: the history must contain the reply whose KV is pulled
                if f"rid-{view.request_id} " not in orjson.dumps(prompt).decode():
                    self.stats["wrong_reuse"] += 1
                cached = max(0, min(view.num_tokens, prompt_tokens) - 1)
                params[wire.REMOTE_PREFILL_CACHED_TOKENS] = cached
                self.stats["pulled"] += cached
            if self._prefill_clock is not None:  # the tokens not pulled are computed, in the engine's steps
                await self._prefill_clock.prefill(prompt_tokens - int(params.get(wire.REMOTE_PREFILL_CACHED_TOKENS)
                                                                      or 0))
            if self.mode == "push":  # hand the KV to decode's registration under this request id
                waiting = PUSH_REGISTRATIONS.pop(request_id, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(prompt_digest(prompt))
                else:
                    PUSH_PENDING[request_id] = prompt_digest(prompt)
                    while len(PUSH_PENDING) > 10_000:  # never collected (decode failed): forget the oldest
                        del PUSH_PENDING[next(iter(PUSH_PENDING))]
            choice = ({"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": "x", "finish_reason": "length"})
            answer = {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                      "model": body.get("model", "fake"), "choices": [choice], "kv_transfer_params": params,
                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                                "total_tokens": prompt_tokens + 1}}
            if with_ids:  # vLLM: the rendered prompt's token ids, top level (chat) or per choice (completions)
                if chat:
                    answer["prompt_token_ids"] = ids
                else:
                    choice["prompt_token_ids"] = ids
            return web.Response(body=orjson.dumps(answer), content_type="application/json")
        self.stats["decode"] += 1
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        kv_from = prompt_digest(prompt)
        if view.do_remote_prefill and view.transfer_id:  # push: KV comes from P
            kv_from = await self._push_kv(str(view.request_id), kv_from)
        # a fresh prompt starts with two marker tokens (the request id, the KV decoded from); a token-id prompt
        # (a continuation) goes on from its sequence: greedy output depends only on the sequence
        sequence, tokens, words = list(ids), [], []
        fresh = not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))
        for i in range(max(1, n)):
            if fresh and i == 0:
                token, word = _id("rid"), token_text(0, request_id=request_id if self.request_marker else "",
                                                     kv_from="" if self.request_marker else kv_from)
            elif fresh and i == 1:
                token, word = _id("kv" + kv_from), token_text(0, kv_from=kv_from)
            else:
                token = next_token(sequence)
                word = token_text(token)
            sequence.append(token)
            tokens.append(token)
            words.append(word)
        out_params = (self._decode_params(request_id, prompt_tokens + n, wire.tenant_tag(kv))
                      if self.bidirectional and kv else None)
        if not body.get("stream"):
            if self._decode_clock is not None:
                async with contextlib.aclosing(self._decode_clock.tokens(len(words))) as steps:
                    async for _ in steps:
                        pass
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
        die_after = 1 if fault.get("die_after_first") else int(fault.get("die_after") or 0)
        options = body.get("stream_options") or {}
        usage = ({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}
                 if options.get("include_usage") else None)  # vLLM's last chunk when asked for (before the params')
        stream = (request, response, words, tokens, ids, head, chat, with_ids, fault, die_after, out_params)
        if self._decode_clock is None:
            return await self._stream(*stream, None, usage)
        async with contextlib.aclosing(self._decode_clock.tokens(len(words))) as steps:
            return await self._stream(*stream, steps, usage)

    async def _stream(self, request: web.Request, response: web.StreamResponse, words: list[str], tokens: list[int],
                      ids: list[int], head: dict[str, Any], chat: bool, with_ids: bool, fault: dict[str, Any],
                      die_after: int, out_params: dict[str, Any] | None,
                      steps: AsyncIterator[int] | None, usage: dict[str, int] | None = None) -> web.StreamResponse:
        """Stream ``words`` as SSE events: one write per event (``event_writes``, a token delay, or engine time,
        where each token waits for its decode step), else all at once."""
        parts: list[bytes] = []
        for i, word in enumerate(words):
            if steps is not None:
                await anext(steps)
            last = "length" if i == len(words) - 1 else None
            if chat:
                choice = {"index": 0, "delta": ({"role": "assistant", "content": word} if i == 0 else
                                                {"content": word}), "finish_reason": last}
            else:
                choice = {"index": 0, "text": word, "finish_reason": last}
            if with_ids:
                choice["token_ids"] = [tokens[i]]
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if with_ids and i == 0:  # vLLM: top level in chat chunks, per choice in completion chunks
                (chunk if chat else choice)["prompt_token_ids"] = ids
            parts.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if fault.get("midstream_error") and i == 1:  # vLLM's in-stream error event (names internals here)
                parts.append(b"data: " + orjson.dumps({"error": {"message": f"remote_host {self.host} failed",
                                                                  "code": 500}}) + b"\n\n")
            if fault.get("endless_line") and i == 1:  # a line that never ends
                await response.write(b"".join(parts) + b"data: " + b"x" * int(fault["endless_line"]))
                await asyncio.sleep(30)
            if die_after and i == die_after - 1:
                await response.write(b"".join(parts))
                await asyncio.sleep(0.01)
                request.transport.close()  # type: ignore[union-attr]
                return response
            if fault.get("token_delay") or self.event_writes or steps is not None:
                await response.write(b"".join(parts))
                parts.clear()
                await asyncio.sleep(float(fault.get("token_delay") or 0))
        if usage is not None:
            parts.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
        if out_params:  # ``sse_nospace``: ``data:`` with no space, which the SSE spec allows
            parts.append((b"data:" if fault.get("sse_nospace") else b"data: ")
                         + orjson.dumps({**head, "choices": [], "kv_transfer_params": out_params}) + b"\n\n")
        parts.append(b"data: [DONE]\n\n")
        await response.write(b"".join(parts))
        await response.write_eof()
        return response

    async def _push_kv(self, request_id: str, own: str) -> str:
        """The digest of the KV prefill pushed under ``request_id`` (upstream matches by id), or, when none comes
        within ``push_wait``, the engine's own recompute."""
        if request_id in PUSH_PENDING:
            return PUSH_PENDING.pop(request_id)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        PUSH_REGISTRATIONS[request_id] = future  # a second registration under one id replaces the first
        try:
            return await asyncio.wait_for(future, self.push_wait)
        except TimeoutError:
            self.stats["push_timeouts"] += 1
            return own
        finally:
            if PUSH_REGISTRATIONS.get(request_id) is future:
                del PUSH_REGISTRATIONS[request_id]

    # -- app --------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)

        async def health(_: web.Request) -> web.Response:
            if self.fault.get("unhealthy"):
                return web.Response(status=503)
            return web.Response(text="")

        async def models(_: web.Request) -> web.Response:
            """vLLM's list: the served name, and the model's local path (``root``) and permissions besides."""
            self.stats["models"] = self.stats.get("models", 0) + 1
            return web.json_response({"object": "list", "data": [{
                "id": "tiny", "object": "model", "created": 1_700_000_000, "owned_by": "vllm",
                "root": "/opt/turnkv/models/tiny", "parent": None, "max_model_len": 4096,
                "permission": [{"id": f"modelperm-{self.engine_id}", "object": "model_permission",
                                "allow_sampling": True, "organization": "*"}]}]})

        async def set_fault(request: web.Request) -> web.Response:
            self.fault = orjson.loads(await request.read() or b"{}")
            return web.json_response(self.fault)

        async def leases(request: web.Request) -> web.Response:
            """turnkv's lease route (connector.leases): signed offers in, re-signed offers with a new expiry out."""
            if self.fault.get("lease_delay"):
                await asyncio.sleep(float(self.fault["lease_delay"]))
            if self.fault.get("lease_status"):
                return web.json_response({"error": {"message": "injected", "code": self.fault["lease_status"]}},
                                         status=int(self.fault["lease_status"]))
            body = orjson.loads(await request.read())
            ttl = float(body["ttl"])
            renewed, missing = {}, []
            for offer in body.get("offers") or ():
                rid = str(wire.KVParams(offer).request_id)
                blocks = [(self.engine_id, b) for g in offer.get(wire.REMOTE_BLOCK_IDS) or () for b in g]
                held = all(RETAINED.get(k, 0) > time.time() for k in blocks) and rid not in self._evicted
                if wire.check_offer(self.offer_secret, offer, FAKE_MODEL, time.time(), 0.0) != "ok" or not held \
                        or not wire.lease_offer_ok(offer, self.engine_id):
                    missing.append(rid)
                    continue
                for k in blocks:
                    RETAINED[k] = max(RETAINED[k], time.time() + ttl)
                out = {**offer, wire.REMOTE_BLOCKS_EXPIRY_TIME: self.monotonic() + ttl}
                renewed[rid] = wire.sign_offer(self.offer_secret, out, time.time() + ttl, FAKE_MODEL)
            self.stats["leases"] = self.stats.get("leases", 0) + 1
            return web.json_response({"renewed": renewed, "missing": missing})

        async def stats(_: web.Request) -> web.Response:
            clocks = {}
            if self._prefill_clock is not None and self._decode_clock is not None:
                p, d = self._prefill_clock, self._decode_clock
                clocks = {"prefill_steps": p.steps, "prefill_busy_s": p.busy_s, "prefill_tokens": p.tokens,
                          "decode_steps": d.steps, "decode_busy_s": d.busy_s, "decode_batched": d.batched}
            return web.json_response({**self.stats, **clocks})

        async def evictions(request: web.Request) -> web.Response:
            """turnkv's evictions feed (connector.leases): announcements after ``since``."""
            self.stats["feed_reads"] = self.stats.get("feed_reads", 0) + 1
            if self.fault.get("evictions_status"):
                return web.Response(status=int(self.fault["evictions_status"]))
            since = int(request.query.get("since", "0"))
            events = [[rid, until] for rid, (seq, until) in self._evicted.items() if seq > since]
            now = time.time()
            hosted = [[rid, until] for rid, (done, until) in self._hosted.items()
                      if done <= now < until and rid not in self._evicted]
            return web.json_response({"epoch": self._epoch, "seq": len(self._evicted), "evicted": events,
                                      "hosted": hosted})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=f"vllm:num_requests_running {self.stats['running']}\n"
                                     f"fake:aborted_total {self.stats['aborted']}\n")

        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/fault", set_fault)
        app.router.add_post(wire.LEASE_ROUTE, leases)
        app.router.add_get("/stats", stats)
        # Every engine has the feed, as every engine with turnkv's connector does (one that never evicts lists
        # nothing); fault {"evictions_status": 404} answers as an engine without it.
        app.router.add_get(wire.EVICTIONS_ROUTE, evictions)
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
    parser.add_argument("--event-writes", action="store_true", help="one write per streamed event (as a real engine)")
    parser.add_argument("--compute", default="instant", help="engine time (bench.engine_clock.COMPUTE_MODELS), or "
                                                             "instant: answer at once")
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="decode sequences running at once under --compute (vLLM's max_num_seqs; 0: no bound)")
    args = parser.parse_args()
    try:
        compute = compute_model(args.compute)
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()

    async def run() -> None:
        engines = [FakeEngine(p, mode=args.mode, bidirectional=not args.no_bidirectional,
                              event_writes=args.event_writes, compute=compute, max_num_seqs=args.max_num_seqs)
                   for p in args.port]
        await start(engines)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
