"""The params stack's keeper (infra/lambdas/keep_tunables.py): which value each tunable's parameter is written with
on a deploy, and the answer CloudFormation gets."""

from __future__ import annotations

import importlib.util

from infra.lambdas import KEEP_TUNABLES

SPEC = {"ttl": {"path": "/turnkv/d/engine/ttl", "pattern": r"^[0-9]{1,4}$", "min": "10", "max": "3600",
                "default": "540"},
        "share": {"path": "/turnkv/d/engine/share", "pattern": r"^[0-9]{1,1}(\.[0-9]+)?$", "min": "0.0",
                  "max": "1.0", "default": "0.5"}}


def _module():
    spec = importlib.util.spec_from_file_location("keep_tunables_unit", KEEP_TUNABLES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stored_value_is_kept_and_a_missing_or_invalid_one_takes_the_default():
    kept = _module().kept
    assert kept({"/turnkv/d/engine/ttl": "600", "/turnkv/d/engine/share": "0.4"}, SPEC) == {"ttl": "600",
                                                                                            "share": "0.4"}
    assert kept({}, SPEC) == {"ttl": "540", "share": "0.5"}  # first deploy
    # bounds the next kit narrowed (or a value written around the CLI): the default, so CloudFormation's write
    # passes the parameter's AllowedPattern
    assert kept({"/turnkv/d/engine/ttl": "5", "/turnkv/d/engine/share": "x"}, SPEC) == {"ttl": "540", "share": "0.5"}


class FakeSsm:
    def __init__(self, stored):
        self.stored, self.calls = stored, []

    def get_parameters(self, Names):
        self.calls.append(Names)
        return {"Parameters": [{"Name": n, "Value": self.stored[n]} for n in Names if n in self.stored],
                "InvalidParameters": [n for n in Names if n not in self.stored]}


def test_the_handler_answers_cloudformation_and_fails_loudly():
    import json

    module = _module()
    sent = []
    event = {"RequestType": "Update", "ResourceProperties": {"Tunables": json.dumps(SPEC)}, "ResponseURL": "u",
             "StackId": "s", "RequestId": "r", "LogicalResourceId": "Tunables", "PhysicalResourceId": "Tunables"}
    ssm = FakeSsm({"/turnkv/d/engine/ttl": "600"})
    body = module.handler(event, None, ssm=ssm, respond=lambda url, b: sent.append((url, b)))
    assert body["Status"] == "SUCCESS" and body["Data"] == {"ttl": "600", "share": "0.5"}
    assert body["PhysicalResourceId"] == "Tunables" and sent == [("u", body)]
    # 25 names: GetParameters takes 10 at a time
    many = {f"t{i}": {**SPEC["ttl"], "path": f"/p/{i}"} for i in range(25)}
    module.handler({**event, "ResourceProperties": {"Tunables": json.dumps(many)}}, None, ssm=(big := FakeSsm({})),
                   respond=lambda url, b: None)
    assert [len(c) for c in big.calls] == [10, 10, 5]
    # delete: nothing read, success (CloudFormation deletes the parameters themselves)
    deleted = module.handler({**event, "RequestType": "Delete"}, None, ssm=None, respond=lambda url, b: None)
    assert deleted["Status"] == "SUCCESS" and deleted["Data"] == {}
    # a broken event is a FAILED answer with the reason, not an hour of CloudFormation waiting
    broken = module.handler({**event, "ResourceProperties": {}}, None, ssm=ssm, respond=lambda url, b: None)
    assert broken["Status"] == "FAILED" and "KeyError" in broken["Reason"]


def test_inline_code_fits_cloudformation_zipfile_limit():
    assert len(KEEP_TUNABLES.read_text().encode()) < 4096
