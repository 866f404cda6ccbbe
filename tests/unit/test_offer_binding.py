"""Signatures cover everything a READ uses, and a clearance is for one tenant's read on one prefill engine (issue
38, item 5): each forged field is refused before any READ, by the wire checks and by prefill's scheduler."""

from __future__ import annotations

import time
import types

import pytest

from tests.unit.test_wire import RETAIN, SECRET, _request, offer, scheduler  # noqa: F401
from turnkv import wire


@pytest.mark.parametrize(("key", "value"), [
    (wire.TP_SIZE, 2), (wire.DCP_SIZE, 2), (wire.PP_SIZE, 2), (wire.REMOTE_BLOCK_SIZE, 16),
    (wire.TRANSFER_MODE, "push"), (wire.TENANT, "tenant-b")])
def test_every_field_a_read_uses_is_signed(key, value):
    good = offer(**{wire.TP_SIZE: 1, wire.DCP_SIZE: 1, wire.PP_SIZE: 1, wire.TRANSFER_MODE: "pull",
                    wire.TENANT: "tenant-a"})
    assert wire.check_offer(SECRET, good, "model-x", time.time(), 5) == "ok"
    assert wire.check_offer(SECRET, {**good, key: value}, "model-x", time.time(), 5) == "forged"
    # a field decode did not send, added on the way: forged too
    bare = offer()
    assert wire.check_offer(SECRET, {**bare, key: value}, "model-x", time.time(), 5) == "forged"


def test_a_clearance_is_for_the_offers_tenant_and_the_prefill_it_names():
    tenant_a = offer(**{wire.TENANT: "tenant-a"})
    read_by = time.time() + 10
    ok = wire.clear_offer(SECRET, tenant_a, read_by, tenant="tenant-a", prefill="prefill-0")
    assert wire.check_clearance(SECRET, ok, time.time(), required=True, engine_id="prefill-0") == "ok"
    # dispatched for another tenant (a router's tenant check bypassed or wrong): not this offer's read
    other_tenant = wire.clear_offer(SECRET, tenant_a, read_by, tenant="tenant-b", prefill="prefill-0")
    assert wire.check_clearance(SECRET, other_tenant, time.time(), required=True, engine_id="prefill-0") == \
        "uncleared"
    no_tenant = wire.clear_offer(SECRET, tenant_a, read_by, prefill="prefill-0")
    assert wire.check_clearance(SECRET, no_tenant, time.time(), required=True, engine_id="prefill-0") == "uncleared"
    # sent to (or replayed on) another prefill engine
    assert wire.check_clearance(SECRET, ok, time.time(), required=True, engine_id="prefill-1") == "uncleared"
    # the bound fields are inside the MAC: edited, stripped or added, the clearance no longer verifies
    for forged in ({**ok, wire.CLEARED_TENANT: "tenant-b", wire.TENANT: "tenant-b"},
                   {**ok, wire.CLEARED_FOR: "prefill-1"},
                   {k: v for k, v in ok.items() if k != wire.CLEARED_FOR},
                   {**wire.clear_offer(SECRET, tenant_a, read_by, tenant="tenant-a"), wire.CLEARED_FOR: "prefill-1"}):
        assert wire.check_clearance(SECRET, forged, time.time(), required=True, engine_id="prefill-1") == \
            "uncleared"
    # a clearance that names no prefill (the router does not know its engine id) is read by the one it reaches
    anywhere = wire.clear_offer(SECRET, tenant_a, read_by, tenant="tenant-a")
    assert wire.check_clearance(SECRET, anywhere, time.time(), required=True, engine_id="prefill-1") == "ok"
    # an offer retained without a tenant (a router that sends none) is cleared without one
    untagged = offer()
    assert wire.check_clearance(SECRET, wire.clear_offer(SECRET, untagged, read_by), time.time(), required=True,
                                engine_id="prefill-0") == "ok"
    assert wire.check_clearance(SECRET, wire.clear_offer(SECRET, untagged, read_by, tenant="tenant-a"), time.time(),
                                required=True, engine_id="prefill-0") == "uncleared"


