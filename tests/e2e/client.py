"""Small synchronous helpers for talking to the router and reading engine metrics in tests."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import requests
from prometheus_client.parser import text_string_to_metric_families

from turnkv import wire
from turnkv.local.stack import StackConfig, offer_secret_path

OFF = {"X-TurnKV-Reuse": "off"}  # a request's reference arm: computed from scratch, nothing reused
OUTCOME, REUSED = "X-TurnKV-Reuse-Outcome", "X-TurnKV-Reused-Tokens"  # what the router says it did
PREFILL_CACHED = "X-TurnKV-Prefill-Cached-Tokens"  # prompt tokens prefill found in its own prefix cache
PULLED = "vllm:prompt_tokens_by_source_total"  # prefill's prompt tokens by source (vLLM's own metric)


def offer_secret(stack) -> bytes:
    """The stack's offer secret, read as its engines and router read it (``turnkv local up`` writes the file)."""
    path = offer_secret_path(StackConfig(state_dir=stack["state_dir"]))
    secret = wire.offer_secret({wire.OFFER_SECRET_FILE_ENV: str(path)})
    assert secret, f"no offer secret at {path}"
    return secret


def with_seals(decode: str, secret: bytes, params: dict) -> dict:
    """A replay of a sealed offer as a router makes it: decode's per-rank digests of the turn's KV bytes from its
    evictions feed (``turnkv.wire.SEALS``), MACed for the turn the offer names as it stands (a test that restamps an
    offer holds the secret; decode's own MAC is over the same identity otherwise). Unchanged when not sealed, or when
    decode lists no seal of it within a second (a turn already read and freed: prefill refuses it anyway)."""
    if not params.get(wire.SEALED):
        return params
    request_id = wire.KVParams(params).request_id
    for _ in range(20):  # decode seals at the step after the turn ended
        feed = requests.get(f"{decode}{wire.EVICTIONS_ROUTE}?since=0&fresh=1", timeout=10).json()
        entries = {e[1]: e[2] for e in feed.get("sealed") or () if e[0] == request_id}
        if entries:
            identity = wire.seal_identity(params)
            return {**params, wire.SEALS: [[r, d, wire.seal_mac(secret, identity, r, d)]
                                           for r, d in sorted(entries.items())]}
        time.sleep(0.05)
    return params


@dataclass
class Reply:
    status: int
    headers: dict
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    body: dict | None = None
    events: list[dict] = field(default_factory=list)

    @property
    def reused(self) -> int:
        return int(self.headers.get(REUSED, "0"))

    @property
    def prefill_cached(self) -> int:
        return int(self.headers.get(PREFILL_CACHED, "0"))

    @property
    def outcome(self) -> str:
        return self.headers.get(OUTCOME, "")


def chat(url: str, messages: list[dict], *, conversation: str | None = None, stream: bool = False,
         reuse: bool = True, max_tokens: int = 16, key: str | None = None, **extra) -> Reply:
    """One chat completion through ``url`` (``key``: the API key it is sent with, for a keyed router)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "return_token_ids": True, **extra}
    if conversation:
        body["conversation_id"] = conversation
    headers = {} if reuse else dict(OFF)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    resp = requests.post(f"{url}/v1/chat/completions", json=body, headers=headers, stream=stream, timeout=300)
    if resp.status_code != 200 or not stream:
        data = resp.json()
        reply = Reply(resp.status_code, dict(resp.headers), body=data)
        if resp.status_code == 200:
            choice = data["choices"][0]
            reply.text, reply.token_ids = choice["message"]["content"], choice["token_ids"]
        return reply
    reply = Reply(resp.status_code, dict(resp.headers))
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        reply.events.append(event)
        for choice in event.get("choices", []):
            reply.text += choice["delta"].get("content") or ""
            reply.token_ids += choice.get("token_ids") or []
    return reply


def metric(url: str, name: str, **labels) -> float:
    """Sum of a Prometheus sample (all series matching ``labels``) from an engine's /metrics."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def pulled_tokens(stack) -> float:
    """Prompt tokens the stack's prefill engine took over the KV connector so far (not recomputed)."""
    return metric(stack["prefill-0"], PULLED, source="external_kv_transfer")


def check_turns(stack, turn, *, first, follow, stream):
    """Four turns of an unmodified client: the first recomputes ('none'), each later one pulls everything decode
    held (the history and its reply but the last generated token: more every turn), and every answer equals the
    one with reuse off. ``turn(history, stream=, headers=)`` asks as the client does: (reply, text, headers);
    ``follow(history, reply, n)`` is the next turn's history."""
    history, previous = first, 0
    for n in range(4):
        before = pulled_tokens(stack)
        reply, text, headers = turn(history, stream=stream)
        moved = pulled_tokens(stack) - before
        _, off, off_headers = turn(history, stream=stream, headers=OFF)
        assert text and text == off, f"turn {n + 1}: reuse changed the answer"
        assert off_headers[OUTCOME] == "disabled"
        print(f"turn {n + 1}: {headers[OUTCOME]} reused={headers[REUSED]} pulled={moved:.0f}")  # the figures (-s)
        if n == 0:
            assert headers[OUTCOME] == "none" and moved == 0
        else:
            assert headers[OUTCOME] == "hit", (n, headers[OUTCOME])
            assert int(headers[REUSED]) == moved > max(600, previous + 100), (n, moved, previous)
            previous = moved
        history = follow(history, reply, n)


def words(model_dir, n: int, seed: int) -> str:
    vocab = (model_dir / "words.txt").read_text().split()
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(n))


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``check`` until it holds or ``timeout`` passes (engine gauges update between steps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()


@contextlib.contextmanager
def engine_stack(config) -> Iterator[dict]:
    """A real local stack for a test module: component URLs by name, plus ``model_dir``; always stopped."""
    import pytest

    from turnkv.local.stack import Supervisor

    if os.environ.get("TURNKV_SKIP_ENGINES"):
        pytest.skip("TURNKV_SKIP_ENGINES is set")
    supervisor = Supervisor(config.state_dir)
    supervisor.down()  # a stack left by an interrupted run
    try:
        state = supervisor.up(config)
        yield {name: c["url"] for name, c in state["components"].items()} | {
            "model_dir": config.model_dir, "state_dir": config.state_dir,
            "pgids": {name: c["pgid"] for name, c in state["components"].items()}}
    finally:
        supervisor.down()
