"""Mid-sequence adoption through a SamplerPool (ember.sampling.pool, ember.sampling.replica):
a followed request reaches its replica with a `FollowTag`, each publish of its follower is
forwarded to every replica's mirror follower, and the running sequence switches at its
next decode step; its `version_spans` come back through the replica's pipe intact.

The replica side (`ReplicaHost`) runs in process here (fast): the races of a forward
that arrives before the sample it concerns, of a replacement replica that never heard
the earlier forwards, and of a mirror whose version is dropped. The 2-replica pool
(conftest's session pool, slow) runs the whole path."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from tinker import types

from ember.sampling import SamplerConfig, SamplingRequest
from ember.sampling.follow import VersionFollower, spans_a_swap, version_spans, with_spans
from ember.sampling.replica import FollowTag, ReplicaHost

from .conftest import params, perturbed, prompt

PROMPT = [5, 6, 7, 8, 9]
LONG = 200  # tokens of the pool's followed sequence: the publish lands well inside it (max_len 256)


def _request(max_tokens: int, session: str = "", follow=None) -> SamplingRequest:
    return SamplingRequest(prompt=prompt(PROMPT), session=session, follow=follow,
                           sampling_params=params(max_tokens=max_tokens, temperature=0.0, stop=[]))


@pytest.fixture(scope="module")
def host(tiny_model_dir, ref_model):
    """A replica's side in this process, with versions 1 (the base weights moved by seed 7)
    and 2 (seed 8) loaded under the pool's keys."""
    h = ReplicaHost(tiny_model_dir, SamplerConfig(max_slots=4, max_len=128))
    h.load_tensors(1, perturbed(ref_model, 7).state_dict().items())
    h.load_tensors(2, perturbed(ref_model, 8).state_dict().items())
    yield h
    h.close()


def test_a_followed_sequence_keeps_its_spans_through_pickling():
    seq = types.SampledSequence(stop_reason="length", sequence_id="s0", tokens_np=np.array([3, 4, 5], np.int32),
                                logprobs_np=np.array([-0.5, -0.25, -1.0], np.float32), topk_logprobs_np=None)
    response = types.SampleResponse(sequences=[with_spans(seq, [(0, 1), (2, 3)])])
    back = pickle.loads(pickle.dumps(response)).sequences[0]  # what the replica pipe and Ray do
    assert version_spans(back) == ((0, 1), (2, 3)) and spans_a_swap(back)
    assert list(back.tokens) == [3, 4, 5] and list(back.logprobs) == [-0.5, -0.25, -1.0]


def test_a_replica_reports_that_its_backend_follows_mid_sequence(host):
    assert host.info().follows_mid_sequence  # TorchSampler reads its follower before each decode step


def test_a_forward_before_its_sample_names_the_requests_generation_then_switches(host):
    host.follow(101, 2, 2)  # generation 2 published (and forwarded) before the sample arrives
    tag = FollowTag(101, ((1, 1),))  # the request was made on version 1, generation 1
    seq = host.sample(_request(6), 1, tag).result(timeout=300).sequences[0]
    assert version_spans(seq) == ((0, 1), (1, 2))  # prefill's token on 1, every decode step on 2


def test_a_replica_that_missed_the_forwards_adopts_the_followers_current_from_the_tag(host):
    tag = FollowTag(102, ((1, 1), (2, 2)))  # as the pool sends it: the request's version, then the current
    seq = host.sample(_request(6), 1, tag).result(timeout=300).sequences[0]
    assert version_spans(seq) == ((0, 1), (1, 2))


def test_an_unfollowed_sample_carries_no_spans_and_a_dropped_version_forgets_its_mirror(tiny_model_dir, ref_model):
    h = ReplicaHost(tiny_model_dir, SamplerConfig(max_slots=4, max_len=128))
    try:
        h.load_tensors(1, perturbed(ref_model, 7).state_dict().items())
        h.load_tensors(2, perturbed(ref_model, 8).state_dict().items())
        assert version_spans(h.sample(_request(3), 1).result(timeout=300).sequences[0]) is None
        h.follow(7, 2, 2)
        h.drop([2])  # the mirror's current version: the mirror goes with it
        h.load_tensors(3, perturbed(ref_model, 9).state_dict().items())
        seq = h.sample(_request(4), 1, FollowTag(7, ((1, 1),))).result(timeout=300).sequences[0]
        assert version_spans(seq) == ((0, 1),)  # a kept mirror would have switched to generation 2
        h.follow(7, 2, 2)  # a late forward of a dropped version changes nothing
        seq = h.sample(_request(4), 1, FollowTag(7, ((1, 1),))).result(timeout=300).sequences[0]
        assert version_spans(seq) == ((0, 1),)
    finally:
        h.close()


@pytest.mark.slow  # the session's 2-replica pool starts for it (tests/sampling/conftest.py)
def test_a_pool_replica_adopts_a_publish_mid_sequence(pool_sampler, ref_model):
    pool = pool_sampler
    assert pool.follows_mid_sequence
    newer = pool.load_weights(perturbed(ref_model, 11).state_dict().items())
    follow = VersionFollower(None, 1)  # as the service's: generation 1 for the base weights
    session = "pool-follow-test"
    followed = pool.submit(_request(LONG, session, follow))
    # Same session, same replica, queued after it: once this short one is done, the long
    # one has decoded tokens too (no sleep: the replica's own progress is the signal).
    short = pool.submit(_request(2, session)).result(timeout=300)
    assert version_spans(short.sequences[0]) is None
    assert follow.publish(newer) == 2
    seq = followed.result(timeout=600).sequences[0]
    spans = version_spans(seq)
    assert spans is not None and len(spans) == 2 and spans[0] == (0, 1) and spans[1][1] == 2, spans
    swap = spans[1][0]
    assert 1 <= swap < len(seq.tokens), spans
    never = pool.submit(_request(LONG, session)).result(timeout=600).sequences[0]
    assert version_spans(never) is None
    assert list(never.tokens[:swap]) == list(seq.tokens[:swap])
    np.testing.assert_allclose(seq.logprobs[:swap], never.logprobs[:swap], rtol=0, atol=1e-4)
    n = min(len(seq.logprobs), len(never.logprobs))
    assert np.abs(np.asarray(seq.logprobs[swap:n]) - np.asarray(never.logprobs[swap:n])).max() > 1e-2
