"""Mid-sequence adoption of in-flight weights on vLLM (docs/architecture.md, in-flight weights).

vLLM's engine runs its own step loop in another process, so `VLLMSampler` cannot read a
request's `VersionFollower` before each decode step as TorchSampler does; it `subscribe`s
to it instead. A followed request runs on its follower's *slot* in the engine:

* a LoRA follower has an adapter id of its own (never reused), whose weights are replaced
  in place on each publish (`add_lora(LoRARequest(..., load_inplace=True))`);
* a full-weights follower has a `WeightGate` key of its own ("follow-<n>"); while the gate
  holds it, a publish reloads the engine's weights in place (the sampler's transport),
  and when the gate loads it, it loads the follower's newest version.

A publish heard while followed requests run pauses the engine between two steps
(`pause_generation(mode="keep")`: queued and running requests stay, with their KV cache),
loads, records the swap, and resumes: the running sequences continue on the new weights
over the KV of their earlier tokens, as on TorchSampler (PipelineRL-style). Requests of
other owners and versions in the engine at that moment wait out the pause and continue.

Where the swap falls in a sequence is the number of its tokens received when the engine
paused. The engine sends the outputs of its last steps before the pause's reply, and
vLLM's output handler hands them on before this loop's pause continuation runs; `_settle`
then yields to the event loop until no followed count moves (nothing new can come: the
engine is paused), so the count is exact. Followed requests stream cumulative outputs
for this (one output per step, merged when the consumer lags).

A followed request's prompt is salted with its follower's slot and generation, so a
request never reuses prefix-cache blocks computed with another generation's weights
(running requests keep their own blocks, which is the point of keeping them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

from ember.sampling.vllm_versions import VLLMWeightVersion, next_lora_id

log = logging.getLogger(__name__)
_slot_ids = itertools.count(1)
_SETTLE_QUIET_YIELDS = 3  # consecutive event-loop turns with no followed count moving
_SETTLE_MAX_YIELDS = 1000


@dataclass(eq=False)
class FollowedPart:
    """One running part of a followed request (its samples `0..size-1`): tokens received per
    sample and the spans ((first_token_index, generation), ...) so far. Event-loop thread only."""

    size: int
    generation: int
    counts: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    spans: dict[int, list[tuple[int, int]]] = field(init=False)

    def __post_init__(self) -> None:
        self.spans = {i: [(0, self.generation)] for i in range(self.size)}

    def saw(self, index: int, tokens: int, finished: bool) -> None:
        self.counts[index] = max(self.counts.get(index, 0), tokens)
        if finished:
            self.finished.add(index)

    def switch(self, generation: int) -> None:
        """The engine runs `generation` from each unfinished sample's next token on (a
        generation that produced no token of a sample is replaced, not kept as an empty span)."""
        for index, spans in self.spans.items():
            if index in self.finished:
                continue
            at = self.counts.get(index, 0)
            if spans[-1][0] == at:
                spans[-1] = (at, generation)
            else:
                spans.append((at, generation))

    def marker(self) -> tuple:
        return tuple(sorted(self.counts.items())), len(self.finished)


@dataclass(eq=False)
class FollowSlot:
    """One follower's place in the engine (see the module docstring)."""

    lora: bool
    generation: int
    version: VLLMWeightVersion | None  # what the slot holds (or loads next); kept alive while held
    index: int = field(default_factory=lambda: next(_slot_ids))
    lora_id: int | None = None
    loaded_in: int = -1  # LoRA: the engine start (`VLLMSampler.engine_starts`) its adapter was loaded in
    parts: set[FollowedPart] = field(default_factory=set)

    @property
    def gate_key(self) -> str:
        return f"follow-{self.index}"

    def salt(self, owner: str) -> str:
        return f"{owner}\0follow-{self.index}-{self.generation}"


def _is_lora(version) -> bool:
    return version is not None and version.is_lora


