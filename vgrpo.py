"""V-GRPO: online RL for flow-matching text-to-image models, with the model's own denoising loss as the
likelihood surrogate inside GRPO (Tang et al., arXiv 2604.23380). One file: sampler, ELBO surrogate,
group-normalised advantages, clipped-ratio update and a torchrun training loop. It reads in run order: the
arguments, the method, one iteration (train_iteration), the training loop (main); below one marked line, what
supports them (defaults and validation, the curriculum, model loading, tiny models, distributed helpers,
checkpoints, logging).

Launch (each line runs as written; --model sd3 / flux default to the paper's recipe for that model, docs/method.md):
    torchrun --nproc_per_node=8 vgrpo.py --model sd3 --reward pickscore     # the SD3.5-M recipe with PickScore
    torchrun --nproc_per_node=8 vgrpo.py --preset sd3-preference            # its first curriculum stage
    torchrun --nproc_per_node=8 vgrpo.py --curriculum sd3                   # its five-stage curriculum, one launch
    torchrun --nproc_per_node=8 vgrpo.py --model flux --prompts hpdv2_train.txt  # FLUX.1-dev, HPDv2 (not shipped)
    torchrun --nnodes=2 --node_rank=$NODE_RANK --master_addr=$MASTER --master_port=29500 \
        --nproc_per_node=8 vgrpo.py --model sd3 --reward pickscore:1,clipscore:1
    torchrun --nproc_per_node=8 vgrpo.py --model sd3 --reward pickscore --resume auto   # continue after preemption
    python vgrpo.py --model sd3 --reward pickscore     # one GPU: the same recipe, 8x the time per iteration
    python vgrpo.py                                    # CPU demo: a pretrained digits SD3 learns the prompted digit
    python vgrpo.py --model tiny-flux                  # a tiny random FLUX on a JPEG reward (what fast tests train)

Where this code fills a gap in, or departs from, the paper:
 1. The advantage uses the population std plus 1e-4 (the paper does not say which std); a group whose
    rewards are all equal gets exactly A = 0.
 2. Pairs are shared across the whole batch on every rank by default (`--pair-sharing batch`, as the
    authors' code is reported to do); the paper's text shares them within a prompt group (`group`).
 3. Stratified sigmas pick one value of the rollout's own sigma grid (without its final 0) uniformly in
    each of N_MC contiguous chunks; `--no-stratified` draws N_MC grid values uniformly with replacement.
 4. The adaptive weight's denominator mean|x0_hat - o| is clamped at 1e-8 (never reached in practice).
 5. With CFG (`--guidance > 1`) the rollout uses the guided velocity, but the surrogate is the ELBO of
    the conditional model, the one being trained (the paper trains SD3.5-M without CFG).
 6. Inner steps split each prompt group's members into `--inner-steps` equal minibatches, so every
    minibatch holds every group and the split is the same on any number of processes.
 7. DPM-Solver++(2M) runs in flow space (alpha = 1 - sigma) on the pipeline's grid; it falls back to first
    order where a step in log-SNR is over twice the previous one (the grid's last steps), which on an
    analytic Gaussian flow cuts its error 2-20x there; elsewhere it equals diffusers' DPM++ scheduler.
 8. The KL term to the sampling policy is the mean squared x0 difference on the shared pairs,
    averaged over samples, pairs and latent dimensions (docs/method.md, step 6).
 9. FLUX latents stay packed (2x2 patches as tokens) everywhere; the surrogate's mean over latent
    dimensions is the same as on unpacked latents, and the pairs' eps are drawn in the packed shape.
10. Several rewards are summed before the advantage by default (`--reward-advantage sum`); the paper does
    not say, and `per-reward` (each reward's group advantage, then their weighted mean) is MixGRPO's choice.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import datetime
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import reward as rewards_lib


# --------------------------------------------------------------------------- arguments


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    # None: the model's recipe decides (RECIPES below, resolved by resolve_defaults; --help lists each model's value);
    # explicit flags always win.
    preset: str = arg("", "a named stage of the paper's curriculum (see PRESETS); explicit flags override it")
    curriculum: str = arg("", "run a curriculum as one launch: sd3 (the paper's five SD3.5-M stages, see CURRICULA) or "
                              "a .json list of stages, each {\"iterations\": N, \"preset\": ..., and any of reward, "
                              "prompts, n_mc, adv_soft_clip, beta}; the weights carry over from stage to stage")
    stage_prompts: str = arg("", "with --curriculum, other prompt files for some stages: PRESET=FILE,... (e.g. "
                                 "sd3-geneval=geneval.jsonl)")
    model: str = arg("digits", "digits (the CPU demo: a tiny SD3 pretrained on handwritten digits, shipped in "
                               "digits/), sd3 (SD3.5-Medium), flux (FLUX.1-dev), qwen-image, flux2-klein (FLUX.2 "
                               "[klein] base 4B), tiny / tiny-flux (random, for tests), or a pipeline id or folder")
    reward: str = arg(None, "reward spec name[:weight],...: pickscore, clipscore, hpsv2, imagereward, aesthetic, "
                            "ocr, geneval, geneval_partial(_jpeg), digit(_correct, _knn), jpeg, unifiedreward@"
                            "http://host:port/v1 (a served judge), http://host:port/path, file.py:function")
    reward_advantage: str = arg("sum", "several rewards: sum (advantage of the weighted sum) or per-reward ("
                                       "weighted mean of each reward's group advantage, as MixGRPO)")
    prompts: str = arg(None, ".txt (one prompt per line) or .jsonl ({\"prompt\": ..., metadata for the reward}); "
                             "default: prompts/train.txt for real models, prompts/digits_train.jsonl for digits, "
                             "12 built-in prompts for the tiny ones")
    resolution: int = arg(None, "image side in pixels")
    max_sequence_length: int = arg(None, "text tokens per prompt (default: 256 SD3, Qwen-Image; 512 FLUX.1, FLUX.2 "
                                         "[klein]; 16 tiny-flux; an SD3 without T5: none, not as many zero tokens)")
    sampler: str = arg("dpmpp2m", "ODE sampler for rollouts: dpmpp2m (DPM-Solver++ 2M) or euler")
    sample_steps: int = arg(None, "ODE steps per rollout")
    guidance: float = arg(None, "classifier-free guidance scale (SD3: default 1 = off, as the paper trains SD3.5-M; "
                                "Qwen-Image, FLUX.2 [klein] base: 4); FLUX.1: the guidance embedding's value (3.5)")
    iterations: int = arg(None, "total training iterations, a resumed run continues up to it")
    prompts_per_step: int = arg(None, "P: prompts per iteration, GLOBAL over all processes")
    group_size: int = arg(None, "G: images per prompt, the GRPO group")
    n_mc: int = arg(4, "N_MC: (sigma, eps) pairs per sample in the ELBO surrogate")
    pair_sharing: str = arg("batch", "who shares the pairs: batch (everyone), group (per prompt) or none")
    stratified: bool = arg(True, "stratify the pairs' sigmas over the sigma grid (--no-stratified to turn off)")
    weighting: str = arg("adaptive", "surrogate weighting: adaptive (self-normalised) or none (plain MSE)")
    clip_eps: float = arg(0.01, "PPO ratio clip range (small: the ratio of a whole image moves fast)")
    beta: float = arg(0.0, "weight of the KL term (0.3 in the paper's last SD3.5 stage)")
    kl_to: str = arg("sampling", "the KL's reference: sampling (the policy that drew the batch, the paper's (7)) or "
                                 "initial (the model before training, LoRA switched off: Flow-GRPO's reference)")
    adv_soft_clip: float = arg(None, "eta for A <- eta * tanh(A / eta); 0 turns it off (default: 3 for SD3, as the "
                                     "paper's on-policy SD3.5 runs; 0 otherwise)")
    adv_std_floor: float = arg(0.0, "advantages divide by max(group std, this) + 1e-4 (0: the group std, as GRPO; 1 "
                                    "with rewards in [0, 1]: no std normalisation, as Dr. GRPO)")
    inner_steps: int = arg(None, "optimizer steps per rollout batch; must divide the group size")
    micro_batch: int = arg(None, "samples per training forward pass, N_MC rows each (default: gcd(minibatch, 16 "
                                 "tiny / 4))")
    sample_batch: int = arg(None, "samples per transformer pass in rollouts and evaluation: no gradients, no kept "
                                  "activations, so larger than --micro-batch")
    decode_batch: int = arg(None, "images per VAE decoding pass (the decoder's activations would otherwise set the "
                                  "peak memory at 512-720 px)")
    lr: float = arg(None, "AdamW learning rate (default: 2e-3 for tiny, 1e-3 for digits, 3e-4 with LoRA, "
                          "1e-5 for full fine-tuning)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    ema: float = arg(0.0, "decay of an EMA of the trained weights, updated after every optimizer step, used by the "
                          "held-out evaluation and saved beside them (0: off, as the paper; e.g. 0.99)")
    lora_rank: int = arg(None, "LoRA rank, ignored with --full-finetune (default 32; 64 Qwen-Image, FLUX.2 [klein])")
    lora_alpha: float = arg(None, "LoRA alpha (default: twice the rank)")
    full_finetune: bool = arg(None, "train every transformer weight instead of LoRA (default: on for the tiny models "
                                    "only)")
    fsdp: bool = arg(False, "shard weights, gradients and AdamW states over the processes with FSDP2 (each block, then "
                            "the root): full fine-tuning of FLUX.1-dev; under torchrun, bf16 or float32")
    mixed_precision: str = arg(None, "bf16, fp16 or no: dtype of the transformer's matmuls (and of frozen weights); "
                                     "the surrogate, the loss, trained weights and AdamW stay float32")
    gradient_checkpointing: bool = arg(None, "recompute activations in the backward pass (less memory, ~30%% slower; "
                                             "default: on for real models, off for digits and tiny)")
    tf32: bool = arg(True, "allow TF32 matmuls on CUDA (Ampere and newer)")
    compile: str = arg("auto", "torch.compile each transformer block, once per run: on, off, auto (on CUDA except "
                               "for digits, tiny and --kl-to initial); every pass runs the compiled blocks "
                               "(docs/method.md)")
    attention: str = arg("flash,efficient,math", "the attention kernels torch may pick on CUDA, from flash, efficient, "
                                                 "cudnn, math (all four: torch's own choice); cuDNN's is left out "
                                                 "unless named: it fails in the backward on Hopper (docs/method.md)")
    offload_text_encoders: bool = arg(True, "keep the text encoders on the CPU except while new prompts are encoded "
                                            "(CUDA)")
    seed: int = arg(0, "seed of training's draws, each keyed by what it is for (iteration, prompt, member), not rank")
    output_dir: str = arg(None, "metrics, samples, checkpoints (default runs/curriculum-NAME, PRESET or MODEL)")
    resume: str = arg("", "checkpoint directory to continue from (OUTPUT/checkpoint-N), or auto: the newest in "
                          "--output-dir")
    save_every: int = arg(None, "save a checkpoint every N iterations and at the end")
    keep_last: int = arg(0, "keep only the newest N checkpoints (0 keeps all)")
    max_bad_steps: int = arg(3, "stop after this many consecutive iterations with NaN/Inf rewards, losses or gradients")
    dist_timeout: int = arg(600, "seconds a collective may wait for another rank before the run fails (no hangs)")
    sample_every: int = arg(10, "save a PNG grid of rollout samples and update rewards.csv/.png every N iterations")
    eval_prompts: str = arg(None, "held-out prompts (.txt or .jsonl) for a deterministic evaluation (fixed noises, "
                                  "ODE); a .jsonl's \"tag\" field breaks the first evaluation reward down by tag "
                                  "(default: prompts/digits_eval.jsonl for digits, none otherwise)")
    eval_every: int = arg(None, "evaluate every N iterations, before training and at the end (0: never; default: 20 "
                                "with --eval-prompts or for digits, 0 otherwise)")
    eval_rewards: str = arg(None, "reward spec of the evaluation, may differ from --reward (default: --reward's "
                                  "rewards; digits: digit_correct,digit_knn,digit)")
    eval_images: int = arg(None, "images per evaluation prompt (default: 8 for digits, 2 otherwise)")
    report_to: str = arg("", "also log to tensorboard, wandb or both (tensorboard,wandb); metrics.jsonl is always "
                             "written. wandb works offline with WANDB_MODE=offline")
    device: str = arg("auto", "auto, cpu, cuda (one GPU of several: CUDA_VISIBLE_DEVICES)")

    def __post_init__(self):
        resolve_defaults(self, int(os.environ.get("WORLD_SIZE", 1)))  # torchrun tells each process the world size


# Every model's defaults in one place. Real models: the paper's settings (docs/method.md gives the source of each
# value, and marks what no public source settles). SD3.5-M: one curriculum stage, 48 prompts x 24 images, 40-step
# DPM-Solver++ without CFG, one optimizer step per iteration with the advantage soft clip. FLUX.1-dev: 16 steps,
# several clipped steps per iteration, 12 images per prompt at 720 px (MixGRPO's setting). Qwen-Image, FLUX.2 [klein]
# base: Flow-GRPO's, Flow-Factory's PickScore recipes. digits (the CPU demo): the pretrained miniature of digits/, LoRA
# on a verifiable reward, a held-out evaluation. Tiny random models: full fine-tuning at 2e-3 (LoRA learns too little).
HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_IDS = {"sd3": "stabilityai/stable-diffusion-3.5-medium", "flux": "black-forest-labs/FLUX.1-dev",
             "qwen-image": "Qwen/Qwen-Image", "flux2-klein": "black-forest-labs/FLUX.2-klein-base-4B",
             "digits": os.path.join(HERE, "digits", "pipeline")}
_NO_EVAL = dict(eval_prompts="", eval_every=0, eval_rewards="", eval_images=2)
_REAL = dict(_NO_EVAL, mixed_precision="bf16", gradient_checkpointing=True, full_finetune=False, save_every=25)
RECIPES = {
    "sd3": dict(_REAL, reward="pickscore", resolution=512, sample_steps=40, guidance=1.0, iterations=150,
                prompts_per_step=48, group_size=24, inner_steps=1, adv_soft_clip=3.0, sample_batch=24,
                decode_batch=4),
    "flux": dict(_REAL, reward="hpsv2", resolution=720, sample_steps=16, guidance=3.5, iterations=300,
                 prompts_per_step=32, group_size=12, inner_steps=4, adv_soft_clip=0.0, sample_batch=12,
                 decode_batch=2),
    "qwen-image": dict(_REAL, reward="pickscore", resolution=512, sample_steps=10, guidance=4.0, iterations=300,
                       prompts_per_step=32, group_size=16, inner_steps=2, adv_soft_clip=0.0, sample_batch=16,
                       decode_batch=4, max_sequence_length=256, lora_rank=64),
    "flux2-klein": dict(_REAL, reward="pickscore", resolution=384, sample_steps=8, guidance=4.0, iterations=300,
                        prompts_per_step=48, group_size=16, inner_steps=2, adv_soft_clip=0.0, sample_batch=16,
                        decode_batch=4, max_sequence_length=512, lora_rank=64),
    "digits": dict(reward="digit", prompts="prompts/digits_train.jsonl", eval_prompts="prompts/digits_eval.jsonl",
                   eval_every=20, eval_rewards="digit_correct,digit_knn,digit", eval_images=8, resolution=16,
                   sample_steps=12, guidance=1.0, iterations=80, prompts_per_step=4, group_size=8, inner_steps=1,
                   adv_soft_clip=0.0, mixed_precision="no", gradient_checkpointing=False, full_finetune=False,
                   lr=1e-3, save_every=80, sample_batch=32, decode_batch=32),
    "tiny": dict(_NO_EVAL, reward="jpeg:100", resolution=32, sample_steps=10, guidance=1.0, iterations=60,
                 prompts_per_step=4, group_size=8, inner_steps=1, adv_soft_clip=0.0, mixed_precision="no",
                 gradient_checkpointing=False, full_finetune=True, save_every=50, prompts="", sample_batch=16,
                 decode_batch=16),
}
RECIPES["tiny-flux"] = dict(RECIPES["tiny"], guidance=3.5, max_sequence_length=16)  # FLUX.1-dev's guidance value
TRAIN_PROMPTS = os.path.join(HERE, "prompts", "train.txt")  # a real model's prompts when --prompts is not given

# The curriculum's stages (PRESETS, CURRICULA: --preset, --curriculum) and resolve_defaults are below the marked line.


# --------------------------------------------------------------------------- the method
# Time convention (SD3 / FLUX rectified flow): sigma = 1 is pure noise, sigma = 0 is data,
#   x_sigma = (1 - sigma) * o + sigma * eps,  the network predicts v = eps - o,  timestep = 1000 * sigma.


def group_advantages(rewards, group_size, eps=1e-4, soft_clip=None, std_floor=0.0):
    """GRPO advantages: A_i = (r_i - mean_group) / (max(std_group, std_floor) + eps), population std (docs/method.md,
    step 2); std_floor > 0 keeps a group of nearly equal rewards from scaling its noise up to unit advantages.

    rewards (P*G,) ordered group by group. A group whose rewards are all equal gets exactly 0.
    soft_clip=eta applies soft_clip_advantages.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    r = rewards.float().view(-1, group_size)                           # (P, G)
    A = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True).clamp_min(std_floor) + eps)
    A = A.masked_fill((r == r[:, :1]).all(1, keepdim=True), 0.0)       # mean of equal floats can be inexact
    return soft_clip_advantages(A.view(-1), soft_clip)


def per_reward_advantages(parts, weights, group_size, eps=1e-4, soft_clip=None, std_floor=0.0):
    """Several rewards combined after normalisation (MixGRPO's choice): A = sum_k w_k A(r_k) / sum_k |w_k|,
    each reward's group advantage computed alone, so a reward with a large scale cannot drown the others.
    Dividing by the weights' sum keeps A on the scale of one advantage, whatever the weights (`jpeg:100`
    scales a reward, it should not scale the step). parts: {name: (P*G,)}; weights: {name: w}."""
    A = sum(w * group_advantages(parts[name], group_size, eps, std_floor=std_floor) for name, w in weights.items())
    return soft_clip_advantages(A / sum(abs(w) for w in weights.values()), soft_clip)


