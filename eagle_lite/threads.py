"""torch CPU threads: the one check behind every entry point's --threads and every config's `threads`, and the one
place that sets them (`set_threads`)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("eagle_lite")
MOST_THREADS = 1024   # more than any CPU has cores: a count past it is a typo, and starting them fails
_warned: set[int] = set()  # counts already warned about: a flag checked at the CLI and again in its config warns once


def check_threads(threads: int | None, name: str = "--threads") -> int | None:
    """`threads` when it is a usable count of torch CPU threads (None: torch's default, one per core).

    Below 1 (or not a whole number), or past `MOST_THREADS` and 4 per core, is a ValueError naming `name`. Above
    this machine's cores is allowed with a warning (once per count in a process): the extra threads wait for a
    core, and every step waits for the slowest thread.
    """
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{name} must be a whole number >= 1 (torch CPU threads; leave it unset for one per core), "
                         f"got {threads!r}")
    cores = os.cpu_count()
    most = max(MOST_THREADS, 4 * (cores or 1))
    if threads > most:   # torch would try to start them all: libgomp gives up, or the process crashes
        raise ValueError(f"{name} must be at most {most} (this machine has {cores or 'an unknown number of'} CPU "
                         f"cores), got {threads}")
    if cores and threads > cores and threads not in _warned:
        _warned.add(threads)
        log.warning("%s %d is more than the %d CPU cores here: the extra threads wait for a core and slow every "
                    "step; use %d or fewer", name, threads, cores, cores)
    return threads


def set_threads(threads: int | None, name: str = "--threads") -> int:
    """Checks `threads` (`check_threads`) and makes it torch's CPU thread count; returns the count now in use.

    None leaves torch's count as it is. Setting the count it already has is skipped (a loop may call this at every
    step). Every runtime entry point, eval tool and trainer sets threads here, not with `torch.set_num_threads`.
    """
    import torch

    threads = check_threads(threads, name)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
