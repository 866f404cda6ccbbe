"""CPU per request of the two legs' bodies: the router's way (``router.encoded``: the client's body serialised once at
intake, the depth check; a large body's legs splice their fields in as parts the leg client joins with its head, a
small one's serialise it whole) against each leg serialising the whole body and joining it (the router until
2026-12-07). Chat bodies of 1 to 200 messages (0.8 to 137 KB).

Run: ``python -m bench.leg_bodies`` (this process's CPU time, best of 7 interleaved rounds, microseconds per request,
both legs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from router import encoded, legs
from router.dispatch import Dispatch
from router.guard import FRESH_PREFILL_PARAMS

#: What prefill answers in pull mode (decode's leg carries it).
PREFILL_ANSWER = {**FRESH_PREFILL_PARAMS, "do_remote_prefill": True, "do_remote_decode": False,
                  "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "prefill-0", "remote_host": "10.0.0.1",
                  "remote_port": 5600, "remote_num_tokens": 4000}
#: The request kind (``router.outcomes.RequestKind.CHAT``'s value: the legs' bodies do not read it; a bench takes no
#: router internals beyond what it measures, tests/unit/test_client_protocol.py).
CHAT: Any = "chat"
#: Rounds, each way in turn (the best of each is printed: the machine's other load only adds).
ROUNDS = 7
#: The leg client's request head (``router.upstream``), joined with the body into one write.
HEAD = [b"POST ", b"/", b"v1/chat/completions", b" HTTP/1.1\r\nHost: ", b"127.0.0.1:8000", b"\r\nContent-Length: ",
        b"1234", b"\r\n", b"X-Request-Id", b": ", b"turnkv-0123456789abcdef0000000000000001", b"\r\n", b"\r\n"]


def chat_body(messages: int) -> dict[str, Any]:
    text = "Read config.py and list the settings that are unused; " * 12
    return {"model": "tiny", "max_tokens": 16, "stream": True, "temperature": 0, "cache_salt": "a" * 64,
            "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} {text}"}
                         for i in range(messages)]}


def old_prefill_body(d: Dispatch, params: dict[str, Any]) -> bytes:
    """``router.legs.prefill_body`` as it was (the whole body per leg)."""
    body = dict(d.body)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("min_tokens", None)
    if d.migrate:
        body["return_token_ids"] = True
    body["stream"] = False
    body.pop("stream_options", None)
    body["kv_transfer_params"] = params
    return orjson.dumps(body)


def old_decode_body(d: Dispatch, params: dict[str, Any]) -> bytes:
    """``router.legs.decode_body`` as it was."""
    body = dict(d.body)
    if d.retain:
        params = {**params, "retain": True}
    if d.migrate:
        body["return_token_ids"] = True
    body["kv_transfer_params"] = params
    return orjson.dumps(body)


def whole(body: dict[str, Any], size: int, nesting: int) -> None:
    """Each leg copies the body, sets its fields and serialises it all (the router until 2026-12-07)."""
    d = Dispatch(CHAT, "/v1/chat/completions", body, "r", None, None)
    for leg in (old_prefill_body(d, FRESH_PREFILL_PARAMS), old_decode_body(d, PREFILL_ANSWER)):
        b"".join([*HEAD, leg])


def spliced(body: dict[str, Any], size: int, nesting: int) -> None:
    """The router's: one serialisation at intake (the depth check), each leg's body (or its parts) joined with the
    head."""
    # as the intake decides (router.flow), from what read_json counted: the body's size and its braces and brackets
    shared = encoded.base(body) if size >= encoded.SHARE_MIN or nesting > encoded.MAX_DEPTH else None
    d = Dispatch(CHAT, "/v1/chat/completions", body, "r", None, None, encoded=shared)
    for body_or_parts in (legs.prefill_body(d, FRESH_PREFILL_PARAMS), legs.decode_body(d, PREFILL_ANSWER)):
        if isinstance(body_or_parts, bytes):  # as router.upstream writes it
            b"".join([*HEAD, body_or_parts])
        else:
            sum(map(len, body_or_parts))
            b"".join([*HEAD, *body_or_parts])


def per_request(way: Callable[[dict[str, Any], int, int], None], body: dict[str, Any], reps: int) -> float:
    """CPU microseconds per call, one round."""
    raw = orjson.dumps(body)
    size, nesting = len(raw), raw.count(b"{") + raw.count(b"[")  # what read_json counts as the body arrives
    t0 = time.process_time()
    for _ in range(reps):
        way(body, size, nesting)
    return (time.process_time() - t0) / reps * 1e6


def main() -> None:
    for messages, reps in ((1, 20_000), (10, 5_000), (20, 3_000), (40, 2_000), (200, 400)):
        body = chat_body(messages)
        size = len(orjson.dumps(body))
        rounds = [(per_request(whole, body, reps), per_request(spliced, body, reps)) for _ in range(ROUNDS)]
        before, after = min(r[0] for r in rounds), min(r[1] for r in rounds)
        print(f"{messages:4d} messages, {size:7,d} bytes: each leg serialises {before:7.2f} us, spliced {after:7.2f} "
              "us per request")


if __name__ == "__main__":
    main()