def soft_clip_advantages(A, eta):
    """eta * tanh(A / eta): advantages bounded by eta, nearly unchanged where |A| << eta; the paper's step control
    for its on-policy SD3.5 runs. eta None or 0: A unchanged."""
    return eta * torch.tanh(A / eta) if eta else A


def stratified_sigmas(sigma_grid, n, generator=None):
    """Stratified noise levels (docs/method.md, step 3): the rollout's sigma grid without its final 0, split into
    n contiguous chunks (torch.tensor_split), one grid value drawn uniformly from each chunk -> (n,).
    Every draw covers high, middle and low noise, which removes most of the surrogate's variance."""
    chunks = torch.tensor_split(noise_levels(sigma_grid), n)
    return torch.stack([c[torch.randint(len(c), (), generator=generator)] for c in chunks])


def noise_levels(sigma_grid):
    """The sigmas the pairs draw from: the rollout's grid without its final 0 (no noise, nothing to denoise)."""
    return sigma_grid[:-1] if sigma_grid[-1] == 0 else sigma_grid


def per_pair(sigmas, o):
    """sigmas (B, N) shaped to broadcast over the pairs' latents (B, N, *lat) of samples o (B, *lat)."""
    return sigmas.view(*sigmas.shape, *[1] * (o.dim() - 1))


def noisy_latents(o, sigmas, eps):
    """x_sigma = (1 - sigma) o + sigma eps for every pair: o (B, *lat), sigmas (B, N), eps (B, N, *lat)."""
    sigma = per_pair(sigmas, o)
    return (1 - sigma) * o.unsqueeze(1) + sigma * eps


def elbo_surrogate(v_pred, o, sigmas, eps, weighting="adaptive"):
    """ELBO surrogate of log pi(o | c) (docs/method.md, step 4), in float32.

    v_pred (B, N, *lat): velocity predictions at x = (1 - sigma) o + sigma eps for the N pairs.
    Returns (s, x0_hat): s (B,) = -mean_j l(o, sigma_j, eps_j) with the adaptive weighting
    l = mean_d (x0_hat - o)^2 / stopgrad(mean_d |x0_hat - o|), or the plain MSE with weighting="none";
    x0_hat (B, N, *lat) = x - sigma * v_pred, the model's x-prediction.
    """
    v_pred, o, sigmas, eps = v_pred.float(), o.float(), sigmas.float(), eps.float()
    # x0_hat - o = (1 - sigma) o + sigma eps - sigma v_pred - o = sigma (eps - o - v_pred): the x-prediction's
    # error is sigma times the velocity's (the flow-matching target is eps - o); no noisy latent needed
    err = per_pair(sigmas, o) * (eps - o.unsqueeze(1) - v_pred)
    x0_hat = o.unsqueeze(1) + err
    dims = tuple(range(2, err.dim()))
    loss = err.pow(2).mean(dims)                                       # (B, N)
    if weighting == "adaptive":
        loss = loss / err.abs().mean(dims).detach().clamp_min(1e-8)
    elif weighting != "none":
        raise ValueError(f"unknown weighting {weighting!r}")
    return -loss.mean(1), x0_hat


def vgrpo_loss(s_new, s_old, advantages, clip_eps, beta=0.0, x0_new=None, x0_old=None):
    """PPO-clip on the surrogate ratio plus an optional KL term (docs/method.md, step 6).

    ratio = exp(s_new - s_old); loss = -mean(min(ratio A, clamp(ratio, 1 - clip_eps, 1 + clip_eps) A))
    + beta * mean((x0_new - x0_old)^2), the KL to the reference (--kl-to) taken as the mean squared difference of
    the two x-predictions on the same pairs (logged as `kl`). Returns (loss, stats); stats are detached 0-dim
    tensors, so that a caller on a GPU reads them once per iteration instead of synchronising at every micro-batch.
    """
    ratio = torch.exp(s_new - s_old)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    policy_loss = -torch.min(unclipped, clipped).mean()
    kl = (x0_new - x0_old).pow(2).mean() if x0_new is not None else torch.zeros((), device=ratio.device)
    loss = policy_loss + beta * kl
    stats = {  # clip_frac: ratios outside [1 - clip_eps, 1 + clip_eps], whether or not the clip binds for A's sign
        "policy_loss": policy_loss, "kl": kl, "clip_frac": ((ratio - 1).abs() > clip_eps).float().mean(),
        "ratio_mean": ratio.mean(), "ratio_min": ratio.min(), "ratio_max": ratio.max(),
    }
    return loss, {name: value.detach() for name, value in stats.items()}


def keyed_generator(*key):
    """A CPU generator seeded by a hash of `key`: draws depend on what they are for, not on call order,
    rank or world size, so 1 or 2 processes and a resumed run all see the same numbers."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def draw_pairs(sigma_grid, n_mc, latent_shape, sample_ids, sharing, stratified, seed, iteration, device="cpu"):
    """The N_MC (sigma, eps) pairs of each sample (docs/method.md, step 3), shared as `sharing` says.

    sample_ids: (global prompt index, member) of each local sample. batch: one draw for everyone on every
    rank; group: one draw per prompt group; none: one per sample. -> sigmas (B, N), eps (B, N, *lat) on
    `device`; with batch sharing eps is one draw expanded over the batch (no per-sample copies).
    """
    grid = noise_levels(sigma_grid)
    keys = [{"batch": (), "group": (p,), "none": (p, m)}[sharing] for p, m in sample_ids]
    draws = {}
    for key in dict.fromkeys(keys):  # one draw per distinct key, keyed so that any rank gets the same one
        g = keyed_generator(seed, "pairs", iteration, *key)
        sig = stratified_sigmas(grid, n_mc, g) if stratified else grid[torch.randint(len(grid), (n_mc,), generator=g)]
        draws[key] = (sig.to(device), torch.randn((n_mc, *latent_shape), generator=g).to(device))
    if len(draws) == 1:
        sig, eps = draws[keys[0]]
        return sig.expand(len(keys), *sig.shape), eps.expand(len(keys), *eps.shape)
    return torch.stack([draws[k][0] for k in keys]), torch.stack([draws[k][1] for k in keys])


@torch.no_grad()
def sample_ode(velocity, noise, sigmas, sampler="dpmpp2m"):
    """Integrate the probability-flow ODE from sigmas[0] (noise) to sigmas[-1] = 0 -> the clean latent o.

    velocity(x, sigma) -> v. `euler` is StableDiffusion3Pipeline's FlowMatchEulerDiscreteScheduler step;
    `dpmpp2m` is DPM-Solver++(2M) on the data prediction x0 = x - sigma v with alpha = 1 - sigma and
    lambda = log(alpha / sigma); as in diffusers' DPMSolverMultistepScheduler it is first order at the first
    step (sigma = 1, lambda = -inf) and at the last (to sigma = 0), and also wherever the step in lambda
    is more than twice the previous one (the pipelines' grids jump from sigma_min to 0 so; extrapolating
    over it is worse than Euler). Any ODE solver is allowed: V-GRPO never needs per-step log-probabilities.

    sigmas: the grid on the CPU. The solver's coefficients are Python floats and the model gets the grid copied
    to the device once, so no step waits for a host-device copy.
    """
    x, x0_prev, h_prev = noise, None, None
    grid, on_device = sigmas.tolist(), sigmas.to(noise.device)
    euler_dt = (sigmas[1:] - sigmas[:-1]).tolist()  # float32 differences, exactly the Euler scheduler's step
    for i in range(len(grid) - 1):
        sigma, sigma_next = grid[i], grid[i + 1]
        v = velocity(x, on_device[i])
        if sampler == "euler":
            x = (x.float() + euler_dt[i] * v.float()).to(v.dtype)
            continue
        x0 = x.float() - sigma * v.float()
        if sigma_next == 0:
            x = x0.to(x.dtype)
            break
        alpha, alpha_next = 1 - sigma, 1 - sigma_next
        # first-order (DDIM) coefficient of D: alpha_next * (1 - exp(-h)), written to stay finite at sigma = 1
        coef = alpha_next - sigma_next * alpha / sigma
        h = math.log(alpha_next / sigma_next) - (math.log(alpha / sigma) if alpha > 0 else -math.inf)
        D = x0
        r = h_prev / h if x0_prev is not None else 0.0
        if r >= 0.5:  # second order only when the last step was comparable (inf at the first: 1st order)
            D = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_prev
        x = ((sigma_next / sigma) * x.float() + coef * D).to(x.dtype)
        x0_prev, h_prev = x0, h
    return x


# --------------------------------------------------------------------------- one iteration


@dataclass
class Run:
    """Everything an iteration needs, made once at start by build_run."""
    args: Args
    family: Family
    model: torch.nn.Module           # as the update runs it: DDP-wrapped on several processes (--fsdp: sharded)
    optimizer: torch.optim.Optimizer
    params: list
    reward_fn: object
    prompts: list
    metadata: list                   # one dict per prompt (from a .jsonl file), handed to the reward
    sigmas: torch.Tensor             # (S + 1,) the rollout's sigma grid, ending in 0
    negative: tuple                  # empty-prompt conditioning for CFG, or None
    rank: int
    world: int
    device: torch.device
    scaler: object = None            # GradScaler with fp16
    eval_prompts: list = None        # held-out prompts, their metadata and the evaluation's reward
    eval_metadata: list = None
    eval_reward_fn: object = None
    trackers: object = None          # Trackers on rank 0 with --report-to
    stages: list = None              # the curriculum's Stages (without one, a single Stage: the whole run)
    ema: object = None               # with --ema: the EMA of the trained weights (EMA, below)

    @property
    def n_prompts(self):
        return self.args.prompts_per_step // self.world


def train_iteration(run, it):
    """One V-GRPO iteration (`it` counts from 0): rollout -> reward -> advantages -> pairs -> update.
    -> (stats, images, prompts, rewards, advantages), the last four for this rank's samples."""
    args, family, timer = run.args, run.family, PhaseTimer(run.device)
    # 1. Rollout of this rank's prompt groups. Prompts and starting noise are keyed by (seed, iteration, global
    #    prompt slot, member): the members of a group differ, and nothing depends on which rank draws them.
    with timer("rollout"):
        sample_ids, prompts, metadata = local_samples(run, it)
        cond, o, images = generate(run, prompts, [(args.seed, "noise", it, j, m) for j, m in sample_ids])
    # 2. The reward and group-normalised advantages (each rank owns whole groups: no communication)
    with timer("reward"):
        r = score(run.reward_fn, images, prompts, metadata).to(run.device)
        A = iteration_advantages(run, r)
        skip = any_nonfinite(run, it, r, A)  # every rank skips together, or DDP would hang
    if skip:
        return dict(SKIPPED_STATS, skipped_steps=args.inner_steps, **timer.stats()), images, prompts, r, A
    # 3. Shared, stratified pairs; 5. the old surrogate for minibatches after the first (none with one inner step)
    with timer("old"):
        sigmas, eps = draw_pairs(run.sigmas, args.n_mc, family.latent_shape, sample_ids, args.pair_sharing,
                                 args.stratified, args.seed, it, run.device)
        batch = {"o": o, "cond": cond, "A": A, "sigmas": sigmas, "eps": eps.to(o.dtype)}
        if args.inner_steps > 1:
            batch["s_old"], batch["x0_old"] = old_surrogate(family, family.transformer, batch, args, run.n_prompts)
        if args.beta > 0 and args.kl_to == "initial":  # the KL's reference: x0_hat of the model before training
            batch["x0_ref"] = initial_x0(family, batch, args, run.n_prompts)
    # 4., 6., 7. The surrogate, the clipped objective, the update; 5. for the first minibatch (docs/method.md)
    with timer("update"):
        stats = update(family, run.model, run.optimizer, run.params, batch, args, run.n_prompts, run.scaler)
    return {**stats, **timer.stats(), **reward_metrics(run)}, images, prompts, r, A


def local_samples(run, it):
    """This rank's samples as (global prompt slot, member), with their prompts and metadata: slot j of iteration
    `it` takes the j-th prompt of a keyed permutation of the prompt file (wrapping around a short file)."""
    order = torch.randperm(len(run.prompts), generator=keyed_generator(run.args.seed, "prompts", it)).tolist()
    slots = range(run.rank * run.n_prompts, (run.rank + 1) * run.n_prompts)
    sample_ids = [(j, m) for j in slots for m in range(run.args.group_size)]
    picked = [order[j % len(order)] for j, _ in sample_ids]
    return sample_ids, [run.prompts[i] for i in picked], [run.metadata[i] for i in picked]


@torch.no_grad()
def generate(run, prompts, noise_keys):
    """Images of `prompts` with the current weights, each from the starting noise keyed by its noise_keys entry
    (training and evaluation alike) -> (conditioning, clean latents o, images in [0, 1])."""
    family = run.family
    noise = torch.stack([torch.randn(family.latent_shape, generator=keyed_generator(*key))
                         for key in noise_keys]).to(run.device)          # (B, *latent_shape)
    cond = family.encode(prompts)
    o = rollout(family, family.transformer, cond, noise, run.sigmas, run.args, run.negative)
    return cond, o, decode(family, o, run.args.decode_batch)


def iteration_advantages(run, r):
    """The group advantages of the summed reward r, or with --reward-advantage per-reward (and several rewards)
    the weighted mean of each reward's own group advantages."""
    args, fn = run.args, run.reward_fn
    if args.reward_advantage == "per-reward" and len(fn.parts) > 1:
        parts = {name: value.to(run.device) for name, value in fn.last_parts.items()}
        weights = {name: w for name, w, _ in fn.parts}
        return per_reward_advantages(parts, weights, args.group_size, soft_clip=args.adv_soft_clip,
                                     std_floor=args.adv_std_floor)
    return group_advantages(r, args.group_size, soft_clip=args.adv_soft_clip, std_floor=args.adv_std_floor)


@torch.no_grad()
def rollout(family, model, cond, noise, sigmas, args, negative=None):
    """Sample o for every local sample with the current weights, --sample-batch samples per pass -> (B, *lat).
    No gradients and no activations are kept, so the pass can be much larger than a training micro-batch."""
    out, cfg = [], family.cfg and args.guidance > 1  # FLUX takes --guidance in its embedding instead
    for start in range(0, len(noise), args.sample_batch):
        rows = slice(start, start + args.sample_batch)
        c = rows_of(cond, rows)
        if cfg:
            c = tuple(torch.cat([n.expand_as(t), t]) for n, t in zip(negative, c))

        def velocity(x, sigma):
            if not cfg:
                return family.velocity(model, x, sigma, c)
            v_uncond, v_cond = family.velocity(model, torch.cat([x, x]), sigma, c).chunk(2)
            return family.guide(v_uncond, v_cond, args.guidance)

        out.append(sample_ode(velocity, noise[rows], sigmas, args.sampler))
    return torch.cat(out)


@torch.no_grad()
def decode(family, o, batch_size):
    """Latents -> images in [0, 1], batch_size samples per VAE pass."""
    return torch.cat([family.decode(o[start:start + batch_size]) for start in range(0, len(o), batch_size)])


def rows_of(cond, rows, repeat=1):
    """Rows `rows` (indices or a slice) of every conditioning tensor, each repeated `repeat` times (N_MC pairs)."""
    return tuple(t[rows].repeat_interleave(repeat, 0) for t in cond)


def surrogate(family, model, o, sigmas, eps, cond, weighting):
    """Evaluate the model on every (sample, pair) row and return elbo_surrogate's (s, x0_hat)."""
    b, n = sigmas.shape
    x_t = noisy_latents(o, sigmas, eps).to(o.dtype)                   # (b, N, *lat)
    v = family.velocity(model, x_t.flatten(0, 1), sigmas.flatten(), rows_of(cond, slice(None), n))
    return elbo_surrogate(v.view(b, n, *o.shape[1:]), o, sigmas, eps, weighting)


def old_surrogate(family, model, batch, args, n_prompts, from_step=1):
    """s_old and x0_hat_old with the sampling weights, on exactly the update's micro-batches, for inner steps
    from_step.. (earlier rows are left NaN). The first minibatch needs no such pass: before any step the update's own
    forward is the sampling policy's, bit for bit (so one inner step, the paper's SD3.5-M setting, has no old pass).
    Compiled, it runs with gradients, as the update does: torch's graph without them rounds differently in bf16."""
    s_old = torch.full((len(batch["o"]),), float("nan"), device=batch["o"].device)
    x0_old = torch.full(batch["eps"].shape, float("nan"), device=batch["o"].device) if args.beta > 0 else None
    with torch.set_grad_enabled(family.compiled):
        for k, idx in micro_batches(n_prompts, args.group_size, args.inner_steps, args.micro_batch, s_old.device):
            if k < from_step:
                continue
            s, x0 = (t.detach() for t in surrogate(family, model, batch["o"][idx], batch["sigmas"][idx],
                                                   batch["eps"][idx], rows_of(batch["cond"], idx), args.weighting))
            s_old[idx] = s  # detached at once: no micro-batch's graph outlives its forward
            if x0_old is not None:
                x0_old[idx] = x0
    return s_old, x0_old


def micro_batches(n_prompts, group_size, inner_steps, micro_batch, device="cpu"):
    """Yield (k, sample indices) for inner step k: minibatch k holds members [k G/K, (k+1) G/K) of every
    local group (so the global minibatch is the same for any world size), cut into micro-batches. The
    indices are made on `device`: indexing GPU tensors with CPU indices would copy them at every micro-batch."""
    members = group_size // inner_steps
    samples = torch.arange(n_prompts * group_size, device=device).view(n_prompts, group_size)
    for k in range(inner_steps):
        for chunk in samples[:, k * members:(k + 1) * members].reshape(-1).split(micro_batch):
            yield k, chunk


