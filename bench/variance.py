"""Surrogate variance (item 1 of the benchmark): how much each variance reduction of V-GRPO removes.

On the same rollouts of the pretrained digits model (the CPU demo's: a generator that follows its prompts partly,
as the paper's SD3.5-M does), the ELBO surrogate s(o) is recomputed under R independent pair
draws for five settings: naive (independent uniform pairs, plain MSE, FPO-style), then each reduction
alone (group-shared pairs, stratified sigmas, adaptive weighting), then all three. Two statistics:

  cv        mean over samples of std_r s(o) / |mean_r s(o)|: the surrogate's own noise (paper: 0.230 -> 0.128)
  group_cv  mean over draws and groups of std_members s / |mean_members s|: how much of the spread
            inside a group is pair noise rather than a difference between images (paper: 0.170 -> 0.038)

    python bench/variance.py                  # 3 seeds, writes bench/results/variance.md
    python bench/variance.py --quick          # seconds, for the test
"""

import argparse
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import learning  # noqa: E402  (the models, loaded as vgrpo loads them)
import vgrpo  # noqa: E402

SETTINGS = {  # name: (pair sharing, stratified, weighting)
    "naive (FPO-style)": ("none", False, "none"),
    "+ group-shared pairs": ("group", False, "none"),
    "+ stratified sigmas": ("none", True, "none"),
    "+ adaptive weighting": ("none", False, "adaptive"),
    "all three (V-GRPO)": ("group", True, "adaptive"),
}


@torch.no_grad()
def measure(family, o, cond, sigmas, group_size, draws, n_mc, seed):
    ids = [(i // group_size, i % group_size) for i in range(len(o))]
    out = {}
    for name, (sharing, stratified, weighting) in SETTINGS.items():
        s = []
        for r in range(draws):
            sig, eps = vgrpo.draw_pairs(sigmas, n_mc, family.latent_shape, ids, sharing, stratified, seed, 1000 + r)
            s.append(torch.cat([vgrpo.surrogate(family, family.transformer, o[idx], sig[idx], eps[idx],
                                                vgrpo.rows_of(cond, idx), weighting)[0]
                                for idx in torch.arange(len(o)).split(16)]))
        s = torch.stack(s)                                             # (R, B)
        cv = (s.std(0) / s.mean(0).abs()).mean().item()
        g = s.view(draws, -1, group_size)                              # (R, P, G)
        group_cv = (g.std(2) / g.mean(2).abs()).mean().item()
        out[name] = (cv, group_cv)
    return out


def run(seeds=3, draws=16, n_prompts=4, group_size=8, out=None, family=None, steps=12):
    """Measure every setting over `seeds` rollouts; write the table (with its set-up line) to `out` -> text."""
    family = family or learning.digits_family()
    sigmas = family.sigma_grid(steps)
    train, _ = vgrpo.load_prompts(learning.DIGIT_PROMPTS.format("train"))
    rows = {name: [] for name in SETTINGS}
    for seed in range(seeds):
        prompts = [train[(seed * n_prompts + i) * 7 % len(train)] for i in range(n_prompts) for _ in range(group_size)]
        cond = family.encode(prompts)
        noise = torch.randn(len(prompts), *family.latent_shape, generator=torch.Generator().manual_seed(seed))
        o = vgrpo.rollout(family, family.transformer, cond, noise, sigmas,
                          types.SimpleNamespace(sampler="dpmpp2m", guidance=1.0, sample_batch=16))
        for name, value in measure(family, o, cond, sigmas, group_size, draws, 4, seed).items():
            rows[name].append(value)
        print(f"seed {seed} done", flush=True)
    lines = ["| setting | cv of the surrogate | within-group cv |", "| --- | --- | --- |"]
    for name, values in rows.items():
        cv, gcv = torch.tensor(values).T
        spread = lambda t: f"{t.mean():.3f}" + (f" ± {t.std():.3f}" if len(t) > 1 else "")  # noqa: E731
        lines.append(f"| {name} | {spread(cv)} | {spread(gcv)} |")
    text = (f"Pretrained digits SD3 (digits/pipeline), N_MC = 4, {steps}-step grid, "
            f"{n_prompts} prompts x {group_size} images, "
            f"{draws} pair draws, {seeds} seed(s) (mean ± std over seeds).\n\n" + "\n".join(lines) + "\n")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
    return text


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--draws", type=int, default=16, help="independent pair draws per sample")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="a seconds-long run that only checks the script works")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "variance.md"))
    a = p.parse_args()
    if a.quick:
        a.seeds, a.draws, a.prompts, a.group_size = 1, 3, 2, 3
    print(run(a.seeds, a.draws, a.prompts, a.group_size, a.out))


if __name__ == "__main__":
    main()
