"""The legs' bodies from the client's body serialised once (router.encoded): what each leg sends is the client's request
with the leg's own fields, whether the body is small (serialised whole per leg) or large (spliced into the shared
bytes), and a body nested past what orjson serialises is a 400 naming the limit."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router import encoded, legs
from router.dispatch import Dispatch
from router.guard import FRESH_PREFILL_PARAMS, RequestError
from router.outcomes import RequestKind
from turnkv import wire

KV = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "p0", "remote_host": "10.0.0.1",
      "remote_port": 5600, "remote_num_tokens": 40}
CLIENT = {"max_tokens": 32, "max_completion_tokens": 32, "min_tokens": 4, "stream": True,
          "stream_options": {"include_usage": True}, "return_token_ids": False}


def body(size: int, **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "x" * size}], "temperature": 0, **fields}


def sent(parts: encoded.Parts) -> dict[str, Any]:
    """What the engine parses: the parts joined, as the leg client writes them."""
    raw = parts if isinstance(parts, bytes) else b"".join(parts)
    return orjson.loads(raw)


def dispatch(b: dict[str, Any], made: bool = True, **fields: Any) -> Dispatch:
    """``made``: the intake serialised the body (one that may nest too deep, or large), else not (router.flow)."""
    return Dispatch(RequestKind.CHAT, "/v1/chat/completions", b, "r", None, None,
                    encoded=encoded.base(b) if made else None, **fields)


@pytest.mark.parametrize("size,made", [(10, False), (10, True), (encoded.SPLICE_MIN * 2, True)],
                         ids=["small", "small_serialised", "spliced"])
@pytest.mark.parametrize("client", [{}, CLIENT], ids=["bare", "every_leg_field"])
@pytest.mark.parametrize("migrate", [False, True])
def test_each_leg_sends_the_client_request_with_its_own_fields(size, made, client, migrate):
    b = body(size, **client)
    d = dispatch(b, made, migrate=migrate)
    assert isinstance(legs.prefill_body(d, FRESH_PREFILL_PARAMS), bytes) is (size < encoded.SPLICE_MIN)
    rest = {k: v for k, v in b.items() if k not in encoded.LEG_FIELDS}
    prefill = sent(legs.prefill_body(d, FRESH_PREFILL_PARAMS))
    want = {**rest, "max_tokens": 1, "stream": False, "kv_transfer_params": FRESH_PREFILL_PARAMS}
    if "max_completion_tokens" in b:
        want["max_completion_tokens"] = 1
    if migrate or "return_token_ids" in b:
        want["return_token_ids"] = migrate or b["return_token_ids"]
    assert prefill == want  # min_tokens and stream_options left out
    decode = sent(legs.decode_body(d, KV))
    assert decode == {**b, "kv_transfer_params": KV, **({"return_token_ids": True} if migrate else {})}


@pytest.mark.parametrize("size", [10, encoded.SPLICE_MIN * 2], ids=["whole", "spliced"])
def test_decode_alone_gets_no_kv_transfer_params_and_a_kept_turn_asks_decode_to_retain(size):
    b = body(size, max_tokens=8)
    assert sent(legs.decode_body(dispatch(b), None)) == b
    kept = sent(legs.decode_body(dispatch(b, retain=True, tenant_tag="t1"), KV))
    assert kept["kv_transfer_params"] == {**KV, wire.RETAIN: True, wire.TENANT: "t1"}


def test_splicing_into_an_empty_object_and_with_nothing_to_add():
    assert orjson.loads(b"".join([encoded.splice(b"{}", {"a": 1})])) == {"a": 1}
    assert encoded.splice(b'{"a":1}', {}) == b'{"a":1}'
    assert orjson.loads(b"".join(encoded.splice(b'{"a":1}', {"b": [2]}))) == {"a": 1, "b": [2]}


def test_a_body_nested_past_orjsons_limit_is_a_400_naming_it():
    value: Any = "x"
    for _ in range(encoded.MAX_DEPTH - 1):
        value = [value]
    assert encoded.base({"v": value})  # the body and 253 arrays: 254 levels
    with pytest.raises(RequestError, match=f"more than {encoded.MAX_DEPTH} levels"):
        encoded.base({"v": [value]})
