"""Fair shares between owners (API keys) of one shared resource: the primitives both the
sampling backends and the service's training lanes use, so each is fair the same way
(docs/architecture.md, trust boundaries). Below both layers, beside `ember/errors.py`: the
samplers never import the service.

`OwnerQueues`: waiting work, one first-come-first-served queue per owner, served round
robin over owners. The sampler's scheduler queues its requests here (owner:
`request.job.owner`); a training `Lane` (`service/sequencer.py`) queues its ops here (owner:
the run's API key).

    queues.extend(requests)          # each joins its owner's queue (`Job.owner`)
    request = queues.head()          # the oldest request of the owner whose turn it is
    queues.next_turn(done=...)       # that owner had its turn: drop the request if done, rotate

An owner that arrives joins the end of the rotation, so with k owners waiting it is served
after at most k - 1 turns of the others, whatever their backlogs: one owner's queue
cannot delay another owner's next request (a turn is one sample placed in a free slot).
Not thread-safe: its user holds a lock or a single thread uses it.

`owner_cap`: the most of a backend's places (TorchSampler cache slots, vLLM engine
sequences) one owner may hold at once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def owner_cap(places: int) -> int:
    """The most of `places` one owner may hold: all but 1/16 of them (from 16 places up), kept
    free so that another owner's next request starts at the next step instead of waiting for
    running sequences to end; below 16 places, all of them."""
    return places - places // 16


def job_owner(request: Any) -> str:
    """The owner of a sampler's `RequestState`."""
    return request.job.owner


class OwnerQueues(Generic[T]):
    def __init__(self, owner_of: Callable[[T], str] = job_owner) -> None:
        self._owner_of = owner_of
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()  # rotation order: first is next
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[T]:
        for queue in self._queues.values():
            yield from queue

    def owners(self) -> list[str]:
        """Owners with waiting requests, in the order of their next turns."""
        return list(self._queues)

    def extend(self, requests: Iterable[T]) -> None:
        for request in requests:
            self._queues.setdefault(self._owner_of(request), deque()).append(request)
            self._count += 1

    def head(self) -> T:
        """The oldest waiting request of the owner whose turn it is."""
        return next(iter(self._queues.values()))[0]

    def next_turn(self, done: bool) -> None:
        """The current owner had its turn: drop its head request if `done`, then move the
        owner to the end of the rotation (or out of it when its queue is empty)."""
        owner, queue = next(iter(self._queues.items()))
        if done:
            queue.popleft()
            self._count -= 1
        if queue:
            self._queues.move_to_end(owner)
        else:
            del self._queues[owner]

    def remove_if(self, dead: Callable[[T], bool]) -> None:
        """Drop every waiting request for which `dead(request)` holds (failed or closing)."""
        for owner in list(self._queues):
            kept = deque(request for request in self._queues[owner] if not dead(request))
            self._count -= len(self._queues[owner]) - len(kept)
            if kept:
                self._queues[owner] = kept
            else:
                del self._queues[owner]
