"""The local twin as a discrete-event simulation of `turnkv bench capacity` and `bench pressure` on the local stack.
Pure, deterministic.

The closed-form twin (``twin``) prices a turn and queues the mean turn (MVA over one processor-shared station).
That cannot reproduce what the benchmark does at a level: N conversations started ``stagger`` apart, each playing a
few turns back to back, on two engines that each run a step loop. This module plays the same run event by event:

- **clients** as ``bench.runner`` drives them: conversation i starts at i x stagger, sends turn t+1 when turn t's
  reply has ended (after its think time), the reuse-off arm of a level then the reuse-on arm, level after level;
- **the prefill engine's step loop** as vLLM's scheduler runs it: requests in arrival order, each step takes up to
  ``chunk`` tokens (chunked prefill, a long prompt over several steps), the step's time is the calibrated
  closed-form compute of its chunks (GEMMs over all of them, each chunk's attention over its own context), and a
  request's reply token comes with the step that computes its last prompt token;
- **prefill's prefix cache** block by block (whole ``block`` blocks, LRU in ``prefill_blocks``): the reuse-off arm
  sends a fresh cache salt every request, so it never hits; the reuse-on arm finds the blocks an earlier turn or
  an earlier level computed (bench capacity builds the same conversations at every level, and greedy decoding
  gives the same replies);
- **the pull**: the tail decode holds beyond prefill's cache, pulled when the connector would (at least
  ``threshold`` tokens, and the pull's predicted time below recomputing it, ``connector.policy``'s rule), costing
  the calibrated fixed cost plus the transfer before the request's prefill;
- **the decode engine's step loop**: every running sequence decodes one token per step; a step costs
  ``decode_step_s + decode_seq_s x batch`` (fitted to a calibration run's per-request decode times); a turn's first
  token comes with the first decode step it joins after its P->D handover;
- **the CPU**: each engine is pinned to its own core, but the router, the clients and the engines' API servers
  float over both and move every streamed token; a prefill step that starts while decode is busy takes
  ``1 + contention`` times as long (fitted to the calibration run too; decode's own share is in its per-sequence
  cost);
- **decode's retention** for `bench pressure` (``retention_blocks``): the connector's own ledger
  (``connector.retention``) decides which finished turns stay for the next turn's pull, with think times between
  turns and text of its own per level (``simulate_pressure``).

The engine hops (``request_overhead_s`` each, measured by `turnkv plan calibrate` with one step inside) are delays,
plus a cost per prompt token and twice as long while their engine steps when ``hop_shares_core`` (attempt 4);
decode's loses the one decode step it holds, which is simulated. Attempt 5 (``hop_steals_step``, ``hop_when_sent``;
`twin-pressure --attempt 5`): a hop sharing a busy engine's core also delays that engine's next step by its own work,
and is priced as the engine is when the turn is sent, not when it was scheduled. With one conversation the simulated
TTFT is the closed form's (``turn_costs``) with decode's first step at the fitted cost, checked by a test.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from connector.retention import Held, ReadDelays, RetentionLedger
from turnkv.plan import closed_form as m

#: bench.workload's system prompt opens with 13 words and the chat template adds 3 tokens per message and one to
#: start the sequence (the mapping ``twin.CapacitySpec`` uses, checked against demo.json).
SYSTEM_EXTRA = 18
TEMPLATE_PER_MESSAGE = 3
ARMS = ("off", "on")
#: How the reuse-off arm's cache salt scopes prefill's prefix cache: "request" (a new salt every request, never a
#: hit), "conversation" (one per conversation and phase: its own earlier turns hit) or "none" (shared with the
#: reuse-on arm). Which one the stack shows is read off a calibration run (``salt_scope``), not assumed.
SALT_SCOPES = ("request", "conversation", "none")


@dataclass(frozen=True)
class SimConstants:
    """What the simulation needs beyond `turnkv plan calibrate`'s constants: decode's step cost and the CPU
    contention, fitted to a calibration run (``fit``); never to the runs it predicts."""

    decode_step_s: float = 0.010
    decode_seq_s: float = 0.0005
    contention: float = 0.0
    salt_scope: str = "request"
    #: Seconds per prompt token each engine hop spends beyond the calibrated one-token hop (rendering, tokenizing
    #: and routing a long prompt), fitted to the calibration run's level 1 (attempt 4 on; 0 before).
    hop_per_token_s: float = 0.0
    #: A hop's work runs in the engine's API server, pinned to the engine's core: while the engine steps, the two
    #: processes share the core and the hop takes twice as long (attempt 4 on; off before).
    hop_shares_core: bool = False
    #: A turn that reaches decode while it steps loads its KV during the next step and decodes from the one after
    #: (vLLM's asynchronous KV load); off in attempts 3-4 (a candidate checked in-sample only).
    kv_load_step: bool = False
    #: Processor sharing is symmetric: a hop that shares its engine's core (``hop_shares_core``) takes the engine's
    #: step as much CPU time as the hop's own work, so the engine's next step ends that much later (attempt 5 on:
    #: under saturation each request's hop then adds to the engine's service time, not only to its own TTFT).
    hop_steals_step: bool = False
    #: A turn's first hop meets its engine as the engine is when the turn is sent (attempt 5 on). Off (attempts
    #: 3-4): as it was when the turn was scheduled, i.e. at the phase's start for first turns and when the turn
    #: before ended for later ones, before the think time: under `bench pressure`'s think times a different moment.
    hop_when_sent: bool = False

    #: What every constants file holds (attempt 3's lacks the hop terms: they default to off).
    REQUIRED = ("decode_step_s", "decode_seq_s", "contention", "salt_scope")

    @classmethod
    def from_dict(cls, data: Any) -> SimConstants:
        """Constants as ``plan twin --fit`` writes them; ValueError naming what is wrong otherwise."""
        if not isinstance(data, dict) or any(k not in data for k in cls.REQUIRED):
            raise ValueError(f"expected an object with {', '.join(cls.REQUIRED)}")
        if data["salt_scope"] not in SALT_SCOPES:
            raise ValueError(f"salt_scope {data['salt_scope']!r}: one of {', '.join(SALT_SCOPES)}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Turn:
    prompt: int  # prompt tokens
    history: int  # tokens decode holds from the turn before (its prompt and reply but the last token)
    out: int  # reply tokens
    think_s: float = 0.0  # pause before the turn


def conversation(turns: int, system_words: int, first_user_words: int, turn_words: int, max_tokens: int,
                 think_s: float = 0.0) -> list[Turn]:
    """One ``bench.workload`` conversation in tokens (one token per word; later turns open with "tool result :" or
    "user :"; every message carries the template's tokens)."""
    out: list[Turn] = []
    prompt = system_words + SYSTEM_EXTRA + first_user_words + TEMPLATE_PER_MESSAGE
    history = 0
    for t in range(turns):
        if t:
            history = prompt + max_tokens - 1  # the reply but its last token (as the router reported)
            hint = 3 if t % 2 else 2
            prompt += max_tokens + TEMPLATE_PER_MESSAGE + turn_words + hint + TEMPLATE_PER_MESSAGE
        out.append(Turn(prompt, history, max_tokens, think_s if t else 0.0))
    return out


@dataclass
class _Request:
    conv: int
    turn: int
    arm: str
    level: int
    spec: Turn
    sent: float
    salt: str
    remaining: int = 0  # prompt tokens prefill still computes
    context: int = 0  # tokens before the next chunk (cached, pulled or computed)
    first_chunk: bool = True
    pulled: int = 0
    cached: int = 0
    produced: int = 0
    ttft: float | None = None


@dataclass
class Record:
    """One simulated turn, as ``bench.client.Result`` records it."""

    level: int
    arm: str
    conv: int
    turn: int
    ttft_ms: float
    latency_ms: float
    reused_tokens: int
    prefill_cached_tokens: int
    completion_tokens: int


@dataclass
class _Engine:
    busy_until: float = 0.0
    busy: bool = False
    debt: float = 0.0  # CPU seconds hops took from this engine's core while it stepped: its next step pays them


@dataclass
class Simulation:
    """One `bench capacity` sweep on the simulated local stack (``run``: every level, both arms)."""

    fleet: m.Fleet
    consts: SimConstants
    stagger_s: float = 0.2
    prefill_blocks: int = 1 << 20
    #: Decode's retention room in blocks (``retained_kv_share`` x its KV blocks), run by the connector's own ledger
    #: (``connector.retention``: a newcomer is refused when the room is full unless turns idle past ``idle_after``
    #: or read ones can go; evicted room frees ``eviction_grace_s`` later). None: room for every turn (a capacity
    #: run on the local stack holds a few dozen blocks of its 2,048).
    retention_blocks: float | None = None
    eviction_grace_s: float = 30.0
    idle_floor_s: float = 10.0
    ttl_s: float = 480.0
    #: Each level plays conversations with text of its own (bench pressure's seed per level): no block is shared
    #: between levels, the system prompt's included.
    per_level_content: bool = False
    #: Tokens every conversation shares (the system prompt with its template tokens): blocks wholly inside it are
    #: one cache entry for all conversations.
    system_tokens: int = 0
    records: list[Record] = field(default_factory=list)

    def __post_init__(self) -> None:
        f = self.fleet
        self.block = f.block_size
        self.chunk = int(f.prefill.prefill_chunk_tokens)
        self.hop_p = f.prefill.efficiency.request_overhead_s
        # The decode hop as calibrated (a one-token request) holds one unloaded decode step, simulated apart.
        self.hop_d = (max(f.decode.efficiency.request_overhead_s - self.decode_step_s(1), 0.0)
                      + f.prefill.efficiency.pd_handover_s)
        self.pull_fixed = m.pull_overhead_s(f)
        self.per_token = float(m.linear_compute_s(f, 1.0))
        self.cache: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self._salt = itertools.count()
        self.ledger = RetentionLedger() if self.retention_blocks is not None else None
        self.read_delays = ReadDelays()
        self._frees: list[tuple[float, str]] = []  # (when, request id) of announced turns

    # -- prefill's prefix cache ---------------------------------------------------------------------------------
    def _key(self, req: _Request, block: int) -> tuple[Any, ...]:
        # Blocks inside the shared system prompt are the same for every conversation; later ones are the
        # conversation's own (its first message differs).
        owner: Any = "system" if (block + 1) * self.block <= self.system_tokens else req.conv
        if self.per_level_content:
            owner = (req.level, owner)
        return (req.salt, owner, block)

    def _hit(self, req: _Request) -> int:
        """Tokens prefill's cache serves: whole blocks, at most prompt - 1 (vLLM computes the last token); none
        when prefill runs without prefix caching (bench pressure's own stacks: the seeds' setting)."""
        if not self.fleet.prefill_prefix_caching:
            return 0
        n = 0
        for b in range((req.spec.prompt - 1) // self.block):
            key = self._key(req, b)
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            n += self.block
        return n

    def _store(self, req: _Request) -> None:
        for b in range(req.spec.prompt // self.block):
            key = self._key(req, b)
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > self.prefill_blocks:
            self.cache.popitem(last=False)

    # -- costs --------------------------------------------------------------------------------------------------
    def prefill_step_s(self, chunks: list[tuple[int, int]], continuing_only: bool) -> float:
        """One prefill step over ``chunks`` (new tokens, context tokens): GEMMs over all, attention per chunk;
        a step with no request's first chunk pays the per-step cost the hop does not already hold."""
        new = np.array([c[0] for c in chunks], dtype=float)
        ctx = np.array([c[1] for c in chunks], dtype=float)
        compute, _, _ = m.compute_parts(self.fleet, new, ctx)
        memory = float(m.weight_bytes_read(self.fleet.model, new.sum())) / self.fleet.prefill.hbm_bytes_s
        step = self.fleet.prefill.efficiency.step_overhead_s if continuing_only else 0.0
        return max(float(compute.sum()), memory) + step

    def _shared(self, engine: _Engine) -> float:
        """How much longer a hop takes on ``engine``'s core now (processor sharing with its step loop)."""
        return 2.0 if self.consts.hop_shares_core and engine.busy else 1.0

    def _hop(self, engine: _Engine, work: float) -> float:
        """A hop of ``work`` CPU seconds on ``engine``'s core: its wall time, and (``hop_steals_step``) the time
        it takes from the engine's stepping, paid by the engine's next step."""
        shared = self._shared(engine)
        if shared > 1.0 and self.consts.hop_steals_step:
            engine.debt += work
        return work * shared

    def decode_step_s(self, batch: int) -> float:
        return self.consts.decode_step_s + self.consts.decode_seq_s * batch

    # -- decode's retention ---------------------------------------------------------------------------------------
    @staticmethod
    def _rid(req: _Request, turn: int | None = None) -> str:
        return f"{req.level}-{req.conv}-{req.turn if turn is None else turn}"

    def _free_due(self, now: float) -> None:
        """Free announced turns past their grace, and live ones past their TTL."""
        assert self.ledger is not None
        for when, rid in [f for f in self._frees if f[0] <= now]:
            self._frees.remove((when, rid))
            self.ledger.release(rid)
        for rid in [r for r, h in self.ledger.live.items() if h.expires_at <= now]:
            self.ledger.release(rid)

    def _offer(self, req: _Request, now: float) -> Any:
        """The previous turn decode still retains and offers (not announced: the router refuses those), else None."""
        if self.ledger is None:
            return True
        self._free_due(now)
        return self.ledger.live.get(self._rid(req, req.turn - 1))

    def _read(self, req: _Request, now: float) -> None:
        """A pull read the previous turn: single use, so freed (``fork_window`` 0), and its wait is a read delay."""
        if self.ledger is None:
            return
        held = self.ledger.release(self._rid(req, req.turn - 1))
        if held is not None:
            self.read_delays.observe(now - held.since)

    def _retain(self, req: _Request, now: float) -> None:
        """Decode finished a reuse-on turn: the ledger places it, or refuses it (and announces idle turns)."""
        if self.ledger is None:
            return
        self._free_due(now)
        blocks = math.ceil((req.spec.prompt + req.spec.out - 1) / self.block)
        placement = self.ledger.place(blocks, now, float(self.retention_blocks or 0.0), 0.0,
                                      lambda _t: self.read_delays.idle_after(0.0, self.ttl_s, None, self.idle_floor_s))
        for rid, _held in placement.evicted:
            self._frees.append((now + self.eviction_grace_s, rid))
        if placement.tier is not None:
            self.ledger.hold(self._rid(req), Held(blocks, now + self.ttl_s, placement.tier, now))

    def _pull_decision(self, tail: int, waiting: int) -> bool:
        """``connector.policy``: pull when the transfer beats recomputing, which also delays the waiting requests."""
        if tail < max(self.fleet.threshold, 1):
            return False
        pull = self.pull_fixed + float(m.transfer_s(self.fleet, tail))
        return pull < self.per_token * tail * (1 + waiting)

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self, conversations: list[list[Turn]], levels: list[int], arms: tuple[str, ...] = ARMS) -> list[Record]:
        """Every level (the first ``level`` conversations at once), each arm in its own phase, in order."""
        t0 = 0.0
        for level in levels:
            for arm in arms:
                t0 = self._phase(conversations[:level], level, arm, t0)
        return self.records

    def _phase(self, convs: list[list[Turn]], level: int, arm: str, start: float) -> float:
        seq = itertools.count()
        events: list[tuple[float, int, str, Any]] = []

        def push(t: float, kind: str, payload: Any) -> None:
            heapq.heappush(events, (t, next(seq), kind, payload))

        prefill, decode = _Engine(), _Engine()
        waiting: list[_Request] = []  # prefill's queue (arrival order), running ones first
        running_d: list[_Request] = []
        joining: list[_Request] = []
        loading: list[_Request] = []
        now = start
        now_box = [start]  # the event loop's clock, for send()

        def send(conv: int, turn: int, t: float) -> None:
            if self.consts.hop_when_sent and t > now_box[0]:
                push(t, "send", (conv, turn))  # the hop is priced when the turn is sent
                return
            spec = convs[conv][turn]
            scope = self.consts.salt_scope
            salt = ("on" if arm == "on" or scope == "none" else f"off-{level}-{conv}" if scope == "conversation"
                    else f"off-{next(self._salt)}")
            hop = self._hop(prefill, self.hop_p + self.consts.hop_per_token_s * spec.prompt)
            push(t + hop, "prefill_arrive", _Request(conv, turn, arm, level, spec, t, salt))

        def start_prefill(t: float) -> None:
            if prefill.busy or not waiting:
                prefill.debt = 0.0 if not prefill.busy else prefill.debt  # idle: the hop's share was the step's
                return
            budget, chunks, parts = self.chunk, [], []
            for req in waiting:
                if budget <= 0:
                    break
                n = min(req.remaining, budget)
                chunks.append((n, req.context))
                parts.append((req, n))
                budget -= n
            continuing = all(not r.first_chunk for r, _ in parts)
            # Decode streaming tokens (its API server, the router, the clients) takes CPU from prefill's core.
            dur = self.prefill_step_s(chunks, continuing) * (1 + self.consts.contention * decode.busy) + prefill.debt
            prefill.debt = 0.0
            prefill.busy = True
            push(t + dur, "prefill_step", parts)

        def start_decode(t: float) -> None:
            if decode.busy:
                return
            if self.consts.kv_load_step:
                # Arrived during a step: the scheduler starts its KV load at this boundary and runs it in the next
                # step only (those loaded during the last step join now); an idle engine just polls the load.
                running_d.extend(loading)
                loading[:] = joining
                if not running_d:
                    running_d.extend(loading)
                    loading.clear()
            else:
                running_d.extend(joining)
            joining.clear()
            if not running_d:
                decode.debt = 0.0  # idle: the hop's share fell in the step that just ended
                return
            dur = self.decode_step_s(len(running_d)) + decode.debt
            decode.debt = 0.0
            decode.busy = True
            push(t + dur, "decode_step", list(running_d))

        for i in range(len(convs)):
            send(i, 0, start + i * self.stagger_s)
        while events:
            now, _, kind, payload = heapq.heappop(events)
            now_box[0] = now
            if kind == "send":
                send(*payload, now)
            elif kind == "prefill_arrive":
                req = payload
                cached = self._hit(req)
                held = self._offer(req, now) if arm == "on" and req.spec.history else None
                req.cached = cached
                tail = req.spec.history - min(cached, req.spec.history)
                if held is not None and self._pull_decision(tail, len(waiting)):
                    req.pulled = tail
                    req.context = req.spec.history
                    req.remaining = req.spec.prompt - req.spec.history
                    push(now + self.pull_fixed + float(m.transfer_s(self.fleet, tail)), "pulled", req)
                    continue
                req.context, req.remaining = cached, req.spec.prompt - cached
                waiting.append(req)
                start_prefill(now)
            elif kind == "pulled":
                self._read(payload, now)
                waiting.append(payload)
                start_prefill(now)
            elif kind == "prefill_step":
                prefill.busy = False
                for req, n in payload:
                    req.remaining -= n
                    req.context += n
                    req.first_chunk = False
                    if req.remaining <= 0:
                        waiting.remove(req)
                        self._store(req)
                        # Decode reads the tokens it lacks (all of them when the salt is new) before its first step.
                        own = arm == "on" or self.consts.salt_scope != "request"
                        lacks = req.spec.prompt - (req.spec.history if own else 0)
                        hop = self._hop(decode, self.hop_d + self.consts.hop_per_token_s * req.spec.prompt)
                        push(now + hop + float(m.transfer_s(self.fleet, lacks, setup=self.fleet.mode != "push")),
                             "decode_arrive", req)
                start_prefill(now)
                start_decode(now)
            elif kind == "decode_arrive":
                joining.append(payload)
                start_decode(now)
            elif kind == "decode_step":
                decode.busy = False
                for req in payload:
                    req.produced += 1
                    if req.ttft is None:
                        req.ttft = now - req.sent
                    if req.produced >= req.spec.out:
                        running_d.remove(req)
                        if arm == "on":
                            self._retain(req, now)
                        self.records.append(Record(level, arm, req.conv, req.turn, req.ttft * 1000,
                                                   (now - req.sent) * 1000, req.pulled, req.cached,
                                                   req.spec.out))
                        if req.turn + 1 < len(convs[req.conv]):
                            send(req.conv, req.turn + 1, now + convs[req.conv][req.turn + 1].think_s)
                start_decode(now)
                start_prefill(now)
        return now


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank, as ``bench.capacity.percentile``."""
    vals = sorted(values)
    if not vals:
        return None
    return round(vals[max(0, math.ceil(q / 100 * len(vals)) - 1)], 1)


def token_ms(records: list[Any]) -> list[float]:
    """Milliseconds per decoded token after the first, per turn (``Record`` or records.jsonl rows)."""
    def get(r: Any, k: str) -> Any:
        return r[k] if isinstance(r, dict) else getattr(r, k)
    return [(get(r, "latency_ms") - get(r, "ttft_ms")) / (get(r, "completion_tokens") - 1) for r in records
            if get(r, "ttft_ms") is not None and (get(r, "completion_tokens") or 0) > 1]


def summarize(records: list[Record], levels: list[int], target_factor: float = 2.0) -> dict[str, Any]:
    """Per level and arm as ``bench capacity`` reports it (TTFT p50/p90, reuse share, samples), and the levels
    sustained under its default target."""
    rows = []
    for level in levels:
        row: dict[str, Any] = {"concurrency": level}
        for arm in ARMS:
            rs = [r for r in records if r.level == level and r.arm == arm]
            later = [r for r in rs if r.turn > 0]
            tpot = token_ms(rs)
            row[arm] = {"ttft_p50_ms": percentile([r.ttft_ms for r in rs], 50),
                        "ttft_p90_ms": percentile([r.ttft_ms for r in rs], 90),
                        "reuse_share": (round(sum(r.reused_tokens > 0 for r in later) / len(later), 3)
                                        if later else None),
                        "ttft_mean_ms": round(float(np.mean([r.ttft_ms for r in rs])), 1) if rs else None,
                        "samples": len(rs), "token_ms": round(float(np.mean(tpot)), 2) if tpot else None}
        rows.append(row)
    target = target_factor * rows[0]["off"]["ttft_p90_ms"] if rows and rows[0]["off"]["ttft_p90_ms"] else 0.0

    def sustained(arm: str) -> int:
        best = 0
        for r in rows:
            if r[arm]["ttft_p90_ms"] is None or r[arm]["ttft_p90_ms"] > target:
                break
            best = r["concurrency"]
        return best

    return {"levels": rows, "target_ms": round(target, 1), "sustained_off": sustained("off"),
            "sustained_on": sustained("on")}


def simulate(fleet: m.Fleet, consts: SimConstants, conversations: list[list[Turn]], levels: list[int],
             system_tokens: int = 0, stagger_s: float = 0.2) -> dict[str, Any]:
    """Play the sweep and summarize it."""
    sim = Simulation(fleet, consts, stagger_s, system_tokens=system_tokens)
    records = sim.run(conversations, levels)
    return summarize(records, levels) | {"records": len(records)}


def _bisect(f: Any, want: float, lo: float, hi: float, steps: int = 40) -> float:
    """The x in [lo, hi] where the increasing ``f(x)`` meets ``want`` (the nearer end if it never does)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < want else (lo, mid)
    return (lo + hi) / 2


def salt_scope(rows: list[dict[str, Any]]) -> str:
    """What a calibration run shows of the reuse-off arm's prefill cache hits: none ("request"), its own earlier
    turns ("conversation"), or even turns played at an earlier level ("none")."""
    off = [r for r in rows if r["arm"] == "off" and r.get("error") is None]
    later = [r for r in off if r["turn"] > 0]
    if not later or sum(r["prefill_cached_tokens"] > 0 for r in later) <= len(later) / 2:
        return "request"
    first_level = min(r["level"] for r in off)
    replayed = [r for r in off if r["turn"] == 0 and r["level"] > first_level and r["conversation"] == 0]
    return "none" if replayed and all(r["prefill_cached_tokens"] > 0 for r in replayed) else "conversation"


def fit(fleet: m.Fleet, conversations: list[list[Turn]], levels: list[int], rows: list[dict[str, Any]],
        system_tokens: int = 0, stagger_s: float = 0.2, shares_core: bool = True,
        kv_load_step: bool = False) -> SimConstants:
    """The simulation's own constants from a *calibration* capacity run's records.jsonl (never a predicted run's):
    the reuse-off arm's cache scope; decode's step cost at one sequence (level 1's time per token: one sequence
    per step, the engines never busy together); its cost per extra sequence (the top level's time per token);
    the contention (the top level's mean reuse-off TTFT: smoother in it than a percentile). The last two by
    bisection on the simulation. ``shares_core`` (attempt 4's model): hops share their engine's core, and their cost
    per prompt token is fitted to level 1 first; off: attempt 3's model."""
    ok = [r for r in rows if r.get("error") is None]
    scope = salt_scope(ok)
    low, top = min(levels), max(levels)
    one = float(np.mean(token_ms([r for r in ok if r["level"] == low]))) / 1000
    top_rows = [r for r in ok if r["level"] == top]
    want_token = float(np.mean(token_ms(top_rows)))
    want_off = float(np.mean([r["ttft_ms"] for r in top_rows if r["arm"] == "off"]))
    consts = SimConstants(one, 0.0, 0.0, scope, hop_shares_core=shares_core, kv_load_step=kv_load_step)

    def simulated(c: SimConstants, at: list[int]) -> list[Record]:
        return Simulation(fleet, c, stagger_s, system_tokens=system_tokens).run(conversations, at)

    def run(c: SimConstants) -> dict[str, Any]:
        return summarize(simulated(c, levels), levels)["levels"][-1]

    if shares_core:
        # Level 1's TTFT beyond the simulated one against prompt length: both hops' cost per prompt token
        # (least squares through the origin: the one-token hop is calibrated).
        measured = {(r["arm"], r["conversation"], r["turn"]): r["ttft_ms"] / 1000 for r in ok if r["level"] == low}
        pairs = [(rec.ttft_ms / 1000, measured[(rec.arm, rec.conv, rec.turn)], conversations[rec.conv][rec.turn].prompt)
                 for rec in simulated(consts, [low]) if (rec.arm, rec.conv, rec.turn) in measured]
        num = sum((want - got) * n for got, want, n in pairs)
        den = sum(n * n for _, _, n in pairs)
        consts = replace(consts, hop_per_token_s=max(num / den / 2, 0.0) if den else 0.0)

    for _ in range(3):
        b = _bisect(lambda x, c=consts: np.mean([run(replace(c, decode_step_s=max(one - x, 0.0), decode_seq_s=x))[a]
                                                 ["token_ms"] for a in ARMS]), want_token, 0.0, one)
        consts = replace(consts, decode_step_s=max(one - b, 0.0), decode_seq_s=b)
        k = _bisect(lambda x, c=consts: run(replace(c, contention=x))["off"]["ttft_mean_ms"], want_off, 0.0, 3.0)
        consts = replace(consts, contention=k)
    return consts


# -- bench pressure --------------------------------------------------------------------------------------------

#: bench.pressure_calc.last_turn_tokens: the system prompt opens with 13 words; every message carries 3 template
#: tokens (system, each user turn, each reply).
PRESSURE_SYSTEM_OPENING = 13


def pressure_fit(turns: int, system_words: int, first_user_words: int, turn_words: int, max_tokens: int,
                 room_blocks: int, block: int) -> int:
    """Conversations whose last turn fits decode's retention room, as ``bench.pressure_calc.compute_fit`` counts
    them (a conversation's last turn: every word, every reply, the template's tokens per message)."""
    words = (system_words + PRESSURE_SYSTEM_OPENING + first_user_words
             + sum(turn_words + (3 if t % 2 else 2) for t in range(1, turns)) + turns * max_tokens)
    last = words + (1 + turns + turns - 1) * TEMPLATE_PER_MESSAGE
    return max(1, room_blocks // math.ceil(last / block))


def summarize_pressure(records: list[Record], counts: list[int]) -> list[dict[str, Any]]:
    """Per level as ``bench.pressure_calc.level_summary`` reports it: the reuse share of later turns (reuse on),
    TTFT p50/p90 of later turns and of every turn per arm, and how many turns each figure has."""
    rows = []
    for n in counts:
        on = [r for r in records if r.level == n and r.arm == "on"]
        off = [r for r in records if r.level == n and r.arm == "off"]
        later_on, later_off = [r for r in on if r.turn > 0], [r for r in off if r.turn > 0]
        rows.append({
            "conversations": n, "later_turns": len(later_on),
            "reuse_share": round(sum(r.reused_tokens > 0 for r in later_on) / len(later_on), 3) if later_on else None,
            "ttft_on_later_p50_ms": percentile([r.ttft_ms for r in later_on], 50),
            "ttft_on_later_p90_ms": percentile([r.ttft_ms for r in later_on], 90),
            "ttft_off_later_p50_ms": percentile([r.ttft_ms for r in later_off], 50),
            "ttft_off_later_p90_ms": percentile([r.ttft_ms for r in later_off], 90),
            "ttft_on_p50_ms": percentile([r.ttft_ms for r in on], 50),
            "ttft_on_p90_ms": percentile([r.ttft_ms for r in on], 90),
            "ttft_off_p50_ms": percentile([r.ttft_ms for r in off], 50),
            "ttft_off_p90_ms": percentile([r.ttft_ms for r in off], 90),
        })
    return rows


def simulate_pressure(fleet: m.Fleet, consts: SimConstants, conversation_turns: list[Turn], counts: list[int],
                      room_blocks: float, system_tokens: int = 0, stagger_s: float = 0.2) -> list[dict[str, Any]]:
    """`bench pressure` on one stack (``--stack-per variant``): each level's ``n`` conversations (text of their own)
    reuse on, then the same turns reuse off (a new cache salt every request, as in bench capacity; decode retains
    nothing for them), with the retention room ``room_blocks``."""
    sim = Simulation(fleet, consts, stagger_s, system_tokens=system_tokens, retention_blocks=room_blocks,
                     per_level_content=True)
    return summarize_pressure(sim.run([conversation_turns] * max(counts), counts, arms=("on", "off")), counts)
