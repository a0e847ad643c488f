"""A slot-based KV cache handed to Hugging Face models as `past_key_values`.

transformers' documented extension point is the `Cache` class and its per-layer
`CacheLayerMixin`; attention modules call `past_key_values.update(k, v, layer_idx)` and
attend over whatever it returns. `SlotCache` gives every sequence a fixed slot
(`[num_slots, kv_heads, capacity, head_dim]` per layer) and is told, before each forward,
where the new keys go (`plan_prefill` / `plan_decode`). The model receives explicit
`position_ids` (one row per sequence) and a 4-D boolean attention mask, which
`create_causal_mask` passes through unchanged, so each row attends only to its own
valid cache entries — no transformers code is patched.

Two kinds of forward:

* prefill: rows are prompts left-padded to a common length T, starting from empty slots.
  The new keys are written to the slots (pad columns are skipped) and returned as they
  are: attention runs over the T new positions only.
* decode: one new token per row. Row r writes position `pos[r]` of slot `slots[r]` and
  attends over positions `[0, kv_len)` of that slot (the mask hides the stale tail).
  When the rows are slots 0..n-1 in order, the read is a view (no copy).

The cache grows its capacity on demand (doubling, up to `max_len`), so memory follows
the longest live sequence rather than the configured maximum.

Linear-attention layers (Qwen3.5's Gated DeltaNet, `layer_types` "linear_attention") keep
no KV: each slot holds that layer's recurrent state instead, a short convolution's last
columns and the delta-rule matrix (`RecurrentSlotLayer`, through transformers' documented
`LinearAttentionCacheLayerMixin`, whose `conv_states` / `recurrent_states` /
`has_previous_state` the modeling code reads and whose `update_conv_state` /
`update_recurrent_state` it calls). A prefill writes the state after each prompt's last
token into its slot (the left pads are zeroed by the model's padding mask, so the state
before a prompt's first token is zero, as for a fresh sequence); a decode step reads the
rows' states and writes them back. The state is the whole sequence's, not a prefix's, so a
prefix-cache extend is refused for such a model (`TorchSampler` turns its prefix cache off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin


@dataclass
class _Plan:
    prefill: bool
    slots: torch.Tensor | slice  # [B] slot of each row, or slice(0, B) for slots 0..B-1
    positions: torch.Tensor  # prefill: [M] positions of the valid tokens; decode: [B]
    valid: torch.Tensor | None = None  # prefill: [B, T] which columns are real tokens
    write_slots: torch.Tensor | None = None  # prefill: [M] slot of each valid token
    kv_len: int = 0  # decode: positions attended
    extend: bool = False  # one row of T new tokens after a restored prefix (prefix-cache hit)


class _SlotLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, store: "SlotCache", layer_idx: int) -> None:
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        s = self.store
        shape = (s.num_slots, key_states.shape[1], s.capacity, key_states.shape[-1])
        self.keys = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(
            (*shape[:3], value_states.shape[-1]), dtype=value_states.dtype, device=value_states.device
        )
        self.is_initialized = True

    def grow(self, capacity: int) -> None:
        if not self.is_initialized or self.keys.shape[2] >= capacity:
            return
        old = self.keys.shape[2]
        for name in ("keys", "values"):
            t = getattr(self, name)
            new = t.new_zeros((t.shape[0], t.shape[1], capacity, t.shape[3]))
            new[:, :, :old] = t
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.store.plan
        if plan is None:
            raise RuntimeError("SlotCache used without a plan (call plan_prefill / plan_decode first)")
        if plan.prefill:
            k_new = key_states.transpose(1, 2)[plan.valid]  # [M, kv_heads, head_dim]
            v_new = value_states.transpose(1, 2)[plan.valid]
            self.keys[plan.write_slots, :, plan.positions] = k_new
            self.values[plan.write_slots, :, plan.positions] = v_new
            return key_states, value_states
        if plan.extend:  # positions [start, start + T) of one slot; attend over [0, kv_len)
            slot, start = plan.slots, plan.kv_len - key_states.shape[2]
            self.keys[slot, :, start : plan.kv_len] = key_states[0]
            self.values[slot, :, start : plan.kv_len] = value_states[0]
            return self.keys[slot : slot + 1, :, : plan.kv_len], self.values[slot : slot + 1, :, : plan.kv_len]
        rows = plan.slots
        idx = torch.arange(rows.stop, device=key_states.device) if isinstance(rows, slice) else rows
        self.keys[idx, :, plan.positions] = key_states[:, :, 0]
        self.values[idx, :, plan.positions] = value_states[:, :, 0]
        keys = self.keys[:, :, : plan.kv_len]
        values = self.values[:, :, : plan.kv_len]
        if isinstance(rows, slice):
            return keys[rows], values[rows]
        return keys.index_select(0, rows), values.index_select(0, rows)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        plan = self.store.plan
        return (plan.kv_len if plan is not None and not plan.prefill else query_length), 0

    # slot operations (`SlotCache` calls them on every layer)
    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values] if self.is_initialized else []

    def release(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        if self.is_initialized:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]

    def snapshot(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[slot, :, :length].clone(), self.values[slot, :, :length].clone()

    def restore(self, snapshot: tuple[torch.Tensor, torch.Tensor], dst_slots: torch.Tensor) -> None:
        k, v = snapshot
        length = k.shape[1]
        self.keys[dst_slots, :, :length] = k
        self.values[dst_slots, :, :length] = v

    def get_seq_length(self) -> int:
        return 0  # per-row lengths live in the sampler; models get explicit position_ids

    def get_max_length(self) -> int:
        return self.store.max_len


class RecurrentSlotLayer(LinearAttentionCacheLayerMixin):
    """A linear-attention layer's state per slot: `conv` [slots, channels, kernel] (the last
    `kernel` inputs of the short causal convolution) and `state` [slots, heads, key dim,
    value dim] (the delta rule's matrix, fp32 as the kernels return it). Allocated on the
    first prefill, zero for a slot never written; a slot's state is its sequence's after
    its last token (slot operations copy it whole: `length` is a KV notion)."""

    def __init__(self, store: "SlotCache", layer_idx: int) -> None:
        super().__init__(number_of_states=1)
        self.store = store
        self.layer_idx = layer_idx
        self.conv: torch.Tensor | None = None
        self.state: torch.Tensor | None = None

    @property
    def is_initialized(self) -> bool:
        return self.conv is not None and self.state is not None

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0,
                            conv_kernel_size: int | None = None) -> None:
        n = self.store.num_slots
        if conv_states is not None and self.conv is None:
            kernel = conv_kernel_size or conv_states.shape[-1]
            self.conv_kernel_size[0] = kernel
            self.conv = conv_states.new_zeros((n, conv_states.shape[1], kernel))
        if recurrent_states is not None and self.state is None:
            self.state = recurrent_states.new_zeros((n, *recurrent_states.shape[1:]))

    def begin(self, plan: _Plan) -> None:
        """Before a forward: a prefill starts from no state; a decode step hands the model
        its rows' conv states (a view for slots 0..B-1, else a copy written back in
        `update_recurrent_state`) and delta-rule states."""
        if plan.extend:
            raise RuntimeError("a linear-attention layer's state is its whole sequence's: no prefix-cache extend")
        self.has_previous_state[0] = not plan.prefill
        if plan.prefill or not self.is_initialized:
            self.conv_states[0] = self.recurrent_states[0] = None
            return
        rows = plan.slots
        self.conv_states[0] = self.conv[rows] if isinstance(rows, slice) else self.conv.index_select(0, rows)
        self.recurrent_states[0] = self.state[rows] if isinstance(rows, slice) else self.state.index_select(0, rows)

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """A prefill's q/k/v inputs [B, channels, T]: keep each row's last `kernel` columns (zeros
        before a short prompt) in its slot; the model convolves the inputs as given."""
        plan = self.store.plan
        if plan is None or not plan.prefill:
            raise RuntimeError("RecurrentSlotLayer: a multi-token forward outside a prefill plan")
        self.lazy_initialization(conv_states=conv_states, conv_kernel_size=conv_kernel_size)
        kernel = self.conv.shape[-1]
        last = conv_states[..., -kernel:]
        if last.shape[-1] < kernel:
            last = torch.nn.functional.pad(last, (kernel - last.shape[-1], 0))
        self.conv[plan.slots] = last.to(self.conv.dtype)
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The rows' delta-rule states after this forward (the layer's last cache call): into
        their slots, with a decode step's conv states when they were a copy."""
        self.lazy_initialization(recurrent_states=recurrent_states)
        plan = self.store.plan
        rows = plan.slots
        self.state[rows] = recurrent_states.to(self.state.dtype)
        if not plan.prefill and not isinstance(rows, slice):
            self.conv[rows] = self.conv_states[0]
        return recurrent_states

    # slot operations (`SlotCache` calls them on every layer)
    def grow(self, capacity: int) -> None:
        pass  # no sequence dimension

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.state] if self.is_initialized else []

    def release(self) -> None:
        self.conv = self.state = None
        self.conv_states[0] = self.recurrent_states[0] = None

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        if self.is_initialized:
            self.conv[dst] = self.conv[src]
            self.state[dst] = self.state[src]

    def snapshot(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[slot].clone(), self.state[slot].clone()

    def restore(self, snapshot: tuple[torch.Tensor, torch.Tensor], dst_slots: torch.Tensor) -> None:
        self.conv[dst_slots], self.state[dst_slots] = snapshot


class SlotCache(Cache):
    """Fixed slots of KV storage for up to `num_slots` sequences of up to `max_len` tokens.
    `layer_types` (the config's): a "linear_attention" layer holds a `RecurrentSlotLayer`."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, initial_capacity: int = 256,
                 layer_types: list[str] | None = None) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.initial_capacity = initial_capacity
        self.capacity = min(max_len, initial_capacity)
        self.plan: _Plan | None = None
        types_ = layer_types or ["full_attention"] * num_layers
        super().__init__(layers=[RecurrentSlotLayer(self, i) if types_[i] == "linear_attention" else _SlotLayer(self, i)
                                 for i in range(num_layers)])

    @property
    def recurrent(self) -> bool:
        """True when some layer keeps a recurrent state (no prefix of it can be cached)."""
        return any(isinstance(layer, RecurrentSlotLayer) for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes of KV (and recurrent-state) storage allocated now."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def release(self) -> None:
        """Free every layer's storage (colocation: the sampler sleeps while the trainer
        trains). No sequence may be live; the next forward allocates it again, small."""
        self.capacity = min(self.max_len, self.initial_capacity)
        self.plan = None
        for layer in self.layers:
            layer.release()

    def _begin(self) -> None:
        for layer in self.layers:
            if isinstance(layer, RecurrentSlotLayer):
                layer.begin(self.plan)

    # ---------------------------------------------------------------- capacity
    def ensure_capacity(self, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"sequence of {length} positions exceeds the cache's max_len {self.max_len}")
        if length <= self.capacity:
            return
        self.capacity = min(self.max_len, max(length, 2 * self.capacity))
        for layer in self.layers:
            layer.grow(self.capacity)

    # ---------------------------------------------------------------- plans
    def plan_prefill(self, slots: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Rows = prompts left-padded to T columns; `valid` [B, T] marks real tokens."""
        self.ensure_capacity(valid.shape[1])
        write_slots = slots[:, None].expand_as(valid)[valid]
        self.plan = _Plan(
            prefill=True, slots=slots, positions=position_ids[valid], valid=valid, write_slots=write_slots
        )
        self._begin()

    def plan_decode(self, slots: torch.Tensor | slice, positions: torch.Tensor, kv_len: int) -> None:
        """One token per row, written at `positions[r]` of slot `slots[r]`; rows attend [0, kv_len)."""
        self.ensure_capacity(kv_len)
        self.plan = _Plan(prefill=False, slots=slots, positions=positions, kv_len=kv_len)
        self._begin()

    def plan_extend(self, slot: int, start: int, length: int, device) -> None:
        """One row: `length` new tokens at positions [start, start + length) of `slot`, whose
        positions before `start` hold a restored prefix; they attend over [0, start + length)."""
        self.ensure_capacity(start + length)
        positions = torch.arange(start, start + length, device=device)
        self.plan = _Plan(prefill=False, slots=slot, positions=positions, kv_len=start + length, extend=True)
        self._begin()

    def clear_plan(self) -> None:
        self.plan = None

    # ---------------------------------------------------------------- prefix sharing
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy positions [0, length) of slot src[i] into slot dst[i] (n samples, one prefill),
        and a linear-attention layer's whole state."""
        for layer in self.layers:
            layer.copy_slots(src, dst, length)

    def snapshot_prefix(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of a slot's first `length` positions (a linear-attention layer: its state,
        which is the whole sequence's), to seed slots that free up later."""
        return [layer.snapshot(slot, length) for layer in self.layers]

    def restore_prefix(self, snapshot: list[tuple[torch.Tensor, torch.Tensor]], dst_slots: torch.Tensor) -> None:
        for layer, part in zip(self.layers, snapshot):
            layer.restore(part, dst_slots)
