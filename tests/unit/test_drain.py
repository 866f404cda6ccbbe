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