def update(family, model, optimizer, params, batch, args, n_prompts, scaler=None):
    """--inner-steps optimizer steps on the clipped surrogate objective; returns the stats as means over the
    micro-batches (grad_norm: over the optimizer steps; ratio_min / ratio_max: the extremes) and skipped_steps.
    batch: o, cond, A, sigmas, eps, s_old / x0_old (old_surrogate: minibatches after the first), x0_ref (--kl-to).
    scaler: a GradScaler with --mixed-precision fp16 (fp16 gradients underflow without loss scaling).
    Statistics stay on the device until the end; the host waits once per optimizer step (to skip a step with a
    non-finite gradient on every rank alike) and once for the statistics."""
    device = batch["o"].device
    stats, finite_loss = collections.defaultdict(list), torch.ones((), dtype=torch.bool, device=device)
    minibatch_size = n_prompts * args.group_size // args.inner_steps
    chunks = list(micro_batches(n_prompts, args.group_size, args.inner_steps, args.micro_batch, device))
    skipped = 0
    for i, (k, idx) in enumerate(chunks):
        last_of_step = i + 1 == len(chunks) or chunks[i + 1][0] != k
        with gradient_sync(model, last_of_step):
            s_new, x0_new = surrogate(family, model, batch["o"][idx], batch["sigmas"][idx], batch["eps"][idx],
                                      rows_of(batch["cond"], idx), args.weighting)
            # k == 0: no step taken yet, so the old policy is the current one, and this forward is its value
            s_old = s_new.detach() if k == 0 else batch["s_old"][idx]
            x0_pair = (None, None)  # the KL term only where it is weighted: x0_hat and the reference --kl-to names
            if args.beta > 0:
                x0_pair = (x0_new, batch["x0_ref"][idx] if "x0_ref" in batch else
                           x0_new.detach() if k == 0 else batch["x0_old"][idx])
            loss, st = vgrpo_loss(s_new, s_old, batch["A"][idx], args.clip_eps, args.beta, *x0_pair)
            part = loss * len(idx) / minibatch_size
            (scaler.scale(part) if scaler else part).backward()
        finite_loss &= torch.isfinite(st["policy_loss"])
        for name, value in st.items():
            stats[name].append(value)  # micro-batches are equal-sized: plain means
        if last_of_step:
            # gradients are already averaged over ranks, so every rank takes the same decision here
            if scaler:
                scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: a DTensor
            stats["grad_norm"].append(grad_norm.detach())
            if scaler:  # an fp16 overflow only lowers the loss scale; a non-finite loss is a bad step
                scaler.step(optimizer)
                scaler.update()
                skipped += not finite_loss.item()
            elif torch.isfinite(grad_norm).item():
                optimizer.step()
            else:  # a NaN / Inf loss or gradient: drop this step, the weights stay finite
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            finite_loss.fill_(True)
    reduce = {"ratio_min": torch.min, "ratio_max": torch.max}
    names = list(stats)
    values = torch.stack([reduce.get(name, torch.mean)(torch.stack(stats[name]).float()) for name in names]).tolist()
    return dict(zip(names, values), skipped_steps=skipped)


# --------------------------------------------------------------------------- the training loop


def main(argv=None):
    args = parse_args(argv)
    quiet_libraries()
    validate(args, int(os.environ.get("WORLD_SIZE", 1)))
    stop_requested = install_stop_handlers()
    run, start = start_run(args)  # processes, model, reward, optimizer and a checkpoint to resume from
    if args.eval_every and start == 0:
        log_evaluation(run, 0)
    history, bad_streak = [], 0
    for it in range(start, args.iterations):
        use_stage(run, it)  # a curriculum's stage sets the reward, prompts and settings; without one, nothing changes
        stats, images, prompts, r, A = train_iteration(run, it)
        m = iteration_metrics(run, it, stats, r, A)
        history.append(m["reward_mean"])
        bad_streak = bad_streak + 1 if m["skipped_steps"] else 0
        stop = any_rank(stop_requested, run.world, run.device)
        done = it + 1
        last = done == args.iterations or stop
        if run.rank == 0:
            record(run, m, (images, prompts, r), first=it == start, last=last)
        del images  # the next rollout should not have to fit beside this one's pictures
        if done % args.save_every == 0 or last:
            save_checkpoint(run, done)  # every rank: FSDP gathers the weights and writes sharded AdamW states
        if args.eval_every and (done % args.eval_every == 0 or done == args.iterations):
            log_evaluation(run, done)
        if distributed():
            dist.barrier()  # nobody runs ahead of a checkpoint being written
        if bad_streak >= args.max_bad_steps:
            raise FatalError(f"{bad_streak} consecutive iterations with NaN/Inf rewards, losses or gradients "
                             f"(--max-bad-steps {args.max_bad_steps}); the last checkpoint holds finite weights")
        if stop:
            if run.rank == 0:
                print(f"vgrpo: stopped after iteration {done}; checkpoint-{done} saved. Continue with the "
                      f"same command plus --resume auto", flush=True)
            break
    finish(run, history)


# ======================================================================================================================
# What supports it: defaults and validation, the curriculum, model loading, tiny models, distributed helpers,
# checkpoints, logging.
# ======================================================================================================================


# --------------------------------------------------------------------------- the run's start and end


def start_run(args):
    """Processes, then (rank 0) the output folder and the resolved configuration, then the model, reward, optimizer
    and a checkpoint to resume from; rank 0 says what will run and trims logs written after that checkpoint."""
    rank, world, device = setup_distributed(args.device, args.dist_timeout)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
        choose_attention_kernels(args.attention)
    if rank == 0:
        announce(args)
    run, start = build_run(args, rank, world, device)
    if rank == 0:
        run.trackers = Trackers(args) if args.report_to else None
        print(describe(run, start), flush=True)
        for name in ("metrics.jsonl", "eval.jsonl"):
            trim_metrics(os.path.join(args.output_dir, name), start)
    return run, start


def finish(run, history):
    """Rank 0 prints the summary and draws the curves; then every rank leaves."""
    if run.rank == 0:
        summarize(run.args.output_dir, history)
        if run.trackers:
            run.trackers.close()
    if distributed():
        dist.barrier()
        # Leave without tearing the process group down: freeing DDP's reducer drops the last reference to the gloo
        # group, whose destructor joins a worker thread that needs the GIL the destructor holds (seen with 8 CPU
        # processes). Everything is written and flushed; torchrun only reads the exit code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --------------------------------------------------------------------------- the command line and its validation


def is_tiny(model):
    return model in ("tiny", "tiny-flux")


def resolve_defaults(args, world_size):
    """Every default in one place: each flag left at None from the model's recipe; the learning rate follows LoRA /
    full fine-tuning; the micro-batch divides the per-process minibatch; held-out prompts are evaluated every 20
    iterations; the output folder is runs/NAME; --resume auto names the newest checkpoint."""
    recipe = RECIPES[args.model if args.model in RECIPES else model_kind(args.model)]
    if args.eval_every is None and args.eval_prompts:   # held-out prompts given: they are evaluated
        args.eval_every = 20
    for name, value in recipe.items():
        if getattr(args, name) is None:  # the recipe's files are the project's
            setattr(args, name, project_file(value) if name.endswith("prompts") and value else value)
    if args.prompts is None:
        args.prompts = project_file(TRAIN_PROMPTS)
    if args.lr is None:
        args.lr = 2e-3 if is_tiny(args.model) else 1e-5 if args.full_finetune else 3e-4
    args.lora_rank = 32 if args.lora_rank is None else args.lora_rank
    args.lora_alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    if args.micro_batch is None:  # a divisor of the minibatch: the same passes on 1 or 2 processes by default
        args.micro_batch = math.gcd(local_minibatch(args, world_size), 16 if is_tiny(args.model) else 4)
    if args.output_dir is None:   # one folder per recipe: the README's recipes do not meet each other's checkpoints
        curriculum = os.path.basename(args.curriculum).removesuffix(".json")
        name = f"curriculum-{curriculum}" if curriculum else \
            args.preset or os.path.basename(os.path.abspath(args.model))
        args.output_dir = os.path.join("runs", name)
    if args.resume == "auto":
        args.resume = latest_checkpoint(args.output_dir) or ""  # nothing saved yet: start from scratch
    return args


def local_minibatch(args, world_size):
    """Samples per optimizer step on each process: P / world prompt groups of G, split over the inner steps."""
    return args.prompts_per_step // world_size * args.group_size // max(args.inner_steps, 1)


def command_line(args):
    """The resolved configuration as the flags that reproduce it (printed at start, saved in config.json)."""
    out = []
    for f in dataclasses.fields(Args):
        value, flag = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if args.curriculum and f.name in STAGE_FLAGS:  # the curriculum sets them stage by stage
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif f.name != "preset" and value is not None:
            out.append(f"{flag} {shlex.quote(value) if isinstance(value, str) else value}")
    return " ".join(out)


def parse_args(argv=None):
    """Command line -> Args. Explicit flags win over a --preset, which wins over the model's recipe."""
    import argparse

    # no abbreviated flags: they would slip past --curriculum's refusal of flags it sets stage by stage
    p = argparse.ArgumentParser(description="V-GRPO training (arXiv 2604.23380)", allow_abbrev=False)
    for f in dataclasses.fields(Args):
        name, text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type in (bool, "bool"):  # --flag / --no-flag
            if "default" not in text:
                shown = recipe_defaults(f.name) if f.default is None else name if f.default else "--no-" + name[2:]
                text += f" (default: {shown})"
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            if "default" not in text:  # None: each model's recipe decides
                shown = recipe_defaults(f.name) if f.default is None else "none" if f.default == "" else f.default
                text += f" (default: {shown})"
            p.add_argument(name, type=typ, default=f.default, help=text)
    known = p.parse_known_args(argv)[0]
    if known.preset:
        if known.preset not in PRESETS:
            raise UsageError(f"unknown --preset '{known.preset}': valid choices are {', '.join(PRESETS)}")
        p.set_defaults(**preset_settings(known.preset))
    if known.curriculum:  # the first stage's settings, and the whole curriculum's length
        stages = load_curriculum(known.curriculum)
        given = [t.split("=")[0] for t in (sys.argv[1:] if argv is None else argv)
                 if t.split("=")[0] in {"--preset", *("--" + f.replace("_", "-") for f in STAGE_FLAGS)}]
        if given:
            raise UsageError(f"--curriculum {known.curriculum} sets {given[0]} stage by stage; leave it out (other "
                             "prompt files: --stage-prompts STAGE=FILE,...)")
        model = {"model": PRESETS[stages[0]["preset"]]["model"]} if stages[0].get("preset") else {}
        p.set_defaults(**stage_settings(stages[0]), **model, iterations=sum(stage["iterations"] for stage in stages))
    return Args(**vars(p.parse_args(argv)))


def recipe_defaults(name):
    """--help's default of a flag the model's recipe sets: each model's value where every recipe has one (so that
    the help cannot go stale as recipes are added), else the words "set by --model"."""
    if not all(name in recipe for recipe in RECIPES.values()):
        return "set by --model"
    return "set by --model: " + ", ".join(f"{model} {recipe[name]}" for model, recipe in RECIPES.items())


class FatalError(Exception):
    """A failure the user must act on: printed as one line, no traceback."""
    exit_code = 1


class UsageError(FatalError):
    """Bad input or a missing resource, found before training starts: exit code 2."""
    exit_code = 2


def note(text):
    """A one-line hint that does not stop the run, printed once (by rank 0) on stderr."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"vgrpo: note: {text}", file=sys.stderr, flush=True)


# checkpoint settings that must match to resume; everything else may change (a curriculum changes rewards)
RESUME_MUST_MATCH = ("model", "full_finetune", "lora_rank", "lora_alpha", "resolution", "fsdp", "curriculum")
SAMPLERS = ("dpmpp2m", "euler")
AMP_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# the flags with a fixed set of values: attribute -> (how an error names it, the valid values)
CHOICES = {
    "sampler": ("sampler", SAMPLERS),
    "pair_sharing": ("--pair-sharing", ("batch", "group", "none")),
    "weighting": ("--weighting", ("adaptive", "none")),
    "mixed_precision": ("--mixed-precision", tuple(AMP_DTYPES)),
    "reward_advantage": ("--reward-advantage", ("sum", "per-reward")),
    "compile": ("--compile", ("auto", "on", "off")),
    "device": ("--device", ("auto", "cpu", "cuda")),   # under torchrun, each process takes cuda:LOCAL_RANK
    "kl_to": ("--kl-to", ("sampling", "initial")),
}
DEFAULT_PROMPTS = [  # the tiny test models' prompts; the others train on a file of prompts/ or --prompts
    "a red apple on a wooden table", "a cat sleeping on a sofa", "a lighthouse at sunset",
    "a bowl of ramen", "a snowy mountain village", "an astronaut riding a horse",
    "a vintage car in the rain", "a field of sunflowers", "a robot reading a book", "a koi pond in autumn",
    "a steaming cup of coffee", "a castle on a hill",
]


def validate(args, world_size):
    """Every check that needs no model, so a wrong flag fails in a second with one line, for `world_size`
    processes (the defaults were resolved for torchrun's WORLD_SIZE when Args was made)."""
    if not is_tiny(args.model) and args.model not in MODEL_IDS and not os.path.isdir(args.model):
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.model) or args.model.startswith("."):
            raise UsageError(f"--model {args.model}: no such folder, and not a Hugging Face id (org/name); use "
                             f"{', '.join(MODEL_IDS)}, tiny, tiny-flux, an id or a local pipeline folder")
    check_finite(args)
    for name, (called, valid) in CHOICES.items():
        if getattr(args, name) not in valid:
            raise UsageError(f"unknown {called} '{getattr(args, name)}': valid choices are {', '.join(valid)}")
    check_curriculum(args)
    for _, _, _, stage in curriculum_stages(args):  # every stage's reward, prompt file and sizes (or the run's)
        check_reward_specs(stage)
        if not stage.prompts and not is_tiny(stage.model):   # "" (an unset shell variable?): the tiny models' prompts
            raise UsageError("--prompts is empty: give a prompt file (.txt or .jsonl); only the tiny test models "
                             "have built-in prompts")
        where = f" (stage {stage.preset})" if args.curriculum else ""
        check_prompt_file("--prompts", stage.prompts, stage.reward, where)
        check_sizes(stage, world_size)
    # every stage evaluates with the run's evaluation rewards
    check_prompt_file("--eval-prompts", args.eval_prompts if args.eval_every else "", args.eval_rewards or args.reward)
    if args.kl_to == "initial" and (args.full_finetune or args.compile == "on"):
        raise UsageError("--kl-to initial takes its reference by switching the LoRA off: it needs LoRA (not "
                         "--full-finetune) and eager blocks (--compile off: peft cannot switch adapters off under "
                         "torch.compile)")
    if args.kl_to == "initial" and not any(stage.beta > 0 for *_, stage in curriculum_stages(args)):
        note("--kl-to initial does nothing without --beta above 0")
    if args.model == "digits" and args.iterations > RECIPES["digits"]["iterations"] and not \
            (args.beta > 0 and args.kl_to == "initial"):
        note(f"past about {RECIPES['digits']['iterations']} iterations the demo's held-out accuracy swings as its "
             "reward gets hacked; --beta 0.3 --kl-to initial --ema 0.95 held within 0.05 of its best to 240 on 4 "
             "seeds (bench/README.md, 'Long runs')")
    if not args.attention or set(args.attention.split(",")) - set(ATTENTION_KERNELS):
        raise UsageError(f"--attention {args.attention!r}: a comma-separated list of {', '.join(ATTENTION_KERNELS)}")
    for name in filter(None, args.report_to.split(",")):
        if name not in ("tensorboard", "wandb"):
            raise UsageError(f"unknown --report-to '{name}': valid choices are tensorboard, wandb")
        if importlib.util.find_spec(name) is None:
            raise UsageError(f"--report-to {name} needs the {name} package: pip install {name}")
    check_paths(args)


