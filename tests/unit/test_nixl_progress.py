"""The NIXL progress thread follows the agent's backends (issue 26, item 6).

The 1 ms delay was measured for idle CPU engines over UCX/TCP. LIBFABRIC agents (EFA, TP 8, many descriptors per
READ) keep upstream's zero-delay thread unless ``TURNKV_NIXL_PROGRESS_US`` says otherwise.
"""

from __future__ import annotations

import logging
import types

import pytest

from connector import nixl_agent
from connector.nixl_agent import PROGRESS_ENV, UCX_DELAY_US, progress_setting

# --- the pure decision ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backends", [None, ["UCX"], []])
def test_ucx_agents_get_turnkvs_delay_by_default(backends):
    setting = progress_setting(backends, {})
    assert (setting.thread, setting.delay_us) == (True, UCX_DELAY_US) and "UCX" in setting.source


@pytest.mark.parametrize("backends", [["LIBFABRIC"], ["UCX", "LIBFABRIC"], ["ALL"]])
def test_libfabric_agents_get_upstreams_zero_delay_by_default(backends):
    setting = progress_setting(backends, {})
    assert (setting.thread, setting.delay_us) == (True, 0)
    assert "upstream" in setting.source and "no added delay" in setting.describe()


@pytest.mark.parametrize("backends", [["UCX"], ["LIBFABRIC"]])
def test_an_explicit_setting_applies_to_every_backend(backends):
    assert progress_setting(backends, {PROGRESS_ENV: "250"}) == progress_setting(backends, {PROGRESS_ENV: " 250"})
    setting = progress_setting(backends, {PROGRESS_ENV: "250"})
    assert (setting.thread, setting.delay_us) == (True, 250) and f"{PROGRESS_ENV}=250" in setting.source
    off = progress_setting(backends, {PROGRESS_ENV: "0"})
    assert (off.thread, off.delay_us) == (False, 0) and off.describe().startswith("no progress thread")


def test_a_malformed_setting_falls_back_to_the_backends_default_and_says_so():
    ucx = progress_setting(["UCX"], {PROGRESS_ENV: "1ms"})
    efa = progress_setting(["LIBFABRIC"], {PROGRESS_ENV: "1ms"})
    assert (ucx.delay_us, efa.delay_us) == (UCX_DELAY_US, 0)
    assert "'1ms' is not an integer" in ucx.source and "'1ms' is not an integer" in efa.source


def test_an_empty_setting_is_unset():
    assert progress_setting(["LIBFABRIC"], {PROGRESS_ENV: ""}).delay_us == 0


# --- the agents vLLM creates, through the plugin -------------------------------------------------------------


class FakeCppAgent:
    def __init__(self, name):
        self.name = name

    def getAvailPlugins(self):
        return ["LIBFABRIC", "UCX"]

    def createBackend(self, backend, params):
        return backend

    def getBackendParams(self, handle):
        return {}, ["DRAM", "VRAM"]


class FakeBindings(types.ModuleType):
    """nixl's C++ bindings as far as nixl_agent's constructor uses them; records each agent's thread settings."""

    def __init__(self) -> None:
        super().__init__("nixl_bindings")
        self.agents: list[tuple[str, bool, int]] = []

    def nixlAgentConfig(self):
        return types.SimpleNamespace()

    def nixlAgent(self, name, config):
        self.agents.append((name, config.useProgThread, config.pthrDelay))
        return FakeCppAgent(name)

    def __getattr__(self, name):  # segment and operation constants
        return name


@pytest.fixture
def engine(monkeypatch):
    """The plugin's NIXL patch as an engine process applies it, over fake C++ bindings and the real nixl._api."""
    pytest.importorskip("vllm")
    import nixl._api as nixl_api
    from vllm.distributed import nixl_utils
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    bindings = FakeBindings()
    monkeypatch.setattr(nixl_api, "nixlBind", bindings)
    monkeypatch.setattr(nixl_api.nixl_agent, "__init__", nixl_api.nixl_agent.__init__)
    monkeypatch.setattr(nixl_utils, "nixl_agent_config", nixl_api.nixl_agent_config)
    monkeypatch.setattr(base_worker, "nixl_agent_config", nixl_api.nixl_agent_config)
    monkeypatch.delenv(PROGRESS_ENV, raising=False)

    def agent(name, **config):
        """An agent built the way vLLM's NIXL worker builds it (base_worker's config, nixl_agent)."""
        nixl_api.nixl_agent(name, base_worker.nixl_agent_config(capture_telemetry=True, **config))
        return bindings.agents[-1][1:]

    return types.SimpleNamespace(apply=nixl_agent.apply, agent=agent, bindings=bindings, nixl_api=nixl_api)


def test_ucx_agents_poll_every_millisecond_and_libfabric_agents_as_upstream(engine, caplog):
    with caplog.at_level(logging.INFO, logger="vllm.turnkv.nixl"):
        applied = engine.apply()
        assert engine.agent("ucx", num_threads=4) == (True, UCX_DELAY_US)
        assert engine.agent("efa", backends=["LIBFABRIC"]) == (True, 0)  # before: (True, 1000)
    assert applied == [f"nixl-progress-thread(UCX {UCX_DELAY_US}, LIBFABRIC 0)"]
    logged = caplog.text
    assert "NIXL agent ucx: progress thread polling every 1000 us (turnkv's default for UCX)" in logged
    assert "NIXL agent efa: progress thread polling every 0 us (upstream's for LIBFABRIC: no added delay)" in logged


def test_an_explicit_delay_reaches_libfabric_agents_too(engine, monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "200")
    engine.apply()
    assert engine.agent("efa", backends=["LIBFABRIC"]) == (True, 200)
    assert engine.agent("ucx") == (True, 200)
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert engine.agent("efa-off", backends=["LIBFABRIC"]) == (False, 0)


def test_applying_twice_wraps_once(engine):
    engine.apply()
    init = engine.nixl_api.nixl_agent.__init__
    assert engine.apply() == []
    assert engine.nixl_api.nixl_agent.__init__ is init
    assert isinstance(engine.nixl_api.nixlBind, nixl_agent.DelayedProgressBindings)
    assert not isinstance(engine.nixl_api.nixlBind._bindings, nixl_agent.DelayedProgressBindings)
