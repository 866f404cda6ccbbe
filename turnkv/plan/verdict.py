"""Does reuse pay? turnkv's fleet against what a user would run instead, sized the same way. Pure: numpy only.

The arms, each sized on its own by ``closed_form.size_fleet`` for the same workload and target:

* ``reuse``: turnkv as planned (decode keeps turns, prefill pulls what its own cache lacks);
* ``peer``: no reuse, prefill prefix caching with a host offload tier (vLLM's native CPU offloading), and the
  same prefix-aware routing: the strongest thing a user would run instead;
* ``peer_no_offload``: the same without the offload tier.

Reuse pays when it costs less per turn than the best peer that meets the target, and is not slower at p90
(within the tolerances below), or costs the same and is faster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from turnkv.plan import closed_form as m
from turnkv.plan.workload import Turns, Workload

#: Differences below these are ties: node counts are whole, and the model's band is far wider.
COST_TIE = 0.005
TTFT_TIE = 0.05
ARMS = ("reuse", "peer", "peer_no_offload")
LABELS = {"reuse": "turnkv", "peer": "peer+offload", "peer_no_offload": "peer"}


@dataclass
class Arm:
    name: str
    fleet: m.Fleet
    plan: m.Plan
    met: bool
    capped: list[str]

    @property
    def kind(self) -> str:
        return "on" if self.name == "reuse" else "off"

    def ttft_ms(self) -> dict[str, float | None]:
        return m.summarize(self.plan)["ttft_ms"][self.kind]

    def turns_per_s(self) -> float:
        return self.plan.load(self.kind).turns_per_s

    def cost_per_1k_turns(self) -> float:
        rate = self.turns_per_s()
        return self.fleet.cost_per_hour() / (rate * 3.6) if rate > 0 else float("inf")

    def token_sources(self) -> dict[str, float]:
        """Shares of all prompt tokens: computed, from prefill's device cache, its offload tier, pulled from
        decode's device tier, pulled from decode's host tier."""
        t, c, plan = self.plan.turns, self.plan.costs, self.plan
        prompt = t.prompt_tokens.astype(float)
        cached = np.broadcast_to(np.asarray(c.cached, dtype=float), prompt.shape)
        offloaded = plan.cache.offloaded if plan.cache is not None else np.zeros_like(prompt)
        pulled = np.zeros_like(prompt)
        if self.kind == "on":
            pulled = np.broadcast_to(np.asarray(c.pulled, dtype=float), prompt.shape) * (plan.hit > 0)
        r = plan.retention
        kept = r.device_gib_per_decode + r.host_gib_per_decode
        host_share = r.host_gib_per_decode / kept if kept > 0 else 0.0
        total = float(prompt.sum())
        return {"computed": round(float((prompt - cached - pulled).sum()) / total, 4),
                "prefill_cache": round(float((cached - offloaded).sum()) / total, 4),
                "prefill_offload": round(float(offloaded.sum()) / total, 4),
                "pulled_device": round(float(pulled.sum()) * (1 - host_share) / total, 4),
                "pulled_host": round(float(pulled.sum()) * host_share / total, 4)}

    def summary(self) -> dict[str, Any]:
        f = self.fleet
        return {"label": LABELS[self.name], "ttft_ms": self.ttft_ms(),
                "nodes": {"prefill": f.instances("prefill"), "decode": f.instances("decode")},
                "engines": {"prefill": f.prefill_nodes, "decode": f.decode_nodes},
                "cost_per_hour": round(f.cost_per_hour(), 2), "turns_per_s": round(self.turns_per_s(), 3),
                "cost_per_1k_turns": round(self.cost_per_1k_turns(), 4), "ttft_target_met": self.met,
                "capped": self.capped, "prefill_offload_gib": f.prefill_offload_gib, "host_kv_gib": f.host_kv_gib,
                "prefill_prefix_caching": f.prefill_prefix_caching,
                "prefill_utilization": round(self.plan.load(self.kind).prefill_util, 4),
                "prefill_cache_hit_share": round(self.plan.cache.hit_share, 4) if self.plan.cache else 0.0,
                "token_sources": self.token_sources()}


def arms(fleet: m.Fleet, workload: Workload, turns: Turns, ttft_target: float | None,
         peer_offload_gib: float) -> dict[str, Arm]:
    """The three arms, each sized on its own (see the module docstring)."""
    peer = replace(fleet, prefill_prefix_caching=True, host_kv_gib=0.0)
    specs = {"reuse": (fleet, "on"), "peer": (replace(peer, prefill_offload_gib=peer_offload_gib), "off"),
             "peer_no_offload": (replace(peer, prefill_offload_gib=0.0), "off")}
    out = {}
    for name, (base, kind) in specs.items():
        sized, met = m.size_fleet(base, workload, ttft_target, turns=turns, arm=kind)
        out[name] = Arm(name, sized, m.evaluate(sized, workload, turns=turns), met, m.capped(sized))
    return out


def _pulled_turn_terms(reuse: Arm) -> dict[str, float]:
    """Mean milliseconds per pulled turn: compute saved, transfer, the pull's fixed cost."""
    c, hit = reuse.plan.costs, reuse.plan.hit > 0
    if not hit.any():
        return {"pulled_turns": 0.0, "compute_saved_ms": 0.0, "transfer_ms": 0.0, "pull_fixed_ms": 0.0}
    return {"pulled_turns": round(float(hit.mean()), 4),
            "compute_saved_ms": round(float((c.compute_off - c.compute_on)[hit].mean()) * 1000, 1),
            "transfer_ms": round(float(c.transfer_on[hit].mean()) * 1000, 1),
            "pull_fixed_ms": round(c.pull_fixed * 1000, 1)}


