"""Rejection sampling of draft tokens against the target model (lossless).

Speculative sampling as in Leviathan et al. (2023) and Chen et al. (2023): for
request i with drafts x_0..x_{n-1} (n = num_draft_tokens[i]), draft j is
accepted if u_j < min(1, p_j(x_j) / q_j(x_j)). At the first rejection one token
is drawn from norm(max(0, p_j - q_j)) and the request stops; if all n drafts
are accepted a bonus token is drawn from p_n. Every request therefore emits
num_accepted + 1 tokens and the emitted sequence is distributed exactly as if
it had been sampled from the target alone. Greedy requests accept a draft iff
it equals the target argmax and emit the argmax at the stop position.

`rejection_sample` is branch-free tensor code: no host syncs (no .item(),
.tolist(), boolean indexing or data-dependent shapes), so it can run inside a
CUDA graph and never stalls the CPU. All randomness is passed in, which lets
the caller draw it per request from that request's own generator
(`draw_randomness`), so a seeded request's output does not depend on which
other requests share its batch.
"""
from __future__ import annotations

import torch


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    target_argmax: torch.Tensor,
    uniform_samples: torch.Tensor,
    exp_noise: torch.Tensor,
    forced_accept_prob: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of N requests; returns (output_token_ids, num_accepted).

    Args (N requests, k draft slots, vocabulary V):
        draft_token_ids: [N, k] int64. Slots at or past num_draft_tokens[i]
            are ignored and may hold anything (e.g. -1).
        num_draft_tokens: [N] int64, each in [0, k].
        draft_probs: [N, k, V] float32 draft distributions q, or None when the
            drafts come from a deterministic proposer (n-gram), in which case q
            is one-hot on the draft token. float32 is required: rounding q to a
            16-bit type makes the output measurably differ from the target.
        target_probs: [N, k+1, V] float32 target distributions p, already
            temperature-scaled, filtered and normalized. Row j is the
            distribution at draft position j; for request i the bonus
            distribution is row num_draft_tokens[i]. Ignored for greedy rows.
        greedy: [N] bool; greedy rows use target_argmax and exact matching.
        target_argmax: [N, k+1] int64, argmax of the processed target logits.
        uniform_samples: [N, k] float32 in [0, 1), one per draft position.
        exp_noise: [N, V] float32 Exponential(1) samples, all > 0 (inf is
            harmless).
            A token is drawn from p as argmax(p / noise) (the exponential race,
            equivalent to the Gumbel-max trick, and insensitive to whether p is
            normalized). Each request draws exactly one token (recovered or
            bonus), at its stop position, so one row of noise per request
            serves whichever position that turns out to be.
        forced_accept_prob: benchmark-only. When set, every draft (greedy or
            sampled row) is accepted with this probability, independently per
            position, ignoring p and q; output tokens are still valid tokens
            but the output distribution is no longer the target's.

    Returns:
        output_token_ids: [N, k+1] int64; request i's accepted drafts followed
            by its recovered or bonus token, then -1.
        num_accepted: [N] int64, the number of accepted drafts.
    """
    _check_inputs(draft_token_ids, num_draft_tokens, draft_probs, target_probs,
                  greedy, target_argmax, uniform_samples, exp_noise, forced_accept_prob)
    k = draft_token_ids.shape[1]
    slots = torch.arange(k, device=draft_token_ids.device)
    valid = slots < num_draft_tokens[:, None]
    # Padded slots may hold -1, which gather would reject; their value never matters.
    drafts = torch.where(valid, draft_token_ids, 0)

    accepted = valid & _accept_each_draft(drafts, draft_probs, target_probs, greedy,
                                          target_argmax, uniform_samples, forced_accept_prob)
    # A draft counts only if every earlier draft was accepted too.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    emitted = _emitted_token(drafts, num_accepted, num_draft_tokens, draft_probs,
                             target_probs, greedy, target_argmax, exp_noise)
    return _assemble_output(drafts, num_accepted, emitted), num_accepted


def draw_randomness(
    num_reqs: int,
    k: int,
    vocab_size: int,
    generators: list[torch.Generator | None],
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw (uniform_samples [N, k], exp_noise [N, V]) for `rejection_sample`.

    A request with its own generator (a seeded request) gets its row drawn from
    that generator alone, so its output is reproducible whatever else is in the
    batch. The other rows come from `default_generator` (torch's global
    generator when None). Generators must live on `device`. Each seeded row
    costs a few small kernel launches.
    """
    if len(generators) != num_reqs:
        raise ValueError(f"got {len(generators)} generators for {num_reqs} requests")
    # One batched draw for everyone; seeded rows are then overwritten, which
    # wastes a little randomness but needs no row bookkeeping.
    uniform = torch.rand(num_reqs, k, device=device, generator=default_generator)
    noise = _exponential((num_reqs, vocab_size), device, default_generator)
    for i, g in enumerate(generators):
        if g is not None:
            uniform[i] = torch.rand(k, device=device, generator=g)
            noise[i] = _exponential((vocab_size,), device, g)
    return uniform, noise


