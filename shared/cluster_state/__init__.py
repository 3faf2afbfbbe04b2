"""The cluster's shared state in Redis: the instance registry (registry.py: each engine's heartbeat record, read by
the gateway and the launcher) and the prefix-cache index (prefix_index.py: engines publish their KV events, the
gateway's router reads which instance holds which block hashes). Only the services use these; the engine does not.
"""
from __future__ import annotations

import asyncio

RECANCEL_S = 0.05


async def cancel_and_wait(*tasks: asyncio.Task) -> None:
    """Cancel tasks and return once every one is done, cancelling again every RECANCEL_S while one runs on.

    Why once is not enough: on Python < 3.12, asyncio.wait_for loses a cancellation that lands as the future it
    waits on finishes (CPython gh-86296), and redis-py sends every command under wait_for. A loop around Redis calls
    (a heartbeat, the prefix index publisher) may so run on after its one cancel(), and whoever awaits it (a drain,
    asyncio.run's own cleanup) waits forever. Outcomes are not raised: the tasks' exceptions stay theirs."""
    pending = {t for t in tasks if t is not None}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:
        if task is not None and not task.cancelled():
            task.exception()  # (retrieved: no "exception was never retrieved" at exit)
