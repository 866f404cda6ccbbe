"""`turnkv smoke`: after a deploy, prove the endpoint serves and reuses KV, through the plain OpenAI API.

A short conversation is played turn by turn, streaming. Each turn is sent twice: first with reuse off
(``X-TurnKV-Reuse: off``, the router's switch) and a ``cache_salt`` of its own, then with reuse on, as a client
sends it. The salt keeps the reuse-off request out of the prefix cache the reuse-on request reads: without it,
prefill's prefix cache (on, as deployed) held the very prompt when the reuse-on request came, nothing was left to
pull, and a healthy stack failed as ``recompute``.

Turns 2+ must reuse the previous turn (the router's ``X-TurnKV-Reuse-Outcome`` header, or its trailing SSE comment
when the headers left before the outcome was known), in one of two ways, both healthy, and the result says which:
``pulled`` (prefill read decode's retained KV) or ``cached`` (the router replayed decode's retained turn, and
prefill's own prefix cache held the history: it recomputed the rest, fewer tokens than a pull is worth,
``kv_recompute_threshold``). Each answer must equal the reuse-off one (greedy decoding: reuse may never change an
answer). The first failure is the reason; nothing here prints (the command renders the result).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from turnkv.wire import (
    PREFILL_CACHED_HEADER,
    REUSE_HEADER,
    REUSE_OFF,
    REUSE_OUTCOME_HEADER,
    REUSED_TOKENS_HEADER,
    ReuseOutcome,
    outcome_advice,
)

#: An agent's standing instructions: long enough that the history a turn reuses is well above the engines'
#: kv_recompute_threshold (64 tokens by default), as an agent's always is.
SYSTEM = (
    "You are a careful travel-planning assistant working for a small outdoor club. Members ask you to plan trips "
    "step by step over several messages, and they rely on you to remember every earlier answer in the "
    "conversation. Keep each reply short and concrete: name specific items, times and places rather than general "
    "advice. When a member changes a constraint, revise only what the change affects and say what you changed. "
    "Assume the group is six adults of mixed experience, travelling by train, staying in mountain huts that must "
    "be booked in advance, with a budget of about one hundred euros per person per day. Mention safety only where "
    "it matters for the plan: weather, altitude, daylight, and the distance to the next hut. Never invent opening "
    "hours or prices; say when something must be checked locally. Prefer routes with a lower-altitude alternative "
    "in case of storms, and keep the daily walking time under seven hours including breaks."
)
#: The user's side of the conversation: each turn resends the whole history, as an agent does.
PROMPTS = (
    "You are helping plan a three-day hiking trip in the Alps. List five things to pack.",
    "Which of those matters most if it rains every afternoon? Answer in two sentences.",
    "Now suggest a daily schedule that avoids the afternoon rain.",
    "Summarise the whole plan in one short paragraph.",
)
#: The outcomes the router reports when the previous turn's KV was pulled, and when reuse was switched off.
HIT = ReuseOutcome.HIT
DISABLED = ReuseOutcome.DISABLED
RECOMPUTE = ReuseOutcome.RECOMPUTE
_TRAILER = re.compile(rb"^: turnkv reuse_outcome=(\S+) reused_tokens=(\d+)(?: prefill_cached_tokens=(\d+))?")
#: Tokens per answer: above the engines' default kv_recompute_threshold (64), so that a retained answer is worth
#: pulling even where prefill's prefix cache holds every earlier turn (an answer is the one part only decode has).
MAX_TOKENS = 96
#: How a turn 2+ reused the previous one (:func:`reuse_kind`).
PULLED, CACHED = "pulled", "cached"


class SmokeFailure(Exception):
    """The endpoint failed the smoke test; the message is the reason, for a person."""


@dataclass(frozen=True)
class TimedReply:
    """One streamed answer as the smoke test reads it: its text, time to first token and the router's reuse
    outcome (not an HTTP reply: the e2e tests' ``Reply`` is that)."""

    text: str
    ttft_ms: float
    outcome: str
    reused_tokens: int
    #: Prompt tokens prefill found in its own prefix cache (``X-TurnKV-Prefill-Cached-Tokens``).
    prefill_cached: int = 0


@dataclass(frozen=True)
class PlayedTurn:
    """One conversation turn played twice, reuse off then on (``router.guard.Turn`` is the router's parsed turn)."""

    index: int
    off: TimedReply
    on: TimedReply

    @property
    def matches(self) -> bool:
        return self.on.text == self.off.text

    @property
    def reuse(self) -> str | None:
        """How the reuse-on request reused the previous turn (:func:`reuse_kind`)."""
        return reuse_kind(self.on)


def reuse_kind(reply: TimedReply) -> str | None:
    """``pulled`` (prefill read decode's retained KV), ``cached`` (the router replayed decode's retained turn and
    prefill's own prefix cache held the history; prefill recomputed the rest, too few tokens to be worth a pull), or
    None (no reuse: a failure from turn 2 on). Pure."""
    if reply.outcome == HIT and reply.reused_tokens > 0:
        return PULLED
    if reply.outcome == RECOMPUTE and reply.prefill_cached > 0:
        return CACHED
    return None


@dataclass
class SmokeResult:
    url: str
    model: str = ""
    turns: list[PlayedTurn] = field(default_factory=list)
    #: Why it failed; None when it passed.
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and bool(self.turns)


def check_turn(turn: PlayedTurn) -> str | None:
    """The reason a played turn fails, or None. Pure: the rules of the smoke test in one place."""
    if turn.off.outcome != DISABLED:
        return (f"turn {turn.index}: the endpoint did not honour '{REUSE_HEADER}: off' (reuse outcome "
                f"{turn.off.outcome!r}); is it a turnkv router, and does the ALB pass the header?")
    if turn.index > 1 and turn.reuse is None:
        return (f"turn {turn.index}: no KV reuse ({turn.on.reused_tokens} tokens pulled from decode, "
                f"{turn.on.prefill_cached} found in prefill's prefix cache); router outcome "
                f"{outcome_advice(turn.on.outcome)}")
    if not turn.matches:
        at = next((i for i, (a, b) in enumerate(zip(turn.on.text, turn.off.text, strict=False)) if a != b),
                  min(len(turn.on.text), len(turn.off.text)))
        where = f"first difference at character {at}: {turn.on.text[at:at + 30]!r} vs {turn.off.text[at:at + 30]!r}"
        if turn.on.outcome != HIT:
            return (f"turn {turn.index}: the same request twice gave two answers ({where}) without any KV reuse: the "
                    "endpoint does not decode greedily at temperature 0, so reuse cannot be checked against it")
        return (f"turn {turn.index}: the answer with reuse differs from the same turn with reuse off ({where}); "
                "reused KV changed the answer")
    return None


def _headers(api_key: str | None, reuse: bool) -> dict[str, str]:
    """A request's headers; reuse off is the router's switch."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if not reuse:
        headers[REUSE_HEADER] = REUSE_OFF
    return headers


async def _error(resp: aiohttp.ClientResponse, what: str) -> SmokeFailure:
    body = (await resp.text())[:300].strip()
    hint = {401: " (pass --api-key)", 403: " (this key may not use the endpoint)",
            404: " (is the URL the router's base, without /v1?)"}.get(resp.status, "")
    return SmokeFailure(f"{what}: HTTP {resp.status} from {resp.url}{hint}: {body}")


async def _model(session: aiohttp.ClientSession, url: str, api_key: str | None) -> str:
    async with session.get(f"{url}/v1/models", headers=_headers(api_key, True)) as resp:
        if resp.status != 200:
            raise await _error(resp, "listing models")
        data = (await resp.json()).get("data") or []
    if not data:
        raise SmokeFailure(f"{url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


async def _chat(session: aiohttp.ClientSession, url: str, api_key: str | None, model: str,
                messages: list[dict[str, str]], reuse: bool, max_tokens: int, what: str,
                salt: str | None = None) -> TimedReply:
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens,
                            "temperature": 0, "seed": 0}
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    ttft: float | None = None
    text = ""
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=_headers(api_key, reuse)) as resp:
        if resp.status != 200:
            raise await _error(resp, what)
        outcome = resp.headers.get(REUSE_OUTCOME_HEADER, "")
        reused = resp.headers.get(REUSED_TOKENS_HEADER, "0")
        cached = resp.headers.get(PREFILL_CACHED_HEADER, "0")
        async for raw in resp.content:
            line = raw.rstrip(b"\r\n")
            if trailer := _TRAILER.match(line):
                outcome, reused = trailer.group(1).decode(), trailer.group(2).decode()
                cached = (trailer.group(3) or b"0").decode()
                continue
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SmokeFailure(f"{what}: the stream ended with an error: {event['error']}")
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = (time.perf_counter() - start) * 1000
                text += piece
    if ttft is None:
        raise SmokeFailure(f"{what}: the stream carried no text")
    return TimedReply(text=text, ttft_ms=ttft, outcome=outcome or "unknown",
                      reused_tokens=int(reused) if str(reused).isdigit() else 0,
                      prefill_cached=int(cached) if str(cached).isdigit() else 0)


def argument_problem(url: str, turns: int) -> str | None:
    """What is wrong with the arguments (the CLI exits 2 on it), or None."""
    if not 2 <= turns <= len(PROMPTS):
        return f"--turns {turns}: play 2 .. {len(PROMPTS)} turns (turn 2 is the first that can reuse KV)"
    if not re.match(r"^https?://[^/\s]+", url):
        return f"--url {url!r} is not an http(s) URL; pass the endpoint's base, e.g. https://my-alb.example.com"
    return None


async def run(url: str, api_key: str | None = None, model: str | None = None, turns: int = len(PROMPTS),
              max_tokens: int = MAX_TOKENS, timeout_s: float = 300.0, verify_tls: bool = True) -> SmokeResult:
    """Play the conversation against ``url`` (the router's base URL); never raises for the endpoint's faults."""
    url = url.rstrip("/")
    result = SmokeResult(url=url)
    if problem := argument_problem(url, turns):
        result.failure = problem
        return result
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
    try:
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(ssl=None if verify_tls else False)) as session:
            result.model = model or await _model(session, url, api_key)
            # A conversation of this run only: another run's identical turn, still readable by forks of its history
            # (decode's fork_window), would otherwise be pulled and prove nothing about this endpoint's retention.
            reference = secrets.token_hex(4)
            system = f"{SYSTEM} Conversation reference {reference}."
            off_salt = f"turnkv-smoke-off-{reference}"  # the reuse-off requests' own prefix cache (module docstring)
            history: list[dict[str, str]] = [{"role": "system", "content": system}]
            for index, prompt in enumerate(PROMPTS[:turns], start=1):
                messages = [*history, {"role": "user", "content": prompt}]
                # Reuse off first: the reuse-on request then holds the conversation's latest entry for the next turn.
                off = await _chat(session, url, api_key, result.model, messages, False, max_tokens,
                                  f"turn {index} (reuse off)", salt=off_salt)
                on = await _chat(session, url, api_key, result.model, messages, True, max_tokens,
                                 f"turn {index} (reuse on)")
                turn = PlayedTurn(index, off, on)
                result.turns.append(turn)
                if reason := check_turn(turn):
                    result.failure = reason
                    return result
                history = [*messages, {"role": "assistant", "content": on.text}]
    except SmokeFailure as exc:
        result.failure = str(exc)
    except TimeoutError:  # an OSError too: not "cannot reach", the endpoint answered too slowly or not at all
        result.failure = (f"turn {len(result.turns) + 1}: no complete answer from {url} within the test's "
                          f"{timeout_s:g} s; check the engines' health and logs, or give --timeout more time")
    except aiohttp.ClientConnectorCertificateError as exc:
        result.failure = (f"{url}: the TLS certificate does not match ({exc.certificate_error}). The ALB serves "
                          "your certificate, issued for your domain, not for the ALB's DNS name: point a DNS record "
                          "(alias or CNAME) of that domain at the ALB and pass --url https://<that name>, or pass "
                          "--insecure to skip the check knowingly")
    except (aiohttp.ClientConnectionError, OSError) as exc:
        result.failure = f"cannot reach {url}: {exc} (is the ALB reachable from here: router.allowed_cidrs?)"
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        result.failure = f"{url} did not answer as an OpenAI-compatible endpoint: {exc!r}"
    return result


def summary_rows(result: SmokeResult) -> list[dict[str, Any]]:
    """One row per turn, for the table (and --json)."""
    return [{"turn": t.index, "ttft_off_ms": round(t.off.ttft_ms, 1), "ttft_on_ms": round(t.on.ttft_ms, 1),
             "outcome": t.on.outcome, "reused_tokens": t.on.reused_tokens, "prefill_cached": t.on.prefill_cached,
             "reuse": t.reuse or "-", "same_answer": t.matches}
            for t in result.turns]


def passed_line(result: SmokeResult) -> str:
    """The verdict of a passed run, saying how turns 2+ reused KV (pulled, cached or both). Pure."""
    later = result.turns[1:]
    pulled = [t for t in later if t.reuse == PULLED]
    cached = [t for t in later if t.reuse == CACHED]
    parts = []
    if pulled:
        parts.append(f"{len(pulled)} pulled decode's retained KV ({sum(t.on.reused_tokens for t in pulled):,} tokens)")
    if cached:
        parts.append(f"{len(cached)} replayed decode's turn and found the history in prefill's prefix cache "
                     "(the rest recomputed: fewer tokens than a pull is worth)")
    line = f"turns 2-{len(result.turns)} reused KV: {'; '.join(parts)}; every answer matched reuse off"
    if not pulled:
        line += (". No turn pulled from decode here: prefill's prefix cache answered first, which is the deployment's "
                 "choice, so the pull path itself was not exercised")
    return line
