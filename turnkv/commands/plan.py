"""`turnkv plan`: size a multi-turn P/D fleet with bi-directional KV reuse, before paying for it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from turnkv import params
from turnkv.commands import renamed, show_table
from turnkv.local.stack import state_folder

console = Console(stderr=True)

#: The catalog's tunables the planner sizes for (defaults and bounds of --ttl and --threshold).
_TTL, _THRESHOLD = params.get("decoder_kv_blocks_ttl"), params.get("kv_recompute_threshold")
DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "bench" / "workloads" / "agentic-p5en.json"

app = typer.Typer(help="Capacity planner: TTFT with reuse off/on, retained KV, hit share, nodes, cost.",
                  invoke_without_command=True)


def _fail(message: str) -> None:
    console.print(f"[red]{message}[/red]", soft_wrap=True)
    raise typer.Exit(2)


#: The tensor-parallel flags, named as `vllm serve --tensor-parallel-size` (the former --tp-prefill and --tp-decode
#: still answer, hidden).
TP, PREFILL_TP, DECODE_TP = "--tensor-parallel-size", "--prefill-tensor-parallel-size", "--decode-tensor-parallel-size"


def build_fleet(model: str, instance: str, tp: int | None, tp_prefill: int | None, tp_decode: int | None,
                dtype: str | None, kv_dtype: str | None, block_size: int | None, mode: str, ttl: float,
                threshold: int, prefill_prefix_caching: bool, state_dir: Path, price: float | None):
    from turnkv.engine_args import EngineSpec
    from turnkv.plan import architectures, hardware
    from turnkv.plan.closed_form import Fleet

    dtype, kv_dtype = _precision("--dtype", dtype, WEIGHT_DTYPES), _precision("--kv-dtype", kv_dtype, KV_DTYPES)
    try:
        arch = architectures.load(model).with_dtypes(dtype, kv_dtype)
        inst = hardware.load(instance, state_dir)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    if arch.kv_dtype == "fp8_ds_mla" and not arch.mla:
        _fail(f"--kv-dtype 'fp8_ds_mla' is vLLM's layout for MLA models; {arch.name} has none: use "
              f"{', '.join(sorted(set(KV_DTYPES) - {'fp8_ds_mla', 'auto'}))}")
    if price is not None:
        inst = replace(inst, price_per_hour=price)
    # TP in the deployment's unit (model.tensor_parallel_size): GPUs, or logical NeuronCores on trn2 (4 a chip), so
    # a node runs as many engines as the deploy gives it; the model prices whole devices (ranks_per_device).
    per_device = inst.ranks_per_device
    ranks = inst.devices * per_device
    default_tp = 1 if instance == "local-cpu" else ranks if ranks <= 8 else 16
    given = {PREFILL_TP: tp_prefill, DECODE_TP: tp_decode} if tp is None else {
        TP: tp, PREFILL_TP: tp_prefill, DECODE_TP: tp_decode}
    allowed = [str(2**k) for k in range(ranks.bit_length()) if per_device <= 2**k <= ranks]
    unit = "" if per_device == 1 else f" logical NeuronCores ({per_device} a chip, LNC=2)"
    for name, value in given.items():
        # infra/config.py (model.tensor_parallel_size) accepts powers of two only, at most the accelerators
        if value is not None and value & (value - 1):
            _fail(f"{name} {value} is not a power of two, which a deployment's model.tensor_parallel_size must be "
                  f"(infra/config.py): use {', '.join(allowed)} on {inst.name}")
        if value is not None and value % per_device:
            _fail(f"{name} {value}: the planner prices whole chips of {inst.name}, TP in{unit}: use "
                  f"{', '.join(allowed)}")
    tp_p, tp_d = tp_prefill or tp or default_tp, tp_decode or tp or default_tp
    for name, value in ((PREFILL_TP, tp_p), (DECODE_TP, tp_d)):
        if value > ranks:
            _fail(f"{name} {value} exceeds the {ranks}{unit or ' devices'} of one {inst.name}: use "
                  f"{', '.join(allowed)}")
    tp_p, tp_d = tp_p // per_device, tp_d // per_device
    if mode not in ("pull", "push"):
        _fail(f"--mode {mode!r}: use pull or push")
    weights = arch.total_params() * arch.weight_bytes_per_param
    for name, value in ((PREFILL_TP, tp_p), (DECODE_TP, tp_d)):
        if inst.kv_cache_bytes(value, weights) <= 0.05 * value * inst.hbm_bytes:
            _fail(f"{arch.name}'s weights ({weights / 1e9:.0f} GB) leave no room for a KV cache on {value} device(s) "
                  f"of {inst.name} ({value * inst.hbm_bytes * inst.memory_utilization / 1e9:.0f} GB usable): "
                  + (f"raise {name}" if value < inst.devices else "pick an instance with more memory")
                  + ("" if arch.dtype == "fp8" else " or use --dtype fp8")
                  + ("; the local stack runs --model tiny-local, and `turnkv plan twin` predicts what `turnkv bench "
                     "capacity` measures on it" if inst.name == "local-cpu" else ""))
    # The block size turnkv's engines run with, locally and on AWS (turnkv.engine_args: `--block-size`).
    block = block_size or EngineSpec.block_size
    if block % inst.kv_block_multiple:
        fits = [b for b in (16, 32, 64, 128, 256) if b % inst.kv_block_multiple == 0]
        _fail(f"--block-size {block}: vLLM's attention backend on {inst.name} takes multiples of "
              f"{inst.kv_block_multiple} tokens: use {', '.join(map(str, fits))} (turnkv's engines run "
              f"{EngineSpec.block_size})")
    return Fleet(arch, inst, inst, tp_p, tp_d, block, mode,
                 float(ttl), int(threshold), prefill_prefix_caching=prefill_prefix_caching)


#: Why a Neuron plan counts no host tier (decode's or prefill's offload tier).
HOST_TIER_REFUSAL = "decode's host tier and vLLM's offload tier need vLLM 0.32 and a GPU; the Neuron image runs 0.29"


#: Precisions the planner models, as vLLM names them (``--dtype``, ``--quantization fp8``, ``--kv-cache-dtype``)
#: and their short forms; "auto" keeps the model's own. Anything else (int4, fp4, ...) is refused, not guessed.
WEIGHT_DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32", "fp8": "fp8"}
KV_DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
             "fp32": "float32", "float32": "float32", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
             "fp8_ds_mla": "fp8_ds_mla"}


def from_deploy_config(path: Path, model: str, instance: str, tp: int | None
                       ) -> tuple[str, str, int, tuple[int, int]]:
    """(model, instance, TP, engines a node for prefill and decode) of a deploy config, as the deploy runs them: the
    pools' one instance type, model.tensor_parallel_size (the deployment's unit), ``engines_per_node`` of the first
    pool of each role, and model.id where the planner's catalog has it (else ``model`` as given)."""
    from infra.config import validate_file
    from turnkv.engine_args import Role
    from turnkv.plan import architectures

    config, problems = validate_file(path)
    if problems or config is None:
        _fail(f"--config {path}: invalid; run `turnkv config validate {path}`")
    types = sorted({p.instance_type for p in config.pools})
    if len(types) != 1:
        _fail(f"--config {path}: pools on {', '.join(types)}; the planner prices one instance type")
    if tp is not None and tp != config.model.tensor_parallel_size:
        _fail(f"{TP} {tp} and --config's model.tensor_parallel_size {config.model.tensor_parallel_size}: give one")
    name = config.model.id.rstrip("/").rsplit("/", 1)[-1]
    known = next((k for k in architectures.CATALOG if k.lower() == name.lower()), None)
    per_role = tuple(config.engines_per_node(next(p for p in config.pools if p.role is role))
                     for role in (Role.PREFILL, Role.DECODE))
    return known or model, types[0], config.model.tensor_parallel_size, per_role  # type: ignore[return-value]


