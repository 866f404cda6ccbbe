"""Params stack custom resource: the value each tunable's parameter holds after a deploy.

The stack's AWS::SSM::Parameter resources take their Value from this resource's attribute of the same name: the
live value where the parameter exists and fits this kit's pattern and bounds (the operator's, from
``turnkv params set``), else the deployment's default. So an upgrade that edits a tunable's help text or
default rewrites the description, never the operator's value. Its properties carry every parameter's
spec, so whatever changes a parameter resource runs this first.
"""

import json
import re
import urllib.request

import boto3


def kept(live, spec):
    """{tunable: value}: the live one where it is valid under ``spec`` (path, pattern, min, max, default)."""
    out = {}
    for name, s in spec.items():
        value = live.get(s["path"])
        valid = value is not None and re.fullmatch(s["pattern"], value) is not None \
            and float(s["min"]) <= float(value) <= float(s["max"])
        out[name] = value if valid else s["default"]
    return out


def live_values(ssm, paths):
    """{path: value} of the parameters that exist (GetParameters takes 10 names; missing ones are skipped)."""
    found = {}
    for start in range(0, len(paths), 10):
        for p in ssm.get_parameters(Names=paths[start:start + 10])["Parameters"]:
            found[p["Name"]] = p["Value"]
    return found


def handler(event, context, ssm=None, respond=None):
    status, reason, data = "SUCCESS", "", {}
    try:
        if event["RequestType"] != "Delete":
            spec = json.loads(event["ResourceProperties"]["Tunables"])
            data = kept(live_values(ssm or boto3.client("ssm"), [s["path"] for s in spec.values()]), spec)
            print(json.dumps({"kept": data}))
    except Exception as exc:  # CloudFormation waits an hour for an answer that never comes
        status, reason = "FAILED", f"{type(exc).__name__}: {exc}"[:400]
    body = {"Status": status, "Reason": reason or "turnkv tunables",
            "PhysicalResourceId": event.get("PhysicalResourceId") or event["LogicalResourceId"],
            "StackId": event["StackId"], "RequestId": event["RequestId"],
            "LogicalResourceId": event["LogicalResourceId"], "Data": data}
    (respond or _put)(event["ResponseURL"], body)
    return body


def _put(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": ""})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
