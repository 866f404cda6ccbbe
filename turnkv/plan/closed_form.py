"""The closed form: TTFT with reuse off and on, transfer, retained KV, hit share, node counts, cost.

One turn with ``history`` tokens decode still holds from the turn before and ``new`` tokens the turn
adds (its user or tool message) costs, on the critical path:

* reuse off: two engine hops + prefill of the whole prompt + P->D transfer of what decode lacks +
  decode's first step;
* reuse on (a hit): two hops + D->P transfer of the history + prefill of the new tokens over that
  context + P->D transfer of the new tokens + decode's first step.

Prefill time is the larger of FLOPs over achieved FLOP/s (linear layers, and attention, which grows
with the context) and reading the weights once (small prefills are memory bound), plus tensor-parallel
all-reduces. A transfer is a fixed set-up plus KV bytes per rank over the rank's link rate times the
efficiency of the message size the KV blocks make. Queueing on prefill follows Pollaczek-Khinchine
(M/G/1) at the load the clients offer. Retained KV follows Little's law: each finished turn holds its
KV until the next turn pulls it or the TTL ends. Pure: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from turnkv import params as tunables
from turnkv.plan.architectures import ModelArch
from turnkv.plan.hardware import Instance, transfer_efficiency
from turnkv.plan.workload import Turns, Workload, sample

GIB = 1024**3
#: Prefill utilization the sizing stays under (queueing grows without bound as it nears 1).
MAX_UTIL = 0.85


@dataclass(frozen=True)
class Fleet:
    model: ModelArch
    prefill: Instance
    decode: Instance
    tp_prefill: int = 8
    tp_decode: int = 8
    #: KV block size in tokens: what turnkv's engines run everywhere (turnkv.engine_args.EngineSpec.block_size,
    #: passed as ``--block-size`` by `turnkv engine run` and the local stack); vLLM's own GPU default is 16.
    block_size: int = 128
    mode: str = "pull"  # push overlaps the P->D set-up with prefill
    ttl_s: float = float(tunables.get("decoder_kv_blocks_ttl").default)
    threshold: int = int(tunables.get("kv_recompute_threshold").default)
    expiry_margin_s: float = float(tunables.get("expiry_margin").default)
    #: Prefill keeps a prefix cache (vLLM's default, and turnkv's deployed engines): a conversation's earlier
    #: prompt is found there while the cache still holds it (``PrefillCache``). Off: the seeds' benchmark.
    prefill_prefix_caching: bool = True
    #: Each prefill engine's host offload tier (GiB; vLLM's native CPU offloading, ``--kv-offloading-size``):
    #: a second LRU tier behind the device prefix cache, loaded at the host link's rate. 0: none.
    prefill_offload_gib: float = 0.0
    #: How the router picks a prefill engine for a conversation's next turn: "prefix-aware" (the engine that
    #: served it before, so the engines' caches add up) or "round-robin" (1 in P turns finds its engine again).
    routing: str = "prefix-aware"
    #: Engines of each role (not instances: an instance runs ``devices // tp`` engines, see ``engines_per_node``).
    prefill_nodes: int = 1
    decode_nodes: int = 1
    #: Each decode engine's host tier of retained turns (``host_kv_budget_mib`` / 1024): turns that do not fit the
    #: device KV cache are held there and read with the same NIXL READ (connector.host_tier). 0: device only.
    host_kv_gib: float = 0.0
    #: Engines a node of each role runs as a deploy config sets them (``pools[].engines_per_node``, prefill then
    #: decode); None: every device used (the deploy's default).
    deployed_engines_per_node: tuple[int, int] | None = None

    def engines_per_node(self, role: str) -> int:
        """Engines one instance of ``role`` runs: the deploy config's, else its devices over the engine's
        tensor-parallel size."""
        if self.deployed_engines_per_node is not None:
            return self.deployed_engines_per_node[0 if role == "prefill" else 1]
        inst, tp = (self.prefill, self.tp_prefill) if role == "prefill" else (self.decode, self.tp_decode)
        return max(1, inst.devices // max(1, tp))

    def instances(self, role: str) -> int:
        """Instances the ``role`` engines take (a partly used instance is paid for whole)."""
        engines = self.prefill_nodes if role == "prefill" else self.decode_nodes
        return -(-engines // self.engines_per_node(role))

    def cost_per_hour(self) -> float:
        """On-demand $/hour of the instances both roles take."""
        return (self.prefill.price_per_hour * self.instances("prefill")
                + self.decode.price_per_hour * self.instances("decode"))

    def filled(self) -> Fleet:
        """The fleet with every instance it pays for running all the engines it holds."""
        return replace(self, prefill_nodes=self.instances("prefill") * self.engines_per_node("prefill"),
                       decode_nodes=self.instances("decode") * self.engines_per_node("decode"))

    @property
    def effective_ttl_s(self) -> float:
        """How long after a reply the next turn still finds its KV: the router's conversation TTL."""
        return float(conversation_ttl(self.ttl_s, self.expiry_margin_s))


