"""The multi-turn A/B runner: every conversation is played with reuse off and on, turn by turn.

One conversation at a time, the arms of a conversation are interleaved (turn t: off, on[, best]) so
that machine noise hits them alike. With several conversations at once the arms run in phases (every
conversation with reuse off, then every one with reuse on): interleaved, an arm's requests would queue
behind the other arm's in the one prefill engine, and each TTFT would measure that shared queue, not
a fleet with or without reuse. Each arm keeps its own history (its own replies), so the comparison also
checks that reuse never changes an answer: with greedy decoding the replies must be identical.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from bench.client import REUSE_OFF_HEADERS, Result, chat
from bench.workload import Conversation, WorkloadSpec, build


@dataclass
class RunSpec:
    url: str
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    ab: bool = False
    #: A router whose prefill engine keeps a prefix cache: the turn is sent there twice, the second timed.
    best_url: str | None = None
    #: The peer-best arm's router (``bench.arms``: a prefix-caching prefill, no decode-to-prefill reuse); it may be
    #: ``best_url``'s: the two arms carry cache salts of their own, so neither finds the other's blocks.
    peer_url: str | None = None
    model: str | None = None
    concurrency: int = 1
    think_time: float = 0.0
    timeout: float = 600.0
    api_key: str | None = None
    words: list[str] | None = None
    #: Conversations to play instead of ``workload``'s (``bench.workload.from_workload_file``).
    conversations: list[Conversation] | None = None
    #: Play only the reuse-off arm (the capacity sweep runs each arm on its own, so a level's load is one arm).
    reuse_off: bool = False
    #: Conversation i starts i x stagger seconds after the first (a closed loop that is not in lock-step).
    stagger: float = 0.0
    #: Names the conversations (distinct per sweep level, so no level reuses another's KV).
    tag: str = ""
    #: Arms one after the other (None: when more than one conversation is in flight).
    phased: bool | None = None

    @property
    def arms_in_phases(self) -> bool:
        return self.concurrency > 1 if self.phased is None else self.phased

    @property
    def arms(self) -> list[str]:
        if self.reuse_off:
            return ["off"]
        arms = ["off", "on"] if self.ab else ["on"]
        arms += ["best"] if self.best_url else []
        return [*arms, "peer"] if self.peer_url else arms

    @property
    def total_requests(self) -> int:
        if self.conversations is not None:
            return sum(len(c.user_turns) for c in self.conversations) * len(self.arms)
        return self.workload.conversations * self.workload.turns * len(self.arms)


async def discover_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
        resp.raise_for_status()
        data = await resp.json()
    return data["data"][0]["id"]


async def run(spec: RunSpec, on_result: Callable[[Result], None] = lambda r: None) -> list[Result]:
    run_id = uuid.uuid4().hex[:8]
    conversations = spec.conversations if spec.conversations is not None else build(spec.workload, spec.words)
    results: list[Result] = []
    limit = asyncio.Semaphore(spec.concurrency)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = spec.model or await discover_model(session, spec.url)

        async def turn_request(conv: Conversation, turn: int, arm: str, replies: list[str]) -> Result:
            body = {
                "model": model,
                "messages": conv.messages_for(turn, replies),
                "max_tokens": conv.max_tokens[turn] if conv.max_tokens else spec.workload.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "conversation_id": f"bench-{run_id}{spec.tag}-{conv.index}-{arm}",
            }
            arm_headers = dict(headers)
            url = spec.url
            if arm in ("off", "best", "peer"):
                arm_headers.update(REUSE_OFF_HEADERS)
            # Salts keep the arms' prefill caches apart: off's is new every request (prefill recomputes it all, the
            # seeds' setting, even where prefill caches), best's and peer's are their own for the run.
            if arm == "off":
                body["cache_salt"] = f"off-{uuid.uuid4().hex}"
            elif arm in ("best", "peer"):
                body["cache_salt"] = f"{arm}-{run_id}"
            if arm == "peer":
                assert spec.peer_url
                url = spec.peer_url
            if arm == "best":
                assert spec.best_url
                url = spec.best_url
                # Best case: a P/D prefill engine whose prefix cache holds everything it computed for this
                # conversation so far, with room for all of it: the previous turn's prompt (the history up to the
                # last user/tool message and the assistant header). Not decode's reply: in P/D decode computes it
                # and no prefill ever sees it (turnkv's pull is what brings it back). Turn 1: the system prompt.
                warm = dict(body, messages=body["messages"][:-2], max_tokens=1) if turn else dict(
                    body, messages=body["messages"][:-1], max_tokens=1, add_generation_prompt=False)
                warm.pop("conversation_id")
                await chat(session, url, warm, arm_headers, Result(conv.index, turn, "warm"), spec.timeout)
            return await chat(session, url, body, arm_headers, Result(conv.index, turn, arm), spec.timeout)

        async def converse(conv: Conversation, arms: list[str]) -> None:
            if spec.stagger:
                await asyncio.sleep(conv.index * spec.stagger)
            async with limit:
                replies: dict[str, list[str]] = {arm: [] for arm in arms}
                for turn in range(len(conv.user_turns)):
                    if conv.think_s and conv.think_s[turn]:
                        await asyncio.sleep(conv.think_s[turn])
                    for arm in arms:
                        result = await turn_request(conv, turn, arm, replies[arm])
                        replies[arm].append(result.reply)
                        results.append(result)
                        on_result(result)
                    if spec.think_time and not conv.think_s:
                        await asyncio.sleep(spec.think_time)

        for arms in ([[arm] for arm in spec.arms] if spec.arms_in_phases else [spec.arms]):
            await asyncio.gather(*(converse(c, arms) for c in conversations))
    return results
