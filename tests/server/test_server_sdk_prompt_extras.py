"""`target_prompt_logprobs`, `prompt_alt_tokens_k` and `prompt_cache_hit_tokens` through the
unmodified SDK against `ember serve` (TorchSampler) and through the in-process client:
values equal the trainer's forward (fp32, 1e-4); bad values fail the same way on both."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

import ember
from helpers.server import MODEL_NAME, sft_datum

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

TOKENS = [5, 17, 30, 42, 8, 61, 9, 3, 22, 14]
PROMPT = types.ModelInput.from_ints(TOKENS)


@pytest.fixture(scope="module")
def in_process(tiny_model_dir, tmp_path_factory):
    client = ember.ServiceClient(models={MODEL_NAME: str(tiny_model_dir)},
                                 data_dir=tmp_path_factory.mktemp("ember-in-process"))
    yield client
    client.close("success")


@pytest.fixture(scope="module", params=["http", "in_process"])
def trained(request):
    """A LoRA run after one optimizer step and a sampler of its weights, per client kind."""
    sc = request.getfixturevalue("sc" if request.param == "http" else "in_process")
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=2).result()
    tc.forward_backward([sft_datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc, tc.save_weights_and_get_sampling_client().result()


def _trainer_logprobs(tc, columns: np.ndarray) -> np.ndarray:
    """[P-1, K]: the trainer's logp(columns[i, j] | prompt[:i + 1]) (one datum per column)."""
    data = [types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.maximum(col, 0)),
                                        "weights": types.TensorData.from_numpy(np.ones(len(col), np.float32))})
            for col in columns.T]
    out = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    return np.stack([o["logprobs"].to_numpy() for o in out], axis=1)


def _params(**kw) -> types.SamplingParams:
    return types.SamplingParams(**{"max_tokens": 3, "seed": 11, "temperature": 1.0, **kw})


def test_target_logprobs_and_alt_tokens_equal_the_trainers_forward(trained):
    tc, sampler = trained
    targets = np.random.default_rng(3).integers(0, 64, size=(len(TOKENS) - 1, 3)).astype(np.int64)
    targets[:, 0] = TOKENS[1:]
    targets[2, 1] = -1
    resp = sampler.sample(PROMPT, 2, _params(), target_prompt_logprobs=types.TensorData.from_numpy(targets),
                          prompt_alt_tokens_k=5).result()
    got = resp.target_prompt_logprobs.to_numpy()
    want = _trainer_logprobs(tc, targets)
    want[2, 1] = 0.0
    assert got.shape == targets.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    alt = resp.prompt_alt_tokens
    toks, lps = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert toks.shape == lps.shape == (len(TOKENS) - 1, 5)
    np.testing.assert_allclose(lps, _trainer_logprobs(tc, toks), atol=1e-4, rtol=0)
    again = sampler.sample(PROMPT, 1, _params(), prompt_alt_tokens_k=5).result().prompt_alt_tokens
    assert (again.tokens.to_numpy() == toks).all()  # seeded: the same draws


def test_sparse_target_keeps_its_layout(trained):
    tc, sampler = trained
    dense = np.full((len(TOKENS) - 1, 40), -1, np.int64)
    dense[1, 3], dense[4, 39], dense[8, 0] = 7, 12, TOKENS[9]
    td = types.TensorData.from_torch_sparse(torch.from_numpy(dense), pad_value=-1)
    resp = sampler.sample(PROMPT, 1, _params(), target_prompt_logprobs=td).result()
    out = resp.target_prompt_logprobs
    assert out.sparse_crow_indices == td.sparse_crow_indices and out.sparse_col_indices == td.sparse_col_indices
    got = out.to_numpy()
    want = _trainer_logprobs(tc, np.stack([np.full(len(TOKENS) - 1, t) for t in (7, 12, TOKENS[9])], axis=1))
    assert abs(got[1, 3] - want[1, 0]) <= 1e-4 and abs(got[4, 39] - want[4, 1]) <= 1e-4
    assert abs(got[8, 0] - want[8, 2]) <= 1e-4 and np.count_nonzero(got) == 3


