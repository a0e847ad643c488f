"""Resumable checkpoints of an RL loop: a `save_state` path plus a small JSON beside the run.

Every `save_every` steps the GRPO recipe saves the policy's weights and optimizer state
(`save_state`) and then writes `<run_dir>/checkpoint.json`: the step, the recipe's
problem/sampling RNG state, the config fields that shape the run, the KL reference's path
and the batch sampled before the step and not yet trained on (with `max_staleness > 0`
it was sampled from weights that no state holds any more, so its samples are kept: the
problems are re-drawn from the RNG state they were drawn with; the file then grows with
P x G x max_tokens). The JSON is written last
and atomically, so it never names a state that is not complete. A resumed run creates its
training client from `state_path` with the optimizer and goes on from `step`.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

CHECKPOINT_FILE = "checkpoint.json"
FORMAT = 1

RngState = tuple  # random.Random.getstate(): (version, 625 ints, gauss_next)
Samples = list[list[tuple[list[int], list[float]]]]  # per problem, per sequence: (tokens, logprobs)


@dataclass(frozen=True)
class SavedBatch:
    """A batch that was sampled but not trained on when the checkpoint was written."""

    version: int  # optimizer steps the weights it was sampled from had seen
    rng_state: RngState  # the RNG before the batch drew its problems and sampling seeds
    samples: Samples


@dataclass(frozen=True)
class Checkpoint:
    recipe: str
    step: int  # optimizer steps done: the step a resumed run runs first
    state_path: str  # save_state (weights + optimizer) after `step` steps
    rng_state: RngState  # the recipe's RNG after `step` steps (and after drawing `batch`)
    config: dict[str, Any]  # the fields of the config that shape the run (a resume must keep them)
    reference_path: str = ""  # the KL reference the run made (its step-0 weights); "" = none or the caller's
    batch: SavedBatch | None = None


def write_checkpoint(run_dir: str | Path, checkpoint: Checkpoint) -> Path:
    """Write `<run_dir>/checkpoint.json` atomically (a kill leaves the old file or the new one)."""
    path = Path(run_dir) / CHECKPOINT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = checkpoint.batch
    data = {
        "format": FORMAT, "recipe": checkpoint.recipe, "step": checkpoint.step, "state_path": checkpoint.state_path,
        "rng_state": list(checkpoint.rng_state), "config": checkpoint.config,
        "reference_path": checkpoint.reference_path,
        "batch": None if batch is None else {"version": batch.version, "rng_state": list(batch.rng_state),
                                             "samples": batch.samples},
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_checkpoint(directory: str | Path, recipe: str, field: str) -> Checkpoint:
    """The checkpoint in `directory`; every problem is a ValueError naming `field` and the file."""
    where = Path(directory)
    if not where.is_dir():
        raise ValueError(f"{field}: no such directory {str(where)!r} "
                         "(expected the run_dir of a run with save_every > 0)")
    path = where / CHECKPOINT_FILE
    if not path.is_file():
        raise ValueError(f"{field}: {str(where)!r} holds no {CHECKPOINT_FILE}; a run writes one every save_every steps "
                         f"(was it run with save_every > 0 and run_dir {str(where)!r}?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{field}: {path} is not readable JSON ({e})") from None
    return _parse(data, recipe, f"{field}: {path}")


def _parse(data: Any, recipe: str, where: str) -> Checkpoint:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{where}: not a checkpoint of format {FORMAT} (got format {got!r})")
    if data.get("recipe") != recipe:
        raise ValueError(f"{where}: a checkpoint of recipe {data.get('recipe')!r}, expected {recipe!r}")
    step = _get(data, "step", int, where)
    if step < 0:
        raise ValueError(f"{where}: 'step' must be >= 0, got {step}")
    state_path = _get(data, "state_path", str, where)
    if not state_path.startswith("tinker://"):
        raise ValueError(f"{where}: 'state_path' must be a tinker:// path, got {state_path!r}")
    reference_path = _get(data, "reference_path", str, where)
    if reference_path and not reference_path.startswith("tinker://"):
        raise ValueError(f"{where}: 'reference_path' must be '' or a tinker:// path, got {reference_path!r}")
    batch = data.get("batch")
    return Checkpoint(recipe, step, state_path, rng_state(data.get("rng_state"), f"{where}: 'rng_state'"),
                      _get(data, "config", dict, where), reference_path,
                      None if batch is None else _parse_batch(batch, f"{where}: 'batch'"))


def _parse_batch(data: Any, where: str) -> SavedBatch:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object or null, got {type(data).__name__}")
    samples = _get(data, "samples", list, where)
    try:
        parsed = [[(_ints(tokens), [float(x) for x in logprobs]) for tokens, logprobs in group] for group in samples]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: 'samples' must be, per problem, a list of [tokens, logprobs] pairs") from None
    return SavedBatch(_get(data, "version", int, where), rng_state(data.get("rng_state"), f"{where}: 'rng_state'"),
                      parsed)


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError("expected a list of ints")
    return values


def _get(data: dict, key: str, kind: type, where: str) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def rng_state(value: Any, where: str) -> RngState:
    """A `random.Random` state from its JSON form (a list), checked by loading it."""
    try:
        version, internal, gauss = value
        state = (version, tuple(internal), gauss)
        if gauss is not None and not isinstance(gauss, float):
            raise TypeError("gauss_next")
        random.Random().setstate(state)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: not a random.Random state (expected [version, [625 ints], gauss])") from None
    return state


def random_from(state: RngState) -> random.Random:
    rng = random.Random()
    rng.setstate(state)
    return rng


def check_same_run(checkpoint: Checkpoint, identity: dict[str, Any], may_change: Collection[str], steps: int,
                   field: str) -> None:
    """Refuse a checkpoint of another run (a field of `identity` differs) or one beyond `steps`."""
    there = checkpoint.config
    differ = sorted(k for k in set(identity) | set(there) if identity.get(k) != there.get(k))
    if differ:
        diffs = "; ".join(f"{k} = {there.get(k)!r} there, {identity.get(k)!r} here" for k in differ)
        raise ValueError(f"{field}: the checkpoint is of another run: {diffs} "
                         f"(a resume may change only {', '.join(sorted(may_change))})")
    if checkpoint.step > steps:
        raise ValueError(f"{field}: the checkpoint is at step {checkpoint.step}, beyond steps = {steps} "
                         f"(expected steps >= {checkpoint.step})")


class SavedSequence(NamedTuple):  # what an RL recipe reads of a tinker SampledSequence
    tokens: list[int]
    logprobs: list[float]


class SavedResponse(NamedTuple):  # what an RL recipe reads of a tinker SampleResponse
    sequences: list[SavedSequence]


def samples_of(futures: Sequence[Future]) -> Samples:
    """The (tokens, logprobs) of every sequence of `sample` futures (awaited)."""
    return [[(list(s.tokens), list(s.logprobs or [])) for s in f.result().sequences] for f in futures]


def completed_futures(samples: Samples) -> list[Future]:
    """`samples_of`'s inverse: completed futures whose results read like SampleResponses."""
    futures = []
    for group in samples:
        future: Future = Future()
        future.set_result(SavedResponse([SavedSequence(tokens, logprobs) for tokens, logprobs in group]))
        futures.append(future)
    return futures
