"""The MDP baseline of the learning-efficiency and headline benchmarks: GRPO on per-step Gaussian transitions of
an SDE sampler, written from the Flow-GRPO paper's description (Liu et al. 2025, "Flow-GRPO: Training Flow
Matching Models via Online RL"), with the step subsampling of DanceGRPO / MixGRPO / Flow-GRPO-Fast.

Time convention as in vgrpo.py: sigma = 1 is noise, x_sigma = (1 - sigma) o + sigma eps, v = eps - o.

ODE -> SDE with the same marginals (Flow-GRPO, section 4.2). With x = (1 - t) o + t eps the posterior mean of
eps is x + (1 - t) v, so the score is -(x + (1 - t) v) / t. Adding Langevin noise of level sigma_t to the
probability-flow ODE dx = v dt and running t from 1 down to 0 (dt < 0) gives
    dx = [v + sigma_t^2 / (2 t) * (x + (1 - t) v)] dt + sigma_t dW,     sigma_t = a sqrt(t / (1 - t)),
and its Euler-Maruyama step from t to t_next < t is a Gaussian policy
    x_next ~ N(mean, std^2 I),  mean = x + [v + sigma_t^2 / (2 t) (x + (1 - t) v)] (t_next - t),
                                std = sigma_t sqrt(t - t_next).
Each denoising step is one action whose log-probability is exact, which is what the MDP formulation needs
(and what V-GRPO does without).

Choices, and why:
 1. a = 0.7, Flow-GRPO's noise level for SD3.5.
 2. sigma_t is infinite at t = 1 (the grid's first point): its noise level uses the grid's second value
    instead (a capped t), as Flow-GRPO's implementation is described to do; t itself stays 1 in the mean.
 3. The step to t = 0 is stochastic too (the formula as written); on the tiny model's grid its std is 0.006.
 4. log-probabilities are averaged over latent dimensions (Flow-GRPO does so); the scale matters only for
    the clip range, 1e-4 here (Flow-GRPO's setting).
 5. Training on a fraction of the steps: each sample trains on K of its S transitions drawn at random
    without replacement, fresh every iteration (Flow-GRPO's timestep fraction, DanceGRPO's 0.6, and the
    MixGRPO / Flow-GRPO-Fast point that a few steps carry the signal). K = N_MC of the V-GRPO run, so both
    methods back-propagate through exactly the same number of rows per sample: the comparison is of the
    estimators, not of the compute spent on them.
 6. The old log-probabilities come for free: they are the rollout's own, stored while sampling.
 7. No KL to a reference model (V-GRPO's runs here have none either); no CFG.
"""

import math

import torch

# --------------------------------------------------------------------------- the SDE policy


def per_row(t, like):
    """A per-sample time (B,) or a scalar -> a tensor broadcastable against `like` (B, *lat), float32."""
    t = torch.as_tensor(t, dtype=torch.float32).expand(like.shape[0])
    return t.reshape(-1, *[1] * (like.dim() - 1))


def noise_level(t, t_cap, a=0.7):
    """sigma_t = a sqrt(t / (1 - t)), with t capped at t_cap (< 1) so that the first step is finite."""
    t = t.clamp(max=float(t_cap))
    return a * (t / (1 - t)).sqrt()


def sde_step(x, v, t, t_next, t_cap, a=0.7):
    """Mean and std of the Euler-Maruyama step x_t -> x_{t_next} of the marginal-preserving SDE (above).
    x, v (B, *lat) float32; t, t_next broadcastable against x (per_row)."""
    level = noise_level(t, t_cap, a)
    dt = t_next - t                                                     # < 0: towards the data
    mean = x + (v + level ** 2 / (2 * t) * (x + (1 - t) * v)) * dt
    return mean, level * (-dt).sqrt()


