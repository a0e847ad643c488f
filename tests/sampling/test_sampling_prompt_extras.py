"""`target_prompt_logprobs` and `prompt_alt_tokens_k` at the sampler level: values equal a
plain full forward's (fp32, 1e-4), layouts round-trip, hostile inputs are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from ember.sampling import SamplingRequest
from ember.sampling.prompt_extras import MAX_PROMPT_ALT_TOKENS_K

from .conftest import backend_param

PROMPT = [3, 17, 42, 9, 60, 5, 77, 12]


def _full_logp(model, tokens: list[int]) -> torch.Tensor:
    """[P-1, V]: row i = log-distribution of prompt[i + 1] from one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _targets(rows: int, k: int, vocab: int, seed: int = 0) -> np.ndarray:
    t = np.random.default_rng(seed).integers(0, vocab, size=(rows, k)).astype(np.int64)
    t[1, 0] = -1  # asks for nothing
    return t


def _request(**kw) -> SamplingRequest:
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=7)
    return SamplingRequest(prompt=types.ModelInput.from_ints(PROMPT), sampling_params=params, **kw)


def _check_targets(sampler, ref_model, td_in, dense: np.ndarray) -> None:
    resp = sampler.submit(_request(target_prompt_logprobs=td_in)).result(120)
    out = resp.target_prompt_logprobs
    assert out is not None and out.dtype == "float32" and out.shape == list(dense.shape)
    assert out.sparse_crow_indices == td_in.sparse_crow_indices
    got = out.to_numpy()
    ref = _full_logp(ref_model, PROMPT)
    for (i, j), tok in np.ndenumerate(dense):
        want = 0.0 if tok == -1 else float(ref[i, tok])
        assert abs(float(got[i, j]) - want) <= 1e-4, (i, j, got[i, j], want)


@pytest.mark.parametrize("sampler", ["direct", "transformers", backend_param("vllm")], indirect=True)
def test_target_prompt_logprobs_dense_match_full_forward(sampler, ref_model):
    dense = _targets(len(PROMPT) - 1, 3, sampler.vocab_size)
    dense[:, 2] = PROMPT[1:]  # the prompt's own tokens: also prompt_logprobs
    _check_targets(sampler, ref_model, types.TensorData.from_numpy(dense), dense)


@pytest.mark.parametrize("sampler", ["direct"], indirect=True)
def test_target_prompt_logprobs_sparse_keeps_layout(sampler, ref_model):
    dense = np.full((len(PROMPT) - 1, 50), -1, np.int64)
    dense[0, 4], dense[3, 0], dense[3, 49], dense[6, 10] = 5, 80, 7, 1
    td = types.TensorData.from_torch_sparse(torch.from_numpy(dense), pad_value=-1)
    assert td.sparse_crow_indices is not None
    _check_targets(sampler, ref_model, td, dense)


@pytest.mark.parametrize("sampler", ["direct", backend_param("vllm")], indirect=True)
def test_prompt_alt_tokens_logprobs_match_full_forward_and_are_seeded(sampler, ref_model):
    k = 4
    resp = sampler.submit(_request(prompt_alt_tokens_k=k)).result(120)
    alt = resp.prompt_alt_tokens
    assert alt is not None and alt.tokens.shape == [len(PROMPT) - 1, k] and alt.logprobs.shape == [len(PROMPT) - 1, k]
    toks, lps = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    ref = _full_logp(ref_model, PROMPT)
    want = ref.gather(1, torch.from_numpy(toks)).numpy()
    np.testing.assert_allclose(lps, want, atol=1e-4, rtol=0)
    again = sampler.submit(_request(prompt_alt_tokens_k=k)).result(120).prompt_alt_tokens
    assert (again.tokens.to_numpy() == toks).all()
    assert len(np.unique(toks)) > 1  # draws at temperature 1 are not all one token


@pytest.mark.parametrize("sampler", ["direct"], indirect=True)
def test_prompt_alt_tokens_greedy_is_argmax(sampler, ref_model):
    params = types.SamplingParams(max_tokens=1, temperature=0.0)
    req = SamplingRequest(prompt=types.ModelInput.from_ints(PROMPT), sampling_params=params, prompt_alt_tokens_k=2)
    toks = sampler.submit(req).result(60).prompt_alt_tokens.tokens.to_numpy()
    argmax = _full_logp(ref_model, PROMPT).argmax(-1).numpy()
    assert (toks == argmax[:, None]).all()