class EngineFollows:
    """The followers of one `VLLMSampler` and their adoptions (its event-loop thread; the
    listeners it subscribes run in the publisher's thread and only schedule work here)."""

    def __init__(self, sampler) -> None:
        self._sampler = weakref.ref(sampler)
        self._slots: weakref.WeakKeyDictionary[Any, FollowSlot] = weakref.WeakKeyDictionary()
        self._lock = asyncio.Lock()  # one adoption at a time: a pause is engine-wide
        self._tasks: set[asyncio.Task] = set()
        self.adoptions = 0  # publishes adopted while followed requests ran (engine paused)

    def slot(self, follower, version: VLLMWeightVersion | None) -> FollowSlot:
        """`follower`'s slot, made on its first request (`version`: the request's, which
        fixes whether the slot is a LoRA adapter or a full set)."""
        slot = self._slots.get(follower)
        if slot is None:
            generation, current = follower.current()
            slot = FollowSlot(lora=_is_lora(version), generation=generation, version=current)
            if slot.lora:
                slot.lora_id = next_lora_id()
            self._slots[follower] = slot
            follower.subscribe(_Listener(weakref.ref(self), weakref.ref(follower)))
            weakref.finalize(follower, _forget_lora, self._sampler, slot.lora_id)
        if _is_lora(version) != slot.lora:
            raise ValueError(f"sample request: follow: the in-flight target holds "
                             f"{'LoRA' if slot.lora else 'full'} weights; version {version!r} cannot join it")
        return slot

    def lora_request(self, slot: FollowSlot, version=None, load_inplace: bool = False):
        """`slot`'s vLLM LoRARequest, of `version` (default: the slot's); `load_inplace`
        replaces the weights vLLM holds under the slot's adapter id."""
        from vllm.lora.request import LoRARequest

        path = (version if version is not None else slot.version).path
        return LoRARequest(lora_name=f"ember-follow-{slot.index}", lora_int_id=slot.lora_id,
                           lora_path=str(path), load_inplace=load_inplace)

    # ------------------------------------------------------------------ requests
    async def start_part(self, llm, follower, slot: FollowSlot, size: int) -> FollowedPart:
        """A part about to enter the engine: bring the slot to the newest generation first
        (in the lock, so no adoption falls between this and the part's registration)."""
        async with self._lock:
            await self._catch_up(llm, follower, slot)
            part = FollowedPart(size, slot.generation)
            slot.parts.add(part)
            return part

    def end_part(self, slot: FollowSlot, part: FollowedPart) -> None:
        slot.parts.discard(part)

    async def load_gate(self, llm, follower, slot: FollowSlot) -> None:
        """The `WeightGate` loader of a full slot's key: the follower's newest version."""
        generation, version = follower.current()
        if version is not None and not self._sampler().owns(version):
            generation, version = slot.generation, slot.version  # refused in `_catch_up`'s log
        await self._load(llm, slot, version)
        slot.generation, slot.version = generation, version
        await llm.reset_prefix_cache()  # nothing runs now: the previous set's cache is stale

    # ------------------------------------------------------------------ adoption
    def heard(self, follower) -> None:
        """A publish (loop thread): adopt it now if the slot is in use."""
        task = asyncio.get_running_loop().create_task(self._adopt(follower))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adopt(self, follower) -> None:
        slot = self._slots.get(follower)
        sampler = self._sampler()
        if slot is None or sampler is None or sampler.closed:
            return
        if not slot.lora and not slot.parts:
            # a full set is loaded only under the weight gate: by running parts (which hold
            # it) or by the next part's `start_part`, never beside a gate swap to another key
            return
        try:
            async with self._lock:
                llm = sampler.engine_if_running()
                if llm is not None:
                    await self._catch_up(llm, follower, slot)
        except Exception:  # noqa: BLE001 - the running requests keep the previous weights; the next request retries
            log.exception("vLLM: adopting in-flight weights mid-sequence failed")

    async def _catch_up(self, llm, follower, slot: FollowSlot) -> None:
        generation, version = follower.current()
        sampler = self._sampler()
        stale_lora = slot.lora and slot.loaded_in != sampler.engine_starts
        if generation <= slot.generation and not stale_lora:
            return
        if not slot.lora and sampler.gate_loaded() != slot.gate_key:
            slot.generation, slot.version = generation, version  # the gate's loader loads it when its turn comes
            return
        if version is not None and not sampler.owns(version):
            log.error("vLLM: in-flight target %r was not loaded into this sampler; followers keep generation %d",
                      version, slot.generation)
            return
        if _is_lora(version) != slot.lora:
            log.error("vLLM: in-flight target switched between LoRA and full weights; followers keep generation %d",
                      slot.generation)
            return
        running = [p for p in slot.parts]
        if not running:
            await self._load(llm, slot, version)
        else:
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await _settle(running)
                await self._load(llm, slot, version)
                for part in running:
                    part.switch(generation)
                self.adoptions += 1
            finally:
                await llm.resume_generation()
        slot.generation, slot.version = generation, version

    async def _load(self, llm, slot: FollowSlot, version) -> None:
        sampler = self._sampler()
        if slot.lora:
            await llm.add_lora(self.lora_request(slot, version, load_inplace=True))
            slot.loaded_in = sampler.engine_starts
        else:
            await sampler.load_full_set(llm, version, slot.gate_key)


async def _settle(parts: list[FollowedPart]) -> None:
    """Yield to the event loop until the paused engine's last outputs have reached every
    part (see the module docstring): no count moves for a few consecutive turns."""
    quiet, before = 0, [p.marker() for p in parts]
    for _ in range(_SETTLE_MAX_YIELDS):
        await asyncio.sleep(0)
        now = [p.marker() for p in parts]
        quiet = quiet + 1 if now == before else 0
        if quiet >= _SETTLE_QUIET_YIELDS:
            return
        before = now


class _Listener:
    """What a follower calls on publish (the publisher's thread): schedule the adoption on
    the sampler's loop. Holds weak references only."""

    def __init__(self, follows_ref, follower_ref) -> None:
        self._follows, self._follower = follows_ref, follower_ref

    def __call__(self, generation: int, version) -> None:
        follows, follower = self._follows(), self._follower()
        sampler = follows._sampler() if follows is not None else None
        if follower is None or sampler is None or sampler.closed:
            return
        try:
            sampler.call_soon(follows.heard, follower)
        except RuntimeError:  # the sampler's loop is gone (closing)
            pass


def _forget_lora(sampler_ref, lora_id: int | None) -> None:
    """A follower is gone: its slot's adapter leaves the engine."""
    sampler = sampler_ref()
    if lora_id is not None and sampler is not None and not sampler.closed:
        try:
            sampler.remove_lora_soon(lora_id)
        except RuntimeError:  # the loop is gone (interpreter exit)
            pass
