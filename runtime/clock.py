"""The executor's clocks: when each instruction and each wait started and ended, in seconds from the step's start.

On CPU the host's monotonic clock; on CUDA, events recorded on the current
stream (GPU time), resolved once the step's last event has completed (the host
waits for that one event, never for the whole device), so timing adds no
synchronization inside the step.
"""

from __future__ import annotations

import time

import torch

__all__ = ["HostClock", "CudaClock"]


class HostClock:
    """Timestamps on the host's monotonic clock, in seconds from the step's start."""

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter() - self.t0

    def resolve(self, token: float) -> float:
        return token


class CudaClock:
    """Timestamps as CUDA events on the current stream: GPU time, resolved after the last one completes.

    A compute instruction's span is what the GPU spent on it, and a wait's span
    (events recorded before and after ``work.wait()``, which makes the stream
    wait for the collective) is the time the stream stalled on communication.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        self.t0 = self.mark()
        self.synced = False

    def mark(self):
        ev = self.last = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve(self, token) -> float:
        if not self.synced:  # every mark is on the compute stream, which has waited for every comm work by then
            self.last.synchronize()
            self.synced = True
        return self.t0.elapsed_time(token) / 1e3
