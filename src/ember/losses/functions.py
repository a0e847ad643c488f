"""Tinker's built-in losses as pure tensor functions (docs/protocol.md §5).

Every function has the signature

    fn(target_logprobs, inputs, config, segment_ids) -> elementwise_loss_T

and works on a *packed micro-batch*: the per-token tensors of several datums concatenated
along the token dimension T.

* ``target_logprobs`` — log p_θ(target_tokens) under the current model, shape (T,) (or
  (T, K) for top-K ``cross_entropy``); it carries the autograd graph.
* ``inputs`` — the validated ``loss_fn_inputs`` (see ``validation.py``) concatenated over
  the same T tokens: ``weights``, ``logprobs`` (sampler log-probs q), ``advantages``,
  ``sequence_ratio_mask``.
* ``config`` — the resolved loss config (see ``config.py``).
* ``segment_ids`` — int64 (T,): the datum each token belongs to. Only GSPO needs it.

Normalisation: **none**. The returned tensor has shape (T,) and holds each token's loss
term; a datum's loss is the sum over its tokens and the micro-batch loss is ``.sum()`` —
no mean over tokens, datums or batches (docs/architecture.md contract 1). Normalisation is the
caller's choice, expressed through ``weights`` / ``advantages``.

Value losses (``value_mse``, ``ppo_value``) take the per-token *values* V_t of a scalar
head in place of ``target_logprobs``, with ``returns`` R_t (and ``old_values``) as inputs;
they are sums over tokens like every other loss.

Maths is done in ``promote(target_logprobs.dtype, float32)`` (so bf16 log-probs are
upcast, fp64 stays fp64). Notation: logp_t = target_logprobs, q_t = sampler logprobs,
A_t = advantages, w_t = weights, r_t = exp(logp_t − q_t), sg[·] = stop-gradient.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ember.errors import UserError

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]


def _compute_dtype(logp: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logp.dtype, torch.float32)


def _per_token(name: str, inputs: Inputs, logp_T: torch.Tensor) -> torch.Tensor:
    """``inputs[name]`` as a (T,) tensor in the compute dtype, aligned with ``logp_T``."""
    x_T = inputs[name]
    if x_T.shape != logp_T.shape:
        raise UserError(
            f"loss input {name!r} has shape {tuple(x_T.shape)}, "
            f"expected {tuple(logp_T.shape)} (same as target_logprobs)"
        )
    return x_T.to(device=logp_T.device, dtype=logp_T.dtype)


def _rl_tensors(
    target_logprobs: torch.Tensor, inputs: Inputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp_T, q_T, adv_T) in the compute dtype; logp_T keeps its graph."""
    if target_logprobs.dim() != 1:
        raise UserError(
            f"RL losses need target_logprobs of shape (T,), got {tuple(target_logprobs.shape)}"
        )
    logp_T = target_logprobs.to(_compute_dtype(target_logprobs))
    return logp_T, _per_token("logprobs", inputs, logp_T), _per_token("advantages", inputs, logp_T)


def _clip_bounds(config: Config) -> tuple[float, float]:
    return float(config["clip_low_threshold"]), float(config["clip_high_threshold"])


