"""Continuous batching over KV-cache slots.

One `step()` = admit waiting samples into free slots (prefilling new prompts, one
prefill per prompt however many samples it has), then one decode forward for every
active slot. A sequence that finishes frees its slot at once, and the next step fills it
with a waiting sample — requests of any length share the batch without waiting for the
longest one. Only the sampler's worker thread calls into a Scheduler.

Prefix cache (`prefix_cache.PrefixCache`, optional): a prompt whose block-aligned prefix
was prefilled before under the same weights gets that prefix's KV copied into its slot and
only the rest computed (one forward of the remaining tokens over the restored prefix);
positions the response must score are never served from the cache
(`ResolvedRequest.first_scored_row`), so results do not depend on a hit.

Fault isolation: the work that belongs to one request (its prompt logprobs, its top-k
logprobs when the batched computation fails, its stop-string checks, building its
response) runs under `_guarded`; if it raises, `fail_job` fails that request alone (its
slots are freed, its other rows in the step are skipped) and the step goes on for every
other row. Only a failure of the shared work (the batched forwards, the draw) escapes
`step()`, and the sampler then fails the requests in flight.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from ember import failpoints
from ember.sampling import jobs as J
from ember.sampling import rng
from ember.sampling.logits import RowParams, draw_tokens, processed_logprobs, top_logprobs
from ember.sampling.prefix_cache import PrefixCache
from ember.sampling.runner import ModelRunner, decode_mask, extend_inputs, prefill_inputs
from ember.sampling.slots import Placement, SlotTable

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, slots: SlotTable, device: torch.device, max_prefill_tokens: int,
                 decode_text=None, prefix_cache: PrefixCache | None = None) -> None:
        self.runner = runner
        self.slots = slots
        self.device = device
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_text = decode_text  # token ids -> str, for stop strings
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self.waiting: deque[J.Job] = deque()
        self.admitting: list[J.Job] = []  # jobs between leaving `waiting` and holding slots
        self.stats = {"prefill_forwards": 0, "prefill_prompts": 0, "decode_steps": 0, "decode_rows": 0,
                      "sequences": 0, "moves": 0, "prefix_cache_hit_tokens": 0}

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or bool(self.slots.active.any())

    def step(self) -> None:
        self.admit()
        if self.slots.active.any():
            self.decode()

    def in_flight(self) -> list[J.Job]:
        """Jobs holding a slot or being admitted (those to fail if a forward raises)."""
        jobs = [j for j in self.slots.job if j is not None] + self.admitting
        return list({id(j): j for j in jobs}.values())

    def reset(self) -> None:
        """Forget every slot (after a failed forward; their jobs have been failed)."""
        for s in np.flatnonzero(self.slots.active):
            self.slots.release(int(s))
        self.admitting = []

    def fail_job(self, job: J.Job, exc: BaseException) -> None:
        """Fail one request alone: free its slots, drop it from the queues, tell its caller
        (with its own error only). Its rows still in this step's arrays are skipped (`_holds`)."""
        log.error("sampling request failed alone: %s: %s", type(exc).__name__, exc, exc_info=exc)
        job.failed = True
        for slot, holder in enumerate(self.slots.job):
            if holder is job:
                self.slots.release(slot)
        self.waiting = deque(j for j in self.waiting if j is not job)
        self.admitting = [j for j in self.admitting if j is not job]
        job.last_logits = job.prefix = None
        J.settle(job.future, error=RuntimeError(f"sampling failed for this request: {type(exc).__name__}: {exc}"))

    def _guarded(self, job: J.Job, fn, *args):
        """fn(*args), one request's own work: if it raises, that request fails (→ None)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one request's fault is that request's alone
            self.fail_job(job, exc)
            return None

    def _holds(self, slot: int, job: J.Job | None = None) -> bool:
        """Slot `slot` still runs a live request (`job`, if given): not freed by a failure."""
        holder = self.slots.job[slot]
        return holder is not None and (job is None or holder is job)

    # ================================================================ admission
    def admit(self) -> None:
        free = list(self.slots.free_slots())
        placements: list[Placement] = []
        to_prefill: list[tuple[J.Job, int]] = []
        while self.waiting and free:
            job = self.waiting[0]
            if job.future.cancelled() and job.next_sample == 0:
                self.waiting.popleft()
                continue
            take = min(job.remaining, len(free))
            first = job.next_sample
            new = [Placement(job, first + i, free.pop(0)) for i in range(take)]
            job.next_sample += take
            if not job.prefilled:
                to_prefill.append((job, new[0].slot))
            placements += new
            if job.remaining == 0:
                self.waiting.popleft()
            self.admitting.append(job)
        if not placements:
            return
        for batch in self._prefill_batches(self._extend_cached(to_prefill)):
            self._prefill(batch)
        placements = [p for p in placements if not p.job.failed]  # a prompt's scores may have failed it
        self._seed_slots(placements)
        self.admitting = []
        self._first_tokens(placements)

    def _prefill_batches(self, items: list[tuple[J.Job, int]]) -> list[list[tuple[J.Job, int]]]:
        """Group by forward group (and whether full-prompt logits are needed), then chunk so
        rows x longest prompt stays within the budget."""
        batches: list[list[tuple[J.Job, int]]] = []
        key = lambda job: (job.group, job.wants_prompt_logprobs)  # noqa: E731
        for group in dict.fromkeys(key(j) for j, _ in items):
            current: list[tuple[J.Job, int]] = []
            longest = 0
            for item in (it for it in items if key(it[0]) == group):
                n = len(item[0].spec.prompt)
                if current and (len(current) + 1) * max(longest, n) > self.max_prefill_tokens:
                    batches.append(current)
                    current, longest = [], 0
                current.append(item)
                longest = max(longest, n)
            batches.append(current)
        return batches

    def _prefill(self, batch: list[tuple[J.Job, int]]) -> None:
        prompts = [j.spec.prompt for j, _ in batch]
        slots = torch.tensor([s for _, s in batch], device=self.device)
        ids, pos, valid, mask = prefill_inputs(prompts, self.device)
        full = batch[0][0].version if batch[0][0].group else None
        lora = self._lora_rows([j.version if j.lora_id else None for j, _ in batch])
        keep_all = batch[0][0].wants_prompt_logprobs  # batches never mix (see _prefill_batches)
        self.runner.cache.plan_prefill(slots, valid, pos)
        logits = self.runner.forward(ids, pos, mask, 0 if keep_all else 1, full=full, lora=lora)
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_prompts"] += len(batch)
        for b, (job, slot) in enumerate(batch):
            self._prefilled(job, logits[b])
            self._remember(job, slot)

    def _prefilled(self, job: J.Job, logits_T_V: torch.Tensor) -> None:
        job.last_logits = logits_T_V[-1].clone()  # not a view: the batch's logits are freed
        job.prefilled = True
        if job.wants_prompt_logprobs:
            self._guarded(job, self._prompt_scores, job, logits_T_V)

    # ================================================================ prefix cache
    def _extend_cached(self, items: list[tuple[J.Job, int]]) -> list[tuple[J.Job, int]]:
        """Prefill the prompts whose prefix is cached (under the same weights) from that
        prefix: its KV is copied into the slot and only the rest of the prompt is computed.
        Returns the others, for a full prefill."""
        rest = []
        for job, slot in items:
            pc = self.prefix_cache
            hit, snap = (0, None) if pc is None else pc.lookup(_weights_key(job), job.spec.prompt,
                                                                 job.spec.first_scored_row)
            if not hit:
                rest.append((job, slot))
                continue
            self._extend(job, slot, hit, snap)
        return rest

    def _extend(self, job: J.Job, slot: int, hit: int, snap) -> None:
        prompt = job.spec.prompt
        cache = self.runner.cache
        cache.ensure_capacity(len(prompt))
        cache.restore_prefix(snap, torch.tensor([slot], device=self.device))
        ids, pos, mask = extend_inputs(prompt, hit, self.device)
        cache.plan_extend(slot, hit, len(prompt) - hit, self.device)
        keep_all = job.wants_prompt_logprobs
        lora = self._lora_rows([job.version if job.lora_id else None])
        logits = self.runner.forward(ids, pos, mask, 0 if keep_all else 1, full=job.version if job.group else None,
                                     lora=lora)[0]
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_prompts"] += 1
        self.stats["prefix_cache_hit_tokens"] += hit
        job.cache_hit_tokens = hit
        if keep_all:  # rows before the hit are never read (hit <= spec.first_scored_row)
            full = logits.new_full((len(prompt), logits.shape[-1]), float("nan"))
            full[hit:] = logits
            logits = full
        self._prefilled(job, logits)
        self._remember(job, slot)

    def _remember(self, job: J.Job, slot: int) -> None:
        """Keep the KV of this prompt's block-aligned prefix for later requests."""
        pc = self.prefix_cache
        if pc is None or job.failed:
            return
        n = pc.wanted_length(len(job.spec.prompt))
        prefix = job.spec.prompt[:n]
        if n > 0 and not pc.contains(_weights_key(job), prefix):
            pc.insert(_weights_key(job), prefix, self.runner.cache.snapshot_prefix(slot, n), job.version)

    @staticmethod
    def _prompt_scores(job: J.Job, logits_T_V: torch.Tensor) -> None:
        p = len(job.spec.prompt)
        spec = job.spec
        if spec.include_prompt_logprobs or spec.topk_prompt_logprobs > 0:
            job.prompt_logprobs, job.prompt_topk = J.prompt_scores(logits_T_V[-p:], spec.prompt, spec)
        job.target_logprobs, job.alt_tokens = J.prompt_extras(logits_T_V[-p:], spec)

    def _lora_rows(self, versions: list) -> list[tuple[torch.Tensor | None, object]]:
        """[(batch rows, version)] for the LoRA versions among `versions` (None = base row)."""
        ids = [v.version_id if v is not None else 0 for v in versions]
        distinct = {i: v for i, v in zip(ids, versions) if i}
        if len(distinct) == 1 and all(ids):
            return [(None, next(iter(distinct.values())))]
        arr = np.asarray(ids)
        return [(torch.as_tensor(np.flatnonzero(arr == i), device=self.device), v) for i, v in distinct.items()]

    def _seed_slots(self, placements: list[Placement]) -> None:
        """Give every placed sample its prompt's KV: copied from the slot just prefilled
        (one gather/scatter per layer for all jobs), or from a snapshot for samples
        placed after their prompt's prefill step."""
        by_job: dict[int, list[Placement]] = {}
        for p in placements:
            by_job.setdefault(id(p.job), []).append(p)
        cache = self.runner.cache
        src: list[int] = []
        dst: list[int] = []
        length = 0
        for group in by_job.values():
            job, n = group[0].job, len(group[0].job.spec.prompt)
            if job.prefix is not None:
                cache.restore_prefix(job.prefix, torch.tensor([p.slot for p in group], device=self.device))
            else:
                src += [group[0].slot] * (len(group) - 1)
                dst += [p.slot for p in group[1:]]
                length = max(length, n) if len(group) > 1 else length
            if job.remaining > 0 and job.prefix is None:
                job.prefix = cache.snapshot_prefix(group[0].slot, n)
            elif job.remaining == 0:
                job.prefix = None
        if dst:
            # Positions past a prompt's end are copied too; they are overwritten before use.
            as_t = lambda xs: torch.tensor(xs, device=self.device)  # noqa: E731
            cache.copy_slots(as_t(src), as_t(dst), length)
        for group in by_job.values():
            job = group[0].job
            slots = np.array([p.slot for p in group])
            self.slots.occupy(slots, job, np.array([p.sample for p in group]), job.group, job.lora_id)

    def _first_tokens(self, placements: list[Placement]) -> None:
        """Each placed sample's first token, drawn from its prompt's last logits."""
        for p in placements:
            if p.job.spec.max_tokens == 0 and self._holds(p.slot, p.job):
                self._finish(p.slot, stop=False)
        live = [p for p in placements if p.job.spec.max_tokens > 0]
        if live:
            logits = torch.stack([p.job.last_logits for p in live])
            self._sample_and_record(logits, np.array([p.slot for p in live]))
        for p in placements:
            if p.job.remaining == 0:
                p.job.last_logits = None  # every sample has its first token

    # ================================================================ decode
    def decode(self) -> None:
        self._compact()
        s = self.slots
        hi = s.high()
        act = np.flatnonzero(s.active[:hi])
        kv_len = int(s.pos[act].max()) + 1
        groups = np.unique(s.group[act])
        if len(groups) == 1:
            logits = self._decode_forward(slice(0, hi), np.arange(hi), kv_len, int(groups[0]))
        else:
            logits = None
            for g in groups:
                rows = act[s.group[act] == g]
                part = self._decode_forward(torch.as_tensor(rows, device=self.device), rows, kv_len, int(g))
                if logits is None:
                    logits = part.new_zeros((hi, part.shape[-1]))
                logits[torch.as_tensor(rows, device=self.device)] = part
        s.pos[act] += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(act)
        self._sample_and_record(logits, act, hi)

    def _compact(self) -> None:
        """Move the highest active sequences into the free slots below them, so the decode
        rows are exactly slots 0..n-1: no forward work for finished sequences (when no
        waiting sample refilled their slot) and the KV read stays a view. Each move copies
        one sequence's KV once; it happens only as the batch drains."""
        s = self.slots
        act = np.flatnonzero(s.active)
        movers = act[act >= act.size]
        if not movers.size:
            return
        holes = np.flatnonzero(~s.active[: act.size])
        length = int(s.pos[movers].max())
        as_t = lambda xs: torch.as_tensor(xs, device=self.device)  # noqa: E731
        self.runner.cache.copy_slots(as_t(movers), as_t(holes), length)
        s.move(movers, holes)
        self.stats["moves"] += int(movers.size)

    def _decode_forward(self, slot_rows, rows: np.ndarray, kv_len: int, group: int) -> torch.Tensor:
        """Logits [len(rows), V] of one decode forward over the given slots."""
        s = self.slots
        positions = torch.as_tensor(s.pos[rows], device=self.device)
        ids = torch.as_tensor(s.last_tok[rows], device=self.device)[:, None]
        active = s.active[rows]
        full = s.job[rows[active][0]].version if group else None
        lora = self._decode_lora(rows, active)
        self.runner.cache.plan_decode(slot_rows, positions, kv_len)
        logits = self.runner.forward(ids, positions[:, None], decode_mask(positions, kv_len), 1, full=full, lora=lora)
        return logits[:, -1]

    def _decode_lora(self, rows: np.ndarray, active: np.ndarray) -> list:
        """LoRA hook plan for decode rows: one adapter for all rows in the common case."""
        s = self.slots
        ids = np.where(active, s.lora[rows], 0)
        live = ids[active]
        if not live.any():
            return []

        def version(i):
            return s.job[rows[int(np.argmax(ids == i))]].version

        if live[0] and (live == live[0]).all():
            return [(None, version(live[0]))]  # idle rows take the delta too; their output is unused
        return [(torch.as_tensor(np.flatnonzero(ids == i), device=self.device), version(i))
                for i in np.unique(live[live > 0])]

    # ================================================================ sampling + bookkeeping
    def _params(self, index) -> RowParams:
        """Sampling parameters of the slots `index` (a slice or an array of slots)."""
        s, d = self.slots, self.device
        greedy = s.greedy[index]
        filt = (s.top_k[index] < s.vocab_size) | (s.top_p[index] < 1.0)
        return RowParams(
            temperature=torch.as_tensor(s.temperature[index], device=d),
            top_k=torch.as_tensor(s.top_k[index], device=d),
            top_p=torch.as_tensor(s.top_p[index], device=d),
            greedy=torch.as_tensor(greedy, device=d),
            all_greedy=bool(greedy.all()),
            any_filter=bool((filt & ~greedy).any()),
        )

    def _sample_and_record(self, logits: torch.Tensor, rows: np.ndarray, hi: int | None = None) -> None:
        """Draw one token for each of `rows` (logits are per row, or per slot 0..hi-1 if hi)."""
        s = self.slots
        if hi is None:  # logits row i belongs to slot rows[i]: gather the slot state by rows
            params = self._params(rows)
            keys, steps, sel = s.keys[rows], s.n_gen[rows], np.arange(len(rows))
        else:
            params = self._params(slice(0, hi))
            keys, steps, sel = s.keys[:hi], s.n_gen[:hi], rows
        u = torch.as_tensor(rng.uniforms(keys, steps), device=self.device)
        draw = draw_tokens(logits, params, u)
        processed = torch.as_tensor(s.processed[rows], device=self.device)
        sel_t = torch.as_tensor(sel, device=self.device)
        tok = draw.tokens[sel_t]
        raw_lp = draw.raw_logprobs[sel_t].gather(1, tok[:, None]).squeeze(1)
        lp = torch.where(processed, draw.processed_logprob[sel_t], raw_lp)
        tok_np = tok.cpu().numpy()
        s.record(rows, tok_np, lp.cpu().numpy())
        if (s.topk[rows] > 0).any():
            self._record_topk(logits, draw.raw_logprobs, params, rows, sel)
        self._check_finished(rows, tok_np)

    def _record_topk(self, logits, raw, params: RowParams, rows: np.ndarray, sel: np.ndarray) -> None:
        """Top-k logprobs of the rows that want them: one batched computation; if it raises
        (e.g. one request's k is too large to allocate), again per request, so that only the
        request(s) whose own computation raises fail."""
        want = self.slots.topk[rows] > 0
        rows, sel = rows[want], sel[want]
        try:
            found = self._topk(logits, raw, params, rows, sel)
        except Exception:  # noqa: BLE001 - retried per request below
            log.warning("batched top-k logprobs failed; computing them per request", exc_info=True)
            for job, idx in self._by_job(rows):
                self._guarded(job, self._record_topk_rows, logits, raw, params, rows[idx], sel[idx])
            return
        self._append_topk(rows, *found)

    def _record_topk_rows(self, logits, raw, params: RowParams, rows: np.ndarray, sel: np.ndarray) -> None:
        self._append_topk(rows, *self._topk(logits, raw, params, rows, sel))

    def _topk(self, logits, raw, params: RowParams, rows: np.ndarray, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logprobs) [len(rows), k] of the k most likely tokens, k = the rows' largest."""
        s = self.slots
        sel_t = torch.as_tensor(sel, device=self.device)
        mats = raw[sel_t]
        if s.processed[rows].any():
            proc = processed_logprobs(logits[sel_t], _subset(params, sel_t))
            mats = torch.where(torch.as_tensor(s.processed[rows], device=self.device)[:, None], proc, mats)
        ids, vals = top_logprobs(mats, int(s.topk[rows].max()))
        return ids.cpu().numpy(), vals.cpu().numpy()

    def _append_topk(self, rows: np.ndarray, ids_np: np.ndarray, vals_np: np.ndarray) -> None:
        for i, r in enumerate(rows):
            self.slots.out_topk[r].append((ids_np[i], vals_np[i]))

    def _by_job(self, rows: np.ndarray) -> list[tuple[J.Job, np.ndarray]]:
        """[(job, indices into rows)] for the live jobs of `rows`."""
        groups: dict[int, tuple[J.Job, list[int]]] = {}
        for i, r in enumerate(rows.tolist()):
            job = self.slots.job[r]
            if job is not None:
                groups.setdefault(id(job), (job, []))[1].append(i)
        return [(job, np.asarray(idx)) for job, idx in groups.values()]

    def _check_finished(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        s = self.slots
        stop = s.stop_token_hit(rows, tokens)
        for i in np.flatnonzero(s.stop_str[rows] & ~stop):
            slot = int(rows[i])
            if self._holds(slot):
                stop[i] = bool(self._guarded(s.job[slot], self._stop_string_hit, slot))
        done = stop | (s.n_gen[rows] >= s.max_new[rows])
        for i in np.flatnonzero(done):
            slot = int(rows[i])
            if self._holds(slot):  # not freed by its request's failure earlier in this step
                self._finish(slot, bool(stop[i]))

    def _stop_string_hit(self, slot: int) -> bool:
        failpoints.hit("sampler.decode_request")
        s = self.slots
        text = self.decode_text(s.out_tok[slot, : s.n_gen[slot]].tolist())
        return any(stop in text for stop in s.job[slot].spec.stop_strings)

    def _finish(self, slot: int, stop: bool) -> None:
        """Slot `slot`'s sequence is done: store it, free the slot, answer its request if complete."""
        job = self.slots.job[slot]
        self._guarded(job, self._finish_sequence, job, slot, stop)

    def _finish_sequence(self, job: J.Job, slot: int, stop: bool) -> None:
        failpoints.hit("sampler.decode_request")
        s = self.slots
        sample, n = int(s.sample[slot]), int(s.n_gen[slot])
        spec = job.spec
        seq = J.sampled_sequence(
            s.out_tok[slot, :n], s.out_lp[slot, :n], s.out_topk[slot], spec.topk_sample_logprobs, stop,
            spec.sequence_ids[sample],
        )
        s.release(slot)
        self.stats["sequences"] += 1
        if job.finish_sample(sample, seq):
            job.last_logits = None
            J.settle(job.future, result=job.response())


def _weights_key(job: J.Job) -> tuple[int, int]:
    """Which weights computed a job's KV: (full version id or 0, LoRA version id or 0)."""
    return job.group, job.lora_id


def _subset(p: RowParams, idx: torch.Tensor) -> RowParams:
    return RowParams(p.temperature[idx], p.top_k[idx], p.top_p[idx], p.greedy[idx], p.all_greedy, p.any_filter)