def _exponential(shape: tuple[int, ...], device: torch.device | str,
                 generator: torch.Generator | None) -> torch.Tensor:
    # -log(u) with u in [0, 1) is Exponential(1) and never 0 (u = 0 gives inf, which
    # just makes that token lose), so argmax(p / noise) never sees 0/0 = NaN. It is
    # also faster than Tensor.exponential_ on CPU.
    return torch.rand(shape, device=device, generator=generator).log_().neg_()


def _gather_token(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """probs [N, T, V], token_ids [N, T] -> the probability of each token [N, T]."""
    return probs.gather(2, token_ids.unsqueeze(2)).squeeze(2)


def _take_position(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [N, T, V], index [N] -> x[i, index[i]] as [N, V], via gather (sync-free)."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[2])).squeeze(1)


def _accept_each_draft(drafts, draft_probs, target_probs, greedy, target_argmax,
                       uniform_samples, forced_accept_prob) -> torch.Tensor:
    """Whether each draft passes its own test, ignoring earlier rejections: [N, k]."""
    if forced_accept_prob is not None:
        return uniform_samples < forced_accept_prob
    k = drafts.shape[1]
    p = _gather_token(target_probs[:, :k], drafts)
    q = 1.0 if draft_probs is None else _gather_token(draft_probs, drafts)
    # u < min(1, p/q) rewritten without division: q may be 0 (then accept iff p > 0).
    sampled_ok = uniform_samples * q < p
    greedy_ok = drafts == target_argmax[:, :k]
    return torch.where(greedy[:, None], greedy_ok, sampled_ok)


def _emitted_token(drafts, num_accepted, num_draft_tokens, draft_probs, target_probs,
                   greedy, target_argmax, exp_noise) -> torch.Tensor:
    """The one token each request draws itself: a recovered token or the bonus. [N]"""
    # The stop position is also the index of that token's target distribution.
    stop = num_accepted
    greedy_token = target_argmax.gather(1, stop[:, None]).squeeze(1)

    p = _take_position(target_probs, stop)
    rejected = stop < num_draft_tokens
    dist = torch.where(rejected[:, None], _residual(p, drafts, draft_probs, stop), p)
    sampled_token = (dist / exp_noise).argmax(dim=1)
    return torch.where(greedy, greedy_token, sampled_token)


def _residual(p: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
              stop: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) at the stop position, unnormalized (the sampling does not care).

    Only used for rows that rejected a draft at `stop`; for other rows `stop`
    may equal k, so it is clamped to stay a valid index.
    """
    k = drafts.shape[1]
    if k == 0:
        return p
    at = stop.clamp(max=k - 1)
    if draft_probs is None:
        # q is one-hot on the draft token and p <= 1, so max(0, p - q) just zeroes that token.
        residual = p.scatter(1, drafts.gather(1, at[:, None]), 0.0)
    else:
        residual = (p - _take_position(draft_probs, at)).clamp_min(0.0)
    # All zero only when p <= q everywhere, i.e. p == q up to rounding: then p is the answer.
    return torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)


def _assemble_output(drafts: torch.Tensor, num_accepted: torch.Tensor,
                     emitted: torch.Tensor) -> torch.Tensor:
    k = drafts.shape[1]
    cols = torch.arange(k + 1, device=drafts.device)[None, :]
    padded_drafts = torch.nn.functional.pad(drafts, (0, 1), value=-1)
    out = torch.where(cols < num_accepted[:, None], padded_drafts, -1)
    return torch.where(cols == num_accepted[:, None], emitted[:, None], out)


def _check_inputs(draft_token_ids, num_draft_tokens, draft_probs, target_probs, greedy,
                  target_argmax, uniform_samples, exp_noise, forced_accept_prob) -> None:
    """Shape and dtype checks only: they read metadata, never device values."""
    n, k = draft_token_ids.shape
    v = target_probs.shape[-1]
    expected = {
        "num_draft_tokens": (num_draft_tokens, (n,)),
        "target_probs": (target_probs, (n, k + 1, v)),
        "greedy": (greedy, (n,)),
        "target_argmax": (target_argmax, (n, k + 1)),
        "uniform_samples": (uniform_samples, (n, k)),
        "exp_noise": (exp_noise, (n, v)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (n, k, v))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    for name, tensor in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if tensor is not None and tensor.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {tensor.dtype}: 16-bit "
                            "probabilities bias rejection sampling")
    if greedy.dtype != torch.bool:
        raise TypeError(f"greedy must be a bool tensor, got {greedy.dtype}")
    if forced_accept_prob is not None and not 0.0 <= forced_accept_prob <= 1.0:
        raise ValueError(f"forced_accept_prob must be in [0, 1], got {forced_accept_prob}")