def ttft_terms_ms(reuse: Arm, peer: Arm) -> dict[str, float]:
    """Where the mean TTFT difference (peer minus reuse, ms; positive: reuse faster) comes from: compute prefill
    does (peer's: what its cache misses, offload loads included; reuse's: the new tokens of pulled turns), prefill
    queueing, and what a pull adds (its transfer and fixed cost)."""
    rp, pp = reuse.plan, peer.plan
    hit = rp.hit > 0
    c = rp.costs
    reuse_compute = np.where(hit, c.compute_on, c.compute_off)
    return {"compute": round(float(pp.costs.compute_off.mean() - reuse_compute.mean()) * 1000, 1),
            "queueing": round((pp.load("off").wait_s - rp.load("on").wait_s) * 1000, 1),
            "transfer": round(-float((c.transfer_on * hit).mean()) * 1000, 1),
            "pull_fixed": round(-float((c.pull_fixed * hit).mean()) * 1000, 1)}


TERM_NAMES = {"compute": "prefill compute", "queueing": "prefill queueing", "transfer": "the pull's transfer",
              "pull_fixed": "the pull's fixed cost"}


def offload_arm(result: dict[str, Arm]) -> bool:
    """Whether the peer+offload arm has an offload tier (else it is the peer arm again)."""
    return result["peer"].fleet.prefill_offload_gib > 0


