"""The local stack's supervisor: plan (pure) and process control with real, cheap processes."""

import json
import os
import socket
import sys
import time
import types
from pathlib import Path

import pytest

from tests.conftest import free_port
from turnkv import params, wire
from turnkv.engine_args import Mode
from turnkv.local import stack
from turnkv.local.stack import ProcessSpec, StackConfig, StackError, Supervisor


def test_plan_pins_engines_and_wires_the_router(tmp_path):
    procs = {p.name: p for p in stack.plan(StackConfig(state_dir=tmp_path, router_port=9000))}
    assert list(procs) == ["prefill-0", "decode-0", "router"]
    prefill, decode, router = procs["prefill-0"], procs["decode-0"], procs["router"]
    cores = sorted(stack.os.sched_getaffinity(0))
    if len(cores) > 1 and stack.shutil.which("taskset"):
        assert prefill.argv[:3] == ["taskset", "-c", str(cores[0])]
        assert decode.argv[:3] == ["taskset", "-c", str(cores[1])]
    # prefix caching on both roles, as deployed; the seeds' setting (prefill recomputes) is the A/B's
    assert "--enable-prefix-caching" in prefill.argv and "--enable-prefix-caching" in decode.argv
    seeds = {p.name: p for p in stack.plan(StackConfig(state_dir=tmp_path, prefill_prefix_caching=False))}
    assert "--no-enable-prefix-caching" in seeds["prefill-0"].argv
    kv = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert kv["engine_id"] == "prefill-0" and kv["kv_connector_extra_config"]["bidirectional_kv_xfer"]
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert prefill.env["UCX_NET_DEVICES"] == "lo"
    # the engines load the connector of this checkout, not the one an editable install points at
    assert prefill.env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(stack.__file__).resolve().parents[2])
    assert router.argv[router.argv.index("--prefill") + 1] == prefill.url
    assert router.argv[router.argv.index("--decode") + 1] == decode.url
    assert router.port == 9000 and router.log.parent == (tmp_path / "logs").resolve()
    # one offer secret: the engines sign and verify with it, the router clears its replays with it
    secret = str(stack.offer_secret_path(StackConfig(state_dir=tmp_path)))
    assert prefill.env[wire.OFFER_SECRET_FILE_ENV] == decode.env[wire.OFFER_SECRET_FILE_ENV] == secret
    assert router.env[wire.OFFER_SECRET_FILE_ENV] == secret


def test_best_case_adds_a_cached_prefill_and_a_second_router(tmp_path):
    procs = {p.name: p for p in stack.plan(StackConfig(state_dir=tmp_path, best_case=True,
                                                       prefill_prefix_caching=True))}
    assert "--enable-prefix-caching" in procs["prefill-0"].argv
    assert "--enable-prefix-caching" in procs["prefill-cached"].argv
    assert procs["router-best"].port == 8001
    argv = procs["router-best"].argv
    assert argv[argv.index("--prefill") + 1] == procs["prefill-cached"].url


def _config_with_only_router_busy(tmp_path, router_port: int) -> StackConfig:
    """Engine ports derived from free_port() (bases + offsets) can land on a port another process on a
    busy CI machine holds at that moment; pick again until every port but the router's is free."""
    for _ in range(20):
        config = StackConfig(state_dir=tmp_path, router_port=router_port, prefill_port=free_port(),
                             decode_port=free_port(), side_channel_base=free_port())
        ports = [q for p in stack.plan(config) for q in (p.port, *p.extra_ports) if q != router_port]
        if not any(stack.port_in_use(q) for q in ports):
            return config
    pytest.fail("no set of free engine ports found in 20 tries")


def test_busy_port_is_named_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config = _config_with_only_router_busy(tmp_path, port)
        with pytest.raises(StackError, match=rf"port\(s\) already in use: {port} \(router\)\."):
            Supervisor(tmp_path).up(config)
    assert not (tmp_path / "state.json").exists()


def _spec(tmp_path, name, code, port=1):
    return ProcessSpec(name, [sys.executable, "-c", code], {}, port, f"http://127.0.0.1:{port}/health",
                       tmp_path / "logs" / f"{name}.log")


