"""`save_weights_and_get_sampling_client(kind="inflight")` in process: the SDK's in-flight
contract (tinker.types.SamplingClientKind). Every in-flight sampling client of a run samples
from the run's newest in-flight save, from its next request on; snapshots stay immutable
(contract 4); another run's in-flight saves never reach it; a bad `kind` is refused naming it;
on a sampler pool a sequence still decoding switches to a new in-flight save mid-sequence."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from helpers.datums import random_sft_datums

from ember.sampling.follow import version_spans

BASE = "ember-test/tiny-qwen3"
PROMPT = types.ModelInput.from_ints([5, 9, 14, 22, 31])
PROBE = types.ModelInput.from_ints([5, 9, 14, 22, 31, 40, 7, 3])
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)


def probe(sampling_client) -> torch.Tensor:
    """Prompt logprobs of a fixed sequence: a function of the weights the client samples from."""
    return torch.tensor(sampling_client.compute_logprobs(PROBE).result()[1:])


def train(tc, steps: int = 2) -> None:
    data = random_sft_datums(4, vocab=84, seed=3)
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()


@pytest.fixture
def tc(make_client):
    return make_client().create_lora_training_client(base_model=BASE, rank=8, seed=0).result()


def test_inflight_clients_follow_the_newest_inflight_save(tc):
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    before = probe(first)
    torch.testing.assert_close(probe(snapshot), before, rtol=0, atol=1e-6)
    train(tc)
    torch.testing.assert_close(probe(first), before, rtol=0, atol=1e-6)  # nothing published yet
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    after = probe(second)
    assert (after - before).abs().max() > 1e-3, "training did not move the probe"
    torch.testing.assert_close(probe(first), after, rtol=0, atol=1e-6)  # the earlier client follows
    torch.testing.assert_close(probe(snapshot), before, rtol=0, atol=1e-6)  # the snapshot does not
    samples = [c.sample(PROMPT, 1, GREEDY).result().sequences[0] for c in (first, second)]
    assert samples[0].tokens == samples[1].tokens
    torch.testing.assert_close(torch.tensor(samples[0].logprobs), torch.tensor(samples[1].logprobs), rtol=0, atol=1e-6)


def test_a_snapshot_save_does_not_move_the_inflight_target(tc):
    inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    before = probe(inflight)
    train(tc)
    newer_snapshot = tc.save_weights_and_get_sampling_client().result()
    assert (probe(newer_snapshot) - before).abs().max() > 1e-3
    torch.testing.assert_close(probe(inflight), before, rtol=0, atol=1e-6)


def test_another_runs_inflight_saves_do_not_reach_a_run(make_client):
    sc = make_client()
    a = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    b = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    a_client = a.save_weights_and_get_sampling_client(kind="inflight").result()
    before = probe(a_client)
    train(b)
    b_client = b.save_weights_and_get_sampling_client(kind="inflight").result()
    assert (probe(b_client) - before).abs().max() > 1e-3
    torch.testing.assert_close(probe(a_client), before, rtol=0, atol=1e-6)


def test_a_bad_kind_is_refused_naming_it_and_the_run_goes_on(make_client):
    sc = make_client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    with pytest.raises(Exception, match="kind must be 'snapshot' or 'inflight'.*got kind='sometimes'"):
        tc.save_weights_and_get_sampling_client(kind="sometimes").result()  # type: ignore[arg-type]
    train(tc, steps=1)  # the refused request's turn was skipped, not waited for
    assert probe(tc.save_weights_and_get_sampling_client(kind="inflight").result()).isfinite().all()


HELD_TOKENS = 600  # ~20 s of decoding on a pool replica here (stop=[]: EOS does not end it); a training step and the save take ~1-2 s


@pytest.mark.slow  # a 2-replica sampler pool starts for it (~10 s) and a long sequence decodes (~20 s)
def test_a_pool_replica_switches_a_running_sequence_to_a_new_inflight_save(make_client):
    sc = make_client(sampler={"replicas": 2, "max_len": 1024, "max_slots": 4, "forward": "direct"})
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    follower = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    held = follower.sample(PROMPT, 1, types.SamplingParams(max_tokens=HELD_TOKENS, temperature=0.0, stop=[]))
    # The same sampling session's next request lands on the same replica, queued after the
    # held one: once it is answered, the held sequence is decoding (no sleep as a signal).
    assert version_spans(follower.sample(PROMPT, 1, GREEDY).result().sequences[0]) == ((0, 1),)
    train(tc, steps=1)
    tc.save_weights_and_get_sampling_client(kind="inflight").result()
    seq = held.result().sequences[0]
    assert len(seq.tokens) == HELD_TOKENS
    spans = version_spans(seq)
    assert spans is not None and len(spans) == 2, (f"spans {spans}: the held sequence ({len(seq.tokens)} tokens) "
                                                   "ended before the in-flight save (a very slow host?)")
    (first, g1), (swap, g2) = spans
    assert (first, g1, g2) == (0, 1, 2) and 0 < swap < len(seq.tokens), spans
