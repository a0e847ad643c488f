"""Checks on one datum's `loss_fn_inputs` before anything touches the model.

Alignment (docs/protocol.md §4.3): ``model_input`` position i predicts token i+1, so
every loss input has first dimension N = length of ``model_input``. ``target_tokens`` is
int64 (N,), or (N, K) for top-K ``cross_entropy`` with ``weights`` of the same shape;
``weights``, ``logprobs``, ``advantages``, ``sequence_ratio_mask``, ``returns`` and
``old_values`` are float (N,). Value losses accept ``target_tokens`` but do not require it.

Every error is a ``UserError`` (a ValueError: ``ember.errors``) that names the datum index and the field, e.g.
``datum 3: loss_fn_inputs['weights'] has shape (7,), expected (8,) (same as target_tokens)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ember.errors import UserError
from ember.losses.registry import LOSSES, LossSpec, get_loss

_CONFIG_KEYS = frozenset(k for spec in LOSSES.values() for k in spec.config_defaults)


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    dims = tuple(int(d) for d in shape)
    return f"({dims[0]},)" if len(dims) == 1 else str(dims)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _first_bad(bad: torch.Tensor) -> str:
    index = tuple(int(i) for i in bad.nonzero()[0])
    return str(index[0]) if len(index) == 1 else str(index)


def _check_keys(spec: LossSpec, where: str, inputs: Mapping[str, object]) -> None:
    got = sorted(map(str, inputs))
    missing = [k for k in spec.required_inputs if k not in inputs]
    if missing:
        raise UserError(
            f"{where}: loss_fn_inputs is missing {missing}, required by loss {spec.name!r} "
            f"(got keys {got})"
        )
    unknown = [k for k in got if k not in spec.accepted_inputs]
    if unknown:
        hint = [k for k in unknown if k in _CONFIG_KEYS]
        note = f"; {hint} belong in loss_fn_config, not loss_fn_inputs" if hint else ""
        raise UserError(
            f"{where}: loss_fn_inputs has unknown key(s) {unknown} for loss {spec.name!r} "
            f"(accepted: {', '.join(spec.accepted_inputs)}){note}"
        )


def _as_dense(where: str, key: str, value: object, n_tokens: int, vocab_size: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise UserError(
            f"{where}: loss_fn_inputs[{key!r}] must be a torch.Tensor, got {type(value).__name__}"
        )
    # No input is larger than (N, vocab_size) (top-K targets at most K = vocab_size): a
    # sparse tensor's declared shape is checked before `to_dense` allocates it.
    if value.layout != torch.strided and math.prod(value.shape) > n_tokens * max(vocab_size, 1):
        raise UserError(
            f"{where}: loss_fn_inputs[{key!r}] has shape {_shape(value.shape)}, more values than "
            f"model_input length x vocab_size = {n_tokens} x {vocab_size}"
        )
    return value.to_dense() if value.layout != torch.strided else value


def _check_target_tokens(
    spec: LossSpec, where: str, n_tokens: int, tokens: torch.Tensor, vocab_size: int, scan: bool = True
) -> torch.Tensor:
    field = f"{where}: loss_fn_inputs['target_tokens']"
    allowed = "(N,) or (N, K)" if spec.supports_top_k else "(N,)"
    if tokens.dim() not in ((1, 2) if spec.supports_top_k else (1,)):
        raise UserError(
            f"{field} has shape {_shape(tokens.shape)}, expected {allowed} with N={n_tokens}"
            + ("" if spec.supports_top_k else " (only cross_entropy takes (N, K) targets)")
        )
    if tokens.shape[0] != n_tokens or (tokens.dim() == 2 and tokens.shape[1] < 1):
        expected = f"({n_tokens},)" if tokens.dim() == 1 else f"({n_tokens}, K) with K >= 1"
        raise UserError(
            f"{field} has shape {_shape(tokens.shape)}, expected {expected} "
            "(first dim = model_input length)"
        )
    if tokens.dim() == 2 and tokens.shape[1] > vocab_size:
        raise UserError(
            f"{field} has shape {_shape(tokens.shape)}: K={tokens.shape[1]} top-K targets per position, "
            f"more than the vocabulary (K <= vocab_size={vocab_size})"
        )
    if tokens.dtype != torch.int64:
        raise UserError(f"{field} has dtype {_dtype(tokens)}, expected int64")
    bad = _bad_values("target_tokens", tokens, vocab_size) if scan else None
    if bad is not None and bool(bad.any()):
        position = _first_bad(bad)
        value = int(tokens[bad][0])
        raise UserError(
            f"{field} has token id {value} at position {position}, "
            f"outside [0, vocab_size={vocab_size})"
        )
    return tokens.contiguous()


def _check_float(
    where: str, key: str, value: torch.Tensor, expected: torch.Size, note: str, scan: bool = True
) -> torch.Tensor:
    field = f"{where}: loss_fn_inputs[{key!r}]"
    if not value.is_floating_point():
        raise UserError(f"{field} has dtype {_dtype(value)}, expected a float tensor (float32)")
    if value.shape != expected:
        raise UserError(
            f"{field} has shape {_shape(value.shape)}, expected {_shape(expected)} ({note})"
        )
    value = value.to(torch.float32).contiguous()
    bad = _bad_values(key, value, 0) if scan else None
    if bad is not None and bool(bad.any()):
        raise UserError(
            f"{field} has a non-finite value {float(value[bad][0])} at position {_first_bad(bad)}"
        )
    return value


TOKEN_FIELDS = ("target_tokens", "model_input")  # fields of token ids; every other field is float


def _bad_values(key: str, value: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mask of the values a validated field may not hold: token ids outside the
    vocabulary (`TOKEN_FIELDS`), non-finite numbers (the float fields)."""
    if key in TOKEN_FIELDS:
        return (value < 0) | (value >= vocab_size)
    return ~torch.isfinite(value)