# -- per-request costs (vectorized over numpy arrays) ---------------------------------------------


def _prefill_flops_s(fleet: Fleet, attention: str = "") -> float:
    """Achieved prefill FLOP/s of one engine: GEMMs, or attention ("fresh": a chunk's queries over its own
    keys; "context": over cached keys) when its factor differs."""
    m, inst, eff = fleet.model, fleet.prefill, fleet.prefill.efficiency
    factor = eff.moe if m.moe else eff.dense
    if attention and eff.attention is not None:
        factor = eff.attention
    if attention == "context" and eff.context_attention is not None:
        factor = eff.context_attention
    if m.index_topk:
        factor *= eff.sparse_attention
    return fleet.tp_prefill * inst.peak(m.dtype) * factor


def weight_bytes_read(m: ModelArch, tokens: Any) -> Any:
    """Bytes of weights one forward pass over ``tokens`` tokens reads: MoE experts only as far as routed."""
    per_param = m.weight_bytes_per_param
    if not m.moe:
        return np.full_like(np.asarray(tokens, dtype=float), m.total_params() * per_param)
    experts_total = m.total_params() - m.active_params()  # idle experts at one token
    touched = np.minimum(1.0, np.asarray(tokens, dtype=float) * m.experts_per_token / m.experts)
    return (m.active_params() + experts_total * touched) * per_param


def chunked_attention_flops(m: ModelArch, new: Any, context: Any, chunk: int) -> tuple[Any, Any]:
    """(fresh, context) attention FLOPs of prefilling ``new`` tokens after ``context`` cached ones in
    chunks of ``chunk`` tokens: each chunk's queries over its own keys, and over every key before it."""
    new, context = np.asarray(new, dtype=float), np.asarray(context, dtype=float)
    full, rest = np.floor(new / chunk), np.mod(new, chunk)
    fresh = full * m.attention_flops(float(chunk), 0.0) + m.attention_flops(rest, 0.0)
    return fresh, m.attention_flops(new, context) - fresh


def prefill_chunks(fleet: Fleet, new: Any) -> np.ndarray:
    return np.ceil(np.asarray(new, dtype=float) / fleet.prefill.prefill_chunk_tokens)


