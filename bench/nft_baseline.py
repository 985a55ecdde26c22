"""The DiffusionNFT baseline of the headline benchmark, written from the paper's description (Zheng et al. 2025,
"DiffusionNFT: Online Diffusion Reinforcement with Forward Process").

Time convention as in vgrpo.py: sigma = 1 is noise, x_sigma = (1 - sigma) o + sigma eps, v = eps - o.

DiffusionNFT never estimates a likelihood. It samples clean images with any solver (here the same DPM-Solver++
ODE rollout V-GRPO uses), maps each reward to an optimality probability r in [0, 1], noises the images with
the forward process and trains the velocity with a flow-matching loss on two implicit policies built from the
sampling (old) velocity and the current one:

    v+ = (1 - beta) v_old + beta v_theta          (the positive policy, pulled towards good images)
    v- = (1 + beta) v_old - beta v_theta          (the negative policy, its reflection through v_old)
    L  = E[ r ||v+ - v||^2 + (1 - r) ||v- - v||^2 ]

Per sample, the minimiser is v_theta = v_old + (2 r - 1) (v - v_old) / beta: towards the flow-matching target of
images better than average, away from it for worse ones, unchanged at r = 1/2.

Choices, and why:
 1. Optimality probability r = 1/2 + 1/2 clip((r_raw - mean_group) / Z, -1, 1), Z the group's (population)
    std + 1e-4: the same per-group normalisation as the GRPO advantages of the other methods, so the methods
    differ in how they use the signal, not in how it is scaled. (The paper also allows a global std.)
 2. Adaptive loss weighting, the paper's: each branch's loss is written on the x-prediction,
    ||x0_hat - o||^2 = sigma^2 ||v_hat - v||^2, and divided by stopgrad(mean_d |x0_hat - o|), per row and
    branch. It is the weighting V-GRPO's surrogate took from DiffusionNFT, so both use the same scale.
 3. Noise levels and noises: N_MC per image, drawn independently per image and uniformly from the rollout's
    sigma grid without its final 0 (the paper draws t per image, with no sharing or stratification; N_MC
    of them keeps the rows equal to V-GRPO's). With one optimizer step per rollout, v_old on those rows is the
    update's own forward, detached: bit for bit what a no-grad pass with the sampling weights would give, the
    way V-GRPO's update takes s_old. So both cost S + N_MC forward rows per image.
 4. The sampling (old) policy is the weights at each rollout, i.e. the paper's soft update of the old policy
    with its coefficient at 0 (its schedule starts there). With several optimizer steps per rollout (the
    benchmark's FLUX regime) v_old of the minibatches after the first comes from a no-grad pass with the
    sampling weights before the first step (old_velocities), as V-GRPO's s_old does. In the one-step regime
    v_theta = v_old at the step and the gradient is
    2 beta sum (2 r - 1) (v_old - v) dv/dtheta: beta only scales it, and AdamW's step is invariant to a constant
    scale except through its epsilon (1e-8), which matters for the many tiny gradients of the tiny model (after
    two steps the parameter changes for beta = 1 and 0.1 differ by about 19%). Swept: 1 and 0.1.
 5. No CFG (DiffusionNFT is CFG-free; no method here uses it) and no KL term.
"""

import torch

import vgrpo

# --------------------------------------------------------------------------- the method's pure pieces


def optimality_probability(rewards, group_size, eps=1e-4):
    """r = 1/2 + 1/2 clip((r_raw - mean_group) / (std_group + eps), -1, 1), population std -> (P*G,) in [0, 1].
    rewards (P*G,) ordered group by group; a group of equal rewards gets 1/2 everywhere (no signal)."""
    r = rewards.float().view(-1, group_size)                                # (P, G)
    z = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)
    z = z.masked_fill((r == r[:, :1]).all(1, keepdim=True), 0.0)
    return (0.5 + 0.5 * z.clamp(-1, 1)).view(-1)


def implicit_policies(v_old, v_theta, beta):
    """The implicit positive and negative velocities (v+, v-) = ((1 - beta) v_old + beta v_theta,
    (1 + beta) v_old - beta v_theta)."""
    return (1 - beta) * v_old + beta * v_theta, (1 + beta) * v_old - beta * v_theta


