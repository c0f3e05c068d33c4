"""Timing and the numbers derived from it (tok/s, ms per token, bandwidth use, forward-cost ratios, cycle
stats), against a scripted clock: time moves only when the target runs a forward, by a cost chosen here, so every
derived number has a value worked out by hand."""
from __future__ import annotations

import time

import pytest
import torch

from engine import bench, timing
from engine.bench import BenchConfig, run_bench
from engine.errors import EngineError
from engine.runtime import Engine
from engine.timing import cycle_stats, time_fn, use_clock

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


class ForwardClock:
    """Seconds that advance by 1 ms + 0.5 ms per token of every forward of the hooked model: a decode step (one
    token) costs 1.5 ms, a forward of 8 tokens 5 ms."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1e3

    def hook(self, module, args) -> None:
        self.advance(1.0 + 0.5 * args[0].shape[1])


@pytest.fixture
def clocked():
    """A tiny random Engine whose target's forwards drive a ForwardClock, the clock every measurement reads."""
    eng = Engine.load(shape="tiny", max_seq_len=64)
    fake = ForwardClock()
    handle = eng.model.register_forward_pre_hook(fake.hook)
    with use_clock(fake):
        yield eng, fake
    handle.remove()


def test_time_fn_is_the_median_of_the_timed_calls():
    fake = ForwardClock()
    durations = iter([50.0, 50.0, 1.0, 5.0, 2.0, 9.0, 3.0])  # two warm-up calls (not timed), then five

    with use_clock(fake):
        s = time_fn(lambda: fake.advance(next(durations)), CPU, iters=5, warmup=2)
    assert s == pytest.approx(3e-3)  # median of 1, 5, 2, 9, 3 ms
    assert timing.clock(CPU) is time.process_time  # the device's clock again after the block


def test_generation_times_come_from_the_clock(clocked):
    eng, _ = clocked
    r = eng.generate([5, 9, 200, 31, 7], 6)
    assert r.prefill_s == pytest.approx(3.5e-3)  # one forward of the 5 prompt tokens: 1 + 2.5 ms
    assert r.decode_s == pytest.approx(7.5e-3)  # 5 decode steps after the prefill's token, 1.5 ms each
    assert r.tok_s == pytest.approx(5 / 7.5e-3)  # 666.7 tok/s
    assert r.ms_per_token == pytest.approx(1.5)
    assert r.accept_length == 1.0  # the baseline: one token per cycle


def test_cycle_stats_of_the_baseline(clocked):
    eng, _ = clocked
    s = cycle_stats(eng.decoder, [[1, 2, 3], [4, 5, 6, 7]], new_tokens=6, repeats=3)
    assert s.samples == pytest.approx([1000 / 1.5] * 3) and s.tok_s == pytest.approx(1000 / 1.5)
    assert s.ms_per_cycle == pytest.approx(1.5) and s.accept_length == 1.0
    assert (s.draft_ms, s.verify_ms, s.other_ms) == pytest.approx((0.0, 1.5, 0.0))  # the whole step is the forward


def test_bench_numbers_derive_from_the_measured_times(clocked, monkeypatch):
    eng, _ = clocked
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 40.0)  # GB/s: its own timing is not a forward
    monkeypatch.setattr(bench, "peer_tok_s", lambda *a: 400.0)  # transformers' model is not the hooked one
    r = run_bench(eng, BenchConfig(prompt_len=8, new_tokens=8, repeats=2, sizes=(1, 8), torch_profile=True))
    assert not r.graphs and set(r.decode) == {"graph", "eager"} and set(r.forward_ms) == {"eager"}
    for d in r.decode.values():  # 7 decode steps of 1.5 ms each, both repeats
        assert d.samples == pytest.approx([1000 / 1.5] * 2) and d.tok_s == pytest.approx(666.667, abs=1e-3)
        assert d.ms_per_token == pytest.approx(1.5)
        # the weights are read once per 1.5 ms step, against 40 GB/s
        assert d.bw_util == pytest.approx(r.weight_bytes / 1.5e-3 / 40e9)
    assert r.forward_ms["eager"] == pytest.approx({1: 1.5, 8: 5.0})
    assert r.t8_over_t1 == pytest.approx(5.0 / 1.5)
    assert r.peer_ratio == pytest.approx(666.667 / 400, abs=1e-5)
    assert r.to_dict()["t8_over_t1"] == pytest.approx(10 / 3) and r.to_dict()["peer_ratio"] == pytest.approx(5 / 3)
    # the profile reads torch's profiler, not the clock
    assert r.step_ms["matrix"] > 0 and r.step_ms["attention"] > 0 and r.step_ms["kernels"] > 0
    assert "aten::mm" in r.profile_table
    with pytest.raises(EngineError, match="max-seq-len"):
        run_bench(eng, BenchConfig(prompt_len=60, new_tokens=8, peer=False))