def _tp_unit(inputs: dict[str, Any]) -> str:
    """" logical NeuronCores (N chips an engine)" where the TP unit is not the device (trn2); "" elsewhere."""
    devices = inputs.get("devices_per_engine") or inputs["tp"]
    if devices == inputs["tp"]:
        return ""
    return f" logical NeuronCores ({devices['prefill']}/{devices['decode']} chips an engine)"


def _check_workload(fleet, workload) -> None:
    """Refuse a workload the model cannot serve: a conversation longer than its context window."""
    from turnkv.plan.workload import sample

    limit = fleet.model.max_context
    if not limit:
        return
    turns = sample(workload, min(workload.num_conversations, 5000), 0)
    longest = int((turns.prompt_tokens + turns.output_tokens).max())
    if longest > limit:
        _fail(f"--workload: its longest turn reaches {longest:,} tokens (prompt + reply), beyond {fleet.model.name}'s "
              f"{limit:,}-token context (max_position_embeddings): lower prefix_num_tokens (or its max), num_turns "
              f"or the reply length, or plan a model with a longer context")


def _precision(flag: str, value: str | None, allowed: dict[str, str | None]) -> str | None:
    if value is None:
        return None
    if value.lower() not in allowed:
        _fail(f"{flag} {value!r} is not a precision the planner models (vLLM names, or their short forms): use "
              f"{', '.join(allowed)}")
    return allowed[value.lower()]


