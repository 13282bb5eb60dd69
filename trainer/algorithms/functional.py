"""The RL math as pure tensor functions: masked statistics, losses and KL estimators (advantages: advantages.py).

Shapes: ``B`` is the batch (one row per response), ``T`` the response length, ``V`` the vocabulary.
Response-level tensors are ``[B, T]`` and come with a ``response_mask`` of the same shape: 1.0 on
real response tokens (EOS included), 0.0 on the right padding after EOS. Nothing here keeps state
or reads config; the trainer passes every number in, so each function is testable on its own.

Modelled on verl's ``core_algos.py`` so that verl's config names mean the same thing here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("kl", "abs", "mse", "low_var_kl")
# verl's other names for the same estimators (Schulman's k1, k2, k3): a verl config must run unchanged.
KL_ESTIMATOR_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}

# exp() of a log-ratio above ~88 overflows float32 to inf, and inf * 0 (a zero advantage or a
# masked token) is nan; no ratio this far from 1 carries a useful gradient anyway.
_LOG_RATIO_LIMIT = 20.0
# verl clamps k3 to this range: a single token far off the reference must not dominate the KL.
_LOW_VAR_KL_LIMIT = 10.0
WHITEN_EPSILON = 1e-8


# ------------------------------------------------------------------------------ masked statistics


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1.

    Args:
        values: any shape.
        mask: same shape as ``values``, 1.0 keeps a position.
        dim: reduce over this dim only; ``None`` reduces over everything to a scalar.

    Returns:
        ``values`` reduced over ``dim``. An all-masked slice gives 0, not nan, so an empty
        micro-batch does not poison the running metrics.
    """
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the positions where ``mask`` is 1, as a scalar.

    ``unbiased`` applies Bessel's correction n / (n - 1). With fewer than two kept positions the
    variance is 0 rather than an error or nan: whitening one token then maps it to 0.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return variance
    count = mask.sum()
    # Clamping keeps n=0 and n=1 finite without a host sync on the count.
    return variance * count / (count - 1).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to unit variance (and zero mean if ``shift_mean``) over the masked positions.

    Statistics come from the kept positions only; masked positions are transformed too but carry
    no meaning, so callers multiply by ``mask`` afterwards.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + WHITEN_EPSILON)
    return whitened if shift_mean else whitened + mean


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes (verl's ``loss_agg_mode``):
        ``token-mean``: sum over all kept tokens / number of kept tokens (long answers weigh more).
        ``seq-mean-token-sum``: per-sequence sum, then mean over sequences (Dr.GRPO).
        ``seq-mean-token-mean``: per-sequence mean, then mean over sequences (original GRPO).
    Sequence means run over rows with at least one kept token, so an empty row changes nothing.
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{mode}'; allowed: {', '.join(LOSS_AGG_MODES)}")
    tokens_per_row = mask.sum(-1)
    row_losses = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        row_losses = row_losses / tokens_per_row.clamp(min=1)
    return masked_mean(row_losses, (tokens_per_row > 0).to(row_losses.dtype))


def aggregation_weight(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What :func:`aggregate_loss` divides by over ``mask`` ``[B, T]``: the kept tokens (``token-mean``) or
    the rows with any (``seq-mean-*``). A micro-batch's aggregate loss times its weight over its mini-batch's
    is its part of the mini-batch's aggregate loss, however the mini-batch was split (verl's global token
    count, ``batch_num_tokens``); weighting by sequence count instead holds for the ``seq-mean`` modes only.
    """
    if mode == "token-mean":
        return mask.sum()
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{mode}'; allowed: {', '.join(LOSS_AGG_MODES)}")
    return (mask.sum(-1) > 0).sum()


# ------------------------------------------------------------------------------------------ losses


class PolicyLoss(NamedTuple):
    """Result of :func:`compute_policy_loss`; every field is a scalar tensor."""

    loss: torch.Tensor
    """Aggregated clipped surrogate loss; keeps the graph."""
    clipfrac: torch.Tensor
    """Fraction of response tokens where the ratio clip was active (detached)."""
    ppo_kl: torch.Tensor
    """Mean of old_log_prob - log_prob over response tokens (detached)."""
    clipfrac_lower: torch.Tensor
    """Fraction of response tokens where the dual clip capped the loss (detached)."""


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate loss with an asymmetric clip range and dual clip.

    Per token, with r = exp(log_prob - old_log_prob):
        L = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7, negated to a loss;
    asymmetric range as in DAPO, Yu et al. 2025). For A < 0 the loss is further capped at
    -A * clip_ratio_c (dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with
    Deep Reinforcement Learning", eq. 5), so one very unlikely-now token cannot blow up the step.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``; only ``log_prob`` needs grad.
        clip_ratio_low, clip_ratio_high: clip range [1 - low, 1 + high].
        clip_ratio_c: dual-clip bound, must be > 1.
        loss_agg_mode: see :func:`aggregate_loss`.
        weights: ``[B, T]`` each token's loss is multiplied by (rollout correction's importance weights, detached);
            None: 1.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    ppo_losses = torch.maximum(unclipped, clipped)
    dual_clip_bound = -advantages * clip_ratio_c
    is_negative = advantages < 0
    token_losses = torch.where(is_negative, torch.minimum(ppo_losses, dual_clip_bound), ppo_losses)
    if weights is not None:
        token_losses = token_losses * weights
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(ratio.dtype), response_mask)
        dual_clipped = is_negative & (ppo_losses > dual_clip_bound)
        clipfrac_lower = masked_mean(dual_clipped.to(ratio.dtype), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return PolicyLoss(
        loss=aggregate_loss(token_losses, response_mask, loss_agg_mode),
        clipfrac=clipfrac,
        ppo_kl=ppo_kl,
        clipfrac_lower=clipfrac_lower,
    )


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 style, as in OpenAI baselines and verl).

    vpred_clipped = values + clamp(vpreds - values, -c, c);
    L = 0.5 * max((vpreds - returns)^2, (vpred_clipped - returns)^2), aggregated.

    Args:
        vpreds: ``[B, T]`` current critic predictions (with grad).
        values: ``[B, T]`` critic values at rollout time.
        returns: ``[B, T]`` targets from the advantage estimator.
        response_mask: ``[B, T]``.
        cliprange_value: c above.
        loss_agg_mode: see :func:`aggregate_loss`.

    Returns:
        ``(loss, clipfrac)``: the scalar loss, and the detached fraction of tokens where the
        clipped branch was strictly larger (verl's ``critic/vf_clipfrac``).
    """
    vpred_clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(vpreds.dtype), response_mask)
    return loss, clipfrac


