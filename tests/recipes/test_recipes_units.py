"""Pure pieces of the recipes: datum alignment, advantages, LR schedules, data loading, the task."""

from __future__ import annotations

import json
import math
import random

import pytest

from ember.models import load_tokenizer
from ember.recipes.common import learning_rate_at, rl_datum, sft_datum
from ember.recipes.digit_sum import DigitSumEnv, DigitSumTask, digit_sum
from ember.recipes.grpo import GRPOConfig, minibatch_datums
from ember.recipes.rl.advantages import group_advantages, kl_k1, kl_k3, kl_shaped_advantages
from ember.recipes.rl.env import Problem
from ember.recipes.rl.reference import completion_logprobs, submit_reference_logprobs
from ember.recipes.rl.rollouts import Rollout
from ember.recipes.sft import batch_datums, load_jsonl


def test_sft_datum_alignment():
    d = sft_datum([1, 2, 3], [4, 5], weight=0.5)
    assert d.model_input.to_ints() == [1, 2, 3, 4]
    assert d.loss_fn_inputs["target_tokens"].data == [2, 3, 4, 5]
    assert d.loss_fn_inputs["weights"].data == [0.0, 0.0, 0.5, 0.5]  # prompt targets weighted 0
    with pytest.raises(ValueError, match="at least one completion token"):
        sft_datum([1], [])


def test_rl_datum_alignment():
    d = rl_datum([1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], advantage=0.25)
    assert d.model_input.to_ints() == [1, 2, 7, 8]
    assert d.loss_fn_inputs["target_tokens"].data == [2, 7, 8, 9]
    assert d.loss_fn_inputs["logprobs"].data == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert d.loss_fn_inputs["advantages"].data == [0.0, 0.25, 0.25, 0.25]
    with pytest.raises(ValueError, match="2 sampler logprobs for 3 completion tokens"):
        rl_datum([1], [7, 8, 9], [0.0, 0.0], 1.0)


def datum_bytes(d) -> tuple:
    """Everything a datum sends: its repr, tokens, and each loss input's dtype, shape and raw bytes."""
    inputs = {k: (v.dtype, list(v.shape), v.to_numpy().tobytes()) for k, v in d.loss_fn_inputs.items()}
    return repr(d), d.model_input.to_ints(), inputs


def test_rl_datum_per_token_advantages():
    d = rl_datum([1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], advantage=[0.5, -1.0, 2])
    assert d.loss_fn_inputs["advantages"].data == [0.0, 0.5, -1.0, 2.0]
    # a float and the same value per token give the same datum, byte for byte
    a = rl_datum([1, 2], [7, 8], [-0.1, -0.2], advantage=0.25)
    b = rl_datum([1, 2], [7, 8], [-0.1, -0.2], advantage=[0.25, 0.25])
    assert datum_bytes(a) == datum_bytes(b)
    with pytest.raises(ValueError, match=r"advantage has 2 per-token values for 3 completion tokens \(expected 3\)"):
        rl_datum([1], [7, 8, 9], [0.0] * 3, [1.0, 1.0])
    with pytest.raises(TypeError, match="advantage must be a float or a per-token sequence of floats, got str"):
        rl_datum([1], [7], [0.0], "1.0")


class _RecordingSampler:
    """Records compute_logprobs calls; results are only available after every submission."""

    def __init__(self):
        self.calls: list[tuple[list[int], int | None]] = []

    def compute_logprobs(self, prompt, prompt_logprobs_last_n=None):
        self.calls.append((prompt.to_ints(), prompt_logprobs_last_n))
        n = len(prompt.to_ints())
        return [None] * (n - prompt_logprobs_last_n) + [-0.5] * prompt_logprobs_last_n


def test_submit_reference_logprobs_and_completion_logprobs():
    ref = _RecordingSampler()
    futures = submit_reference_logprobs(ref, [([1, 2], [3, 4, 5]), ([9], [8])])
    assert ref.calls == [([1, 2, 3, 4, 5], 3), ([9, 8], 1)]  # one call per sequence, completion only
    assert completion_logprobs(futures[0], 2, 3) == [-0.5, -0.5, -0.5]
    assert completion_logprobs([None, -1.0, -2.0], 1, 2) == [-1.0, -2.0]
    with pytest.raises(ValueError, match="sequence 1: a datum needs at least one completion token"):
        submit_reference_logprobs(ref, [([1], [2]), ([1], [])])
    with pytest.raises(ValueError, match="returned no logprobs"):
        completion_logprobs(None, 1, 2)
    with pytest.raises(ValueError,
                       match=r"2 logprobs for a sequence of 1 prompt \+ 2 completion tokens \(expected 3\)"):
        completion_logprobs([None, -1.0], 1, 2)
    with pytest.raises(ValueError, match=r"no logprob for completion token\(s\) \[0\]"):
        completion_logprobs([None, None, -2.0], 1, 2)