def default_offload_gib(inst, tp: int, engines: int | None = None) -> float:
    """An engine's default host tier (decode's retained turns, or a peer prefill's offload tier): half the node's
    host memory over its engines (``engines``, default devices // TP), as the deploy sizes decode's
    (infra/instances.py host_tier_budget_mib)."""
    return 0.5 * inst.host_memory_gib / max(1, engines or inst.devices // max(1, tp))


def run_plan(fleet, workload, ttft_target: float | None, simulate: bool, conversations: int,
             deployment: str, peer_offload_gib: float | None = None) -> dict[str, Any]:
    """Everything `turnkv plan` prints, as one JSON-ready dict (pure apart from the timing)."""
    from turnkv.plan import closed_form as m
    from turnkv.plan import simulate as sim
    from turnkv.plan import verdict as v
    from turnkv.plan.workload import sample

    turns = sample(workload, 5000, 0)
    offload = default_offload_gib(fleet.prefill, fleet.tp_prefill) if peer_offload_gib is None else peer_offload_gib
    if not fleet.prefill.host_tiers:  # no offload tier on this image: the peer runs its prefix cache only
        offload = 0.0
    arms = v.arms(fleet, workload, turns, ttft_target, offload)
    sized, target_met, plan = arms["reuse"].fleet, arms["reuse"].met, arms["reuse"].plan
    # Reuse off sized on its own, by the same function, for the same target and workload, with the same prefill
    # settings: prefill for what its own cache does not hold, decode for the turns in flight only.
    no_reuse, target_met_off = m.size_fleet(replace(fleet, host_kv_gib=0.0), workload, ttft_target, turns=turns,
                                            arm="off")
    # Reuse off is shown on the fleet sized for it: what running without reuse would take and give.
    plan_off = m.evaluate(no_reuse, workload, turns=turns)
    per_turn = [on | {"ttft_ms_off": off["ttft_ms_off"]} for on, off in zip(plan.per_turn(), plan_off.per_turn(),
                                                                           strict=False)]
    curve = m.ttl_curve(sized, workload, turns)
    ttl = m.recommend_ttl(curve)
    later = turns.history_tokens > 0
    new = float((turns.prompt_tokens - turns.history_tokens)[later].mean()) if later.any() else 0.0
    threshold = m.break_even_tokens(sized, new)
    price = sized.cost_per_hour()
    hit = plan.hit > 0
    per_node = {role: sized.engines_per_node(role) for role in ("prefill", "decode")}
    band = sized.prefill.efficiency.ttft_band
    for row in per_turn:
        for arm in ("off", "on"):
            row[f"ttft_ms_{arm}_band"] = band_ms(row[f"ttft_ms_{arm}"], band)
    verdict = v.verdict(arms, ttft_target)
    capped = {name: arm.capped for name, arm in arms.items() if arm.capped} | (
        {"no_reuse": m.capped(no_reuse)} if m.capped(no_reuse) else {})
    out: dict[str, Any] = {
        "verdict": verdict,
        "capped": capped,
        "max_engines_per_role": m.MAX_ENGINES,
        "inputs": {"model": sized.model.name, "dtype": sized.model.dtype, "kv_dtype": sized.model.kv_dtype,
                   "instance": sized.prefill.name,
                   # In the deployment's unit (model.tensor_parallel_size); "devices": what the model prices.
                   "tp": {"prefill": sized.tp_prefill * sized.prefill.ranks_per_device,
                          "decode": sized.tp_decode * sized.decode.ranks_per_device},
                   "devices_per_engine": {"prefill": sized.tp_prefill, "decode": sized.tp_decode},
                   "block_size": sized.block_size, "mode": sized.mode, "ttl_s": sized.ttl_s,
                   "threshold": sized.threshold, "prefill_prefix_caching": sized.prefill_prefix_caching,
                   "prefill_offload_gib": sized.prefill_offload_gib, "peer_offload_gib": offload,
                   "routing": sized.routing, "host_kv_gib": sized.host_kv_gib,
                   "ttft_target_ms": ttft_target, "num_clients": workload.num_clients,
                   "mean_user_turns": round(workload.mean_user_turns(), 2),
                   "deployable": sized.prefill.deployable, "deployable_note": sized.prefill.deployable_note},
        "assumptions": {"num_clients": workload.num_clients,
                        "think_time_s_mean": round(float(workload.think_time_s.mean()), 1),
                        "turns_per_s": round(plan.load_on.turns_per_s, 2),
                        "max_prefill_utilization": m.MAX_UTIL, "block_size": sized.block_size,
                        "prefill_prefix_caching": sized.prefill_prefix_caching,
                        "prefill_cache": {"hit_share": round(plan.cache.hit_share, 4),
                                          "offload_share": round(plan.cache.offload_share, 4),
                                          "characteristic_time_s": {"device": _finite(plan.cache.t_device_s),
                                                                    "with_offload": _finite(plan.cache.t_total_s)}},
                        "pull_fixed_components": [
                            {"name": c.name, "ms": round(c.seconds * 1000, 1), "per_turn": c.per_turn,
                             "source": c.source} for c in sized.prefill.efficiency.pull_components],
                        "pull_fixed_ms": round(sized.prefill.efficiency.pull_overhead_s * 1000, 1),
                        "pd_handover_ms": round(sized.prefill.efficiency.pd_handover_s * 1000, 1),
                        "decode_prefix_caching": True, "engines_per_node": per_node,
                        "price_per_node_hour": sized.prefill.price_per_hour},
        "ttft_ms": {"off": m.summarize(plan_off)["ttft_ms"]["off"], "on": m.summarize(plan)["ttft_ms"]["on"]},
        "ttft_ms_band": {},
        "per_turn": per_turn,
        "transfer_ms": round(float(plan.costs.transfer_on[hit].mean() * 1000), 1) if hit.any() else 0.0,
        "compute_saved_ms": round(float((plan.costs.compute_off - plan.costs.compute_on)[hit].mean() * 1000), 1)
        if hit.any() else 0.0,
        "retained_gib_per_decode": round(plan.retention.retained_gib_per_decode, 3),
        "retained_share_of_kv_cache": round(plan.retention.share_of_kv_cache, 4),
        "retained_tiers_gib_per_decode": {"device": round(plan.retention.device_gib_per_decode, 3),
                                          "host": round(plan.retention.host_gib_per_decode, 3),
                                          "host_budget": sized.host_kv_gib,
                                          "fits": round(plan.retention.fits, 4)},
        "kv_cache_gib_per_decode": round(m.kv_cache_gib(sized), 1),
        "reuse_share": round(plan.retention.reuse_share, 4),
        "prefill_utilization": {"off": round(plan_off.load_off.prefill_util, 4),
                                "on": round(plan.load_on.prefill_util, 4)},
        "nodes": {"prefill": sized.instances("prefill"), "decode": sized.instances("decode")},
        "engines": {"prefill": sized.prefill_nodes, "decode": sized.decode_nodes},
        "engines_per_node": per_node,
        "ttft_target_met": target_met,
        "nodes_without_reuse": {"prefill": no_reuse.instances("prefill"), "decode": no_reuse.instances("decode"),
                                "engines": {"prefill": no_reuse.prefill_nodes, "decode": no_reuse.decode_nodes},
                                "ttft_target_met": target_met_off,
                                "cost_per_hour": round(no_reuse.cost_per_hour(), 2)},
        "cost_per_hour": round(price, 2),
        "ttl_curve": curve,
        "recommend": {"decoder_kv_blocks_ttl": ttl, "conversation_ttl": m.conversation_ttl(ttl),
                      "kv_recompute_threshold": threshold, "params_set": m.params_line(ttl, threshold, deployment)},
        "ttft_band": {"relative": band, "source": sized.prefill.efficiency.ttft_band_source},
        "constants": {"efficiency": sized.prefill.efficiency.__dict__ | {"transfer_efficiency": None},
                      "sources": sized.prefill.sources},
    }
    out["ttft_ms_band"] = {arm: {k: band_ms(v, band) for k, v in out["ttft_ms"][arm].items()} for arm in ("off", "on")}
    if simulate:
        results = {arm: sim.simulate(fl, workload, conversations, arm=arm) for arm, fl in (("off", no_reuse),
                                                                                          ("on", sized))}
        out["simulation"] = {
            "conversations": results["on"].conversations, "turns": results["on"].turns,
            "ttft_ms": {arm: sim.summary(r) for arm, r in results.items()},
            "reuse_share": round(results["on"].reuse_share, 4),
            "retained_gib_per_decode": round(results["on"].retained_gib_per_decode, 3),
            "retained_gib_peak": round(results["on"].retained_gib_peak, 3),
            "seconds": round(sum(r.seconds for r in results.values()), 2),
        }
        out["simulation"]["ttft_ms_band"] = {arm: {k: band_ms(v, band) for k, v in summ.items()}
                                             for arm, summ in out["simulation"]["ttft_ms"].items()}
    return out


def _finite(value: float) -> float | None:
    return round(value, 1) if value != float("inf") else None


def band_ms(value: float | None, band: float | None) -> list[float] | None:
    """[low, high] of a TTFT in ms under a relative band (None without a value or a band)."""
    if value is None or band is None:
        return None
    return [round(value * (1 - band), 1), round(value * (1 + band), 1)]


def chart(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), dpi=120)
    rows = result["per_turn"]
    x = [r["prompt_tokens"] for r in rows]
    left.plot(x, [r["ttft_ms_off"] for r in rows], "o-", color="#c0392b", label="reuse off (prefill prefix cache only)")
    left.plot(x, [r["ttft_ms_on"] for r in rows], "s-", color="#27ae60", label="reuse on (pull from decode)")
    left.plot(x, [r["transfer_ms"] for r in rows], "^--", color="#7f8c8d", label="KV transfer (D->P)")
    band = result["ttft_band"]["relative"]
    for arm, color in (("off", "#c0392b"), ("on", "#27ae60")):
        spans = [r[f"ttft_ms_{arm}_band"] for r in rows]
        if band is not None and all(spans):
            left.fill_between(x, [lo for lo, _ in spans], [hi for _, hi in spans], color=color, alpha=0.12, lw=0,
                              label=f"±{band:.0%} band" if arm == "off" else None)
    left.set_xlabel("prompt tokens")
    left.set_ylabel("TTFT, mean (ms)")
    left.set_title(f"{result['inputs']['model']} on {result['inputs']['instance']}: predicted TTFT")
    left.grid(alpha=0.3)
    left.legend()
    curve = result["ttl_curve"]
    ttl = [c["ttl_s"] for c in curve]
    right.plot(ttl, [c["retained_gib_per_decode"] for c in curve], "o-", color="#8e44ad")
    right.set_xscale("log")
    right.set_xlabel("decoder_kv_blocks_ttl (s)")
    right.set_ylabel("retained KV per decode node (GiB)", color="#8e44ad")
    twin = right.twinx()
    twin.plot(ttl, [100 * c["reuse_share"] for c in curve], "s-", color="#2980b9")
    twin.set_ylabel("turns that find their KV (%)", color="#2980b9")
    right.axvline(result["recommend"]["decoder_kv_blocks_ttl"], color="#7f8c8d", linestyle=":")
    right.set_title("retained HBM and hit share against TTL")
    right.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _ms(value: float | None, band: float | None = None) -> str:
    if value is None:
        return "overloaded"
    return f"{value:.0f}" if band is None else f"{value:.0f} ±{value * band:.0f}"