def test_bench_says_where_its_wall_time_went(clocked, monkeypatch, capsys):
    eng, _ = clocked
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 40.0)
    r = run_bench(eng, BenchConfig(prompt_len=8, new_tokens=8, repeats=2, sizes=(1, 8), eager_tokens=4, peer=False))
    # a generation of n tokens: the prompt's forward (8 tokens, 5 ms), then n - 1 steps of 1.5 ms
    # graph decode: a warm-up and two timed generations of 8; eager: of 4; forward costs: time_fn's two warm-up and
    # timed calls per size, T=1 and T=8 (the gemv floor is not a forward of the model)
    assert list(r.wall_s) == ["graph decode", "eager decode", "forward costs"]
    assert r.wall_s["graph decode"] == pytest.approx(3 * (5 + 7 * 1.5) / 1e3)
    assert r.wall_s["eager decode"] == pytest.approx(3 * (5 + 3 * 1.5) / 1e3)
    err = capsys.readouterr().err
    assert f"bench {r.model}: graph decode in 0.0 s" in err and "forward costs in" in err
    assert "wall time: graph decode 0.0 s, eager decode 0.0 s, forward costs" in bench.format_bench(r)


def test_bench_floors_take_time_on_the_real_clock():
    eng = Engine.load(shape="tiny", max_seq_len=64)
    assert bench.gemv_floor_ms(eng.model) > 0 and bench.copy_bandwidth(CPU) > 0


class PacedDecoder:
    """A stand-in decoder whose passes cost `work` seconds a token times the machine's pace, which doubles after
    every `per_pace` passes of all decoders (a machine slowing down between rounds); it logs its name per pass."""

    def __init__(self, name: str, work: float, machine: dict):
        self.name, self.work, self.machine = name, work, machine

    def generate(self, prompt, n, sampling=None, seed=0, timed_phases=False):
        from types import SimpleNamespace
        m = self.machine
        if n > 8 and not timed_phases and prompt == m["first"]:  # a pass starts with the first prompt
            m["log"].append(self.name)
        pace = 2.0 ** (max(len(m["log"]) - 1, 0) // m["per_pace"])
        s = n * self.work * pace
        return SimpleNamespace(decode_tokens=n, decode_s=s, verify_cycles=n, token_ids=[0] * n,
                               draft_s=0.0, verify_s=s, other_s=0.0)


def test_interleaved_rounds_pair_their_passes():
    """Rounds rotate the decoders' order, and each round's passes share the machine's pace: the ratio taken round by
    round is the work's ratio, however the pace moved between rounds."""
    prompts = [[1, 2], [3]]
    machine = {"log": [], "per_pace": 2, "first": prompts[0]}
    decs = {"base": PacedDecoder("base", 2e-3, machine), "spec": PacedDecoder("spec", 1e-3, machine)}
    st = timing.interleaved_cycle_stats(decs, prompts, 16, repeats=3)
    assert machine["log"] == ["base", "spec", "spec", "base", "base", "spec"]
    assert st["base"].samples == pytest.approx([500.0, 250.0, 125.0])  # the pace did move between rounds
    assert timing.paired_ratios(st["spec"], st["base"]) == pytest.approx([2.0, 2.0, 2.0])
    # measured one decoder after the other (cycle_stats of each), the same machine gives another ratio
    machine.update(log=[])
    one_by_one = {n: cycle_stats(d, prompts, 16, repeats=3) for n, d in decs.items()}
    assert one_by_one["spec"].tok_s / one_by_one["base"].tok_s != pytest.approx(2.0)


def test_interleaved_new_tokens_per_decoder():
    prompts = [[1]]
    machine = {"log": [], "per_pace": 10**6, "first": prompts[0]}
    decs = {"a": PacedDecoder("a", 1e-3, machine), "b": PacedDecoder("b", 1e-3, machine)}
    st = timing.interleaved_cycle_stats(decs, prompts, {"a": 32, "b": 16}, repeats=2)
    assert st["a"].ms_per_cycle == pytest.approx(1.0) and st["b"].ms_per_cycle == pytest.approx(1.0)
    assert len(st["a"].token_ids[0]) == 32 and len(st["b"].token_ids[0]) == 16
