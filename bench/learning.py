"""Learning efficiency: V-GRPO against its baselines, side by side on the same model.

    python bench/learning.py --reward jpeg --seed 0 --out /tmp/jpeg-0.json     # one job (run.py runs them all)
    python bench/learning.py --reward colour --seed 1 --methods '[{"kind": "DiffusionNFT", "lr": 0.003}]' \
        --target-gain 0.05 --iterations 80 --eval-every 2 --out /tmp/nft-1.json    # learners of your choice

One process trains copies of the same transformer (full fine-tuning, AdamW): the tiny random SD3
(vgrpo.build_tiny_sd3_pipeline) for the jpeg and colour tasks, the pretrained digits model (digits/pipeline) for
the digits task (the prompted digit's probability, judged by accuracy on held-out phrasings; the headline's task),
on the same prompts, the same starting noises and the same group size, one iteration of
each learner in turn (the order rotates every iteration), so that a busy machine slows all of them alike and
their seconds can be compared. The methods (a learner is a method with its learning rate and knobs, spec()):

  V-GRPO        vgrpo.py's functions: DPM-Solver++ rollout, batch-shared stratified pairs, adaptive weighting
  naive ELBO    the same loop with the reductions off: independent uniform pairs, plain MSE (FPO-style)
  MDP           bench/mdp_baseline.py: Flow-GRPO's SDE rollout, per-step log-probabilities and clipped
                ratios, trained on K random steps of each sample's trajectory
  DiffusionNFT  bench/nft_baseline.py: ODE rollout, forward-process loss on implicit positive / negative policies
  MixGRPO       bench/mixgrpo_baseline.py: SDE steps in a sliding window, ODE elsewhere, MDP loss on the window

By default all take one optimizer step per rollout (vgrpo's tiny default; on-policy, so no ratio is clipped);
Setup.inner_steps > 1 splits each rollout into that many minibatches, one clipped step each (FLUX's regime).
Every `eval_every` iterations each policy is scored on the same fixed evaluation set with the same
deterministic sampler (DPM-Solver++, the deployed one): the MDP-type methods train on SDE samples, so their
training rewards are not comparable, their ODE samples are. NFE counts the transformer forward rows of the
training iterations, measured (count_rows): rollout S per sample plus N_MC (V-GRPO, naive ELBO, DiffusionNFT),
K (MDP) or w (MixGRPO) update rows per sample, all back-propagated; with one step per rollout no method needs
a separate pass for its old values (V-GRPO's s_old, DiffusionNFT's v_old, the MDP's log-probabilities).
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import sys
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import mdp_baseline as mdp  # noqa: E402
import mixgrpo_baseline as mix  # noqa: E402
import nft_baseline as nft  # noqa: E402
import reward as rewards_lib  # noqa: E402
import vgrpo  # noqa: E402

METHODS = ("V-GRPO", "naive ELBO", "MDP")


@dataclasses.dataclass
class Setup:
    prompts_per_step: int = 2      # P
    group_size: int = 8            # G (vgrpo's default; G = 4 learned too slowly to see in minutes)
    sample_steps: int = 10         # S, for every method's rollout and for the evaluation
    n_mc: int = 4                  # pairs per sample (V-GRPO, naive ELBO, DiffusionNFT); K, the MDP's trained steps
    iterations: int = 24
    eval_every: int = 4
    eval_dense: int = 0            # also evaluate after each of the first this many iterations (finer early timing)
    eval_samples: int = 16         # evaluation set: the first (up to) 8 prompts, fixed noises, 16 samples
    eval_prompts: int = 8
    lr: float = 2e-3               # vgrpo's tiny default, for the default learners (the headline sweeps it)
    max_grad_norm: float = 1.0
    clip_eps: float = 0.01         # V-GRPO / naive ELBO ratio clip (vgrpo's default)
    mdp_clip_eps: float = 1e-4     # Flow-GRPO's per-step clip range
    mdp_noise: float = 0.7         # Flow-GRPO's a (MDP and MixGRPO)
    nft_beta: float = 1.0          # DiffusionNFT's beta, unless a learner sets its own
    mix_window: int = 4            # MixGRPO's window size w, unless a learner sets its own
    mix_shift_every: int = 8       # MixGRPO's shift interval (iterations per window position)
    micro_batch: int = 16
    inner_steps: int = 1           # optimizer steps per rollout: 1 (SD3.5-M's regime) or several (FLUX's, clipped)
    adv_soft_clip: float = 0.0     # V-GRPO / naive ELBO: eta of the advantage soft clip (3 in SD3.5-M's regime)


# --------------------------------------------------------------------------- the two rewards

COLOURS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0),
           "cyan": (0, 1, 1), "magenta": (1, 0, 1), "white": (1, 1, 1), "black": (0, 0, 0)}
COLOUR_PROMPTS = ["a red square", "a cyan square"]  # complementary: no global shift helps both


def named_colour(prompt):
    return next(COLOURS[w] for w in prompt.split() if w in COLOURS)


def colour_reward(images, prompts):
    """Prompt-conditional verifiable reward: minus the Euclidean distance between the image's mean RGB and
    the colour the prompt names ("a red square" -> (1, 0, 0)); images in [0, 1] -> (B,) in [-sqrt(3), 0].

    The tiny model's random VAE starts every image near the same grey-blue mean colour (0.44, 0.54, 0.58),
    0.87 from red and 0.62 from cyan; GRPO normalises the reward per group, so what is learned is the
    direction towards the named colour. The two prompts name complementary colours, so a change of the
    overall colour helps one as much as it hurts the other: only a prompt-dependent change gains. (With all
    eight colours V-GRPO learned nothing visible in 30 iterations in a trial run, and with red and blue it
    first learned a shift good for both; this model's random text path is weak.)
    """
    target = torch.tensor([named_colour(p) for p in prompts], dtype=torch.float32)
    return -(images.float().mean((2, 3)) - target).norm(dim=1)


def jpeg_reward(images, prompts):
    """JPEG compressibility scaled as vgrpo's tiny-model default (jpeg:100): -kB / 5 for 32 px images."""
    return 100 * rewards_lib.jpeg_reward(images, prompts)


DIGIT_PROMPTS = os.path.join(os.path.dirname(HERE), "prompts", "digits_{}.jsonl")


def make_task(name):
    """-> (training reward, training prompts, evaluation reward, evaluation prompts) of the task `name`. jpeg and
    colour (the tiny random model) evaluate their own reward on their first prompts; digits (the pretrained
    miniature) trains on the prompted digit's probability and is evaluated by accuracy on held-out phrasings."""
    if name == "digits":
        train, _ = vgrpo.load_prompts(DIGIT_PROMPTS.format("train"))
        held_out, _ = vgrpo.load_prompts(DIGIT_PROMPTS.format("eval"))
        return rewards_lib.load_reward("digit"), train, rewards_lib.load_reward("digit_correct"), held_out
    if name == "jpeg":
        return jpeg_reward, list(vgrpo.DEFAULT_PROMPTS), jpeg_reward, list(vgrpo.DEFAULT_PROMPTS)
    return colour_reward, list(COLOUR_PROMPTS), colour_reward, list(COLOUR_PROMPTS)


TASKS = ("jpeg", "colour", "digits")
# the digits task's set-up: the CPU demo's batch (4 prompts x 8, 12 steps), evaluated on every held-out prompt
DIGITS_SETUP = dict(prompts_per_step=4, group_size=8, sample_steps=12, eval_samples=160, eval_prompts=20,
                    micro_batch=32, lr=1e-4)
CHECKS = {"digits": "digit_knn"}  # a second judge, recorded beside each evaluation (reward hacking shows as a gap)


# --------------------------------------------------------------------------- the model and the inputs


def tiny_family():
    """vgrpo's tiny SD3 (seed 0: the 'pretrained' model every method starts from), as vgrpo loads it."""
    return vgrpo.load_family(vgrpo.Args(model="tiny"), torch.device("cpu"))


def digits_family():
    """The pretrained digits model (digits/pipeline), as vgrpo loads it: the demo's model and the headline's."""
    return vgrpo.load_family(vgrpo.Args(model="digits"), torch.device("cpu"))


def family_for(task):
    return digits_family() if task == "digits" else tiny_family()


def iteration_inputs(family, prompts, setup, seed, it):
    """Prompts, conditioning and starting noise of iteration `it`, keyed so every method gets the same."""
    order = torch.randperm(len(prompts), generator=vgrpo.keyed_generator(seed, "prompts", it))
    ids = [(j, m) for j in range(setup.prompts_per_step) for m in range(setup.group_size)]
    chosen = [prompts[order[j % len(order)]] for j, _ in ids]
    noise = torch.stack([torch.randn(family.latent_shape, generator=vgrpo.keyed_generator(seed, "noise", it, j, m))
                         for j, m in ids])
    return {"ids": ids, "prompts": chosen, "cond": family.encode(chosen), "noise": noise}


def eval_inputs(family, prompts, setup, seed):
    use = prompts[:setup.eval_prompts]
    chosen = [p for p in use for _ in range(max(1, setup.eval_samples // len(use)))]
    return {"prompts": chosen, "cond": family.encode(chosen), "noise": eval_noise(family, chosen, seed)}


def eval_noise(family, chosen, seed):
    return torch.stack([torch.randn(family.latent_shape, generator=vgrpo.keyed_generator(seed, "eval", i))
                        for i in range(len(chosen))])


def count_rows(family):
    """Make family.velocity count the transformer rows it evaluates (family.rows): the NFE of each iteration is
    measured, not derived, so it stays right whatever the methods' code does to save a pass."""
    if not hasattr(family, "rows"):
        inner, family.rows = family.velocity, 0

        def velocity(model, x, sigma, cond):
            family.rows += x.shape[0]
            return inner(model, x, sigma, cond)

        family.velocity = velocity
    return family


def sde_noises(family, inputs, n_steps, seed, it):
    """The standard normal draw of every SDE step of every sample (B, S, *lat), keyed like the starting noise."""
    shape = (n_steps, *family.latent_shape)
    return torch.stack([torch.randn(shape, generator=vgrpo.keyed_generator(seed, "sde", it, j, m))
                        for j, m in inputs["ids"]])


def decode(family, o, micro_batch):
    return torch.cat([family.decode(o[idx]) for idx in torch.arange(len(o)).split(micro_batch)])


# --------------------------------------------------------------------------- one iteration of each method


KINDS = ("V-GRPO", "naive ELBO", "MDP", "DiffusionNFT", "MixGRPO")


def spec(kind, lr, name=None, **knobs):
    """One learner's settings: its method, its learning rate and its knobs (DiffusionNFT's beta, MixGRPO's
    window) -> dict; `name` labels it in tables and curves (default: the method's name)."""
    if kind not in KINDS:
        raise ValueError(f"unknown method {kind!r}; known: {', '.join(KINDS)}")
    return {"name": name or kind, "kind": kind, "lr": lr, **knobs}


class Learner:
    """One method's trainable copy of the transformer, its optimizer and its running totals."""

    def __init__(self, settings, family, base_state, setup):
        self.name, self.kind, self.settings, self.setup = settings["name"], settings["kind"], settings, setup
        self.model = copy.deepcopy(family.transformer)
        self.model.load_state_dict(base_state)
        self.model.requires_grad_(True)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=settings["lr"], weight_decay=0.0)
        naive = self.kind == "naive ELBO"
        # the attributes vgrpo.rollout / old_surrogate / update read
        self.args = types.SimpleNamespace(
            sampler="dpmpp2m", guidance=1.0, micro_batch=setup.micro_batch, sample_batch=setup.micro_batch,
            group_size=setup.group_size,
            inner_steps=setup.inner_steps, n_mc=setup.n_mc, beta=0.0, clip_eps=setup.clip_eps,
            max_grad_norm=setup.max_grad_norm,
            pair_sharing="none" if naive else "batch", stratified=not naive, weighting="none" if naive else "adaptive")


def elbo_iteration(learner, family, sigmas, inputs, reward_fn, seed, it):
    """V-GRPO (or the naive ELBO): rollout -> reward -> advantages -> pairs + old surrogate -> update."""
    args, B, P = learner.args, len(inputs["noise"]), learner.setup.prompts_per_step
    t0 = time.perf_counter()
    o = vgrpo.rollout(family, learner.model, inputs["cond"], inputs["noise"], sigmas, args)
    images = decode(family, o, args.micro_batch)
    t1 = time.perf_counter()
    r = reward_fn(images, inputs["prompts"])
    A = vgrpo.group_advantages(r, args.group_size, soft_clip=learner.setup.adv_soft_clip)
    t2 = time.perf_counter()
    sig, eps = vgrpo.draw_pairs(sigmas, args.n_mc, family.latent_shape, inputs["ids"], args.pair_sharing,
                                args.stratified, seed, it)
    batch = {"o": o, "cond": inputs["cond"], "A": A, "sigmas": sig, "eps": eps}
    if args.inner_steps > 1:  # the sampling policy's values of the later minibatches (none with one step)
        batch["s_old"], batch["x0_old"] = vgrpo.old_surrogate(family, learner.model, batch, args, P)
    t3 = time.perf_counter()
    with first_step_ratios(args, P) as first:
        stats = vgrpo.update(family, learner.model, learner.optimizer, learner.params, batch, args, P)
    t4 = time.perf_counter()
    return dict(reward=r.mean().item(), time_rollout=t1 - t0, time_reward=t2 - t1, time_old=t3 - t2,
                time_update=t4 - t3, backprop_rows=B * args.n_mc, grad_norm=stats["grad_norm"],
                clip_frac=stats["clip_frac"], ratio_dev_first=max(first))


@contextlib.contextmanager
def first_step_ratios(args, n_prompts):
    """-> a list that fills, inside the block, with the largest |ratio - 1| that vgrpo.update's loss sees on each
    micro-batch before its first optimizer step (its first inner step's): measured where the update takes its ratio,
    as the MDP baseline's is, not assumed from how the update is built."""
    first = sum(k == 0 for k, _ in vgrpo.micro_batches(n_prompts, args.group_size, args.inner_steps, args.micro_batch))
    seen, real_loss = [], vgrpo.vgrpo_loss

    def loss(s_new, s_old, *rest, **kw):
        if len(seen) < first:
            seen.append((s_new.detach() - s_old).exp().sub(1).abs().max().item())
        return real_loss(s_new, s_old, *rest, **kw)

    vgrpo.vgrpo_loss = loss
    try:
        yield seen
    finally:
        vgrpo.vgrpo_loss = real_loss


def mdp_iteration(learner, family, sigmas, inputs, reward_fn, seed, it):
    """The MDP baseline: SDE rollout with log-probabilities -> reward -> advantages -> per-step update."""
    s, B, S = learner.setup, len(inputs["noise"]), len(sigmas) - 1
    t0 = time.perf_counter()
    step_noise = sde_noises(family, inputs, S, seed, it)
    states, log_probs = mdp.sde_rollout(family, learner.model, inputs["cond"], inputs["noise"], step_noise,
                                        sigmas, s.mdp_noise, s.micro_batch)
    images = decode(family, states[:, -1], s.micro_batch)
    t1 = time.perf_counter()
    r = reward_fn(images, inputs["prompts"])
    A = vgrpo.group_advantages(r, s.group_size)
    t2 = time.perf_counter()
    steps = mdp.train_steps(B, S, s.n_mc, vgrpo.keyed_generator(seed, "steps", it))
    stats = mdp_steps(learner, family, {"states": states, "log_probs": log_probs, "cond": inputs["cond"]}, steps, A,
                      sigmas)
    t3 = time.perf_counter()
    return dict(reward=r.mean().item(), time_rollout=t1 - t0, time_reward=t2 - t1, time_old=0.0,
                time_update=t3 - t2, backprop_rows=B * s.n_mc, **stats)


def minibatches(setup):
    """The sample indices of each inner step: members [k G/K, (k+1) G/K) of every group, as vgrpo.update splits."""
    chunks = list(vgrpo.micro_batches(setup.prompts_per_step, setup.group_size, setup.inner_steps, setup.micro_batch))
    return [torch.cat([idx for k, idx in chunks if k == step]) for step in range(setup.inner_steps)]


def mdp_steps(learner, family, rollout, steps, A, sigmas):
    """The MDP loss's optimizer steps, one per minibatch (inner_steps of them), every one against the rollout's own
    log-probabilities (the sampling policy's, which an MDP method records for free): after the first step the
    per-step ratio moves and its clip binds. -> the grad norm and clip fraction averaged over the steps."""
    s, stats = learner.setup, []
    for idx in minibatches(s):
        part = {"states": rollout["states"][idx], "log_probs": rollout["log_probs"][idx],
                "cond": tuple(c[idx] for c in rollout["cond"])}
        stats.append(mdp.mdp_update(family, learner.model, learner.optimizer, learner.params, part, steps[idx], A[idx],
                                    sigmas, s.mdp_noise, s.mdp_clip_eps, s.micro_batch, s.max_grad_norm))
    return {"grad_norm": sum(x["grad_norm"] for x in stats) / len(stats),
            "clip_frac": sum(x["clip_frac"] for x in stats) / len(stats),
            "ratio_dev_first": stats[0]["ratio_dev_first"]}


def nft_iteration(learner, family, sigmas, inputs, reward_fn, seed, it):
    """DiffusionNFT: ODE rollout -> reward -> optimality probability -> forward-noised rows + v_old -> update."""
    s, B, beta = learner.setup, len(inputs["noise"]), learner.settings.get("beta", learner.setup.nft_beta)
    t0 = time.perf_counter()
    o = vgrpo.rollout(family, learner.model, inputs["cond"], inputs["noise"], sigmas, learner.args)
    images = decode(family, o, s.micro_batch)
    t1 = time.perf_counter()
    r = reward_fn(images, inputs["prompts"])
    optimality = nft.optimality_probability(r, s.group_size)
    t2 = time.perf_counter()
    # independent uniform draws per image, as the paper's (keyed apart from V-GRPO's pairs)
    sig, eps = vgrpo.draw_pairs(sigmas, s.n_mc, family.latent_shape, inputs["ids"], "none", False, seed, ("nft", it))
    batch = {"o": o, "cond": inputs["cond"], "r": optimality, "sigmas": sig, "eps": eps}
    parts = minibatches(s)
    if len(parts) > 1:  # the sampling policy's velocity on the later minibatches' rows, before any step
        batch["v_old"] = nft.old_velocities(family, learner.model, batch, torch.cat(parts[1:]), s.micro_batch)
    t3 = time.perf_counter()
    for idx in parts:
        part = {k: (tuple(c[idx] for c in v) if k == "cond" else v[idx]) for k, v in batch.items() if k != "v_old"}
        if idx is not parts[0]:
            part["v_old"] = batch["v_old"][idx]
        stats = nft.nft_update(family, learner.model, learner.optimizer, learner.params, part, beta, s.micro_batch,
                               s.max_grad_norm)
    t4 = time.perf_counter()
    return dict(reward=r.mean().item(), time_rollout=t1 - t0, time_reward=t2 - t1, time_old=t3 - t2,
                time_update=t4 - t3, backprop_rows=B * s.n_mc,
                grad_norm=stats["grad_norm"], ratio_dev_first=None)   # DiffusionNFT's loss has no ratio


def mixgrpo_iteration(learner, family, sigmas, inputs, reward_fn, seed, it):
    """MixGRPO: mixed ODE-SDE rollout (SDE in the window) -> reward -> advantages -> update on the window."""
    s, B, S = learner.setup, len(inputs["noise"]), len(sigmas) - 1
    size = learner.settings.get("window", s.mix_window)
    steps = mix.window(it, S, size, s.mix_shift_every)
    t0 = time.perf_counter()
    step_noise = sde_noises(family, inputs, S, seed, it)
    states, log_probs = mix.mixed_rollout(family, learner.model, inputs["cond"], inputs["noise"], step_noise, sigmas,
                                          steps, s.mdp_noise, s.micro_batch)
    images = decode(family, states[:, -1], s.micro_batch)
    t1 = time.perf_counter()
    r = reward_fn(images, inputs["prompts"])
    A = vgrpo.group_advantages(r, s.group_size)
    t2 = time.perf_counter()
    stats = mdp_steps(learner, family, {"states": states, "log_probs": log_probs, "cond": inputs["cond"]},
                      mix.window_steps(B, steps), A, sigmas)
    t3 = time.perf_counter()
    return dict(reward=r.mean().item(), time_rollout=t1 - t0, time_reward=t2 - t1, time_old=0.0,
                time_update=t3 - t2, backprop_rows=B * size, window=steps[0], **stats)


STEP = {"V-GRPO": elbo_iteration, "naive ELBO": elbo_iteration, "MDP": mdp_iteration,
        "DiffusionNFT": nft_iteration, "MixGRPO": mixgrpo_iteration}


@torch.no_grad()
def evaluate(learner, family, sigmas, inputs, reward_fn, check_fn=None):
    """Mean reward of the deterministic DPM-Solver++ samples on the fixed evaluation set -> (that, the check's
    mean or None, the images' diversity: vgrpo.pixel_diversity of each prompt's images, averaged over prompts)."""
    args = types.SimpleNamespace(sampler="dpmpp2m", guidance=1.0, micro_batch=learner.setup.micro_batch,
                                 sample_batch=learner.setup.micro_batch)
    o = vgrpo.rollout(family, learner.model, inputs["cond"], inputs["noise"], sigmas, args)
    images = decode(family, o, args.micro_batch)
    value = reward_fn(images, inputs["prompts"]).mean().item()
    check = None if check_fn is None else check_fn(images, inputs["prompts"]).mean().item()
    return value, check, diversity(images, inputs["prompts"])


def diversity(images, prompts):
    """The mean over prompts of vgrpo.pixel_diversity of each prompt's images (0 when each prompt's images are one
    picture); the eval.jsonl's eval_diversity of vgrpo.py's own evaluation."""
    groups = {}
    for image, prompt in zip(images, prompts):
        groups.setdefault(prompt, []).append(image)
    values = [vgrpo.pixel_diversity(torch.stack(g)) for g in groups.values() if len(g) > 1]
    return sum(values) / len(values) if values else 0.0


# --------------------------------------------------------------------------- one job: a reward and a seed


def run_job(task, seed, setup, family=None, verbose=True, methods=None, target_gain=None, stop_at_target=True):
    """Train the learners `methods` (specs; default the three methods of METHODS at setup.lr) on one reward and
    seed, interleaved -> {name: {"settings": spec, "train": [...], "eval": [...]}}. train: per-iteration dicts
    (reward, seconds by phase, nfe); eval: (iteration, mean eval reward). With a target gain (the learner's spec's
    `target_gain`, else `target_gain`), a learner stops at the first evaluation at least that far above the base
    model's (the others run on), so that slow methods can be run long. The target is a gain, not a reward: each
    seed's evaluation set scores the base differently."""
    family = count_rows(family or family_for(task))
    sigmas = family.sigma_grid(setup.sample_steps)
    reward_fn, prompts, eval_fn, eval_prompts = make_task(task)
    base_state = copy.deepcopy(family.transformer.state_dict())
    methods = methods or [spec(name, setup.lr) for name in METHODS]
    learners = [Learner(m, family, base_state, setup) for m in methods]
    if len({l.name for l in learners}) != len(learners):
        raise ValueError("learner names must be distinct")
    ev = eval_inputs(family, eval_prompts, setup, seed)
    check = rewards_lib.load_reward(CHECKS[task]) if task in CHECKS else None
    out = {l.name: {"settings": l.settings, "train": [], "eval": [], "check": [], "diversity": []} for l in learners}

    def record(l, it):
        value, check_value, spread = evaluate(l, family, sigmas, ev, eval_fn, check)
        out[l.name]["eval"].append((it, value))
        out[l.name]["diversity"].append((it, spread))
        if check:
            out[l.name]["check"].append((it, check_value))

    for l in learners:
        record(l, 0)
    for it in range(setup.iterations):
        if not learners:
            break
        inputs = iteration_inputs(family, prompts, setup, seed, it)
        for l in learners[it % len(learners):] + learners[:it % len(learners)]:  # rotate: no method always first
            rows = family.rows
            out[l.name]["train"].append(STEP[l.kind](l, family, sigmas, inputs, reward_fn, seed, it))
            out[l.name]["train"][-1]["nfe"] = family.rows - rows
            if (it + 1) % setup.eval_every == 0 or it + 1 <= setup.eval_dense or it + 1 == setup.iterations:
                record(l, it + 1)
        if verbose:
            print(f"{task} seed {seed} it {it + 1}: " + " | ".join(
                f"{l.name} {out[l.name]['train'][-1]['reward']:+.4f} ({out[l.name]['eval'][-1][1]:+.4f})"
                for l in learners), flush=True)
        if stop_at_target:
            learners = [l for l in learners
                        if not reached(out[l.name]["eval"], l.settings.get("target_gain", target_gain))]
    return out


def reached(evals, target_gain):
    """Has the last evaluation (after the start) gained at least target_gain over the first (the base model)?"""
    return target_gain is not None and evals[-1][0] > 0 and evals[-1][1] - evals[0][1] >= target_gain


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reward", choices=TASKS, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=Setup.iterations)
    p.add_argument("--eval-every", type=int, default=Setup.eval_every)
    p.add_argument("--eval-dense", type=int, default=0, help="also evaluate after each of the first N iterations")
    p.add_argument("--methods", help="JSON list of learner specs (see spec()); default: V-GRPO, naive ELBO, MDP")
    p.add_argument("--target-gain", type=float, help="stop each learner at its first evaluation this far above the "
                   "base model's (a learner's spec may set its own target_gain)")
    p.add_argument("--run-to-end", action="store_true", help="run every learner all iterations (the targets only "
                   "mark where each got there)")
    p.add_argument("--setup", default="{}", help="JSON of Setup fields to change, e.g. '{\"inner_steps\": 4}'")
    p.add_argument("--threads", type=int, default=1, help="torch threads (run.py runs two jobs side by side)")
    p.add_argument("--out", required=True, help="JSON file for the curves")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    import diffusers
    diffusers.utils.logging.set_verbosity_error()
    setup = Setup(**{**(DIGITS_SETUP if a.reward == "digits" else {}), **json.loads(a.setup),
                     "iterations": a.iterations, "eval_every": a.eval_every, "eval_dense": a.eval_dense})
    methods = [spec(**m) for m in json.loads(a.methods)] if a.methods else None
    result = run_job(a.reward, a.seed, setup, methods=methods, target_gain=a.target_gain,
                     stop_at_target=not a.run_to_end)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"reward": a.reward, "seed": a.seed, "setup": dataclasses.asdict(setup), "target_gain": a.target_gain,
                   "methods": result}, f)


if __name__ == "__main__":
    main()
