"""Routing replay's side of the service: a datum's recorded routes, from the stability
records its provenance names (docs/architecture.md#mixture-of-experts).

TorchSampler records, per sequence of a mixture-of-experts model, the experts every layer
chose for the prompt's tokens and for each sampled token fed back
(`ember.sampling.experts.RoutedSequence`); a `record_stability_info=True` sample keeps them
in its `SequenceRecord` (bounded, per owner and session, expiring with it:
`ember.service.stability`). With replay on (`loss_fn_config["routing_replay"]`, default
`StabilityConfig.routing_replay`), a datum with ``model_input_spans`` (tinker's
``Datum.with_provenance``) is matched against the records exactly as for
``stable_reinforce`` (`ember.service.provenance.check_model_input`) and gets
``loss_fn_inputs["routed_experts"]``, (N, layers, k) expert indices per input position,
which the engine replays (`ember.engine.moe.RouteReplay`). Positions without a route are
-1 and routed by the current router: prompt tokens whose KV came from the prefix cache, a
sampled run's last token (never fed to the model while sampling), and every position of
a datum without provenance. A record whose routes disagree with its tokens' count, or
whose layers differ from another run's of the same datum, is refused naming the datum
and the field; the engine refuses routes that do not fit its model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from tinker import types

from ember.engine.moe import ROUTES_KEY
from ember.service.api import UserError
from ember.service.provenance import check_model_input

if TYPE_CHECKING:
    from ember.service.stability import SequenceRecord, StabilityRecords

OPTION = "routing_replay"


def replay_option(config: Mapping | None, default: bool) -> tuple[dict | None, bool]:
    """(the loss config without `routing_replay`, whether replay is on): the key is the
    service's, not the loss's; 0 (off) or 1 (on), else a UserError naming it."""
    if not config or OPTION not in config:
        return (dict(config) if config else None), default
    rest = {k: v for k, v in config.items() if k != OPTION}
    value = config[OPTION]
    if isinstance(value, bool) or value not in (0, 1):
        raise UserError(f"loss_fn_config[{OPTION!r}] must be 0 (route normally) or 1 (replay the sampler's "
                        f"routes), got {value!r}")
    return (rest or None), bool(value)


def _span_routes(rec: "SequenceRecord", span, where: str) -> np.ndarray | None:
    """The routes of the positions `span` covers ((length, layers, k), -1 where unrecorded),
    None when the record holds no routes (a dense model's sample)."""
    sampled = isinstance(span, types.SampledProvenanceSpan)
    routes, want = (rec.routes, rec.tokens.size - 1) if sampled else (rec.prompt_routes, rec.prompt.size)
    if routes is None:
        return None
    if routes.shape[0] != max(want, 0):
        kind = "sampled tokens fed back" if sampled else "prompt tokens"
        raise UserError(f"{where}: the routing record of sequence_id {span.sequence_id!r} holds {routes.shape[0]} "
                        f"routes for its {max(want, 0)} {kind}; it cannot be replayed")
    out = np.full((int(span.length), *routes.shape[1:]), -1, np.int64)
    part = routes[int(span.offset):int(span.offset) + int(span.length)]
    out[:part.shape[0]] = part  # a sampled run's last token has no route: -1
    return out


def datum_routes(records: "StabilityRecords", owner: str, session_id: str, index: int,
                 datum: types.Datum) -> np.ndarray | None:
    """(N, layers, k) routes of the datum's input positions; None without provenance or
    without any routing record (nothing to replay)."""
    if datum.model_input_spans is None:
        return None
    spans = check_model_input(records, owner, session_id, index, datum)
    parts, shape = [], None
    for j, span in enumerate(spans):
        where = f"datum {index}: model_input_spans[{j}]"
        part = _span_routes(records.lookup(owner, session_id, span.sequence_id, where), span, where)
        if part is not None and shape is not None and part.shape[1:] != shape:
            raise UserError(f"{where}: the routing record of sequence_id {span.sequence_id!r} has "
                            f"{part.shape[1:]} (layers, experts per token), an earlier run's has {shape}")
        shape = shape or (part.shape[1:] if part is not None else None)
        parts.append((int(span.length), part))
    if shape is None:
        return None
    return np.concatenate([p if p is not None else np.full((n, *shape), -1, np.int64) for n, p in parts])


def with_routes(records: "StabilityRecords", owner: str, session_id: str, data: Sequence[types.Datum],
                batch: Sequence[types.Datum]) -> list[types.Datum]:
    """`batch` (the request's datums, possibly resolved) with ``routed_experts`` added
    where `data` (as sent, with provenance) names recorded routes."""
    out = []
    for i, (sent, datum) in enumerate(zip(data, batch)):
        routes = datum_routes(records, owner, session_id, i, sent)
        if routes is None:
            out.append(datum)
            continue
        inputs = dict(datum.loss_fn_inputs) | {ROUTES_KEY: types.TensorData.from_numpy(routes)}
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return out
