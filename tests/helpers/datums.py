"""Datum factories for tests and benchmarks (random but reproducible)."""

from __future__ import annotations

import torch
from tinker import types


def sft_datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token datum: model_input = tokens[:-1], target_tokens = tokens[1:]."""
    n = len(tokens) - 1
    w = weights if weights is not None else [1.0] * n
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": torch.tensor(tokens[1:], dtype=torch.int64),
            "weights": torch.tensor(w, dtype=torch.float32),
        },
    )


def random_sft_datums(n: int, vocab: int, min_len: int = 3, max_len: int = 12, seed: int = 0) -> list[types.Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        toks = torch.randint(0, vocab, (length + 1,), generator=g).tolist()
        weights = torch.rand(length, generator=g).tolist()
        out.append(sft_datum(toks, weights))
    return out


def random_rl_datums(
    n: int, vocab: int, min_len: int = 3, max_len: int = 12, seed: int = 0, with_mask: bool = False
) -> list[types.Datum]:
    """Datums for importance_sampling/ppo/cispo/dro (and gspo with `with_mask`)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        toks = torch.randint(0, vocab, (length + 1,), generator=g)
        inputs = {
            "target_tokens": toks[1:].clone(),
            "logprobs": -torch.rand(length, generator=g) * 5.0,
            "advantages": torch.randn(length, generator=g),
        }
        if with_mask:
            inputs["sequence_ratio_mask"] = (torch.rand(length, generator=g) > 0.3).float()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()), loss_fn_inputs=inputs))
    return out


def assert_tensors_close(a: dict, b: dict, rtol: float = 1e-5) -> None:
    """Contract-2 comparison of two {name: tensor} dicts at fp32 `rtol`.

    Elementwise |x - y| <= rtol·|y| + rtol·max|y|: relative to each element and, for elements
    that are sums cancelling to near zero, relative to the tensor's scale (a different
    reduction order legitimately moves those by ~1e-7 of the scale in fp32).
    """
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    assert a, "nothing to compare"
    for name in a:
        x, y = a[name].detach().float(), b[name].detach().float()
        scale = float(y.abs().max()) if y.numel() else 0.0
        torch.testing.assert_close(x, y, rtol=rtol, atol=rtol * scale + 1e-12, msg=lambda m, n=name: f"{n}: {m}")
