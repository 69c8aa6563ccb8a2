"""The server's worker threads run at background CPU priority, so that they only take what decoding leaves.

Everything the server does for a request beside decoding runs on the event loop's default executor
(`asyncio.to_thread`): tokenizing, chat templates, compiling a grammar or a tool schema, preparing stop
strings, cold adapter loads, rendering large responses, metrics. On a machine with as many cores as
llama.cpp has decode threads (the default), any of that which runs while a decode does takes a core away
from one of llama.cpp's threads, and a step's threads wait for their slowest. At the lowest priority (nice
19) such work runs in the gaps decoding leaves, the decode threads keep their cores, and a request's own
preparation is what waits. Measured beside the attacks of BENCHMARKS.md ("Served attacks under the
plain-request floor"), this alone moved a neighbour's latency by no more than the noise: those attacks
spent their cost on the engine thread (fairness.py bounds it there); this bounds what is left beside it.

Linux gives each thread its own nice value (`setpriority` on a thread id); elsewhere the setting does
nothing (the threads keep the process's priority). A thread cannot take its priority back up without
privileges, which is why these are threads of their own, never the engine's or the event loop's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("loramux.server")

NICE_MAX = 19  # the lowest CPU priority
THREAD_PREFIX = "loramux-bg"


def lower_priority(nice: int) -> bool:
    """Give the calling thread CPU priority `nice` (0-19, 19 the lowest; Linux only). True if it took."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        # on Linux a thread id is a task id: this sets this thread's nice value, not the process's
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(nice, NICE_MAX))
    except OSError as e:  # a sandbox may refuse it: the work still runs, at normal priority
        log.warning("loramux: could not lower a worker thread's CPU priority (%s); background work will "
                    "compete with decoding for cores", e)
        return False
    return True


def background_executor(nice: int) -> ThreadPoolExecutor:
    """A thread pool whose threads run at CPU priority `nice` (`lower_priority`)."""
    return ThreadPoolExecutor(thread_name_prefix=THREAD_PREFIX, initializer=lower_priority, initargs=(nice,))


def install(nice: int) -> ThreadPoolExecutor | None:
    """Make the running event loop's default executor (`asyncio.to_thread`) a background one; None for
    nice 0 (the loop keeps its own executor, at the process's priority)."""
    if nice <= 0:
        return None
    pool = background_executor(nice)
    asyncio.get_running_loop().set_default_executor(pool)
    return pool


__all__ = ["NICE_MAX", "THREAD_PREFIX", "background_executor", "install", "lower_priority"]
