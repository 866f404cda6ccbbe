from connector.policy import CostModel


def test_floor_and_no_estimate():
    m = CostModel()
    assert m.decide(10, floor=64).reason == "floor" and not m.decide(10, floor=64).pull
    d = m.decide(1000, floor=64)
    assert d.pull and d.reason == "no-estimate"


def test_pulls_when_the_network_beats_compute_and_not_otherwise():
    m = CostModel()
    for _ in range(10):
        m.observe_step(0.4, 1000)  # 0.4 ms per computed token
        m.observe_pull(0.003, 1000)  # 3 us per pulled token
    d = m.decide(2000, floor=64)
    assert d.pull and d.reason == "faster" and d.predicted_pull_s < d.predicted_compute_s
    slow = CostModel(probe_every=3)
    for _ in range(10):
        slow.observe_step(0.1, 1000)  # 0.1 ms per token
        slow.observe_pull(0.5, 1000)  # a congested link: 0.5 ms per token
    decisions = [slow.decide(2000, floor=64) for _ in range(3)]
    assert [d.reason for d in decisions] == ["slower", "slower", "probe"]
    assert [d.pull for d in decisions] == [False, False, True]


def test_decode_steps_do_not_count_as_prefill_speed():
    m = CostModel(min_prefill_tokens=256)
    m.observe_step(0.05, 1)  # a decode step: 50 ms for one token would say compute is very slow
    assert m.compute_per_token.value is None
    m.observe_step(0.2, 1000, pulled_in_step=True)
    assert m.compute_per_token.value is None


def test_fixed_overhead_is_learned_from_pulls_of_different_sizes():
    m = CostModel()
    for _ in range(40):
        m.observe_pull(0.010 + 1e-6 * 500, 500)
        m.observe_pull(0.010 + 1e-6 * 5000, 5000)
    assert abs(m.pull_overhead - 0.010) < 1e-6 and abs(m.pull_per_token - 1e-6) < 1e-9
    assert m.predicted_pull(100) < m.predicted_pull(10000)


def test_noisy_pulls_never_fit_a_free_per_token_cost():
    m = CostModel()
    m.observe_pull(0.020, 500)  # the small pull happened to be slower than the big one
    m.observe_pull(0.015, 5000)
    assert m.pull_overhead == 0.0 and m.pull_per_token > 0
    assert m.predicted_pull(10000) > m.predicted_pull(100)