def test_engine_dying_at_start_names_its_log(tmp_path):
    sup = Supervisor(tmp_path)
    proc = _spec(tmp_path, "prefill-0", "import sys; print('CUDA out of cheese'); sys.exit(3)")
    state = {"components": {proc.name: sup._spawn(proc)}}
    with pytest.raises(StackError) as info:
        sup._wait_healthy([proc], state, timeout=30, on_event=lambda *a: None)
    message = str(info.value)
    assert "prefill-0 exited during start-up" in message and str(proc.log) in message
    assert "CUDA out of cheese" in message


def test_down_stops_whole_process_groups(tmp_path):
    sup = Supervisor(tmp_path)
    # A parent that starts a grandchild in its own group, like vllm serve and its engine-core process.
    code = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    proc = _spec(tmp_path, "engine", code)
    info = sup._spawn(proc)
    sup._save({"components": {"engine": info}})
    time.sleep(0.5)
    assert stack._group_alive(info["pgid"])
    assert sup.down() == ["engine"]
    assert not stack._group_alive(info["pgid"])
    assert not (tmp_path / "state.json").exists()


def test_plan_with_several_engines_router_args_and_upstream_push(tmp_path):
    from turnkv.local.stack import plan

    config = StackConfig(state_dir=tmp_path, router_port=28000, prefill_port=28100, decode_port=28200,
                         side_channel_base=25600, prefill_engines=2, decode_engines=2, router_identity=True,
                         connector="NixlPushConnector", router_args=("--store", "redis://127.0.0.1:1"))
    procs = {p.name: p for p in plan(config)}
    assert set(procs) == {"prefill-0", "prefill-1", "decode-0", "decode-1", "router"}
    sides = sorted(p.extra_ports[0] for p in procs.values() if p.kind == "engine")
    assert len(set(sides)) == 4 and sides[0] == 25600
    argv = procs["router"].argv
    assert "http://127.0.0.1:28101?engine_id=prefill-1&side_channel_port=25604" in argv
    assert argv[-2:] == ["--mode", "push"] and "--store" in argv
    kv = procs["prefill-1"].argv[procs["prefill-1"].argv.index("--kv-transfer-config") + 1]
    assert '"kv_connector":"NixlPushConnector"' in kv and "module_path" not in kv
    assert '"bidirectional_kv_xfer":false' in kv


def test_extra_routers_share_the_engines_with_flags_and_router_tunables_of_their_own(tmp_path):
    from turnkv.local.stack import ExtraRouter, plan

    config = StackConfig(state_dir=tmp_path, router_port=18000, prefill_port=18100, decode_port=18200,
                         tunables={"conversation_ttl": 45}, connector="NixlPushConnector",
                         extra_routers=(ExtraRouter("router-keyed", 18010, ("--api-keys-file", "/k")),
                                        ExtraRouter("router-evict", 18020, tunables={"replay_window": 3})))
    procs = {p.name: p for p in plan(config)}
    assert list(procs) == ["prefill-0", "decode-0", "router", "router-keyed", "router-evict"]
    main, keyed, evict = procs["router"], procs["router-keyed"], procs["router-evict"]
    assert keyed.port == 18010 and keyed.kind == "router" and keyed.log.name == "router-keyed.log"
    for router in (keyed, evict):  # the same engines, the same mode, the stack's tunables
        assert [router.argv[i + 1] for i, a in enumerate(router.argv) if a in ("--prefill", "--decode")] == \
            [procs["prefill-0"].url, procs["decode-0"].url]
        assert router.argv[-2:] == ["--mode", "push"] and "conversation_ttl=45" in router.argv
    assert "--api-keys-file" in keyed.argv and "--api-keys-file" not in main.argv + evict.argv
    windows = {r.name: [a for a in r.argv if a.startswith("replay_window=")] for r in (main, keyed, evict)}
    assert windows["router-evict"] == ["replay_window=3.0"] and windows["router"] == windows["router-keyed"] != \
        windows["router-evict"]
    with pytest.raises(StackError, match="decoder_kv_blocks_ttl are not router tunables"):
        plan(StackConfig(state_dir=tmp_path, extra_routers=(
            ExtraRouter("r", 9, tunables={"decoder_kv_blocks_ttl": 5}),)))