def actor_loss(
    pg_loss: torch.Tensor,
    entropy: torch.Tensor,
    kl_loss: torch.Tensor | None,
    *,
    entropy_coeff: float,
    kl_loss_coef: float,
) -> torch.Tensor:
    """The actor's objective: L = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss.

    The entropy enters as a bonus (minimising L raises the entropy: dL/dH = -entropy_coeff) and the
    KL to the reference as a penalty (minimising L pulls the policy towards it: dL/dKL = +kl_loss_coef),
    as in verl's dp_actor and the GRPO objective (Shao et al. 2024, eq. 3).

    Args:
        pg_loss: scalar clipped surrogate loss (:func:`compute_policy_loss`).
        entropy: scalar aggregated entropy of the policy over the response tokens.
        kl_loss: scalar aggregated KL(policy || reference) estimate, or ``None`` without a KL loss.
        entropy_coeff: weight of the entropy bonus (``actor.entropy_coeff``).
        kl_loss_coef: weight of the KL loss (``actor.kl_loss_coef``); unused when ``kl_loss`` is None.
    """
    loss = pg_loss - entropy_coeff * entropy
    if kl_loss is not None:
        loss = loss + kl_loss_coef * kl_loss
    return loss


# ------------------------------------------------------------------------------- logits and KL


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in float32, with one float32 copy of ``[..., V]`` at most: the division
    happens in place on the upcast copy, and not at all at temperature 1 (``x / 1.0`` is a second full
    copy: 0.6 GB for 8 x 128 tokens of a 152k vocabulary). Logits that are float32 already are divided
    out of place: they may be the model's own output, which its backward may need."""
    scaled = logits.float()
    if temperature == 1.0:
        return scaled
    if scaled is logits:
        return scaled / temperature
    return scaled.div_(temperature)  # the upcast's backward keeps nothing: in place is safe


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: ``[..., V] -> [...]``.

    H = logsumexp(z) - sum(softmax(z) * z), which never takes the log of a tiny probability.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def _gathered_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per position: ``[..., V]`` and ``[...]`` -> ``[...]``.

    Computed as the gathered logit minus logsumexp, so no ``[..., V]`` log-softmax copy is kept.
    Half-precision logits are upcast to float32 one leading row at a time (the result is float32):
    a bf16 logsumexp is off by ~0.05 nats at typical magnitudes, which shows up directly as noise
    in the PPO ratio, while upcasting the whole ``[B, T, V]`` tensor at once would double its memory.
    """
    if logits.dtype in (torch.float32, torch.float64):
        return _gathered_log_probs(logits, labels)
    if logits.dim() < 2:
        return _gathered_log_probs(logits.float(), labels)
    rows = zip(logits, labels, strict=True)
    return torch.stack([_gathered_log_probs(row.float(), row_labels) for row, row_labels in rows])


LOSS_CHUNK_ELEMENTS = 1 << 24
"""Logits a chunk of `log_probs_and_entropy_from_logits` widens to float32 at once (64 MB): whole sequences, or runs
of one sequence's positions where a sequence is larger (`_loss_chunks`)."""


