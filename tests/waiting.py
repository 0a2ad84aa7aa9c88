"""The tests' one wait for an observable state (``eventually``, ``eventually_async``) and the harness's failure
(``HarnessError``). Bounded in time and in count of calls; fails naming what it waited for and the last thing it saw.
Never a sleep as synchronisation: it returns as soon as the state holds."""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar


class HarnessError(AssertionError):
    """A harness process did not start, answer or stop in time. An AssertionError so pytest shows it as a
    test failure with its message (which carries the process's log tail), not as an internal error."""


T = TypeVar("T")
_LAST_CHARS = 2000  # of the last value's repr in a timeout message


class NotYet(Exception):
    """Raised by an ``eventually`` predicate: the state is not reached yet, and here is what was seen instead (its
    message is the "last seen" of a timeout)."""


class _Poll:
    """The bounds and the record of one ``eventually``: a deadline, a count of calls (``timeout / interval + 2``: a
    clock that stalls cannot make it spin), the last value or exception seen, and the message at the end."""

    def __init__(self, timeout: float, what: str | Callable[[], str], interval: float,
                 details: Callable[[], str] | None):
        if interval <= 0 or timeout < 0:
            raise ValueError(f"eventually: interval {interval} must be > 0 and timeout {timeout} >= 0")
        self.timeout, self.what, self.interval, self.details = timeout, what, interval, details
        self.deadline = time.monotonic() + timeout
        self.calls_left = int(timeout / interval) + 2
        self.last = "no answer yet"

    def saw(self, value: Any = None, error: BaseException | None = None) -> None:
        self.calls_left -= 1
        if isinstance(error, NotYet):
            self.last = str(error)[:_LAST_CHARS]
        elif error is not None:
            self.last = f"{type(error).__name__}: {error}"[:_LAST_CHARS]
        else:
            self.last = repr(value)[:_LAST_CHARS]

    def pause(self) -> float | None:
        """Seconds to sleep before the next call; None when the time or the count is spent."""
        left = self.deadline - time.monotonic()
        if left <= 0 or self.calls_left <= 0:
            return None
        return min(self.interval, left)

    def failure(self) -> HarnessError:
        what = self.what() if callable(self.what) else self.what
        details = f"\n{self.details()}" if self.details is not None else ""
        return HarnessError(f"{what}: not within {self.timeout:g}s; last seen: {self.last}{details}")

    def attempt(self, pred: Callable[[], T], errors: tuple[type[BaseException], ...]) -> T | None:
        """One call of ``pred``: its value when true, else None after noting what it saw (a false value, ``NotYet``
        or an exception in ``errors``). An AssertionError (an invariant inside pred, a harness process gone)
        propagates at once, as does anything else."""
        try:
            value = pred()
        except AssertionError:
            raise
        except (NotYet, *errors) as e:
            self.saw(error=e)
            return None
        if not value:
            self.saw(value)
        return value or None

    def pause_or_fail(self) -> float:
        """The pause before the next call, or the failure when the bounds are used up."""
        pause = self.pause()
        if pause is None:
            raise self.failure()
        return pause


def eventually(pred: Callable[[], T], timeout: float, what: str | Callable[[], str], interval: float = 0.05,
               errors: tuple[type[BaseException], ...] = (), details: Callable[[], str] | None = None) -> T:
    """The tests' one wait for an observable state: call ``pred()`` every ``interval`` seconds until it returns a true
    value, and return that value.

    Bounded in time (``timeout`` seconds: the last call is made at the deadline) and in count (``timeout / interval
    + 2`` calls). ``NotYet`` (the predicate saying what it saw instead) or an exception of a type in ``errors`` (e.g.
    ``UmbpError`` while a process restarts) counts as "not yet". An AssertionError always propagates at once (an
    invariant checked inside ``pred``, a harness process that exited), as does any exception not in ``errors``.
    After the timeout: ``HarnessError`` (an AssertionError) naming ``what`` (text, or a callable giving it) and the
    last value or exception seen, then ``details()`` (e.g. the processes' log tails: read only on failure). Not a
    sleep: it returns as soon as the state holds.
    """
    poll = _Poll(timeout, what, interval, details)
    while True:
        value = poll.attempt(pred, errors)
        if value:
            return value
        time.sleep(poll.pause_or_fail())


async def eventually_async(pred: Callable[[], T], timeout: float, what: str | Callable[[], str],
                           interval: float = 0.05, errors: tuple[type[BaseException], ...] = (),
                           details: Callable[[], str] | None = None) -> T:
    """``eventually`` inside an event loop: the same bounds and failure, ``asyncio.sleep`` between the calls (the
    loop's own tasks make the state change meanwhile)."""
    import asyncio

    poll = _Poll(timeout, what, interval, details)
    while True:
        value = poll.attempt(pred, errors)
        if value:
            return value
        await asyncio.sleep(poll.pause_or_fail())
