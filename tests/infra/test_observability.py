"""Every alarm and every dashboard metric watches something that is emitted.

The emitters run for real on sample traffic: the router (in-process, over fake engines on loopback) writes its
EMF lines for a two-turn conversation, streamed and not; the engine bridge (``turnkv.emf_bridge.run``) scrapes a
vLLM-shaped ``/metrics`` page twice and sends its EMF documents to a TCP listener standing in for the CloudWatch
agent. From those records come the (namespace, metric, dimension names) identities CloudWatch would create. The
CloudWatch agent's own metrics (GPU, EFA) come from the agent configuration the node writes (its measurements
and aggregation dimensions): the agent itself does not run here. AWS service namespaces (ALB, ECS, Auto
Scaling) are AWS's to emit and are only listed.

Then every alarm and every metric of every dashboard widget of the synthesized observability stack (plain
metrics, metric math and SEARCH expressions) must name an emitted identity, with the deployment's name as the
Deployment value.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest

from infra.bootstrap import NodeBootstrap, agent_config
from turnkv import emf_bridge
from turnkv import metric_names as mn
from turnkv.engine_args import Mode, Role

pytestmark = pytest.mark.infra

Identity = tuple[str, str, frozenset[str]]
OURS = (mn.ROUTER_NAMESPACE, mn.ENGINE_NAMESPACE, mn.AGENT_NAMESPACE)


def identities(document: dict) -> set[Identity]:
    """What CloudWatch makes of one EMF document: one metric per (directive dimension set, metric)."""
    out = set()
    for directive in document["_aws"]["CloudWatchMetrics"]:
        for dims in directive["Dimensions"]:
            for metric in directive["Metrics"]:
                assert metric["Name"] in document, f"EMF names {metric['Name']} without a value"
                assert all(d in document for d in dims), f"EMF dimension without a value: {dims}"
                out.add((directive["Namespace"], metric["Name"], frozenset(dims)))
    return out


# ---------------------------------------------------------------- the emitters, run


def router_records(deployment: str, price: float = 0.0) -> list[dict]:
    from router.app import FLOW
    from tests.router.conftest import engines, router_over

    async def traffic() -> list[dict]:
        async with router_over(engines(1, "prefill"), engines(1, "decode"), emf=True,
                               deployment=deployment, prefill_price_per_hour=price) as (session, app):
            buf = io.StringIO()
            app[FLOW].emf.stream = buf
            for stream in (False, True):
                messages = [{"role": "user", "content": "Plan a three-step refactor of the billing module."}]
                conversation = f"obs-{stream}"
                for turn in range(2):
                    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": stream,
                            "conversation_id": conversation}
                    async with session.post("/v1/chat/completions", json=body) as resp:
                        raw = await resp.read()
                        assert resp.status == 200, raw
                    messages = [*messages, {"role": "assistant", "content": _answer(raw, stream)},
                                {"role": "user", "content": f"and step {turn + 2}?"}]
            # An edited history (a reply this router never stored) misses: the miss outcome is emitted too.
            edited = [{"role": "user", "content": "Plan a three-step refactor of the billing module."},
                      {"role": "assistant", "content": "A reply the router never saw."},
                      {"role": "user", "content": "and step 2?"}]
            async with session.post("/v1/chat/completions",
                                    json={"model": "tiny", "messages": edited, "max_tokens": 4}) as resp:
                assert resp.status == 200, await resp.read()
            async with session.post("/v1/chat/completions", json={"model": "tiny"}) as resp:  # a client error
                assert resp.status == 400
            app[FLOW].emf.flush()
            return [orjson.loads(line) for line in buf.getvalue().splitlines()]

    return asyncio.run(traffic())


def _answer(raw: bytes, stream: bool) -> str:
    if not stream:
        return orjson.loads(raw)["choices"][0]["message"]["content"]
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n")
              if line.startswith(b"data: ") and line != b"data: [DONE]"]
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))


def vllm_metrics(scale: int) -> str:
    """A /metrics page with every family the bridge reads, shaped as vLLM exports them."""
    lines = []
    for family in (mn.VLLM_TTFT, mn.VLLM_ITL, mn.VLLM_NIXL_XFER_TIME, mn.VLLM_NIXL_BYTES):
        lines.append(f"# TYPE {family} histogram")
        for le, share in (("0.05", 0.5), ("0.5", 0.9), ("+Inf", 1.0)):
            lines.append(f'{family}_bucket{{engine="0",le="{le}",model_name="tiny"}} {share * 10 * scale}')
        lines += [f'{family}_sum{{engine="0",model_name="tiny"}} {2.5 * scale}',
                  f'{family}_count{{engine="0",model_name="tiny"}} {10 * scale}']
    for family, value in ((mn.VLLM_KV_USAGE, 0.3), (mn.VLLM_RUNNING, 2), (mn.VLLM_WAITING, 1)):
        lines += [f"# TYPE {family} gauge", f'{family}{{engine="0",model_name="tiny"}} {value}']
    lines += [f"# TYPE {mn.VLLM_NIXL_EXPIRED} counter", f'{mn.VLLM_NIXL_EXPIRED}_total{{engine="0"}} {scale}']
    # turnkv's retention tiers, as the connector's metrics export them (a label per tier or reason)
    for family in (mn.VLLM_RETAINED_BYTES, mn.VLLM_HOST_RETAINED_BYTES, mn.VLLM_HOST_POOL_BYTES,
                   mn.VLLM_HOST_TIER_CONFIGURED_BYTES, mn.VLLM_HOST_TIER_GRANTED_BYTES):
        lines += [f"# TYPE {family} gauge", f'{family}{{engine="0",model_name="tiny"}} {1024 * scale}']
    lines += [f"# TYPE {mn.VLLM_HOST_MOVES} counter",
              f'{mn.VLLM_HOST_MOVES}_total{{engine="0",model_name="tiny"}} {scale}']
    for family, label, values in ((mn.VLLM_PULLS, "tier", mn.TIERS), (mn.VLLM_RETENTION_PLACED, "tier", mn.TIERS),
                                  (mn.VLLM_RETENTION_REFUSALS, "reason", mn.REFUSAL_REASONS),
                                  (mn.VLLM_RETENTION_EVICTIONS, "reason", mn.EVICTION_REASONS)):
        lines.append(f"# TYPE {family} counter")
        lines += [f'{family}_total{{engine="0",model_name="tiny",{label}="{v}"}} {scale}' for v in values]
    return "\n".join(lines) + "\n"


def engine_documents(deployment: str, role: str, engine_id: str = "") -> list[dict]:
    pages = iter([vllm_metrics(1), vllm_metrics(3)])

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = next(pages).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    agent = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def listen() -> None:
        for _ in range(2):
            conn, _ = agent.accept()
            with conn:
                received.append(conn.makefile("rb").read())

    http = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threads = [threading.Thread(target=http.serve_forever, daemon=True), threading.Thread(target=listen, daemon=True)]
    for t in threads:
        t.start()
    try:
        dimensions = {mn.DEPLOYMENT: deployment, mn.ROLE: role, **({mn.ENGINE_ID: engine_id} if engine_id else {})}
        emf_bridge.run(f"http://127.0.0.1:{http.server_port}/metrics", dimensions,
                       log_group="/turnkv/test/engines", interval=0.01, address=agent.getsockname(), iterations=2)
        threads[1].join(timeout=10)
    finally:
        http.shutdown()
        agent.close()
    return [json.loads(line) for blob in received for line in blob.splitlines() if line.strip()]


def agent_identities(deployment: str) -> set[Identity]:
    """The CloudWatch agent's metrics as its configuration defines them (the agent does not run here)."""
    config = agent_config(NodeBootstrap(
        deployment=deployment, region="us-east-2", pool="p", role=Role.PREFILL, gpu=True, model="m",
        served_model_name="m", mode=Mode.PULL, bidirectional=True, tp_size=8, max_model_len=1024,
        cloudmap_service_id="srv", log_group="/lg"))
    metrics = config["metrics"]
    names = {m if m.startswith("efa_") else f"efa_{m}" for m in metrics["metrics_collected"]["efa"]["measurement"]}
    names |= {f"nvidia_smi_{m}" for m in metrics["metrics_collected"]["nvidia_gpu"]["measurement"]}
    return {(metrics["namespace"], n, frozenset(d)) for n in names for d in metrics["aggregation_dimensions"]}


