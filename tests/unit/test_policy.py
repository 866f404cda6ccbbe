from connector.policy import CostModel, Load, StepClock


def learned(compute_per_token: float = 0.0004, transfer_per_token: float = 8e-6, step_overhead: float = 0.02,
            transfer_overhead: float = 0.002) -> CostModel:
    m = CostModel(probe_every=3)
    for _ in range(20):
        for tokens in (100, 1000, 3000):
            m.observe_step(step_overhead + compute_per_token * tokens, tokens)
            m.observe_transfer(transfer_overhead + transfer_per_token * tokens, tokens)
    return m


def test_floor_and_no_estimate():
    m = CostModel()
    assert m.decide(10, floor=64).reason == "floor" and not m.decide(10, floor=64).pull
    d = m.decide(1000, floor=64)
    assert d.pull and d.reason == "no-estimate"


def test_pulls_when_the_transfer_beats_compute_and_not_otherwise():
    m = learned()
    d = m.decide(2000, floor=64)
    assert d.pull and d.reason == "faster" and d.predicted_pull_s < d.predicted_compute_s
    assert abs(d.predicted_compute_s - 0.8) < 1e-6 and abs(d.predicted_pull_s - 0.018) < 1e-6
    slow = learned(compute_per_token=0.0001, transfer_per_token=0.0005)  # a congested link
    decisions = [slow.decide(2000, floor=64) for _ in range(3)]
    assert [d.reason for d in decisions] == ["slower", "slower", "probe"]
    assert [d.pull for d in decisions] == [False, False, True]


def test_compute_is_the_marginal_cost_of_a_token_not_the_step_average():
    # Steps cost 50 ms whatever they hold, plus 0.4 ms per token. Averaging 100-token steps would say 0.9 ms.
    m = learned(compute_per_token=0.0004, step_overhead=0.05)
    assert abs(m.compute_per_token - 0.0004) < 1e-9 and abs(m.step_overhead - 0.05) < 1e-9
    m.observe_step(0.0, 0)  # an empty step (waiting for KV only) is no sample
    assert abs(m.compute_per_token - 0.0004) < 1e-9


def test_a_busy_engine_pulls_what_an_idle_engine_recomputes():
    # A slow link: pulling 2,000 tokens takes 1.0 s, recomputing them 0.8 s of engine time.
    m = learned(compute_per_token=0.0004, transfer_per_token=0.0005, transfer_overhead=0.0)
    idle = m.decide(2000, floor=64, load=Load())
    assert not idle.pull and idle.reason == "slower" and idle.queue_delay_s == 0
    # Three other requests wait for prefill: recomputing would delay each of them by 0.8 s as well.
    busy = m.decide(2000, floor=64, load=Load(requests=3, tokens=6000))
    assert busy.pull and busy.reason == "load"
    assert abs(busy.queue_delay_s - 2.4) < 1e-6 and busy.load.requests == 3
    # The floor holds whatever the load.
    assert m.decide(40, floor=64, load=Load(requests=50, tokens=90_000)).reason == "floor"


def test_the_handshake_counts_only_for_an_engine_not_handshaken_yet():
    m = learned()
    m.observe_handshake(0.5)
    known, new = m.predicted_pull(2000), m.predicted_pull(2000, new_engine=True)
    assert abs(new - known - 0.5) < 1e-9
    assert m.decide(2000, floor=64, new_engine=True).reason == "faster"  # 0.52 s < 0.8 s
    assert m.decide(500, floor=64, new_engine=True).reason == "slower"  # 0.506 s > 0.2 s


def test_fixed_overhead_is_learned_from_transfers_of_different_sizes():
    m = CostModel()
    for _ in range(40):
        m.observe_transfer(0.010 + 1e-6 * 500, 500)
        m.observe_transfer(0.010 + 1e-6 * 5000, 5000)
    assert abs(m.pull_overhead - 0.010) < 1e-6 and abs(m.pull_per_token - 1e-6) < 1e-9
    assert m.predicted_pull(100) < m.predicted_pull(10000)