def first_bad_datum(datums: Sequence[Mapping[str, torch.Tensor]], vocab_size: int) -> int | None:
    """The value checks of `validate_datum_inputs` over many validated datums at once (one
    scan per field instead of one per datum and field): the index of the first datum
    holding a bad value, or None. Re-validate that datum with ``scan_values=True`` for
    its error. A datum may also carry its ``model_input`` ids under that key."""
    first = None
    for key in {k for d in datums for k in d}:
        owners = [i for i, d in enumerate(datums) if key in d]
        parts = [datums[i][key].reshape(-1) for i in owners]
        bad = _bad_values(key, torch.cat(parts), vocab_size)
        if bool(bad.any()):
            ends = torch.tensor([p.numel() for p in parts]).cumsum(0)
            at = owners[int(torch.searchsorted(ends, bad.nonzero()[0, 0], right=True))]
            first = at if first is None else min(first, at)
    return first


def validate_datum_inputs(
    name: str,
    datum_index: int,
    n_tokens: int,
    inputs: Mapping[str, torch.Tensor],
    vocab_size: int,
    *,
    scan_values: bool = True,
) -> dict[str, torch.Tensor]:
    """Check one datum's ``loss_fn_inputs`` (dense torch tensors) for loss ``name``.

    ``n_tokens`` is the datum's ``model_input`` length. Returns a new dict: target_tokens
    int64; float inputs as contiguous float32; ``cross_entropy`` without ``weights`` gets
    all-ones weights (docs/protocol.md §5 recommends ones; skyrl-tx does the same).
    ``scan_values=False`` checks keys, shapes and dtypes only, leaving the token-range and
    finiteness scans to one `first_bad_datum` call over a whole request.
    """
    spec = get_loss(name)
    where = f"datum {datum_index}"
    if n_tokens < 1:
        raise UserError(f"{where}: model_input is empty (length {n_tokens}); need >= 1 token")
    _check_keys(spec, where, inputs)
    dense = {key: _as_dense(where, key, value, n_tokens, vocab_size) for key, value in inputs.items()}
    out: dict[str, torch.Tensor] = {}
    tokens = None  # optional for value losses (required-ness is `_check_keys`'s job)
    if "target_tokens" in dense:
        tokens = _check_target_tokens(spec, where, n_tokens, dense.pop("target_tokens"), vocab_size, scan_values)
        out["target_tokens"] = tokens
    per_token = torch.Size([n_tokens])
    for key, value in dense.items():
        if key == "weights" and tokens is not None:
            expected, note = tokens.shape, "same as target_tokens"
        else:
            expected, note = per_token, "N = model_input length"
        out[key] = _check_float(where, key, value, expected, note, scan_values)
    if "weights" in spec.optional_inputs and "weights" not in out:
        shape = tokens.shape if tokens is not None else per_token
        out["weights"] = torch.ones(shape, dtype=torch.float32)
    return out