def test_kl_estimators():
    q, p = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5]
    assert kl_k1(q, p) == pytest.approx([0.5, -1.0, 0.0])
    k3 = kl_k3(q, p)
    r = [-0.5, 1.0, 0.0]
    assert k3 == pytest.approx([math.exp(x) - 1 - x for x in r], abs=1e-12)
    assert all(k >= 0 for k in k3)
    with pytest.raises(ValueError, match="2 sampler logprobs vs 1 reference logprobs"):
        kl_k1([0.0, 0.0], [0.0])


def test_kl_shaped_advantages_are_centred():
    adv = [0.5, -0.5]
    q = [[-1.0, -2.0, -0.5], [-0.1]]
    p = [[-1.5, -1.0, -0.5], [-0.4]]
    shaped = kl_shaped_advantages(adv, q, p, kl_coef=0.2)
    k1 = [[0.5, -1.0, 0.0], [0.3]]
    mean_k1 = (0.5 - 1.0 + 0.0 + 0.3) / 4
    assert shaped == [pytest.approx([a + 0.2 * (mean_k1 - k) for k in ks], abs=1e-12) for a, ks in zip(adv, k1)]
    # centring: the token-mean of the shaped advantages is the token-mean of the unshaped ones
    flat = [x for row in shaped for x in row]
    assert sum(flat) / 4 == pytest.approx((0.5 * 3 - 0.5) / 4, abs=1e-12)
    # tokens the policy made likelier than the reference are penalised relative to the others
    assert shaped[0][0] < shaped[0][2] < shaped[0][1]
    assert kl_shaped_advantages(adv, q, p, kl_coef=0.0) == [[0.5] * 3, [-0.5]]
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0, got -1"):
        kl_shaped_advantages(adv, q, p, kl_coef=-1)
    with pytest.raises(ValueError, match="1 advantages, 2 sampler and 2 reference logprob lists"):
        kl_shaped_advantages([0.0], q, p, kl_coef=1.0)


def test_sft_batch_weights_make_a_token_mean():
    datums = batch_datums([([1, 2], [3, 4, 5]), ([1], [6])])
    weights = [w for d in datums for w in d.loss_fn_inputs["weights"].data]
    assert sum(weights) == pytest.approx(1.0)
    assert sorted(set(weights)) == [0.0, 0.25]


def test_group_advantages():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=False) == [0.5, -0.5, -0.5, 0.5]
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([1.0, 1.0], std_normalize=True) == [0.0, 0.0]


def test_minibatch_datums_scale_by_sequences_and_skip_constant_groups():
    p = Problem(tokens=(1, 2), text="x")
    varied = [Rollout(p, [3, 4], [-1.0, -1.0], r) for r in (1.0, 0.0)]
    constant = [Rollout(p, [3], [-1.0], 1.0) for _ in range(2)]
    datums = minibatch_datums([varied, constant], std_normalize=False)
    assert len(datums) == 2  # the constant group carries no signal and is not sent
    # A = +-0.5, divided by the 4 sequences of the mini-batch
    assert [d.loss_fn_inputs["advantages"].data[-1] for d in datums] == [0.125, -0.125]