def nft_loss(v_theta, v_old, x_t, o, sigma, r, beta, weighting="adaptive"):
    """DiffusionNFT's loss on rows (R, *lat): mean_rows [r l(v+) + (1 - r) l(v-)], in float32.

    l(v_hat) = mean_d (x0_hat - o)^2 / stopgrad(mean_d |x0_hat - o|) with x0_hat = x_t - sigma v_hat (adaptive,
    choice 2), or mean_d (v_hat - v)^2 with the target v = eps - o = (x_t - o) / sigma (weighting="none").
    sigma (R,), r (R,) the row's optimality probability."""
    v_theta, v_old, x_t, o = v_theta.float(), v_old.float(), x_t.float(), o.float()
    s = sigma.float().view(-1, *[1] * (o.dim() - 1))
    dims = tuple(range(1, o.dim()))

    def branch(v_hat):
        if weighting == "none":
            return (v_hat - (x_t - o) / s).pow(2).mean(dims)
        if weighting != "adaptive":
            raise ValueError(f"unknown weighting {weighting!r}")
        err = x_t - s * v_hat - o
        return err.pow(2).mean(dims) / err.abs().mean(dims).detach().clamp_min(1e-8)

    v_pos, v_neg = implicit_policies(v_old, v_theta, beta)
    l_pos, l_neg = branch(v_pos), branch(v_neg)
    loss = (r * l_pos + (1 - r) * l_neg).mean()
    return loss, {"loss_pos": l_pos.mean().item(), "loss_neg": l_neg.mean().item()}


# --------------------------------------------------------------------------- model evaluations


def rows(o, sigmas, eps, cond, idx):
    """The (sample, pair) rows of samples idx: x_t (b N, *lat), o (b N, *lat), sigma (b N,), cond repeated."""
    n = sigmas.shape[1]
    x_t = vgrpo.noisy_latents(o[idx], sigmas[idx], eps[idx]).flatten(0, 1)
    return x_t, o[idx].repeat_interleave(n, 0), sigmas[idx].flatten(), vgrpo.rows_of(cond, idx, n)


@torch.no_grad()
def old_velocities(family, model, batch, samples, micro_batch):
    """The sampling policy's velocity on every row of `samples` (before any optimizer step) -> (B, N, *lat), NaN on
    the other samples' rows: the v_old of the minibatches after the first when several steps follow one rollout."""
    o, sig, n = batch["o"], batch["sigmas"], batch["sigmas"].shape[1]
    out = torch.full(batch["eps"].shape, float("nan"))
    for idx in samples.split(micro_batch):
        x_t, _, s, c = rows(o, sig, batch["eps"], batch["cond"], idx)
        out[idx] = family.velocity(model, x_t, s, c).float().view(len(idx), n, *o.shape[1:])
    return out


def nft_update(family, model, optimizer, params, batch, beta, micro_batch, max_grad_norm, weighting="adaptive"):
    """One optimizer step on DiffusionNFT's loss over every row, gradients accumulated over micro-batches.
    batch: o (B, *lat), cond, r (B,), sigmas (B, N), eps (B, N, *lat), and v_old (B, N, *lat) after a first step.
    Without v_old no step has been taken since the rollout, so the sampling policy is the current weights and
    v_old is this forward's own value, detached (choice 3)."""
    o, sig, B = batch["o"], batch["sigmas"], len(batch["o"])
    n, stats = sig.shape[1], {"loss_pos": [], "loss_neg": []}
    for idx in torch.arange(B).split(micro_batch):
        x_t, o_rows, s, c = rows(o, sig, batch["eps"], batch["cond"], idx)
        v = family.velocity(model, x_t, s, c)
        v_old = batch["v_old"][idx].flatten(0, 1) if "v_old" in batch else v.detach()
        loss, st = nft_loss(v, v_old, x_t, o_rows, s,
                            batch["r"][idx].repeat_interleave(n), beta, weighting)
        (loss * len(idx) / B).backward()
        for k, value in st.items():
            stats[k].append(value)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {k: sum(v) / len(v) for k, v in stats.items()} | {"grad_norm": grad_norm}
