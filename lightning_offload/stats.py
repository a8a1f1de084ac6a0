"""What one offloading step (a ``with`` block, or one training batch of the callback) did."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class OffloadStats:
    """Counters for the latest step. Bytes are bytes; times are milliseconds of device time.

    Attributes:
        saved_tensors: tensors autograd saved through the hooks.
        eligible_bytes: bytes of saved tensors that the policy allowed to leave the device (unique storage spans).
        offloaded_tensors: saved tensors whose data was sent to host memory.
        offloaded_bytes: bytes copied device -> host (each storage span once).
        resident_bytes: eligible bytes kept on the device (the resident tail, pacing, or a full host pool).
        prefetched_bytes: bytes copied host -> device ahead of need in backward.
        fetched_on_demand_bytes: bytes copied host -> device only when backward asked for them.
        host_bytes_held: host bytes still holding this engine's offloaded data at the end of the step (another
            engine of the process holds its own).
        host_pinned_bytes: host bytes the process-wide pool owns (pinned on CUDA).
        host_allocations: new host buffers allocated for this engine in this step (0 in steady state).
        inflight_bytes: bytes whose device -> host copy may still be running (their sources stay allocated).
        stall_ms: time the compute stream waited for host -> device copies (streamed mode on CUDA).
        d2h_ms: summed duration of device -> host copies (only with ``measure_copies=True``).
        h2d_ms: summed duration of host -> device copies (only with ``measure_copies=True``).
    """

    saved_tensors: int = 0
    eligible_bytes: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    resident_bytes: int = 0
    prefetched_bytes: int = 0
    fetched_on_demand_bytes: int = 0
    host_bytes_held: int = 0
    host_pinned_bytes: int = 0
    host_allocations: int = 0
    inflight_bytes: int = 0
    stall_ms: float = 0.0
    d2h_ms: float = 0.0
    h2d_ms: float = 0.0

    def d2h_gbps(self) -> float:
        """Achieved device -> host bandwidth in GB/s (0 when copies were not timed)."""
        return self.offloaded_bytes / self.d2h_ms / 1e6 if self.d2h_ms > 0 else 0.0

    def h2d_gbps(self) -> float:
        """Achieved host -> device bandwidth in GB/s (0 when copies were not timed)."""
        moved = self.prefetched_bytes + self.fetched_on_demand_bytes
        return moved / self.h2d_ms / 1e6 if self.h2d_ms > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
