"""Where plans aim under a budget: the fit margin they keep below it, the default budget of a device, and when the
allocator's cache is worth emptying. Plain bytes in and out."""

from __future__ import annotations

from lightning_offload.units import GiB

# The device's allocator never gets all of its memory (CUDA context, fragmentation, other libraries): the default
# budget leaves this share of the total (at least _MIN_MARGIN) unplanned.
_MARGIN_SHARE = 0.08
_MIN_MARGIN = 3 * GiB
# Plans aim at least this share below the budget: the allocator rounds blocks up, and a hard cap counts reserved bytes.
PLAN_MARGIN_SHARE = 0.05
# Where the measuring step's allocator, pressed for room, reserved past its peak, plans aim this multiple of that gap
# below the budget, plus the misprediction a planned step may have before it replans (REPLAN_SHARE). On an H200 a small
# model's 2 GiB cap (500 MiB of logits' gradient) left 0.11 GiB of fragments, and plans aimed only 5% below it ran out
# of memory.
RESERVED_GAP_FACTOR = 1.5
# The fit margin's prior: this share of the room the budget leaves above the step's base (weights, optimizer state,
# gradients: what the model cannot get wrong), in force until planned steps of the input showed a larger error.
# The model's errors and the allocator's fragments come from what it predicts (activations, the loss's transients), so
# they scale with the room, not with the weights: on an H200 a model zoo's planned steps peaked up to 0.22 GiB above
# their predictions, and a hard cap that failed a 1000 MiB request held 0.27 GiB of fragments (8.6% of the room).
FIT_ROOM_SHARE = 0.10
# A planned step replans when its peak passes its prediction by more than this share of the budget.
REPLAN_SHARE = 0.02
# Steps that shaped the allocator's cache in a layout of their own (a memory-budget planner's measuring steps and plans
# under trial; the optimizer's state allocated in the first step into room activations had used) can leave it holding
# far more than a step needs: expandable segments are never unmapped but by emptying the cache. Past this multiple of
# the steps' peak allocated memory the cache is emptied once, where the budget (or the process's cap) leaves room for a
# layout mapped afresh to reserve FRESH_LAYOUT_ROOM x that peak. On an H200 the small-vocab model's 8 GiB budget row
# reserved 7.7 GiB for 6.2 allocated after its trials, 6.7 once emptied; where the budget was close to the peak,
# Llama-1B's kept plans under hard caps at 0.9x and at the floor (5-6% of room) emptied each time then flushed the
# cache in every step (1.10x -> 1.77x `none`'s step time): a layout mapped afresh reached the cap there.
SETTLED_RESERVED_RATIO = 1.10
FRESH_LAYOUT_ROOM = 1.15


def cache_worth_emptying(reserved: int, peak: int, room: int) -> bool:
    """Whether an allocator holding ``reserved`` bytes, after steps that peaked at ``peak`` bytes allocated, holds far
    more than a step needs (over ``SETTLED_RESERVED_RATIO`` x the peak) while ``room`` bytes (a budget, a cap) hold a
    layout mapped afresh (``FRESH_LAYOUT_ROOM`` x the peak): then emptying the cache once returns memory for good."""
    return peak > 0 and room >= FRESH_LAYOUT_ROOM * peak and reserved > SETTLED_RESERVED_RATIO * peak


def default_budget(total: int) -> int:
    """What the device can hold for training: ``total`` (what the process may use of the device's memory) less a
    margin, at most half of it (``_MIN_MARGIN`` alone would leave nothing of a device of 3 GiB)."""
    return total - min(max(_MIN_MARGIN, int(total * _MARGIN_SHARE)), total // 2)


def fit_margin(budget: int, base: int, fit_error: int, pressed_error: int = 0) -> int:
    """How far below ``budget`` every plan's predicted peak stays: ``FIT_ROOM_SHARE`` of the room above the step's
    ``base`` (a prior, in force from the first planned step on), the largest ``fit_error`` the input's planned steps
    showed, and the largest ``pressed_error`` (reserved past the prediction under a pressed
    hard cap: a step that ran proved it enough, so a plan that ran keeps fitting)."""
    return max(int(FIT_ROOM_SHARE * max(0, budget - base)), fit_error, pressed_error)


def plan_aim(budget: int, margin: int, reserved_gap: int) -> int:
    """What plans aim for: ``budget`` less the fit ``margin``, at least ``PLAN_MARGIN_SHARE`` of it, and further where
    the measuring step's allocator, pressed, reserved ``reserved_gap`` bytes past its peak."""
    margin = max(int(budget * PLAN_MARGIN_SHARE), margin)
    if reserved_gap:
        margin = max(margin, int(RESERVED_GAP_FACTOR * reserved_gap + REPLAN_SHARE * budget))
    return budget - margin
