"""What offloading the first bytes of each forward does to a step's peak and time (:class:`OffloadModel`), and what a
plan's offloading costs by it. Plain numbers: bytes and milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from lightning_offload.planner.profile import FRUGAL_CAP, Plan, StepProfile, eligible_bytes

# The share of forward (and of backward) behind which copies are assumed to hide: the rest of a transfer shows as step
# time. Below 1 because copies share memory bandwidth and start only once tensors exist.
HIDDEN_SHARE = 0.8
# Copies never get less than this share of the link in the model, whatever a step waited (a host stall, say).
_LEAST_LINK_SHARE = 0.01


@dataclass(frozen=True)
class OffloadChoice:
    """Offloading ``nbytes`` of a forward: how much lower the peak gets, what it costs, the in-flight bound used.

    ``forward_relief`` is how much lower forward's own peak gets, where it differs from ``relief`` (``None``: it does
    not): copies let go of at the head lower the loss's and the blocks' backward, not a peak forward reached before.
    """

    nbytes: int
    relief: int
    cost_ms: float
    inflight_cap: int | None
    prefetch_cap: int | None = None
    forward_relief: int | None = None


class OffloadModel:
    """What offloading the first bytes of each forward does to the step's peak and time (one profile, ``eligible``
    bytes saved per forward, e.g. after checkpointing some blocks).

    The peak is at the end of forward (where the loss's transient comes on top of every kept activation) or early in
    backward. Two ways to offload:

    * *Unbounded*: copies out lag behind forward as far as they need, so forward never waits for the throttle; what the
      link has not moved by the end of forward (``HIDDEN_SHARE`` of forward's time) is still on the device then.
    * *Throttled* at ``inflight_cap``: forward waits whenever more than the cap lags behind, so only the cap is left
      at the end of forward, at the price of forward waiting for the link while it saves the offloaded bytes.

    With ``released_at_head`` (the profile knows where the head begins), the engine lets go of every copy still in
    flight when forward reaches the head, the compute stream waiting for those the link has not finished: the loss's
    and the blocks' backward hold none of them, and what forward did not hide shows as a wait instead. Without it,
    the relief is net of the bytes fetched ahead as well (one peak, which may be where prefetching runs).

    Either way, backward must bring the bytes back: what its compute cannot hide shows as time, and copies fetched
    ahead of need may be on the device at the peak (up to ``prefetch_bytes``).
    """

    def __init__(
        self, profile: StepProfile, eligible: int, frugal: int = FRUGAL_CAP, released_at_head: bool = False
    ) -> None:
        self.p = profile
        self.eligible = eligible
        self.frugal = frugal  # the in-flight and prefetch bound of the most frugal offload
        self.released_at_head = released_at_head
        self.link = max(profile.link_bytes_per_ms * profile.link_share, 1e-9)
        self.backward_ms = profile.backward_ms or 2 * profile.forward_ms
        self.hidden_out = HIDDEN_SHARE * profile.forward_ms * self.link  # bytes copied out behind forward

    def fetched_ahead(self, nbytes: int, prefetch: int | None = None) -> int:
        """Bytes fetched back ahead of need while backward has freed nothing yet: counted in full (when prefetching
        starts depends on how evenly backward walks the saved bytes, which checkpointed blocks and the loss make
        uneven, and a peak under-predicted fails under a hard cap)."""
        return min(max(0, nbytes), self.p.prefetch_bytes if prefetch is None else prefetch)

    def _way_back_ms(self, nbytes: int) -> float:
        return max(0.0, nbytes / self.link - HIDDEN_SHARE * self.backward_ms)

    def _choice(
        self, nbytes: int, lagging: int, cost_ms: float, cap: int | None, prefetch: int | None = None
    ) -> OffloadChoice:
        """``lagging``: bytes whose copies are still on their way out at the end of forward."""
        if not self.released_at_head:
            relief = nbytes - lagging - self.fetched_ahead(nbytes, prefetch)
            return OffloadChoice(nbytes, relief, cost_ms, cap, prefetch)
        # The compute stream waits at the head for the lagging copies: what the rest of forward did not hide shows.
        return OffloadChoice(nbytes, nbytes, cost_ms + lagging / self.link, cap, prefetch, nbytes - lagging)

    def unbounded(self, nbytes: int) -> OffloadChoice:
        lagging = max(0, nbytes - int(self.hidden_out))
        choice = self._choice(nbytes, lagging, self._way_back_ms(nbytes), None)
        if self.released_at_head:
            # Without a throttle nothing bounds the bytes still on their way out as forward and the loss's forward peak:
            # how many left by then is a guess from timing, and a guess is no fit guarantee (on an H200, through the
            # Lightning callback, plans that counted on it ran out of memory at the loss's logits, 1 GiB past their
            # prediction). Forward's peak is predicted as if none had left; the head's backward still gets it all.
            choice = replace(choice, forward_relief=0)
        return choice

    def throttled(self, nbytes: int, cap: int, prefetch: int | None = None) -> OffloadChoice:
        """``prefetch``: a bound on bytes fetched ahead below the configured one (``None``: the configured one)."""
        # Forward saves the offloaded bytes in its first nbytes/eligible share; the link must keep within the cap.
        saving_ms = self.p.forward_ms * nbytes / max(1, self.eligible)
        waiting_ms = max(0.0, (nbytes - cap) / self.link - saving_ms)
        back_ms = self._way_back_ms(nbytes)
        if prefetch is not None:  # with little fetched ahead, most of the way back waits for the link
            back_ms = max(back_ms, nbytes / self.link - self.backward_ms / 2)
        # The cap's worth still on its way out as forward goes on; the rest of forward hides some of it.
        rest_ms = self.p.forward_ms - saving_ms
        in_flight = min(nbytes, cap)
        if not self.released_at_head:
            return self._choice(nbytes, in_flight, waiting_ms + back_ms, cap, prefetch)
        lagging = max(0, int(in_flight - HIDDEN_SHARE * rest_ms * self.link))
        # Forward's own peak may come before the head, with the whole cap in flight.
        return replace(
            self._choice(nbytes, lagging, waiting_ms + back_ms, cap, prefetch), forward_relief=nbytes - in_flight
        )

    def cheapest(
        self, needed: Sequence[int], movable: int, peak_of: Callable[[OffloadChoice], int], budget: int
    ) -> OffloadChoice | None:
        """The cheapest offload of at most ``movable`` bytes whose ``peak_of`` stays within ``budget``, trying the
        ``needed`` reliefs (each unbounded, and throttled with the cap on top); ``None``: none fits (then
        :meth:`most_frugal`)."""
        choices = []
        cap = self.p.inflight_cap
        for nbytes in needed:
            nbytes = min(movable, max(0, nbytes))
            if not self.p.inflight_fixed:
                choices.append(self.unbounded(nbytes))
            choices.append(self.throttled(min(movable, nbytes + cap), cap))
        fitting = [c for c in choices if peak_of(c) <= budget]
        return min(fitting, key=lambda c: (c.cost_ms, c.nbytes)) if fitting else None

    def most_frugal(self, movable: int) -> OffloadChoice:
        """Everything movable leaves, with little in flight either way: the least peak, whatever it costs."""
        return self.throttled(movable, min(self.p.inflight_cap, self.frugal), min(self.p.prefetch_bytes, self.frugal))


def forward_relief(choice: OffloadChoice) -> int:
    return choice.relief if choice.forward_relief is None else choice.forward_relief


def offload_cost_ms(profile: StepProfile, plan: Plan) -> float:
    """What ``plan``'s offloading costs per step by the model of ``profile`` (its recompute not included)."""
    if not plan.offload_bytes:
        return 0.0
    eligible = eligible_bytes(profile, plan.checkpoint_blocks, plan.split, plan.light_blocks)
    model = OffloadModel(profile, eligible, released_at_head=profile.two_peaks)
    if plan.inflight_cap is None:
        return model.unbounded(plan.offload_bytes).cost_ms
    return model.throttled(plan.offload_bytes, plan.inflight_cap, plan.prefetch_cap).cost_ms


def fit_link_share(profile: StepProfile, plan: Plan, observed_ms: float) -> float:
    """The largest link share (at most the profile's) at which ``plan``'s offloading costs at least ``observed_ms``,
    the time a step on that plan waited for copies: the model then predicts what was measured."""
    low, high = _LEAST_LINK_SHARE, profile.link_share
    if offload_cost_ms(replace(profile, link_share=high), plan) >= observed_ms:
        return high
    for _ in range(30):  # the cost falls as the share grows: bisect for the largest share still costing enough
        middle = (low + high) / 2
        if offload_cost_ms(replace(profile, link_share=middle), plan) >= observed_ms:
            low = middle
        else:
            high = middle
    return low
