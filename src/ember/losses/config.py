"""`loss_fn_config` resolution: defaults filled in, everything else checked.

Rules (a third-party Tinker-compatible executor enforces the same; docs/protocol.md §5):
unknown keys are rejected, values must be finite real numbers, clip thresholds are
absolute ratio bounds with 0 ≤ low ≤ high, β ≥ 0, and ``value_clip`` > 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from ember.errors import UserError
from ember.losses.registry import get_loss

ConfigIn = Mapping[str, float | str] | None


def _as_number(name: str, key: str, value: object) -> float:
    # bool is an int subclass; `True` as a clip threshold is certainly a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(
            f"loss {name!r}: loss_fn_config[{key!r}] must be a number, "
            f"got {type(value).__name__} {value!r}"
        )
    number = float(value)
    if not math.isfinite(number):
        raise UserError(f"loss {name!r}: loss_fn_config[{key!r}] must be finite, got {number}")
    return number


def _check_ranges(name: str, config: Mapping[str, float]) -> None:
    if "clip_low_threshold" in config:
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        if not 0.0 <= low <= high:
            raise UserError(
                f"loss {name!r}: clip thresholds must satisfy 0 <= clip_low_threshold <= "
                f"clip_high_threshold (absolute ratio bounds, e.g. 0.8 and 1.2), "
                f"got clip_low_threshold={low}, clip_high_threshold={high}"
            )
    if config.get("beta", 0.0) < 0.0:
        raise UserError(
            f"loss {name!r}: loss_fn_config['beta'] must be >= 0, got {config['beta']}"
        )
    if "value_clip" in config and not config["value_clip"] > 0.0:
        raise UserError(
            f"loss {name!r}: loss_fn_config['value_clip'] must be > 0 (the clip range ε of "
            f"V − V_old, e.g. 0.2), got {config['value_clip']}"
        )


def resolve_config(name: str, config: ConfigIn) -> dict[str, float]:
    """The loss's config with defaults filled in, as plain floats.

    ``ValueError`` on an unknown loss, unknown keys (named, with the accepted keys),
    non-numeric or non-finite values, clip thresholds out of order, β < 0, or
    ``value_clip`` <= 0.
    Idempotent: resolving a resolved config returns an equal dict.
    """
    spec = get_loss(name)
    given = dict(config or {})
    unknown = sorted(str(k) for k in given if k not in spec.config_defaults)
    if unknown:
        accepted = ", ".join(sorted(spec.config_defaults)) or "none"
        raise UserError(
            f"loss {name!r}: unknown loss_fn_config key(s) {unknown}; accepted keys: {accepted}"
        )
    resolved = dict(spec.config_defaults)
    for key, value in given.items():
        resolved[key] = _as_number(name, key, value)
    _check_ranges(name, resolved)
    return resolved