def _clipped_surrogate(
    ratio_T: torch.Tensor, adv_T: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """−min(ratio·A, clip(ratio, low, high)·A), elementwise (PPO's pessimistic bound)."""
    unclipped_T = ratio_T * adv_T
    clipped_T = torch.clamp(ratio_T, low, high) * adv_T
    return -torch.minimum(unclipped_T, clipped_T)


def cross_entropy(
    target_logprobs: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted negative log-likelihood, summed (no normalisation).

    loss_t = −w_t · logp_t; for top-K targets (T, K): loss_t = −Σ_k w_tk · logp_tk.
    Weights may be any real numbers (0/1 masks for SFT, −dC/dlogp for custom losses).
    On a value head the first argument holds the values V_t: loss_t = −w_t · V_t, the
    linear surrogate ``forward_backward_custom`` uses (weights = −dC/dV gives ∇C exactly).
    """
    logp = target_logprobs.to(_compute_dtype(target_logprobs))
    weights = _per_token("weights", inputs, logp)
    loss = -(weights * logp)
    return loss.sum(dim=1) if loss.dim() == 2 else loss


def importance_sampling(
    target_logprobs: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Importance-weighted REINFORCE, summed (no normalisation).

    loss_t = −r_t · A_t with r_t = exp(logp_t − q_t); d loss_t / d logp_t = −r_t · A_t.
    """
    logp_T, q_T, adv_T = _rl_tensors(target_logprobs, inputs)
    return -torch.exp(logp_T - q_T) * adv_T


def ppo(
    target_logprobs: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO clipped objective per token, summed (no normalisation).

    loss_t = −min(r_t · A_t, clip(r_t, low, high) · A_t); ``low``/``high`` are absolute
    ratio bounds (``clip_low_threshold``/``clip_high_threshold``, default 0.8/1.2).
    """
    logp_T, q_T, adv_T = _rl_tensors(target_logprobs, inputs)
    low, high = _clip_bounds(config)
    return _clipped_surrogate(torch.exp(logp_T - q_T), adv_T, low, high)


def cispo(
    target_logprobs: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """CISPO: clipped, stop-gradient importance weight on the log-likelihood; summed.

    loss_t = −sg[clip(r_t, low, high)] · logp_t · A_t (defaults low 0.0, high 4.0), so
    d loss_t / d logp_t = −clip(r_t, low, high) · A_t: every token keeps a gradient.
    """
    logp_T, q_T, adv_T = _rl_tensors(target_logprobs, inputs)
    low, high = _clip_bounds(config)
    weight_T = torch.clamp(torch.exp(logp_T - q_T), low, high).detach()
    return -weight_T * logp_T * adv_T


def dro(
    target_logprobs: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """DRO: policy gradient with a quadratic penalty on the log-ratio; summed.

    loss_t = −(logp_t · A_t − ½ · β · (logp_t − q_t)²).
    Tinker's docs show no default β; ember uses 0.1, following a third-party
    Tinker-compatible reimplementation (see ``registry.py``).
    """
    logp_T, q_T, adv_T = _rl_tensors(target_logprobs, inputs)
    beta = float(config["beta"])
    return -(logp_T * adv_T - 0.5 * beta * (logp_T - q_T) ** 2)


def gspo_sequence_log_ratio(
    logp_T: torch.Tensor, q_T: torch.Tensor, mask_T: torch.Tensor, segment_ids: torch.Tensor | None
) -> torch.Tensor:
    """Per token, its datum's mean of sg[logp] − q over the tokens with mask ≠ 0.

    Tokens are grouped by equal ``segment_ids`` (any labelling works). A datum whose
    mask is all zero gets log-ratio 0, i.e. s = 1 (Tinker's formula would be NaN there).
    """
    if segment_ids is None:
        segment_ids = torch.zeros_like(logp_T, dtype=torch.long)
    if segment_ids.shape != logp_T.shape:
        raise UserError(
            f"segment_ids has shape {tuple(segment_ids.shape)}, "
            f"expected {tuple(logp_T.shape)} (same as target_logprobs)"
        )
    ids_S, seg_T = torch.unique(segment_ids.to(logp_T.device), return_inverse=True)
    in_ratio_T = (mask_T != 0).to(logp_T.dtype)  # Tinker: `sequence_ratio_mask != 0`
    n_seg = ids_S.numel()
    total_S = logp_T.new_zeros(n_seg).index_add_(0, seg_T, (logp_T.detach() - q_T) * in_ratio_T)
    count_S = logp_T.new_zeros(n_seg).index_add_(0, seg_T, in_ratio_T)
    return (total_S / count_S.clamp(min=1.0))[seg_T]


def gspo(
    target_logprobs: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """GSPO-token (Tinker's variant): a sequence-level ratio with per-token gradients.

    Per datum, over the tokens M with ``sequence_ratio_mask`` ≠ 0:
        s = exp(mean_{t∈M} (sg[logp_t] − q_t))            (s = 1 when M is empty)
        s_t = sg[s] · exp(logp_t − sg[logp_t])             (value s, gradient s · ∇logp_t)
        loss_t = −min(s_t · A_t, clip(s_t, low, high) · A_t)
    The sum runs over *all* tokens t of the datum, masked or not (as in Tinker's formula:
    the mask only selects which tokens define s); mask out a token's contribution with
    A_t = 0. No normalisation. Defaults low 0.8 / high 1.2, as for ``ppo``.
    """
    logp_T, q_T, adv_T = _rl_tensors(target_logprobs, inputs)
    mask_T = _per_token("sequence_ratio_mask", inputs, logp_T)
    log_s_T = gspo_sequence_log_ratio(logp_T, q_T, mask_T, segment_ids)
    s_T = torch.exp(log_s_T + logp_T - logp_T.detach())
    low, high = _clip_bounds(config)
    return _clipped_surrogate(s_T, adv_T, low, high)


def stable_reinforce(
    target_logprobs: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """StableReinforce: REINFORCE on the sampled tokens with a masked importance ratio; summed.

    Tinker documents the interface (alpha): samples recorded with
    ``record_stability_info=True``, datums annotated with provenance spans, the loss name.
    It does not publish the objective; this formula is **ember's choice**, a REINFORCE that
    stays bounded off-policy (masking tokens whose trainer/sampler ratio left a trust band,
    as IcePop does for training/inference mismatch):

        r_t    = exp(logp_t − q_t)               q_t: the *recorded* sampler log-prob
        keep_t = 1[m_t ≠ 0] · 1[low ≤ sg[r_t] ≤ high]
                                   m_t = ``sampled_mask``: 1 where the target token is
                                   covered by a SampledProvenanceSpan, else 0
        loss_t = −keep_t · r_t · A_t             d loss_t / d logp_t = −keep_t · r_t · A_t

    ``q`` (``logprobs``) and ``m`` (``sampled_mask``) are filled in by the service from the
    records the datum's provenance names (``ember.service.stability``), never taken from
    the client. Provenance rule: every ``model_input`` token and every target under a
    ``SampledProvenanceSpan`` must equal the record (their recorded q_t is what the loss
    uses); targets under a ``PromptProvenanceSpan`` carry no loss (m_t = 0) and may be
    placeholders (tinker-cookbook's ``rl_loop`` sends 0s there). See docs/architecture.md.
    ``low``/``high`` are ``clip_low_threshold`` / ``clip_high_threshold``
    (default 0.5 / 2.0). Normalisation: none (sum over tokens and datums, contract 1).
    """
    logp_T, q_T, adv_T = _rl_tensors(target_logprobs, inputs)
    mask_T = _per_token("sampled_mask", inputs, logp_T)
    low, high = _clip_bounds(config)
    ratio_T = torch.exp(logp_T - q_T)
    keep_T = (mask_T != 0) & (ratio_T.detach() >= low) & (ratio_T.detach() <= high)
    return -keep_T.to(logp_T.dtype) * ratio_T * adv_T


def _value_tensors(
    values: torch.Tensor, inputs: Inputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v_T, returns_T, weights_T) in the compute dtype; v_T keeps its graph.

    ``weights`` defaults to ones (validation fills it in; direct callers may omit it)."""
    if values.dim() != 1:
        raise UserError(f"value losses need values of shape (T,), got {tuple(values.shape)}")
    v_T = values.to(_compute_dtype(values))
    w_T = _per_token("weights", inputs, v_T) if "weights" in inputs else torch.ones_like(v_T)
    return v_T, _per_token("returns", inputs, v_T), w_T


def value_mse(
    values: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Squared error of a scalar head's values against returns, summed (no normalisation).

    loss_t = ½ · w_t · (V_t − R_t)², R = ``returns``, w = ``weights`` (default 1);
    d loss_t / d V_t = w_t · (V_t − R_t).
    """
    v_T, r_T, w_T = _value_tensors(values, inputs)
    return 0.5 * w_T * (v_T - r_T) ** 2


def ppo_value(
    values: torch.Tensor,
    inputs: Inputs,
    config: Config,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO's clipped value loss (Schulman et al. 2017; baselines, verl), summed.

        V^clip_t = V^old_t + clamp(V_t − V^old_t, −ε, ε)      ε = ``value_clip`` (default 0.2)
        loss_t   = ½ · w_t · max((V_t − R_t)², (V^clip_t − R_t)²)

    V^old = ``old_values`` (the values the returns were computed with), R = ``returns``,
    w = ``weights`` (default 1). No normalisation.
    """
    v_T, r_T, w_T = _value_tensors(values, inputs)
    old_T = _per_token("old_values", inputs, v_T)
    eps = float(config["value_clip"])
    clipped_T = old_T + torch.clamp(v_T - old_T, -eps, eps)
    return 0.5 * w_T * torch.maximum((v_T - r_T) ** 2, (clipped_T - r_T) ** 2)
