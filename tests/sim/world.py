"""One simulated deployment (a router, a prefill engine, a decode engine) driven through a random schedule.

The engine models play vLLM's scheduler loop around the connector (looks at waiting requests every step until
they are allocated, asynchronous and synchronous loads, failed loads truncated at their first invalid block,
finished requests' blocks held until their transfer is reported) and the router around the engines (single-use
and fork-readable replays cleared with a read-by instant, the evictions feed, lease renewals). Every decision that
is not the connector's (which action next, allocation failures, latencies, faults, the scripted cost model's
answers) comes from one seeded generator, so a seed replays its schedule exactly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import traceback
import types
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus

from connector.leases import merge_feeds
from connector.worker import TurnkvWorkerMeta
from tests.sim import adapters
from tests.sim.fabric import BLOCK_LEN, REGIONS, AgentView, Fabric, Memory
from tests.sim.model import BLOCK_SIZE, Trace, Violation, block_fault, block_labels, token_at
from tests.sim.upstream import (
    Directory,
    SimBlocks,
    agent_metadata,
    handshake_payload,
    kv_cache_config,
    vllm_config,
)
from turnkv import params as catalog
from turnkv import wire

SECRET = "sim-offer-secret-" + "s" * 16
BS = BLOCK_SIZE
#: The fake wall clock starts here: ahead of the real clock, which the replay guard reads (connector.offers).
START = 2_000_000_000.0
#: perf_counter = wall - this (another epoch, as on a real host).
PERF_EPOCH = 1_999_000_000.0
#: A poll's sleep counts as at least this much fake time (the inline wait polls every 0.2 ms for up to 10 s).
MIN_SLEEP = 0.05


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FakeClock:
    """Wall clock, perf clock (another epoch) and sleep, all fake."""

    def __init__(self) -> None:
        self.wall = START

    def time(self) -> float:
        return self.wall

    def perf(self) -> float:
        return self.wall - PERF_EPOCH

    def sleep(self, seconds: float) -> None:
        self.wall += max(float(seconds), MIN_SLEEP)

    def advance(self, seconds: float) -> None:
        self.wall += seconds


@contextlib.contextmanager
def simulated(clock: FakeClock, tunables_path: str) -> Iterator[None]:
    """The connector's clocks and environment for one schedule (restored afterwards)."""
    saved = (time.time, time.perf_counter, time.sleep)
    env = {wire.OFFER_SECRET_ENV: SECRET, wire.MODEL_FINGERPRINT_ENV: "sim-model",
           catalog.TUNABLES_FILE_ENV: tunables_path}
    old_env = {k: os.environ.get(k) for k in env}
    quiet = logging.getLogger("vllm.turnkv.connector")  # disabled, not re-levelled: setLevel clears every cache
    disabled = quiet.disabled
    os.environ.update(env)
    time.time, time.perf_counter, time.sleep = clock.time, clock.perf, clock.sleep  # type: ignore[assignment]
    quiet.disabled = True
    try:
        yield
    finally:
        time.time, time.perf_counter, time.sleep = saved  # type: ignore[assignment]
        quiet.disabled = disabled
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class Config:
    """One schedule's deployment, drawn from its seed (router settings kept valid: grace >= what they need)."""

    tp: int
    decode_blocks: int
    prefill_blocks: int
    retained_share: float
    host_slots: int
    fork_window: float
    skew: float
    replay_window: float
    interval: float
    grace: float
    ttl: float
    idle_evict: float
    threshold: int
    inline_ms: float
    cost: str  # "learned" or "scripted"
    p_recompute: float
    p_alloc_fail: float
    lookahead: int  # decode's num_lookahead_tokens (speculative decoding): blocks held past the last token
    reuse_first: bool  # decode's pool hands freed blocks out first (as a nearly full pool does)
    starve: float  # how often prefill runs out of KV room for a while (action weight)
    elsewhere: float  # how often decode gets a turn another prefill engine prefilled (action weight)
    prefix_cache: bool
    tenants: int
    convs: int
    ticks: int

    @classmethod
    def draw(cls, rng: random.Random, scenario: str = "default") -> Config:
        """``scenario`` "spec": decode runs speculative decoding (lookahead slots); "default": it does not."""
        skew, window, interval = rng.choice([1, 2, 5]), rng.choice([2.0, 5.0, 10.0]), rng.choice([0.5, 1.0, 2.0])
        needed = catalog.eviction_grace_needed({"evictions_interval": interval, "replay_window": window,
                                                "expiry_skew_margin": skew})
        return cls(tp=rng.choice([1, 1, 1, 2]), decode_blocks=rng.randint(24, 64), prefill_blocks=rng.randint(20, 48),
                   retained_share=rng.choice([0.1, 0.2, 0.35, 0.5]), host_slots=rng.choice([0, 8, 16, 32]),
                   fork_window=rng.choice([0.0, 0.0, 5.0, 20.0]), skew=skew, replay_window=window, interval=interval,
                   grace=float(int(needed) + 1 + rng.choice([0, 2, 10])), ttl=float(rng.choice([30, 60, 120, 480])),
                   idle_evict=float(rng.choice([0, 0, 5, 20])), threshold=rng.choice([0, 0, 4, 8, 16]),
                   inline_ms=float(rng.choice([0, 25, 25, 1000])), cost=rng.choice(["learned", "scripted", "scripted"]),
                   p_recompute=rng.choice([0.2, 0.5]), p_alloc_fail=rng.choice([0.0, 0.2, 0.5]),
                   lookahead=rng.choice([1, 2, 3]) if scenario == "spec" else 0, reuse_first=rng.random() < 0.4,
                   starve=rng.choice([0.0, 0.2, 0.6]), elsewhere=rng.choice([0.0, 0.5, 1.5]),
                   prefix_cache=rng.random() < 0.5, tenants=rng.randint(2, 3), convs=rng.randint(3, 6),
                   ticks=rng.randint(60, 140))

    def short(self) -> str:
        return (f"tp={self.tp} decode_blocks={self.decode_blocks} prefill_blocks={self.prefill_blocks} "
                f"share={self.retained_share} host_slots={self.host_slots} fork_window={self.fork_window} "
                f"skew={self.skew} replay_window={self.replay_window} interval={self.interval} grace={self.grace} "
                f"ttl={self.ttl} idle_evict={self.idle_evict} threshold={self.threshold} inline_ms={self.inline_ms} "
                f"cost={self.cost}({self.p_recompute}) alloc_fail={self.p_alloc_fail} lookahead={self.lookahead} "
                f"reuse_first={self.reuse_first} starve={self.starve} elsewhere={self.elsewhere} "
                f"prefix_cache={self.prefix_cache} tenants={self.tenants} convs={self.convs}")