def print_tables(result: dict[str, Any]) -> None:
    from rich.table import Table

    out = Console()
    inp = result["inputs"]
    t = Table(title=f"turnkv plan — {inp['model']} ({inp['dtype']}, KV {inp['kv_dtype']}) on {inp['instance']}, "
                    f"TP {inp['tp']['prefill']}/{inp['tp']['decode']}{_tp_unit(inp)}, {inp['mode']}; "
                    "reuse off on its own fleet")
    # Short headers (80 columns), units and meanings in the caption.
    for col in ("turn", "prompt", "cached", "pulled", "TTFT off", "TTFT on", "transfer", "pull fixed",
                "saved"):
        t.add_column(col, justify="right")
    t.caption = ("tokens: prompt, cached (prefill's prefix cache), pulled (from decode); ms: TTFT, the pull's "
                 "transfer and fixed cost, compute saved by the pull")
    band = result["ttft_band"]["relative"]
    for r in result["per_turn"]:
        t.add_row(str(r["turn"]), str(r["prompt_tokens"]), str(r["prefill_cached_tokens"]), str(r["pulled_tokens"]),
                  _ms(r["ttft_ms_off"], band), _ms(r["ttft_ms_on"], band), f"{r['transfer_ms']:.0f}",
                  f"{r['pull_fixed_ms']:.0f}", f"{r['compute_saved_ms']:.0f}")
    show_table(out, t)
    s = Table(title="summary (all turns)")
    for col in ("", "mean", "p50", "p90"):
        s.add_column(col, justify="right")
    for arm in ("off", "on"):
        v = result["ttft_ms"][arm]
        s.add_row(f"TTFT reuse {arm} (ms)", *(_ms(v[k], band) for k in ("mean", "p50", "p90")))
    if "simulation" in result:
        for arm in ("off", "on"):
            v = result["simulation"]["ttft_ms"][arm]
            s.add_row(f"simulated {arm} (ms)", *(_ms(v[k], band) for k in ("mean", "p50", "p90")))
    show_table(out, s)
    out.print(f"TTFT band: {result['ttft_band']['source']}", soft_wrap=True)
    rec = result["recommend"]
    a = result["assumptions"]
    per = a["engines_per_node"]
    out.print(
        f"assumptions: {a['num_clients']:,} clients, think time {a['think_time_s_mean']:.0f} s mean, "
        f"{a['turns_per_s']:.2f} turns/s with reuse; prefill utilization capped at {a['max_prefill_utilization']:.0%}; "
        f"block size {a['block_size']}; prefill prefix caching {'on' if a['prefill_prefix_caching'] else 'off'}, "
        f"decode's on; {per['prefill']} prefill / {per['decode']} decode engine(s) per node; "
        f"${a['price_per_node_hour']:.2f}/hour per node on demand", soft_wrap=True)
    if inp["deployable_note"]:  # not deployable, or deployable with a caveat (trn2: unverified, behind an opt-in)
        # escaped: the note names "connector.allow_unverified: [neuron]", which rich would take for a style tag
        out.print(f"[yellow]{inp['instance']} is {escape(inp['deployable_note'])}[/yellow]", soft_wrap=True)
    if max(per.values()) > 1:
        out.print(f"{per['prefill']}/{per['decode']} engines share a node here; the CDK stack runs them so by "
                  "default (pools[].engines_per_node: the node's accelerators over the TP size, each engine on its "
                  "own devices and ports)", soft_wrap=True)
    if not result["ttft_target_met"]:
        out.print(f"[yellow]the p90 TTFT target of {inp['ttft_target_ms']:.0f} ms is below what this model and "
                  "instance reach with no queueing at all: sized for the load only[/yellow]")
    engines = "" if max(per.values()) == 1 else (f" ({result['engines']['prefill']} prefill + "
                                                  f"{result['engines']['decode']} decode engines)")
    off = result["nodes_without_reuse"]
    out.print(
        f"nodes: [bold]{result['nodes']['prefill']}P{result['nodes']['decode']}D[/bold]{engines} "
        f"(without reuse, sized on its own: {off['prefill']}P{off['decode']}D, ${off['cost_per_hour']:.2f}/hour"
        + ("" if off["ttft_target_met"] or inp["ttft_target_ms"] is None else ", misses the target") + "), "
        f"${result['cost_per_hour']:.2f}/hour on demand; prefill utilization off "
        f"{result['prefill_utilization']['off']:.0%}"
        f" / on {result['prefill_utilization']['on']:.0%}\n"
        f"retained KV per decode {'node' if per['decode'] == 1 else 'engine'}: "
        f"{result['retained_gib_per_decode']:.1f} GiB "
        f"({result['retained_share_of_kv_cache']:.0%} of its {result['kv_cache_gib_per_decode']:.0f} GiB KV cache"
        + (f"; {result['retained_tiers_gib_per_decode']['host']:.1f} GiB of it in the "
           f"{result['retained_tiers_gib_per_decode']['host_budget']:.0f} GiB host tier"
           if result['retained_tiers_gib_per_decode']['host_budget'] else "")
        + f"; {result['retained_tiers_gib_per_decode']['fits']:.0%} fits); "
        f"turns that find their KV: {result['reuse_share']:.1%}\n"
        f"recommended: decoder_kv_blocks_ttl={rec['decoder_kv_blocks_ttl']} s, kv_recompute_threshold="
        f"{rec['kv_recompute_threshold']} tokens (pulling beats recomputing above it)\n  {rec['params_set']}")
    print_verdict(out, result)
    if "simulation" in result:
        sim = result["simulation"]
        out.print(f"simulation: {sim['conversations']:,} conversations, {sim['turns']:,} turns in "
                  f"{sim['seconds']:.1f} s;"
                  f" hit share {sim['reuse_share']:.1%}, retained {sim['retained_gib_per_decode']:.1f} GiB mean, "
                  f"{sim['retained_gib_peak']:.1f} GiB peak per decode node")


