"""The capacity search: the longest sequence (a multiple of ``step``) that trains, with few probes. No torch here.

A probe trains a few steps at one sequence length and says whether it fitted and, when it did, its peak memory.
Fitting is monotone in the sequence length, so the search keeps a bracket: ``longest`` (the largest length that
fitted, 0 for none yet) and ``first_fail`` (the smallest that did not, ``None`` for none yet), and ends when they
are one step apart or ``longest`` reached ``max_seq``.

Peak memory grows about linearly with the sequence (activations, logits and flash attention are all linear in it),
so after a fitting probe the line through the two longest fitting probes (or, after the first, through the memory
held before any probe and that probe) predicts the length at which the peak meets the cap, and the search jumps
there: typically 3-5 probes, against ~2 log2(max_seq / step) for doubling and bisection. The prediction is
safeguarded: once a failure brackets the answer, a prediction below a length that fitted, or two probes that did
not halve the bracket, switch to bisection, so the worst case stays logarithmic. Without peaks (no CUDA) the
search doubles, then bisects.

Long probes are expensive (attention is quadratic in the sequence), so before each probe its duration is estimated
from the longest fitting probe (time x (seq ratio)^2, an upper bound for a step of linear plus quadratic cost);
the candidate is shortened to what the remaining time allows, and the search stops with ``stopped="deadline"``
when even the next step up does not fit in it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Probe:
    """One training run at one sequence length.

    Attributes:
        seq: tokens in the (single) sequence.
        fits: the steps ran without running out of memory.
        peak_bytes: peak device memory the cap applies to (reserved), ``None`` where unknown (CPU, or no fit).
        peak_alloc_bytes: peak allocated device memory (``None`` where unknown).
        step_s: median time of the steps after the first (``None`` without a fit).
        wall_s: seconds the probe took, set-up and failure included.
        note: why it did not fit, or anything else worth keeping.
        plan: what a memory-budget planner chose at this length (``None``: no planner, or no plan yet).
    """

    seq: int
    fits: bool
    peak_bytes: float | None = None
    peak_alloc_bytes: float | None = None
    step_s: float | None = None
    wall_s: float = 0.0
    note: str = ""
    plan: dict[str, Any] | None = None


@dataclass
class SearchState:
    """The bracket and every probe so far; serialisable, so a restarted process continues where one stopped.

    Attributes:
        step: the sequence grows in multiples of this.
        max_seq: the longest sequence tried; reaching it ends the search (``capped``).
        longest: the largest sequence that fitted (0: none yet).
        first_fail: the smallest sequence above ``longest`` that did not fit (``None``: none yet).
        probes: every probe, in order.
        stopped: why the search ended early (``"deadline"``, ``"max probes"``), ``None`` otherwise.
    """

    step: int
    max_seq: int
    longest: int = 0
    first_fail: int | None = None
    probes: list[Probe] = field(default_factory=list)
    stopped: str | None = None

    @property
    def capped(self) -> bool:
        """``longest`` reached ``max_seq``: the true capacity is at least that, unknown above."""
        return self.longest >= self.max_seq

    @property
    def complete(self) -> bool:
        """The answer is exact (within one step), or bounded below by ``max_seq``."""
        return self.capped or (self.first_fail is not None and self.first_fail - self.longest <= self.step)

    @property
    def upper(self) -> int | None:
        """The most the true longest can be (``None``: unbounded, i.e. capped or no failure seen yet)."""
        if self.capped or self.first_fail is None:
            return None
        return self.first_fail - self.step

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)
        if probe.fits:
            self.longest = max(self.longest, probe.seq)
            if self.first_fail is not None and self.first_fail <= self.longest:
                # Not monotone after all (noise at the edge): trust the longer fit, forget the failure.
                self.first_fail = None
        elif probe.seq > self.longest:
            self.first_fail = probe.seq if self.first_fail is None else min(self.first_fail, probe.seq)

    def best_probe(self) -> Probe | None:
        """The fitting probe at ``longest`` (the latest, if several)."""
        fits = [p for p in self.probes if p.fits and p.seq == self.longest]
        return fits[-1] if fits else None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(capped=self.capped, complete=self.complete, upper=self.upper)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchState:
        state = cls(step=data["step"], max_seq=data["max_seq"])
        for probe in data.get("probes", []):
            state.record(Probe(**probe))
        state.stopped = data.get("stopped")
        return state


def _floor_to(value: float, step: int) -> int:
    return math.floor(value / step) * step


def predict(state: SearchState, cap_bytes: float | None, baseline_bytes: float | None) -> int | None:
    """The longest multiple of ``step`` whose peak the line through the known peaks keeps under ``cap_bytes``.

    The line goes through the two longest fitting probes with a peak, or through ``baseline_bytes`` (memory held
    before any probe: weights) at length 0 and the one such probe. With only one probe the slope is too steep
    (gradients and optimizer state count as per-token memory), so the prediction errs short, never long.

    Returns:
        ``None`` when there is nothing to fit a line to (no cap, no peaks) or the line does not rise.
    """
    if cap_bytes is None:
        return None
    points: dict[int, float] = {}
    for probe in state.probes:
        if probe.fits and probe.peak_bytes is not None:
            points[probe.seq] = probe.peak_bytes
    if not points:
        return None
    seqs = sorted(points)
    if len(seqs) >= 2:
        (s1, p1), (s2, p2) = (seqs[-2], points[seqs[-2]]), (seqs[-1], points[seqs[-1]])
    elif baseline_bytes is not None:
        (s1, p1), (s2, p2) = (0, baseline_bytes), (seqs[0], points[seqs[0]])
    else:
        return None
    slope = (p2 - p1) / (s2 - s1)
    if slope <= 0:
        return None
    return _floor_to(s2 + (cap_bytes - p2) / slope, state.step)


def estimate_seconds(state: SearchState, seq: int) -> float | None:
    """Upper estimate of a probe at ``seq`` from the longest fitting probe: its wall time x (seq ratio)^2."""
    fits = [p for p in state.probes if p.fits and p.wall_s > 0]
    if not fits:
        return None
    ref = max(fits, key=lambda p: p.seq)
    return ref.wall_s * max(1.0, seq / ref.seq) ** 2


def _longest_within(state: SearchState, seconds: float) -> int | None:
    """The longest sequence whose estimated probe time is at most ``seconds`` (``None``: no estimate)."""
    fits = [p for p in state.probes if p.fits and p.wall_s > 0]
    if not fits:
        return None
    ref = max(fits, key=lambda p: p.seq)
    if seconds <= ref.wall_s:
        return ref.seq
    return _floor_to(ref.seq * math.sqrt(seconds / ref.wall_s), state.step)


def _widths(state: SearchState) -> list[float]:
    """The bracket's width (``first_fail - longest``; ``inf`` while nothing failed) after each probe."""
    replay = SearchState(state.step, state.max_seq)
    widths = []
    for probe in state.probes:
        replay.record(probe)
        widths.append(math.inf if replay.first_fail is None else replay.first_fail - replay.longest)
    return widths