def _bad(vocab: int):
    rows = len(PROMPT) - 1
    ok = np.zeros((rows, 2), np.int64)
    return [
        (dict(prompt_alt_tokens_k=MAX_PROMPT_ALT_TOKENS_K + 1), "prompt_alt_tokens_k"),
        (dict(prompt_alt_tokens_k=10**12), "prompt_alt_tokens_k"),
        (dict(prompt_alt_tokens_k=-1), "prompt_alt_tokens_k"),
        (dict(target_prompt_logprobs=types.TensorData.from_numpy(ok[:-1])), "target_prompt_logprobs.shape"),
        (dict(target_prompt_logprobs=types.TensorData.from_numpy(ok.reshape(-1))), "target_prompt_logprobs.shape"),
        (dict(target_prompt_logprobs=types.TensorData.from_numpy(ok.astype(np.float32))),
         "target_prompt_logprobs.dtype"),
        (dict(target_prompt_logprobs=types.TensorData.from_numpy(ok + vocab)), "target_prompt_logprobs value 0"),
        (dict(target_prompt_logprobs=types.TensorData.from_numpy(ok - 2)), "target_prompt_logprobs value 0"),
        (dict(target_prompt_logprobs=types.TensorData(data=[1, 2], dtype="int64", shape=[rows, 10**9],
                                                      sparse_crow_indices=[0, 2] + [2] * (rows - 1),
                                                      sparse_col_indices=[5, 5])),
         "sparse_col_indices"),
        (dict(target_prompt_logprobs=types.TensorData(data=[1], dtype="int64", shape=[rows, 3],
                                                      sparse_crow_indices=[0, 1],
                                                      sparse_col_indices=[0])),
         "sparse_crow_indices"),
        (dict(target_prompt_logprobs=[[1, 2]]), "a tinker.types.TensorData"),
    ]


@pytest.mark.parametrize("sampler", ["direct", backend_param("vllm")], indirect=True)
def test_hostile_values_are_refused_naming_the_field(sampler):
    for kw, needle in _bad(sampler.vocab_size):
        with pytest.raises(ValueError, match="sample request") as err:
            sampler.submit(_request(**kw)).result(60)
        assert needle in str(err.value), (kw, str(err.value))


def test_compute_is_independent_of_row_chunking():
    """Draws are keyed by (seed, global row, draw), so bounded-memory chunking changes nothing."""
    from ember.sampling import prompt_extras as X

    logits = torch.randn(37, 50, generator=torch.Generator().manual_seed(0))
    dense = np.random.default_rng(1).integers(-1, 50, size=(37, 3))
    targets = X.check_targets(types.TensorData.from_numpy(dense), 38, 50)
    whole_t, whole_a = X.compute(logits, targets, 6, 0.8, seed=123)
    part_t, part_a = X.compute(logits, targets, 6, 0.8, seed=123, chunk_rows=5)
    assert (whole_a.tokens.to_numpy() == part_a.tokens.to_numpy()).all()
    np.testing.assert_array_equal(whole_t.to_numpy(), part_t.to_numpy())
    ref = torch.log_softmax(logits, -1)
    want = np.where(dense >= 0, ref.gather(1, torch.from_numpy(np.maximum(dense, 0))).numpy(), 0.0)
    np.testing.assert_allclose(part_t.to_numpy(), want, atol=1e-6, rtol=0)
    freq = np.bincount(X.compute(logits[:1].expand(4000, 50), None, 1, 1.0, seed=9)[1].tokens.to_numpy().ravel(),
                       minlength=50) / 4000
    np.testing.assert_allclose(freq, torch.softmax(logits[0], -1).numpy(), atol=0.03)  # draws follow the distribution


@pytest.mark.parametrize("last_n", [None, 20])
def test_prompt_scores_chunked_equal_one_pass(last_n):
    """`jobs.prompt_scores` runs its fp32 log-softmax over row chunks: prompt logprobs and
    top-k equal one log-softmax over all rows (rtol 1e-5), for any chunk size."""
    from types import SimpleNamespace

    from ember.sampling import jobs

    g = torch.Generator().manual_seed(3)
    logits, prompt = torch.randn(37, 50, generator=g), tuple(torch.randint(0, 50, (37,), generator=g).tolist())
    spec = SimpleNamespace(prompt_logprobs_last_n=last_n, topk_prompt_logprobs=4)
    first = 1 if last_n is None else 37 - last_n
    ref = torch.log_softmax(logits[first - 1 : 36], -1)
    want = ref.gather(1, torch.tensor(prompt[first:])[:, None]).squeeze(1).numpy()
    for rows in (1, 5, 36, 512):
        got, top = jobs.prompt_scores(logits, prompt, spec, chunk_rows=rows)
        assert np.isnan(got[:first]).all()
        np.testing.assert_allclose(got[first:], want, rtol=1e-5, atol=1e-6)
        vals, ids = torch.topk(ref, 4, dim=-1)
        np.testing.assert_array_equal(top.token_ids[first:], ids.numpy())
        np.testing.assert_allclose(top.logprobs[first:], vals.numpy(), rtol=1e-5)