def print_verdict(out: Console, result: dict[str, Any]) -> None:
    """The arms side by side and the verdict line, from the same numbers plan.json carries."""
    from rich.table import Table

    from turnkv.plan.verdict import ARMS

    v = result["verdict"]
    t = Table(title="does reuse pay? each arm sized on its own for the same load and target")
    for col in ("arm", "TTFT p50", "TTFT p90", "nodes", "$/hour", "$ per 1k turns", "cache hits", "computed",
                "pulled"):
        t.add_column(col, justify="right")
    t.caption = ("TTFT in ms; cache hits: prompt tokens found in prefill's prefix cache; computed, pulled: shares of "
                 "the prompt tokens")
    for name in ARMS:
        a = v["arms"][name]
        if name == "peer" and not a.get("prefill_offload_gib", 1):
            continue  # no offload tier (trn2's image runs none): the same arm as "peer"
        src = a["token_sources"]
        t.add_row(a["label"], _ms(a["ttft_ms"]["p50"]), _ms(a["ttft_ms"]["p90"]),
                  f"{a['nodes']['prefill']}P{a['nodes']['decode']}D" + (" (capped)" if a["capped"] else ""),
                  f"{a['cost_per_hour']:.2f}", f"{a['cost_per_1k_turns']:.3f}", f"{a['prefill_cache_hit_share']:.0%}",
                  f"{src['computed']:.0%}", f"{src['pulled_device'] + src['pulled_host']:.0%}")
    show_table(out, t)
    a = result["assumptions"]
    parts = ", ".join(f"{c['name']} {c['ms']:.1f} ms" + ("" if c["per_turn"] else " (not per turn)")
                      for c in a["pull_fixed_components"])
    out.print(f"pull fixed cost {a['pull_fixed_ms']:.0f} ms per pulled turn: {parts}; P->D handover "
              f"{a['pd_handover_ms']:.0f} ms in both arms", soft_wrap=True)
    if result["capped"]:
        out.print(f"[yellow]capped: {result['capped']} needed {result['max_engines_per_role']:,} engines or more "
                  "(the sizing's limit): the fleet shown is the cap, not enough[/yellow]", soft_wrap=True)
    color = "green" if v["pays"] else "yellow"
    out.print(f"[bold {color}]verdict: {v['reason']}[/bold {color}]", soft_wrap=True)


@app.callback()
def plan(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Catalog name (Qwen3-32B, Qwen3-8B, GLM-5-FP8, "
                                            "Llama-3.3-70B-Instruct, tiny-local) or a Hugging Face config.json "
                                            "path.")] = "Qwen3-32B",
    instance: Annotated[str, typer.Option(help="p5en.48xlarge, p5.48xlarge or local-cpu; trn2.48xlarge and "
                                               "trn1.32xlarge as a what-if (flagged).")] = "p5en.48xlarge",
    workload: Annotated[Path, typer.Option(help="vLLM multi-turn generator JSON (+ num_clients, think_time_s).")]
    = DEFAULT_WORKLOAD,
    tp: Annotated[int | None, typer.Option(TP, "--tp", min=1, help="Tensor parallel size of both roles: a power of "
                                                                "two up to the instance's devices; a node runs "
                                                                "devices // TP engines.")] = None,
    prefill_tp: Annotated[int | None, typer.Option(PREFILL_TP, min=1, help=f"Prefill TP (default {TP}).")] = None,
    decode_tp: Annotated[int | None, typer.Option(DECODE_TP, min=1, help=f"Decode TP (default {TP}).")] = None,
    tp_prefill: Annotated[int | None, typer.Option("--tp-prefill", min=1, hidden=True)] = None,
    tp_decode: Annotated[int | None, typer.Option("--tp-decode", min=1, hidden=True)] = None,
    dtype: Annotated[str | None, typer.Option(help="Weights/GEMM precision (bf16, fp16, fp32, fp8); default the "
                                                      "model's.")]
    = None,
    kv_dtype: Annotated[str | None, typer.Option(help="KV cache precision (bf16, fp16, fp32, fp8, fp8_e4m3, "
                                                         "fp8_e5m2, fp8_ds_mla for MLA); default the model's.")] = None,
    block_size: Annotated[int | None, typer.Option(min=1, help="KV block size in tokens (default 128, what turnkv's "
                                                               "engines run: turnkv.engine_args).")]
    = None,
    ttl: Annotated[float, typer.Option(min=_TTL.minimum, max=_TTL.maximum, help="decoder_kv_blocks_ttl (s).")]
    = _TTL.default,
    threshold: Annotated[int, typer.Option(min=_THRESHOLD.minimum, help="kv_recompute_threshold (tokens).")]
    = _THRESHOLD.default,
    mode: Annotated[str, typer.Option(help="pull or push.")] = "pull",
    prefill_prefix_caching: Annotated[bool, typer.Option(help="Prefill keeps a prefix cache (on, as deployed; "
                                                              "--no-prefill-prefix-caching: the planner's "
                                                              "calibration benchmarks, docs/planning.md).")]
    = True,
    prefill_offload_gib: Annotated[float | None, typer.Option(min=0, help="Each prefill engine's host offload tier "
                                                                     "(GiB, vLLM --kv-offloading-size): the peer arm's "
                                                                     "(default half the node's host memory over its "
                                                                     "engines); given, turnkv's prefill runs it too.")]
    = None,
    routing: Annotated[str, typer.Option(help="Prefill choice for a conversation's next turn: prefix-aware or "
                                              "round-robin.")] = "prefix-aware",
    ttft_target_ms: Annotated[float | None, typer.Option(
        min=1, help="p90 TTFT target in ms: each arm (reuse on, and reuse off) is sized to meet it.")] = None,
    ttft_target: Annotated[float | None, typer.Option("--ttft-target", min=1, hidden=True)] = None,
    host_kv_gib: Annotated[float | None, typer.Option(min=0, help="Each decode engine's host tier of retained turns "
                                                                 "(GiB; host_kv_budget_mib / 1024). Default: what the "
                                                                 "deploy gives it (half the node's host memory over "
                                                                 "its engines); 0: device only.")] = None,
    simulate: Annotated[bool, typer.Option("--simulate", help="Also run the fleet simulation.")] = False,
    conversations: Annotated[int, typer.Option(min=1, help="Conversations to simulate.")] = 100_000,
    price: Annotated[float | None, typer.Option(min=0, help="On-demand $/hour per node instead of the table's.")]
    = None,
    deployment: Annotated[str, typer.Option(help="Deployment name for the printed `turnkv params set` line.")]
    = "NAME",
    config: Annotated[Path | None, typer.Option(help="A deploy config (deploy/*.yaml): plan its instance type, "
                                                     "model.tensor_parallel_size, engines a node per role and (when "
                                                     "the catalog knows it) model.id, instead of --instance, --tp "
                                                     "and --model.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON only.")] = False,
    out: Annotated[Path, typer.Option(help="Folder for plan.json and plan.png.")] = Path("results/plan"),
    state_dir: Annotated[Path | None, typer.Option(help="Where `turnkv plan calibrate` stored local-cpu constants "
                                                      "(default: the local stack's state folder).")] = None,
) -> None:
    """Predict TTFT with reuse off and on, retained KV and hit share by TTL, nodes and cost; recommend a TTL and
    a threshold. First principles (FLOPs, bytes, published hardware figures); the GPU factors and fixed costs are
    fitted to published TTFT measurements (turnkv/plan/data/gpu_measurements.json), and every TTFT carries a band."""
    state_dir = state_folder(state_dir)
    if ctx.invoked_subcommand:
        return
    from turnkv.plan.workload import WorkloadError
    from turnkv.plan.workload import load as load_workload

    try:
        wl = load_workload(workload)
    except WorkloadError as exc:
        _fail(f"--workload: {exc}")
    except OSError as exc:  # a folder, no permission: a message, not a traceback
        _fail(f"--workload {workload}: cannot be read ({exc.strerror}); pass a workload JSON file")
    engines_per_node = None
    if config is not None:
        model, instance, tp, engines_per_node = from_deploy_config(config, model, instance, tp)
    fleet = build_fleet(model, instance, tp, renamed(ctx, "prefill_tp", "tp_prefill"),
                        renamed(ctx, "decode_tp", "tp_decode"), dtype, kv_dtype, block_size, mode, ttl, threshold,
                        prefill_prefix_caching, state_dir, price)
    if engines_per_node is not None:
        fleet = replace(fleet, deployed_engines_per_node=engines_per_node)
    if routing not in ("prefix-aware", "round-robin"):
        _fail(f"--routing {routing!r}: use prefix-aware or round-robin")
    host = (default_offload_gib(fleet.decode, fleet.tp_decode, fleet.engines_per_node("decode"))
            if host_kv_gib is None else host_kv_gib)
    if not fleet.decode.host_tiers:
        for flag, value in (("--host-kv-gib", host_kv_gib), ("--prefill-offload-gib", prefill_offload_gib)):
            if value:
                _fail(f"{flag} {value:g} on {fleet.decode.name}: its image runs no host tier ({HOST_TIER_REFUSAL}); "
                      "leave it out")
        host = 0.0
    fleet = replace(fleet, host_kv_gib=float(host), prefill_offload_gib=float(prefill_offload_gib or 0.0),
                    routing=routing)
    _check_workload(fleet, wl)
    with console.status("planning" + (" and simulating" if simulate else "")):
        result = run_plan(fleet, wl, renamed(ctx, "ttft_target_ms", "ttft_target"), simulate, conversations,
                          deployment, prefill_offload_gib)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(result, indent=2, default=str))
        chart(result, out / "plan.png")
    except OSError as exc:  # a read-only working folder (the default --out is under it), /proc, a full disk
        _fail(f"--out {out}: cannot write plan.json and plan.png there ({exc.strerror}); pass --out to a writable "
              "folder")
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
        return
    print_tables(result)
    console.print(f"wrote {out / 'plan.json'} and the chart [bold]{out / 'plan.png'}[/bold]")