def verdict(result: dict[str, Arm], ttft_target: float | None = None) -> dict[str, Any]:
    """``pays`` and the reason, against the best peer (the cheapest per 1k turns among those meeting the target).
    With a target both arms meet, TTFT under it does not count: cost decides (TTFT breaks a cost tie)."""
    reuse = result["reuse"]
    # Without an offload tier (none given, or an image that runs none: trn2) "peer+offload" is "peer": left out.
    peers = [result["peer"], result["peer_no_offload"]] if offload_arm(result) else [result["peer_no_offload"]]
    best = min(peers, key=lambda a: (not a.met, a.cost_per_1k_turns(), a.ttft_ms()["p90"] or float("inf")))
    r_cost, p_cost = reuse.cost_per_1k_turns(), best.cost_per_1k_turns()
    r90, p90 = reuse.ttft_ms()["p90"], best.ttft_ms()["p90"]
    cheaper = r_cost < p_cost * (1 - COST_TIE)
    dearer = r_cost > p_cost * (1 + COST_TIE)
    faster = r90 is not None and (p90 is None or r90 < p90 * (1 - TTFT_TIE))
    slower = r90 is None or (p90 is not None and r90 > p90 * (1 + TTFT_TIE))
    meets = reuse.met or not best.met
    under_target = ttft_target is not None and reuse.met and best.met and r90 is not None and r90 <= ttft_target
    if under_target:  # both meet the target: the cheaper fleet wins, TTFT only breaks a tie
        pays = cheaper or (not dearer and faster)
    else:
        pays = meets and not dearer and not slower and (cheaper or faster)
    pays = pays and not reuse.capped
    price = reuse.fleet.prefill.price_per_hour
    d_p = reuse.fleet.instances("prefill") - best.fleet.instances("prefill")
    d_d = reuse.fleet.instances("decode") - best.fleet.instances("decode")
    terms = _pulled_turn_terms(reuse)
    ttft_terms = ttft_terms_ms(reuse, best)
    saved = terms["compute_saved_ms"]
    # Which term dominates: the larger node-cost difference when the fleets differ in cost; else the TTFT term that
    # moves the answer most in its direction (positive: reuse faster).
    costs = {"decode nodes for retained KV": d_d * price, "prefill nodes": d_p * price}
    per_hour = reuse.fleet.cost_per_hour() - best.fleet.cost_per_hour()
    if (cheaper and per_hour > 0) or (dearer and per_hour < 0):
        # dearer by the hour but cheaper per turn (or the reverse): the closed loop's turn rate decides; more
        # decode nodes decode faster, and clients come back sooner
        dominant = "turns served per hour (decode speed)"
    elif (d_p or d_d) and (cheaper or dearer):
        dominant = max(costs, key=lambda k: abs(costs[k]))
    else:
        agree = {k: v for k, v in ttft_terms.items() if (v > 0) == pays and v != 0} or ttft_terms
        dominant = TERM_NAMES[max(agree, key=lambda k: abs(agree[k]))]
    ms = "overloaded" if r90 is None else f"{r90:.0f} ms"
    pms = "overloaded" if p90 is None else f"{p90:.0f} ms"
    parts = [f"{LABELS['reuse']} {_nodes(reuse)} ${reuse.fleet.cost_per_hour():.2f}/h at {reuse.turns_per_s():.2f} "
             f"turns/s, ${r_cost:.3f} per 1k turns, p90 TTFT {ms}; {LABELS[best.name]} {_nodes(best)} "
             f"${best.fleet.cost_per_hour():.2f}/h at {best.turns_per_s():.2f} turns/s, ${p_cost:.3f} per 1k turns, "
             f"p90 {pms}"]
    if under_target:
        parts.append(f"both meet the {ttft_target:.0f} ms p90 target, so cost decides")
    if d_d or d_p:
        parts.append(f"reuse takes {d_d:+d} decode and {d_p:+d} prefill node(s) ({(d_d + d_p) * price:+.2f} $/h)")
    if terms["pulled_turns"]:
        parts.append(f"a pulled turn saves {saved:.0f} ms of compute for {terms['transfer_ms']:.0f} ms of transfer + "
                     f"{terms['pull_fixed_ms']:.0f} ms fixed; {terms['pulled_turns']:.0%} of turns pull")
    else:
        parts.append("no turn pulls (prefill's own cache or the threshold leaves nothing worth pulling)")
    parts.append("mean TTFT against the peer (ms, + for reuse): "
                 + ", ".join(f"{TERM_NAMES[k]} {v:+.0f}" for k, v in ttft_terms.items()))
    if not meets:
        parts.append("reuse misses the TTFT target the peer meets")
    if reuse.capped or best.capped:
        parts.append(f"the sizing stopped at {m.MAX_ENGINES:,} engines for "
                     + ", ".join(f"{a.name}'s {'/'.join(a.capped)}" for a in (reuse, best) if a.capped)
                     + ": that fleet is not enough, the figures are at the cap")
    return {"pays": bool(pays), "against": best.name, "dominant": dominant,
            "reason": ("reuse pays: " if pays else "reuse does not pay: ") + "; ".join(parts)
            + f" (dominant: {dominant})",
            "per_pulled_turn": terms, "ttft_terms_ms": ttft_terms,
            "arms": {name: arm.summary() for name, arm in result.items()}}


def _nodes(arm: Arm) -> str:
    return f"{arm.fleet.instances('prefill')}P{arm.fleet.instances('decode')}D"