def check_finite(args):
    """NaN passes every range check (each comparison is False); inf only makes sense as a clip (none)."""
    for f in dataclasses.fields(Args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not (math.isfinite(value) or (f.name == "max_grad_norm" and value > 0)):
            raise UsageError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")


def check_sizes(args, world_size):
    """Counts, batch arithmetic over the processes, and the scalars' signs."""
    for name in ("sample_steps", "iterations", "prompts_per_step", "n_mc", "inner_steps", "save_every", "sample_every",
                 "sample_batch", "decode_batch"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.full_finetune and (args.lora_rank < 1 or args.lora_alpha <= 0):
        raise UsageError(f"--lora-rank must be at least 1 and --lora-alpha positive (the adapters are scaled by "
                         f"alpha / rank: 0 trains nothing), got {args.lora_rank} and {args.lora_alpha:g}")
    if args.group_size < 2:
        raise UsageError(f"--group-size must be at least 2 (advantages compare samples of a prompt), "
                         f"got {args.group_size}")
    if args.n_mc > args.sample_steps:
        raise UsageError(f"--n-mc {args.n_mc} exceeds --sample-steps {args.sample_steps}: stratification needs a "
                         "grid point per pair")
    if args.prompts_per_step % world_size:
        below = args.prompts_per_step // world_size * world_size
        nearest = " or ".join(str(p) for p in (below, below + world_size) if p > 0)
        raise UsageError(f"--prompts-per-step {args.prompts_per_step} is not divisible by the {world_size} "
                         f"processes (each process takes whole prompt groups): use --prompts-per-step {nearest}")
    if args.group_size % args.inner_steps:
        raise UsageError(f"--inner-steps {args.inner_steps} must divide --group-size {args.group_size}")
    minibatch = local_minibatch(args, world_size)
    if args.fsdp and ("RANK" not in os.environ or args.mixed_precision == "fp16"):
        raise UsageError("--fsdp shards over torchrun's processes (launch with torchrun) and computes in bf16 or "
                         "float32 (fp16's loss scaler is not sharded)")
    if args.micro_batch < 1 or minibatch % args.micro_batch:
        raise UsageError(f"--micro-batch {args.micro_batch} must divide the per-process minibatch of "
                         f"{minibatch} samples (P/world * G / inner-steps)")
    if min(args.clip_eps, args.lr, args.max_grad_norm) <= 0 or min(args.beta, args.adv_soft_clip,
                                                                   args.adv_std_floor, args.weight_decay) < 0:
        raise UsageError("--clip-eps, --lr and --max-grad-norm must be positive (a clip at 0 zeroes every gradient, "
                         "inf clips nothing); "
                         "--beta, --adv-soft-clip, --adv-std-floor and --weight-decay non-negative")
    if args.guidance < 0:
        raise UsageError(f"--guidance must be >= 0, got {args.guidance:g} (SD3: 1 or less is no CFG)")
    if args.resolution < 16 or args.resolution % 16:
        raise UsageError(f"--resolution must be a positive multiple of 16, got {args.resolution}")
    if args.eval_every < 0 or args.eval_images < 1 or (args.eval_every and not args.eval_prompts):
        raise UsageError("--eval-every needs --eval-prompts (and must be >= 0); --eval-images must be >= 1")
    if args.beta > 0 and args.inner_steps == 1 and args.kl_to == "sampling":
        note(f"--beta {args.beta:g} does nothing with --inner-steps 1: the KL is to the sampling policy, which the "
             "only step starts from (value and gradient 0)" + (f" (stage {args.preset})" if args.curriculum else ""))
    if not 0 <= args.ema < 1:
        raise UsageError(f"--ema is a decay in [0, 1) (0: off), got {args.ema}")
    if args.keep_last < 0 or args.max_bad_steps < 1 or args.dist_timeout < 1:
        raise UsageError("--keep-last must be >= 0, --max-bad-steps and --dist-timeout >= 1")


def check_prompt_file(flag, path, reward_spec, where=""):
    """`flag`'s prompt file (none: "") exists, and its rewards can score every prompt in it: checked now, not when
    training draws the prompt hours in."""
    if path and not os.path.isfile(path):
        raise UsageError(f"{flag}: prompt file not found: {path}{where}")
    names = [name for name, _ in rewards_lib.parse_reward_spec(reward_spec)]
    problem = path and rewards_lib.prompt_file_problem(names, *load_prompts(path))
    if problem:
        raise UsageError(f"{flag} {path}{where}: {problem}")


def check_curriculum(args):
    """--stage-prompts names stages of --curriculum as PRESET=FILE."""
    if args.stage_prompts and not args.curriculum:
        raise UsageError("--stage-prompts replaces the prompt files of --curriculum's stages: give --curriculum")
    stages = {stage_name(s, n) for n, s in enumerate(load_curriculum(args.curriculum), 1)} if args.curriculum else ()
    for item in filter(None, args.stage_prompts.split(",")):
        name, _, path = item.partition("=")
        if name not in stages or not path:
            raise UsageError(f"--stage-prompts {item!r}: expected PRESET=FILE with PRESET one of the stages "
                             f"{', '.join(sorted(stages))}")


def check_paths(args):
    """The output folder is writable, --resume names a checkpoint of this configuration, and a new run does not
    start among an earlier run's checkpoints (its metrics would be cleared, --keep-last would delete the new run's
    checkpoints first, and --resume auto after a preemption would take the old run's)."""
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=args.output_dir).close()
    except OSError as e:
        raise UsageError(f"--output-dir {args.output_dir} is not writable ({e.strerror or e})") from None
    if args.resume:
        check_resume_matches(args)
        return
    earlier = latest_checkpoint(args.output_dir)
    if earlier:
        with open(os.path.join(earlier, "state.json")) as f:
            unfinished = json.load(f)["iteration"] < args.iterations
        try:   # another configuration, and --resume auto would be refused
            check_resume_matches(dataclasses.replace(args, resume=earlier))
        except UsageError:
            unfinished = False
        advice = ("continue that run with --resume auto, or " if unfinished else "") + \
            "start anew in another --output-dir"
        raise UsageError(f"--output-dir {args.output_dir} holds an earlier run's {os.path.basename(earlier)}: "
                         f"{advice} (or delete its checkpoint-* folders)")


UNIFIEDREWARD_NOTE = ("the paper's FLUX.1-dev run also trains on UnifiedReward, a VLM judge on a server: "
                      "start one (e.g. `vllm serve CodeGoat24/UnifiedReward-qwen-7b --port 8000`) and append "
                      ",unifiedreward@http://localhost:8000/v1 to --reward")


def check_reward_specs(args):
    if args.preset == "flux-preference" and "unifiedreward@" not in args.reward:
        note(UNIFIEDREWARD_NOTE)
    for flag, spec in (("--reward", args.reward), ("--eval-rewards", args.eval_rewards)):
        try:
            names = [name for name, _ in rewards_lib.parse_reward_spec(spec)] if spec or flag == "--reward" else []
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None
        if len(set(names)) < len(names):
            raise UsageError(f"{flag} {spec}: a reward is named twice; give it one weight")
        clash = [n for n in names if rewards_lib.metric_name(n) in ("mean", "std", "group_std", "reward")]
        if clash:  # its metric would overwrite reward_mean, reward_std, ... or eval_reward
            raise UsageError(f"{flag}: rename the reward function {clash[0]!r}: its metric name clashes with a "
                             "built-in one")


def check_resume_matches(args):
    state_file = os.path.join(args.resume, "state.json")
    if not os.path.isfile(state_file):
        raise UsageError(f"--resume {args.resume}: not a checkpoint directory (no state.json)")
    with open(state_file) as f:
        state = json.load(f)
    saved = state["args"]
    if state["iteration"] > args.iterations:  # a curriculum stage's --iterations counts from the very start
        raise UsageError(f"--resume {args.resume} is at iteration {state['iteration']} and --iterations is "
                         f"{args.iterations}: nothing to train; --iterations is the total, counted from the start")
    keys = [k for k in RESUME_MUST_MATCH if not (k.startswith("lora") and args.full_finetune)]
    diff = [f"--{k.replace('_', '-')} {saved.get(k)} there, {getattr(args, k)} here" for k in keys
            if saved.get(k) != getattr(args, k)]
    if diff:
        raise UsageError(f"--resume {args.resume} belongs to a different configuration: {'; '.join(diff)}")
    if args.ema and not os.path.isdir(os.path.join(args.resume, "ema")):
        raise UsageError(f"--resume {args.resume}: no ema/ in it (saved without --ema); resume without --ema")


# --------------------------------------------------------------------------- the curriculum: stages of one launch


# Named stages of the paper's curriculum: a model and a reward (and what the stage changes); the model's recipe
# fills in the rest, and explicit flags override both. Prompt files are the project's (prompts/).
PRESETS = {
    "sd3-preference": dict(model="sd3", reward="pickscore:1,hpsv2:1,clipscore:1"),  # SD3.5-M's preference stages
    # GenEval stages: the partial-credit score (a 0/1 reward leaves most groups of a hard prompt all equal), about
    # 10 pairs, no soft clip (reported to hurt with a coarse reward)
    "sd3-geneval": dict(model="sd3", reward="geneval_partial", prompts="prompts/geneval_train.jsonl", n_mc=10,
                        adv_soft_clip=0.0),
    # text rendering, the last stage: its prompts quote the text; the paper's KL term (0.3) to keep earlier skills,
    # which is zero with one inner step (the KL is to the sampling policy): --kl-to initial makes it act
    "sd3-ocr": dict(model="sd3", reward="ocr", prompts="prompts/ocr_train.txt", n_mc=10, iterations=30,
                    adv_soft_clip=0.0, beta=0.3),
    # the paper adds UnifiedReward, a VLM judge on a server (`vllm serve CodeGoat24/UnifiedReward-qwen-7b --port 8000`):
    # append ,unifiedreward@http://localhost:8000/v1 to --reward (UNIFIEDREWARD_NOTE, printed at start without it)
    "flux-preference": dict(model="flux", reward="hpsv2:1,pickscore:1,imagereward:1"),
}
# The paper's SD3.5-M curriculum as one launch: its stages (a preset each) and their lengths, 580 iterations in all.
# The weights and optimizer carry over from stage to stage; --resume auto continues inside the right one.
CURRICULA = {"sd3": [{"preset": "sd3-preference", "iterations": 150}, {"preset": "sd3-geneval", "iterations": 200},
                     {"preset": "sd3-preference", "iterations": 150}, {"preset": "sd3-geneval", "iterations": 50},
                     {"preset": "sd3-ocr", "iterations": 30}]}
STAGE_FLAGS = ("reward", "prompts", "n_mc", "adv_soft_clip", "beta", "iterations")  # what the stages set


def load_curriculum(name):
    """--curriculum -> its stages (dicts): a name of CURRICULA or a .json file holding such a list."""
    if name in CURRICULA:
        return CURRICULA[name]
    if not name.endswith(".json") or not os.path.isfile(name):
        raise UsageError(f"unknown --curriculum '{name}': use {', '.join(CURRICULA)} or a .json file of stages")
    with open(name) as f:
        try:
            stages = json.load(f)
        except json.JSONDecodeError as e:
            raise UsageError(f"--curriculum {name}: not JSON ({e.msg})") from None
    for i, stage in enumerate(stages if isinstance(stages, list) and stages else [None], 1):
        bad = set(stage) - {"preset", *STAGE_FLAGS} if isinstance(stage, dict) else {"?"}
        if bad or not isinstance(stage.get("iterations"), int) or stage["iterations"] < 1 or \
                stage.get("preset", "sd3-preference") not in PRESETS:
            raise UsageError(f"--curriculum {name}, stage {i}: expected {{\"iterations\": N >= 1, \"preset\": one "
                             f"of {', '.join(PRESETS)}, or any of {', '.join(STAGE_FLAGS[:-1])}}}")
    return stages


def stage_name(stage, number):
    return stage.get("preset") or f"stage-{number}"


def project_file(path):
    """A path inside the project, relative to where vgrpo runs (nodes with the project elsewhere agree on it)."""
    return os.path.relpath(os.path.join(HERE, path))


def preset_settings(name):
    return {k: project_file(v) if k.endswith("prompts") and v else v for k, v in PRESETS[name].items()}


@dataclass
class Stage:
    """A stage of --curriculum, or the whole run without one: iterations [start, end) with their own settings
    (args), reward and prompts; use_stage makes them the run's."""
    name: str
    start: int
    end: int
    args: Args
    reward_fn: object = None
    prompts: list = None
    metadata: list = None


def use_stage(run, it):
    """Make the stage that iteration `it` belongs to the run's: its settings, reward and prompts (rank 0 says so)."""
    stage = next(s for s in run.stages if s.start <= it < s.end)
    if run.args is not stage.args:
        run.args, run.reward_fn, run.prompts, run.metadata = stage.args, stage.reward_fn, stage.prompts, stage.metadata
        if run.rank == 0:
            a = stage.args
            print(f"vgrpo: stage {run.stages.index(stage) + 1}/{len(run.stages)} {stage.name}, iterations "
                  f"{stage.start + 1}..{stage.end}: reward {a.reward}, prompts {a.prompts}, N_MC {a.n_mc}, "
                  f"soft clip {a.adv_soft_clip:g}, beta {a.beta:g}", flush=True)


def curriculum_stages(args):
    """--curriculum's stages as (preset, first iteration, end, that stage's Args): the preset's settings on top of
    the run's, --stage-prompts' files instead of its prompts. Without a curriculum, one stage: the whole run."""
    if not args.curriculum:
        return [("", 0, args.iterations, args)]
    files = dict(item.split("=", 1) for item in filter(None, args.stage_prompts.split(",")))
    # the stage's flags are reset to unset, then replace() runs Args.__post_init__ again: the recipe fills what the
    # stage leaves unset (the preference stages' soft clip 3, for one)
    unset = {k: v for k, v in default_flags().items() if k in STAGE_FLAGS}
    out, start = [], 0
    for number, stage in enumerate(load_curriculum(args.curriculum), 1):
        name, settings = stage_name(stage, number), stage_settings(stage)
        settings.update({"prompts": files[name]} if name in files else {})
        out.append((name, start, start + stage["iterations"], dataclasses.replace(
            args, **{**unset, **settings, "preset": name, "iterations": args.iterations})))
        start += stage["iterations"]
    return out


def stage_settings(stage):
    """A curriculum stage's flags: its preset's (without the model and length) and its own on top."""
    settings = {k: v for k, v in preset_settings(stage["preset"]).items() if k not in ("model", "iterations")} \
        if stage.get("preset") else {}
    return {**settings, **{k: v for k, v in stage.items() if k not in ("preset", "iterations")}}


def is_json_object(line):
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def load_prompts(path):
    """-> (prompts, metadata). .txt: one prompt per line, blank lines skipped. .jsonl: one object per line
    with a "prompt" field; the whole object is the prompt's metadata, handed to rewards that take it
    (GenEval's format). An empty, non-UTF-8 or malformed file is refused with its line number."""
    if not path:
        return list(DEFAULT_PROMPTS), [{} for _ in DEFAULT_PROMPTS]
    suffix = os.path.splitext(path)[1].lower().replace(".ndjson", ".jsonl")   # the same format
    if suffix in (".json", ".csv", ".tsv", ".parquet", ".yaml"):
        raise UsageError(f"prompt file {path}: prompts are read from .txt (one per line) or .jsonl (one object per "
                         f"line), not {suffix}")
    prompts, metadata = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").lstrip("\ufeff").strip()   # and the byte-order mark some editors write
            except UnicodeDecodeError:
                raise UsageError(f"prompt file {path}, line {number}: not UTF-8 text") from None
            if not line:
                continue
            if suffix != ".jsonl":
                if not prompts and is_json_object(line):   # its metadata would be lost
                    raise UsageError(f"prompt file {path}, line {number}: a JSON object in a text file; name the "
                                     "file .jsonl to read each line's prompt and metadata")
                prompts.append(line)
                metadata.append({})
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"prompt file {path}, line {number}: not JSON ({e.msg})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise UsageError(f'prompt file {path}, line {number}: expected an object with a "prompt" string')
            prompts.append(item["prompt"])
            metadata.append(item)
    if not prompts:
        raise UsageError(f"prompt file {path} has no prompts")
    return prompts, metadata


# --------------------------------------------------------------------------- model families
# The loop talks to a model only through this seam: encode(prompts), velocity(model, x, sigma, cond),
# decode(o), sigma_grid(steps), latent_shape, save_lora(dir). The four families differ only in what is below.


TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # the pipelines' names (SD3: three, FLUX: two)


class Family:
    """What every model shares: prompt embeddings encoded once at start (or, when they would not fit, cached per
    prompt with the text encoders offloaded to the CPU between uses), mixed-precision forward passes, LoRA saving
    in the pipeline's own format."""

    cfg = True  # does --guidance mean classifier-free guidance (two passes)? FLUX feeds it to an embedding
    negative_prompt = ""  # CFG's unconditional prompt
    compiled = False  # --compile: the blocks run torch.compile'd (compile_blocks)
    cache_bytes = 2 << 30  # on-demand embeddings kept per prompt (FLUX's 512 T5 tokens: 4 MB each in bf16)
    store_bytes = 8 << 30  # host memory for the embeddings of every prompt, encoded at start (SD3: 2.7 MB each)

    def __init__(self, pipe, resolution, max_sequence_length, device, amp_dtype=None, offload_text_encoders=False):
        self.pipe, self.device, self.max_sequence_length = pipe, device, max_sequence_length
        self.transformer, self.resolution = pipe.transformer, resolution
        self.amp_dtype, self.offload = amp_dtype, offload_text_encoders
        self._cache = collections.OrderedDict()  # prompt -> embeddings, on the CPU when the encoders are offloaded
        self._store, self._stored = None, None    # prompt -> row of the stacked embeddings encoded at start

    def autocast(self):
        """bf16/fp16 matmuls for the transformer; the surrogate and the loss are computed in float32."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def text_encoders(self):
        return [getattr(self.pipe, n) for n in TEXT_ENCODERS if getattr(self.pipe, n, None) is not None]

    @torch.no_grad()
    def encode_all(self, prompts, path, write=True, batch_size=32):
        """Encode every prompt the run will meet once, at start, batch_size at a time, into an embedding store that
        `encode` then reads: no iteration ever moves the text encoders (T5-XXL and two CLIPs: ~11 GB in bf16) to
        the device and back. The store is saved at `path` (by the rank with write=True) keyed by the encoders'
        weights and the prompts, so a resumed run reads it back. With the encoders offloaded (CUDA) they are then
        freed. Returns False, changing nothing, when the store would not fit in store_bytes of host memory."""
        unique = list(dict.fromkeys(prompts))
        weights = torch.stack([p.detach().double().sum() for enc in self.text_encoders() for p in enc.parameters()])
        key = f"{type(self).__name__} {self.max_sequence_length} {weights.sum().item():.17g} {weights.numel()}"
        saved = torch.load(path, weights_only=True) if os.path.isfile(path) else {}
        if saved.get("key") == key and saved["prompts"] == unique:
            stored = saved["embeddings"]
        else:
            self.move_text_encoders(self.device)
            first = self.encode_texts(unique[:1])
            if sum(t[0].numel() * t.element_size() for t in first) * len(unique) > self.store_bytes:
                self.move_text_encoders("cpu" if self.offload else self.device)
                return False
            chunks = [self.encode_texts(unique[i:i + batch_size]) for i in range(0, len(unique), batch_size)]
            stored = [torch.cat([chunk[k] for chunk in chunks]).cpu() for k in range(len(first))]
            if write:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                torch.save({"key": key, "prompts": unique, "embeddings": stored}, path + ".tmp")
                os.replace(path + ".tmp", path)
        pin = self.device.type == "cuda"  # pinned host memory: the per-iteration copies run asynchronously
        self._stored = [t.pin_memory() if pin else t.to(self.device) for t in stored]
        self._store = {p: i for i, p in enumerate(unique)}
        if self.offload:  # only the store is read from now on
            for name in TEXT_ENCODERS:
                setattr(self.pipe, name, None)
        return True

    def move_text_encoders(self, device):
        for enc in self.text_encoders():
            enc.to(device)

    @torch.no_grad()
    def encode(self, prompts):
        """Prompt embeddings: rows of the store encode_all made, or else one prompt at a time (cached), so
        results never depend on batch composition."""
        if self._store is not None:
            missing = [p for p in prompts if p not in self._store]
            if missing and not self.text_encoders():
                raise FatalError(f"prompt {missing[0]!r} is not in the embedding store encoded at start")
            if not missing:
                rows = torch.tensor([self._store[p] for p in prompts])
                return tuple(self.store_rows(t, rows) for t in self._stored)
        missing = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        if missing and self.offload:
            self.move_text_encoders(self.device)
        store = torch.device("cpu") if self.offload else self.device
        for p in missing:
            self._cache[p] = tuple(t[0].to(store) for t in self.encode_texts([p]))
        if missing and self.offload:
            self.move_text_encoders("cpu")
        wanted = dict.fromkeys(prompts)
        for p in wanted:
            self._cache.move_to_end(p)  # least recently used first
        size = sum(t.numel() * t.element_size() for v in self._cache.values() for t in v)
        while size > self.cache_bytes and next(iter(self._cache)) not in wanted:
            size -= sum(t.numel() * t.element_size() for t in self._cache.popitem(last=False)[1])
        n = len(next(iter(self._cache.values())))
        return tuple(torch.stack([self._cache[p][k] for p in prompts]).to(self.device) for k in range(n))

    def store_rows(self, t, rows):
        """Rows of a stored embedding tensor, on the device. A pinned store is indexed into pinned memory (t[rows]
        would make an ordinary pageable copy, whose copy to the GPU then runs synchronously), so the copy overlaps
        the work queued before it. The store stays in host memory: SD3's prompts take 2.7 MB each in bf16, a
        curriculum's 3,000 of them 8 GB, which no GPU should hold beside the model."""
        if not t.is_pinned():
            return t[rows].to(self.device)
        out = torch.empty((len(rows), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, rows, out=out).to(self.device, non_blocking=True)

    def scheduler_grid(self, steps, sigmas=None):
        """The pipeline's own (shifted) schedule: S values then the final 0, float32 on the CPU."""
        scheduler = copy.deepcopy(self.pipe.scheduler)
        kwargs = {"sigmas": sigmas} if sigmas is not None else {}
        if scheduler.config.get("use_dynamic_shifting", False):  # resolution-dependent shift (FLUX, SD3.5 opt.)
            kwargs["mu"] = self.shift_mu(steps)
        scheduler.set_timesteps(None if sigmas is not None else steps, device="cpu", **kwargs)
        return scheduler.sigmas.float()

    def sigma_grid(self, steps):
        """linspace(1, 1/S, S) through the pipeline's scheduler and its shift, as FLUX.1's, FLUX.2's and Qwen-Image's
        pipelines sample (SD3's lets the scheduler choose)."""
        import numpy as np

        return self.scheduler_grid(steps, sigmas=np.linspace(1.0, 1 / steps, steps))

    def shift_mu(self, steps):
        """The dynamic shift's mu as FLUX.1's and Qwen-Image's pipelines compute it: linear in the image tokens."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        c = self.pipe.scheduler.config
        return calculate_shift(self.image_tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                               c.get("base_shift", 0.5), c.get("max_shift", 1.15))

    def guide(self, v_uncond, v_cond, scale):
        """Classifier-free guidance of two velocities (the rollout's, with --guidance > 1 where cfg is True)."""
        return v_uncond + scale * (v_cond - v_uncond)

    def pack_latents(self, pipe, resolution):
        """FLUX.1's, FLUX.2's and Qwen-Image's layout: 2x2 latent patches as tokens, (h/2 * w/2, 4C), the transformer's
        input channels; side is the unpacked latent side."""
        self.side = 2 * (resolution // (pipe.vae_scale_factor * 2))
        self.latent_shape = ((self.side // 2) ** 2, pipe.transformer.config.in_channels)
        self.image_tokens = self.latent_shape[0]

    @staticmethod
    def pipeline_timestep(sigma, x):
        """sigma as those pipelines hand it to their transformers, bit for bit: (sigma * 1000) in x's dtype / 1000."""
        return (sigma * 1000).to(x.device).expand(x.shape[0]).to(x.dtype) / 1000

    def vae_decode(self, latents):
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)                   # (B, 3, H, W) in [0, 1]

    def save_lora(self, directory, state_dict, config):
        type(self.pipe).save_lora_weights(directory, transformer_lora_layers=state_dict,
                                          transformer_lora_adapter_metadata=config)


class SD3Family(Family):
    """Stable Diffusion 3 / 3.5 (MMDiT, two CLIP encoders and optionally T5). Latents (C, h, w)."""

    def blocks(self):  # the units FSDP shards
        return list(self.transformer.transformer_blocks)

    lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

    def __init__(self, pipe, resolution, max_sequence_length, device, **kw):
        super().__init__(pipe, resolution, max_sequence_length, device, **kw)
        side = resolution // pipe.vae_scale_factor
        self.latent_shape = (self.transformer.config.in_channels, side, side)
        self.image_tokens = (side // self.transformer.config.patch_size) ** 2

    def sigma_grid(self, steps):
        return self.scheduler_grid(steps)

    def encode_texts(self, prompts):
        emb, _, pooled, _ = self.pipe.encode_prompt(prompts, None, None, device=self.device, num_images_per_prompt=1,
                                                    do_classifier_free_guidance=False,
                                                    max_sequence_length=self.max_sequence_length)
        return emb, pooled

    def velocity(self, model, x, sigma, cond):
        emb, pooled = cond
        timestep = (sigma * 1000).to(x.device).expand(x.shape[0])
        with self.autocast():
            v = model(hidden_states=x, timestep=timestep, encoder_hidden_states=emb.to(x.dtype),
                      pooled_projections=pooled.to(x.dtype), return_dict=False)[0]
        return v.float() if self.amp_dtype else v  # keep the ODE state and the surrogate in float32

    @torch.no_grad()
    def decode(self, o):
        return self.vae_decode(o)


class FluxFamily(Family):
    """FLUX.1 (double- and single-stream blocks, CLIP pooled + T5 sequence). Latents are kept packed as the
    transformer reads them: 2x2 latent patches -> tokens, (h/2 * w/2, 4C); image ids give each token its
    (row, column) for the rotary embedding. FLUX.1-dev is guidance-distilled: --guidance feeds its guidance
    embedding in a single pass (no CFG). Its schedule is linspace(1, 1/S, S) shifted by a resolution-dependent mu."""

    cfg = False

    def blocks(self):
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    # every linear layer inside the blocks: attention of both streams, the double blocks' feed-forwards, the
    # single blocks' fused MLP (proj_mlp in, proj_out out); not the model's own input / output layers
    lora_targets = (r".*blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                    r"|proj_mlp|proj_out|ff(_context)?\.net\.(0\.proj|2))")

    def __init__(self, pipe, resolution, max_sequence_length, device, guidance=3.5, **kw):
        super().__init__(pipe, resolution, max_sequence_length, device, **kw)
        self.pack_latents(pipe, resolution)
        self.img_ids = pipe._prepare_latent_image_ids(1, self.side // 2, self.side // 2, device, torch.float32)
        self.guidance = guidance if pipe.transformer.config.guidance_embeds else None

    def encode_texts(self, prompts):
        emb, pooled, _ = self.pipe.encode_prompt(prompts, None, device=self.device, num_images_per_prompt=1,
                                                 max_sequence_length=self.max_sequence_length)
        return emb, pooled

    def velocity(self, model, x, sigma, cond):
        emb, pooled = cond
        t = self.pipeline_timestep(sigma, x)
        guidance = None if self.guidance is None else torch.full((x.shape[0],), self.guidance, device=x.device)
        txt_ids = torch.zeros(emb.shape[1], 3, device=x.device)
        with self.autocast():
            v = model(hidden_states=x, timestep=t, guidance=guidance, pooled_projections=pooled.to(x.dtype),
                      encoder_hidden_states=emb.to(x.dtype), txt_ids=txt_ids, img_ids=self.img_ids,
                      return_dict=False)[0]
        return v.float() if self.amp_dtype else v

    @torch.no_grad()
    def decode(self, o):
        side, scale = self.resolution, self.pipe.vae_scale_factor
        return self.vae_decode(self.pipe._unpack_latents(o, side, side, scale))


class QwenImageFamily(Family):
    """Qwen-Image (Qwen/Qwen-Image: a 20B MMDiT reading Qwen2.5-VL's last hidden states). Latents are 2x2-packed tokens
    as FLUX.1's, (h/2 * w/2, 4C), over a video VAE's single frame normalised by per-channel means and stds. Guidance is
    true CFG with a " " negative prompt, rescaled to the conditional velocity's norm per token, as its pipeline does.
    Prompt embeddings vary in length: each is padded to max_sequence_length with its mask, so rows stack."""

    cfg, negative_prompt = True, " "

    def blocks(self):
        return list(self.transformer.transformer_blocks)

    @property
    def lora_targets(self):
        """The joint attention of both streams and both feed-forwards, as Flow-GRPO's Qwen-Image LoRA (not the
        modulations), except the last block's text-stream output (to_add_out, txt_mlp), which feeds nothing: DDP
        requires a gradient for every trained weight."""
        last = len(self.transformer.transformer_blocks) - 1
        return (r"(.*\.)?transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj)"
                r"|img_mlp\.net\.(0\.proj|2))"
                rf"|(.*\.)?transformer_blocks\.(?!{last}\.)\d+\.(attn\.to_add_out|txt_mlp\.net\.(0\.proj|2))")

    def __init__(self, pipe, resolution, max_sequence_length, device, **kw):
        Family.__init__(self, pipe, resolution, max_sequence_length, device, **kw)
        self.pack_latents(pipe, resolution)
        self.text_tokens = max_sequence_length  # until encode_all has seen every prompt

    def encode_all(self, prompts, path, write=True, batch_size=32):
        """As Family's; then every prompt of the run is known, and the padding that all of them have (past the
        longest, rounded up to 64 tokens) is cut from every forward: prompts are tens of tokens, the padding to
        max_sequence_length would cost a fifth of the transformer's work at 512 px."""
        stored = super().encode_all(prompts, path, write, batch_size)
        if stored:
            longest = int(self._stored[1].sum(1).max())
            self.text_tokens = min(self.max_sequence_length, -(-longest // 64) * 64)
        return stored

    def encode(self, prompts):
        emb, mask = super().encode(prompts)
        return emb[:, :self.text_tokens], mask[:, :self.text_tokens]

    def encode_texts(self, prompts):
        emb, mask = self.pipe.encode_prompt(prompts, device=self.device, max_sequence_length=self.max_sequence_length)
        mask = torch.ones(emb.shape[:2], dtype=torch.long, device=emb.device) if mask is None else mask
        pad = self.max_sequence_length - emb.shape[1]
        return torch.nn.functional.pad(emb, (0, 0, 0, pad)), torch.nn.functional.pad(mask, (0, pad))

    def velocity(self, model, x, sigma, cond):
        emb, mask = cond
        t = self.pipeline_timestep(sigma, x)
        shapes = [[(1, self.side // 2, self.side // 2)]] * x.shape[0]    # one frame of h/2 x w/2 tokens per row
        with self.autocast():
            v = model(hidden_states=x, timestep=t, encoder_hidden_states=emb.to(x.dtype),
                      encoder_hidden_states_mask=mask, img_shapes=shapes, return_dict=False)[0]
        return v.float() if self.amp_dtype else v

    def guide(self, v_uncond, v_cond, scale):
        v = super().guide(v_uncond, v_cond, scale)
        return v * (v_cond.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))

    @torch.no_grad()
    def decode(self, o):
        vae, shape = self.pipe.vae, (1, self.pipe.vae.config.z_dim, 1, 1, 1)
        latents = self.pipe._unpack_latents(o, self.resolution, self.resolution, self.pipe.vae_scale_factor)
        latents = latents * torch.tensor(vae.config.latents_std, device=o.device).view(shape) + \
            torch.tensor(vae.config.latents_mean, device=o.device).view(shape)
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


class Flux2KleinFamily(Family):
    """FLUX.2 [klein] (black-forest-labs/FLUX.2-klein-base-4B / -9B, and the 4-step distilled FLUX.2-klein-4B / -9B):
    FLUX.2's double- and single-stream blocks reading three stacked hidden layers of Qwen3, 4D rotary positions
    (t, h, w, l), and FLUX.2's VAE, whose 2x2-patchified latents are normalised by its batch norm's running statistics.
    The base models take true CFG (two passes, --guidance); the distilled ones no guidance at all. Its schedule's shift
    mu is an empirical function of the image tokens and the number of steps."""

    negative_prompt = ""

    def blocks(self):
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    # attention and feed-forwards of the double blocks, the single blocks' fused QKV+MLP input and output (a plain
    # Linear there, where the double blocks' to_out is a list holding one)
    lora_targets = (r"(.*\.)?transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|"
                    r"add_v_proj|to_add_out)|ff(_context)?\.(linear_in|linear_out))"
                    r"|(.*\.)?single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)")

    def __init__(self, pipe, resolution, max_sequence_length, device, **kw):
        Family.__init__(self, pipe, resolution, max_sequence_length, device, **kw)
        self.cfg = not pipe.config.is_distilled
        self.pack_latents(pipe, resolution)
        grid = torch.zeros(1, self.latent_shape[1], self.side // 2, self.side // 2)
        self.img_ids = pipe._prepare_latent_ids(grid)[0].to(device)              # (tokens, 4): (0, row, column, 0)

    def sigma_grid(self, steps):
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):  # its pipeline then leaves the grid to them
            return self.scheduler_grid(steps)
        return super().sigma_grid(steps)

    def shift_mu(self, steps):
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        return compute_empirical_mu(self.image_tokens, steps)

    def encode_texts(self, prompts):
        emb, _ = self.pipe.encode_prompt(prompts, device=self.device, max_sequence_length=self.max_sequence_length)
        return (emb,)

    def velocity(self, model, x, sigma, cond):
        emb, = cond
        t = self.pipeline_timestep(sigma, x)
        txt_ids = self.pipe._prepare_text_ids(emb[:1])[0].to(x.device)          # (tokens, 4): (0, 0, 0, index)
        with self.autocast():
            v = model(hidden_states=x, timestep=t, guidance=None, encoder_hidden_states=emb.to(x.dtype),
                      txt_ids=txt_ids, img_ids=self.img_ids, return_dict=False)[0]
        return v.float() if self.amp_dtype else v

    @torch.no_grad()
    def decode(self, o):
        pipe, half = self.pipe, self.side // 2
        latents = o.transpose(1, 2).reshape(len(o), -1, half, half)             # tokens -> (4C, h/2, w/2)
        bn = pipe.vae.bn
        latents = latents * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps) + \
            bn.running_mean.view(1, -1, 1, 1)
        latents = pipe._unpatchify_latents(latents)
        image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


# kind -> (diffusers pipeline class, Family); a pipeline folder's model_index.json names its class
PIPELINES = {"sd3": ("StableDiffusion3Pipeline", SD3Family), "flux": ("FluxPipeline", FluxFamily),
             "qwen-image": ("QwenImagePipeline", QwenImageFamily),
             "flux2-klein": ("Flux2KleinPipeline", Flux2KleinFamily)}


def model_kind(model):
    """'sd3', 'flux', 'qwen-image' or 'flux2-klein' for a --model value: the class in its model_index.json (a local
    folder's or the Hugging Face cache's copy), else a guess from the name."""
    if model in PIPELINES:
        return model
    if is_tiny(model):
        return "flux" if model == "tiny-flux" else "sd3"
    name = MODEL_IDS.get(model, model)
    index = os.path.join(name, "model_index.json")
    if not os.path.isfile(index) and re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        from huggingface_hub import try_to_load_from_cache

        index = try_to_load_from_cache(name, "model_index.json")
    if isinstance(index, str) and os.path.isfile(index):
        with open(index) as f:
            pipeline = json.load(f).get("_class_name", "")
        kind = next((kind for kind, (cls, _) in PIPELINES.items() if cls == pipeline), None)
        if kind is None and pipeline.startswith("Flux") and not pipeline.startswith("Flux2"):
            kind = "flux"  # FLUX.1's other pipelines (Kontext, Fill, ...) hold the same parts
        if kind is None:
            raise UsageError(f"--model {model}: its pipeline is a {pipeline}, none of "
                             f"{', '.join(cls for cls, _ in PIPELINES.values())}")
        return kind
    lower = name.lower()
    return "qwen-image" if "qwen-image" in lower else "flux2-klein" if "flux.2-klein" in lower else \
        "flux" if "flux" in lower else "sd3"


def load_family(args, device):
    """--model -> a Family on `device`. Missing weights are one clear line, not a traceback."""
    kind, amp = model_kind(args.model), AMP_DTYPES[args.mixed_precision]
    if is_tiny(args.model):
        pipe = build_tiny_sd3_pipeline() if kind == "sd3" else build_tiny_flux_pipeline()
    else:
        pipe = load_pipeline(MODEL_IDS.get(args.model, args.model), kind, amp or torch.float32)
    # an SD3 without T5 would get max_sequence_length zero tokens in its place: none, unless asked for
    max_len = args.max_sequence_length if args.max_sequence_length is not None else \
        512 if kind == "flux" else 256 if getattr(pipe, "text_encoder_3", None) is not None else 0
    pipe.set_progress_bar_config(disable=True)
    # full fine-tuning keeps float32 master weights (AdamW on bf16 weights loses small updates); with LoRA
    # the frozen base weights can live in the low-precision dtype and only the adapters stay float32
    weights_dtype = torch.float32 if args.full_finetune or amp is None else amp
    if pipe.transformer.dtype != weights_dtype:
        pipe.transformer.to(weights_dtype)
    # under --fsdp the transformer stays on the CPU until fully_shard moves it to the GPU block by block, each block
    # as its shard: no GPU ever holds the whole model (FLUX.1-dev in float32 for full fine-tuning: 48 GB)
    pipe.transformer.requires_grad_(False).to("cpu" if args.fsdp else device)
    pipe.vae.requires_grad_(False).to(device)
    offload = args.offload_text_encoders and device.type == "cuda"
    for name in TEXT_ENCODERS:
        if getattr(pipe, name, None) is not None:
            getattr(pipe, name).requires_grad_(False).to("cpu" if offload else device)
    if args.gradient_checkpointing:
        pipe.transformer.enable_gradient_checkpointing()
    kw = dict(amp_dtype=amp, offload_text_encoders=offload)
    if kind == "flux":
        kw["guidance"] = args.guidance
    family = PIPELINES[kind][1](pipe, args.resolution, max_len, device, **kw)
    if kind == "flux" and family.guidance is None and args.guidance != 1:
        note(f"{args.model} has no guidance embedding (as FLUX.1 [schnell]): --guidance {args.guidance:g} is ignored")
    if kind == "flux2-klein" and not family.cfg and args.guidance > 1:
        note(f"{args.model} is step-distilled: it takes no guidance (--guidance {args.guidance:g} is ignored) and is "
             "made for --sample-steps 4")
    return family


def load_pipeline(name, kind, dtype):
    """The kind's pipeline (PIPELINES) from a folder or the Hugging Face cache, its frozen parts in `dtype`.
    Components the folder's model_index.json lists as absent (an SD3 saved without T5) are passed as None, which
    diffusers requires. What is missing is one line."""
    import diffusers
    from huggingface_hub import try_to_load_from_cache
    from safetensors import SafetensorError     # a weights file cut short

    local = os.path.isdir(name)
    index = os.path.join(name, "model_index.json") if local else try_to_load_from_cache(name, "model_index.json")
    if local and not os.path.isfile(index):
        raise UsageError(f"--model {name}: the folder has no model_index.json, so it is not a diffusers pipeline "
                         "(make one with pipe.save_pretrained(folder))")
    absent = {}
    if isinstance(index, str) and os.path.isfile(index):
        with open(index) as f:
            absent = {part: None for part, entry in json.load(f).items() if entry == [None, None]}
    try:
        pipe = getattr(diffusers, PIPELINES[kind][0]).from_pretrained(name, dtype=dtype, **absent)
    except (OSError, ValueError, SafetensorError) as e:
        if local:
            raise UsageError(f"--model {name}: the pipeline folder is incomplete ({type(e).__name__}: "
                             f"{str(e).splitlines()[0]})") from None
        raise UsageError(f"could not load '{name}' ({type(e).__name__}): it is not a local folder and the Hugging Face "
                         f"cache has no complete copy; download it once with `hf download {name}` (accept the "
                         "model's licence first) or pass a local pipeline folder with --model /path/to/pipeline") \
            from None
    # a tokenizer whose files are absent loads as an empty one that reads every prompt as unknown tokens
    bare = [part for part, component in pipe.components.items()
            if part.startswith("tokenizer") and component is not None and rewards_lib.lacks_vocabulary(component)]
    if bare:
        where, fix = ("the folder", "save the pipeline there again") if local else \
            ("the Hugging Face cache's copy", f"download it again with `hf download {name}`")
        raise UsageError(f"--model {name}: {where} has no vocabulary for {' and '.join(bare)} (an incomplete copy: "
                         f"every prompt would read as unknown tokens); {fix}")
    return pipe


def add_trainable_weights(family, args):
    """LoRA through diffusers' peft integration, or full fine-tuning; returns the trainable parameters."""
    transformer = family.transformer
    if args.full_finetune:
        transformer.requires_grad_(True)
    else:
        from peft import LoraConfig

        transformer.requires_grad_(False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)  # the same LoRA init on every rank
            transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                               init_lora_weights="gaussian", target_modules=family.lora_targets))
        if family.amp_dtype is not None:
            # peft casts each LoRA layer's input up to the adapter's float32 and autocast casts it back down for the
            # matmul: a copy of the activations per layer per forward, for the same result (bench/results/cost.md)
            from peft.tuners.tuners_utils import BaseTunerLayer

            for layer in transformer.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.cast_input_dtype_enabled = False
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:  # trained weights stay float32 even when the frozen base is bf16 (AdamW needs the precision)
        p.data = p.data.float()
    return params


@torch.no_grad()
def initial_x0(family, batch, args, n_prompts):
    """--kl-to initial: x0_hat of the model before training on every row the update will see, micro-batch by
    micro-batch as the update sees them, with the LoRA switched off (the frozen base is the initial model)."""
    x0_ref = torch.empty(batch["eps"].shape, device=batch["o"].device)
    family.transformer.disable_adapters()
    try:
        for _, idx in micro_batches(n_prompts, args.group_size, args.inner_steps, args.micro_batch, x0_ref.device):
            x0_ref[idx] = surrogate(family, family.transformer, batch["o"][idx], batch["sigmas"][idx],
                                    batch["eps"][idx], rows_of(batch["cond"], idx), args.weighting)[1]
    finally:  # an error in the pass must not leave the LoRA off for the rest of the run
        family.transformer.enable_adapters()
    return x0_ref


RECOMPILE_LIMIT = 64  # compiled variants allowed per block class (torch's default, 8, is too few: compile_blocks)


def compile_wanted(args, world, device):
    """--compile -> whether compile_blocks runs: on CUDA for real models with `auto`. Decided before the models load,
    so that a refusal comes at once, and alike on every rank."""
    missing = missing_compile_toolchain(device) if device.type == "cuda" else None
    # every rank decides alike (a node without gcc would otherwise train with other numerics), so every rank joins
    # this reduction, whatever its flags: the last rank that lacks the toolchain (gloo's tensors stay on the CPU)
    if world > 1 and device.type == "cuda":
        lacking = torch.tensor([dist.get_rank() + 1 if missing else 0],
                               device="cpu" if dist.get_backend() == "gloo" else device)
        dist.all_reduce(lacking, op=dist.ReduceOp.MAX)
        lacking_rank = int(lacking.item()) - 1
        if missing:
            missing = f"{missing} on rank {dist.get_rank()}"
        elif lacking_rank >= 0:
            missing = f"triton, a GPU of compute capability 7.0+ and a C compiler, and rank {lacking_rank} lacks one"
    small = is_tiny(args.model) or args.model == "digits"  # compiling would take longer than their whole run
    # --kl-to initial switches the LoRA off for its reference, which peft does not support under torch.compile
    eager = device.type != "cuda" or small or args.kl_to == "initial"
    if args.compile == "off" or (args.compile == "auto" and eager):
        return False
    if missing and args.compile == "on":
        raise UsageError(f"--compile on: torch.compile on CUDA needs {missing}; or --compile off (eager, slower)")
    if missing:   # a slim container image: the first forward would fail deep in inductor
        note(f"the transformer's blocks run eagerly (slower): torch.compile on CUDA needs {missing}")
        return False
    return True


def compile_blocks(family):
    """--compile: torch.compile on each transformer block in place (regional compilation), after LoRA is attached and
    before FSDP2 shards the blocks. Blocks of one kind share their compiled code (torch inlines the modules, so the
    weights are inputs, not constants): SD3.5-M compiles three kinds of block, FLUX two, in seconds rather than the
    minutes a whole-model compile takes. A change of batch (rollout, micro-batch, a partial chunk, evaluation)
    recompiles once with the batch dimension made dynamic, then never again. Every pass that computes a surrogate
    runs these blocks, the old surrogate with gradients on as the update (old_surrogate), so the two see the same
    compiled numerics."""
    # The blocks of a class share one forward, whose compiled variants count against one limit (8 by default): SD3.5-M
    # needs 11 in an iteration and an evaluation (3 kinds of block in the rollout, 4 in the update, where the first
    # block's input needs no gradient, 4 at the evaluation's new batch; 14 under FSDP2), and past the limit torch runs
    # the remaining variants eagerly, silently.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for block in family.blocks():
        block.compile()
    family.compiled = True


def missing_compile_toolchain(device):
    """What torch.compile's CUDA kernels need and this machine lacks, or None: triton writes them for GPUs of compute
    capability 7.0 and newer, and builds each kernel's launcher with the C compiler it finds as $CC, gcc or clang,
    against Python's C headers (where triton looks for them)."""
    from torch.utils._triton import has_triton_package

    if not has_triton_package():
        return "triton (pip install triton)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 7:
        return f"a GPU of compute capability 7.0 or newer (this one: {major}.{minor})"
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        return "a C compiler for triton (gcc or clang, or its path in $CC)"
    headers = python_headers()
    if not os.path.isfile(os.path.join(headers, "Python.h")):
        return f"Python's C headers for triton ({headers}/Python.h: the python3-dev package of this Python)"
    return None


def python_headers():
    """The folder where triton looks for Python.h: this Python's include folder (Debian's posix_local scheme is read
    as posix_prefix, as triton does)."""
    import sysconfig

    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


def compiled_graphs():
    """How many frames torch.compile has compiled in this process so far (each recompile counts)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def compile_seconds():
    """The seconds torch.compile has spent compiling in this process so far (its own timers: each frame's compile,
    the backend's included, and each backward graph that is compiled only at its first backward), or None where this
    torch does not keep those timers."""
    from torch._dynamo.utils import compilation_time_metrics

    times = [sum(v) for k, v in compilation_time_metrics.items()
             if k.endswith("compile_inner") or k == "backward._backward_impl"]
    return sum(times) if times else None


def wrap_for_training(family, args, world, device):
    """DDP (every rank holds every weight, gradients averaged) or, with --fsdp, FSDP2: each transformer block
    sharded over the ranks, then the root, so weights, gradients and AdamW states take 1/world of the memory.
    Returns the module the update calls; rollouts call family.transformer, the same module under FSDP2."""
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        amp = AMP_DTYPES[args.mixed_precision]
        # compute in the mixed-precision dtype, reduce gradients in float32 into float32 master weights. The inputs
        # stay as given, as without FSDP: autocast casts the matmuls', and SD3's timestep (1000 sigma, steps of 4 in
        # bf16) and FLUX's rotary cos / sin keep their float32
        policy = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32, cast_forward_inputs=False) \
            if amp else MixedPrecisionPolicy()
        for block in family.blocks():
            fully_shard(block, mp_policy=policy)
        return fully_shard(family.transformer, mp_policy=policy)
    if world == 1:
        return family.transformer
    # no buffer broadcast at every step (SD3's positional embedding is a 453 MB buffer, equal on every rank);
    # gradients as views into DDP's buckets: no second copy of them (9 GB of SD3.5-M's with full fine-tuning)
    return torch.nn.parallel.DistributedDataParallel(family.transformer, broadcast_buffers=False,
                                                     device_ids=[device] if device.type == "cuda" else None,
                                                     gradient_as_bucket_view=True)


def build_run(args, rank, world, device):
    """Load the model, the rewards and prompts of every stage, the optimizer (and a checkpoint) -> (Run, first
    iteration)."""
    compiled = compile_wanted(args, world, device)  # before the models load: a refusal comes at once
    stages = [Stage(*stage) for stage in curriculum_stages(args)]
    for stage in stages:
        stage.prompts, stage.metadata = load_prompts(stage.args.prompts)
    eval_prompts, eval_metadata = load_prompts(args.eval_prompts) if args.eval_every else (None, None)
    family = load_family(args, device)
    # every prompt the run will meet, CFG's negative one too, encoded once (the store is reused on resume)
    family.encode_all([p for stage in stages for p in stage.prompts] + (eval_prompts or []) + [family.negative_prompt],
                      os.path.join(args.output_dir, "embeddings.pt"), write=rank == 0)
    try:
        # the reward models in float32 (why: reward.load_reward). Every stage's at start, so that a missing model
        # stops the run now
        loaded = {}
        for spec in [stage.args.reward for stage in stages] + ([args.eval_rewards or args.reward]
                                                               if args.eval_every else []):
            if spec not in loaded:
                loaded[spec] = rewards_lib.load_reward(spec, device)
        for stage in stages:
            stage.reward_fn = loaded[stage.args.reward]
        eval_reward_fn = loaded[args.eval_rewards or args.reward] if args.eval_every else None
    except rewards_lib.RewardError as e:
        raise UsageError(str(e)) from None
    add_trainable_weights(family, args)
    ema_values = resumed_ema(args, family)  # the saved EMA (read through the model before its own weights)
    start = load_trained_weights(args.resume, family, args) if args.resume else 0
    check_ranks_agree(args, family.transformer, world, device)  # before the wrap, which would hide a difference
    if compiled:
        compile_blocks(family)  # each block compiled in place, then sharded or wrapped
    model = wrap_for_training(family, args, world, device)
    params = [p for p in family.transformer.parameters() if p.requires_grad]  # after sharding: the local shards
    # fused on CUDA: one kernel for all parameters instead of a few per tensor (LoRA on SD3.5-M: ~600 tensors)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type) if args.mixed_precision == "fp16" else None
    negative = family.encode([family.negative_prompt]) if family.cfg and args.guidance > 1 else None
    sigmas = family.sigma_grid(args.sample_steps)
    run = Run(args, family, model, optimizer, params, stages[0].reward_fn, stages[0].prompts, stages[0].metadata,
              sigmas, negative, rank, world, device, scaler, eval_prompts, eval_metadata, eval_reward_fn,
              stages=stages, ema=EMA(params, args.ema, ema_values, model) if args.ema else None)
    # after every optimizer step: a step skipped for a NaN leaves the EMA as it is, except under fp16 on CUDA, where
    # the fused AdamW is called with the scaler's found_inf and skips inside (the EMA then moves towards unchanged
    # weights)
    if run.ema is not None:
        optimizer.register_step_post_hook(lambda *_: run.ema.update())
    if args.resume:
        load_training_state(args.resume, run)
    return run, start


# --------------------------------------------------------------------------- tiny models, built in code


def write_byte_tokenizer(directory):
    """A byte-level CLIP tokenizer (no merges): 256 byte symbols, the same with </w>, then the two
    special tokens. Real CLIP vocabularies cannot be downloaded here; this one tokenises any text."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    byte_to_char = {b: chr(b if b in printable else next(extra)) for b in range(256)}  # GPT-2's byte map
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab.update({byte_to_char[b] + "</w>": 256 + b for b in range(256)})
    vocab.update({"<|startoftext|>": 512, "<|endoftext|>": 513})
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")


def tiny_clip_text(with_projection, seed):
    """A byte-level CLIP tokenizer and a CLIP text encoder of width 32 reading 32 tokens, random weights."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    config = CLIPTextConfig(
        vocab_size=514, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, projection_dim=32, bos_token_id=512, eos_token_id=513, pad_token_id=513)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config).eval()
    with tempfile.TemporaryDirectory() as d:
        write_byte_tokenizer(d)
        return CLIPTokenizer.from_pretrained(d, model_max_length=32), encoder


def tiny_vae(scaling_factor, shift_factor):
    """A VAE that downsamples 2x into 4 channels (the real ones: 8x into 16)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=32, scaling_factor=scaling_factor,
        shift_factor=shift_factor).eval()


def build_tiny_sd3_pipeline(seed=0):
    """A small StableDiffusion3Pipeline with random weights, built in code: 32 px images, a VAE that
    downsamples 2x, patch size 1 -> 256 image tokens; 2 MMDiT layers of 4 heads x 16; two CLIP text
    encoders of width 32 reading 32 byte tokens, no T5. Deterministic in `seed`, so every process builds the same
    one."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64,
            pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16).eval()
        vae = tiny_vae(1.5305, 0.0609)
    tokenizer, text_encoder = tiny_clip_text(True, seed + 1)
    tokenizer_2, text_encoder_2 = tiny_clip_text(True, seed + 2)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=None, tokenizer_3=None)


def build_tiny_flux_pipeline(seed=0):
    """A small FluxPipeline with random weights, built in code: 32 px images, a VAE that downsamples 2x,
    2x2 packing -> 64 image tokens of 16 channels; one double- and one single-stream block of 4 heads x 16
    with the guidance embedding (as FLUX.1-dev); a CLIP text encoder of width 32 and a T5 encoder of width
    32 whose character-level tokenizer is built in code (real vocabularies cannot be downloaded here)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6)).eval()
        vae = tiny_vae(0.3611, 0.1159)
        characters = [(chr(c), -1.0) for c in range(32, 127)] + [("▁", -1.0)]
        vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + characters
        t5 = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                     num_heads=4, dropout_rate=0.0)).eval()
    tokenizer, text_encoder = tiny_clip_text(False, seed + 1)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # FLUX.1's config
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=t5, tokenizer_2=T5Tokenizer(vocab=vocab, extra_ids=0), transformer=transformer)


# --------------------------------------------------------------------------- distributed helpers


def setup_distributed(device_arg, timeout_s=600):
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; without them this is a single process.
    Nothing else about distribution leaks into the loop: ranks own whole prompt groups."""
    ddp = "RANK" in os.environ
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) if ddp else (0, 1, 0)
    use_cuda = torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"
    device = torch.device(f"cuda:{local}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if ddp:
        # a bounded timeout: a rank that died or hangs makes the others fail instead of waiting forever
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


def distributed():
    return dist.is_available() and dist.is_initialized()


ATTENTION_KERNELS = ("flash", "efficient", "cudnn", "math")  # torch's scaled_dot_product_attention backends


def default_flags():
    """Each flag's declared default, before any recipe fills in the None ones (for scripts that reuse them)."""
    return {f.name: f.default for f in dataclasses.fields(Args)}


def choose_attention_kernels(kernels):
    """--attention: which of torch's SDPA kernels may run, for the whole process. The flags are global, not a
    context around a forward pass, so they hold wherever attention runs: the rollout, the surrogates, the backward
    and checkpointing's recomputation inside it (on autograd's thread, after any context would have closed), the
    evaluation and the rewards' models. Torch picks the first allowed kernel that supports the inputs."""
    chosen = set(kernels.split(","))
    torch.backends.cuda.enable_flash_sdp("flash" in chosen)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in chosen)
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in chosen)
    torch.backends.cuda.enable_math_sdp("math" in chosen)


def any_rank(flag, world, device):
    """True on every rank if `flag` is true on any rank."""
    if world == 1:
        return bool(flag)
    t = torch.tensor([float(bool(flag))], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def check_ranks_agree(args, transformer, world, device):
    """Before the DDP wrap: every rank must run the same configuration from the same weights, else one line and
    exit (after the wrap every rank would silently train rank 0's weights, while its own model files differ)."""
    if world == 1:
        return
    config = json.dumps(dataclasses.asdict(args), sort_keys=True).encode()
    digest = int.from_bytes(hashlib.blake2b(config, digest_size=7).digest(), "little")
    weights = torch.stack([p.detach().double().sum() for p in transformer.parameters()]).sum()
    mine = torch.tensor([float(digest), weights.item()], dtype=torch.float64, device=device)
    everyone = all_gather_cat(mine.unsqueeze(0), world)
    for rank, other in enumerate(everyone):
        if other[0] != everyone[0][0]:
            raise FatalError(f"rank {rank} runs a different configuration than rank 0: launch every node with the "
                             "same flags")
        if other[1] != everyone[0][1]:
            raise FatalError(f"rank {rank} starts from different weights than rank 0 (model files differ between "
                             "nodes?)")


def all_gather_cat(t, world):
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def reduce_stats(stats, world, device):
    """Average per-rank statistics over ranks (all ranks hold equally many samples); min/max for extremes."""
    if world == 1:
        return stats
    keys = sorted(stats)
    out = {}
    for op, post in ((dist.ReduceOp.SUM, lambda x: x / world), (dist.ReduceOp.MIN, None), (dist.ReduceOp.MAX, None)):
        t = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        out[op] = dict(zip(keys, (post(t) if post else t).tolist()))
    extremes = {"ratio_min": dist.ReduceOp.MIN, "ratio_max": dist.ReduceOp.MAX}
    return {k: out[extremes.get(k, dist.ReduceOp.SUM)][k] for k in keys}


def gradient_sync(model, enabled):
    """DDP and FSDP2 average (or reduce-scatter) gradients over ranks during backward; with accumulation over
    micro-batches only the last of a step should."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "no_sync") and not enabled:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- checkpoints


def trained_weights(run):
    """The trained weights as full CPU tensors on rank 0 ({} elsewhere): the LoRA's, or every weight and buffer
    with full fine-tuning. Under FSDP every rank takes part and each sharded tensor is gathered alone, so no
    second full copy of the model is ever held on a GPU."""
    full = {}
    for name, value in run.family.transformer.state_dict().items():
        if not run.args.full_finetune and "lora_" not in name:
            continue
        if hasattr(value, "full_tensor"):  # a DTensor shard: gathered from every rank
            value = value.full_tensor()
        if run.rank == 0:
            full[name] = value.detach().cpu()
    return full


def save_checkpoint(run, iteration):
    """OUTPUT/checkpoint-N/: LoRA (pytorch_lora_weights.safetensors, loadable by pipe.load_lora_weights) or the
    full transformer (transformer/, loadable by from_pretrained), the optimizer state (optimizer.pt, or one shard
    per rank under optimizer/ with FSDP) and the step. Every rank calls it; rank 0 writes all but the optimizer
    shards. Written to a .tmp folder, then renamed, so a save cut short is never taken for a checkpoint."""
    args, family, master = run.args, run.family, run.rank == 0
    final = os.path.join(args.output_dir, f"checkpoint-{iteration}")
    tmp = final + ".tmp"
    weights = trained_weights(run)
    if master and not all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point()):
        raise FatalError(f"refusing to save non-finite weights at iteration {iteration}")
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if master:
        write_weights(family, args, weights, tmp)
    if run.ema is not None:  # the EMA in the same format, in ema/ (every rank: FSDP gathers), written while in place
        with run.ema.swapped_in():  # (on the CPU trained_weights' tensors are the weights themselves, not copies)
            ema_weights = trained_weights(run)
            if master:
                write_weights(family, args, ema_weights, os.path.join(tmp, "ema"))
    if args.fsdp:  # each rank writes its own shard of the AdamW states (torch.distributed.checkpoint)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if run.world > 1:
            dist.barrier()  # the folder exists before anyone writes into it
        dcp.save(get_optimizer_state_dict(run.model, run.optimizer), checkpoint_id=os.path.join(tmp, "optimizer"))
    elif master:
        torch.save(run.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    if not master:
        return final
    if run.scaler is not None:  # fp16's loss scale: part of the state a resumed run must continue from
        torch.save(run.scaler.state_dict(), os.path.join(tmp, "scaler.pt"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({"iteration": iteration, "args": dataclasses.asdict(args), "world_size": run.world}, f, indent=1)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    prune_checkpoints(args.output_dir, args.keep_last)
    return final


def write_weights(family, args, weights, directory):
    """The trained weights as the pipelines load them: LoRA (pytorch_lora_weights.safetensors, pipe.load_lora_weights)
    or the full transformer (transformer/, from_pretrained)."""
    if args.full_finetune:
        from huggingface_hub import save_torch_state_dict

        family.transformer.save_config(os.path.join(directory, "transformer"))
        save_torch_state_dict(weights, os.path.join(directory, "transformer"), max_shard_size="10GB",
                              filename_pattern="diffusion_pytorch_model{suffix}.safetensors")
    else:
        from peft.utils import get_peft_model_state_dict

        os.makedirs(directory, exist_ok=True)
        family.save_lora(directory, get_peft_model_state_dict(family.transformer, state_dict=weights),
                         family.transformer.peft_config["default"].to_dict())


class EMA:
    """--ema: an exponential moving average of the trained weights, e <- decay e + (1 - decay) w after every optimizer
    step, in float32 (the trained weights' dtype). Under --fsdp each rank averages its own shards (DTensors), so the
    EMA is sharded like the weights."""

    def __init__(self, params, decay, initial=None, model=None):
        self.params, self.decay, self.model = params, decay, model
        if initial is None:
            self.shadow = [p.detach().clone() for p in params]
        else:  # from a checkpoint: full tensors, sharded like the weights under FSDP
            self.shadow = [like(p, v) for p, v in zip(params, initial)]

    @torch.no_grad()
    def update(self):
        for e, w in zip(self.shadow, self.params):
            e.lerp_(w.detach(), 1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        """The EMA in the trained weights' place while the block runs, the trained weights back after it (kept on the
        host, except FSDP's shards). FSDP2 leaves the root's own weights unsharded after a forward: resharding it
        first makes the copies reach what the next forward gathers."""
        with torch.no_grad():
            self.reshard()
            kept = [p.detach().clone() if hasattr(p, "device_mesh") else p.detach().to("cpu", copy=True)
                    for p in self.params]
            for p, e in zip(self.params, self.shadow):
                p.copy_(e)
        try:
            yield
        finally:
            with torch.no_grad():
                self.reshard()
                for p, k in zip(self.params, kept):
                    p.copy_(k)

    def reshard(self):
        if hasattr(self.model, "reshard"):  # an FSDP2 module
            self.model.reshard()


def like(param, full):
    """A full tensor placed as `param` is: its shard where param is a DTensor (FSDP), else a copy on its device."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh, param.placements)
    return full.to(param.device, param.dtype).clone()


def resumed_ema(args, family):
    """With --ema and --resume: the EMA saved in the checkpoint's ema/ (read into the model, which the checkpoint's
    own weights then overwrite), as full tensors in the trained weights' order; None when starting fresh."""
    directory = os.path.join(args.resume, "ema") if args.resume else ""
    if not args.ema or not directory:   # (validate refused an --ema resume from a checkpoint without ema/)
        return None
    load_weights(directory, family, args)
    return [p.detach().clone() for p in family.transformer.parameters() if p.requires_grad]


def complete_checkpoints(output_dir):
    """checkpoint-N folders that were fully written (renamed from .tmp, state.json inside), oldest first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isfile(os.path.join(output_dir, name, "state.json")):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir):
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def prune_checkpoints(output_dir, keep_last):
    for path in complete_checkpoints(output_dir)[:-keep_last] if keep_last else []:
        shutil.rmtree(path)


def load_trained_weights(directory, family, args):
    """Restore the trained weights from save_checkpoint's folder, before any wrapping; -> the iteration saved."""
    load_weights(directory, family, args)
    with open(os.path.join(directory, "state.json")) as f:
        return json.load(f)["iteration"]


def load_weights(directory, family, args):
    """write_weights' folder (a checkpoint, or its ema/) into the transformer, before any wrapping."""
    from safetensors.torch import load_file

    if args.full_finetune:
        trained = type(family.transformer).from_pretrained(os.path.join(directory, "transformer"))
        family.transformer.load_state_dict(trained.state_dict())
    else:
        from peft import set_peft_model_state_dict

        lora_file = os.path.join(directory, "pytorch_lora_weights.safetensors")
        if not os.path.isfile(lora_file):
            raise UsageError(f"--resume {directory}: no {os.path.basename(lora_file)} (was it a --full-finetune run?)")
        state = {k.removeprefix("transformer."): v for k, v in load_file(lora_file).items()}
        result = set_peft_model_state_dict(family.transformer, state)
        if getattr(result, "unexpected_keys", None):
            raise UsageError(f"--resume {directory}: LoRA does not fit this model ({result.unexpected_keys[0]}, ...)")


def load_training_state(directory, run):
    """Restore AdamW (and fp16's loss scale) into the optimizer built over the wrapped model. FSDP's sharded
    states are resharded by torch.distributed.checkpoint, so a resume may use another number of processes. The
    learning rate and weight decay are this launch's flags: a resume may change them."""
    if run.args.fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = get_optimizer_state_dict(run.model, run.optimizer)
        dcp.load(state, checkpoint_id=os.path.join(directory, "optimizer"))
        set_optimizer_state_dict(run.model, run.optimizer, state)
    else:
        run.optimizer.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt"), map_location=run.device,
                                                 weights_only=True))
    for group in run.optimizer.param_groups:  # this launch's --lr and --weight-decay, not the checkpoint's
        group["lr"], group["weight_decay"] = run.args.lr, run.args.weight_decay
    if run.scaler is not None and os.path.isfile(os.path.join(directory, "scaler.pt")):
        run.scaler.load_state_dict(torch.load(os.path.join(directory, "scaler.pt"), weights_only=True))


# --------------------------------------------------------------------------- metrics, evaluation, pictures and trackers


def iteration_metrics(run, it, stats, r, A):
    """Global metrics of one iteration (rewards and advantages gathered, the rest reduced over ranks)."""
    G = run.args.group_size
    r_all, A_all = all_gather_cat(r, run.world).float(), all_gather_cat(A, run.world).float()
    groups = r_all.view(-1, G)
    m = {"iteration": it + 1, "reward_mean": r_all.mean().item(), "reward_std": r_all.std(unbiased=False).item(),
         "reward_group_std": groups.std(1, unbiased=False).mean().item(),
         "zero_adv_groups": (A_all.view(-1, G) == 0).all(1).float().mean().item(),
         "flat_groups": flat_group_share(groups),
         "adv_mean": A_all.mean().item(), "adv_std": A_all.std(unbiased=False).item(),
         "adv_abs_max": A_all.abs().max().item()}
    m.update(reduce_stats(stats, run.world, run.device))
    if len(run.stages) > 1:  # the curriculum's stage, 1-based
        m["stage"] = next(k for k, s in enumerate(run.stages, 1) if s.start <= it < s.end)
    m["state_mb"] = state_bytes(run) / 2**20
    if run.device.type == "cuda":  # this process's peak since the last iteration (bench/results/memory.md's rows)
        m["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
        torch.cuda.reset_peak_memory_stats(run.device)
    m["time_total"] = sum(m[k] for k in ("time_rollout", "time_reward", "time_old", "time_update"))
    if run.family.compiled:  # frames compiled so far, and the seconds it took: they grow while shapes are new
        m["compiled_graphs"], m["compile_s"] = compiled_graphs(), compile_seconds()
    return m


def flat_group_share(groups):
    """The share of groups (P, G) whose rewards are (nearly) equal, their std at most 0.1% of their mean's size: a
    saturated reward, whose advantages are noise scaled up to unit size (or exactly 0 where all are equal)."""
    return (groups.std(1, unbiased=False) <= 1e-3 * groups.mean(1).abs()).float().mean().item()


def score(reward_fn, images, prompts, metadata, what=""):
    """The reward of each image; a reward that fails (a server down, a wrong shape) is one line, not a traceback."""
    try:
        return reward_fn(images, prompts, metadata)
    except rewards_lib.RewardError as e:
        raise FatalError(f"{what}{e}") from None


def any_nonfinite(run, it, r, A):
    """True on every rank when any rank's rewards or advantages hold a NaN or Inf; such a rank names the reward."""
    bad = not bool(torch.isfinite(r).all() & torch.isfinite(A).all())  # one device-to-host sync, not two
    if bad:
        names = ", ".join(getattr(run.reward_fn, "nonfinite", [])) or "the reward"
        print(f"vgrpo: rank {run.rank}, iteration {it + 1}: non-finite values from {names}; update skipped",
              file=sys.stderr, flush=True)
    return any_rank(bad, run.world, run.device)


def reward_metrics(run):
    """Each reward's batch mean when there are several, what the rewards counted (UnifiedReward's answers without a
    score), and fp16's loss scale."""
    fn, out = run.reward_fn, {}
    if len(fn.parts) > 1:
        out = {f"reward_{rewards_lib.metric_name(k)}": v.mean().item() for k, v in fn.last_parts.items()}
    out.update({f"reward_{k}": v for k, v in fn.last_counts.items()})
    if run.scaler:
        out["loss_scale"] = run.scaler.get_scale()
    return out


class PhaseTimer:
    """Wall-clock seconds per phase of an iteration: `with timer("rollout"):` adds to time_rollout. On CUDA a phase
    ends when the GPU has done its work: kernels run after the host queues them, and a phase's tail would otherwise
    count in the next phase that waits for a result (the rollout's in the reward's)."""

    def __init__(self, device):
        self.seconds, self.device = dict.fromkeys(("rollout", "reward", "old", "update"), 0.0), device

    @contextlib.contextmanager
    def __call__(self, phase):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[phase] += time.perf_counter() - start

    def stats(self):
        return {f"time_{phase}": seconds for phase, seconds in self.seconds.items()}


SKIPPED_STATS = {k: float("nan") for k in ("policy_loss", "kl", "clip_frac", "ratio_mean", "ratio_min", "ratio_max",
                                           "grad_norm")}


def state_bytes(run):
    """This process's bytes of transformer weights and AdamW states: the local shards under FSDP."""
    tensors = [*run.family.transformer.parameters(),
               *(t for s in run.optimizer.state.values() for t in s.values() if torch.is_tensor(t))]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # a DTensor's shard on this rank
    return sum(t.numel() * t.element_size() for t in local)


def log_line(m, total):
    return (f"it {m['iteration']:5d}/{total} | reward {m['reward_mean']:+.5f} ± {m['reward_std']:.5f} "
            f"flat {m['flat_groups']:.2f} | ratio [{m['ratio_min']:.4f}, {m['ratio_max']:.4f}] "
            f"clip {m['clip_frac']:.3f} | kl {m['kl']:.2e} | gnorm {m['grad_norm']:.3f} | {m['time_total']:.2f}s "
            f"(roll {m['time_rollout']:.2f} rew {m['time_reward']:.2f} old {m['time_old']:.2f} "
            f"upd {m['time_update']:.2f})")


def describe(run, start):
    a, n_params = run.args, sum(p.numel() for p in run.params)
    per_rank = run.n_prompts * a.group_size
    minibatch = per_rank // a.inner_steps
    return "\n".join([
        f"vgrpo: model {a.model} ({run.family.latent_shape} latents, {run.family.image_tokens} image tokens), "
        f"reward {a.reward}, {'full fine-tuning' if a.full_finetune else f'LoRA r={a.lora_rank} alpha={a.lora_alpha}'}"
        f" ({n_params:,} trainable), {a.sampler} x {a.sample_steps} steps, device {run.device}",
        f"batch: {a.prompts_per_step} prompts x {a.group_size} images = {a.prompts_per_step * a.group_size} "
        f"samples per iteration over {run.world} process(es) -> {run.n_prompts} prompt group(s) = {per_rank} "
        "samples each",
        f"update: {a.inner_steps} optimizer step(s) per iteration of {minibatch * run.world} samples "
        f"({minibatch} per process, micro-batches of {a.micro_batch} x {a.n_mc} pairs = "
        f"{a.micro_batch * a.n_mc} rows per forward, {minibatch // a.micro_batch} accumulated)",
        f"precision: {a.mixed_precision if a.mixed_precision != 'no' else 'float32'} matmuls, float32 surrogate and "
        f"trained weights{', gradient checkpointing' if a.gradient_checkpointing else ''}"
        f"{', text encoders offloaded to the CPU' if run.family.offload else ''}"
        f"{', blocks compiled (torch.compile: the first iteration compiles)' if run.family.compiled else ''}",
        f"iterations {start + 1}..{a.iterations}, output in {a.output_dir}"
        + (f", resumed from {a.resume}" if a.resume else "")
        + (f"; evaluation of {len(run.eval_prompts)} prompts x {a.eval_images} every {a.eval_every} iterations with "
           f"{a.eval_rewards or a.reward}" if a.eval_every else ""),
    ])


def announce(args):
    """Rank 0 at start: the output folders, the resolved configuration (printed and in config.json)."""
    os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)
    print(f"vgrpo: config{f' (preset {args.preset})' if args.preset else ''}: {command_line(args)}", flush=True)
    if os.path.abspath(args.prompts) == TRAIN_PROMPTS:
        print(f"vgrpo: no --prompts given: training on the {len(load_prompts(args.prompts)[0])} varied prompts of "
              f"{args.prompts}. The paper trains on Pick-a-Pic (PickScore), HPDv2 (FLUX, HPSv2), "
              "GenEval and OCR prompt sets: pass yours with --prompts FILE.txt (a prompt per line) or FILE.jsonl "
              "(with metadata)", flush=True)
    with open(os.path.join(args.output_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=1)
    print(f"vgrpo: loading model '{args.model}' and reward '{args.reward}' ...", flush=True)


def quiet_libraries():
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()  # per-prompt truncation notices would drown the log
    transformers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()  # loading bars per component: one "loading" line says it
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")  # bf16 norms on CPU
    # FSDP2 warns that the transformer returns a view; nothing here modifies a model output in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def install_stop_handlers():
    """SIGTERM (cluster preemption) and SIGINT ask the loop to checkpoint and stop after the current
    iteration; a second signal stops at once."""
    requested = []

    def handler(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(signal.Signals(signum).name)
        print(f"vgrpo: {requested[0]} received: saving a checkpoint after this iteration (again to quit now)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return requested


def record(run, m, samples, first, last):
    """Rank 0 after an iteration: its metrics line, the progress line, a grid of its samples (images, prompts,
    rewards) every --sample-every iterations, at the first and the last, and the reward curves."""
    args, done = run.args, m["iteration"]
    with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(m) + "\n")
    print(log_line(m, args.iterations), flush=True)
    grid = {}
    if first or done % args.sample_every == 0 or last:
        grid["samples"] = os.path.join(args.output_dir, "samples", f"iter-{done:05d}.png")
        images, prompts, r = samples
        save_sample_grid(grid["samples"], images, prompts, r.cpu(), args.group_size)
    if run.trackers:
        run.trackers.log(m, done, images=grid)
    if done % args.sample_every == 0 or last:
        write_curves(args.output_dir)


def log_evaluation(run, done):
    """Evaluate after `done` iterations (every rank); rank 0 appends to eval.jsonl, prints a line, saves a picture.
    With --ema the evaluation runs the EMA weights."""
    with run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext():
        m, images, prompts, r = evaluate(run, done)
    if run.rank == 0:
        with open(os.path.join(run.args.output_dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")
        overall = {k: v for k, v in m.items() if k != "iteration" and "/" not in k}
        by_tag = {k.partition("/")[2]: v for k, v in m.items() if "/" in k and not k.startswith("eval_diversity")}
        print(f"eval {done:5d}/{run.args.iterations} | " + " | ".join(f"{k.removeprefix('eval_')} {v:+.4f}"
              for k, v in overall.items()) + (f" | by tag: {' '.join(f'{t} {v:.2f}' for t, v in by_tag.items())}"
                                                if by_tag else ""), flush=True)
        path = os.path.join(run.args.output_dir, "samples", f"eval-{done:05d}.png")
        if images is not None:
            save_sample_grid(path, images, prompts, r, run.args.eval_images, max_groups=10)
        if run.trackers:
            run.trackers.log(m, done, images={"eval_samples": path} if images is not None else {})


@torch.no_grad()
def evaluate(run, done):
    """Deterministic evaluation on the held-out prompts after `done` iterations: the same noises every time (keyed by
    prompt and image, never by iteration or --seed, so runs are comparable), the ODE sampler, rewards that may differ
    from the training reward (so reward hacking shows: training reward up, held-out rewards down). Ranks take every
    world-th prompt; sums are reduced. The first reward is also averaged per value of the prompts' "tag" metadata
    (eval_NAME/TAG: per digit, per GenEval task), where a collapse onto a few of them shows; so is the diversity of
    each prompt's images (eval_diversity, in pixels, and in a CLIP reward's embedding where one is evaluated), which
    falls when a prompt's images turn into one picture.
    -> (metrics, images, prompts, first reward) of this rank's first 10 prompts, for the picture."""
    args, fn = run.args, run.eval_reward_fn
    local = [(i, k) for i in range(run.rank, len(run.eval_prompts), run.world) for k in range(args.eval_images)]
    names = [name for name, _, _ in fn.parts]
    tally = EvalTally(names, [md.get("tag") for md in run.eval_metadata], args.eval_images, fn.counts)
    pictured = []                                                      # (images, prompts, rewards) for the grid
    for start in range(0, len(local), args.sample_batch):
        chunk = local[start:start + args.sample_batch]
        prompts = [run.eval_prompts[i] for i, _ in chunk]
        _, _, images = generate(run, prompts, [("eval", i, k) for i, k in chunk])
        total = score(fn, images, prompts, [run.eval_metadata[i] for i, _ in chunk], what="evaluation: ")
        tally.add(chunk, images, fn.last_parts, total, image_features(fn), fn.last_counts)
        if sum(len(p) for _, p, _ in pictured) < 10 * args.eval_images:
            pictured.append((images.cpu(), prompts, fn.last_parts[names[0]].float()))
    if args.fsdp:  # FSDP gathers weights in every forward: each rank runs as many passes as the busiest one
        family, busiest = run.family, math.ceil(len(run.eval_prompts) / run.world) * args.eval_images
        for _ in range(math.ceil(len(local) / args.sample_batch), math.ceil(busiest / args.sample_batch)):
            rollout(family, family.transformer, family.encode(run.eval_prompts[:1]),
                    torch.zeros(1, *family.latent_shape, device=run.device), run.sigmas, args, run.negative)
    objective = len(names) > 1 and (args.eval_rewards or args.reward) == args.reward  # the training reward, held out
    m = {"iteration": done, **tally.metrics(run.world, run.device, objective)}
    if not pictured:
        return m, None, [], None
    images, prompts, rewards = zip(*pictured)
    return m, torch.cat(images), sum(prompts, []), torch.cat(rewards)


def image_features(reward_fn):
    """The image embeddings a CLIP-family part of the reward computed in its last call (None without one)."""
    return next((f.last_image_features for _, _, f in reward_fn.parts if hasattr(f, "last_image_features")), None)


class EvalTally:
    """The evaluation's sums, made on each rank and reduced once: every reward and the weighted total per image,
    what the rewards count per image (`counts`: UnifiedReward's share of answers without a score, scored 0), the
    first reward per tag, and per prompt the diversity of its images (pixel_diversity, and embedding_diversity of the
    CLIP features when the reward has them), overall and per tag."""

    def __init__(self, names, tag_of, images_per_prompt, counts=()):
        self.names, self.images_per_prompt, self.counts = names, images_per_prompt, list(counts)
        self.tag_of = [str(t) if t is not None else None for t in tag_of]
        self.tags = list(dict.fromkeys(t for t in self.tag_of if t is not None))
        # each reward, each count, the total, the images
        self.rewards = torch.zeros(len(names) + len(self.counts) + 2, dtype=torch.float64)
        # rows: first reward's sum, its images, pixel diversity's sum, embedding diversity's sum, prompts; columns:
        # the tags, then every prompt
        self.by_tag = torch.zeros(5, len(self.tags) + 1, dtype=torch.float64)
        self.pending, self.embedded = {}, False

    def add(self, chunk, images, parts, total, features, counts=None):
        first = parts[self.names[0]].double()
        self.rewards += torch.tensor([*(parts[n].double().sum().item() for n in self.names),
                                      *(counts[c] * len(chunk) for c in self.counts),   # shares of this chunk
                                      total.double().sum().item(), len(chunk)], dtype=torch.float64)
        for j, (i, _) in enumerate(chunk):
            columns = [self.tags.index(self.tag_of[i])] if self.tag_of[i] is not None else []
            self.by_tag[:2, columns] += torch.tensor([[first[j].item()], [1.0]], dtype=torch.float64)
            if self.images_per_prompt < 2:  # one image per prompt: no pairs, nothing to keep
                continue
            mine = self.pending.setdefault(i, [])
            mine.append((images[j], None if features is None else features[j]))
            if len(mine) == self.images_per_prompt:  # the prompt's images are all here
                pixels, embedded = torch.stack([x for x, _ in mine]), [e for _, e in mine]
                d = embedding_diversity(torch.stack(embedded)) if embedded[0] is not None else 0.0
                self.embedded |= embedded[0] is not None
                self.by_tag[2:, columns + [-1]] += torch.tensor([[pixel_diversity(pixels)], [d], [1.0]],
                                                                 dtype=torch.float64)
                del self.pending[i]

    def metrics(self, world, device, objective=False):
        """-> eval_NAME per reward, eval_COUNT per count (a share of the images), eval_reward (the weighted total,
        when `objective`), eval_FIRST/TAG and its mean_of_tags, eval_diversity (and /TAG) and eval_diversity_clip."""
        sums = torch.cat([self.rewards, self.by_tag.flatten(), torch.tensor([float(self.embedded)])])
        if world > 1:
            sums = sums.to(device)
            dist.all_reduce(sums)
        sums = sums.cpu()
        rewards, by_tag = sums[:len(self.rewards)], sums[len(self.rewards):-1].view(5, -1)
        means = (rewards[:-1] / rewards[-1].clamp_min(1)).tolist()
        first = rewards_lib.metric_name(self.names[0])
        m = {f"eval_{rewards_lib.metric_name(n)}": v for n, v in zip(self.names, means)}
        m.update({f"eval_{c}": v for c, v in zip(self.counts, means[len(self.names):])})
        if objective:
            m["eval_reward"] = means[-1]
        per_tag = {t: by_tag[:, k].tolist() for k, t in enumerate(self.tags)}
        m.update({f"eval_{first}/{t}": v[0] / v[1] for t, v in per_tag.items()})
        if self.tags:  # GenEval's overall score: the mean over its tasks, whatever their sizes
            m[f"eval_{first}/mean_of_tags"] = sum(m[f"eval_{first}/{t}"] for t in self.tags) / len(self.tags)
        if by_tag[4, -1] > 0:  # prompts with two images or more
            m["eval_diversity"] = (by_tag[2, -1] / by_tag[4, -1]).item()
            m.update({f"eval_diversity/{t}": v[2] / v[4] for t, v in per_tag.items() if v[4]})
            if sums[-1] > 0:
                m["eval_diversity_clip"] = (by_tag[3, -1] / by_tag[4, -1]).item()
        return m


def pixel_diversity(images):
    """How different n images of one prompt are: the mean over their pairs of the RMS pixel difference, on the uint8
    pictures the rewards see (images in [0, 1]: 0 when all are the same picture, about 0.4 for independent uniform
    noise). The rounding keeps it independent of batch sizes and process counts, whose float noise it removes."""
    flat = (images.float().clamp(0, 1) * 255).round().flatten(1) / 255
    n = len(flat)
    distances = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist")  # exact zeros for equal images
    return (distances.sum() / (n * (n - 1)) / flat.shape[1] ** 0.5).item()


def embedding_diversity(features):
    """The mean over pairs of 1 - cosine similarity of n image embeddings: 0 when all embed alike."""
    f = torch.nn.functional.normalize(features.float(), dim=-1)
    n = len(f)
    return ((n * n - (f @ f.T).sum()) / (n * (n - 1))).item()


def summarize(output_dir, history):
    """The training reward's first and last iterations, and the held-out evaluation before and after."""
    if len(history) >= 2:
        k = min(10, len(history) // 2)
        print(f"vgrpo: done. mean reward of the first {k} iterations {sum(history[:k]) / k:+.5f}, "
              f"of the last {k} {sum(history[-k:]) / k:+.5f}", flush=True)
    evals = read_jsonl(os.path.join(output_dir, "eval.jsonl"))
    if len(evals) >= 2:
        before, after = evals[0], evals[-1]
        print(f"vgrpo: held-out, iteration {before['iteration']} -> {after['iteration']}: " + ", ".join(
            f"{k.removeprefix('eval_')} {before[k]:.4f} -> {after[k]:.4f}" for k in after if k.startswith("eval_")
            and "/" not in k and k in before), flush=True)
    png = write_curves(output_dir)
    print(f"vgrpo: reward curves in {os.path.join(output_dir, 'rewards.csv')}"
          + (f" and {png}" if png else " (pip install matplotlib for rewards.png)"), flush=True)


def trim_metrics(path, start):
    """On resume, drop logged iterations after the checkpoint (a run that died later logged them)."""
    if not os.path.exists(path):
        return
    with open(path) as f:  # a fresh run (start 0) drops everything, the old evaluation at iteration 0 too
        keep = [line for line in f if start and line.strip() and json.loads(line)["iteration"] <= start]
    with open(path, "w") as f:
        f.writelines(keep)


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_curves(output_dir):
    """rewards.csv (always) and rewards.png (when matplotlib is installed): the training reward and every
    evaluation reward against the iteration. Returns the PNG's path, or None without matplotlib."""
    import csv

    rows = {}
    for m in read_jsonl(os.path.join(output_dir, "metrics.jsonl")) + read_jsonl(os.path.join(output_dir, "eval.jsonl")):
        rows.setdefault(m["iteration"], {}).update({k: v for k, v in m.items() if k.startswith(("reward", "eval_"))})
    columns = sorted({k for r in rows.values() for k in r},
                     key=lambda k: (k.startswith("eval_"), k not in ("reward_mean", "eval_reward"), k))
    with open(os.path.join(output_dir, "rewards.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["iteration", *columns])
        for it in sorted(rows):
            w.writerow([it, *(rows[it].get(k, "") for k in columns)])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    try:  # a picture must never stop a long run
        return plot_curves(plt, rows, columns, os.path.join(output_dir, "rewards.png"))
    except Exception as e:
        print(f"vgrpo: could not draw rewards.png ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return None


def plot_curves(plt, rows, columns, path):
    """One panel per reward curve; an evaluation reward broken down by tag is one panel with a line per tag."""
    single = [k for k in columns if "/" not in k and (k == "reward_mean" or k.startswith("eval_") or
              (k.startswith("reward_") and k not in ("reward_std", "reward_group_std")))]
    tagged = collections.defaultdict(list)
    for k in sorted(columns, key=lambda k: k.endswith("/mean_of_tags")):  # the mean last, in the legend too
        if "/" in k:
            tagged[k.partition("/")[0]].append(k)
    panels = ([[k] for k in single] + list(tagged.values()))[:8]
    if not panels:
        return None
    cols = min(4, len(panels))
    rows_ = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(3.6 * cols, 3.0 * rows_), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, keys in zip(axes.flat, panels):
        for key in keys:
            its = [it for it in sorted(rows) if rows[it].get(key) is not None and math.isfinite(rows[it][key])]
            values = [rows[it][key] for it in its]
            held_out = key.startswith("eval_")
            if len(keys) > 1:  # one line per tag
                ax.plot(its, values, marker="o", ms=2, label=key.partition("/")[2], **tag_line_styles(keys)[key])
                continue
            ax.plot(its, values, "o-" if held_out else "-", color="tab:orange" if held_out else "tab:blue",
                    alpha=1.0 if held_out else 0.35, lw=1.2, ms=3)
            if not held_out and len(values) >= 5:  # a 5-iteration moving average over the noisy per-batch mean
                smooth = [sum(values[max(0, i - 4):i + 1]) / len(values[max(0, i - 4):i + 1])
                          for i in range(len(values))]
                ax.plot(its, smooth, color="tab:blue", lw=1.8)
        name = keys[0].partition("/")[0]
        ax.set_title(("held-out " if name.startswith("eval_") else "training ") + name.removeprefix("eval_")
                     .removeprefix("reward_").replace("mean", "reward") + (" by tag" if len(keys) > 1 else ""),
                     fontsize=9)
        if len(keys) > 1:
            ax.legend(fontsize=5, ncol=2)
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


TAB10 = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
         "tab:olive", "tab:cyan")


def tag_line_styles(keys):
    """Each tag's line in a per-tag panel: tab10's ten colours, solid, then dashed, dotted and dash-dotted for the
    tags after the tenth, so no two tags look alike; the mean over the tags thick and black."""
    styles, tags = {}, [k for k in keys if not k.endswith("/mean_of_tags")]
    for j, key in enumerate(tags):
        styles[key] = dict(color=TAB10[j % 10], ls=("-", "--", ":", "-.")[j // 10 % 4], lw=1.0)
    styles.update({k: dict(color="black", ls="-", lw=2.4) for k in keys if k not in styles})
    return styles


def save_sample_grid(path, images, prompts, rewards, group_size, max_groups=4, max_members=8):
    """A PNG: one row per prompt group (its prompt on top), each image with its reward underneath."""
    from PIL import Image, ImageDraw

    groups, cols = min(len(images) // group_size, max_groups), min(group_size, max_members)
    side = max(128, images.shape[-1])
    head, foot = 14, 12
    grid = Image.new("RGB", (cols * side, groups * (head + side + foot)), "white")
    draw = ImageDraw.Draw(grid)
    pictures = rewards_lib.to_uint8_images(images)
    for g in range(groups):
        top = g * (head + side + foot)
        draw.text((2, top + 1), prompts[g * group_size][:cols * side // 6], fill="black")
        for m in range(cols):
            i = g * group_size + m
            grid.paste(pictures[i].resize((side, side), Image.NEAREST), (m * side, top + head))
            draw.text((m * side + 2, top + head + side), f"{rewards[i].item():.4g}", fill="black")
    grid.save(path)


class Trackers:
    """--report-to: each iteration's and evaluation's metrics, the sample grids and the resolved configuration, also
    sent to TensorBoard (OUTPUT/tensorboard) and / or Weights & Biases (OUTPUT/wandb; project from WANDB_PROJECT,
    default vgrpo). Rank 0 only; metrics.jsonl stays the record a resume trims and the plots read."""

    def __init__(self, args):
        names = args.report_to.split(",")
        self.tensorboard = self.wandb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(args.output_dir, "tensorboard"))
            self.tensorboard.add_text("config", command_line(args))
        if "wandb" in names:
            import wandb

            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "vgrpo"), dir=args.output_dir,
                                    name=os.path.basename(os.path.abspath(args.output_dir)),
                                    config=dataclasses.asdict(args))

    def log(self, metrics, step, images=None):
        scalars = {k: v for k, v in metrics.items() if k != "iteration" and math.isfinite(v)}
        if self.tensorboard:
            import numpy as np
            from PIL import Image

            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, step)
            for name, path in (images or {}).items():
                self.tensorboard.add_image(name, np.asarray(Image.open(path)), step, dataformats="HWC")
            self.tensorboard.flush()
        if self.wandb:
            import wandb

            self.wandb.log({**scalars, **{name: wandb.Image(path) for name, path in (images or {}).items()}}, step=step)

    def close(self):
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


if __name__ == "__main__":
    try:
        main()
    except FatalError as e:
        where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
        print(f"vgrpo: error{where}: {e}", file=sys.stderr, flush=True)
        if "RANK" in os.environ:
            os._exit(e.exit_code)  # do not wait in collectives for ranks that may not fail
        sys.exit(e.exit_code)
    except Exception:
        if "RANK" not in os.environ:
            raise
        # one rank failed (a reward that raises, an OOM): print the original error and leave at once, so the
        # launcher stops the other ranks instead of letting them wait in a collective
        import traceback

        traceback.print_exc()
        print(f"vgrpo: rank {os.environ['RANK']} failed; stopping every rank", file=sys.stderr, flush=True)
        os._exit(1)
