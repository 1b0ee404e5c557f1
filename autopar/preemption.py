"""Stopping for a preemption at a step boundary, every process at the same step.

A cluster preempts a job by sending its processes SIGTERM, and kills them a grace period later.
A job that wants to lose nothing saves a checkpoint in between, and every process must save the
same step (each writes its own shards of it). `Preemption` answers, once per step, "do we stop
here?", the same on every process:

- In several processes (`jax.distributed.initialize`), JAX's preemption service catches
  SIGTERM on any process and the processes agree, through the coordinator, on a step at
  which all stop (`multihost_utils.reached_preemption_sync_point`). Each step asks a local
  flag only: no collective is added. The service is on by default
  (`jax_enable_preemption_service`); a Python SIGTERM handler installed after
  `jax.distributed.initialize` would take the signal from it, so none is installed here.
- In one process, a SIGTERM handler sets the flag (and the previous handler is put back by
  `close()`).

    preemption = autopar.Preemption()
    for step in range(start, steps):
        state, loss = train_step(state, batch)
        if preemption.reached(step):
            autopar.save_checkpoint(f"{directory}/step_{step + 1}", state, plan)
            break                                      # exit 0: the scheduler restarts the job

The restarted job resumes from `autopar.latest_checkpoint(directory)`.
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
