"""Asynchronous rollouts: a thread samples groups from an in-flight sampling client while the
trainer trains, at most `max_steps_off_policy` (N) steps ahead of it.

The trainer publishes version k (the weights after k optimizer steps) with an in-flight save
(`save_weights_and_get_sampling_client(kind="inflight")`, which every in-flight client of the
run follows from its next request on) and then `RolloutWorker.publish(k)`. The worker's round r
(one batch of P groups, meant for step r) waits until version >= r - N is published, then
samples from the in-flight client and tags each group with the version published when its
requests were submitted. The weights a request samples are those of that version or newer (a
save between reading the version and submitting is adopted), so `step - version` is an upper
bound on a group's staleness; the gate keeps it <= N. `take` still drops any group staler than
N (a safety net the gate should leave idle) and reports how many it dropped. The sampler's
logprobs are those of the weights it sampled with, which the RL losses' importance ratio uses.

With N = 0 the gate makes sampling wait for each step's weights: on-policy, but no overlap
(the synchronous loop in `ember.recipes.grpo` is the cheaper way to get that).
"""

from __future__ import annotations

import queue
import random
import threading
from typing import NamedTuple

from tinker import types

from ember.recipes.rl.env import Environment
from ember.recipes.rl.rollouts import Rollout, collect_groups, submit_samples

JOIN_TIMEOUT_S = 600.0  # close(): a round in progress finishes its samples first


class VersionedGroup(NamedTuple):
    """One problem's G rollouts and the policy version published when they were submitted."""

    group: list[Rollout]
    version: int


def split_stale(items: list[VersionedGroup], step: int, max_steps_off_policy: int
                ) -> tuple[list[VersionedGroup], list[VersionedGroup]]:
    """(fresh, stale): a group is stale when `step - version > max_steps_off_policy`."""
    fresh = [g for g in items if step - g.version <= max_steps_off_policy]
    stale = [g for g in items if step - g.version > max_steps_off_policy]
    return fresh, stale


class RolloutWorker:
    """A daemon thread sampling rounds of `n_problems` groups from `client` (an in-flight
    sampling client) into a queue, gated to run at most `max_steps_off_policy` steps ahead.

    Use as a context manager (or call `close`): the thread stops at the next round."""

    def __init__(self, client, env: Environment, n_problems: int, group_size: int, params: types.SamplingParams,
                 rng: random.Random, max_steps_off_policy: int) -> None:
        self.client, self.env, self.rng = client, env, rng
        self.n_problems, self.group_size, self.params = n_problems, group_size, params
        self.max_off = max_steps_off_policy
        self.items: queue.Queue[VersionedGroup | BaseException] = queue.Queue()  # bounded by the gate
        self.version, self.stopping = 0, False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self.run, name="ember-grpo-rollouts", daemon=True)

    def __enter__(self) -> RolloutWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def publish(self, version: int) -> None:
        """The trainer's weights `version` are what the in-flight client now samples."""
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(JOIN_TIMEOUT_S)

    def wait_for_round(self, r: int) -> int | None:
        """The published version once it is >= r - N; None when closing."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopping or self.version >= r - self.max_off)
            return None if self.stopping else self.version

    def run(self) -> None:
        r = 0
        try:
            while (version := self.wait_for_round(r)) is not None:
                problems = self.env.sample_problems(self.n_problems, self.rng)
                futures = submit_samples(self.client, problems, self.group_size, self.params, self.rng)
                for group in collect_groups(self.env, problems, futures):
                    self.items.put(VersionedGroup(group, version))
                r += 1
        except BaseException as e:  # handed to the trainer, which raises it
            self.items.put(e)

    def take(self, n: int, step: int) -> tuple[list[VersionedGroup], int]:
        """The next `n` groups fresh enough for `step` (in sampling order) and how many stale ones
        were dropped on the way."""
        fresh: list[VersionedGroup] = []
        dropped = 0
        while len(fresh) < n:
            item = self.items.get()
            if isinstance(item, BaseException):
                raise RuntimeError(f"GRPO rollout thread failed: {type(item).__name__}: {item}") from item
            kept, stale = split_stale([item], step, self.max_off)
            fresh += kept
            dropped += len(stale)
        return fresh, dropped