def _off_default(name):
    """A value other than the catalog's default that the catalog's cross-checks accept with the other defaults."""
    tunable = params.get(name)
    span = tunable.maximum - tunable.minimum
    for raw in (tunable.maximum, tunable.minimum, tunable.default + span / 10, tunable.default - span / 100,
                tunable.default * 1.5, tunable.default + 1):
        try:
            value = tunable.parse(round(raw) if tunable.kind is int else raw)
            if value != tunable.default:
                params.validate({name: value})
                return value
        except params.ParamError:
            continue
    raise AssertionError(f"no valid non-default value found for {name}")


@pytest.mark.parametrize("name", [t.name for t in params.CATALOG if t.scope is params.Scope.ENGINE])
def test_every_engine_tunable_set_on_local_up_reaches_the_engines_start_values(tmp_path, name):
    """`turnkv local up --set NAME=VALUE` for each engine tunable: the engines' KV-transfer config carries it, and the
    connector starts with it (reloadable ones) before any tunables file exists. The host tier is decode's alone."""
    from connector.tunables import RELOADABLE, start_values

    value = _off_default(name)
    procs = {p.name: p for p in stack.plan(StackConfig(state_dir=tmp_path, tunables={name: value}))}
    for role in ("prefill-0", "decode-0"):
        argv = procs[role].argv
        extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        expected = 0 if (name == "host_kv_budget_mib" and role == "prefill-0") else value
        assert extra[name] == expected, (role, extra)
        if name in RELOADABLE:
            config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra))
            assert start_values(config)[name] == expected


def test_rank_cores_gives_each_tensor_parallel_rank_a_core_wrapping_on_small_machines():
    assert stack.rank_cores([0, 1], 0, 1) == [0]
    assert stack.rank_cores([0, 1], 1, 2) == [1, 0]
    assert stack.rank_cores([2, 3, 4, 5], 3, 2) == [3, 4]


def test_plan_runs_each_role_at_its_own_tensor_parallelism_and_block_size(tmp_path, monkeypatch):
    monkeypatch.setattr(stack, "_cores", lambda: [0, 1])
    monkeypatch.setattr(stack.shutil, "which", lambda name: f"/usr/bin/{name}")
    config = StackConfig(state_dir=tmp_path, prefill_tp=2, decode_block_size=32, prefill_block_size=128)
    procs = {p.name: p for p in stack.plan(config)}
    prefill, decode = procs["prefill-0"], procs["decode-0"]

    def flag(proc, name):
        return proc.argv[proc.argv.index(name) + 1]

    assert flag(prefill, "--tensor-parallel-size") == "2" and flag(decode, "--tensor-parallel-size") == "1"
    assert flag(prefill, "--block-size") == "128" and flag(decode, "--block-size") == "32"
    # one core per rank: the CPU backend binds each rank's threads to its own list
    assert prefill.argv[:3] == ["taskset", "-c", "0,1"] and prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert decode.argv[:3] == ["taskset", "-c", "1"] and decode.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    # push: the router names prefill's TP in its first push (else prefill answers TP 2 and decode is resent)
    push = {p.name: p for p in stack.plan(StackConfig(state_dir=tmp_path, prefill_tp=2, mode=Mode.PUSH))}
    assert push["router"].argv[push["router"].argv.index("--prefill") + 1].endswith(
        "?engine_id=prefill-0&side_channel_port=5600&tp_size=2")