def compute_parts(fleet: Fleet, new: Any, context: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(compute, weight-read floor, all-reduce) seconds of prefilling ``new`` tokens after ``context`` cached
    ones on one prefill engine, in the engine's chunks."""
    m, inst, tp = fleet.model, fleet.prefill, fleet.tp_prefill
    new = np.asarray(new, dtype=float)
    fresh, ctx = chunked_attention_flops(m, new, context, inst.prefill_chunk_tokens)
    compute = (m.linear_flops_per_token() * new / _prefill_flops_s(fleet)
               + fresh / _prefill_flops_s(fleet, "fresh") + ctx / _prefill_flops_s(fleet, "context")
               + np.maximum(prefill_chunks(fleet, new) - 1, 0) * inst.efficiency.step_overhead_s)
    memory = weight_bytes_read(m, new) / (tp * inst.hbm_bytes_s)
    allreduce = np.zeros_like(new)
    if tp > 1:  # two all-reduces of the activations per layer (attention out, MLP out), bf16
        allreduce = 2 * m.layers * 2 * (tp - 1) / tp * new * m.hidden * 2 / inst.efficiency.allreduce_bus_bytes_s
    return compute, memory, allreduce


def linear_compute_s(fleet: Fleet, new: Any) -> np.ndarray:
    """Seconds the linear layers (GEMMs) of a ``new``-token prefill take, attention left out."""
    return fleet.model.linear_flops_per_token() * np.asarray(new, dtype=float) / _prefill_flops_s(fleet)


def compute_s(fleet: Fleet, new: Any, context: Any) -> np.ndarray:
    """Prefill of ``new`` tokens after ``context`` cached tokens on one prefill engine (seconds), in the
    engine's chunks (the first chunk's step is in the hop's fixed cost)."""
    compute, memory, allreduce = compute_parts(fleet, new, context)
    return np.where(np.asarray(new, dtype=float) > 0, np.maximum(compute, memory) + allreduce, 0.0)


def transfer_s(fleet: Fleet, tokens: Any, inst: Instance | None = None, tp: int | None = None,
               setup: bool = True, rate: float | None = None) -> np.ndarray:
    """One NIXL transfer of ``tokens`` tokens' KV between engines (each rank moves its own share), at the rank's
    link rate or ``rate`` (bytes/s: a read from decode's host tier), times the message size's efficiency."""
    inst = inst or fleet.decode
    tp = tp or fleet.tp_decode
    m = fleet.model
    per_token = m.kv_bytes_per_token_rank(tp)
    message = fleet.block_size * per_token / (m.layers * m.kv_regions_per_layer())
    rate = (rate or inst.rank_link_bytes_s()) * transfer_efficiency(inst.efficiency, message)
    tokens = np.asarray(tokens, dtype=float)
    fixed = inst.efficiency.transfer_setup_s if setup else 0.0
    return np.where(tokens > 0, fixed + tokens * per_token / rate, 0.0)


def decode_step_s(fleet: Fleet, context: Any, batch: float = 1.0) -> np.ndarray:
    """One decode step: weights once plus every sequence's KV (memory bound)."""
    m, inst, tp = fleet.model, fleet.decode, fleet.tp_decode
    kv = np.asarray(context, dtype=float) * m.kv_bytes_per_token_rank(tp) * batch
    return (weight_bytes_read(m, max(batch, 1.0)) / tp + kv) / (inst.hbm_bytes_s * inst.efficiency.decode_bandwidth)


def hops_s(fleet: Fleet) -> float:
    """Fixed cost of a P/D turn's two engine hops and its P->D handover (step alignment), either arm."""
    eff = fleet.prefill.efficiency
    return eff.request_overhead_s + fleet.decode.efficiency.request_overhead_s + eff.pd_handover_s


def pull_overhead_s(fleet: Fleet) -> float:
    """Fixed cost a pulled (reuse-on) turn adds beyond its transfer's set-up and bytes."""
    return fleet.prefill.efficiency.pull_overhead_s


@dataclass
class TurnCosts:
    ttft_off: np.ndarray
    ttft_on: np.ndarray  # if the history is pulled (a hit)
    transfer_on: np.ndarray  # D->P pull of the history prefill lacks
    compute_off: np.ndarray
    compute_on: np.ndarray
    pull: np.ndarray  # bool: the threshold lets this turn pull
    #: Tokens of each turn prefill's own prefix cache serves (both arms), those a pull moves, and the pull's
    #: fixed cost beyond the transfer (the named components, hardware.PullComponent).
    cached: np.ndarray | float = 0.0
    pulled: np.ndarray | float = 0.0
    pull_fixed: float = 0.0
    offload_load: np.ndarray | float = 0.0  # seconds loading the cached tokens from prefill's offload tier


def turn_costs(fleet: Fleet, prompt: Any, history: Any, cached: Any = None, offloaded: Any = None,
               from_host: Any = None) -> TurnCosts:
    """Costs of turns whose prompt has ``history`` tokens decode still holds, ``cached`` of which prefill's own
    prefix cache holds (default none; ``offloaded`` of those in its host offload tier); prefill computes the rest.
    ``from_host`` marks turns whose history decode keeps in its host tier (read at the host rate)."""
    prompt, history = (np.asarray(a, dtype=float) for a in (prompt, history))
    cached = np.zeros_like(prompt) if cached is None else np.minimum(np.asarray(cached, dtype=float), prompt - 1)
    offloaded = np.zeros_like(prompt) if offloaded is None else np.minimum(np.asarray(offloaded, dtype=float), cached)
    new = prompt - history
    pd_setup = fleet.mode != "push"
    first = decode_step_s(fleet, prompt)
    # Prefill's prefix cache serves ``cached`` tokens in either arm; what it keeps in its offload tier is loaded
    # over the host link first (vLLM's OffloadingConnector), per rank.
    load = np.where(offloaded > 0, offloaded * fleet.model.kv_bytes_per_token_rank(fleet.tp_prefill)
                    / fleet.prefill.host_link_bytes_s, 0.0)
    compute_off = compute_s(fleet, prompt - cached, cached) + load
    # Decode keeps its own prefix cache: it lacks only the new tokens (the whole prompt on a first turn).
    pd_tokens = np.where(history > 0, new, prompt)
    pd = transfer_s(fleet, pd_tokens, setup=pd_setup)
    ttft_off = hops_s(fleet) + compute_off + pd + first
    # Reuse pulls only the history prefill's cache lacks (the conversation's tail, or all of it after eviction).
    known = np.minimum(cached, history)
    pulled = np.maximum(history - known, 0.0)
    pull = (history > 0) & (pulled >= max(fleet.threshold, 1))
    rate_host = None if from_host is None else np.asarray(from_host, dtype=bool)
    transfer_on = np.where(pull, transfer_s(fleet, pulled), 0.0)
    if rate_host is not None and rate_host.any():
        host = transfer_s(fleet, pulled, rate=fleet.decode.host_read_bytes_s())
        transfer_on = np.where(pull & rate_host, host, transfer_on)
    fixed = pull_overhead_s(fleet)
    compute_on = np.where(pull, compute_s(fleet, new, history) + np.where(known > 0, load, 0.0), compute_off)
    ttft_on = np.where(pull, hops_s(fleet) + fixed + transfer_on + compute_on + pd + first, ttft_off)
    return TurnCosts(ttft_off, ttft_on, transfer_on, compute_off, compute_on, pull, cached,
                     np.where(pull, pulled, 0.0), fixed, load)


# -- the workload-level closed form ---------------------------------------------------------------


def hit_probability(fleet: Fleet, think: np.ndarray) -> np.ndarray:
    return (think < fleet.effective_ttl_s).astype(float)


@dataclass
class FleetLoad:
    """What the workload's closed-loop clients put on a fleet (``connector.policy.Load`` is one engine's live load)."""

    turns_per_s: float
    prefill_util: float
    wait_s: float  # mean prefill queueing delay
    wait_p90_s: float
    tpot_s: float


def _load(fleet: Fleet, workload: Workload, turns: Turns, service: np.ndarray, ttft: np.ndarray) -> FleetLoad:
    """Closed-loop clients: each cycles think -> TTFT -> decode; M/G/1 per prefill engine."""
    clients = workload.num_clients
    ctx = turns.prompt_tokens + turns.output_tokens / 2
    batch = max(1.0, clients / max(fleet.decode_nodes, 1))
    tpot = float(decode_step_s(fleet, ctx.mean(), batch))
    cycle = float(np.mean(turns.think_s + ttft + turns.output_tokens * tpot))
    lam = clients / cycle if cycle > 0 else 0.0
    es, es2 = float(service.mean()), float((service**2).mean())
    rho = lam * es / fleet.prefill_nodes
    if clients <= 1 or rho <= 0:
        return FleetLoad(lam, rho, 0.0, 0.0, tpot)
    if rho >= 1:
        return FleetLoad(lam, rho, math.inf, math.inf, tpot)
    # Finite-source correction: a client never waits behind itself.
    wait = (clients - 1) / clients * rho / (1 - rho) * es2 / (2 * es)
    p90 = (wait / rho) * math.log(10 * rho) if rho > 0.1 else 0.0
    return FleetLoad(lam, rho, wait, max(p90, 0.0), tpot)


@dataclass
class Retention:
    retained_gib_per_decode: float
    share_of_kv_cache: float
    reuse_share: float  # of turns with history: their KV still held (and pulled)
    in_use_gib_per_decode: float
    #: Of the retained KV: what the device cache holds (what is left of 90% of it after in-use KV) and what
    #: goes to the host tier; ``fits`` is the share of retained KV the two tiers hold together. Beyond that,
    #: turns are not retained, and (no cliff: connector.retention keeps a stable subset) reuse falls to that
    #: share rather than to 0.
    device_gib_per_decode: float = 0.0
    host_gib_per_decode: float = 0.0
    fits: float = 1.0


def tiers(retained_gib: float, in_use_gib: float, kv_cache: float, host_gib: float) -> tuple[float, float, float]:
    """(device GiB, host GiB, share that fits) of one decode engine's retained KV (pure)."""
    device_room = max(0.0, 0.9 * kv_cache - in_use_gib)
    device = min(retained_gib, device_room)
    host = min(max(0.0, retained_gib - device), max(0.0, host_gib))
    fits = 1.0 if retained_gib <= 0 else min(1.0, (device + host) / retained_gib)
    return device, host, fits


def kv_cache_gib(fleet: Fleet) -> float:
    m = fleet.model
    return fleet.decode.kv_cache_bytes(fleet.tp_decode, m.total_params() * m.weight_bytes_per_param) / GIB


def retention(fleet: Fleet, workload: Workload, turns: Turns, lam_turns: float, ttft: np.ndarray,
              tpot: float) -> Retention:
    """Little's law over finished turns: KV is held from the end of a reply until the next turn pulls it
    or the TTL ends (after a conversation's last turn, for the whole TTL)."""
    m, tp = fleet.model, fleet.tp_decode
    node_bytes_per_token = m.kv_bytes_per_token_rank(tp) * tp
    held_tokens = turns.prompt_tokens + turns.output_tokens - 1
    next_think = np.append(turns.think_s[1:], np.inf)
    last = np.append(turns.conv[1:] != turns.conv[:-1], True)
    ttl = fleet.ttl_s
    hold = np.where(last, ttl, np.minimum(next_think, ttl))
    retained_bytes = lam_turns * float(np.mean(held_tokens * node_bytes_per_token * hold))
    decode_s = turns.output_tokens * tpot
    in_use = lam_turns * float(np.mean(held_tokens * node_bytes_per_token * decode_s))
    eligible = turns.history_tokens >= max(fleet.threshold, 1)
    hits = hit_probability(fleet, turns.think_s)[eligible]
    with_history = turns.history_tokens > 0
    share = float(hits.sum() / max(with_history.sum(), 1))
    per_node = retained_bytes / fleet.decode_nodes / GIB
    capacity = kv_cache_gib(fleet)
    in_use_node = in_use / fleet.decode_nodes / GIB
    device, host, fits = tiers(per_node, in_use_node, capacity, fleet.host_kv_gib)
    return Retention(per_node, per_node / capacity if capacity else math.inf, share * fits, in_use_node,
                     device, host, fits)


def _ms(seconds: float) -> float | None:
    """Milliseconds, or None where the prefill engines cannot keep up (no finite TTFT)."""
    return round(float(seconds) * 1000, 1) if np.isfinite(seconds) else None


def _summary(values: np.ndarray) -> dict[str, float | None]:
    if not np.isfinite(values).all():  # the prefill engines cannot keep up: no finite TTFT
        return {"mean": None, "p50": None, "p90": None}
    return {"mean": round(float(values.mean()) * 1000, 1), "p50": round(float(np.percentile(values, 50)) * 1000, 1),
            "p90": round(float(np.percentile(values, 90)) * 1000, 1)}


@dataclass
class Plan:
    fleet: Fleet
    workload: Workload
    turns: Turns = field(repr=False)
    costs: TurnCosts = field(repr=False)
    hit: np.ndarray = field(repr=False)
    load_off: FleetLoad
    load_on: FleetLoad
    retention: Retention
    cache: PrefillCache | None = None

    def load(self, arm: str) -> FleetLoad:
        return self.load_off if arm == "off" else self.load_on

    def unqueued_ttft(self, arm: str) -> np.ndarray:
        """TTFT of every sampled turn (seconds) without prefill queueing; ``on`` pulls only on hits."""
        if arm == "off":
            return self.costs.ttft_off
        return np.where(self.hit > 0, self.costs.ttft_on, self.costs.ttft_off)

    def ttft(self, arm: str) -> np.ndarray:
        """TTFT of every sampled turn (seconds), queueing included (infinite on an overloaded fleet)."""
        return self.unqueued_ttft(arm) + self.load(arm).wait_s

    def per_turn(self) -> list[dict[str, Any]]:
        rows = []
        on = np.where(self.hit > 0, self.costs.ttft_on, self.costs.ttft_off)
        for t in range(int(self.turns.turn.max()) + 1):
            sel = self.turns.turn == t
            if sel.sum() < max(3, 0.01 * len(self.turns.turn) / (t + 1)):
                break
            rows.append({
                "turn": t + 1,
                "prompt_tokens": round(float(self.turns.prompt_tokens[sel].mean())),
                "ttft_ms_off": _ms(self.costs.ttft_off[sel].mean() + self.load_off.wait_s),
                "ttft_ms_on": _ms(on[sel].mean() + self.load_on.wait_s),
                "transfer_ms": round(float((self.costs.transfer_on * self.hit)[sel].mean()) * 1000, 1),
                "compute_saved_ms": round(float(((self.costs.compute_off - self.costs.compute_on)
                                                  * self.hit)[sel].mean()) * 1000, 1),
                "pull_fixed_ms": round(float((self.costs.pull_fixed * self.hit)[sel].mean()) * 1000, 1),
                "prefill_cached_tokens": round(float(np.broadcast_to(self.costs.cached, sel.shape)[sel].mean())),
                "pulled_tokens": round(float((np.broadcast_to(self.costs.pulled, sel.shape) * self.hit)[sel].mean())),
                "pulled_share": round(float(self.hit[sel].mean()), 4),
            })
        return rows


@dataclass
class PrefillCache:
    """What prefill's own prefix cache serves, per turn: Che's approximation of an LRU cache (an entry survives
    while it was last used less than the characteristic time ago), the characteristic time solved from the
    working set by Little's law (each prefill leaves its prompt, which the conversation's next turn finds or the
    cache evicts), per tier: device (90% of the engine's KV cache) and device + host offload tier."""

    cached: np.ndarray  # tokens per turn (whole blocks): the conversation's previous prompt on a hit, else the
    #                     shared prefix
    offloaded: np.ndarray  # of those, the ones loaded from the host offload tier
    t_device_s: float
    t_total_s: float
    hit_share: float  # of later turns: their previous prompt still cached (either tier)
    offload_share: float  # of later turns: found in the offload tier only


def _characteristic_time(resident: Any, capacity: float) -> float:
    """T with resident(T) = capacity (resident grows with T), by bisection in log space."""
    if capacity <= 0:
        return 0.0
    lo, hi = 1e-3, 1e8
    if resident(hi) <= capacity:
        return math.inf
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if resident(mid) <= capacity else (lo, mid)
    return lo


def prefill_cache(fleet: Fleet, turns: Turns, lam_turns: float, tpot: float, seed: int = 0) -> PrefillCache:
    """Per-turn tokens prefill's prefix cache serves at ``lam_turns`` turns/s over the fleet (see PrefillCache)."""
    n = len(turns.prompt_tokens)
    block = max(1, fleet.block_size)
    common = float(turns.common_prefix_tokens // block * block)
    zeros = np.zeros(n)
    if not fleet.prefill_prefix_caching:
        return PrefillCache(zeros, zeros, 0.0, 0.0, 0.0, 0.0)
    later = turns.turn > 0
    prompt = turns.prompt_tokens.astype(float)
    prev_prompt = np.where(later, np.roll(prompt, 1), 0.0)
    prev_out = np.where(later, np.roll(turns.output_tokens.astype(float), 1), 0.0)
    gap = np.where(later, turns.think_s + prev_out * tpot, np.inf)  # since the previous prefill of the conversation
    next_gap = np.append(gap[1:], np.inf)
    engine_bytes = prompt * fleet.model.kv_bytes_per_token_rank(fleet.tp_prefill) * fleet.tp_prefill
    per_engine = lam_turns / max(fleet.prefill_nodes, 1)

    def resident(t: float) -> float:
        return per_engine * float(np.mean(engine_bytes * np.minimum(next_gap, t)))

    m = fleet.model
    device = 0.9 * fleet.prefill.kv_cache_bytes(fleet.tp_prefill, m.total_params() * m.weight_bytes_per_param)
    t_dev = _characteristic_time(resident, device)
    t_all = _characteristic_time(resident, device + fleet.prefill_offload_gib * GIB)
    same = np.ones(n, dtype=bool)
    if fleet.routing == "round-robin" and fleet.prefill_nodes > 1:
        same = np.random.default_rng(seed + 7).random(n) < 1.0 / fleet.prefill_nodes
    hit = later & same & (gap < t_all)
    in_device = hit & (gap < t_dev)
    prev_cached = np.floor(prev_prompt / block) * block
    cached = np.where(hit, np.maximum(prev_cached, common), common)
    offloaded = np.where(hit & ~in_device, np.maximum(prev_cached - common, 0.0), 0.0)
    n_later = max(int(later.sum()), 1)
    return PrefillCache(cached, offloaded, t_dev, t_all, float(hit.sum() / n_later),
                        float((hit & ~in_device).sum() / n_later))


def _from_host(fleet: Fleet, turns: Turns, ret: Retention) -> np.ndarray | None:
    """Turns whose retained KV decode keeps in its host tier: the longest-idle share of the retained bytes (the
    device tier keeps the most recent)."""
    kept = ret.device_gib_per_decode + ret.host_gib_per_decode
    if ret.host_gib_per_decode <= 0 or kept <= 0:
        return None
    share = ret.host_gib_per_decode / kept
    later = turns.turn > 0
    cut = float(np.quantile(turns.think_s[later], 1 - share)) if later.any() else math.inf
    return later & (turns.think_s >= cut)


def evaluate(fleet: Fleet, workload: Workload, conversations: int = 5000, seed: int = 0,
             turns: Turns | None = None) -> Plan:
    turns = turns or sample(workload, min(conversations, workload.num_conversations * 50) or conversations, seed)
    # Load first without prefill's cache (arrival rate and decode speed), then the cache at that load, then the costs.
    clients = workload.num_clients
    ctx = turns.prompt_tokens + turns.output_tokens / 2
    tpot = float(decode_step_s(fleet, ctx.mean(), max(1.0, clients / max(fleet.decode_nodes, 1))))
    lam0 = clients / max(float(np.mean(turns.think_s + turns.output_tokens * tpot)), 1e-9)
    cache = prefill_cache(fleet, turns, lam0, tpot, seed)
    first_ret = retention(fleet, workload, turns, lam0, np.zeros(1), tpot)
    costs = turn_costs(fleet, turns.prompt_tokens, turns.history_tokens, cache.cached, cache.offloaded,
                       _from_host(fleet, turns, first_ret))
    hit = np.where(costs.pull, hit_probability(fleet, turns.think_s), 0.0)
    ttft_on = np.where(hit > 0, costs.ttft_on, costs.ttft_off)
    load_off = _load(fleet, workload, turns, costs.compute_off, costs.ttft_off)
    service_on = np.where(hit > 0, costs.compute_on, costs.compute_off)
    load_on = _load(fleet, workload, turns, service_on, ttft_on)
    ret = retention(fleet, workload, turns, load_on.turns_per_s, ttft_on, load_on.tpot_s)
    return Plan(fleet, workload, turns, costs, hit, load_off, load_on, ret, cache)


# -- sizing and recommendations -------------------------------------------------------------------


#: Most engines of one role the sizing tries. A fleet that needs more is reported at this cap, flagged
#: (``capped``), never silently: `turnkv plan` prints it and plan.json carries it.
MAX_ENGINES = 4096


def _fewest(ok: Any, cap: int) -> int:
    """Fewest n in 1..cap with ok(n) (ok monotone in n), by doubling then bisection; cap when none."""
    hi = 1
    while hi < cap and not ok(hi):
        hi = min(cap, hi * 2)
    if hi == 1 or (hi == cap and not ok(cap)):
        return hi
    lo = hi // 2  # not ok
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def size_fleet(fleet: Fleet, workload: Workload, ttft_target_ms: float | None = None,
               max_nodes: int = MAX_ENGINES, turns: Turns | None = None, max_util: float = MAX_UTIL,
               arm: str = "on", decode_nodes: int | None = None) -> tuple[Fleet, bool]:
    """Fewest prefill engines that keep utilization under ``max_util`` and p90 TTFT under the target, and
    fewest decode engines whose memory holds what the arm keeps there, each rounded up to whole instances
    (an instance runs ``devices // tp`` engines, all of them: it is paid for whole). Decode speed sets how
    fast clients come back, so the two counts are solved together. The flag says whether the target is met: below
    the unloaded p90, no number of engines meets it (then sized for the load only). ``decode_nodes``
    fixes the decode count (to compare prefill needs at the same decode speed). At most ``max_nodes`` engines
    per role: ``capped`` says when a role needed more."""
    turns = turns or sample(workload, 5000, 0)

    def plan_for(p: int, d: int) -> Plan:
        return evaluate(replace(fleet, prefill_nodes=p, decode_nodes=d), workload, turns=turns)

    unloaded = plan_for(max_nodes, max_nodes)
    floor_ms = float(np.percentile(unloaded.unqueued_ttft(arm), 90)) * 1000
    met = ttft_target_ms is None or floor_ms <= ttft_target_ms
    target = ttft_target_ms if met else None

    def prefill_ok(plan: Plan) -> bool:
        load = plan.load(arm)
        p90 = float(np.percentile(plan.unqueued_ttft(arm), 90)) + load.wait_p90_s
        return load.prefill_util < max_util and (target is None or p90 * 1000 <= target)

    def decode_ok(plan: Plan) -> bool:
        r, room = plan.retention, 0.9 * kv_cache_gib(plan.fleet)
        if arm != "on":  # no reuse: decode holds the turns in flight only, on the device (no host tier in play)
            return r.in_use_gib_per_decode <= room
        # Reuse: in-flight KV on the device; retained turns in what is left there plus the host tier.
        return (r.in_use_gib_per_decode <= room
                and r.retained_gib_per_decode + r.in_use_gib_per_decode <= room + plan.fleet.host_kv_gib)

    per_p, per_d = fleet.engines_per_node("prefill"), fleet.engines_per_node("decode")

    def whole(engines: int, per_node: int) -> int:  # an instance runs all the engines it holds
        return -(-engines // per_node) * per_node

    prefill = decode = 1
    for _ in range(6):
        before = (prefill, decode)
        p_now = prefill
        decode = decode_nodes or whole(_fewest(lambda d, p=p_now: decode_ok(plan_for(p, d)), max_nodes), per_d)
        d_now = decode
        prefill = whole(_fewest(lambda p, d=d_now: prefill_ok(plan_for(p, d)), max_nodes), per_p)
        if (prefill, decode) == before:
            break
    return replace(fleet, prefill_nodes=prefill, decode_nodes=decode), met


def capped(fleet: Fleet, max_nodes: int = MAX_ENGINES) -> list[str]:
    """The roles a sized fleet holds at the sizing's cap (it may need more than it shows)."""
    return [role for role, n in (("prefill", fleet.prefill_nodes), ("decode", fleet.decode_nodes)) if n >= max_nodes]


def break_even_tokens(fleet: Fleet, new: float, limit: int = 1_000_000) -> int:
    """Fewest history tokens for which pulling beats recomputing them (the threshold to set)."""
    grid = np.unique(np.round(np.geomspace(1, limit, 400)))
    pull = transfer_s(fleet, grid) + pull_overhead_s(fleet) + compute_s(fleet, new, grid)
    recompute = compute_s(fleet, grid + new, 0)
    wins = np.nonzero(pull < recompute)[0]
    return int(grid[wins[0]]) if len(wins) else limit


TTL_GRID = (10, 30, 60, 120, 180, 240, 300, 480, 600, 900, 1200, 1800, 2700, 3600)


def ttl_curve(fleet: Fleet, workload: Workload, turns: Turns) -> list[dict[str, float]]:
    rows = []
    for ttl in TTL_GRID:
        plan = evaluate(replace(fleet, ttl_s=float(ttl)), workload, turns=turns)
        rows.append({"ttl_s": ttl, "reuse_share": round(plan.retention.reuse_share, 4),
                     "retained_gib_per_decode": round(plan.retention.retained_gib_per_decode, 3),
                     "share_of_kv_cache": round(plan.retention.share_of_kv_cache, 4)})
    return rows


def recommend_ttl(curve: list[dict[str, float]], max_kv_share: float = 0.5) -> int:
    """Shortest TTL reaching 95% of the best reuse share without retained KV above ``max_kv_share`` of
    the decode KV cache; when memory binds first, the longest TTL that fits."""
    best = max(r["reuse_share"] for r in curve)
    fits = [r for r in curve if r["share_of_kv_cache"] <= max_kv_share]
    if not fits:
        return int(curve[0]["ttl_s"])
    good = [r for r in fits if r["reuse_share"] >= 0.95 * best]
    return int(good[0]["ttl_s"] if good else fits[-1]["ttl_s"])


def conversation_ttl(ttl: float, margin: float | None = None) -> int:
    """The router's conversation TTL that goes with an engine TTL: as the defaults (480 -> 450), the
    expiry margin and 20 s of slack below it (params.cross_check requires at least the margin)."""
    margin = float(tunables.get("expiry_margin").default) if margin is None else margin
    return max(int(tunables.get("conversation_ttl").minimum), int(ttl - margin - 20))


def params_line(ttl: int, threshold: int, deployment: str = "NAME") -> str:
    conv_ttl = conversation_ttl(ttl)
    return (f"turnkv params set decoder_kv_blocks_ttl={ttl} conversation_ttl={conv_ttl} "
            f"kv_recompute_threshold={threshold} --deployment {deployment}")


def summarize(plan: Plan) -> dict[str, Any]:
    return {"ttft_ms": {"off": _summary(plan.ttft("off")), "on": _summary(plan.ttft("on"))}}