class _LogProbsAndEntropy(torch.autograd.Function):
    """Per position: log softmax(z / T)[label] and the entropy of softmax(z / T), from [B, R, V] logits z of any
    dtype, a chunk at a time (`_loss_chunks`), in float32. What it keeps for the backward is the logits as they came
    (bf16: half of one float32 copy) and one logsumexp per position; the backward computes the softmax again, chunk
    by chunk.

    Written by hand because the composed ops keep several float32 [B, R, V] tensors alive at once (the upcast
    logits, the softmax and its product for the entropy, the gradient): 1.2 GB each for 16 x 128 tokens of a
    152k vocabulary, the largest part of an update's working memory, which an offloaded update pays for in
    layers it streams. verl chunks its entropy for the same reason; torch has no fused kernel for the pair.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunks: list[tuple[slice, slice]], kernels: ChunkKernels) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an unused output (the entropy as a metric) gets no gradient at all
        log_probs = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        entropies, totals = torch.empty_like(log_probs), torch.empty_like(log_probs)
        for part in chunks:
            log_probs[part], entropies[part], totals[part] = kernels.forward(logits[part], labels[part], temperature)
        ctx.save_for_backward(logits, labels, totals)
        ctx.temperature, ctx.chunks, ctx.kernels = temperature, chunks, kernels
        return log_probs, entropies

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None,
                 grad_entropies: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits, labels, totals = ctx.saved_tensors
        if grad_log_probs is None and grad_entropies is None:
            return None, None, None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for part in ctx.chunks:
            grad[part] = ctx.kernels.backward(logits[part], labels[part], totals[part],
                                              None if grad_log_probs is None else grad_log_probs[part],
                                              None if grad_entropies is None else grad_entropies[part],
                                              ctx.temperature)
        return grad, None, None, None, None


def _chunk_forward(logits: torch.Tensor, labels: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of `_LogProbsAndEntropy`'s forward: [..., V] logits and [...] labels -> float32 [...] log-probs,
    entropies and logsumexps of softmax(logits / temperature)."""
    scaled = _scaled_chunk(logits, temperature)
    total = torch.logsumexp(scaled, dim=-1)
    log_probs = scaled.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - total
    entropies = total - (torch.exp(scaled - total.unsqueeze(-1)) * scaled).sum(-1)
    return log_probs, entropies, total


def _chunk_backward(logits: torch.Tensor, labels: torch.Tensor, totals: torch.Tensor,
                    grad_log_probs: torch.Tensor | None, grad_entropies: torch.Tensor | None,
                    temperature: float) -> torch.Tensor:
    """One chunk of `_LogProbsAndEntropy`'s backward: the [..., V] gradient of the logits (float32; the softmax
    computed again from the logits and their logsumexps `totals`)."""
    scaled = _scaled_chunk(logits, temperature, own=True)  # changed in place by softmax_gradient
    return softmax_gradient(scaled, totals, labels, grad_log_probs, grad_entropies, temperature)


