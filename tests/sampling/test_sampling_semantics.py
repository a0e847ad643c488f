"""Tinker's sampling semantics: seeds, stops, max_tokens, top-k/top-p, continuous
batching, logprobs modes."""

from __future__ import annotations

import math

import numpy as np
from tinker import types

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

from .conftest import greedy_reference, not_on, params, prompt

P = [5, 6, 7, 8]


def _req(p, n=1, **kw) -> SamplingRequest:
    extra = {k: kw.pop(k) for k in ("topk_sample_logprobs", "logprobs_mode") if k in kw}
    return SamplingRequest(prompt=prompt(p), num_samples=n, sampling_params=params(**kw), **extra)


def _tokens(resp: types.SampleResponse) -> list[list[int]]:
    return [s.tokens for s in resp.sequences]


def test_seed_reproducible_whatever_the_neighbours(sampler):
    target = _req(P, n=3, max_tokens=16, seed=42, stop=[], temperature=0.9, top_p=0.95)
    alone = sampler.sample_many([target], timeout=60)[0]
    rng = np.random.default_rng(0)
    neighbours = [
        _req(rng.integers(6, 80, size=int(rng.integers(1, 12))).tolist(), n=int(rng.integers(1, 4)),
             max_tokens=int(rng.integers(1, 30)), seed=int(rng.integers(1 << 30)), stop=[],
             top_k=int(rng.integers(2, 20)))
        for _ in range(7)
    ]
    crowded = sampler.sample_many(neighbours[:4] + [target] + neighbours[4:], timeout=60)[4]
    assert _tokens(crowded) == _tokens(alone)
    for a, b in zip(alone.sequences, crowded.sequences):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
    # samples of one request differ from each other; another seed gives other tokens
    assert len({tuple(t) for t in _tokens(alone)}) == 3
    other = sampler.sample_many([_req(P, n=3, max_tokens=16, seed=43, stop=[], temperature=0.9, top_p=0.95)])[0]
    assert _tokens(other) != _tokens(alone)


def test_continuous_batching_equals_one_at_a_time(tiny_model_dir):
    # 2 slots for 9 sequences of very different lengths: slots are reused as soon as a
    # sequence ends, and the 4-sample request is placed over several steps.
    requests = [
        _req([5 + i, 6, 7][: 1 + i % 3], n=1 + (i == 2) * 3, max_tokens=[3, 20, 7, 1, 12, 2][i], seed=100 + i, stop=[])
        for i in range(6)
    ]
    with TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=2)) as s:
        batched = s.sample_many(requests, timeout=60)
        stats = dict(s.stats)
        single = [s.sample_many([r], timeout=60)[0] for r in requests]
    for b, one in zip(batched, single):
        assert _tokens(b) == _tokens(one)
        for x, y in zip(b.sequences, one.sequences):
            assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)
    total = sum(len(t) for r in batched for t in _tokens(r))
    assert total == 3 + 20 + 4 * 7 + 1 + 12 + 2
    # Batched: fewer decode forwards than tokens (sequences shared steps); each prompt
    # was prefilled once although request 2 has 4 samples.
    assert stats["decode_steps"] < total - 9
    assert stats["prefill_prompts"] == 6
    # As the batch drained, a sequence left in slot 1 was moved down into the freed slot 0
    # (compaction) — and its tokens and logprobs still equal the one-at-a-time run's.
    assert stats["moves"] >= 1


def _greedy_run(sampler, ref_model, n=24):
    return greedy_reference(ref_model, P, n)


def test_stop_token_ids(sampler, ref_model):
    seq = _greedy_run(sampler, ref_model)
    stop_tok = seq[5]
    first = seq.index(stop_tok)
    r = sampler.sample(prompt(P), 1, params(max_tokens=24, temperature=0, stop=[stop_tok]))
    assert r.sequences[0].tokens == seq[: first + 1] and r.sequences[0].stop_reason == "stop"
    # stop=[] generates to max_tokens; an id that never comes changes nothing
    other = [t for t in range(6, 80) if t not in seq][0]
    for stop in ([], [other]):
        r = sampler.sample(prompt(P), 1, params(max_tokens=24, temperature=0, stop=stop))
        assert r.sequences[0].tokens == seq and r.sequences[0].stop_reason == "length"
    assert sampler.eos_token_ids == (sampler.tokenizer.eos_token_id,)


def test_eos_stops_unless_stop_is_empty(tiny_model_dir, ref_model):
    # A sampler whose EOS is a token the greedy path emits: stop=None stops there, stop=[]
    # does not, explicit stop ids keep EOS stopping too. (TorchSampler takes an EOS
    # override; for vLLM the same is checked in test_sampling_vllm.py with a model whose
    # generation config names that EOS.)
    seq = greedy_reference(ref_model, P, 24)
    stop_tok = seq[5]
    first = seq.index(stop_tok)
    base = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(max_slots=2))
    with TorchSampler(base.model, base.tokenizer, SamplerConfig(max_slots=2), eos_token_ids=[stop_tok]) as s:
        none = s.sample(prompt(P), 1, params(max_tokens=24, temperature=0))
        empty = s.sample(prompt(P), 1, params(max_tokens=24, temperature=0, stop=[]))
        other = [t for t in range(6, 80) if t not in seq][0]
        ids = s.sample(prompt(P), 1, params(max_tokens=24, temperature=0, stop=[other]))
    assert none.sequences[0].tokens == seq[: first + 1] and none.sequences[0].stop_reason == "stop"
    assert empty.sequences[0].tokens == seq and empty.sequences[0].stop_reason == "length"
    assert ids.sequences[0].tokens == seq[: first + 1] and ids.sequences[0].stop_reason == "stop"


