"""The MixGRPO baseline of the headline benchmark, written from the paper's description (Li et al. 2025,
"MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE").

Time convention as in vgrpo.py: sigma = 1 is noise, x_sigma = (1 - sigma) o + sigma eps, v = eps - o.

MixGRPO is Flow-GRPO's MDP (bench/mdp_baseline.py: the marginal-preserving SDE step as a Gaussian policy,
per-step clipped ratios) restricted to a sliding window of w consecutive denoising steps: inside the window the
rollout takes SDE steps and their log-probabilities are kept, outside it takes deterministic ODE steps, and only
the window's steps are trained. The window starts at the noisiest steps and moves one step later every
`shift_every` iterations; when it reaches the end it rolls back to the start.

Choices, and why:
 1. Plain MixGRPO, not MixGRPO-Flash: the ODE steps outside the window are first-order (Euler), as in the
    paper's main variant, whose FLUX numbers are the ones V-GRPO's "2x" is measured against. Every step of the
    12-step grid is kept, so the rollout costs what every other method's does.
 2. Window size w = 4 (the paper's) or 2 (the paper's 4 of 25 steps is 16% of the trajectory, 2 of our 12),
    picked by the sweep; stride 1 and roll-back, as in the paper.
 3. Shift interval: the paper moves the window every 25 iterations in 300-iteration runs, so the window
    travels a good part of the trajectory during a run; runs here are at most a few dozen iterations, so it
    moves every 8 (through all positions in 64 iterations with w = 4).
 4. The final step (to sigma = 0) is never in the window: its SDE noise is about 0.006 on this grid, so there
    is nothing to explore or to train there (the paper's window also stops short of the last steps).
 5. SDE noise a = 0.7, per-step clip range 1e-4, no KL (the paper's settings, shared with Flow-GRPO). The
    paper's advantage clip at 5 never binds with G = 8 (|A| <= sqrt(7)).
 6. The trained steps are the window's w steps of every sample (the MDP baseline trains K random ones).
"""

import torch

import mdp_baseline as mdp

# --------------------------------------------------------------------------- the sliding window


def window(iteration, n_steps, size, shift_every, stride=1):
    """Step indices of the SDE window at `iteration` (0-based): start = (iteration // shift_every) * stride,
    rolled back modulo the n_steps - size admissible starts (the last step is never in it, choice 4)."""
    if not 1 <= size < n_steps:
        raise ValueError(f"window size must be in [1, {n_steps - 1}], got {size}")
    start = (iteration // shift_every * stride) % (n_steps - size)
    return list(range(start, start + size))


# --------------------------------------------------------------------------- the mixed ODE-SDE rollout


@torch.no_grad()
def mixed_rollout(family, model, cond, noise, step_noise, sigmas, steps, a, micro_batch):
    """Euler ODE steps everywhere except the steps in `steps`, which are SDE steps (mdp_baseline.sde_step).

    noise (B, *lat) the start, step_noise (B, S, *lat) standard normals (only the window's are used).
    -> states (B, S + 1, *lat) with states[:, -1] = o, log_probs (B, S): the log-probability of each window
    transition under the sampling weights, 0 elsewhere (an ODE step has no density).
    """
    states, log_probs, in_window = [], [], set(steps)
    for idx in torch.arange(len(noise)).split(micro_batch):
        c = tuple(t[idx] for t in cond)
        x, xs, lps = noise[idx], [noise[idx]], []
        for i in range(len(sigmas) - 1):
            v = family.velocity(model, x, sigmas[i], c).float()
            if i in in_window:
                mean, std = mdp.sde_step(x.float(), v, mdp.per_row(sigmas[i], x), mdp.per_row(sigmas[i + 1], x),
                                         sigmas[1], a)
                x_next = mean + std * step_noise[idx, i]
                lps.append(mdp.gaussian_log_prob(x_next, mean, std))
            else:
                x_next = x.float() + (sigmas[i + 1] - sigmas[i]) * v
                lps.append(torch.zeros(len(idx)))
            x = x_next.to(x.dtype)
            xs.append(x)
        states.append(torch.stack(xs, 1))
        log_probs.append(torch.stack(lps, 1))
    return torch.cat(states), torch.cat(log_probs)


def window_steps(n_samples, steps):
    """The trained steps of every sample: the window's -> (B, w), the layout mdp_baseline.mdp_update takes."""
    return torch.tensor(steps).expand(n_samples, len(steps))
