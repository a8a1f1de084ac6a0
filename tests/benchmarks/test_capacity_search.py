"""The capacity search on synthetic "does it fit" predicates: exact answers, few probes, deadlines, resumption."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.search import Probe, SearchState, next_seq, predict, run_search

STEP = 2048
MAX_SEQ = 131072
GB = 1e9


def linear(static: float, per_token: float, cap: float, overhead: float = 1.0, seconds_per_token: float = 1e-4):
    """A probe whose peak is ``static + per_token * seq``; it fits when ``peak * overhead <= cap``.

    ``overhead`` > 1 models fragmentation the reported peak does not show (the line then predicts too long).
    """

    def probe(seq: int) -> Probe:
        peak = static + per_token * seq
        fits = peak * overhead <= cap
        return Probe(seq, fits, peak_bytes=peak if fits else None, wall_s=seconds_per_token * seq)

    return probe


def true_longest(static: float, per_token: float, cap: float, overhead: float = 1.0) -> int:
    return max(0, min(MAX_SEQ, math.floor((cap / overhead - static) / per_token / STEP) * STEP))


def check_consistent(state: SearchState) -> None:
    """Every fit is at or below the answer, every failure above it, and nothing was probed twice."""
    assert all(p.seq <= state.longest for p in state.probes if p.fits)
    if state.first_fail is not None:
        assert all(p.seq >= state.first_fail for p in state.probes if not p.fits)
    seqs = [p.seq for p in state.probes]
    assert len(seqs) == len(set(seqs)), seqs
    assert all(p.seq % STEP == 0 and STEP <= p.seq <= MAX_SEQ for p in state.probes)


@pytest.mark.parametrize(
    ("static", "per_token", "cap"),
    [
        (3 * GB, 1.3e6, 25.7 * GB),  # small-vocab model without checkpointing at a 24 GiB cap: ~17k tokens
        (10 * GB, 2.9e6, 25.7 * GB),  # Llama-1B full fine-tuning: logits dominate, ~5k tokens
        (3 * GB, 0.25e6, 25.7 * GB),  # ~90k tokens
        (12 * GB, 0.9e6, 85.9 * GB),  # ~80k tokens at 80 GiB
    ],
)
def test_linear_memory_is_found_exactly_in_a_few_probes(static: float, per_token: float, cap: float) -> None:
    state = run_search(linear(static, per_token, cap), SearchState(STEP, MAX_SEQ), STEP, cap, baseline_bytes=1 * GB)
    expected = true_longest(static, per_token, cap)
    assert state.longest == expected
    assert state.first_fail == expected + STEP and state.complete and state.upper == expected
    assert not state.capped and state.stopped is None
    # The line through two fits predicts the edge: far fewer probes than doubling and bisecting (~12).
    assert len(state.probes) <= 5, [(p.seq, p.fits) for p in state.probes]
    check_consistent(state)


def test_a_prediction_that_is_too_long_is_walked_back() -> None:
    # 6% more memory than the peaks show: every prediction is ~6% too long and fails.
    probe = linear(3 * GB, 0.25e6, 25.7 * GB, overhead=1.06)
    state = run_search(probe, SearchState(STEP, MAX_SEQ), STEP, 25.7 * GB, baseline_bytes=1 * GB)
    expected = true_longest(3 * GB, 0.25e6, 25.7 * GB, overhead=1.06)
    assert state.longest == expected and state.first_fail == expected + STEP
    assert len(state.probes) <= 9, [(p.seq, p.fits) for p in state.probes]
    check_consistent(state)


@pytest.mark.parametrize("overhead", [0.8, 0.9, 0.95])
def test_a_prediction_that_is_too_short_does_not_crawl(overhead: float) -> None:
    # The peaks overstate what the cap needs (memory the allocator could have reused): predictions land short of
    # the edge, and stepping up one step at a time from there would take ~10-20 probes.
    probe = linear(3 * GB, 0.25e6, 25.7 * GB, overhead=overhead)
    state = run_search(probe, SearchState(STEP, MAX_SEQ), STEP, 25.7 * GB, baseline_bytes=1 * GB)
    expected = true_longest(3 * GB, 0.25e6, 25.7 * GB, overhead=overhead)
    assert state.longest == expected and state.first_fail == expected + STEP
    assert len(state.probes) <= 9, [(p.seq, p.fits) for p in state.probes]
    check_consistent(state)


@pytest.mark.parametrize("limit", [2048, 10000, 50000, 100352])
def test_without_peaks_it_doubles_then_bisects(limit: int) -> None:
    state = run_search(lambda seq: Probe(seq, seq <= limit), SearchState(STEP, MAX_SEQ), STEP)
    expected = limit // STEP * STEP
    assert (state.longest, state.first_fail) == (expected, expected + STEP)
    first_failure = next(i for i, p in enumerate(state.probes) if not p.fits)
    growth = [p.seq for p in state.probes[: first_failure + 1]]
    assert growth == [min(MAX_SEQ, STEP * 2**i) for i in range(len(growth))]  # doubling until the first failure
    assert len(state.probes) <= 2 * math.log2(MAX_SEQ / STEP) + 2
    check_consistent(state)


def test_nothing_fits() -> None:
    state = run_search(lambda seq: Probe(seq, False), SearchState(STEP, MAX_SEQ), STEP)
    assert [p.seq for p in state.probes] == [STEP]
    assert state.longest == 0 and state.first_fail == STEP and state.complete and state.upper == 0


def test_everything_fits_up_to_the_maximum() -> None:
    state = run_search(linear(1 * GB, 1e3, 80 * GB), SearchState(STEP, MAX_SEQ), STEP, 80 * GB, 1 * GB)
    assert state.longest == MAX_SEQ and state.capped and state.complete
    assert state.upper is None  # the true capacity is unknown above the maximum
    assert len(state.probes) <= 3


def test_the_start_hint_is_the_first_probe_and_rounded_to_the_step() -> None:
    state = SearchState(STEP, MAX_SEQ)
    assert next_seq(state, start=41000) == 40960
    assert next_seq(state, start=10**9) == MAX_SEQ
    state = run_search(lambda seq: Probe(seq, seq <= 50000), state, start=40960)
    assert state.probes[0].seq == 40960 and state.longest == 49152


def test_prediction_from_one_fit_and_the_baseline_errs_short() -> None:
    state = SearchState(STEP, MAX_SEQ)
    state.record(Probe(4096, True, peak_bytes=5 * GB))
    # The line through (0, 1 GB) and (4096, 5 GB) reaches 21 GB at 20480 tokens.
    assert predict(state, 21 * GB, 1 * GB) == 20480
    assert predict(state, 21 * GB, None) is None  # one point and no baseline: no line
    assert predict(state, None, 1 * GB) is None  # no cap: nothing to predict
    state.record(Probe(8192, True, peak_bytes=6 * GB))  # two points: slope 1 GB per 4096 tokens
    assert predict(state, 21 * GB, 1 * GB) == 8192 + 15 * 4096
    state.record(Probe(12288, True, peak_bytes=6 * GB))  # flat: no prediction
    assert predict(state, 21 * GB, 1 * GB) is None


def test_deadline_shortens_long_probes_then_stops() -> None:
    clock = {"now": 0.0}
    limit = 120000

    def probe(seq: int) -> Probe:
        seconds = 1e-8 * seq**2  # attention-bound: quadratic in the sequence
        clock["now"] += seconds
        return Probe(seq, seq <= limit, wall_s=seconds)

    budget = 150.0
    seen: list[tuple[int, float]] = []

    def time_left() -> float:
        return budget - clock["now"]

    def on_probe(state: SearchState) -> None:
        seen.append((state.probes[-1].seq, state.probes[-1].wall_s))

    state = run_search(probe, SearchState(STEP, MAX_SEQ), STEP, time_left=time_left, on_probe=on_probe)
    assert state.stopped == "deadline" and not state.complete
    # 2048 ... 65536 by doubling take 57 s; 131072 would take 172 s (the estimate: 43 s x 2^2) against 93 s left,
    # so the probe is shortened to what the time allows: 65536 x sqrt(93 / 43) -> 96256 (93 s). Then nothing is
    # left for even one more step.
    assert [p.seq for p in state.probes] == [2048, 4096, 8192, 16384, 32768, 65536, 96256]
    assert clock["now"] <= budget  # no probe was started that the estimate said would overrun
    assert state.longest == 96256
    assert len(seen) == len(state.probes)


def test_a_stopped_search_resumes_from_its_saved_state() -> None:
    probe = linear(3 * GB, 0.25e6, 25.7 * GB)
    whole = run_search(probe, SearchState(STEP, MAX_SEQ), STEP, 25.7 * GB, 1 * GB)
    first = run_search(probe, SearchState(STEP, MAX_SEQ), STEP, 25.7 * GB, 1 * GB, max_probes=2)
    assert first.stopped == "max probes" and len(first.probes) == 2 and not first.complete
    saved = json.loads(json.dumps(first.as_dict()))  # what a worker writes before its process is replaced
    assert saved["complete"] is False and saved["longest"] == first.longest
    resumed = run_search(probe, SearchState.from_dict(saved), STEP, 25.7 * GB, 1 * GB)
    assert (resumed.longest, resumed.first_fail) == (whole.longest, whole.first_fail)
    assert [p.seq for p in resumed.probes] == [p.seq for p in whole.probes]


def test_a_non_monotone_predicate_cannot_loop_forever() -> None:
    state = run_search(lambda seq: Probe(seq, (seq // STEP) % 2 == 1), SearchState(STEP, MAX_SEQ), STEP, max_probes=10)
    assert len(state.probes) <= 10
    assert state.complete or state.stopped == "max probes"


def test_bounds_of_a_state() -> None:
    state = SearchState(STEP, MAX_SEQ)
    state.record(Probe(8192, True))
    assert state.upper is None and not state.complete  # nothing failed yet: unbounded
    state.record(Probe(16384, False))
    assert state.upper == 14336 and not state.complete
    state.record(Probe(10240, True))
    state.record(Probe(12288, False))
    assert (state.longest, state.first_fail, state.upper, state.complete) == (10240, 12288, 10240, True)
    assert state.best_probe().seq == 10240
