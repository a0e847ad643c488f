"""Continuous batching over KV-cache slots: the loop that serves TorchSampler's requests.

    scheduler.enqueue(jobs)    # requests join their owner's waiting queue
    while scheduler.busy:
        scheduler.step()       # admit(), then decode() (under torch.inference_mode())

- `admit()` places waiting samples in free slots. A request's prompt is prefilled once,
  in the step that places its first samples (one forward for a batch of prompts); each
  placed sample gets a copy of the prompt's KV and draws its first token from the
  prompt's last logits. Samples that find no free slot wait for a later step, which
  restores the prompt's KV from a snapshot.
- `decode()` runs one forward over every active slot and draws one token per slot. A
  sequence that stops or reaches max_tokens frees its slot at once and the next
  `admit()` refills it: requests of any length share the batch without waiting for the
  longest one.

Fair shares (the policy): waiting requests are queued per owner (`SamplingRequest.owner`,
the tenant), first come first served within an owner, and free slots are handed out
round robin over the owners with waiting work, one sample per turn
(`ember.fairness.OwnerQueues`). One owner holds at most `owner_cap` slots (all but 1/16
from 16 slots up), so a newcomer usually finds a free slot at the next step. A running
sequence is never preempted. So an owner's next request waits for at most the work
already running (one decode step when a reserved slot is free, else until a slot frees)
plus one turn of each other waiting owner, however many samples another owner has
queued; the per-owner
bound on queued work is the service's (`Limits.max_queued_samples_per_key`,
`max_queued_sample_tokens_per_key`).

The scheduler owns the queues (`waiting`), the slots (`SlotTable`: per-slot arrays) and
one `RequestState` per request in flight. Only the sampler's worker thread calls it.
A token is drawn with a uniform that is a function of (seed, sample, step) alone
(`rng`), so a request's samples do not depend on what shares the batch. The sections
below follow the loop: failures, admission, prefix cache, decode, drawing, finishing.

Prefix cache (`prefix_cache.PrefixCache`, optional): a prompt whose block-aligned prefix
was prefilled before under the same weights gets that prefix's KV copied into its slot and
only the rest computed (one forward of the remaining tokens over the restored prefix);
positions the response must score are never served from the cache
(`ResolvedRequest.first_scored_row`), so results do not depend on a hit.

Fault isolation: the work that belongs to one request (its prompt scores, its top
logprobs when the batched computation fails, its stop-string checks, building its
response) runs under `_guarded`; if it raises, `_fail_request` fails that request alone (its
slots are freed, its other rows in the step are skipped) and the step goes on for every
other row. Only a failure of the shared work (the batched forwards, the draw) escapes
`step()`, and the sampler then calls `fail_in_flight`.

Shapes are in names' suffixes: B rows of a forward (prompts in prefill, slots in decode),
T tokens of a row, P prompt tokens, V vocabulary, N rows whose draw is recorded, K top
logprobs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch

from ember import failpoints
from ember.sampling import jobs, rng
from ember.sampling.experts import with_routes
from ember.fairness import OwnerQueues, owner_cap
from ember.sampling.follow import with_spans
from ember.sampling.logits import RowParams, draw_tokens, processed_logprobs, top_logprobs
from ember.sampling.prefix_cache import PrefixCache, Snapshot
from ember.sampling.prompt_logits import PromptLogits
from ember.sampling.request_state import RequestState
from ember.sampling.runner import ModelRunner, decode_mask, extend_inputs, prefill_inputs
from ember.sampling.slots import Placement, SlotTable
from ember.sampling.weights import TorchWeightVersion

log = logging.getLogger(__name__)

ToPrefill = list[tuple[RequestState, int]]  # (request, the slot its prompt is prefilled into)
LoraRows = list[tuple[torch.Tensor | None, TorchWeightVersion]]  # (batch rows or None = all, adapter version)


class Scheduler:
    def __init__(self, runner: ModelRunner, slots: SlotTable, device: torch.device, max_prefill_tokens: int,
                 decode_text=None, prefix_cache: PrefixCache | None = None, logprob_chunk_tokens: int = 0) -> None:
        self.runner = runner
        # > 0 (and a plain LM head): a scored prompt's prefill keeps hidden states, not (P, V) logits
        self.logprob_chunk_tokens = logprob_chunk_tokens if runner.lm_head is not None else 0
        self.slots = slots
        self.device = device
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_text = decode_text  # token ids -> str, for stop strings
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self.waiting = OwnerQueues()  # requests with samples still to place, per owner
        self.admitting: list[RequestState] = []  # requests between leaving `waiting` and holding slots
        self.stats = {"prefill_forwards": 0, "prefill_prompts": 0, "decode_steps": 0, "decode_rows": 0,
                      "sequences": 0, "moves": 0, "prefix_cache_hit_tokens": 0, "cancelled": 0,
                      "unembed_calls": 0, "unembed_rows_max": 0}

    # ================================================================ the loop
    def enqueue(self, new_jobs: Iterable[jobs.Job]) -> None:
        self.waiting.extend(RequestState(job) for job in new_jobs)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or bool(self.slots.active.any())

    def step(self) -> None:
        self.drop_cancelled()
        self.admit()
        if self.slots.active.any():
            self.decode()

    def load(self) -> dict[str, int]:
        """Read-only (`TorchSampler.stats` and /metrics report it): sequences holding a slot
        now, and requests waiting for one."""
        return {"active_slots": int(self.slots.active.sum()), "waiting_requests": len(self.waiting)}

    # ================================================================ cancellation
    def drop_cancelled(self) -> None:
        """Requests whose caller cancelled their Future (a streaming client that hung up)
        leave before the step: their slots are freed for the waiting ones. A request not yet
        placed is skipped when it reaches the head of its queue (`_place_waiting`)."""
        for request in self.in_flight():
            if request.job.future.cancelled():
                self._release_request(request)
                self.stats["cancelled"] += 1

    def _release_request(self, request: RequestState) -> None:
        """Free every slot `request` holds and take it out of the queues."""
        for slot, holder in enumerate(self.slots.request):
            if holder is request:
                self.slots.release(slot)
        self.waiting.remove_if(lambda other: other is request)
        self.admitting = [other for other in self.admitting if other is not request]

    # ================================================================ failures
    def in_flight(self) -> list[RequestState]:
        """Requests holding a slot or being admitted (those to fail if a forward raises)."""
        held = [request for request in self.slots.request if request is not None] + self.admitting
        return list({id(request): request for request in held}.values())

    def fail_in_flight(self, error: Exception) -> None:
        """The shared work of a step raised: fail every request it touched, forget every slot."""
        self._fail_all_of(self.in_flight(), error)

    def fail_everything(self, error: Exception) -> None:
        """The sampler is closing: fail the waiting requests too."""
        self._fail_all_of(list(self.waiting) + self.in_flight(), error)

    def _fail_all_of(self, requests: list[RequestState], error: Exception) -> None:
        dead = {id(request) for request in requests}
        self.waiting.remove_if(lambda queued: id(queued) in dead)
        for slot in np.flatnonzero(self.slots.active):
            self.slots.release(int(slot))
        self.admitting = []
        for request in requests:
            jobs.settle(request.job.future, error=error)

    def _fail_request(self, request: RequestState, exc: BaseException) -> None:
        """Fail one request alone: free its slots, drop it from the queues, tell its caller
        (with its own error only). Its rows still in this step's arrays are skipped (`_holds`)."""
        log.error("sampling request failed alone: %s: %s", type(exc).__name__, exc, exc_info=exc)
        request.fail()
        self._release_request(request)
        error = RuntimeError(f"sampling failed for this request: {type(exc).__name__}: {exc}")
        jobs.settle(request.job.future, error=error)

    def _guarded(self, request: RequestState, fn, *args):
        """fn(*args), one request's own work: if it raises, that request fails (→ None)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one request's fault is that request's alone
            self._fail_request(request, exc)
            return None

    def _holds(self, slot: int, request: RequestState | None = None) -> bool:
        """Slot `slot` still runs a live request (`request`, if given): not freed by a failure."""
        holder = self.slots.request[slot]
        return holder is not None and (request is None or holder is request)

    # ================================================================ admission
    def admit(self) -> None:
        """Place waiting samples in free slots, prefill the new prompts, draw first tokens."""
        placements, to_prefill = self._place_waiting()
        if not placements:
            return
        for batch in self._prefill_batches(self._extend_cached(to_prefill)):
            self._prefill(batch)
        # A prompt's scores may have failed its request: its samples are not placed.
        placements = [placed for placed in placements if not placed.request.failed]
        self._copy_prompt_kv(placements)
        self.admitting = []
        self._draw_first_tokens(placements)

    def _place_waiting(self) -> tuple[list[Placement], ToPrefill]:
        """Samples of waiting requests onto the free slots, one per turn, round robin over
        owners, each owner within its slot cap (see the module docstring); and the requests
        placed for the first time, whose prompt is prefilled into their first slot."""
        free = list(self.slots.free_slots())
        placements: list[Placement] = []
        to_prefill: ToPrefill = []
        admitted: set[int] = set()
        held = self._slots_by_owner()
        cap = owner_cap(self.slots.num_slots)
        blocked = 0  # consecutive turns of owners at their cap
        while self.waiting and free and blocked < len(self.waiting.owners()):
            request = self.waiting.head()
            if request.job.future.cancelled():  # its slots, if any, were freed by drop_cancelled
                self.waiting.next_turn(done=True)
                continue
            if held.get(request.job.owner, 0) >= cap:
                blocked += 1
                self.waiting.next_turn(done=False)
                continue
            blocked = 0
            is_new = request.samples_placed == 0
            placed = Placement(request, request.place(1)[0], free.pop(0))
            held[request.job.owner] = held.get(request.job.owner, 0) + 1
            if is_new:
                to_prefill.append((request, placed.slot))
            placements.append(placed)
            if id(request) not in admitted:
                admitted.add(id(request))
                self.admitting.append(request)
            self.waiting.next_turn(done=request.samples_unplaced == 0)
        return placements, to_prefill

    def _slots_by_owner(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for request in self.slots.request:
            if request is not None:
                held[request.job.owner] = held.get(request.job.owner, 0) + 1
        return held

    def _prefill_batches(self, to_prefill: ToPrefill) -> list[ToPrefill]:
        """Group by weights of the forward (and whether full-prompt logits are needed), then
        chunk so rows x longest prompt stays within the budget."""
        batches: list[ToPrefill] = []
        for key in dict.fromkeys(_prefill_key(request) for request, _ in to_prefill):
            current: ToPrefill = []
            longest = 0
            for request, slot in to_prefill:
                if _prefill_key(request) != key:
                    continue
                length = len(request.spec.prompt)
                if current and (len(current) + 1) * max(longest, length) > self.max_prefill_tokens:
                    batches.append(current)
                    current, longest = [], 0
                current.append((request, slot))
                longest = max(longest, length)
            batches.append(current)
        return batches

    def _prefill(self, batch: ToPrefill) -> None:
        """One forward over a batch of prompts (left-padded to T), into their first slots."""
        requests = [request for request, _ in batch]
        first = requests[0]
        slots_B = torch.tensor([slot for _, slot in batch], device=self.device)
        prompts = [request.spec.prompt for request in requests]
        ids_B_T, positions_B_T, valid_B_T, mask = prefill_inputs(prompts, self.device)
        keep_all = first.spec.scores_prompt  # batches never mix (see _prefill_batches)
        hidden = keep_all and self.logprob_chunk_tokens > 0
        self.runner.cache.plan_prefill(slots_B, valid_B_T, positions_B_T)
        out_B_T = self.runner.forward(ids_B_T, positions_B_T, mask, 0 if keep_all else 1,
                                      full=_full_version(first), lora=self._lora_rows(requests),
                                      vision=self._vision(first, 0), hidden=hidden)  # an image prompt alone
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_prompts"] += len(batch)
        self._keep_prompt_routes(requests, 0)
        for row, (request, slot) in enumerate(batch):
            self._prefilled(request, self._prompt_logits(request, out_B_T[row], hidden))
            self._remember_prefix(request, slot)

    def _keep_prompt_routes(self, requests: list[RequestState], start: int) -> None:
        """A mixture-of-experts model's routes of the prompts just run (left-padded rows;
        the first `start` tokens came from the prefix cache: -1, not run), for replay."""
        routes = self.runner.routes
        if routes is None:
            return
        for row, request in enumerate(requests):
            n = len(request.spec.prompt)
            kept = np.full((n, *routes.shape[2:]), -1, np.int16)
            kept[start:] = routes[row, routes.shape[1] - (n - start):].numpy()
            request.prompt_routes = kept

    def _prompt_logits(self, request: RequestState, out_T: torch.Tensor, hidden: bool) -> PromptLogits:
        """One prompt's prefill output as logits: held ([T, V]), or its hidden states [T, H]
        under the LM head of the request's weights, `logprob_chunk_tokens` rows at a time."""
        if not hidden:
            return PromptLogits.of(out_T)
        full, lora, runner = _full_version(request), self._lora_rows([request]), self.runner

        def unembed(rows_H: torch.Tensor) -> torch.Tensor:
            self.stats["unembed_calls"] += 1  # the memory bound shows: no call is given more than a chunk
            self.stats["unembed_rows_max"] = max(self.stats["unembed_rows_max"], int(rows_H.shape[0]))
            return runner.unembed(rows_H, full, lora)

        return PromptLogits.from_hidden(out_T, unembed, self.logprob_chunk_tokens, runner.lm_head.vocab_size)

    def _prefilled(self, request: RequestState, logits_T_V: PromptLogits) -> None:
        """A prompt's logits are computed: keep the last row, score the prompt if asked."""
        request.keep_last_logits(logits_T_V)
        if request.spec.scores_prompt:
            self._guarded(request, request.score_prompt, logits_T_V)

    def _vision(self, request: RequestState, start: int) -> dict | None:
        """The image arguments of a forward over request's prompt[start:] (None: text only)."""
        images = request.job.images
        if images is None:
            return None
        return images.forward_kwargs(start, self.device, next(self.runner.model.parameters()).dtype)

    def _lora_rows(self, requests: list[RequestState]) -> LoraRows:
        """LoRA hook plan for a prefill batch: [(batch rows, adapter version)] (base rows: none)."""
        ids = [request.job.lora_version_id for request in requests]
        versions = {lora_id: request.job.version for lora_id, request in zip(ids, requests) if lora_id}
        if len(versions) == 1 and all(ids):
            return [(None, next(iter(versions.values())))]
        ids_B = np.asarray(ids)
        return [(self._on_device(np.flatnonzero(ids_B == lora_id)), version) for lora_id, version in versions.items()]

    def _copy_prompt_kv(self, placements: list[Placement]) -> None:
        """Give every placed sample its prompt's KV and occupy its slot: copied from the slot
        just prefilled (one gather/scatter per layer for all requests), or from the snapshot
        kept for samples placed after their prompt's prefill step."""
        by_request: dict[int, list[Placement]] = {}
        for placed in placements:
            by_request.setdefault(id(placed.request), []).append(placed)
        cache = self.runner.cache
        src: list[int] = []
        dst: list[int] = []
        length = 0
        for group in by_request.values():
            request, prompt_len = group[0].request, len(group[0].request.spec.prompt)
            if request.prompt_kv is not None:
                cache.restore_prefix(request.prompt_kv, self._on_device([placed.slot for placed in group]))
            else:
                src += [group[0].slot] * (len(group) - 1)
                dst += [placed.slot for placed in group[1:]]
                length = max(length, prompt_len) if len(group) > 1 else length
            if request.samples_unplaced > 0 and request.prompt_kv is None:
                request.prompt_kv = cache.snapshot_prefix(group[0].slot, prompt_len)
            elif request.samples_unplaced == 0:
                request.prompt_kv = None
        if dst:
            # Positions past a prompt's end are copied too; they are overwritten before use.
            cache.copy_slots(self._on_device(src), self._on_device(dst), length)
        for group in by_request.values():
            slots = np.array([placed.slot for placed in group])
            self.slots.occupy(slots, group[0].request, np.array([placed.sample for placed in group]))

    def _draw_first_tokens(self, placements: list[Placement]) -> None:
        """Each placed sample's first token, drawn from its prompt's last logits."""
        for placed in placements:
            if placed.request.spec.max_tokens == 0 and self._holds(placed.slot, placed.request):
                self._finish(placed.slot, stop=False)
        live = [placed for placed in placements if placed.request.spec.max_tokens > 0]
        if live:
            logits_B_V = torch.stack([placed.request.last_logits_V for placed in live])
            slots_B = np.array([placed.slot for placed in live])
            self._draw_and_record(logits_B_V, slots_B, np.arange(len(live)))
        for placed in placements:
            if placed.request.samples_unplaced == 0:
                placed.request.last_logits_V = None  # every sample has its first token

    # ================================================================ prefix cache
    def _extend_cached(self, to_prefill: ToPrefill) -> ToPrefill:
        """Prefill the prompts whose prefix is cached (under the same weights) from that
        prefix: its KV is copied into the slot and only the rest of the prompt is computed.
        Returns the others, for a full prefill."""
        rest: ToPrefill = []
        for request, slot in to_prefill:
            hit, snapshot = 0, None
            if self.prefix_cache is not None:
                hit, snapshot = self.prefix_cache.lookup(request.job.cache_key, request.job.prefix_tokens,
                                                         request.spec.first_scored_row)
                if hit and request.job.images is not None:  # never inside an image (sampling/vision.py)
                    hit = request.job.images.safe_hit(hit)
                    snapshot = [(k[:, :hit], v[:, :hit]) for k, v in snapshot]
            if not hit:
                rest.append((request, slot))
                continue
            self._extend(request, slot, hit, snapshot)
        return rest

    def _extend(self, request: RequestState, slot: int, hit: int, snapshot: Snapshot) -> None:
        """Restore the first `hit` prompt tokens' KV into `slot`; one forward over the rest."""
        prompt = request.spec.prompt
        cache = self.runner.cache
        cache.ensure_capacity(len(prompt))
        cache.restore_prefix(snapshot, torch.tensor([slot], device=self.device))
        ids_1_T, positions_1_T, mask = extend_inputs(prompt, hit, self.device)
        cache.plan_extend(slot, hit, len(prompt) - hit, self.device)
        keep_all = request.spec.scores_prompt
        hidden = keep_all and self.logprob_chunk_tokens > 0
        logits_T_V = self.runner.forward(ids_1_T, positions_1_T, mask, 0 if keep_all else 1,
                                         full=_full_version(request), lora=self._lora_rows([request]),
                                         vision=self._vision(request, hit), hidden=hidden)[0]  # or [T, H]
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_prompts"] += 1
        self.stats["prefix_cache_hit_tokens"] += hit
        request.cache_hit_tokens = hit
        self._keep_prompt_routes([request], hit)
        if keep_all:  # rows before the hit are never read (hit <= spec.first_scored_row)
            prompt_logits_P_V = logits_T_V.new_full((len(prompt), logits_T_V.shape[-1]), float("nan"))
            prompt_logits_P_V[hit:] = logits_T_V
            logits_T_V = prompt_logits_P_V
        self._prefilled(request, self._prompt_logits(request, logits_T_V, hidden))
        self._remember_prefix(request, slot)

    def _remember_prefix(self, request: RequestState, slot: int) -> None:
        """Keep the KV of this prompt's block-aligned prefix for later requests."""
        cache = self.prefix_cache
        if cache is None or request.failed:
            return
        length = cache.wanted_length(len(request.spec.prompt))
        prefix = request.job.prefix_tokens[:length]
        key = request.job.cache_key
        if length > 0 and not cache.contains(key, prefix):
            cache.insert(key, prefix, self.runner.cache.snapshot_prefix(slot, length), request.job.version)

    # ================================================================ decode
    def decode(self) -> None:
        """One forward over the active slots (one per set of full weights), one token each."""
        self._compact()
        slots = self.slots
        num_rows = slots.high()
        active = np.flatnonzero(slots.active[:num_rows])
        self._adopt_followed(active)
        kv_len = int(slots.position[active].max()) + 1
        full_ids = np.unique(slots.full_version_id[active])
        if len(full_ids) == 1:
            logits_B_V = self._decode_forward(slice(0, num_rows), np.arange(num_rows), kv_len, int(full_ids[0]))
        else:
            logits_B_V = None
            for full_id in full_ids:
                rows = active[slots.full_version_id[active] == full_id]
                rows_t = self._on_device(rows)
                part_B_V = self._decode_forward(rows_t, rows, kv_len, int(full_id))
                if logits_B_V is None:
                    logits_B_V = part_B_V.new_zeros((num_rows, part_B_V.shape[-1]))
                logits_B_V[rows_t] = part_B_V
        slots.position[active] += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(active)
        self._draw_and_record(logits_B_V, slice(0, num_rows), active)

    def _adopt_followed(self, active: np.ndarray) -> None:
        """Followed requests (`SamplingRequest.follow`): a slot whose follower has published
        a newer version runs this step's token on it; its KV of earlier tokens is kept."""
        slots = self.slots
        for slot in active.tolist():
            follow = slots.request[slot].spec.request.follow
            if follow is None:
                continue
            self._first_span(slot, follow)
            generation, version = follow.current()
            if generation > slots.generation[slot]:
                slots.switch_version(slot, version, generation)

    def _first_span(self, slot: int, follow) -> None:
        """Record the generation a followed slot started on (its request's version)."""
        slots = self.slots
        if not slots.spans[slot]:
            version = slots.version[slot]
            slots.switch_version(slot, version, follow.generation_of(version))
            slots.spans[slot][-1] = (0, int(slots.generation[slot]))

    def _compact(self) -> None:
        """Move the highest active sequences into the free slots below them, so the decode
        rows are exactly slots 0..n-1: no forward work for finished sequences (when no
        waiting sample refilled their slot) and the KV read stays a view. Each move copies
        one sequence's KV once; it happens only as the batch drains."""
        slots = self.slots
        active = np.flatnonzero(slots.active)
        movers = active[active >= active.size]
        if not movers.size:
            return
        holes = np.flatnonzero(~slots.active[: active.size])
        length = int(slots.position[movers].max())
        self.runner.cache.copy_slots(self._on_device(movers), self._on_device(holes), length)
        slots.move(movers, holes)
        self.stats["moves"] += int(movers.size)

    def _decode_forward(self, slot_rows, rows: np.ndarray, kv_len: int, full_id: int) -> torch.Tensor:
        """Logits [len(rows), V] of one decode forward over the slots `rows` (`slot_rows`:
        the same on the device, or a slice) that all run on full version `full_id` (0: base)."""
        slots = self.slots
        positions_B = torch.as_tensor(slots.position[rows], device=self.device)
        ids_B_1 = torch.as_tensor(slots.last_token[rows], device=self.device)[:, None]
        active = slots.active[rows]
        full = slots.version[rows[active][0]] if full_id else None
        lora = self._decode_lora_rows(rows, active)
        self.runner.cache.plan_decode(slot_rows, positions_B, kv_len)
        vision = None
        if slots.rope_delta[rows].any():  # image prompts: M-RoPE runs `delta` ahead of the cache position
            mrope_B = positions_B + torch.as_tensor(slots.rope_delta[rows], device=self.device)
            vision = {"position_ids": torch.stack([positions_B, mrope_B, mrope_B, mrope_B])[:, :, None]}
        logits_B_1_V = self.runner.forward(ids_B_1, positions_B[:, None], decode_mask(positions_B, kv_len), 1,
                                           full=full, lora=lora, vision=vision)
        if self.runner.routes is not None:  # a mixture-of-experts model: each row's fed-back token's experts
            routes = self.runner.routes[:, 0].numpy()
            for row in np.flatnonzero(active).tolist():
                slots.out_routes[int(rows[row])].append(routes[row])
        return logits_B_1_V[:, -1]

    def _decode_lora_rows(self, rows: np.ndarray, active: np.ndarray) -> LoraRows:
        """LoRA hook plan for decode rows: one adapter for all rows in the common case."""
        slots = self.slots
        ids_B = np.where(active, slots.lora_version_id[rows], 0)
        live = ids_B[active]
        if not live.any():
            return []

        def version(lora_id) -> TorchWeightVersion:
            return slots.version[rows[int(np.argmax(ids_B == lora_id))]]

        if live[0] and (live == live[0]).all():
            return [(None, version(live[0]))]  # idle rows take the delta too; their output is unused
        return [(self._on_device(np.flatnonzero(ids_B == lora_id)), version(lora_id))
                for lora_id in np.unique(live[live > 0])]

    # ================================================================ drawing tokens
    def _row_params(self, slots_B) -> RowParams:
        """Sampling parameters of the slots `slots_B` (a slice or an array of slots)."""
        slots, device = self.slots, self.device
        greedy = slots.greedy[slots_B]
        filtered = (slots.top_k[slots_B] < slots.vocab_size) | (slots.top_p[slots_B] < 1.0)
        return RowParams(
            temperature=torch.as_tensor(slots.temperature[slots_B], device=device),
            top_k=torch.as_tensor(slots.top_k[slots_B], device=device),
            top_p=torch.as_tensor(slots.top_p[slots_B], device=device),
            greedy=torch.as_tensor(greedy, device=device),
            all_greedy=bool(greedy.all()),
            any_filter=bool((filtered & ~greedy).any()),
        )

    def _draw_and_record(self, logits_B_V: torch.Tensor, slots_B, picked: np.ndarray) -> None:
        """Draw a token for every row of `logits_B_V` (row b belongs to slot `slots_B[b]`, a
        slice or an array) and record those of the rows `picked`; then end the finished."""
        slots = self.slots
        recorded_N = np.arange(slots.num_slots)[slots_B][picked]  # the slots whose tokens count
        uniforms_B = torch.as_tensor(_uniforms(slots, slots_B), device=self.device)
        params = self._row_params(slots_B)
        draw = draw_tokens(logits_B_V, params, uniforms_B)
        picked_t = self._on_device(picked)
        tokens_N = draw.tokens[picked_t]
        raw_logprobs_N = draw.raw_logprobs[picked_t].gather(1, tokens_N[:, None]).squeeze(1)
        processed_N = torch.as_tensor(slots.processed_logprobs[recorded_N], device=self.device)
        logprobs_N = torch.where(processed_N, draw.processed_logprob[picked_t], raw_logprobs_N)
        tokens_np = tokens_N.cpu().numpy()
        logprobs_np = logprobs_N.cpu().numpy()
        slots.record(recorded_N, tokens_np, logprobs_np)
        if (slots.num_top_logprobs[recorded_N] > 0).any():
            self._record_top_logprobs(logits_B_V, draw.raw_logprobs, params, recorded_N, picked)
        self._stream_tokens(recorded_N, tokens_np, logprobs_np)
        self._end_finished(recorded_N, tokens_np)

    def _stream_tokens(self, slots_N: np.ndarray, tokens_N: np.ndarray, logprobs_N: np.ndarray) -> None:
        """Hand each streaming request (`SamplingRequest.on_tokens`) its samples' new tokens;
        a callback that raises fails its own request only."""
        for index, slot in enumerate(slots_N.tolist()):
            request = self.slots.request[slot]
            if request is not None and request.job.on_tokens is not None:
                self._guarded(request, request.job.on_tokens, int(self.slots.sample[slot]),
                              [int(tokens_N[index])], [float(logprobs_N[index])])

    def _record_top_logprobs(self, logits_B_V, raw_logprobs_B_V, params: RowParams, slots_N: np.ndarray,
                             rows_N: np.ndarray) -> None:
        """Top logprobs of the slots that want them (slot slots_N[n] drew from row rows_N[n]):
        one batched computation; if it raises (e.g. one request's k is too large to allocate),
        again per request, so that only the request(s) whose own computation raises fail."""
        want = self.slots.num_top_logprobs[slots_N] > 0
        slots_N, rows_N = slots_N[want], rows_N[want]
        try:
            found = self._top_logprobs(logits_B_V, raw_logprobs_B_V, params, slots_N, rows_N)
        except Exception:  # noqa: BLE001 - retried per request below
            log.warning("batched top-k logprobs failed; computing them per request", exc_info=True)
            for request, idx in self._by_request(slots_N):
                self._guarded(request, self._record_top_logprobs_of, logits_B_V, raw_logprobs_B_V, params,
                              slots_N[idx], rows_N[idx])
            return
        self._append_top_logprobs(slots_N, *found)

    def _record_top_logprobs_of(self, logits_B_V, raw_logprobs_B_V, params: RowParams, slots_N: np.ndarray,
                                rows_N: np.ndarray) -> None:
        self._append_top_logprobs(slots_N, *self._top_logprobs(logits_B_V, raw_logprobs_B_V, params, slots_N, rows_N))

    def _top_logprobs(self, logits_B_V, raw_logprobs_B_V, params: RowParams, slots_N: np.ndarray,
                      rows_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logprobs) [N, K] of the K most likely tokens, K = the slots' largest count."""
        slots = self.slots
        rows_t = self._on_device(rows_N)
        logprobs_N_V = raw_logprobs_B_V[rows_t]
        if slots.processed_logprobs[slots_N].any():
            processed_N_V = processed_logprobs(logits_B_V[rows_t], _subset(params, rows_t))
            processed_N = torch.as_tensor(slots.processed_logprobs[slots_N], device=self.device)
            logprobs_N_V = torch.where(processed_N[:, None], processed_N_V, logprobs_N_V)
        k = int(slots.num_top_logprobs[slots_N].max())
        try:
            failpoints.hit("sampler.top_logprobs", key=self._sequence_ids(slots_N))
            ids_N_K, values_N_K = top_logprobs(logprobs_N_V, k)
        except MemoryError as exc:  # an allocation failure is about the size: name the matrix
            raise MemoryError(f"cannot allocate top-{k} of a {tuple(logprobs_N_V.shape)} matrix ({exc})") from exc
        return ids_N_K.cpu().numpy(), values_N_K.cpu().numpy()

    def _sequence_ids(self, slots_N: np.ndarray) -> str:
        """The sequence ids the slots of `slots_N` decode, space-separated (a fail point's key)."""
        slots = self.slots
        held = [(slots.request[s], int(slots.sample[s])) for s in slots_N.tolist() if slots.request[s] is not None]
        return " ".join(str(request.spec.sequence_ids[sample]) for request, sample in held)

    def _append_top_logprobs(self, slots_N: np.ndarray, ids_N_K: np.ndarray, values_N_K: np.ndarray) -> None:
        for index, slot in enumerate(slots_N):
            self.slots.out_top_logprobs[slot].append((ids_N_K[index], values_N_K[index]))

    def _by_request(self, slots_N: np.ndarray) -> list[tuple[RequestState, np.ndarray]]:
        """[(request, indices into slots_N)] for the live requests of `slots_N`."""
        groups: dict[int, tuple[RequestState, list[int]]] = {}
        for index, slot in enumerate(slots_N.tolist()):
            request = self.slots.request[slot]
            if request is not None:
                groups.setdefault(id(request), (request, []))[1].append(index)
        return [(request, np.asarray(idx)) for request, idx in groups.values()]

    # ================================================================ finishing
    def _end_finished(self, slots_N: np.ndarray, tokens_N: np.ndarray) -> None:
        """Finish the sequences of `slots_N` that drew a stop token, ended a stop string, or
        reached max_tokens."""
        slots = self.slots
        stop = slots.stop_token_hit(slots_N, tokens_N)
        for index in np.flatnonzero(slots.has_stop_strings[slots_N] & ~stop):
            slot = int(slots_N[index])
            if self._holds(slot):
                stop[index] = bool(self._guarded(slots.request[slot], self._stop_string_hit, slot))
        done = stop | (slots.num_generated[slots_N] >= slots.max_tokens[slots_N])
        for index in np.flatnonzero(done):
            slot = int(slots_N[index])
            if self._holds(slot):  # not freed by its request's failure earlier in this step
                self._finish(slot, bool(stop[index]))

    def _stop_string_hit(self, slot: int) -> bool:
        failpoints.hit("sampler.decode_request")
        failpoints.hit("sampler.stop_strings")
        slots = self.slots
        text = self.decode_text(slots.out_tokens[slot, : slots.num_generated[slot]].tolist())
        return any(stop in text for stop in slots.request[slot].spec.stop_strings)

    def _finish(self, slot: int, stop: bool) -> None:
        """Slot `slot`'s sequence is done: store it, free the slot, answer its request if complete."""
        request = self.slots.request[slot]
        self._guarded(request, self._finish_sequence, request, slot, stop)

    def _finish_sequence(self, request: RequestState, slot: int, stop: bool) -> None:
        slots = self.slots
        sample, length = int(slots.sample[slot]), int(slots.num_generated[slot])
        spec = request.spec
        failpoints.hit("sampler.decode_request", key=str(spec.sequence_ids[sample]))
        sequence = jobs.sampled_sequence(
            slots.out_tokens[slot, :length], slots.out_logprobs[slot, :length], slots.out_top_logprobs[slot],
            spec.topk_sample_logprobs, stop, spec.sequence_ids[sample],
        )
        if request.prompt_routes is not None:
            sequence = with_routes(sequence, request.prompt_routes, slots.out_routes[slot])
        follow = spec.request.follow
        if follow is not None:
            self._first_span(slot, follow)
            sequence = with_spans(sequence, slots.spans[slot])
        slots.release(slot)
        self.stats["sequences"] += 1
        if request.finish_sample(sample, sequence):
            jobs.settle(request.job.future, result=request.response())

    def _on_device(self, values) -> torch.Tensor:
        return torch.as_tensor(values, device=self.device)


def _prefill_key(request: RequestState) -> tuple[int, bool, int]:
    """Prompts prefilled in one forward share their full weights and whether every position's
    logits are kept; an image prompt is prefilled alone (its M-RoPE positions and pixels are its own)."""
    return request.job.full_version_id, request.spec.scores_prompt, id(request) if request.job.images else 0


def _full_version(request: RequestState) -> TorchWeightVersion | None:
    """The full version a request's forward runs with (None: the base module)."""
    return request.job.version if request.job.full_version_id else None


def _uniforms(slots: SlotTable, slots_B) -> np.ndarray:
    """The uniform draw of each of the slots `slots_B` at its current step."""
    return rng.uniforms(slots.rng_key[slots_B], slots.num_generated[slots_B])


def _subset(params: RowParams, rows: torch.Tensor) -> RowParams:
    return RowParams(params.temperature[rows], params.top_k[rows], params.top_p[rows], params.greedy[rows],
                     params.all_greedy, params.any_filter)