@app.command()
def calibrate(
    state_dir: Annotated[Path | None, typer.Option(help="State folder of the local stack (the constants go there; "
                                                      "default: `turnkv local`'s).")] = None,
) -> None:
    """Measure the local CPU engines (prefills of several lengths, one pull) and store local-cpu constants."""
    state_dir = state_folder(state_dir)
    from turnkv.plan import calibrate as cal

    result = cal.run(state_dir, say=console.print)
    e = result["efficiency"]
    Console().print(
        f"local-cpu: GEMMs {result['achieved_flops_s'] / 1e9:.1f} GFLOP/s ({e['dense']:.0%} of nominal peak), "
        f"attention {result['achieved_attention_flops_s'] / 1e9:.1f} GFLOP/s, over cached context "
        f"{result['achieved_context_attention_flops_s'] / 1e9:.1f} GFLOP/s; "
        f"{e['request_overhead_s'] * 1000:.0f} ms per engine hop, {e['step_overhead_s'] * 1000:.1f} ms per extra "
        f"chunk; transfers {e['transfer_setup_s'] * 1000:.1f} ms + "
        f"{result['network_bits_s'] / 8 / 2**30:.2f} GiB/s\nwrote {state_dir / 'plan-calibration.json'}")


@app.command()
def twin(
    levels: Annotated[str, typer.Option("--concurrency-levels", "--levels",
                                        help="Conversations at once, as `turnkv bench capacity` takes them.")]
    = "1,2,4,8,16",
    turns: Annotated[int, typer.Option(min=2, help="Turns per conversation.")] = 6,
    system_words: Annotated[int, typer.Option(min=0, help="Shared system prompt length (words ~ tokens).")] = 200,
    first_user_words: Annotated[int, typer.Option(min=1, help="First user message length.")] = 300,
    turn_words: Annotated[int, typer.Option(min=1, help="Words each later turn appends.")] = 200,
    max_tokens: Annotated[int, typer.Option(min=1, help="Reply length in tokens.")] = 16,
    prefill_prefix_caching: Annotated[bool, typer.Option(help="Prefill keeps a prefix cache (the local stack's "
                                                              "default).")] = True,
    state_dir: Annotated[Path | None, typer.Option(help="Where `turnkv plan calibrate` stored local-cpu constants "
                                                      "(default: the local stack's state folder).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the prediction here (JSON).")] = None,
    measured: Annotated[Path | None, typer.Option(help="A `turnkv bench capacity` capacity.json to compare with.")]
    = None,
    decode_token_ms: Annotated[float | None, typer.Option(min=0, help="CPU ms per decoded token under load (from "
                                                                      "--fit-decode on a calibration run).")] = None,
    fit_decode: Annotated[Path | None, typer.Option(help="A calibration run's capacity.json (of this command's "
                                                         "workload): fit the decode cost to it and print it.")]
    = None,
    fit: Annotated[Path | None, typer.Option(help="A calibration run's folder (`turnkv bench capacity --records`: "
                                                  "capacity.json and records.jsonl): fit the event simulation's "
                                                  "constants to it and write them to --out.")] = None,
    hops_share_core: Annotated[bool, typer.Option(help="With --fit: engine hops share their engine's core and cost "
                                                       "per prompt token (attempt 4's model); off: attempt 3's.")]
    = True,
    constants: Annotated[Path | None, typer.Option(help="The event simulation's constants (from --fit): predict by "
                                                        "simulating the run event by event (turnkv.plan.twin_sim) "
                                                        "instead of the closed form's mean value analysis.")]
    = None,
    stagger: Annotated[float, typer.Option(min=0, help="Seconds between conversation starts, as the run's "
                                                       "--stagger.")] = 0.2,
) -> None:
    """Predict what `turnkv bench capacity` measures on the local stack (TTFT p50/p90 per level and arm, reuse
    share, the level sustained) from `turnkv plan calibrate`'s constants, before it runs; --measured compares."""
    state_dir = state_folder(state_dir)
    from turnkv.engine_args import EngineSpec
    from turnkv.plan import architectures, closed_form, hardware
    from turnkv.plan import twin as tw

    if not (state_dir / hardware.CALIBRATION_FILE).is_file():
        _fail(f"no local-cpu calibration in {state_dir}: run `turnkv plan calibrate` first (the twin predicts from "
              "measured constants only)")
    try:
        level_list = [int(x) for x in levels.split(",") if x.strip()]
    except ValueError:
        level_list = []
    if not level_list or level_list != sorted(set(level_list)) or level_list[0] < 1:
        _fail(f"--concurrency-levels {levels!r}: expected increasing positive numbers such as 1,2,4,8,16")
    inst = hardware.load("local-cpu", state_dir)
    fleet = closed_form.Fleet(architectures.tiny_local(), inst, inst, 1, 1, block_size=EngineSpec.block_size,
                              prefill_prefix_caching=prefill_prefix_caching, host_kv_gib=0.0)
    spec = tw.CapacitySpec(turns, system_words, first_user_words, turn_words, max_tokens)
    if fit is not None or constants is not None:
        _twin_sim(fleet, spec, level_list, stagger, fit, constants, measured, out, inst.efficiency.source,
                  hops_share_core)
        return
    if fit_decode is not None:
        token_s = tw.fit_decode(fleet, spec, json.loads(fit_decode.read_text()))
        Console().print(f"decode_token_ms={token_s * 1000:.3f}")
        return
    token_s = None if decode_token_ms is None else decode_token_ms / 1000
    result = tw.predict(fleet, spec, level_list, token_s) | {"calibration": inst.efficiency.source}
    if measured is not None:
        result["comparison"] = tw.compare(result, json.loads(measured.read_text()))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    _print_twin(result, f"twin of `turnkv bench capacity` ({inst.efficiency.source})")


