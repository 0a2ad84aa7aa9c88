"""Supervised background loops: what a metaserver loop that must never end (a partition's election rounds and
process lease keep-alive, ``metaserver/ha/election.py``) does with a failure. Every failure, whatever its type, is
logged (a warning for an error of ours, such as etcd being away; the traceback for anything else, a bug) and the
loop goes on after a bounded backoff. A loop that ends anyway (a BaseException) makes ``/healthz`` fail
(``metaserver/handlers/metrics.py``), so a supervisor restarts the process instead of keeping a zombie.
"""

from __future__ import annotations

import logging

from umbp.errors import UmbpError

log = logging.getLogger("umbp.metaserver")

MAX_BACKOFF_S = 5.0  # a loop that keeps failing still retries at least this often


def backoff(fails: int, base: float) -> float:
    """The pause after ``fails`` failures in a row: ``base`` (none failed), doubling per failure, MAX_BACKOFF_S at
    most."""
    return min(base * (1 << min(fails, 8)), MAX_BACKOFF_S)


def log_failure(what: str, e: Exception) -> None:
    """Log a supervised loop's failure (see the module docstring)."""
    if isinstance(e, UmbpError):
        log.warning("metaserver: %s: %s; retrying", what, e)
    else:
        log.error("metaserver: %s failed; retrying", what, exc_info=e)