@pytest.fixture(scope="module")
def emitted(gpu) -> set[Identity]:
    deployment = gpu.app.config.name
    # priced as the router stack passes it (the prefill pool's engine-hour): the savings in dollars are emitted too
    router = router_records(deployment, gpu.app.config.prefill_engine_price_per_hour())
    assert len(router) >= 4 and {r[mn.DEPLOYMENT] for r in router} == {deployment}
    assert {r[mn.REUSE_OUTCOME] for r in router} >= {"miss", "hit"}, [r[mn.REUSE_OUTCOME] for r in router]
    engine = engine_documents(deployment, "prefill")
    assert engine and all(d[mn.DEPLOYMENT] == deployment for d in engine)
    # Once per discovery round each router replica counts the engines Cloud Map lists (router.app wires it).
    from router import telemetry

    registered = telemetry.registered_engines_records(namespace=mn.ROUTER_NAMESPACE, deployment=deployment,
                                                      counts={r.value: 1 for r in Role})
    out = set().union(*(identities(r) for r in [*router, *registered]), *(identities(d) for d in engine))
    return out | agent_identities(deployment)


# ---------------------------------------------------------------- what the templates watch


def _dashboard_body(template: dict) -> dict:
    (dashboard,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::CloudWatch::Dashboard"]
    body = dashboard["Properties"]["DashboardBody"]
    if isinstance(body, dict):  # Fn::Join of strings and tokens (region, load balancer names): tokens -> "TOKEN"
        body = "".join(p if isinstance(p, str) else "TOKEN" for p in body["Fn::Join"][1])
    return json.loads(body)


_SEARCH = re.compile(r"SEARCH\('\{([^}]*)\}\s+MetricName=\"([^\"]+)\"([^']*)'")


def watched(template: dict) -> list[tuple[str, Identity, dict[str, str]]]:
    """(where, identity, dimension values) for every metric an alarm or a widget reads."""
    out = []

    def plain(where: str, ns: str, name: str, dims: dict[str, str]) -> None:
        out.append((where, (ns, name, frozenset(dims)), dims))

    def expression(where: str, text: str) -> None:
        for schema, name, rest in _SEARCH.findall(text):
            ns, *dim_names = [p.strip() for p in schema.split(",")]
            values = dict(re.findall(r'(\w+)="([^"]*)"', rest))
            plain(where, ns, name, {d: values.get(d, "*") for d in dim_names})

    for lid, res in template["Resources"].items():
        if res["Type"] != "AWS::CloudWatch::Alarm":
            continue
        props = res["Properties"]
        if "MetricName" in props:
            plain(f"alarm {lid}", props["Namespace"], props["MetricName"],
                  {d["Name"]: d["Value"] for d in props.get("Dimensions", [])})
        for m in props.get("Metrics", []):
            if "MetricStat" in m:
                metric = m["MetricStat"]["Metric"]
                plain(f"alarm {lid}", metric["Namespace"], metric["MetricName"],
                      {d["Name"]: d["Value"] for d in metric.get("Dimensions", [])})
            elif "Expression" in m:
                expression(f"alarm {lid}", m["Expression"])
    for widget in _dashboard_body(template)["widgets"]:
        props = widget.get("properties", {})
        where = f"widget {props.get('title', widget['type'])!r}"
        for row in props.get("metrics", []):
            options = row[-1] if row and isinstance(row[-1], dict) else {}
            fields = [x for x in row if not isinstance(x, dict)]
            if "expression" in options and not fields:
                expression(where, options["expression"])
                continue
            ns, name, *pairs = fields
            plain(where, ns, name, dict(zip(pairs[::2], pairs[1::2], strict=True)))
    return out


def test_every_alarm_and_widget_watches_an_emitted_metric(gpu, emitted):
    deployment = gpu.app.config.name
    checks = watched(gpu.template("observability"))
    ours = [c for c in checks if c[1][0] in OURS]
    aws = sorted({c[1][0] for c in checks if c[1][0] not in OURS})
    print(f"{len(ours)} turnkv metric reads checked; AWS-emitted namespaces (not checked): {aws}")
    assert len(ours) > 30 and any(w.startswith("alarm") for w, _, _ in ours)
    missing = sorted({(where, ns, name, tuple(sorted(dims))) for where, (ns, name, dims), _ in ours
                      if (ns, name, dims) not in emitted})
    assert missing == [], "watched but never emitted:\n" + "\n".join(map(str, missing))
    for where, _, values in ours:
        if mn.DEPLOYMENT in values:
            assert values[mn.DEPLOYMENT] == deployment, where
        if mn.ROLE in values:
            assert values[mn.ROLE] in {r.value for r in Role}, where


def test_each_engine_of_a_node_still_feeds_every_engine_widget_and_alarm(gpu):
    """A node of several engines: each engine's bridge publishes per engine (its EngineId) and, under the same
    metrics, the {Deployment, Role} set every engine widget and alarm reads; one engine's records alone cover them."""
    deployment = gpu.app.config.name
    engine_reads = {ident for where, ident, _ in watched(gpu.template("observability"))
                    if ident[0] == mn.ENGINE_NAMESPACE}
    assert engine_reads
    per_slot = []
    for engine_id in ("i-0abc", "i-0abc-1"):
        documents = engine_documents(deployment, "decode", engine_id)
        assert documents and {d[mn.ENGINE_ID] for d in documents} == {engine_id}
        emitted = set().union(*(identities(d) for d in documents))
        assert engine_reads <= emitted, sorted(engine_reads - emitted)
        per_slot.append({i for i in emitted if mn.ENGINE_ID in i[2]})
    assert per_slot[0] and per_slot[0] == per_slot[1]  # the same metrics, told apart by the EngineId value


def test_the_ttft_alarm_watches_what_the_router_emits(gpu, emitted):
    reads = [(ident, values) for where, ident, values in watched(gpu.template("observability"))
             if where.startswith("alarm RouterTtft")]
    assert reads and all(ident[:2] == (mn.ROUTER_NAMESPACE, mn.TTFT) and ident in emitted for ident, _ in reads)


def test_the_dashboard_shows_engines_registered_per_role_against_what_the_pools_hold(gpu):
    """What the EnginesNotRegistered alarms watch is on the dashboard too, with each role's pool count as a line."""
    widgets = [w["properties"] for w in _dashboard_body(gpu.template("observability"))["widgets"]
               if "Engines registered" in w.get("properties", {}).get("title", "")]
    assert len(widgets) == 1, "no engines-registered widget"
    shown = set()
    for row in widgets[0]["metrics"]:
        _, name, *pairs = [x for x in row if not isinstance(x, dict)]
        if name == mn.REGISTERED_ENGINES:
            shown.add(dict(zip(pairs[::2], pairs[1::2], strict=True))[mn.ROLE])
    roles = {p.role.value for p in gpu.app.config.pools}
    assert shown == roles
    lines = {a["label"]: a["value"] for a in widgets[0]["annotations"]["horizontal"]}
    for role in roles:
        want = sum(p.count for p in gpu.app.config.pools if p.role.value == role)
        assert lines[f"{role} pools: {want}"] == want


def test_the_router_prices_reuse_savings_at_the_prefill_pools_engine_hour(gpu, push, tp4):
    """One price table (turnkv.plan.hardware): p5en at TP 8 is one engine per instance, at TP 4 two; the router's
    container gets that price, and the dashboard turns the savings into dollars per 1,000 turns and per tenant."""
    from turnkv import router_env
    from turnkv.plan.hardware import INSTANCES

    p5en = INSTANCES["p5en.48xlarge"].price_per_hour
    assert gpu.app.config.prefill_engine_price_per_hour() == pytest.approx(p5en)
    assert tp4.app.config.prefill_engine_price_per_hour() == pytest.approx(p5en / 2)
    assert push.app.config.prefill_engine_price_per_hour() == pytest.approx(INSTANCES["p5.48xlarge"].price_per_hour)
    for synth, want in ((gpu, p5en), (tp4, p5en / 2)):
        (task,) = [r for r in synth.template("router")["Resources"].values() if r["Type"] == "AWS::ECS::TaskDefinition"]
        env = {e["Name"]: e["Value"] for c in task["Properties"]["ContainerDefinitions"] for e in c["Environment"]}
        assert float(env[router_env.PREFILL_PRICE]) == pytest.approx(want)
    widgets = {w["properties"].get("title"): w["properties"] for w in _dashboard_body(gpu.template("observability"))
               ["widgets"] if "properties" in w}
    per_1k = widgets["Reuse savings: $ per 1k turns"]
    expressions = [row[-1]["expression"] for row in per_1k["metrics"] if isinstance(row[-1], dict)
                   and "expression" in row[-1]]
    assert "1000 * FILL(c, 0) / t" in expressions
    names = {row[1] for row in per_1k["metrics"] if len(row) > 2 and isinstance(row[1], str)}
    assert {mn.PREFILL_COST_SAVED, mn.REQUESTS, mn.PREFILL_TIME_SAVED} <= names
    assert widgets["Reuse savings: $ per 1k turns (24 h)"]["period"] == 86400
    for title, metric in (("Prefill time saved by tenant", mn.PREFILL_TIME_SAVED),
                          ("Prefill $ saved by tenant", mn.PREFILL_COST_SAVED)):
        (row,) = widgets[title]["metrics"]
        assert f"{mn.DEPLOYMENT},{mn.TENANT}" in row[-1]["expression"] and metric in row[-1]["expression"]