def _last_was_floor_fit(state: SearchState) -> bool:
    """The last probe fitted one step above the longest fit before it (the prediction said "no more room")."""
    if len(state.probes) < 2 or not state.probes[-1].fits:
        return False
    before = max((p.seq for p in state.probes[:-1] if p.fits), default=0)
    return state.probes[-1].seq == before + state.step


def next_seq(
    state: SearchState,
    start: int,
    cap_bytes: float | None = None,
    baseline_bytes: float | None = None,
) -> int | None:
    """The next length to probe, or ``None`` when the bracket is closed (or ``max_seq`` fitted).

    While nothing has failed: the prediction, or one step up when it says there is no more room (twice in a
    row: it is wrong, double instead), or double without one. Once a failure brackets the answer: the prediction
    clamped into the bracket, unless it is below a fit or the last two probes did not halve the bracket: then the
    bracket's midpoint.
    """
    step, lo, hi = state.step, state.longest, state.first_fail
    if state.complete:
        return None
    floor = lo + step
    ceiling = min(state.max_seq, hi - step) if hi is not None else state.max_seq

    def clamp(candidate: int) -> int:
        return min(max(candidate, floor), ceiling)

    if not state.probes:
        return clamp(_floor_to(start, step))
    guess = predict(state, cap_bytes, baseline_bytes)
    if hi is None:
        if guess is not None and guess > lo:
            return clamp(guess)
        if guess is not None and not _last_was_floor_fit(state):
            return floor
        return clamp(2 * lo)
    widths = _widths(state)
    mid = lo + _floor_to((hi - lo) / 2, step)
    # A prediction at or below a length that fitted is proven short; one that did not halve the bracket over the
    # last two probes is not converging: bisect instead.
    if guess is None or guess <= lo or (len(widths) >= 3 and widths[-1] > widths[-3] / 2):
        return clamp(mid)
    return clamp(guess)


def run_search(
    probe: Callable[[int], Probe],
    state: SearchState,
    start: int,
    cap_bytes: float | None = None,
    baseline_bytes: float | None = None,
    time_left: Callable[[], float] = lambda: math.inf,
    max_probes: int = 24,
    on_probe: Callable[[SearchState], None] | None = None,
) -> SearchState:
    """Probe until the bracket closes, ``max_seq`` fits, the time runs out or ``max_probes`` were made.

    Args:
        probe: trains at one length and reports (see :class:`Probe`).
        state: the bracket to continue (a fresh one, or one a previous process left).
        start: the first length to probe when ``state`` has no probe yet.
        cap_bytes: the memory cap the peaks are compared with (``None``: no prediction).
        baseline_bytes: memory held before any probe (the model), the line's anchor after the first probe.
        time_left: seconds left for probing; a probe estimated to take longer is shortened or not made.
        max_probes: a safety net against a non-monotone predicate.
        on_probe: called after every probe (the caller saves the state).

    Returns:
        ``state``, updated.
    """
    state.stopped = None
    while True:
        seq = next_seq(state, start, cap_bytes, baseline_bytes)
        if seq is None:
            return state
        if len(state.probes) >= max_probes:
            state.stopped = "max probes"
            return state
        left = time_left()
        estimate = estimate_seconds(state, seq)
        if estimate is not None and estimate > left:
            affordable = _longest_within(state, left)
            if affordable is None or affordable <= state.longest:
                state.stopped = "deadline"
                return state
            seq = affordable
        elif left <= 0:
            state.stopped = "deadline"
            return state
        state.record(probe(seq))
        if on_probe is not None:
            on_probe(state)
