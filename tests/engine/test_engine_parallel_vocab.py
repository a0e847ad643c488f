"""Tensor parallelism's vocabulary-sharded LM head (`ember.engine.vocab_parallel`) at world 2
(process runtime, CPU gloo) against world 1.

* the autograd function alone: each of two ranks holds a vocabulary slice of a (T, V)
  matrix; outputs and the slices' gradients equal torch.log_softmax's on the full matrix
  (V even and odd; one target or K per row);
* engines at tp=2 (lm_head split by rows: each rank holds ceil(V/2) or fewer rows of the
  weight and of a LoRA B on lm_head) against an unchunked world-1 engine: losses, logprobs,
  gradients and parameters after SGD steps (rtol 1e-5 fp32, `helpers.layouts`), Qwen3 and
  Llama (vocabulary 85: uneven shards of 43 and 42 rows), LoRA (lm_head adapted) and full
  fine-tuning, packed and padded, chunked (a 30-token datum in chunks of 5) and unchunked,
  top-K targets; checkpoints saved at tp=2 load at world 1;
* a tied model keeps lm_head replicated (documented in `ember.engine.parallel`) and still
  equals world 1; a split that would leave a rank without rows is refused.
"""

import dataclasses

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import ParallelismConfig
from ember.engine.vocab_parallel import check_vocab_split
from ember.models.testing import DEFAULT_ALPHABET, build_tiny_model
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
from helpers import ranks as wt
from helpers.datums import random_rl_datums, random_sft_datums
from helpers.layouts import check_params_then_align, close, close_dicts, close_outputs

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

TP2 = ParallelismConfig(tp=2)
LR = 1e-3


@pytest.fixture(scope="module")
def group():
    g = WorkerGroup.create("process", world_size=2, call_timeout_s=300)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def odd_llama_dir(tmp_path_factory):
    """A tiny Llama whose vocabulary (85) tp=2 does not divide."""
    return build_tiny_model(tmp_path_factory.mktemp("llama-85"), family="llama", seed=1,
                            tokenizer_alphabet=DEFAULT_ALPHABET + "~")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3-tied"), family="qwen3", seed=2, tie_word_embeddings=True)


