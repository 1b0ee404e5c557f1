"""Stopping for a preemption at a step boundary, every process at the same step.

`Preemption(signals=(SIGTERM,))` answers once per step, the same on every process, "do we
stop here?": `reached(step)` is True once, at the first step asked after a SIGTERM reached
any process. In several processes (`jax.distributed.initialize`), that is the step JAX's
preemption service agreed on, and every process must ask at every step from the same first
step. In one process, a SIGTERM handler notices the signal, `request()` acts as one, and
`close()` (or leaving a `with` block) puts back the previous handlers. AutoparError: made
outside the main thread of one process; in several, JAX's preemption service off, or
`request()` called.

Design and rationale: docs/internals-planning.md, "autopar/preemption.py".
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from autopar.distributed import multiprocess
from autopar.errors import AutoparError


class Preemption:
    """Whether to stop for a preemption, asked once per step on every process alike."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self._requested = threading.Event()
        self._previous: dict[int, Any] = {}
        self._multiprocess = multiprocess()
        if self._multiprocess:
            _check_service()
            return
        if threading.current_thread() is not threading.main_thread():
            raise AutoparError("autopar.Preemption() installs a signal handler, which Python "
                               "allows only in the main thread. Fix: make it in the main "
                               "thread, before the training loop.")
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._notice)

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        self._requested.set()

    def request(self) -> None:
        """Ask to stop, as a SIGTERM does (one process; e.g. from a test or a watchdog)."""
        if self._multiprocess:
            raise AutoparError("in several processes a preemption is noticed by JAX's "
                               "preemption service. Fix: send the process SIGTERM.")
        self._requested.set()

    def reached(self, step: int) -> bool:
        """True at the step where every process is to save and stop: the first step asked
        after a SIGTERM reached any process (in several processes, the step JAX's service
        agreed on: all must ask at every step, from the same first step). True once."""
        if self._multiprocess:
            from jax.experimental import multihost_utils
            return bool(multihost_utils.reached_preemption_sync_point(step))
        if self._requested.is_set():
            self._requested.clear()
            return True
        return False

    def close(self) -> None:
        """Put back the signal handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_service() -> None:
    from jax._src import distributed
    if distributed.global_state.preemption_sync_manager is None:
        raise AutoparError("JAX's preemption service is off, and several processes cannot "
                           "agree on a step to stop at without it. Fix: leave "
                           "jax_enable_preemption_service on (its default) when calling "
                           "jax.distributed.initialize.")