def test_decode_signs_the_retain_requests_tenant_and_prefill_refuses_a_clearance_for_another_tenant_or_engine(
        scheduler):  # noqa: F811
    decode, prefill = scheduler(), scheduler()
    prefill.engine_id = "prefill-0"
    tokens = list(range(300))
    _, out = decode.request_finished(_request("d1", tokens, {**RETAIN, wire.TENANT: "tenant-a"}), [[1, 2, 3]])
    assert out[wire.TENANT] == "tenant-a" and wire.check_offer(SECRET, out, "model-x", time.time(), 5) == "ok"
    _, untagged = decode.request_finished(_request("d2", tokens, {**RETAIN, wire.TENANT: "x" * 65}), [[4, 5, 6]])
    assert wire.TENANT not in untagged  # malformed tag: none
    prompt = tokens + [7] * 10
    read_by = time.time() + 10
    refused = [
        wire.clear_offer(SECRET, out, read_by, tenant="tenant-b", prefill="prefill-0"),
        wire.clear_offer(SECRET, out, read_by, tenant="tenant-a", prefill="prefill-1"),
        wire.clear_offer(SECRET, {**out, wire.TP_SIZE: 4}, read_by, tenant="tenant-a", prefill="prefill-0"),
        wire.clear_offer(SECRET, {**out, wire.REMOTE_BLOCK_SIZE: 16}, read_by, tenant="tenant-a", prefill="prefill-0"),
        wire.clear_offer(SECRET, {**out, wire.TRANSFER_MODE: "push"}, read_by, tenant="tenant-a",
                         prefill="prefill-0"),
    ]
    for i, params in enumerate(refused):
        count, _ = prefill.get_num_new_matched_tokens(_request(f"p{i}", prompt, params), 0)
        assert count == 0 and prefill.asked[-1]["remote_block_ids"] is None, i
    data = prefill.turnkv_stats.data
    assert data["turnkv_offers_uncleared"] == [1, 1] and data["turnkv_offers_forged"] == [1, 1, 1]
    good = wire.clear_offer(SECRET, out, read_by, tenant="tenant-a", prefill="prefill-0")
    assert prefill.get_num_new_matched_tokens(_request("p9", prompt, good), 0)[0] == 300


def test_a_worker_recognizes_its_own_boot_stamp_as_the_scheduler_makes_it():
    """The lease route's boot check (``connector.leases``): each rank compares the offer's stamp with the
    fingerprint of the agent it serves, the one decode's scheduler stamped its offers with."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    from connector.scheduler import _boot_of
    from connector.worker import TurnkvWorkerMixin

    def payload(agent: bytes):
        meta = NixlAgentMetadata(engine_id="decode-0", agent_metadata=agent, kv_caches_base_addr=[0], device_id=0,
                                 num_blocks=8, block_lens=[64], block_strides=[64], kv_cache_layout="NHD",
                                 block_size=16, ssm_sizes=(0, 0), attn_backend_name="x",
                                 physical_blocks_per_logical_kv_block=1)
        return types.SimpleNamespace(agent_metadata_bytes=msgspec.msgpack.Encoder().encode(meta))

    class Worker(TurnkvWorkerMixin):
        pass

    ranks = [payload(b"agent-0"), payload(b"agent-1")]
    stamp = _boot_of({(0, 0): ranks[0], (0, 1): ranks[1]})
    restarted = _boot_of({(0, 0): payload(b"agent-0-new"), (0, 1): payload(b"agent-1-new")})
    for rank, served in enumerate(ranks):
        worker = Worker()
        worker.tp_rank, worker.xfer_handshake_metadata = rank, served
        assert worker.turnkv_own_boot(stamp) and not worker.turnkv_own_boot(restarted)
        assert worker.turnkv_own_boot(None) and not worker.turnkv_own_boot(7)
