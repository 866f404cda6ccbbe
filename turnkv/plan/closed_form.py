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
    prefill_prefix_caching: bool = False
    #: Engines of each role (not instances: an instance runs ``devices // tp`` engines, see ``engines_per_node``).
    prefill_nodes: int = 1
    decode_nodes: int = 1
    #: Each decode engine's host tier of retained turns (``host_kv_budget_mib`` / 1024): turns that do not fit the
    #: device KV cache are held there and read with the same NIXL READ (connector.host_tier). 0: device only.
    host_kv_gib: float = 0.0

    def engines_per_node(self, role: str) -> int:
        """Engines one instance of ``role`` runs: its devices over the engine's tensor-parallel size."""
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
               setup: bool = True) -> np.ndarray:
    """One NIXL transfer of ``tokens`` tokens' KV between engines (each rank moves its own share)."""
    inst = inst or fleet.decode
    tp = tp or fleet.tp_decode
    m = fleet.model
    per_token = m.kv_bytes_per_token_rank(tp)
    message = fleet.block_size * per_token / (m.layers * m.kv_regions_per_layer())
    rate = inst.rank_link_bytes_s() * transfer_efficiency(inst.efficiency, message)
    tokens = np.asarray(tokens, dtype=float)
    fixed = inst.efficiency.transfer_setup_s if setup else 0.0
    return np.where(tokens > 0, fixed + tokens * per_token / rate, 0.0)


def decode_step_s(fleet: Fleet, context: Any, batch: float = 1.0) -> np.ndarray:
    """One decode step: weights once plus every sequence's KV (memory bound)."""
    m, inst, tp = fleet.model, fleet.decode, fleet.tp_decode
    kv = np.asarray(context, dtype=float) * m.kv_bytes_per_token_rank(tp) * batch
    return (weight_bytes_read(m, max(batch, 1.0)) / tp + kv) / (inst.hbm_bytes_s * inst.efficiency.decode_bandwidth)


def hops_s(fleet: Fleet) -> float:
    return fleet.prefill.efficiency.request_overhead_s + fleet.decode.efficiency.request_overhead_s


def pull_overhead_s(fleet: Fleet) -> float:
    """Fixed cost a pulled (reuse-on) turn adds beyond its transfer's set-up and bytes."""
    return fleet.prefill.efficiency.pull_overhead_s


@dataclass
class TurnCosts:
    ttft_off: np.ndarray
    ttft_on: np.ndarray  # if the history is pulled (a hit)
    transfer_on: np.ndarray  # D->P pull of the history
    compute_off: np.ndarray
    compute_on: np.ndarray
    pull: np.ndarray  # bool: the threshold lets this turn pull


def turn_costs(fleet: Fleet, prompt: Any, history: Any) -> TurnCosts:
    """Costs of turns whose prompt has ``history`` tokens decode still holds; prefill computes the rest."""
    prompt, history = (np.asarray(a, dtype=float) for a in (prompt, history))
    new = prompt - history
    pd_setup = fleet.mode != "push"
    first = decode_step_s(fleet, prompt)
    # Reuse off: prefill computes everything it does not cache itself (prefix caching off by default).
    cached = history if fleet.prefill_prefix_caching else 0.0
    compute_off = compute_s(fleet, prompt - cached, cached)
    # Decode keeps its own prefix cache: it lacks only the new tokens (the whole prompt on a first turn).
    pd_tokens = np.where(history > 0, new, prompt)
    pd = transfer_s(fleet, pd_tokens, setup=pd_setup)
    ttft_off = hops_s(fleet) + compute_off + pd + first
    pull = (history > 0) & (history >= max(fleet.threshold, 1))
    transfer_on = np.where(pull, transfer_s(fleet, history), 0.0)
    compute_on = np.where(pull, compute_s(fleet, new, history), compute_off)
    ttft_on = np.where(pull, hops_s(fleet) + pull_overhead_s(fleet) + transfer_on + compute_on + pd + first, ttft_off)
    return TurnCosts(ttft_off, ttft_on, transfer_on, compute_off, compute_on, pull)


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
            })
        return rows


def evaluate(fleet: Fleet, workload: Workload, conversations: int = 5000, seed: int = 0,
             turns: Turns | None = None) -> Plan:
    turns = turns or sample(workload, min(conversations, workload.num_conversations * 50) or conversations, seed)
    costs = turn_costs(fleet, turns.prompt_tokens, turns.history_tokens)
    hit = np.where(costs.pull, hit_probability(fleet, turns.think_s), 0.0)
    ttft_on = np.where(hit > 0, costs.ttft_on, costs.ttft_off)
    load_off = _load(fleet, workload, turns, costs.compute_off, costs.ttft_off)
    service_on = np.where(hit > 0, costs.compute_on, costs.compute_off)
    load_on = _load(fleet, workload, turns, service_on, ttft_on)
    ret = retention(fleet, workload, turns, load_on.turns_per_s, ttft_on, load_on.tpot_s)
    return Plan(fleet, workload, turns, costs, hit, load_off, load_on, ret)


# -- sizing and recommendations -------------------------------------------------------------------


def size_fleet(fleet: Fleet, workload: Workload, ttft_target_ms: float | None = None, max_nodes: int = 256,
               turns: Turns | None = None, max_util: float = MAX_UTIL, arm: str = "on",
               decode_nodes: int | None = None) -> tuple[Fleet, bool]:
    """Fewest prefill engines that keep utilization under ``max_util`` and p90 TTFT under the target, and
    fewest decode engines whose KV cache holds in-use plus retained KV, each rounded up to whole instances
    (an instance runs ``devices // tp`` engines, all of them: it is paid for whole). Decode speed sets how
    fast clients come back, so the two counts are solved together. The flag says whether the target is met: below
    the unloaded p90, no number of engines meets it (then sized for the load only). ``decode_nodes``
    fixes the decode count (to compare prefill needs at the same decode speed)."""
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
        r = plan.retention
        kept = r.retained_gib_per_decode if arm == "on" else 0.0
        # The host tier holds what the device cache cannot (read at the same link rate: assumed, see docs).
        return kept + r.in_use_gib_per_decode <= 0.9 * kv_cache_gib(plan.fleet) + plan.fleet.host_kv_gib

    per_p, per_d = fleet.engines_per_node("prefill"), fleet.engines_per_node("decode")

    def whole(engines: int, per_node: int) -> int:  # an instance runs all the engines it holds
        return -(-engines // per_node) * per_node

    prefill = decode = 1
    for _ in range(6):
        before = (prefill, decode)
        decode = decode_nodes or whole(next((d for d in range(1, max_nodes + 1) if decode_ok(plan_for(prefill, d))),
                                            max_nodes), per_d)
        prefill = whole(next((p for p in range(1, max_nodes + 1) if prefill_ok(plan_for(p, decode))), max_nodes),
                        per_p)
        if (prefill, decode) == before:
            break
    return replace(fleet, prefill_nodes=prefill, decode_nodes=decode), met


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