@pytest.mark.parametrize("kwargs,needle", [
    (dict(target_prompt_logprobs=types.TensorData.from_numpy(np.zeros((4, 2), np.int64))),
     "target_prompt_logprobs.shape: expected [len(prompt) - 1, K] = [9, K >= 1], got [4, 2]"),
    (dict(target_prompt_logprobs=types.TensorData.from_numpy(np.full((9, 1), 10**9, np.int64))),
     "target_prompt_logprobs value 0: expected -1 or a token id in [0, "),
    (dict(prompt_alt_tokens_k=10**6), "prompt_alt_tokens_k=1000000 is over the limit"),
])
def test_hostile_values_fail_with_a_message_naming_the_field(trained, kwargs, needle):
    _, sampler = trained
    with pytest.raises(tinker.RequestFailedError) as err:
        sampler.sample(PROMPT, 1, _params(), **kwargs).result()
    assert needle in str(err.value)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(target_prompt_logprobs=types.TensorData.from_numpy(np.zeros((9, 2), np.float32))), "int64"),
    (dict(target_prompt_logprobs=types.TensorData.from_numpy(np.zeros(9, np.int64))), "2-D"),
    (dict(prompt_alt_tokens_k=-1), "prompt_alt_tokens_k must be 0 or greater"),
])
def test_client_side_checks_match_the_sdk(trained, kwargs, needle):
    _, sampler = trained
    with pytest.raises(ValueError, match=needle):
        sampler.sample(PROMPT, 1, _params(), **kwargs)


LONG = types.ModelInput.from_ints([(7 * i + 3) % 60 + 1 for i in range(40)])


def test_prompt_cache_hit_tokens_on_a_repeated_prompt_and_not_across_adapters(trained):
    tc, sampler = trained
    kw = dict(include_prompt_logprobs=True, prompt_logprobs_last_n=3)
    first = sampler.sample(LONG, 2, _params(), **kw).result()
    second = sampler.sample(LONG, 2, _params(), **kw).result()
    assert first.prompt_cache_hit_tokens == 0 and second.prompt_cache_hit_tokens > 0
    np.testing.assert_allclose(np.asarray(first.prompt_logprobs[-3:]), np.asarray(second.prompt_logprobs[-3:]),
                               atol=1e-5, rtol=0)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in second.sequences]
    tc.forward_backward([sft_datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    newer = tc.save_weights_and_get_sampling_client().result()  # another weights version
    assert newer.sample(LONG, 1, _params(), **kw).result().prompt_cache_hit_tokens == 0
    assert newer.sample(LONG, 1, _params(), **kw).result().prompt_cache_hit_tokens > 0


def test_raw_bodies_with_bad_target_tensors_are_400s(ember_server, sc):
    """What the SDK would not send: data that does not fit the shape (a 400 from the route);
    a sparse tensor with a huge K is checked without densifying (unsorted columns refused)."""
    import httpx

    sampler = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result() \
        .save_weights_and_get_sampling_client().result()
    body = dict(sampling_session_id=sampler.get_sampler_handle(), seq_id=10**6, num_samples=1,
                prompt=PROMPT.model_dump(mode="json"), sampling_params={"max_tokens": 1})
    with httpx.Client(base_url=ember_server.base_url + "/api/v1", headers={"X-API-Key": "tml-test"}, timeout=60) as c:
        r = c.post("/asample", json={**body, "target_prompt_logprobs": {"data": [1, 2, 3], "dtype": "int64",
                                                                         "shape": [9, 2]}})
        assert r.status_code == 400 and "target_prompt_logprobs" in r.text and "[9, 2]" in r.text, r.text
    with pytest.raises(tinker.RequestFailedError, match="strictly increasing columns"):
        sampler.sample(PROMPT, 1, _params(), target_prompt_logprobs=types.TensorData(
            data=[1, 2], dtype="int64", shape=[9, 10**12], sparse_crow_indices=[0, 2] + [2] * 8,
            sparse_col_indices=[7, 3])).result()
