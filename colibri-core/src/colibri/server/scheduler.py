"""KV slots and the bounded FIFO queue in front of them.

The engine runs ``kv_slots`` sequences at once; each request holds one slot from submit until the engine
confirms the sequence ended (``done``, an ``error``, or the engine's death) — never merely until the client went
away, or a new request could land on a slot the engine is still writing. Requests beyond the slots wait in a
FIFO queue of at most ``max_queue`` entries for at most ``queue_timeout`` seconds; beyond that they are refused
with 429 and a ``Retry-After`` estimate.

A conversation keeps its slot: the scheduler remembers which conversation key used each slot last and hands the
same slot back when it is free, so the engine reuses the cached prefix and a follow-up turn only prefills what is
new. When that slot is busy another free one is taken instead (throughput beats reuse; the engine's
longest-common-prefix match makes a foreign slot merely slower, never wrong). An explicit ``cache_slot`` pins a
request to one slot and waits for it.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass, field

from .errors import APIError


@dataclass
class _Waiter:
    key: str | None
    pinned: int | None
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)


class Lease:
    """One slot held by one request; :meth:`release` exactly once when the engine is done with it."""

    def __init__(self, scheduler: SlotScheduler, slot: int, reused_owner: bool, waited_s: float):
        self.scheduler = scheduler
        self.slot = slot
        self.reused_owner = reused_owner   # the slot last served this same conversation
        self.waited_s = waited_s
        self._started = time.monotonic()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.scheduler._release(self.slot, time.monotonic() - self._started)


class SlotScheduler:
    """Assigns KV slots to requests, FIFO, with conversation affinity. Lives on the event loop's thread."""

    def __init__(self, slots: int, max_queue: int, queue_timeout: float):
        self.slots = slots
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self._free: set[int] = set(range(slots))
        self._owner: dict[int, str | None] = {}      # slot -> key of the conversation it last served
        self._last_used: dict[int, float] = {i: 0.0 for i in range(slots)}
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._service_s = 1.0                         # moving average of how long a lease is held

    # ---- what /metrics and /health show --------------------------------------------------------------------

    @property
    def busy(self) -> int:
        return self.slots - len(self._free)

    @property
    def busy_slots(self) -> list[int]:
        """The slots held by a request now (the dashboard draws each slot)."""
        return sorted(set(range(self.slots)) - self._free)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def retry_after_s(self) -> int:
        """A rough wait before a retry could be served: queued work spread over the slots."""
        estimate = self._service_s * (len(self._waiters) + 1) / self.slots
        return max(1, min(60, math.ceil(estimate)))

    # ---- acquiring ------------------------------------------------------------------------------------------

    async def acquire(self, key: str | None, pinned: int | None = None) -> Lease:
        if not self._waiters:
            slot = self._pick(key, pinned)
            if slot is not None:
                return self._grant(slot, key, 0.0)
        if len(self._waiters) >= self.max_queue:
            raise APIError(429, f"server busy: all {self.slots} KV slots are in use and the queue "
                                f"({self.max_queue}) is full; retry later", code="queue_full",
                           headers={"Retry-After": str(self.retry_after_s())})
        waiter = _Waiter(key, pinned, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            # asyncio.wait, not wait_for: a cancellation of this wait always propagates (wait_for on Python 3.11
            # can return a result instead when the grant and the cancel meet)
            await asyncio.wait({waiter.future}, timeout=self.queue_timeout)
            if not waiter.future.done() and self._withdraw(waiter):
                raise APIError(429, f"server busy: no KV slot became free within {self.queue_timeout:g} s; "
                                    f"retry later", code="queue_timeout",
                               headers={"Retry-After": str(self.retry_after_s())})
            slot, reused = waiter.future.result()
        except asyncio.CancelledError:
            # the client went away while queued; hand back a slot granted in the meantime
            if not self._withdraw(waiter) and waiter.future.done() and not waiter.future.cancelled():
                self._release(waiter.future.result()[0], None)
            raise
        return Lease(self, slot, reused, time.monotonic() - waiter.queued_at)

    def _withdraw(self, waiter: _Waiter) -> bool:
        """Take a waiter off the queue; False when it had already been granted a slot."""
        if waiter.future.done() and not waiter.future.cancelled():
            return False
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        waiter.future.cancel()
        return True

    def _pick(self, key: str | None, pinned: int | None) -> int | None:
        if pinned is not None:
            return pinned if pinned in self._free else None
        if not self._free:
            return None
        if key is not None:
            for slot in self._free:
                if self._owner.get(slot) == key:
                    return slot
        # Otherwise the free slot idle the longest: its cached conversation is the least likely to come back.
        return min(self._free, key=lambda s: (s in self._owner, self._last_used[s], s))

    def _grant(self, slot: int, key: str | None, waited: float) -> Lease:
        reused = key is not None and self._owner.get(slot) == key
        self._take(slot, key)
        return Lease(self, slot, reused, waited)

    def _take(self, slot: int, key: str | None) -> None:
        self._free.discard(slot)
        self._owner[slot] = key
        self._last_used[slot] = time.monotonic()

    def _release(self, slot: int, held_s: float | None) -> None:
        if held_s is not None:
            self._service_s = 0.8 * self._service_s + 0.2 * held_s
        self._last_used[slot] = time.monotonic()
        self._free.add(slot)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to waiters in arrival order (a waiter pinned to a busy slot lets others pass)."""
        for waiter in list(self._waiters):
            if not self._free:
                return
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            slot = self._pick(waiter.key, waiter.pinned)
            if slot is None:
                continue
            self._waiters.remove(waiter)
            reused = waiter.key is not None and self._owner.get(slot) == waiter.key
            self._take(slot, waiter.key)
            waiter.future.set_result((slot, reused))
