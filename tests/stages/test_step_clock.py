"""`StepClock` turns each step's two timing events into its idle time, span and work, in launch
order. CUDA events cannot run here, so events stand in that record a time on the host's
clock; the GPU tests (`test_overlap_steps.py`) run the real ones."""

from __future__ import annotations

from stages.runtime.step_clock import StepClock, StepTime


class _Event:
    """A recorded instant in ms, answering as `torch.cuda.Event` does."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: _Event) -> float:
        return later.ms - self.ms


def test_each_step_keeps_its_own_work_beside_its_span_and_the_idle_time_before_it():
    clock = StepClock()
    clock.finished(_Event(0.0), _Event(9.0), (64, 0))
    clock.finished(_Event(9.5), _Event(30.0), (64, 700))  # 0.5 ms idle, then a prefill step
    assert clock.take() == [StepTime(None, 9.0, 64, 0), StepTime(0.5, 20.5, 64, 700)]
    assert clock.take() == []
    clock.finished(_Event(31.0), _Event(40.0))  # a runner that gives no counts
    assert clock.take() == [StepTime(1.0, 9.0, 0, 0)]
