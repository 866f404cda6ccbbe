"""Issue #37, item 4: host-tier reads are learned and predicted at their own measured rate, not as device reads; the
worker spin cut applies on CPU engines only."""

from __future__ import annotations

import pytest

from connector import idle
from connector.policy import DEVICE, HOST, CostModel

pytest.importorskip("vllm")

from connector.admission import ReadPlan
from connector.stats import TurnkvKVConnectorStats
from connector.worker import TurnkvWorkerMeta, TurnkvWorkerMixin


def model(device_per_token: float, host_per_token: float | None, compute_per_token: float = 0.0004) -> CostModel:
    m = CostModel(probe_every=0)
    for _ in range(20):
        for tokens in (100, 1000, 3000):
            m.observe_step(0.02 + compute_per_token * tokens, tokens)
            m.observe_transfer(0.002 + device_per_token * tokens, tokens)
            if host_per_token is not None:
                m.observe_transfer(0.003 + host_per_token * tokens, tokens, HOST)
    return m


def test_a_host_tier_offer_is_predicted_at_the_host_tier_s_rate():
    m = model(device_per_token=8e-6, host_per_token=0.0006)  # the host tier over a slow path: slower than compute
    assert abs(m.pull_per_token - 8e-6) < 1e-12 and abs(m.host_pull_per_token - 0.0006) < 1e-12
    device = m.decide(2000, floor=64, tier=DEVICE)
    host = m.decide(2000, floor=64, tier=HOST)
    assert device.pull and device.reason == "faster" and abs(device.predicted_pull_s - 0.018) < 1e-9
    assert not host.pull and host.reason == "slower" and abs(host.predicted_pull_s - 1.203) < 1e-9


def test_host_reads_do_not_skew_the_device_rate_and_an_unread_tier_has_no_estimate():
    m = model(device_per_token=8e-6, host_per_token=None)
    assert m.host_pull_per_token is None
    assert m.decide(2000, floor=64, tier=HOST).reason == "no-estimate"  # pulls once, then knows
    before = m.pull_per_token
    for _ in range(50):
        m.observe_transfer(0.5, 1000, HOST)
    assert m.pull_per_token == before


class _Upstream:
    """Upstream's ``_pop_done_transfers``: every handle is DONE, its telemetry recorded in the order polled."""

    def _pop_done_transfers(self, transfers):
        done = set()
        for req_id in list(transfers):
            size, seconds = self.sizes[req_id]
            self.xfer_stats.data["bytes_transferred"].append(size)
            self.xfer_stats.data["transfer_duration"].append(seconds)
            done.add(req_id)
            del transfers[req_id]
        return done, set()


class _Worker(TurnkvWorkerMixin, _Upstream):
    pass


def test_the_worker_reports_host_tier_reads_apart_from_device_reads():
    w = object.__new__(_Worker)
    w.xfer_stats, w.world_size = TurnkvKVConnectorStats(), 1
    w._turnkv_reads, w._turnkv_host_read_samples = [], []
    w._turnkv_plans = {"from-host": ReadPlan(host=((0x1000,), 8))}
    w._turnkv_checked, w._recving_metadata = set(), {}
    w.sizes = {"from-device": (4096, 0.001), "from-host": (8192, 0.004)}
    w._recving_transfers = {"from-device": [1], "from-host": [2]}
    done, failed = w._pop_done_transfers(w._recving_transfers)
    assert done == {"from-device", "from-host"} and failed == set() and w._recving_transfers == {}
    assert w._turnkv_reads == [(4096, 0.001)] and w._turnkv_host_read_samples == [(8192, 0.004)]
    meta = TurnkvWorkerMeta(reads=w._turnkv_reads, host_reads=w._turnkv_host_read_samples)
    other = TurnkvWorkerMeta(host_reads=[(1, 0.1)])
    assert meta.aggregate(other).host_reads == [(8192, 0.004), (1, 0.1)]


def test_the_worker_spin_cut_applies_on_cpu_engines_only(monkeypatch):
    calls = []
    monkeypatch.setattr(idle, "_shorter_worker_spin", lambda: calls.append("spin") or ["worker-spin(2ms)"])
    monkeypatch.setattr(idle, "_idle_engine_tick", lambda: ["idle-tick(100ms)"])
    assert idle.apply("cuda") == ["idle-tick(100ms)"] and calls == []
    assert idle.apply("neuron") == ["idle-tick(100ms)"] and calls == []
    assert idle.apply("cpu") == ["worker-spin(2ms)", "idle-tick(100ms)"] and calls == ["spin"]
    assert idle.spin_cut_applies("cpu") and not idle.spin_cut_applies("cuda")