def test_learning_rate_schedules():
    assert learning_rate_at(5, 10, 1.0, "constant") == 1.0
    assert learning_rate_at(0, 11, 1.0, "cosine") == pytest.approx(1.0)
    assert learning_rate_at(5, 11, 1.0, "cosine") == pytest.approx(0.5)
    assert learning_rate_at(10, 11, 1.0, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert learning_rate_at(10, 11, 1.0, "linear", min_ratio=0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        learning_rate_at(1, 10, 1.0, "step")


def test_grpo_config_validation():
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        GRPOConfig(group_size=0)
    with pytest.raises(ValueError, match="clip_low <= 1 <= clip_high"):
        GRPOConfig(clip_low=1.5)
    with pytest.raises(ValueError, match=r"minibatches \(5\) > prompts_per_step \(4\)"):
        GRPOConfig(prompts_per_step=4, minibatches=5)


def test_digit_sum_task_and_env(digit_model_dir):
    task = DigitSumTask(load_tokenizer(digit_model_dir))
    tok = task.tokenizer
    assert tok.decode(task.prompt_tokens(40913)) == "Sum the digits of 40913:"
    assert task.answer_tokens(40913) == tok.encode(" 17", add_special_tokens=False) + [tok.eos_token_id]
    assert digit_sum(40913) == 17
    held = task.numbers(50, seed=1)
    labelled = task.numbers(50, seed=2, exclude=held)
    assert len(set(held)) == 50 and not set(held) & set(labelled)
    assert all(100 <= n <= 99999 for n in held + labelled)
    env = DigitSumEnv(task, exclude=held)
    problems = env.sample_problems(200, random.Random(0))
    assert not {p.reference for p in problems} & set(held)
    p = task.problem(40913)
    assert env.reward(p, task.answer_tokens(40913)) == 1.0
    assert env.reward(p, task.answer_tokens(40913)[:-1]) == 0.0  # no EOS: not an exact match
    assert env.reward(p, task.answer_tokens(40914)) == 0.0


def test_load_jsonl_formats_and_errors(digit_model_dir, tmp_path):
    tok = load_tokenizer(digit_model_dir)
    path = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "Sum the digits of 12:", "completion": " 3"},
        {"text": "Sum the digits"},
        {"messages": [{"role": "user", "content": "Sum the digits of 12:"}, {"role": "assistant", "content": " 3"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (p0, c0), (p1, c1), (p2, c2) = load_jsonl(path, tok)
    assert tok.decode(p0) == "Sum the digits of 12:" and c0 == tok.encode(" 3") + [tok.eos_token_id]
    assert len(p1) == 1 and tok.decode(p1 + c1) == "Sum the digits"
    assert tok.decode(p2).endswith("<|assistant|>") and tok.decode(c2) == " 3<|eos|>"
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps(rows[0]) + "\n")
    assert load_jsonl(short, tok, max_length=len(p0) + 1)[0][1] == c0[:1]  # truncated completion
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "completion": "y"}\n{"answer": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a 'messages', 'prompt'\+'completion' or 'text'"):
        load_jsonl(bad, tok)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        load_jsonl(bad, tok)
    with pytest.raises(FileNotFoundError, match="SFT data file not found"):
        load_jsonl(tmp_path / "missing.jsonl", tok)


def test_phase_progress_shows_window_averages_and_keeps_sparse_metrics():
    import io

    from rich.console import Console

    from ember.recipes.progress import PhaseProgress

    out = io.StringIO()
    with PhaseProgress(Console(file=out, width=100), live=False, window=2, every=2) as progress:
        hook = progress.phase("GRPO", 4, {"r": "reward", "acc": "held-out acc"})
        hook(0, {"r": 0.0})
        hook(1, {"r": 1.0, "acc": 0.25})
        hook(2, {"r": 0.5})
        hook(3, {"r": 0.5})
    lines = [line for line in out.getvalue().splitlines() if line.startswith("GRPO")]
    assert lines == ["GRPO 2/4  reward 0.500  held-out acc 0.250", "GRPO 4/4  reward 0.500  held-out acc 0.250"]


def test_plot_series_and_moving_average(tmp_path):
    from ember.metrics import JsonlSink
    from ember.recipes.plotting import moving_average, plot_demo, series

    assert moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    sink = JsonlSink(tmp_path / "m.jsonl")
    for step in range(3):
        sink.write(step, {"grpo/reward": 0.1 * step, **({"grpo/heldout_acc": 0.5} if step == 2 else {})})
        sink.write(step, {"sft/loss": 1.0 / (step + 1)})
    sink.close()
    from ember.metrics import read_jsonl

    assert series(read_jsonl(tmp_path / "m.jsonl"), "grpo/heldout_acc") == ([2], [0.5])
    png = plot_demo(tmp_path / "m.jsonl", tmp_path / "p.png", {"sft_accuracy": 0.2})
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_phase_progress_shows_the_last_evaluation_not_their_mean():
    """The demo's held-out accuracy (recorded every eval_every steps) shows its last value."""
    import io

    from rich.console import Console

    from ember.recipes.progress import PhaseProgress

    out = io.StringIO()
    with PhaseProgress(Console(file=out, width=100), live=False, window=20, every=4) as progress:
        hook = progress.phase("GRPO", 4, {"r": "reward", "acc": "held-out acc"})
        hook(0, {"r": 0.0, "acc": 0.1})
        hook(1, {"r": 1.0, "acc": 0.3})
        hook(2, {"r": 0.5})
        hook(3, {"r": 0.5, "acc": 0.4})
    lines = [line for line in out.getvalue().splitlines() if line.startswith("GRPO")]
    assert lines == ["GRPO 4/4  reward 0.500  held-out acc 0.400"]
