"""Play an agent trace (``bench.agent_trace``) against a router, arm by arm, and record every request.

Arms: ``off`` (``X-TurnKV-Reuse: off``: every prompt recomputed, unless prefill's own prefix cache holds part of
it), ``on`` (the router pulls the previous turn's KV back from decode), ``best`` (a second router, ``--best-url``,
whose prefill engine keeps a prefix cache, played with reuse off: what a sticky prefix-caching prefill gets) and
``peer`` (peer-best of ``bench.arms``: ``--peer-url``, the router of ``turnkv local up --peer``, reuse off). ``off``
salts every request (``bench.arms.body_extras``), so a prefill with prefix caching on recomputes it all. The
arms run one after the other, every session of an arm at once (sessions of two arms interleaved would queue behind
each other in one prefill engine, and each TTFT would measure that queue). Within an arm each session waits its
steps' think times (times ``time_scale``), a fork sends its branches at once and subagents run at once while their
parent waits. Every arm keeps its own histories: the assistant messages are the model's replies unchanged (the
router finds a turn by the digest of the history plus the reply decode generated), and greedy decoding makes the
replies of the arms comparable one by one.

Run: ``python -m bench.agent_bench --trace agent-coding --url http://127.0.0.1:8000 --out results/agent``, or
``turnkv bench agent``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import agent_trace, arms, client
from bench.agent_trace import Agent, Session
from bench.client import PREFILL_CACHED_HEADER, REUSE_OUTCOME_HEADER, REUSED_TOKENS_HEADER  # noqa: F401
from bench.runner import discover_model
from turnkv import router_env, wire

ARMS = ("off", "on", "best", "peer")
REUSE_HEADER = wire.REUSE_HEADER


@dataclass
class Record(client.Reply):
    """One request of an agent trace: where it sits in the session, what it measured (``client.Reply``), and when
    it ran."""

    arm: str
    session: int
    agent: str  # "main", or "sub<step>.<i>"
    step: int
    kind: str  # task, tool, user, fork, subagent (a subagent's first turn), join (the parent resuming)
    branch: int = 0
    #: Seconds since the arm started, when the request was sent and when its answer ended.
    started_s: float = 0.0
    ended_s: float = 0.0

    @property
    def key(self) -> tuple[int, str, int, int]:
        return (self.session, self.agent, self.step, self.branch)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def post_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                    record: Record, timeout: float, origin: float) -> Record:
    """POST a streaming chat completion and fill ``record`` (``bench.client.chat``), with when it started and ended
    on the run's clock (``origin``)."""
    started = time.perf_counter()
    record.started_s = round(started - origin, 4)
    await client.chat(session, url, body, headers, record, timeout)
    record.ended_s = round(started + (record.latency_ms or 0.0) / 1000 - origin, 4)
    record.latency_ms = None if record.latency_ms is None else round(record.latency_ms, 2)
    record.ttft_ms = None if record.ttft_ms is None else round(record.ttft_ms, 2)
    return record