def test_stop_strings(sampler, ref_model):
    seq = _greedy_run(sampler, ref_model)
    decode = lambda toks: sampler.tokenizer.decode(toks, skip_special_tokens=True)  # noqa: E731
    text = decode(seq)
    assert len(text) >= 8, text
    for stop in (text[3:5], text[6]):  # a string spanning two tokens, and a bare string
        end = next(j for j in range(1, len(seq) + 1) if stop in decode(seq[:j]))
        for stop_arg in (stop, [stop, "never-there"]):
            r = sampler.sample(prompt(P), 1, params(max_tokens=24, temperature=0, stop=stop_arg))
            assert r.sequences[0].tokens == seq[:end], (stop, text)
            assert r.sequences[0].stop_reason == "stop"
            assert stop in decode(r.sequences[0].tokens) and stop not in decode(r.sequences[0].tokens[:-1])


def test_max_tokens_length_and_default(sampler):
    r = sampler.sample(prompt(P), 2, params(max_tokens=5, stop=[], seed=1))
    assert [len(t) for t in _tokens(r)] == [5, 5] and {s.stop_reason for s in r.sequences} == {"length"}
    assert all(len(s.logprobs) == 5 for s in r.sequences)
    r = sampler.sample(prompt(P), 1, params(stop=[], seed=1))  # max_tokens unset
    assert len(r.sequences[0].tokens) == sampler.config.default_max_tokens == 128
    r = sampler.sample(prompt(P), 1, params(max_tokens=0), include_prompt_logprobs=True)
    assert r.sequences[0].tokens == [] and r.sequences[0].stop_reason == "length"
    assert len(r.prompt_logprobs) == len(P)
    # A completion that reaches the sampler's max_len ends with "length".
    long = sampler.sample(prompt([7] * 250), 1, params(max_tokens=50, stop=[], seed=2))
    assert len(long.sequences[0].tokens) == sampler.max_len - 250
    assert long.sequences[0].stop_reason == "length"


def _first_token_draws(sampler, n, **kw):
    """n independent first tokens from one prompt (all from the same distribution)."""
    resp = sampler.sample(prompt(P), n, params(max_tokens=1, stop=[], seed=7, **kw), topk_sample_logprobs=84)
    probs = np.zeros(84)
    for tok, lp in resp.sequences[0].topk_logprobs[0]:
        probs[tok] = math.exp(lp)
    return np.array([s.tokens[0] for s in resp.sequences]), probs


def test_top_k_and_top_p_restrict_the_support(sampler):
    n = 400
    free, probs = _first_token_draws(sampler, n, temperature=2.0)  # vLLM's hottest
    order = np.argsort(-probs, kind="stable")
    assert len(set(free.tolist()) - set(order[:3].tolist())) > 0  # unrestricted: tokens outside the top 3 occur
    topk, _ = _first_token_draws(sampler, n, temperature=2.0, top_k=3)
    assert set(topk.tolist()) == set(order[:3].tolist())  # only, and all of, the top 3
    # frequencies follow the renormalised top-3 distribution at temperature 2 (5 sigma)
    p3 = probs[order[:3]] ** (1 / 2.0)
    p3 /= p3.sum()
    counts = np.array([(topk == t).sum() for t in order[:3]])
    assert np.all(np.abs(counts - n * p3) < 5 * np.sqrt(n * p3 * (1 - p3))), (counts, n * p3)
    # top-p: the nucleus of the raw distribution (temperature 1)
    nucleus_draws, _ = _first_token_draws(sampler, n, top_p=0.1)
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.1)) + 1].tolist())
    assert set(nucleus_draws.tolist()) <= nucleus
    assert len(set(nucleus_draws.tolist())) >= min(3, len(nucleus))


@not_on("vllm", "a vLLM engine computes one logprobs mode (SamplerConfig.logprobs_mode); a request for the other "
                "is refused (test_sampling_vllm.py), and a processed-mode engine is tested there")
def test_processed_logprobs_mode(sampler):
    kw = dict(max_tokens=8, stop=[], seed=11, temperature=0.7, top_k=5)
    raw = sampler.sample(prompt(P), 1, params(**kw), topk_sample_logprobs=84).sequences[0]
    proc = sampler.sample(prompt(P), 1, params(**kw), logprobs_mode="processed", topk_sample_logprobs=5).sequences[0]
    assert proc.tokens == raw.tokens  # the mode changes what is reported, not what is drawn
    for i, tok in enumerate(raw.tokens):
        row = dict(raw.topk_logprobs[i])
        top5 = sorted(row, key=row.get, reverse=True)[:5]
        scaled = np.array([row[t] for t in top5]) / 0.7
        logq = scaled - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()
        assert tok in top5
        assert abs(proc.logprobs[i] - logq[top5.index(tok)]) < 1e-4
        assert abs(raw.logprobs[i] - row[tok]) < 1e-6
        assert [t for t, _ in proc.topk_logprobs[i]] == top5
    # top-k entries outside the processed support (probability 0) are left out
    narrow = sampler.sample(prompt(P), 1, params(**{**kw, "top_k": 3}), logprobs_mode="processed",
                            topk_sample_logprobs=5).sequences[0]
    assert all(len(row) == 3 for row in narrow.topk_logprobs)
    assert all(abs(sum(math.exp(lp) for _, lp in row) - 1) < 1e-5 for row in narrow.topk_logprobs)