def gaussian_log_prob(x_next, mean, std):
    """log N(x_next; mean, std^2 I), averaged over the latent dimensions -> (B,), in float32."""
    lp = -(x_next.float() - mean) ** 2 / (2 * std ** 2) - std.log() - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


@torch.no_grad()
def sde_rollout(family, model, cond, noise, step_noise, sigmas, a, micro_batch):
    """Sample with the SDE, keeping every state and the log-probability of every transition taken.

    noise (B, *lat) the start, step_noise (B, S, *lat) the standard normal draw of each step.
    -> states (B, S + 1, *lat) with states[:, -1] = o, log_probs (B, S) under the sampling weights.
    """
    states, log_probs = [], []
    for idx in torch.arange(len(noise)).split(micro_batch):
        c = tuple(t[idx] for t in cond)
        x, xs, lps = noise[idx], [noise[idx]], []
        for i in range(len(sigmas) - 1):
            v = family.velocity(model, x, sigmas[i], c)
            mean, std = sde_step(x.float(), v.float(), per_row(sigmas[i], x), per_row(sigmas[i + 1], x), sigmas[1], a)
            x = (mean + std * step_noise[idx, i]).to(x.dtype)
            xs.append(x)
            lps.append(gaussian_log_prob(x, mean, std))
        states.append(torch.stack(xs, 1))
        log_probs.append(torch.stack(lps, 1))
    return torch.cat(states), torch.cat(log_probs)


def train_steps(n_samples, n_steps, k, generator):
    """K distinct step indices per sample, uniformly at random -> (B, K) (choice 5 above)."""
    return torch.stack([torch.randperm(n_steps, generator=generator)[:k] for _ in range(n_samples)])


# --------------------------------------------------------------------------- the per-step clipped loss


def mdp_loss(log_prob_new, log_prob_old, advantages, clip_eps):
    """Flow-GRPO's objective on (sample, step) rows: ratio = exp(logp_new - logp_old) per step,
    loss = -mean_rows min(ratio A, clip(ratio, 1 -+ clip_eps) A), A the sample's group advantage."""
    ratio = torch.exp(log_prob_new - log_prob_old)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages).mean()
    stats = {"clip_frac": ((ratio - 1).abs() > clip_eps).float().mean().item(),
             "ratio_dev": (ratio - 1).abs().max().item()}
    return loss, stats


def mdp_update(family, model, optimizer, params, rollout, steps, A, sigmas, a, clip_eps, micro_batch, max_grad_norm):
    """One optimizer step on the selected transitions of every sample, gradients accumulated over
    micro-batches of `micro_batch` samples x K steps (the same rows per forward as V-GRPO's N_MC pairs).

    rollout: dict with states (B, S+1, *lat), log_probs (B, S), cond. steps (B, K) from train_steps.
    """
    states, log_probs_old, cond = rollout["states"], rollout["log_probs"], rollout["cond"]
    B, K = steps.shape
    stats = {"clip_frac": [], "ratio_dev": []}
    for idx in torch.arange(B).split(micro_batch):
        rows_i, rows_k = idx.repeat_interleave(K), steps[idx].reshape(-1)  # (b K,) sample and step of each row
        x, x_next = states[rows_i, rows_k], states[rows_i, rows_k + 1]      # (b K, *lat)
        v = family.velocity(model, x, sigmas[rows_k], tuple(c[rows_i] for c in cond))
        mean, std = sde_step(x.float(), v.float(), per_row(sigmas[rows_k], x), per_row(sigmas[rows_k + 1], x),
                             sigmas[1], a)
        loss, st = mdp_loss(gaussian_log_prob(x_next, mean, std), log_probs_old[rows_i, rows_k], A[rows_i], clip_eps)
        (loss * len(idx) / B).backward()
        for name, value in st.items():
            stats[name].append(value)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"clip_frac": sum(stats["clip_frac"]) / len(stats["clip_frac"]), "ratio_dev_first": max(stats["ratio_dev"]),
            "grad_norm": grad_norm}
