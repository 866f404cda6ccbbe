"""Upstream's ``kv_transfer_params`` keys are spelled once, in ``turnkv/wire.py``, and the typed view round-trips.

The router, the connector and the fake engine read and write vLLM's NIXL keys (``remote_engine_id``,
``do_remote_decode``, ...) through ``turnkv.wire``'s constants and its ``KVParams`` view. A bare literal elsewhere is
a second spelling of a wire fact: a typo in it silently reads None. Every ``.py`` file of ``router/`` and
``connector/``, and the benchmarks that build params (``bench/fake_engine.py``, ``fastapi_proxy.py``,
``router_peers.py``), is parsed; a string constant equal to an upstream key is an offence
(docstrings and comments only mention keys inside longer text, so they never match).
"""

from __future__ import annotations

import ast
import importlib.util
import time
from pathlib import Path

import orjson
import pytest

from tests.sources import python_files, relative
from turnkv import wire

SCANNED = ("router", "connector", "bench/fake_engine.py", "bench/fastapi_proxy.py", "bench/router_peers.py")
#: (file, key): literals that name something else with the same spelling.
ALLOWED = {
    # Engine attributes (Cloud Map / --prefill-engines), named after the engine's tensor-parallel size, not params.
    ("router/engines/__init__.py", "tp_size"),
    ("router/engines/discovery.py", "tp_size"),
}


def key_literals(source: str, rel: str) -> list[tuple[int, str]]:
    """(line, key) for every string constant in ``source`` that spells one of upstream's keys."""
    keys = set(wire.UPSTREAM_KEYS)
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source, filename=rel))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys]


def test_upstream_keys_are_spelled_only_in_turnkv_wire():
    files = python_files(SCANNED)
    assert len(files) > 40, "the scan found too few files: the folder list or the repository root is off"
    offenders = []
    for path in files:
        rel = relative(path)
        offenders += [f"{rel}:{line}: {key!r}" for line, key in key_literals(path.read_text(), rel)
                      if (rel, key) not in ALLOWED]
    assert not offenders, ("upstream kv_transfer_params keys spelled as bare strings (use turnkv.wire's constants "
                           "or wire.KVParams):\n" + "\n".join(offenders))


@pytest.mark.parametrize("source", [
    'params.get("remote_engine_id")\n',
    "kv['do_remote_decode']\n",
    'x = {"remote_num_tokens": 0}\n',
    'f"rid-{kv.get(\'remote_request_id\')}"\n',
    'KEYS = ("tp_size", "pp_size")\n',
    'out.setdefault("remote_prefill_cached_tokens", 1)\n',
])
def test_the_rule_sees_a_bare_key(source):
    assert key_literals(source, "router/x.py"), source


@pytest.mark.parametrize("source", [
    "params.get(wire.REMOTE_ENGINE_ID)\n",
    '"""Reads ``remote_engine_id`` from the params."""\n',
    "# remote_host\n",
    'x = "remote_engine"\n',
    'attrs.get("side_channel_port")\n',
])
def test_the_rule_passes_other_strings(source):
    assert not key_literals(source, "router/x.py"), source