def test_cuda_engines_share_the_gpu_with_no_cpu_settings_and_start_one_after_another(tmp_path):
    cuda = StackConfig(state_dir=tmp_path, accelerator="cuda", cuda_devices="1", gpu_memory_utilization=0.3)
    procs = stack.plan(cuda)
    engines = [p for p in procs if p.kind == "engine"]
    for engine in engines:
        assert engine.argv[0].endswith("vllm")  # no taskset: GPU ranks are not pinned to cores
        assert engine.argv[engine.argv.index("--gpu-memory-utilization") + 1] == "0.3"
        assert engine.env["CUDA_VISIBLE_DEVICES"] == "1"
        # UCX keeps its CUDA transports; the CPU build's settings would leave none that reach VRAM
        cpu_only = {"UCX_TLS", "UCX_NET_DEVICES", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"}
        assert not cpu_only & set(engine.env)
    assert [[p.name for p in b] for b in stack.start_batches(cuda, procs)] == [["prefill-0"], ["decode-0"], ["router"]]
    cpu = StackConfig(state_dir=tmp_path)
    cpu_procs = stack.plan(cpu)
    assert [[p.name for p in b] for b in stack.start_batches(cpu, cpu_procs)] == [["prefill-0", "decode-0"], ["router"]]
    assert all("--gpu-memory-utilization" not in p.argv and "CUDA_VISIBLE_DEVICES" not in p.env for p in cpu_procs)


@pytest.mark.parametrize(("field", "value", "named"), [("accelerator", "tpu", "'tpu' is not one of cpu, cuda"),
                                                        ("gpu_memory_utilization", 1.5, "1.5 is not in (0, 1]")])
def test_a_wrong_accelerator_setting_is_refused_by_name(tmp_path, field, value, named):
    config = StackConfig(state_dir=tmp_path, **{"accelerator": "cuda", field: value})
    with pytest.raises(StackError, match=named.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        stack.plan(config)


def test_decode_only_flags_reach_decode_and_not_prefill(tmp_path):
    config = StackConfig(state_dir=tmp_path, engine_extra_args=("--seed", "7"),
                         decode_extra_args=("--speculative-config", '{"method": "ngram"}'))
    procs = {p.name: p for p in stack.plan(config)}
    assert "--speculative-config" in procs["decode-0"].argv and "--speculative-config" not in procs["prefill-0"].argv
    assert all("--seed" in procs[name].argv for name in ("prefill-0", "decode-0"))


def test_cuda_on_the_cpu_build_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(stack.engine_env, "cpu_build_vllm", lambda: "0.32.0+cpu")
    monkeypatch.setattr(stack, "port_in_use", lambda port, host="127.0.0.1": False)
    with pytest.raises(StackError, match=r"needs vLLM's CUDA wheel; this environment has vllm 0\.32\.0\+cpu"):
        Supervisor(tmp_path).up(StackConfig(state_dir=tmp_path, accelerator="cuda"))
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "models").exists()


@pytest.mark.parametrize(("flags", "dtype", "refused"), [
    ("fpu sse avx2 fma", "fp8", True), ("fpu avx2 avx512f avx512bw", "fp8", False),
    ("fpu avx2 amx_tile amx_bf16", "fp8_e4m3", False), ("fpu avx2", "auto", False), ("", "fp8", False)])
def test_an_fp8_kv_cache_on_a_cpu_without_avx512_or_amx_is_refused_with_the_fix(tmp_path, flags, dtype, refused):
    """vLLM's CPU attention raises in engine start-up for fp8 KV without AVX-512/AMX; the stack says it first."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n" if flags else "")
    why = stack.engine_env.fp8_kv_refusal(dtype, stack.engine_env.cpu_flags(cpuinfo))
    assert bool(why) == refused and (not why or "--kv-cache-dtype auto" in why)


def test_the_stack_refuses_fp8_kv_on_such_a_cpu_before_anything_starts(tmp_path, monkeypatch):
    from turnkv.engine_settings import EngineSettings

    monkeypatch.setattr(stack.engine_env, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(stack, "port_in_use", lambda port, host="127.0.0.1": False)
    config = StackConfig(state_dir=tmp_path, engine_settings=EngineSettings(kv_cache_dtype="fp8"))
    with pytest.raises(StackError, match="AVX-512 or AMX"):
        Supervisor(tmp_path).up(config)
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "models").exists()


def test_a_run_starts_with_its_own_tunables_file_so_set_wins_over_one_left_behind(tmp_path):
    """`make demo`'s pressure rows left retained_kv_share 0.5 / host_kv_budget_mib 256 in .turnkv/tunables.json;
    the engines re-read that file over their start-up values, so the next `local up --set retained_kv_share=0.02`
    ran with 0.5. Each run now writes the file with its own values before any engine starts."""
    import json

    from connector.tunables import TunablesFile

    config = StackConfig(state_dir=tmp_path, tunables={"retained_kv_share": 0.02})
    left = stack.tunables_file(config)
    left.write_text(json.dumps({"retained_kv_share": 0.5, "host_kv_budget_mib": 256}))
    stack.write_tunables_file(config)
    seen: dict = {}
    reader = TunablesFile(seen.update, path=str(left))
    assert reader.poll()
    assert seen["retained_kv_share"] == 0.02 and seen["host_kv_budget_mib"] == params.get("host_kv_budget_mib").default
    engines = {p.name: p for p in stack.plan(config)}
    assert engines["decode-0"].env[params.TUNABLES_FILE_ENV] == str(left.resolve())
    assert not left.with_suffix(".json.new").exists()


def test_the_routers_decode_share_is_what_the_local_decode_engines_run_at_once(tmp_path):
    """decode_fair_sequences on the local router: vLLM's CPU default max_num_seqs (128 per rank), the engines' own
    max_num_seqs when set, and a --set over both."""
    from turnkv.engine_settings import EngineSettings

    def router_set(config: StackConfig) -> list[str]:
        argv = next(p for p in stack.plan(config) if p.name == "router").argv
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]

    assert "decode_fair_sequences=128" in router_set(StackConfig(state_dir=tmp_path))
    assert "decode_fair_sequences=256" in router_set(StackConfig(state_dir=tmp_path, decode_tp=2))
    assert "decode_fair_sequences=8" in router_set(StackConfig(state_dir=tmp_path,
                                                               engine_settings=EngineSettings(max_num_seqs=8)))
    assert "decode_fair_sequences=5" in router_set(StackConfig(state_dir=tmp_path,
                                                               tunables={"decode_fair_sequences": 5}))


def test_the_default_state_folder_does_not_depend_on_the_working_directory(tmp_path):
    """Issue #49: `.turnkv` under the working directory made `local status` / `local down` elsewhere say "no local
    stack" / "nothing was running" while three engines kept running. The default is the environment's folder, else
    the checkout's, else the home folder's."""
    checkout = tmp_path / "clone"
    (checkout / "connector").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    home = tmp_path / "home"
    assert stack.default_state_dir({}, checkout, home) == checkout / ".turnkv"
    assert stack.default_state_dir({}, tmp_path / "site-packages", home) == home / ".turnkv"
    assert stack.default_state_dir({stack.STATE_DIR_ENV: str(tmp_path / "s")}, checkout, home) == tmp_path / "s"
    assert stack.default_state_dir({}) == stack.SOURCE_ROOT / ".turnkv"  # this checkout
    assert stack.state_folder(Path("given")) == Path("given")


def test_local_status_and_down_name_the_folder_they_looked_in(tmp_path, monkeypatch):
    """From any working directory, the commands look in the same folder and say which; `down` removes the
    hot-reloaded tunables file it would otherwise leave behind."""
    from typer.testing import CliRunner

    from turnkv.cli import app

    folder = tmp_path / "state"
    folder.mkdir()
    (folder / stack.TUNABLES_FILE).write_text("{}")
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(folder))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    status = runner.invoke(app, ["local", "status"], env={"COLUMNS": "200"})
    assert status.exit_code == 1 and f"no local stack in {folder}" in status.output
    down = runner.invoke(app, ["local", "down"], env={"COLUMNS": "200"})
    assert down.exit_code == 0 and f"nothing was running ({folder})" in down.output
    assert not (folder / stack.TUNABLES_FILE).exists()


def test_local_logs_hides_the_routers_emf_lines_unless_asked(tmp_path, monkeypatch):
    """Issue #49: `turnkv local logs router` printed a CloudWatch EMF JSON object per request between the lines a
    person reads."""
    from typer.testing import CliRunner

    from turnkv.cli import app

    logs = tmp_path / "logs"
    logs.mkdir()
    emf = '{"Deployment":"local","ReuseOutcome":"hit","_aws":{"Timestamp":1,"CloudWatchMetrics":[]}}'
    (logs / "router.log").write_text(f"router on http://127.0.0.1:8000\n{emf}\nrouter stopped after 3 s\n")
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path))
    runner = CliRunner()
    plain = runner.invoke(app, ["local", "logs", "router"], env={"COLUMNS": "200"})
    assert plain.exit_code == 0 and "router stopped after 3 s" in plain.output and "_aws" not in plain.output
    assert "_aws" in runner.invoke(app, ["local", "logs", "router", "--emf"], env={"COLUMNS": "200"}).output
