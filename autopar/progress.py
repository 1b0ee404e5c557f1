"""Progress of long planning and compiling, on the "autopar" logger.

Work that is over in less than DELAY_S says nothing. Past it, the stage it is in is logged
(tracing, searching a mesh, a schedule, a memory-price round, a compile check), then each
change of stage at most once a second, a line every HEARTBEAT_S while one stage lasts, and
the total at the end. Only process 0 of several logs.

Where the program has configured no logging, the "autopar" logger gets a handler of its own
that writes `autopar: <message>` to stderr at INFO; where it has, records go to its handlers
at the levels it set. Off: `logging.getLogger("autopar").setLevel(logging.WARNING)`, or the
environment variable AUTOPAR_PROGRESS=0.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Iterator

import jax

logger = logging.getLogger("autopar")

DELAY_S = 2.0  # work shorter than this is not reported
HEARTBEAT_S = 10.0  # a line this often while one stage lasts
MIN_INTERVAL_S = 1.0  # changes of stage reported at most this often
# What a line says, outermost first: setting one level clears the levels after it.
LEVELS = ("schedule", "mesh", "round", "stage")


class _Task:
    def __init__(self, what: str) -> None:
        self.what, self.start = what, time.perf_counter()
        self.detail: dict[str, str] = {}
        self.last_emit = -1.0
        self.emitted = False
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def line(self) -> str:
        parts = [self.detail[k] for k in LEVELS if k in self.detail]
        elapsed = time.perf_counter() - self.start
        return f"{self.what}: {', '.join(parts) or 'working'} [{elapsed:.1f} s]"

    def emit(self, now: float) -> None:
        self.last_emit, self.emitted = now, True
        _log(self.line())

    def beat(self) -> None:
        """The timer's call: the current stage, where nothing was said for a while."""
        with self.lock:
            if self.timer is None:  # the task ended
                return
            now = time.perf_counter()
            if not self.emitted or now - self.last_emit >= HEARTBEAT_S - 1e-3:
                self.emit(now)
            wait = HEARTBEAT_S - (now - self.last_emit)
            self.timer = _timer(max(wait, 0.1), self.beat)


_current: list[_Task] = []  # the task under way (nested tasks report as its stages)
_timings: list[dict[str, float]] = []  # seconds by stage, of each `timing` under way


@contextlib.contextmanager
def task(what: str) -> Iterator[None]:
    """Report on the work inside, `what` naming it ("planning train_step"), where it is long."""
    if _current or not _enabled():
        yield
        return
    t = _Task(what)
    _current.append(t)
    t.timer = _timer(DELAY_S, t.beat)
    ended = "stopped by an error after"
    try:
        yield
        ended = "done in"
    finally:
        with t.lock:
            t.timer.cancel()
            t.timer = None
        _current.pop()
        if t.emitted:
            _log(f"{what}: {ended} {time.perf_counter() - t.start:.1f} s")


@contextlib.contextmanager
def timing() -> Iterator[dict[str, float]]:
    """The seconds spent inside in each `stage`, by stage name, and inside in all ("total"),
    whether or not progress is reported."""
    spent: dict[str, float] = {}
    _timings.append(spent)
    start = time.perf_counter()
    try:
        yield spent
    finally:
        _timings.remove(spent)
        spent["total"] = time.perf_counter() - start


@contextlib.contextmanager
def stage(name: str, text: str | None = None) -> Iterator[None]:
    """Work of one stage of planning ("tracing", "searching", "bounding", "compile checks"):
    the task's line says `text` (by default `name`), and its seconds are added to every
    `timing` under way."""
    update("stage", text or name)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        for spent in _timings:
            spent[name] = spent.get(name, 0.0) + elapsed


def update(level: str, text: str) -> None:
    """The task under way is now at `text` on `level` (one of LEVELS); the levels after it
    are cleared."""
    if not _current:
        return
    t = _current[-1]
    with t.lock:
        for later in LEVELS[LEVELS.index(level):]:
            t.detail.pop(later, None)
        t.detail[level] = text
        now = time.perf_counter()
        if now - t.start >= DELAY_S and now - t.last_emit >= MIN_INTERVAL_S:
            t.emit(now)


def _enabled() -> bool:
    return os.environ.get("AUTOPAR_PROGRESS", "1") != "0"


def _timer(seconds: float, fn) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()
    return timer


def _log(message: str) -> None:
    if jax.process_index() != 0:
        return
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("autopar: %(message)s"))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    logger.info(message)