def test_noisy_transfers_never_fit_a_free_per_token_cost():
    m = CostModel()
    m.observe_transfer(0.020, 500)  # the small pull happened to be slower than the big one
    m.observe_transfer(0.015, 5000)
    assert m.pull_overhead == 0.0 and m.pull_per_token > 0
    assert m.predicted_pull(10000) > m.predicted_pull(100)


def test_the_wait_for_the_engine_is_kept_apart_from_the_transfer():
    m = learned()
    before = m.predicted_pull(2000)
    m.observe_wait(2.5)  # a pulled request waited 2.5 s for busy steps
    assert m.wait.value == 2.5 and m.predicted_pull(2000) == before


def test_step_clock_with_overlapping_steps():
    clock = StepClock()
    # async scheduling: step 2 is scheduled before step 1's output is processed
    clock.scheduled(1, 2000, now=0.00)
    clock.scheduled(2, 500, now=0.01)
    assert clock.in_flight == 2
    assert clock.finished(1, now=1.00) == (1.0, 2000)
    busy, tokens = clock.finished(2, now=1.25)  # step 2 ran only once step 1 was done
    assert tokens == 500 and abs(busy - 0.25) < 1e-9
    # synchronous: scheduled after the previous one finished
    clock.scheduled(3, 100, now=2.0)
    busy, tokens = clock.finished(3, now=2.1)
    assert tokens == 100 and abs(busy - 0.1) < 1e-9
    # a step whose output never came back is dropped when a later one finishes
    clock.scheduled(4, 100, now=3.0)
    clock.scheduled(5, 200, now=3.1)
    busy, tokens = clock.finished(5, now=3.3)
    assert tokens == 200 and abs(busy - 0.2) < 1e-9 and clock.in_flight == 0
    assert clock.finished(4, now=3.4) is None


def test_steps_of_one_size_give_the_average_rate_not_a_noisy_slope():
    m = CostModel()
    # a saturated engine: every step near its 2,048-token budget, times noisy
    for i in range(30):
        tokens = 2048 - (i % 3) * 40
        m.observe_step(1.0 + 0.3 * ((i * 7) % 5) / 4, tokens)
    rate = m.steps.sy / m.steps.sx
    assert m.step_overhead == 0.0 and abs(m.compute_per_token - rate) < 1e-12


def test_one_stalled_read_does_not_turn_pulls_off():
    # bench.pull_cost, before TRANSFER_CLIP: READs of ~2 MiB at 0.5-13 ms, then one at 179 ms (a busy host), and the
    # next turns were all recomputed (no pull, so no sample to undo it).
    m = CostModel(probe_every=20)
    for _ in range(20):
        m.observe_step(0.030 + 0.00026 * 70, 70)
        m.observe_step(0.030 + 0.00026 * 290, 290)
    for seconds, tokens in ((0.0128, 224), (0.0029, 181), (0.0043, 265), (0.0005, 222), (0.0006, 224),
                            (0.0005, 181)):
        m.observe_transfer(seconds, tokens)
    m.observe_transfer(0.179, 265)
    assert all(m.decide(t, floor=64).pull for t in (181, 224, 265))


def test_a_lasting_slowdown_is_still_learned_within_a_few_reads():
    m = learned(compute_per_token=0.0004, transfer_per_token=8e-6, transfer_overhead=0.002)
    assert m.decide(2000, floor=64).pull
    m.observe_transfer(1.6, 2000)  # one stalled READ: held back
    assert m.predicted_pull(2000) < 0.02 and m.decide(2000, floor=64).pull
    m.observe_transfer(0.019, 2000)  # the next one was normal: the outlier is dropped
    assert m.predicted_pull(2000) < 0.02
    for _ in range(2):  # the link got 90 times slower for good: 1.6 s per 2,000 tokens against 0.8 s of compute
        m.observe_transfer(1.6, 2000)
    assert m.predicted_pull(2000) > 0.3  # learned from the second slow READ on
    for _ in range(4):
        m.observe_transfer(1.6, 2000)
    assert m.predicted_pull(2000) > 0.8 and m.decide(2000, floor=64).reason == "slower"
