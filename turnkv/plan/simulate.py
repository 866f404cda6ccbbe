"""`turnkv plan --simulate`: play the workload against an xPyD fleet, vectorized with numpy.

What the closed form cannot give: the hit share and retained KV when turns compete for prefill engines
and for decode memory, and the tail of TTFT. The router's policies, as it applies them:

* clients: ``num_clients`` of them, each playing its conversations one after another; a turn arrives
  after the previous reply ends plus the think time;
* load-aware prefill choice: arrivals are dealt to prefill engines in arrival order, so each engine's
  outstanding work stays equal (the router's least-outstanding choice for equal engines); each engine
  serves FCFS, solved exactly by the Lindley recursion as a running maximum;
* decode affinity: a conversation stays on the decode engine that holds its KV;
* TTL expiry: the next turn pulls only if it arrives within the router's conversation TTL and the
  decode engine had room to retain the KV (a retention that would overflow the engine's KV cache is
  dropped, so that turn recomputes).

TTFT feeds back into arrival times, so arrivals and queueing are solved by fixed-point iteration.
Pure: numpy only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from turnkv.plan import closed_form as closed
from turnkv.plan.closed_form import GIB, Fleet
from turnkv.plan.workload import Turns, Workload, sample


@dataclass
class SimResult:
    arm: str
    conversations: int
    turns: int
    ttft_s: np.ndarray
    hit: np.ndarray  # bool per turn
    reuse_share: float  # hits over turns with history
    retained_gib_per_decode: float  # time average
    retained_gib_peak: float  # worst decode engine, worst moment
    prefill_util: float
    makespan_s: float
    seconds: float  # wall time of the simulation itself
    passes: int = 0  # fixed-point passes until arrivals, waits and hits settled


def _client_timeline(turns: Turns, clients: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, segment start flags): turns ordered client by client, conversations in play order."""
    conv = turns.conv
    client = conv % clients
    pos = conv // clients
    key = client.astype(np.int64) * (int(conv.max()) + 1) + pos
    order = np.argsort(key, kind="stable")
    c = client[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = c[1:] != c[:-1]
    return order, starts


def _segmented_exclusive_cumsum(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    total = np.cumsum(values)
    excl = total - values
    seg_id = np.cumsum(starts) - 1
    base = excl[starts][seg_id]
    return excl - base


def _fcfs_waits(arrival: np.ndarray, service: np.ndarray, servers: int) -> np.ndarray:
    """Queueing delay of each job; jobs dealt to servers in arrival order, FCFS on each (Lindley)."""
    order = np.argsort(arrival)
    wait = np.empty_like(arrival)
    for s in range(servers):
        idx = order[s::servers]
        a, x = arrival[idx], service[idx]
        cum = np.cumsum(x)
        # departure_n = cum_n + max_{k<=n}(a_k - cum_{k-1})
        dep = cum + np.maximum.accumulate(a - (cum - x))
        wait[idx] = dep - x - a
    return wait


def _retention(fleet: Fleet, turns: Turns, arrival: np.ndarray, end: np.ndarray, eligible: np.ndarray,
               capacity_bytes: float, window: tuple[float, float]) -> tuple[np.ndarray, float, float]:
    """Which turns find their KV held; time-average and peak retained bytes per decode engine."""
    m, tp = fleet.model, fleet.tp_decode
    node_bytes_per_token = m.kv_bytes_per_token_rank(tp) * tp
    n = len(arrival)
    same_conv_next = np.zeros(n, dtype=bool)
    same_conv_next[:-1] = turns.conv[1:] == turns.conv[:-1]
    next_arrival = np.full(n, np.inf)
    next_arrival[:-1] = np.where(same_conv_next[:-1], arrival[1:], np.inf)
    hold_end = np.minimum(end + fleet.ttl_s, next_arrival)
    size = (turns.prompt_tokens + turns.output_tokens - 1) * node_bytes_per_token
    node = turns.conv % fleet.decode_nodes
    # Sweep per node: +size at each retention start, -size at its end; a retention that would push its
    # node over the KV cache is dropped (its next turn recomputes).
    kept = np.ones(n, dtype=bool)
    times = np.concatenate([end, hold_end])
    deltas = np.concatenate([size, -size])
    nodes = np.concatenate([node, node])
    # One sort: by node, then time; a release sorts before a grab at the same instant.
    span = float(np.max(times[np.isfinite(times)], initial=0.0)) + 1.0
    key = nodes * span + times + (deltas > 0) * (span * 1e-12)
    ev = np.argsort(key)
    d_sorted, n_sorted = deltas[ev], nodes[ev]
    first = np.ones(len(ev), dtype=bool)
    first[1:] = n_sorted[1:] != n_sorted[:-1]
    grab = ev < n
    interval = np.where(grab, ev, ev - n)  # the retention each event belongs to
    # Drop the retentions that find their engine full, recount without them, until none overflows (a
    # dropped retention frees room for later ones only from the next pass: slightly conservative).
    for _ in range(20):
        live = kept[interval]
        level = _segmented_exclusive_cumsum(np.where(live, d_sorted, 0.0), first) + np.where(live, d_sorted, 0.0)
        over = grab & live & (level > capacity_bytes)
        if not over.any():
            break
        kept[ev[over]] = False
    peak = float(level.max()) if len(level) else 0.0
    t0, t1 = window
    overlap = np.clip(np.minimum(hold_end, t1) - np.maximum(end, t0), 0.0, None)
    retained_avg = float(np.where(kept, overlap * size, 0.0).sum()) / max(t1 - t0, 1e-9) / fleet.decode_nodes
    # The next turn pulls when the previous turn's KV was kept and it arrives within the router's TTL.
    prev_kept = np.zeros(n, dtype=bool)
    prev_kept[1:] = kept[:-1] & same_conv_next[:-1]
    gap = np.zeros(n)
    gap[1:] = arrival[1:] - end[:-1]
    hit = eligible & prev_kept & (gap < fleet.effective_ttl_s)
    return hit, retained_avg, peak


def _steady_window(arrival: np.ndarray, end: np.ndarray, client: np.ndarray, clients: int) -> tuple[float, float]:
    """From the last client's start until the first client runs out of conversations: every client busy,
    so time averages describe the offered load, not the ramp-up or the ramp-down."""
    last_end = np.full(clients, -np.inf)
    first_arrival = np.full(clients, np.inf)
    np.maximum.at(last_end, client, end)
    np.minimum.at(first_arrival, client, arrival)
    active = np.isfinite(last_end)
    t0 = float(first_arrival[active].max()) if active.any() else float(arrival.min())
    t1 = float(last_end[active].min()) if active.any() else float(end.max())
    return (t0, t1) if t1 > t0 else (float(arrival.min()), float(end.max()))


def simulate(fleet: Fleet, workload: Workload, conversations: int | None = None, arm: str = "on", seed: int = 0,
             iterations: int = 12, turns: Turns | None = None) -> SimResult:
    started = time.perf_counter()
    turns = turns or sample(workload, conversations, seed)
    n = len(turns.conv)
    clients = workload.num_clients
    ctx = turns.prompt_tokens + turns.output_tokens / 2
    tpot = float(closed.decode_step_s(fleet, ctx.mean(), max(1.0, clients / fleet.decode_nodes)))
    # Prefill's own prefix cache as the closed form has it (Che's approximation at the offered load): the
    # simulation plays queueing and decode retention, not the prefill cache's LRU.
    lam = clients / max(float(np.mean(turns.think_s + turns.output_tokens * tpot)), 1e-9)
    cache = closed.prefill_cache(fleet, turns, lam, tpot, seed)
    costs = closed.turn_costs(fleet, turns.prompt_tokens, turns.history_tokens, cache.cached, cache.offloaded)
    decode_s = turns.output_tokens * tpot
    order, starts = _client_timeline(turns, clients)
    # Both retention tiers (the host tier holds what the device cache cannot). Not modelled: the connector's idle
    # eviction (a turn unread for ~2 think-time p90s gives its room to a newer one), so turns of conversations that
    # ended hold room until the TTL here: under pressure this undercounts reuse.
    capacity = (closed.kv_cache_gib(fleet) + fleet.host_kv_gib) * GIB
    eligible = costs.pull if arm == "on" else np.zeros(n, dtype=bool)
    hit = eligible.copy()
    wait = np.zeros(n)
    # Clients start spread over one mean conversation, not all at t=0: steady load, no start-up stampede.
    conversation_s = float((turns.think_s + costs.ttft_off + decode_s).sum()) / (int(turns.conv.max()) + 1)
    client_offset = np.random.default_rng(seed + 1).uniform(0.0, conversation_s, clients)
    start = client_offset[turns.conv % clients]
    for i in range(iterations):
        previous = wait
        base = np.where(hit, costs.ttft_on, costs.ttft_off)
        service = np.where(hit, costs.compute_on, costs.compute_off)
        ttft = base + wait
        busy = (ttft + decode_s)[order]
        arrival = np.empty(n)
        arrival[order] = _segmented_exclusive_cumsum(busy, starts) + \
            (_segmented_exclusive_cumsum(turns.think_s[order], starts) + turns.think_s[order])
        arrival += start
        wait = _fcfs_waits(arrival, service, fleet.prefill_nodes)
        if i > 1:  # damped from the third pass: under heavy load waits and arrivals otherwise oscillate
            wait = 0.5 * (wait + previous)
        end = arrival + base + wait + decode_s
        window = _steady_window(arrival, end, turns.conv % clients, clients)
        # Settled in distribution: single turns keep reshuffling (any shift moves a client's later turns),
        # so compare the mean wait and the hit share between passes.
        settled = abs(float(wait.mean() - previous.mean())) < max(5e-4, 0.02 * float(wait.mean()))
        if arm == "on":
            new_hit, retained, peak = _retention(fleet, turns, arrival, end, eligible, capacity, window)
            settled = settled and abs(int(new_hit.sum()) - int(hit.sum())) <= 1e-3 * n
            hit = new_hit
        if settled:
            break
    if arm != "on":  # what reuse would have retained, for comparison (nothing is pulled)
        _, retained, peak = _retention(fleet, turns, arrival, end, eligible, np.inf, window)
    ttft = np.where(hit, costs.ttft_on, costs.ttft_off) + wait
    service = np.where(hit, costs.compute_on, costs.compute_off)
    makespan = float(end.max() - arrival.min())
    t0, t1 = window
    busy_in_window = np.clip(np.minimum(arrival + wait + service, t1) - np.maximum(arrival + wait, t0), 0.0, None)
    with_history = turns.history_tokens > 0
    return SimResult(arm, int(turns.conv.max()) + 1, n, ttft, hit,
                     float(hit.sum() / max(with_history.sum(), 1)), retained / GIB, peak / GIB,
                     float(busy_in_window.sum() / max(t1 - t0, 1e-9) / fleet.prefill_nodes), makespan,
                     time.perf_counter() - started, i + 1)


def summary(result: SimResult) -> dict[str, float]:
    t = result.ttft_s * 1000
    return {"mean": round(float(t.mean()), 1), "p50": round(float(np.percentile(t, 50)), 1),
            "p90": round(float(np.percentile(t, 90)), 1), "p99": round(float(np.percentile(t, 99)), 1)}