# ---------------------------------------------------------------------- the autograd function
@pytest.mark.parametrize("vocab", [84, 85])
@pytest.mark.parametrize("k", [None, 3], ids=["one-target", "top-3"])
def test_vocab_parallel_logprobs_equal_log_softmax_on_the_full_matrix(group, vocab, k):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g) * 8.0  # wide rows: the max matters
    targets = torch.randint(0, vocab, (9,) if k is None else (9, k), generator=g)
    targets[0] = vocab - 1  # the last shard's last row, and the first shard's first
    targets[1] = 0
    grad = torch.randn(targets.shape, generator=g)
    full = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(full, dim=-1)
    want = (logp.gather(1, targets.unsqueeze(1)).squeeze(1) if k is None else logp.gather(1, targets))
    want.backward(grad)
    answers = group.run_per_rank(None, wt.vocab_parallel_logprobs, logits, targets, grad)
    assert [a[1].shape[1] for a in answers] == [-(-vocab // 2), vocab // 2]  # no rank holds V columns
    for rank, (out, _) in enumerate(answers):
        close(out, want.detach(), f"rank {rank} logprobs")
    close(torch.cat([a[1] for a in answers], dim=1), full.grad, "logits gradient")


@pytest.mark.parametrize(("vocab", "tp"), [(5, 4), (6, 4), (1, 2)])
def test_a_split_that_leaves_a_rank_empty_is_refused(vocab, tp):
    with pytest.raises(ValueError, match=rf"tp={tp} cannot split a vocabulary of {vocab} tokens"):
        check_vocab_split(vocab, tp)


def test_uneven_splits_with_rows_on_every_rank_are_accepted():
    for vocab, tp in ((85, 2), (151936, 8), (4, 4), (7, 4)):
        check_vocab_split(vocab, tp)


# ---------------------------------------------------------------------- engines
def _top_k_datum(vocab: int) -> types.Datum:
    g = torch.Generator().manual_seed(7)
    targets = torch.randint(0, vocab, (11, 3), generator=g)
    return types.Datum(model_input=types.ModelInput.from_ints(torch.randint(0, vocab, (11,), generator=g).tolist()),
                       loss_fn_inputs={"target_tokens": targets, "weights": torch.rand(11, 3, generator=g)})


def batches(vocab: int):
    long = random_sft_datums(1, vocab, min_len=30, max_len=30, seed=4)  # six chunks of 5
    return [(random_sft_datums(3, vocab, min_len=2, max_len=14, seed=1) + long, "cross_entropy"),
            (random_rl_datums(3, vocab, seed=5), "importance_sampling"),
            ([_top_k_datum(vocab)], "cross_entropy")]


def _seed_lora_b(params: dict) -> dict:
    """Non-zero LoRA B values (a fresh adapter's B = 0 leaves every A without a gradient)."""
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in params.items() if "lora_B" in n}


# (family, lora, packing, chunk)
CASES = [("qwen3", False, True, 5), ("qwen3", True, False, 5), ("llama85", False, False, 0), ("llama85", True, True, 5)]


@pytest.mark.parametrize(("family", "lora", "packing", "chunk"), CASES,
                         ids=[f"{f}-{'lora' if lo else 'full'}-{'packed' if p else 'padded'}-chunk{c}"
                              for f, lo, p, c in CASES])
def test_tp2_sharded_head_matches_world1(group, tiny_model_dir, odd_llama_dir, family, lora, packing, chunk,
                                         tmp_path):
    model_dir = tiny_model_dir if family == "qwen3" else odd_llama_dir
    vocab = 84 if family == "qwen3" else 85
    lora_config = types.LoraConfig(rank=4) if lora else None
    base = EngineConfig(micro_batch_tokens=64, packing=packing)
    ref = TorchEngine.from_pretrained(model_dir, dataclasses.replace(base, logprob_chunk_tokens=0), lora_config)
    assert int(ref.hf_config.vocab_size) == vocab
    name = f"vocab-{family}-{lora}-{packing}-{chunk}"
    spec = EngineSpec(str(model_dir), dataclasses.replace(base, logprob_chunk_tokens=chunk), TP2, lora_config)
    eng = GroupEngine.create(group, name, spec)
    try:
        rows = group.run_per_rank(name, wt.lm_head_local_rows)
        want_rows = [-(-vocab // 2), vocab // 2]
        for rank, shapes in enumerate(rows):
            assert shapes, "no lm_head tensor among the trained ones"
            assert all(s == want_rows[rank] for s in shapes.values()), f"rank {rank} lm_head rows: {shapes}"
        datums, loss = batches(vocab)[0]
        for rank, shapes in enumerate(group.run_per_rank(name, wt.lm_head_output_shapes, datums, loss)):
            assert {cols for _, cols in shapes} == {want_rows[rank]}, f"rank {rank} logits widths: {shapes}"
            if chunk:  # the chunks, and the one position the HF forward keeps per row (4 rows padded)
                assert max(r for r, _ in shapes) <= chunk, f"rank {rank} logits rows: {shapes}"
        if lora:
            seeded = _seed_lora_b(wt.full_params(ref))
            group.run(name, wt.set_params, seeded), wt.set_params(ref, seeded)
        for datums, loss in batches(vocab):
            close_outputs(eng.forward_backward(datums, loss), ref.forward_backward(datums, loss))
            grads = group.run(name, wt.full_grads)
            close_dicts(grads, wt.full_grads(ref), f"{loss} grad")
            lm = {n: g for n, g in grads.items() if "lm_head" in n}
            assert lm and all(g.abs().max() > 0 for g in lm.values()), f"lm_head without gradient: {list(lm)}"
            group.run(name, wt.sgd_step, LR), wt.sgd_step(ref, LR)
        close_dicts(dict(eng.named_weights()), dict(ref.named_weights()), "named_weights")  # the sampler's view
        check_params_then_align(ref, group.run(name, wt.full_params))
        datums = random_sft_datums(4, vocab, seed=9)
        close_outputs(eng.forward(datums, "cross_entropy"), ref.forward(datums, "cross_entropy"))
        eng.save_state(tmp_path / "tp2")
        saved = group.run(name, wt.full_params)
    finally:
        eng.close()
    w1 = TorchEngine.from_pretrained(model_dir, base, lora_config)
    w1.load_state(tmp_path / "tp2")
    for n, p in wt.full_params(w1).items():
        assert torch.equal(p, saved[n]), n  # the full lm_head (and its LoRA B) came back from the shards


def test_tied_lm_head_stays_replicated_and_matches_world1(group, tied_dir):
    config = EngineConfig(micro_batch_tokens=64, logprob_chunk_tokens=5)
    ref = TorchEngine.from_pretrained(tied_dir, dataclasses.replace(config, logprob_chunk_tokens=0))
    assert ref.model.get_output_embeddings().weight is ref.model.get_input_embeddings().weight
    eng = GroupEngine.create(group, "tied", EngineSpec(str(tied_dir), config, TP2))
    try:
        assert group.run_per_rank("tied", wt.lm_head_is_replicated) == [True, True]
        datums, loss = batches(84)[0]
        close_outputs(eng.forward_backward(datums, loss), ref.forward_backward(datums, loss))
        close_dicts(group.run("tied", wt.full_grads), wt.full_grads(ref), "tied grad")
    finally:
        eng.close()
