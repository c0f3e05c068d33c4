"""The A/B harness (engine/abtest.py) and its verdict (specbook/judge.py, the paired 2-of-3 rule runbook verify
applies), on CPU with an injected clock: time moves only when a callable 'runs', by the cost the test gives it. A
planted slowdown of B must be caught, an equal pair and a noisy but equal pair must not be flagged, and the order of
A and B alternates round by round. scripts/gpu_bench.judged turns the verdict into the scripts' exit code."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine.abtest import ab, interleave
from engine.errors import EngineError
from engine.timing import use_clock
from specbook import judge

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


class Clock:
    """Seconds that move only when a sample 'runs'."""

    def __init__(self) -> None:
        self.t, self.log = 100.0, []

    def __call__(self) -> float:
        return self.t

    def work(self, name: str, seconds: float):
        def run() -> None:
            self.log.append(name)
            self.t += seconds
        return run


def gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "scripts" / "gpu_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(cost_a, cost_b, rounds: int = 3):
    """A and B whose n-th call (counting warm-ups) takes cost_x(n) seconds, sampled as the scripts do."""
    clock, calls = Clock(), {"A": 0, "B": 0}

    def side(name, cost):
        def run() -> None:
            clock.log.append(name)
            clock.t += cost(calls[name])
            calls[name] += 1
        return run

    with use_clock(clock):
        samples = ab(side("A", cost_a), side("B", cost_b), CPU, rounds=rounds)
    return samples, clock.log


def test_a_planted_slowdown_of_b_is_caught():
    samples, _ = measure(lambda n: 0.010, lambda n: 0.013)
    assert samples.pair_ratios() == pytest.approx([1.3] * 3)
    assert judge.ab_verdict(samples.pair_ratios(), "lower", 0.02) == "slower"
    out, code = gpu_bench().judged(samples, 0.02, "not-slower")
    assert (out["verdict"], code) == ("slower", 1)
    assert gpu_bench().judged(samples, 0.5, "not-slower")[1] == 0  # within a wide enough tolerance: the same


def test_a_faster_b_is_faster_and_passes_not_slower():
    samples, _ = measure(lambda n: 0.010, lambda n: 0.008)
    out, code = gpu_bench().judged(samples, 0.02, "not-slower")
    assert (out["verdict"], code) == ("faster", 0)
    assert gpu_bench().judged(samples, 0.02, "same")[1] == 1


def test_an_equal_pair_is_the_same():
    samples, _ = measure(lambda n: 0.010, lambda n: 0.010)
    out, code = gpu_bench().judged(samples, 0.02, "not-slower")
    assert (out["verdict"], code) == ("same", 0) and out["pair_ratios"] == pytest.approx([1.0] * 3)


def test_a_noisy_but_equal_pair_is_not_slower():
    """Each call off by up to 4% either way, both sides alike on average: a pair's median ratio stays inside a 2%
    tolerance, where single rounds would not."""
    noise = [1.04, 0.97, 1.0, 0.96, 1.03, 1.01, 0.98, 1.02, 0.99, 1.0]
    samples, _ = measure(lambda n: 0.010 * noise[n % 10], lambda n: 0.010 * noise[(n + 3) % 10])
    assert max(abs(r - 1) for r in samples.round_ratios()) > 0.02  # single rounds would have voted
    out, code = gpu_bench().judged(samples, 0.02, "not-slower")
    assert out["verdict"] in ("same", "faster") and code == 0


def test_the_order_alternates_round_by_round_after_the_warm_up():
    samples, log = measure(lambda n: 0.01, lambda n: 0.01, rounds=2)
    assert log[:2] == ["A", "B"]  # one warm-up call each
    assert log[2:] == ["A", "B", "B", "A"] * 3  # 3 pairs of 2 rounds: A B, B A, ...
    assert samples.orders == [["A", "B"], ["B", "A"]] * 3 and (samples.pairs, samples.rounds) == (3, 2)


def test_a_drift_of_the_machines_pace_hits_both_sides_alike():
    """Every call 1% slower than the one before, A and B the same work: interleaving keeps the pairs the same."""
    count = [0]

    def pace(_n):
        count[0] += 1
        return 0.010 * 1.01 ** count[0]

    samples, _ = measure(pace, pace)
    assert judge.ab_verdict(samples.pair_ratios(), "lower", 0.02) == "same"


def test_a_callable_that_times_itself_gives_its_own_seconds():
    clock = Clock()
    with use_clock(clock):
        seconds, orders = interleave({"x": lambda: 0.25, "y": clock.work("y", 2.0)}, CPU, rounds=3, warmup=0)
    assert seconds == {"x": [0.25] * 3, "y": [2.0] * 3} and orders == [["x", "y"], ["y", "x"], ["x", "y"]]


def test_bad_harness_input_is_an_engine_error():
    with pytest.raises(EngineError):
        interleave({}, CPU, 3)
    with pytest.raises(EngineError):
        ab(lambda: None, lambda: None, CPU, pairs=0)
    with use_clock(lambda: 1.0), pytest.raises(EngineError, match="took no time"):
        ab(lambda: None, lambda: None, CPU)


@pytest.mark.parametrize("ratios,direction,want", [
    ([1.0, 1.01, 0.99], "lower", "same"),
    ([1.3, 1.3, 1.0], "lower", "slower"),  # two of three outside, worse
    ([1.3, 0.7, 1.0], "lower", "flaky"),  # no two agree
    ([0.7, 0.7, 1.3], "lower", "faster"),
    ([0.7, 0.7, 0.7], "higher", "slower"),  # a rate that fell
    ([1.5, 1.5, 1.5], "none", "changed"),
])
def test_the_rule_in_words(ratios, direction, want):
    assert judge.ab_verdict(ratios, direction, 0.05) == want


def test_the_rule_takes_three_pairs_and_a_known_direction():
    with pytest.raises(ValueError, match="three pairs"):
        judge.ab_verdict([1.0, 1.0], "lower", 0.05)
    with pytest.raises(ValueError, match="direction"):
        judge.ab_verdict([1.0] * 3, "up", 0.05)


def test_runbook_verify_and_the_scripts_share_the_one_rule():
    """specbook.verify judges by specbook.judge (no copy of the rule of its own), and judge needs nothing but the
    standard library (the engine's scripts import it beside the engine)."""
    import specbook.verify as verify

    assert verify.drift is judge.drift
    source = (ROOT / "specbook" / "verify.py").read_text()
    assert "def drift" not in source and "def _majority" not in source
    imports = [line for line in (ROOT / "specbook" / "judge.py").read_text().splitlines()
               if line.startswith(("import ", "from "))]
    assert all(m.split()[1].split(".")[0] in ("__future__", "collections", "typing") for m in imports), imports