def _print_twin(result: dict[str, Any], title: str, reuse_lines: bool = False) -> None:
    """A capacity twin's prediction per level (with the simulated turns per arm, where it counts them) and, with
    --measured, each TTFT cell's error (``reuse_lines``: the reuse share's comparison too)."""
    say = Console()
    say.print(f"{title}; target {result['target_ms']:,.0f} ms; sustained off {result['sustained_off']}, on "
              f"{result['sustained_on']}")
    for row in result["levels"]:
        samples = f" ({row['off']['samples']} turns per arm)" if "samples" in row["off"] else ""
        say.print(f"  {row['concurrency']:>3} at once: off p50/p90 {row['off']['ttft_p50_ms']:,.0f}/"
                  f"{row['off']['ttft_p90_ms']:,.0f} ms, on {row['on']['ttft_p50_ms']:,.0f}/"
                  f"{row['on']['ttft_p90_ms']:,.0f} ms, reuse share {row['on']['reuse_share']:.0%}{samples}")
    for c in result.get("comparison", []):
        if c["error"] is not None:
            say.print(f"  {c['concurrency']:>3} {c['arm']:>3} {c['stat']}: predicted {c['predicted']:,.0f}, "
                      f"measured {c['measured']:,.0f} ({c['error']:+.0%})")
        elif reuse_lines and c["stat"] == "reuse_share":
            say.print(f"  {c['concurrency']:>3} {c['arm']:>3} reuse share: predicted {c['predicted']:.0%}, "
                      f"measured {c['measured']:.0%}")


def _twin_sim(fleet, spec, levels: list[int], stagger: float, fit: Path | None, constants: Path | None,
              measured: Path | None, out: Path | None, source: str, hops_share_core: bool = True) -> None:
    """`plan twin --fit` / `--constants`: the event simulation's constants from a calibration run, or its
    prediction (and, with --measured, the comparison)."""
    import dataclasses

    from turnkv.plan import twin as tw
    from turnkv.plan import twin_sim as ts

    say = Console()
    if fit is not None:
        cap_file, rec_file = fit / "capacity.json", fit / "records.jsonl"
        if not cap_file.is_file() or not rec_file.is_file():
            _fail(f"--fit {fit}: expected capacity.json and records.jsonl there (run `turnkv bench capacity "
                  "--records --out` for the calibration run)")
        run = json.loads(cap_file.read_text())
        w = run["meta"]["workload"]
        convs = [ts.conversation(w["turns"], w["system_words"], w["first_user_words"], w["turn_words"],
                                 w["max_tokens"])] * max(lv["concurrency"] for lv in run["levels"])
        rows = [json.loads(line) for line in rec_file.read_text().splitlines() if line.strip()]
        run_levels = [lv["concurrency"] for lv in run["levels"]]
        fitted = ts.fit(fleet, convs, run_levels, rows, w["system_words"] + ts.SYSTEM_EXTRA - 1,
                        run["meta"].get("stagger_s", stagger), hops_share_core)
        text = json.dumps(dataclasses.asdict(fitted) | {"fitted_to": str(fit), "calibration": source}, indent=2)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        say.print(text)
        return
    assert constants is not None
    try:
        consts = ts.SimConstants.from_dict(json.loads(constants.read_text()))
    except (OSError, ValueError) as exc:
        _fail(f"--constants {constants}: not the event simulation's constants ({exc}); make them with --fit")
    convs = [ts.conversation(spec.turns, spec.system_words, spec.first_user_words, spec.turn_words,
                             spec.max_tokens)] * max(levels)
    result = ts.simulate(fleet, consts, convs, levels, spec.system_words + ts.SYSTEM_EXTRA - 1, stagger)
    result |= {"spec": spec.__dict__, "stagger_s": stagger, "constants": dataclasses.asdict(consts),
               "calibration": source, "model": "event simulation (turnkv.plan.twin_sim)"}
    if measured is not None:
        result["comparison"] = tw.compare(result, json.loads(measured.read_text()))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    _print_twin(result, f"event twin of `turnkv bench capacity` ({source})", reuse_lines=True)