@dataclass
class PlaySpec:
    url: str = router_env.LOCAL_URL
    arms: tuple[str, ...] = ("off", "on")
    best_url: str | None = None
    #: The peer-best arm's router (``turnkv local up --peer``: a prefix-caching prefill of its own, reuse off).
    peer_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    #: Think times are multiplied by this (0: no pauses).
    time_scale: float = 1.0
    timeout: float = 600.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def __post_init__(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms:
            raise ValueError(f"unknown arm {bad[0] if bad else '(none)'!r}: arms are {', '.join(ARMS)}")
        if "best" in self.arms and not self.best_url:
            raise ValueError("the best arm needs a second router: --best-url")
        if "peer" in self.arms and not self.peer_url:
            raise ValueError("the peer arm needs the peer-best router: --peer-url (turnkv local up --peer)")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")


def parse_arms(text: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"--arms: unknown arm {bad[0] if bad else '(none)'!r}; use a comma list of "
                         f"{', '.join(ARMS)}")
    return tuple(a for a in ARMS if a in arms)


def total_requests(sessions: list[Session], arms: tuple[str, ...]) -> int:
    return sum(s.requests() for s in sessions) * len(arms)


async def play(sessions: list[Session], spec: PlaySpec,
               on_record: Callable[[Record], None] = lambda r: None) -> list[Record]:
    """Every arm of ``spec``, one after the other; in each, every session at once."""
    records: list[Record] = []
    auth = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        model = spec.model or await discover_model(http, spec.url)
        for extra, name in ((spec.best_url, "best"), (spec.peer_url, "peer")):
            if extra and name in spec.arms:
                await discover_model(http, extra)  # reachable before anything is played
        for arm in spec.arms:
            url = {"best": spec.best_url, "peer": spec.peer_url}.get(arm) or spec.url
            headers = dict(auth) if arm == "on" else {**auth, **client.REUSE_OFF_HEADERS}
            origin = time.perf_counter()

            async def ask(s: Session, agent: str, step: int, kind: str, messages: list[dict[str, str]],
                          branch: int = 0, *, arm: str = arm, url: str = url, headers: dict[str, str] = headers,
                          origin: float = origin) -> Record:
                body = {"model": model, "messages": messages, "max_tokens": s.max_tokens, "temperature": 0,
                        "stream": True, "stream_options": {"include_usage": True},
                        "conversation_id": f"agent-{spec.run_id}-{arm}-{s.index}-{agent}",
                        **(arms.body_extras(arm) if arm == "off" else {})}
                record = Record(arm, s.index, agent, step, kind, branch)
                await post_chat(http, url, body, headers, record, spec.timeout, origin)
                records.append(record)
                on_record(record)
                return record

            async def run_agent(s: Session, agent: Agent, history: list[dict[str, str]], ask=ask) -> str:
                """Play ``agent``'s steps after ``history``; its last reply."""
                reply = ""
                for i, step in enumerate(agent.steps):
                    if step.think_s and spec.time_scale:
                        await asyncio.sleep(step.think_s * spec.time_scale)
                    if step.kind == "fork":
                        done = await asyncio.gather(*(ask(s, agent.name, i, "fork", [*history, *branch], b)
                                                      for b, branch in enumerate(step.branches)))
                        new, reply = list(step.branches[0]), done[0].reply  # the session goes on from branch 0
                    elif step.children:
                        finals = await asyncio.gather(*(run_agent(s, child, history) for child in step.children))
                        new = list(agent_trace.join_messages(list(finals)))
                        reply = (await ask(s, agent.name, i, "join", [*history, *new])).reply
                    else:
                        new = list(step.messages)
                        reply = (await ask(s, agent.name, i, step.kind, [*history, *new])).reply
                    history = [*history, *new, {"role": "assistant", "content": reply}]
                return reply

            await asyncio.gather(*(run_agent(s, s.main, [{"role": "system", "content": s.system}])
                                   for s in sessions))
    return records


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default="agent-coding", help="a trace file, or a shipped trace's name")
    p.add_argument("--url", default=router_env.LOCAL_URL, help="the router")
    p.add_argument("--best-url", default=None, help="a router over a prefix-caching prefill (the best arm)")
    p.add_argument("--peer-url", default=None, help="the peer-best router (turnkv local up --peer: port + 2)")
    p.add_argument("--arms", default=None, help="comma list of off,on,best (default: off,on, plus best with "
                                                "--best-url)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every think time (0: none)")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", type=Path, default=Path("results/agent"))
    return p


def default_arms(best_url: str | None, peer_url: str | None = None) -> str:
    return ",".join(["off", "on", *(["best"] if best_url else []), *(["peer"] if peer_url else [])])


def main(argv: list[str] | None = None) -> int:
    from bench import agent_report

    args = parser().parse_args(argv)
    try:
        trace = agent_trace.load(args.trace)
        spec = PlaySpec(url=args.url, arms=parse_arms(args.arms or default_arms(args.best_url, args.peer_url)),
                        best_url=args.best_url, peer_url=args.peer_url, model=args.model, api_key=args.api_key,
                        time_scale=args.time_scale)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    sessions = agent_trace.expand(trace)
    try:
        records = asyncio.run(play(sessions, spec))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"error: {type(exc).__name__}: {exc} (is the router at {args.url} up?)")
        return 1
    summary = agent_report.write(records, args.out, {"trace": trace.name, "url": args.url, "best_url": args.best_url,
                                                     "peer_url": args.peer_url, "time_scale": args.time_scale,
                                                     "off_salted": True})
    print(agent_report.markdown(summary))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