def test_the_keys_are_the_ones_vllms_nixl_connector_reads_and_writes():
    """No invented key: each constant (but the two vLLM spells outside the NIXL connector) is a string literal of
    the installed NIXL connector's sources."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    nixl = Path(next(iter(spec.submodule_search_locations))) / "distributed/kv_transfer/kv_connector/v1/nixl"
    literals: set[str] = set()
    for path in nixl.glob("*.py"):
        tree = ast.parse(path.read_text())
        literals |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        # dict(do_remote_prefill=..., ...): upstream builds its answer with keyword arguments
        literals |= {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg}
    elsewhere = {wire.REMOTE_PREFILL_CACHED_TOKENS, wire.TRANSFER_ID}  # vLLM's scheduler; push proxies
    assert set(wire.UPSTREAM_KEYS) - elsewhere <= literals, set(wire.UPSTREAM_KEYS) - elsewhere - literals


# -- the typed view ------------------------------------------------------------------------------------

#: Decode's offer as vLLM 0.32 returns it with turnkv's additions (bench/router_peers.py's shape, signed).
DECODE_OFFER = {
    "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[3, 4, 5, 6]],
    "remote_engine_id": "decode-3", "remote_request_id": "chatcmpl-0000000000000000000000000000002a",
    "remote_host": "10.0.12.34", "remote_port": 5600, "tp_size": 8, "dcp_size": 1, "pp_size": 1,
    "remote_num_tokens": 4042, "remote_blocks_expiry_time": 1800000042.0, "transfer_mode": "pull",
    wire.BOOT: "boot-decode-3",
    wire.TOKEN_PROOF: {"v": 1, "block_size": 128, "num_tokens": 4042, "digests": ["a", "b", "c", "d"]},
}
#: Prefill's answer in push mode (tests/router's fake engine shape) with a key this view has no property for.
PUSH_ANSWER = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[17]], "remote_engine_id": "prefill-0",
    "remote_request_id": "r-1", "remote_host": "127.0.0.1", "remote_port": 28600, "tp_size": 1, "dcp_size": 1,
    "pp_size": 1, "remote_num_tokens": 12, "remote_blocks_expiry_time": None, "transfer_mode": "push",
    "remote_prefill_cached_tokens": 9, wire.PREFILL_LOCAL_TOKENS: 4, "some_future_key": {"nested": [1, 2]},
}
#: Step 1 of the pull protocol: what prefill is sent on a turn without reuse.
FRESH = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
         "remote_host": None, "remote_port": None}


def _signed(params):
    return wire.sign_offer(b"s" * 32, dict(params), time.time() + 100, "model-x")


@pytest.mark.parametrize("params", [_signed(DECODE_OFFER), DECODE_OFFER, PUSH_ANSWER, FRESH, {}],
                         ids=["signed-offer", "offer", "push-answer", "fresh", "empty"])
def test_the_view_round_trips_the_params_byte_for_byte(params):
    before = orjson.dumps(params)
    view = wire.KVParams.from_params(params)
    back = view.to_params()
    assert back == params and list(back) == list(params) and orjson.dumps(back) == before
    assert back is not params  # a new dict: editing it leaves the original (and the view) alone
    assert orjson.dumps(params) == before  # reading through the view changes nothing
    assert all(view.get(k) == v for k, v in params.items())  # unknown keys are kept, not dropped


def test_the_view_reads_decodes_offer():
    view = wire.KVParams.from_params(_signed(DECODE_OFFER))
    assert view.do_remote_decode and not view.do_remote_prefill
    assert (view.engine_id, view.request_id, view.host, view.port) == (
        "decode-3", "chatcmpl-0000000000000000000000000000002a", "10.0.12.34", 5600)
    assert view.block_ids == [[3, 4, 5, 6]] and view.num_tokens == 4042
    assert (view.tp_size, view.pp_size, view.transfer_mode) == (8, 1, "pull")
    assert isinstance(view.expires_at, float) and view.expires_at > time.time()


def test_the_view_counts_as_the_readers_did():
    """``int(params.get(key) or default)``: absent, None and 0 read as the default (upstream's defaults)."""
    fresh = wire.KVParams.from_params(FRESH)
    assert (fresh.port, fresh.num_tokens, fresh.prefill_cached_tokens, fresh.tp_size, fresh.pp_size) == (0, 0, 0, 1, 1)
    assert fresh.engine_id is None and fresh.host is None and fresh.block_ids is None and fresh.expires_at is None
    push = wire.KVParams.from_params(PUSH_ANSWER)
    assert push.prefill_cached_tokens == 9 and push.transfer_mode == "push" and push.get("some_future_key")
    none = wire.KVParams.from_params(None)
    assert not none.do_remote_decode and none.to_params() == {}
    assert wire.KVParams({wire.EXPIRES_AT: True}).expires_at is None  # a bool is no instant


def test_the_replayed_keys_are_upstreams_then_ours():
    from router import guard

    replayed = guard.REPLAY_KEYS
    assert replayed == (*wire.UPSTREAM_OFFER_KEYS, *wire.OFFER_KEYS)
    assert set(DECODE_OFFER) - set(wire.OFFER_KEYS) == set(wire.UPSTREAM_OFFER_KEYS)
    offer = _signed(DECODE_OFFER)
    assert guard.replayable(offer) == offer  # nothing of decode's offer is dropped