class SimRequest:
    """The fields of ``vllm.v1.request.Request`` the connector and upstream's scheduler read."""

    def __init__(self, request_id: str, prompt: list[int], params: dict[str, Any] | None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt)
        self._all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.kv_transfer_params = params
        self.max_tokens = 1

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)


class BlockPool:
    """vLLM's block pool, as far as a schedule needs it: free blocks (least recently freed first), reference counts,
    and (prefix caching) full blocks findable by the tokens up to their end until they are reused."""

    def __init__(self, size: int, reuse_first: bool = False) -> None:
        self.size, self.reuse_first = size, reuse_first
        self.free: deque[int] = deque(range(size))
        self.refs = [0] * size
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.by_key: dict[tuple[int, ...], int] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free)

    def local_hit(self, prompt: list[int]) -> list[int]:
        hit = []
        for i in range((len(prompt) - 1) // BS):  # vLLM computes at least the last token
            block = self.by_key.get(tuple(prompt[:(i + 1) * BS]))
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate(self, hit: list[int], fresh: int) -> list[int] | None:
        if fresh > len([b for b in self.free if b not in hit]):
            return None
        for block in hit:
            if self.refs[block] == 0:
                self.free.remove(block)
            self.refs[block] += 1
        out = []
        for _ in range(fresh):
            block = self.free.popleft()
            key = self.key_of.pop(block, None)
            if key is not None:
                self.by_key.pop(key, None)
            self.refs[block] = 1
            out.append(block)
        return list(hit) + out

    def cache(self, block: int, key: tuple[int, ...]) -> None:
        if key not in self.by_key and block not in self.key_of:
            self.by_key[key] = block
            self.key_of[block] = key

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.refs[block] <= 0:
                continue
            self.refs[block] -= 1
            if self.refs[block] == 0:
                # a nearly full pool hands a freed block out next (reuse_first): the hazards come sooner
                (self.free.appendleft if self.reuse_first else self.free.append)(block)


@dataclass
class Conv:
    cid: str
    number: int
    tenant: str
    tokens: list[int]
    key: str  # the router's key for its next turn (a fork's first turn reads its parent's)
    busy: bool = False
    turns: int = 0


@dataclass
class Entry:
    params: dict[str, Any]
    stored_at: float
    fork_until: float = 0.0


@dataclass
class PReq:
    rid: str
    conv: Conv
    prompt: list[int]
    request: SimRequest
    tier: str | None  # the tier of the offer it was sent with (None: none)
    blocks: list[int] = field(default_factory=list)
    local: int = 0
    external: int = 0
    resumed: bool = False  # scheduled before: vLLM does not ask the connector again
    remote: bool = False  # WAITING_FOR_REMOTE_KVS: skipped (keeping its place in the queue) until received
    loading: bool = False  # scheduled this step with a synchronous (inline) load


@dataclass
class DReq:
    rid: str
    conv: Conv
    prompt: list[int]
    reply: int
    request: SimRequest
    blocks: list[int] = field(default_factory=list)
    generated: int = 0


class Aggregator:
    """vLLM's ``KVOutputAggregator``: a request is finished sending or receiving once every rank said so."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.sending: Counter[str] = Counter()
        self.recving: Counter[str] = Counter()
        self.failed: set[str] = set()

    def add(self, results: list[Any]) -> tuple[set[str], set[str], set[str]]:
        sent, received = set(), set()
        for result in results:
            for rid in result.finished_sending:
                self.sending[rid] += 1
                if self.sending[rid] == self.world_size:
                    del self.sending[rid]
                    sent.add(rid)
            self.failed |= set(result.failed_recving or ())
            for rid in result.finished_recving:
                self.recving[rid] += 1
                if self.recving[rid] == self.world_size:
                    del self.recving[rid]
                    received.add(rid)
        failed = received & self.failed
        self.failed -= received
        return sent, received, failed


class Engine:
    """What both engine models share: the connector's scheduler and one worker per TP rank, over the fabric."""

    def __init__(self, world: World, engine_id: str, blocks: int, extra: dict[str, Any], boot: int,
                 reuse_first: bool = False) -> None:
        self.world, self.engine_id, self.boot = world, engine_id, boot
        tp = world.cfg.tp
        self.memories: list[Memory] = []
        self.agents: list[str] = []
        self.workers: list[adapters.SimWorker] = []
        metas = []
        for rank in range(tp):
            agent = f"{engine_id}#b{boot}r{rank}"
            memory = Memory(agent, "device", blocks, 0x10_0000_0000 + rank * 0x1_0000_0000, world.clock.perf)
            world.fabric.register(agent, memory)
            worker = adapters.SimWorker(engine_id, rank, tp, AgentView(world.fabric, agent, memory),
                                        world.directory, BS, world.on_read)
            meta = agent_metadata(engine_id, agent, memory, BS)
            worker.xfer_handshake_metadata = handshake_payload(meta)
            self.memories.append(memory)
            self.agents.append(agent)
            self.workers.append(worker)
            metas.append(meta)
        world.directory.engines[engine_id] = metas
        self.pool = BlockPool(blocks, reuse_first)
        self.scheduler = adapters.SimScheduler(vllm_config(tp, BS, extra), engine_id, kv_cache_config(blocks))
        self.scheduler.set_xfer_handshake_metadata({(0, r): handshake_payload(m) for r, m in enumerate(metas)})
        self.aggregator = Aggregator(tp)

    def collect(self) -> tuple[set[str], set[str], set[str], set[int]]:
        """The step's output from every rank: to the scheduler (``update_connector_output``), and what vLLM's
        scheduler needs (finished sending, finished and failed receiving, blocks that failed to load)."""
        results = [w.get_transfer_results() for w in self.workers]
        invalid: set[int] = set()
        for worker in self.workers:
            invalid |= worker.get_block_ids_with_load_errors()
        meta = None
        for worker in self.workers:
            mine = worker.build_turnkv_meta()
            if mine is not None:
                meta = mine if meta is None else meta.aggregate(mine)
        sent, received, failed = self.aggregator.add(results)
        output = types.SimpleNamespace(finished_sending=sent, finished_recving=received, failed_recving=failed,
                                       kv_connector_worker_meta=meta if isinstance(meta, TurnkvWorkerMeta) else None)
        self.scheduler.update_connector_output(output)
        return sent, received, failed, invalid

    def start_load(self, scheduled_tokens: int) -> Any:
        meta = self.scheduler.build_connector_meta(types.SimpleNamespace(total_num_scheduled_tokens=scheduled_tokens))
        stats = self.world.stats  # coverage: what the scheduler asked its workers to do this step
        for name in ("turnkv_to_host", "turnkv_evict", "turnkv_forkable"):
            stats[name.removeprefix("turnkv_")] += len(getattr(meta, name, None) or ())
        stats["inline"] += sum(1 for plan in (getattr(meta, "turnkv_reads", None) or {}).values() if plan.inline)
        for worker in self.workers:
            worker.start_load_kv(meta)
        return meta

    def write(self, rid: str, conv: Conv, tokens: list[int], blocks: list[int], first_block: int = 0) -> None:
        """A forward over ``tokens``: each rank's blocks from ``first_block`` on hold their KV."""
        for rank, memory in enumerate(self.memories):
            for i, label in enumerate(block_labels(conv.tenant, conv.cid, rid, rank, tokens)):
                if i >= first_block:
                    memory.write(blocks[i], label)


class PrefillEngine(Engine):
    def __init__(self, world: World) -> None:
        cfg = world.cfg
        super().__init__(world, "prefill-0", cfg.prefill_blocks,
                         {"kv_recompute_threshold": cfg.threshold, "inline_pull_max_ms": cfg.inline_ms,
                          "expiry_skew_margin": cfg.skew, "decoder_kv_blocks_ttl": cfg.ttl}, boot=1)
        # The scheduler's cost model (a public attribute): scripted answers, or the learned ones (logged either way).
        self.scheduler.cost = adapters.ScriptedCost(world.rng, cfg.p_recompute if cfg.cost == "scripted" else 0.0,
                                                    lambda text: world.note(f"{world.looking}: {text}"))
        self.waiting: list[PReq] = []  # vLLM's waiting queue, in arrival order (remote loads keep their place)
        self.held: dict[str, list[int]] = {}  # finished, blocks kept until decode read them (or the lease ends)
        self.starved_until = 0.0  # no KV room for new admissions until then (a long queue ahead of them)
        self.orphans: dict[str, list[int]] = {}  # aborted while their READ was in flight

    def active(self) -> int:
        return len(self.waiting)

    def remote(self) -> list[PReq]:
        return [p for p in self.waiting if p.remote]

    def step(self) -> None:
        w = self.world
        scheduled: list[tuple[PReq, int]] = []
        tokens = 0
        for preq in list(self.waiting):
            req = preq.request
            total = len(preq.prompt)
            if preq.remote:
                continue  # vLLM skips it (it keeps its place) until its load is reported
            if req.num_computed_tokens == 0 and not preq.resumed:
                hit = self.pool.local_hit(preq.prompt) if w.cfg.prefix_cache else []
                local = len(hit) * BS
                w.looking = preq.rid
                count, load_async = self.scheduler.get_num_new_matched_tokens(req, local)
                count = int(count or 0)
                load_async = bool(load_async) and count > 0
                w.note(f"prefill look {preq.rid} (local hit {local}): {count} tokens "
                       f"{'async' if load_async else 'sync' if count else ''} "
                       f"[{adapters.admission_note(self.scheduler, preq.rid)}]")
                upto = local + count if load_async else total
                fresh = cdiv(upto, BS) - len(hit)
                starved = w.clock.time() < self.starved_until or w.rng.random() < w.cfg.p_alloc_fail
                blocks = None if starved else self.pool.allocate(hit, fresh)
                if blocks is None:
                    w.note(f"prefill: no KV room for {preq.rid} this step")
                    break
                preq.blocks, preq.local, preq.external = blocks, local, count
                hashed = len(hit) if load_async or count == 0 else (local + count) // BS
                self.scheduler.update_state_after_alloc(req, SimBlocks(blocks, hashed), count)
                preq.resumed = True
                w.note(f"prefill alloc {preq.rid}: blocks {blocks} (external {count})")
                if load_async:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    req.num_computed_tokens = local + count
                    preq.remote = True
                    continue
                scheduled.append((preq, local + count))
                preq.loading = count > 0
                tokens += total - local - count
            else:
                more = cdiv(total, BS) - len(preq.blocks)
                extra = self.pool.allocate([], more) if more > 0 else []
                if extra is None:
                    w.note(f"prefill: no KV room for {preq.rid} this step")
                    break
                preq.blocks += extra
                scheduled.append((preq, req.num_computed_tokens))
                tokens += total - req.num_computed_tokens
        if not scheduled and not self.remote() and not self.held and not self.orphans:
            self.start_load(0)
            self.collect()
            return
        self.start_load(tokens)
        w.clock.advance(w.rng.uniform(0.01, 0.04))  # the forward
        sent, received, failed, invalid = self.collect()
        for preq, _ in scheduled:
            preq.loading = False  # the step's forward is done: a READ landing from now on is late
        for preq, computed in scheduled:
            bad = next((i for i in range(cdiv(computed, BS)) if preq.blocks[i] in invalid), None)
            if bad is not None:  # a failed synchronous load: this step's output is dropped, recomputed from there
                preq.request.num_computed_tokens = bad * BS
                w.note(f"prefill {preq.rid}: load failed at block {bad}: recomputing from token {bad * BS}")
                continue
            self.waiting.remove(preq)
            self.forward(preq, computed)
        for rid in sorted(received):
            self.received(rid, rid in failed, invalid)
        for rid in sorted(sent):
            blocks = self.held.pop(rid, None)
            if blocks is not None:
                self.pool.release(blocks)

    def received(self, rid: str, failed: bool, invalid: set[int]) -> None:
        w = self.world
        if rid in self.orphans:
            self.pool.release(self.orphans.pop(rid))
            return
        preq = next((p for p in self.waiting if p.rid == rid and p.remote), None)
        if preq is None:
            return
        preq.remote = False
        req = preq.request
        loaded = preq.local + preq.external
        bad = next((i for i in range(cdiv(loaded, BS)) if preq.blocks[i] in invalid), None)
        if failed or bad is not None:
            req.num_computed_tokens = (bad * BS) if bad is not None else preq.local
            w.note(f"prefill {rid}: READ failed: {req.num_computed_tokens} tokens kept")
            if req.num_computed_tokens == 0:
                self.pool.release(preq.blocks)
                preq.blocks, preq.resumed = [], False  # looked at again (vLLM: no valid computed tokens)
        else:
            req.num_computed_tokens = loaded if loaded < len(preq.prompt) else len(preq.prompt) - 1
            w.note(f"prefill {rid}: READ done ({preq.external} tokens)")
        req.status = RequestStatus.WAITING

    def forward(self, preq: PReq, computed: int) -> None:
        """The step computes ``preq`` on the KV its blocks hold before ``computed``: the oracle, then its own KV."""
        w = self.world
        for rank, memory in enumerate(self.memories):
            for i in range(cdiv(computed, BS)):
                label = memory.labels.get(preq.blocks[i])
                fault = block_fault(label, preq.conv.tenant, preq.prompt, rank, i, computed)
                if fault:
                    held = label.short() if label else "nothing"
                    w.violate("kv", preq.rid, f"computes on rank {rank} block {i} (id {preq.blocks[i]}): {fault}; "
                                              f"it holds {held} (conv {preq.conv.cid} of {preq.conv.tenant}, "
                                              f"offer tier {preq.tier})")
                    return
        self.write(preq.rid, preq.conv, preq.prompt, preq.blocks, computed // BS)
        if w.cfg.prefix_cache:
            for i in range(len(preq.prompt) // BS):
                self.pool.cache(preq.blocks[i], tuple(preq.prompt[:(i + 1) * BS]))
        w.stats["prefills"] += 1
        w.stats["reused_tokens"] += max(0, computed - preq.local)
        req = preq.request
        req.num_computed_tokens = len(preq.prompt)
        req._all_token_ids.append(token_at(preq.conv.number, len(preq.prompt)))
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, out = self.scheduler.request_finished(req, (list(preq.blocks),))
        verdict = (out or {}).get(wire.VERDICT)
        if verdict:
            w.stats[f"verdict_{verdict['reason']}"] += 1
        w.note(f"prefill computed {preq.rid} ({computed} of {len(preq.prompt)} tokens loaded){' ' if verdict else ''}"
               f"{verdict or ''}")
        if delay:
            self.held[preq.rid] = preq.blocks
        else:
            self.pool.release(preq.blocks)
        w.decode.admit(preq, out or {})

    def abort(self, preq: PReq) -> None:
        req = preq.request
        req.status = RequestStatus.FINISHED_ABORTED
        self.scheduler.request_finished(req, (list(preq.blocks),))
        self.waiting.remove(preq)
        if preq.remote:
            self.orphans[preq.rid] = preq.blocks  # freed once the READ into them is over
        else:
            self.pool.release(preq.blocks)
        preq.conv.busy = False


class DecodeEngine(Engine):
    def __init__(self, world: World, boot: int) -> None:
        cfg = world.cfg
        extra = {"kv_recompute_threshold": cfg.threshold, "decoder_kv_blocks_ttl": cfg.ttl,
                 "retained_kv_share": cfg.retained_share, "retention_eviction_grace": cfg.grace,
                 "expiry_skew_margin": cfg.skew, "fork_window": cfg.fork_window,
                 "retention_idle_evict": cfg.idle_evict, "host_kv_budget_mib": 64 if cfg.host_slots else 0}
        super().__init__(world, "decode-0", cfg.decode_blocks, extra, boot, cfg.reuse_first)
        self.pools: list[Memory] = []
        if cfg.host_slots:
            for rank, worker in enumerate(self.workers):
                pool = Memory(self.agents[rank] + "/pool", "host", cfg.host_slots,
                              0x7F00_0000_0000 + boot * 0x1000_0000 + rank * 0x100_0000, world.clock.perf)
                world.fabric.register(self.agents[rank], pool)
                self.pools.append(pool)
                adapters.install_host_pool(worker, adapters.SimHostPool(
                    self.memories[rank], pool, [BLOCK_LEN] * REGIONS,
                    lambda: world.rng.choice([0.0, 0.005, 0.05, 0.5]), world.clock.perf), rank)
        self.scheduler.turnkv_bind_block_pool(self.pool)
        self.waiting: list[DReq] = []
        self.running: list[DReq] = []
        self.held: dict[str, list[int]] = {}  # finished turns whose blocks upstream has not reported sent

    def active(self) -> int:
        return len(self.waiting) + len(self.running)

    def admit(self, preq: PReq, prefill_out: dict[str, Any]) -> None:
        w = self.world
        rid = w.next_id("d")
        params = dict(prefill_out)
        params[wire.RETAIN] = True
        params[wire.TENANT] = preq.conv.tenant
        self.waiting.append(DReq(rid, preq.conv, list(preq.prompt), w.rng.randint(2, 9),
                                 SimRequest(rid, preq.prompt, params)))
        w.note(f"router: {preq.rid}'s turn goes to decode as {rid}")

    def step(self) -> None:
        w = self.world
        for dreq in list(self.waiting):
            req = dreq.request
            self.scheduler.get_num_new_matched_tokens(req, 0)  # asked every step it waits
            need = cdiv(len(dreq.prompt) + dreq.reply + w.cfg.lookahead, BS)  # reserved up front
            blocks = None if w.rng.random() < w.cfg.p_alloc_fail / 2 else self.pool.allocate([], need)
            if blocks is None:
                w.note(f"decode: no KV room for {dreq.rid} ({need} blocks, {len(self.pool.free)} free)")
                break
            dreq.blocks = blocks
            self.scheduler.update_state_after_alloc(req, SimBlocks(blocks, 0), 0)
            self.write(dreq.rid, dreq.conv, dreq.prompt, blocks)
            self.waiting.remove(dreq)
            self.running.append(dreq)
        for dreq in list(self.running):
            dreq.generated += w.rng.randint(1, 3)
            if dreq.generated >= dreq.reply:
                self.finish(dreq)
        self.start_load(len(self.running) + 1)
        w.clock.advance(w.rng.uniform(0.01, 0.03))
        sent, _, _, _ = self.collect()
        for rid in sorted(sent):
            blocks = self.held.pop(rid, None)
            if blocks is not None:
                self.pool.release(blocks)

    def finish(self, dreq: DReq) -> None:
        w = self.world
        self.running.remove(dreq)
        conv, req = dreq.conv, dreq.request
        start = len(dreq.prompt)
        tokens = list(dreq.prompt) + [token_at(conv.number, start + i) for i in range(dreq.reply)]
        req._all_token_ids = tokens
        # The last sampled token has no KV yet; with speculative decoding, draft slots may count as computed and
        # the request holds blocks for its lookahead slots (vLLM allocates them with each step).
        drafts = w.rng.randint(0, w.cfg.lookahead) if w.cfg.lookahead else 0
        req.num_computed_tokens = len(tokens) - 1 + drafts
        keep = cdiv(len(tokens) - 1 + w.cfg.lookahead, BS)
        self.pool.release(dreq.blocks[keep:])
        dreq.blocks = dreq.blocks[:keep]
        # KV exists for the computed tokens that are token ids (a draft slot past them holds no token)
        self.write(dreq.rid, conv, tokens[:min(len(tokens), req.num_computed_tokens)], dreq.blocks, start // BS)
        req.status = RequestStatus.FINISHED_STOPPED
        delay, out = self.scheduler.request_finished(req, (list(dreq.blocks),))
        if delay:
            self.held[dreq.rid] = dreq.blocks
        else:
            self.pool.release(dreq.blocks)
        conv.tokens, conv.busy, conv.key = tokens, False, conv.cid
        conv.turns += 1
        if out:
            w.router.store(conv, out)
            host = out.get(wire.HOST_TIER)
            w.note(f"decode finished {dreq.rid} ({conv.cid}, {len(tokens)} tokens): offers "
                   f"{out[wire.REMOTE_NUM_TOKENS]} tokens in {'host slots' if host else 'device blocks'} "
                   f"{out[wire.REMOTE_BLOCK_IDS][0]}"
                   f"{' fork-readable' if out.get(wire.FORK_WINDOW) else ''}")
        else:
            w.note(f"decode finished {dreq.rid} ({conv.cid}): not retained")


class Router:
    """The router's replay rules (``router.flow._take``, ``router.engines.evictions.EvictionFeed``), pure."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.entries: dict[str, Entry] = {}
        self.epoch, self.seq, self.read_at, self.known_since = "", 0, 0.0, 0.0
        self.evicted: dict[str, float] = {}
        self.hosted: set[str] = set()
        self._last_seen: tuple[list[str], list[str]] | None = None

    def store_offer(self, key: str, params: dict[str, Any]) -> None:
        self.entries[key] = Entry(dict(params), self.world.clock.time())

    def store(self, conv: Conv, params: dict[str, Any]) -> None:
        self.store_offer(conv.cid, params)

    def poll(self) -> None:
        w = self.world
        for _ in range(2):
            sent_at, since = w.clock.time(), self.seq
            answer = merge_feeds([worker.turnkv_evictions(since) for worker in w.decode.workers])
            if answer["epoch"] != self.epoch:
                self.evicted.clear()
                if self.epoch:
                    self.known_since = sent_at  # a restart: offers stored before are not replayed
                if since > 0 and self.epoch:
                    self.epoch, self.seq = answer["epoch"], 0
                    continue
            for rid, until in answer["evicted"]:
                self.evicted[rid] = float(until)
            self.epoch, self.seq, self.read_at = answer["epoch"], answer["seq"], sent_at
            self.hosted = {rid for rid, _ in answer["hosted"]}
            for rid, until in list(self.evicted.items()):
                if until < sent_at:
                    del self.evicted[rid]
            break
        seen = (sorted(self.evicted), sorted(self.hosted))
        if seen != self._last_seen:
            self._last_seen = seen
            w.note(f"router: decode's evictions feed says evicted {seen[0]}, hosted {seen[1]}")

    def refuses(self, entry: Entry, now: float) -> str | None:
        rid = entry.params.get(wire.REMOTE_REQUEST_ID)
        if entry.stored_at < self.known_since:
            return "decode restarted since"
        if float(entry.params.get(wire.EXPIRES_AT, 0)) - self.world.cfg.skew <= now:
            return "expired"
        if rid in self.evicted:
            return "evicted"
        if entry.params.get(wire.HOST_TIER) and rid not in self.hosted:
            return "host copy not confirmed"
        if not self.read_at:
            return "feed not read yet"
        if now - self.read_at > 2 * self.world.cfg.interval + max(1.0, self.world.cfg.interval):
            return "feed not read lately"
        return None

    def take(self, key: str, tenant: str) -> dict[str, Any] | None:
        """The cleared replay for the next turn at ``key`` (single use, or fork-readable for its window)."""
        w = self.world
        now = w.clock.time()
        entry = self.entries.get(key)
        if entry is None:
            return None
        if now - self.read_at >= w.cfg.interval and w.rng.random() < 0.8:
            self.poll()  # the router's feed loop reads every evictions_interval (a read may fail: stale then)
        window = wire.fork_window(entry.params)
        if window <= 0:
            del self.entries[key]
        elif not entry.fork_until:
            entry.fork_until = now + window
        elif now >= entry.fork_until:
            del self.entries[key]
            return None
        why = self.refuses(entry, now)
        if why:
            w.note(f"router: offer {entry.params.get(wire.REMOTE_REQUEST_ID)} for {key} not replayed ({why})")
            return None
        read_by = now + w.cfg.replay_window
        if entry.fork_until:
            read_by = min(read_by, entry.fork_until + wire.FORK_READ_SLACK)
        reader = f"{w.rng.getrandbits(64):016x}" if window > 0 else None
        return wire.clear_offer(SECRET.encode(), entry.params, read_by, reader, tenant=tenant, prefill="prefill-0")

    def renew(self) -> None:
        """Renew a random stored offer's lease on every decode rank; the router keeps the re-signed offer."""
        w = self.world
        if not self.entries:
            return
        key = w.rng.choice(sorted(self.entries))
        entry = self.entries[key]
        rid = entry.params.get(wire.REMOTE_REQUEST_ID)
        boots = {rid: entry.params.get(wire.BOOT)}
        answers = [adapters.renew(worker, [rid], w.cfg.ttl, boots) for worker in w.decode.workers]
        if all(rid in a for a in answers):
            from connector.leases import renewed_offer

            expiry = min(a[rid] for a in answers)
            entry.params = renewed_offer(SECRET.encode(), entry.params, expiry, "sim-model", w.clock.perf(),
                                         w.clock.time())
            w.note(f"router: renewed the lease of {rid} ({key})")
        else:
            w.note(f"router: lease of {rid} ({key}) not renewed")


class World:
    """One schedule: the deployment, the generator, the trace and what went wrong."""

    def __init__(self, seed: int, trace: bool = False, scenario: str = "default") -> None:
        self.seed, self.scenario = seed, scenario
        self.rng = random.Random(seed)
        self.cfg = Config.draw(self.rng, scenario)
        self.clock = FakeClock()
        self.trace = Trace(enabled=trace)
        self.looking = "-"  # the request prefill's scheduler is looking at (the scripted cost model's log names it)
        self.violations: list[Violation] = []
        self.stats: Counter[str] = Counter()
        self.fabric = Fabric(self.clock.perf, self.note)
        self.fabric.latency = lambda: self.rng.uniform(0.001, 0.02)
        # A slow READ ends within the clocks' margin (expiry_skew_margin >= 1 s) that decode's frees keep after a
        # READ's last start; under "stall" READs may also stall past it.
        self.fabric.slow = {"slow": lambda: self.rng.uniform(0.1, 0.8)}
        if scenario == "stall":
            self.fabric.slow = {"slow": lambda: self.rng.uniform(1.0, 6.0), "hang": lambda: 60.0}
        self.fabric.on_land = self.on_land
        self.directory = Directory()
        self.directory.handshake_seconds = lambda: self.rng.choice([0.01, 0.05, 0.3, 2.0, 8.0])
        self._ids: Counter[str] = Counter()
        self.preqs: dict[str, PReq] = {}
        self.convs: list[Conv] = []
        self.boot = 1
        self.stopped = False  # a violation that ends the schedule (a wrong "tier" read goes on to the oracle)

    # bookkeeping -------------------------------------------------------------------------------------

    def note(self, text: str) -> None:
        self.trace.add(self.clock.time() - START, text)

    def next_id(self, prefix: str) -> str:
        self._ids[prefix] += 1
        return f"{prefix}{self._ids[prefix]}"

    def violate(self, kind: str, request: str, detail: str) -> None:
        line = self.trace.add(self.clock.time() - START, f"VIOLATION [{kind}] {request}: {detail}")
        preq = self.preqs.get(request)
        related: tuple[str, ...] = (request,)
        if preq is not None:
            offer = preq.request.kv_transfer_params or {}
            related += (preq.conv.cid, *([offer[wire.REMOTE_REQUEST_ID]] if preq.tier else []))
        self.violations.append(Violation(kind, request, detail, line, related))
        self.stopped |= kind != "tier"

    def on_read(self, request_id: str, rank: int, kind: str, blocks: list[int]) -> None:
        """Every READ prefill's workers post: host-tier offers must read decode's pool, device offers its cache."""
        preq = self.preqs.get(request_id)
        self.stats[f"reads_{kind}"] += 1
        self.note(f"prefill rank {rank} READs {request_id} from decode {kind} {blocks}")
        if preq is not None and preq.tier is not None and preq.tier != kind:
            self.violate("tier", request_id, f"its {preq.tier}-tier offer was read from decode's {kind} memory "
                                             f"at ids {blocks} (rank {rank})")

    def on_land(self, request_id: str, agent: str, blocks: list[int]) -> None:
        """A READ's bytes land in prefill's blocks: only while the reading request still holds them and waits for
        that load (landing later overwrites KV it, or the request the blocks went to, has computed on or cached)."""
        if not agent.startswith("prefill"):
            return
        preq = self.preqs.get(request_id)
        loading = preq is not None and (preq.remote or preq.loading or request_id in self.prefill.orphans)
        foreign = [b for b in blocks if preq is None or b not in preq.blocks]
        if not loading or foreign:
            why = [*(["after the request stopped waiting for it"] if not loading else []),
                   *([f"blocks {foreign} are not its own"] if foreign else [])]
            self.violate("late-write", request_id, f"its READ landed in prefill blocks {blocks} {'; '.join(why)}")

    # the schedule ------------------------------------------------------------------------------------

    def run(self) -> None:
        with simulated(self.clock, f"/nonexistent/turnkv-sim-{os.getpid()}.json"):
            try:
                self._run()
                self._count_worker_refusals()
            except Exception as exc:  # the connector (or upstream) raised: an engine would die here
                tb = traceback.extract_tb(exc.__traceback__)
                where = next((f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(tb)
                              if "/connector/" in f.filename or "/vllm/" in f.filename), "?")
                self.violate("crash", "-", f"{type(exc).__name__}: {exc} at {where}")
                self.trace.add(self.clock.time() - START, "".join(traceback.format_exception(exc)[-6:]))

    def _count_worker_refusals(self) -> None:
        """Coverage: READs prefill's workers refused right before posting (a late deadline, a restarted decode)."""
        for worker in self.prefill.workers:
            data = getattr(worker.xfer_stats, "data", {})
            for key in ("turnkv_offers_late", "turnkv_stale_offers"):
                self.stats[f"worker_{key.removeprefix('turnkv_')}"] += int(sum(data.get(key) or ()))

    def _run(self) -> None:
        cfg = self.cfg
        self.note(f"seed {self.seed}: {cfg.short()}")
        self.prefill = PrefillEngine(self)
        self.decode = DecodeEngine(self, self.boot)
        self.router = Router(self)
        for i in range(cfg.convs):
            cid, history = f"c{i}", [token_at(i, p) for p in range(self.rng.randint(3, 9))]
            self.convs.append(Conv(cid, i, f"t{i % cfg.tenants}", history, cid))
        self.decode.step()  # the workers report their host pools
        actions = [(self.start_turn, 3.0), (self.fork, 0.6), (self.prefill_step, 4.0), (self.decode_step, 4.0),
                   (self.poll, 1.5), (self.renew, 0.3), (self.advance, 2.0), (self.jump, 0.4), (self.fault, 0.3),
                   (self.restart_decode, 0.04), (self.abort, 0.15), (self.reload, 0.1), (self.starve, cfg.starve),
                   (self.elsewhere, cfg.elsewhere)]
        funcs, weights = [a for a, _ in actions], [w for _, w in actions]
        for _ in range(cfg.ticks):
            self.rng.choices(funcs, weights)[0]()
            self.check_fabric()
            if self.stopped:
                return
        self.drain()

    def check_fabric(self) -> None:
        """READs whose descriptor ids addressed another region or block than their own layout says."""
        for request, fault in self.fabric.copy_faults:
            self.violate("layout", request, fault)
        self.fabric.copy_faults.clear()

    def drain(self) -> None:
        """No new turns: the engines run (and the router reads the feed) until every request is done."""
        for _ in range(400):
            if self.stopped or (not self.prefill.active() and not self.decode.active()):
                break
            self.prefill_step()
            self.decode_step()
            self.check_fabric()
            self.clock.advance(self.rng.choice([0.05, 0.5, 2.0]))
        else:
            # Waiting requests holding the blocks the queue's head needs (failed loads keep their valid prefix) stall
            # vLLM's FCFS queue itself: upstream's, not counted. A request still waiting for a READ is.
            stuck = sorted(p.rid for p in self.prefill.waiting if p.remote)
            if stuck:
                self.violate("stuck", ",".join(stuck[:6]), "still waiting for remote KV after 400 drain steps")
            else:
                self.stats["queue_stalls"] += 1

    # actions -----------------------------------------------------------------------------------------

    def start_turn(self, conv: Conv | None = None) -> None:
        idle = [c for c in self.convs if not c.busy]
        if not idle or self.prefill.active() > 8:
            return
        conv = conv or self.rng.choice(idle)
        conv.busy = True
        prompt = list(conv.tokens) + [token_at(conv.number, len(conv.tokens) + i)
                                      for i in range(self.rng.randint(1, 2 * BS))]
        offer = self.router.take(conv.key, conv.tenant)
        params: dict[str, Any] = dict(offer) if offer else {wire.DO_REMOTE_DECODE: True}
        rid = self.next_id("p")
        tier = None
        if offer:
            tier = "host" if offer.get(wire.HOST_TIER) else "device"
            self.stats[f"replays_{tier}"] += 1
        preq = PReq(rid, conv, prompt, SimRequest(rid, prompt, params), tier)
        self.preqs[rid] = preq
        self.prefill.waiting.append(preq)
        self.note(f"turn {rid}: {conv.cid} ({conv.tenant}) prompt {len(prompt)} tokens"
                  + (f", offer {offer[wire.REMOTE_REQUEST_ID]} ({tier} {offer[wire.REMOTE_BLOCK_IDS][0]}, "
                     f"read by +{offer[wire.READ_BY] - self.clock.time():.1f}s)" if offer else ", no offer"))

    def elsewhere(self) -> None:
        """A turn prefilled by another prefill engine (not simulated): decode computes and retains it all the same,
        so decode's blocks churn while this prefill is busy or starved. It reads no offer (its conversation's stored
        one stays, superseded when this turn is retained)."""
        idle = [c for c in self.convs if not c.busy]
        if not idle:
            return
        conv = self.rng.choice(idle)
        conv.busy = True
        prompt = list(conv.tokens) + [token_at(conv.number, len(conv.tokens) + i)
                                      for i in range(self.rng.randint(1, 2 * BS))]
        rid = self.next_id("x")
        params = {wire.DO_REMOTE_PREFILL: True, wire.DO_REMOTE_DECODE: False, wire.REMOTE_ENGINE_ID: "prefill-1",
                  wire.REMOTE_REQUEST_ID: rid, wire.REMOTE_HOST: "host-prefill-1", wire.REMOTE_PORT: 5600}
        self.note(f"turn {rid}: {conv.cid} ({conv.tenant}) prefilled by another engine")
        self.decode.admit(PReq(rid, conv, prompt, SimRequest(rid, prompt, {}), None), params)

    def fork(self) -> None:
        """A fork of an idle conversation whose stored turn is fork-readable: same tenant, same history."""
        parents = [c for c in self.convs if not c.busy and wire.fork_window(
            self.router.entries.get(c.key, Entry({}, 0)).params) > 0]
        if not parents or len(self.convs) > 14:
            return
        parent = self.rng.choice(parents)
        number = len(self.convs)
        child = Conv(f"c{number}", number, parent.tenant, list(parent.tokens), parent.key)
        self.convs.append(child)
        self.note(f"fork {child.cid} of {parent.cid}")
        self.stats["forks"] += 1
        self.start_turn(child)
        if self.rng.random() < 0.5:
            self.start_turn(parent)

    def prefill_step(self) -> None:
        self.prefill.step()

    def decode_step(self) -> None:
        self.decode.step()

    def poll(self) -> None:
        self.router.poll()

    def renew(self) -> None:
        self.router.renew()

    def advance(self) -> None:
        seconds = self.rng.choice([0.05, 0.2, 0.5, 1.0, 2.0])
        self.clock.advance(seconds)

    def jump(self) -> None:
        seconds = self.rng.choice([5.0, 12.0, 30.0, 60.0, 200.0])
        self.note(f"time passes: {seconds:g} s")
        self.clock.advance(seconds)

    def starve(self) -> None:
        """Prefill has no KV room for new requests for a while (looked at every step meanwhile)."""
        seconds = self.rng.choice([2.0, 5.0, 15.0, 40.0])
        self.prefill.starved_until = self.clock.time() + seconds
        self.note(f"prefill: no KV room for new requests for {seconds:g} s")

    def fault(self) -> None:
        rank = self.rng.randrange(self.cfg.tp)
        mode = self.rng.choice(["fail", *sorted(self.fabric.slow)])
        self.fabric.faults.setdefault(self.prefill.agents[rank], []).append(mode)
        self.note(f"fault: prefill rank {rank}'s next READ will {mode}")

    def restart_decode(self) -> None:
        """Decode dies and comes back under the same engine id: new agents, empty memory, a new host pool."""
        old = self.decode
        for agent in old.agents:
            self.fabric.kill(agent)
        self.boot += 1
        self.note(f"decode restarts (boot {self.boot}): its requests are lost")
        self.stats["restarts"] += 1
        for dreq in old.waiting + old.running:
            dreq.conv.busy = False
        self.decode = DecodeEngine(self, self.boot)
        self.decode.step()

    def abort(self) -> None:
        live = [p for p in self.prefill.waiting if not p.resumed or p.remote]
        if not live:
            return
        preq = self.rng.choice(sorted(live, key=lambda p: p.rid))
        self.note(f"client aborts {preq.rid}")
        self.prefill.abort(preq)

    def reload(self) -> None:
        """A tunables reload on one engine (what the tunables file's hot reload applies)."""
        if self.rng.random() < 0.5:
            values: dict[str, int | float] = self.rng.choice([
                {"retained_kv_share": self.rng.choice([0.05, 0.2, 0.5])},
                {"fork_window": self.rng.choice([0.0, 10.0])},
                {"host_kv_budget_mib": self.rng.choice([16, 64])}])
            engine = self.decode
        else:
            values = self.rng.choice([{"kv_recompute_threshold": self.rng.choice([0, 8, 40])},
                                      {"inline_pull_max_ms": self.rng.choice([0.0, 25.0])}])
            engine = self.prefill
        self.note(f"reload {engine.engine_id}: {values}")
        adapters.reload_tunables(engine.scheduler, values)