@app.command("twin-pressure")
def twin_pressure(
    constants: Annotated[Path, typer.Option(help="The event simulation's constants (`turnkv plan twin --fit` on a "
                                                 "calibration capacity run).")],
    levels: Annotated[str, typer.Option(help="Multiples of the conversations that fit, as `bench.pressure --levels`.")]
    = "1,2,4,8",
    turns: Annotated[int, typer.Option(min=2, help="Turns per conversation.")] = 4,
    think_s: Annotated[float, typer.Option(min=0, help="Fixed think time before each later turn (--think fixed:S).")]
    = 1.0,
    system_words: Annotated[int, typer.Option(min=0)] = 100,
    first_user_words: Annotated[int, typer.Option(min=1)] = 200,
    turn_words: Annotated[int, typer.Option(min=1)] = 100,
    max_tokens: Annotated[int, typer.Option(min=1, help="Reply length (exact: --exact-replies).")] = 96,
    retained_kv_share: Annotated[float, typer.Option(min=0, max=1, help="The variant's retained_kv_share.")] = 0.01,
    kv_cache_gib: Annotated[float | None, typer.Option(min=0, help="Decode's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; "
                                                                  "default: the local stack's).")] = None,
    stagger: Annotated[float, typer.Option(min=0)] = 0.2,
    prefill_prefix_caching: Annotated[bool, typer.Option(help="Prefill keeps a prefix cache: off on the stacks "
                                                              "bench pressure starts (bench.variants: "
                                                              "prefill recomputes what it does not pull); on with "
                                                              "--url against `turnkv local up`.")]
    = False,
    attempt: Annotated[int, typer.Option(min=4, max=5, help="The simulation's model: 4 (as the constants say) or 5 "
                                                           "(a hop on a busy core also delays its engine's next step, "
                                                           "and meets the engine as it is when the turn is sent).")]
    = 4,
    state_dir: Annotated[Path | None, typer.Option(help="Where `turnkv plan calibrate` stored local-cpu constants "
                                                      "(default: the local stack's state folder).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the prediction here (JSON).")] = None,
    measured: Annotated[Path | None, typer.Option(help="A `bench.pressure` summary.json to compare with.")] = None,
) -> None:
    """Predict what `python -m bench.pressure --stack-per variant` measures on one local stack (reuse share and
    TTFT p50/p90 of later turns per arm and level) by the event simulation, before it runs."""
    state_dir = state_folder(state_dir)
    import dataclasses

    from turnkv.engine_args import EngineSpec
    from turnkv.local.stack import StackConfig
    from turnkv.plan import architectures, closed_form, hardware
    from turnkv.plan import twin_sim as ts

    if kv_cache_gib is None:
        kv_cache_gib = float(StackConfig.kv_cache_gib)
    if not (state_dir / hardware.CALIBRATION_FILE).is_file():
        _fail(f"no local-cpu calibration in {state_dir}: run `turnkv plan calibrate` first")
    try:
        multiples = [float(x) for x in levels.split(",") if x.strip()]
        consts = ts.SimConstants.from_dict(json.loads(constants.read_text()))
    except (OSError, ValueError) as exc:
        _fail(f"--levels {levels!r} / --constants {constants}: {exc} (make the constants with `turnkv plan twin "
              "--fit`)")
    if attempt == 5:
        consts = dataclasses.replace(consts, hop_steals_step=True, hop_when_sent=True)
    inst = hardware.load("local-cpu", state_dir)
    arch = architectures.tiny_local()
    block = EngineSpec.block_size
    fleet = closed_form.Fleet(arch, inst, inst, 1, 1, block_size=block, prefill_prefix_caching=prefill_prefix_caching,
                              host_kv_gib=0.0)
    blocks = int(kv_cache_gib * 2**30 // (block * arch.kv_bytes_per_token_rank(1)))
    room = int(retained_kv_share * blocks)
    fit = ts.pressure_fit(turns, system_words, first_user_words, turn_words, max_tokens, room, block)
    counts = sorted({max(1, round(x * fit)) for x in multiples})
    conv = ts.conversation(turns, system_words, first_user_words, turn_words, max_tokens, think_s)
    rows = ts.simulate_pressure(fleet, consts, conv, counts, room, system_words + ts.SYSTEM_EXTRA - 1, stagger)
    result: dict[str, Any] = {"fit": fit, "room_blocks": room, "decode_blocks": blocks, "levels": rows,
                              "prefill_prefix_caching": prefill_prefix_caching,
                              "constants": dataclasses.asdict(consts), "calibration": inst.efficiency.source,
                              "model": "event simulation (turnkv.plan.twin_sim)"}
    say = Console()
    say.print(f"event twin of bench pressure: {fit} conversation(s) fit in {room} blocks of decode's {blocks}")
    keys = ("reuse_share", "ttft_on_later_p50_ms", "ttft_on_later_p90_ms", "ttft_off_later_p50_ms",
            "ttft_off_later_p90_ms")
    if measured is not None:
        got = json.loads(measured.read_text())
        levels_measured = {lv["conversations"]: lv for v in got["variants"] for lv in v["levels"]
                           if lv.get("conversations")}
        result["comparison"] = []
        for row in rows:
            lv = levels_measured.get(row["conversations"])
            for k in keys:
                want = None if lv is None else lv.get(k)
                err = None if not want or k == "reuse_share" or row[k] is None else round(row[k] / want - 1, 4)
                result["comparison"].append({"conversations": row["conversations"], "stat": k,
                                             "predicted": row[k], "measured": want, "error": err})
    for row in rows:
        say.print(f"  {row['conversations']:>3} conversations: reuse share {row['reuse_share']:.0%}, later turns "
                  f"on p50/p90 {row['ttft_on_later_p50_ms']:,.0f}/{row['ttft_on_later_p90_ms']:,.0f} ms, off "
                  f"{row['ttft_off_later_p50_ms']:,.0f}/{row['ttft_off_later_p90_ms']:,.0f} ms "
                  f"({row['later_turns']} later turns per arm)")
    for c in result.get("comparison", []):
        if c["measured"] is None:
            continue
        err = "" if c["error"] is None else f" ({c['error']:+.0%})"
        say.print(f"  {c['conversations']:>3} {c['stat']}: predicted {c['predicted']}, measured {c['measured']}{err}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
