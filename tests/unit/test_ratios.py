"""turnkv.plan.ratios: the target fleet's memory ratios from the planner's tables, scaled to the local stack."""

from __future__ import annotations

import pytest

from infra import instances
from turnkv.local.stack import StackConfig, StackError, at_ratios, plan
from turnkv.plan import architectures, hardware, ratios


def test_the_target_pools_come_from_the_planners_tables():
    p = ratios.pools()
    model = architectures.CATALOG["Qwen3-32B"]
    inst = hardware.INSTANCES["p5en.48xlarge"]
    assert p.kv_bytes_per_token == 64 * 8 * 128 * 2 * 2 == model.kv_bytes_per_token()  # 256 KiB, bf16
    engine_kv = 8 * inst.hbm_bytes * inst.memory_utilization - model.total_params() * 2
    assert p.prefill_hbm_tokens == pytest.approx(engine_kv / p.kv_bytes_per_token)
    host = instances.INSTANCE_TYPES["p5en.48xlarge"].host_memory_gib * 2**30
    assert p.prefill_offload_tokens == pytest.approx(host * instances.HOST_TIER_SHARE / p.kv_bytes_per_token)
    assert p.ratio(p.decode_hbm_tokens) == pytest.approx(5.0)  # five decode nodes of the same engine
    assert p.ratio(p.decode_retained_tokens) == pytest.approx(2.5)  # retained_kv_share 0.5 of them
    assert p.ratio(p.decode_host_tokens) == pytest.approx(5 * p.ratio(p.prefill_offload_tokens), rel=1e-3)
    assert set(p.as_dict()["sources"]) >= {"kv_bytes_per_token", "engine_kv_cache", "host_memory", "host_tier"}


def test_scaling_keeps_the_ratios_in_whole_blocks():
    s = ratios.scale(prefill_blocks=16)
    assert s.block_bytes == 8192 * 128  # the tiny model: 4 layers x 4 KV heads x 64 x K,V x fp32
    # turnkv's prefill runs the offloading tier too (as deployed): both prefills hold HBM + offload
    assert (s.prefill_hbm_blocks, s.prefill_blocks, s.peer_prefill_blocks, s.decode_blocks) == (16, 35, 35, 80)
    hbm_only = ratios.scale(prefill_blocks=16, prefill_offload=False)
    assert (hbm_only.prefill_blocks, hbm_only.peer_prefill_blocks, hbm_only.decode_blocks) == (16, 35, 80)
    assert s.host_kv_budget_mib == 93  # 5.79 x 16 blocks of 1 MiB, rounded up
    assert ratios.scale(prefill_blocks=32).decode_blocks == 160
    with pytest.raises(ValueError):
        ratios.scale(prefill_blocks=0)


def test_fit_counts_whole_conversations():
    assert ratios.fit(1180, 35, 128) == 3  # 10 blocks each
    assert ratios.fit(100_000, 35, 128) == 1


def test_the_stack_at_target_ratios_starts_exact_block_counts_and_the_peer_arm():
    config = at_ratios(StackConfig(peer=True, tunables={"kv_recompute_threshold": 32}), ratios.scale())
    assert config.tunables == {"kv_recompute_threshold": 32, "retained_kv_share": 0.5, "host_kv_budget_mib": 93}
    procs = {p.name: p for p in plan(config)}
    assert set(procs) == {"prefill-0", "decode-0", "prefill-peer", "router", "router-peer"}

    def override(name: str) -> str:
        argv = procs[name].argv
        return argv[argv.index("--num-gpu-blocks-override") + 1]

    assert (override("prefill-0"), override("prefill-peer"), override("decode-0")) == ("35", "35", "80")
    # vLLM keeps one block back: 35 blocks of 128 serve a request of 34 x 128 tokens
    assert all(procs[n].argv[procs[n].argv.index("--max-model-len") + 1] == str(34 * 128)
               for n in ("prefill-0", "decode-0", "prefill-peer"))
    peer = procs["prefill-peer"].argv
    assert "--enable-prefix-caching" in peer and procs["prefill-peer"].port == config.peer_prefill_port
    router_peer = procs["router-peer"].argv
    assert router_peer[router_peer.index("--prefill") + 1] == f"http://127.0.0.1:{config.peer_prefill_port}"
    assert router_peer[router_peer.index("--decode") + 1] == procs["decode-0"].url  # the same decode engine
    ports = [port for p in procs.values() for port in (p.port, *p.extra_ports)]
    assert len(ports) == len(set(ports))


def test_a_plain_stack_is_unchanged_and_bad_counts_are_refused():
    procs = plan(StackConfig())
    assert [p.name for p in procs] == ["prefill-0", "decode-0", "router"]
    assert not any("--num-gpu-blocks-override" in p.argv for p in procs)
    with pytest.raises(StackError, match="decode_blocks"):
        plan(StackConfig(decode_blocks=0))
    with pytest.raises(StackError, match="peer"):
        plan(StackConfig(peer=True, prefill_engines=3))


def test_turnkv_local_up_starts_the_peer_arm_at_target_ratios(monkeypatch):
    from typer.testing import CliRunner

    from turnkv.cli import app
    from turnkv.commands import local

    seen = []
    monkeypatch.setattr(local, "start_stack", lambda config, console: seen.append(config) or {
        "components": {"router": {"url": "http://127.0.0.1:8000"}}})
    result = CliRunner().invoke(app, ["local", "up", "--peer", "--target-ratios", "--prefill-blocks", "32",
                                      "--no-prefill-offload"])
    assert result.exit_code == 0, result.output
    config = seen[0]
    assert config.peer and (config.prefill_blocks, config.peer_prefill_blocks, config.decode_blocks) == (32, 69, 160)
    assert config.tunables["host_kv_budget_mib"] == 186 and config.max_model_len == 31 * 128
    result = CliRunner().invoke(app, ["local", "up", "--peer", "--target-ratios", "--prefill-blocks", "32"])
    assert result.exit_code == 0, result.output
    assert (seen[1].prefill_blocks, seen[1].peer_prefill_blocks) == (69, 69)  # as deployed: the offload tier too