def softmax_gradient(scaled: torch.Tensor, totals: torch.Tensor, labels: torch.Tensor,
                     grad_log_probs: torch.Tensor | None, grad_entropies: torch.Tensor | None, temperature: float, *,
                     means: torch.Tensor | None = None, inside: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 gradient of logits z, given as `scaled` = z / T in float32 (changed in place), of the log-prob of
    each position's label and of its entropy, from the positions' logsumexps of z / T (`totals`) and the softmax
    means of z / T (`means`; None: computed here): d entropy / dz_j = -p_j (z_j - sum_i p_i z_i) and
    d log p_label / dz_j = [j = label] - p_j, both over T. `inside`: whether each label falls in these columns (a
    tile of the vocabulary: use_fused_kernels' trainer/algorithms/fused_head.py; None: every label does)."""
    probs = torch.exp(scaled - totals.unsqueeze(-1))
    if grad_entropies is not None:
        means = (probs * scaled).sum(-1) if means is None else means
        grad = scaled.sub_(means.unsqueeze(-1)).mul_(probs).mul_(-grad_entropies.unsqueeze(-1))
        if grad_log_probs is not None:
            grad.sub_(probs.mul_(grad_log_probs.unsqueeze(-1)))
    else:
        assert grad_log_probs is not None
        grad = probs.mul_(-grad_log_probs.unsqueeze(-1))
    if grad_log_probs is not None:
        added = grad_log_probs if inside is None else torch.where(inside, grad_log_probs, 0.0)
        grad.scatter_add_(-1, labels.unsqueeze(-1), added.unsqueeze(-1))
    return grad / temperature if temperature != 1.0 else grad


class ChunkKernels(NamedTuple):
    """The per-chunk functions of `log_probs_and_entropy_from_logits`: as written (EAGER_KERNELS), or compiled
    (trainer/algorithms/compiled_kernels.py: actor.use_torch_compile)."""

    forward: Any
    """(logits, labels, temperature) -> (log_probs, entropies, logsumexps), as `_chunk_forward`."""
    backward: Any
    """(logits, labels, logsumexps, grad_log_probs, grad_entropies, temperature) -> the logits' gradient."""


EAGER_KERNELS = ChunkKernels(_chunk_forward, _chunk_backward)


def _loss_chunks(shape: torch.Size, budget: int) -> list[tuple[slice, slice]]:
    """(sequences, positions) of each chunk of `shape`'s [B, R, V] logits: as many whole sequences as `budget`
    elements hold, or runs of one sequence's positions where a sequence alone is more (long responses)."""
    sequences, positions, vocabulary = shape
    per_chunk = max(1, budget // max(1, vocabulary))  # positions
    if per_chunk >= positions:
        rows = per_chunk // max(1, positions)
        return [(slice(first, first + rows), slice(None)) for first in range(0, sequences, rows)]
    return [(slice(row, row + 1), slice(first, first + per_chunk))
            for row in range(sequences) for first in range(0, positions, per_chunk)]


def _scaled_chunk(logits: torch.Tensor, temperature: float, *, own: bool = False) -> torch.Tensor:
    """`logits` / `temperature` in float32; with `own` a tensor of its own even where that is `logits` unchanged
    (float32 at temperature 1), which may then be changed in place."""
    if temperature != 1.0:
        return logits.float() / temperature  # out of place: float32 logits are the caller's
    return logits.to(torch.float32, copy=own)


def log_probs_and_entropy_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                                      entropy_graph: bool = True,
                                      kernels: ChunkKernels = EAGER_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, R, V]`` logits and ``[B, R]`` labels -> float32 ``[B, R]`` log-probs of the labels and entropies, both of
    softmax(logits / temperature), as `log_probs_from_logits` and `entropy_from_logits` of `scaled_logits` give them
    (to float32 rounding) with a fraction of their memory (`_LogProbsAndEntropy`). Without `entropy_graph` the
    entropies carry no gradient (a metric). `kernels`: the per-chunk functions (compiled ones: ChunkKernels)."""
    chunks = _loss_chunks(logits.shape, LOSS_CHUNK_ELEMENTS)
    log_probs, entropies = _LogProbsAndEntropy.apply(logits, labels, temperature, chunks, kernels)  # type: ignore[no-untyped-call]
    return log_probs, entropies if entropy_graph else entropies.detach()


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs, ``[B, T]``.

    Estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):
        ``kl``: k1 = log p - log q (unbiased, high variance, can be negative).
        ``abs``: |log p - log q|.
        ``mse``: k2 = 0.5 * (log p - log q)^2 (low variance, biased).
        ``low_var_kl``: k3 = r - log r - 1 with r = q / p (unbiased, non-negative), clamped to
        [-10, 10] as verl does.
    verl's aliases ``k1``, ``k2`` and ``k3`` name ``kl``, ``mse`` and ``low_var_kl``.
    """
    estimator = KL_ESTIMATOR_ALIASES.get(estimator, estimator)
    log_ratio = log_prob - ref_log_prob
    if estimator == "kl":
        return log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "mse":
        return 0.5 * log_ratio.square()
    if estimator == "low_var_kl":
        ref_over_policy = (-log_ratio).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        k3 = torch.exp(ref_over_policy) - ref_over_policy - 1
        return k3.clamp(-_LOW_VAR_KL_LIMIT, _LOW_VAR_KL_LIMIT)
    allowed = [*KL_ESTIMATORS, *(f"{alias} (= {name})" for alias, name in KL_ESTIMATOR_ALIASES.items())]
    raise ValueError(f"unknown KL estimator '{estimator}'; allowed: {', '.join(allowed)}")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Subtract a KL penalty from the token rewards (Ziegler et al. 2019, sec. 2.2; verl's in-reward KL).

    Args:
        token_level_scores: ``[B, T]`` rewards from the reward function or model.
        log_prob, ref_log_prob: ``[B, T]`` sampled-token log-probs of the actor and reference.
        response_mask: ``[B, T]``.
        kl_coef: beta, usually a KL controller's current value.
        estimator: see :func:`kl_penalty`.

    Returns:
        ``(token_level_rewards, mean_kl)``: rewards = scores - kl_coef * kl * mask, ``[B, T]``;
        mean_kl is a scalar, the mean over sequences of each sequence's masked-mean KL
        (verl's ``actor/reward_kl_penalty``, which feeds the adaptive controller).
    """
    kl = kl_penalty(log_prob, ref_log_prob, estimator) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kl
    mean_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return token_level_rewards, mean_kl
