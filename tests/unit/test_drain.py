"""The node's drain on termination (turnkv/drain.py): the lifecycle action is completed only after the routers
dropped the node and its in-flight streams finished, and never later than the drain bound."""

from __future__ import annotations

from turnkv import drain


class FakeNode:
    """A node whose terminate hook fires after ``hook_after`` s, with streams that end at the given times."""

    def __init__(self, hook_after: float, stream_ends: list[float], engine_gone_at: float | None = None):
        self.t, self.hook_after, self.stream_ends, self.gone = 0.0, hook_after, stream_ends, engine_gone_at
        self.completed_at: float | None = None

    def lifecycle_state(self):
        return drain.TERMINATING if self.t >= self.hook_after else "InService"

    def running(self):
        if self.gone is not None and self.t >= self.gone:
            return None
        return sum(1 for end in self.stream_ends if end > self.t)

    def complete(self):
        assert self.completed_at is None, "completed twice"
        self.completed_at = self.t

    def now(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds


def test_the_action_completes_once_streams_finish_after_the_routers_settle():
    node = FakeNode(hook_after=100, stream_ends=[130, 240])
    done = drain.watch(node, timeout_s=900, settle_s=20, poll_s=5)
    # hook seen at 100, settled until 120, streams end at 130 and 240: completed at the first poll after 240
    assert node.completed_at == 240 and done == drain.Drained(waited_s=140, running=0, timed_out=False)


def test_an_idle_node_still_waits_for_the_routers_to_drop_it():
    node = FakeNode(hook_after=0, stream_ends=[])
    drain.watch(node, timeout_s=900, settle_s=20)
    assert node.completed_at == 20  # a router may still send a turn until its next discovery refresh


def test_the_drain_is_bounded():
    node = FakeNode(hook_after=0, stream_ends=[5000])
    done = drain.watch(node, timeout_s=300, settle_s=20, poll_s=7)
    assert node.completed_at == 300 and done.timed_out and done.running == 1


def test_a_node_whose_engines_are_gone_completes_after_settling():
    node = FakeNode(hook_after=0, stream_ends=[5000], engine_gone_at=0)
    drain.watch(node, timeout_s=300, settle_s=20)
    assert node.completed_at == 20


def test_running_requests_sums_every_label_set():
    text = ('# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_running_total 9\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n')
    assert drain.running_requests(text) == 3


def test_the_cli_completes_the_hook_of_its_group_once_the_engines_are_idle(monkeypatch):
    """`turnkv engine drain` (what turnkv-drain.service runs) against fake instance metadata, engine metrics and
    Auto Scaling: it completes the drain hook's action for this instance in its group."""
    import io
    import time
    import urllib.request

    import boto3
    from typer.testing import CliRunner

    from turnkv.cli import app
    from turnkv.node_env import DRAIN_HOOK

    asked: list[str] = []

    def urlopen(request, timeout=None):
        url = request if isinstance(request, str) else request.full_url
        asked.append(url)
        answers = {"/latest/api/token": "tok", "/meta-data/instance-id": "i-0abc",
                   "/meta-data/autoscaling/target-lifecycle-state": drain.TERMINATING,
                   ":8000/metrics": 'vllm:num_requests_running{engine="0"} 0.0\n',
                   ":8001/metrics": 'vllm:num_requests_running{engine="0"} 0.0\n'}
        return io.BytesIO(next(v for k, v in answers.items() if url.endswith(k)).encode())

    class Asg:
        calls: list[dict] = []  # noqa: RUF012 (a recorder)

        def complete_lifecycle_action(self, **kw):
            Asg.calls.append(kw)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(boto3, "client", lambda service, **kw: Asg() if service == "autoscaling" else None)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    monkeypatch.delenv("TURNKV_DEPLOYMENT", raising=False)
    done = CliRunner().invoke(app, ["engine", "drain", "--group", "turnkv-prod-decode", "--region", "us-east-2",
                                    "--timeout", "30", "--engines", "2"])
    assert done.exit_code == 0, done.output
    assert Asg.calls == [{"LifecycleHookName": DRAIN_HOOK, "AutoScalingGroupName": "turnkv-prod-decode",
                          "InstanceId": "i-0abc", "LifecycleActionResult": "CONTINUE"}]
    assert any(u.endswith(":8001/metrics") for u in asked)  # both engines' ports
    assert "drained i-0abc" in done.output
