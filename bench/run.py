"""Every table and plot of the benchmark, from scratch.

    python bench/run.py                          # everything: items 1-3 (~25 min) then the headline (~30 min)
    python bench/run.py --only headline --jobs 1 # the headline alone: V-GRPO against four learners
    python bench/run.py --quick --out /tmp/b     # about a minute: toy sizes, checks that everything runs
    python bench/run.py --report-only            # rebuild the tables and plots from the raw JSON under --out

Items 1-3 run, `--jobs` processes at a time with one torch thread each: the surrogate-variance table
(bench/variance.py), the learning-efficiency jobs on the tiny random model (bench/learning.py, one per reward and
seed, each training V-GRPO, the naive ELBO and the MDP baseline side by side), and the cost measurements
(bench/cost.py). The headline, on the pretrained digits model, pits five learners (V-GRPO, DiffusionNFT, MixGRPO,
the MDP baseline and the naive ELBO) against each other in two regimes (one-step: one optimizer step per rollout
with the advantage soft clip, SD3.5-M's; multi-step: four clipped steps per rollout, FLUX's): a learning-rate sweep
on seed 0, then every learner at its chosen setting on seeds 1-3, run to a cap, and the steps / NFE / seconds at
which each first reaches each baseline's target. It writes, under --out (default bench/results/; `--only learning`
writes its learning.* there too; the committed learning.* are in bench/results/random-model/):

  variance.md    item 1: coefficient of variation of the surrogate under each variance reduction
  learning.md    item 2: final rewards, steps / NFE / seconds to a common target, MDP-time / V-GRPO-time
  learning.png   item 2: evaluation reward against gradient steps, NFE and seconds, mean ± std over seeds
  learning/*.json  the raw curves of every job
  cost.md, cost.json  item 3: per-phase seconds, update vs flow-matching floor, rollout vs the diffusers
                 pipeline, peak memory of a V-GRPO step vs a flow-matching step (the .json: the raw measurements)
  headline.md    per regime: the sweep, then gradient steps / NFE / seconds to each target per seed and their
                 ratios to V-GRPO's (mean ± std over seeds) beside the paper's 2x (MixGRPO) and 3x (DiffusionNFT)
  headline-one-step.png, headline-multi-step.png  each regime's learning curves, every learner and seed, against
                 steps, NFE and seconds
  headline/REGIME/sweep.json, seed-N.json  each regime's raw curves: the sweep's and each seed's
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

COLOURS = {"V-GRPO": "tab:blue", "naive ELBO": "tab:orange", "MDP": "tab:green"}
REWARD_TITLES = {"jpeg": "JPEG compressibility (jpeg:100)", "colour": "prompt colour (-|mean RGB - named|)"}


# --------------------------------------------------------------------------- running the pieces


def run_commands(commands, jobs):
    """Run shell-free commands `jobs` at a time; each one's output goes to its .log file. Fails loudly."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")

    def one(item):
        cmd, log = item
        t = time.perf_counter()
        with open(log, "w") as f:
            code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=os.path.dirname(HERE))
        if code:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}); see {log}")
        print(f"  done in {time.perf_counter() - t:5.0f} s: {' '.join(cmd[1:])}", flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, commands))


def full(out, seeds, iterations, jobs):
    py, raw = sys.executable, os.path.join(out, "learning")
    os.makedirs(raw, exist_ok=True)
    commands = [([py, os.path.join(HERE, "learning.py"), "--reward", reward, "--seed", str(seed), "--iterations",
                  str(iterations), "--out", os.path.join(raw, f"{reward}-{seed}.json")],
                 os.path.join(raw, f"{reward}-{seed}.log")) for seed in range(seeds) for reward in ("jpeg", "colour")]
    # the short ones last, to fill the gap the long ones leave; cost's ratios are interleaved in-process,
    # so the one other job running beside it slows both contenders alike
    commands += [([py, os.path.join(HERE, "variance.py"), "--out", os.path.join(out, "variance.md")],
                  os.path.join(out, "variance.log")),
                 ([py, os.path.join(HERE, "cost.py"), "--out", os.path.join(out, "cost.md")],
                  os.path.join(out, "cost.log"))]
    print(f"bench: {len(commands)} jobs, {jobs} at a time", flush=True)
    run_commands(commands, jobs)
    return load_results(out)


def load_results(out):
    raw = os.path.join(out, "learning")
    return [json.load(open(os.path.join(raw, f))) for f in sorted(os.listdir(raw)) if f.endswith(".json")]


def quick(out):
    """Everything in this process at toy sizes (importing torch + diffusers once costs most of the time)."""
    import torch

    torch.set_num_threads(1)
    import cost
    import learning
    import variance

    family = learning.tiny_family()
    variance.run(seeds=1, draws=2, n_prompts=2, group_size=2, out=os.path.join(out, "variance.md"), steps=4)
    setup = learning.Setup(prompts_per_step=2, group_size=2, sample_steps=4, n_mc=2, iterations=2, eval_every=1,
                           eval_samples=2, eval_prompts=2, micro_batch=4)
    results = []
    for reward in ("jpeg", "colour"):
        curves = learning.run_job(reward, 0, setup, family=family, verbose=False)
        results.append({"reward": reward, "seed": 0, "setup": dataclasses.asdict(setup), "methods": curves})
    os.makedirs(os.path.join(out, "learning"), exist_ok=True)
    for r in results:
        with open(os.path.join(out, "learning", f"{r['reward']}-0.json"), "w") as f:
            json.dump(r, f)
    text = cost.report(cost.measure(quick=True, rss=False))
    with open(os.path.join(out, "cost.md"), "w") as f:
        f.write(text)
    return results, headline_quick(out)


# --------------------------------------------------------------------------- learning: curves and tables


def curves(results, reward):
    """{method: dict(steps, nfe, seconds (seed means, cumulative at each evaluation), mean, std, per_seed)}."""
    import numpy as np

    jobs = [r for r in results if r["reward"] == reward]
    out = {}
    for method in jobs[0]["methods"]:
        steps = [it for it, _ in jobs[0]["methods"][method]["eval"]]
        values = np.array([[v for _, v in j["methods"][method]["eval"]] for j in jobs])           # (seeds, evals)
        train = [j["methods"][method]["train"] for j in jobs]
        nfe = np.cumsum([0] + [t["nfe"] for t in train[0]])
        secs = np.mean([np.cumsum([0] + [t["time_rollout"] + t["time_reward"] + t["time_old"] + t["time_update"]
                                         for t in tr]) for tr in train], 0)
        phases = {k: float(np.median([t[f"time_{k}"] for tr in train for t in tr]))
                  for k in ("rollout", "reward", "old", "update")}
        out[method] = dict(steps=steps, nfe=[int(nfe[s]) for s in steps], seconds=[float(secs[s]) for s in steps],
                           mean=values.mean(0), std=values.std(0), per_seed=values, phases=phases,
                           nfe_per_it=train[0][0]["nfe"],
                           ratio_dev=max((t["ratio_dev_first"] for tr in train for t in tr
                                          if t["ratio_dev_first"] is not None), default=None))   # None: no ratio
    return out


TARGET_FRACTION = 0.25


def target_of(c):
    """The common target: the base model's evaluation reward plus a quarter of the best method's final gain
    (its mean over the last two evaluations). The best method reaches it by construction, and a low bar
    lets the slower methods reach it within the run, so that the table says how much longer they take."""
    base = c["V-GRPO"]["mean"][0]
    best = max(float(v["mean"][-2:].mean()) - base for v in c.values())
    return (base + TARGET_FRACTION * best if best > 0 else None), best


def first_reaching(v, target):
    """Index of the first evaluation whose seed-mean reward is at least `target`, or None."""
    hits = [i for i, m in enumerate(v["mean"]) if target is not None and m >= target and i > 0]
    return hits[0] if hits else None


def time_ratio(c, method, hit):
    """Seconds to target of `method` over V-GRPO's, with a lower bound where `method` never got there."""
    ref, ours = hit["V-GRPO"], hit[method]
    if method == "V-GRPO":
        return "1.00" if ref is not None else "not reached"
    if ref is None:
        return "n/a (V-GRPO did not reach it)"
    ref_s = c["V-GRPO"]["seconds"][ref]
    if ours is None:
        return f"> {c[method]['seconds'][-1] / ref_s:.1f} (not reached)"
    return f"{c[method]['seconds'][ours] / ref_s:.2f}"


def learning_table(results):
    lines = []
    for reward in [name for name in REWARD_TITLES if any(r["reward"] == name for r in results)]:
        c = curves(results, reward)
        target, best = target_of(c)
        hit = {method: first_reaching(v, target) for method, v in c.items()}
        n_seeds, last = len(c["V-GRPO"]["per_seed"]), c["V-GRPO"]["steps"][-1]
        lines += [f"### {REWARD_TITLES[reward]}", "",
                  f"Evaluation reward of DPM-Solver++ samples on a fixed set, mean ± std over {n_seeds} seed(s). "
                  "Base model "
                  f"{c['V-GRPO']['mean'][0]:+.4f}; target = base + {TARGET_FRACTION:g} x the best final gain = "
                  + (f"{target:+.4f}." if target is not None else "none (no method gained)."), "",
                  f"| method | final reward (step {last}) | gain | steps to target | NFE to target | seconds to target "
                  "| NFE / step | s / step (rollout, old, update) | time to target / V-GRPO's |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for method, v in c.items():
            i, p = hit[method], v["phases"]
            to_target = (f"{v['steps'][i]} | {v['nfe'][i]:,} | {v['seconds'][i]:.0f}" if i is not None else
                         f"not in {last} | > {v['nfe'][-1]:,} | > {v['seconds'][-1]:.0f}")
            lines.append(f"| {method} | {v['mean'][-1]:+.4f} ± {v['std'][-1]:.4f} "
                         f"| {v['mean'][-1] - v['mean'][0]:+.4f} | {to_target} | {v['nfe_per_it']} "
                         f"| {sum(p.values()):.2f} ({p['rollout']:.2f}, {p['old']:.2f}, "
                         f"{p['update']:.2f}) | {time_ratio(c, method, hit)} |")
        lines += ["", "Final reward per seed: " + "; ".join(
            f"{m} " + " / ".join(f"{x:+.4f}" for x in v["per_seed"][:, -1]) for m, v in c.items()) + "."]
        lines += ["", "Largest |ratio - 1| on each update's forwards before its first optimizer step (on-policy): "
                  + ", ".join(f"{m} {v['ratio_dev']:.1e}" for m, v in c.items() if v["ratio_dev"] is not None)
                  + ".", ""]
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = [name for name in REWARD_TITLES if any(r["reward"] == name for r in results)]
    fig, axes = plt.subplots(len(rewards), 3, figsize=(13, 3.6 * len(rewards)), squeeze=False)
    for row, reward in zip(axes, rewards):
        c = curves(results, reward)
        target, _ = target_of(c)
        for ax, (key, label) in zip(row, (("steps", "gradient steps"), ("nfe", "transformer forward rows (NFE)"),
                                          ("seconds", "training seconds (shared 2-core CPU)"))):
            for method, v in c.items():
                x = v[key]
                ax.plot(x, v["mean"], label=method, color=COLOURS[method], marker="o", ms=3)
                ax.fill_between(x, v["mean"] - v["std"], v["mean"] + v["std"], color=COLOURS[method], alpha=0.15)
            if target is not None:
                ax.axhline(target, ls="--", color="grey", lw=1, label="target")
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
        row[0].set_ylabel(f"eval reward\n{REWARD_TITLES[reward]}")
    axes[0][0].legend(loc="best", fontsize=8)
    n_seeds = len([r for r in results if r["reward"] == rewards[0]])
    fig.suptitle(f"Tiny random SD3, same init, prompts and P x G; mean ± std over {n_seeds} seed(s)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- headline: V-GRPO against four learners
# The task: the pretrained digits model (digits/), trained on the prompted digit's probability, judged by its accuracy
# on held-out phrasings (the paper's setting in miniature: a pretrained generator, a semantic verifiable reward).
# In both of the paper's regimes: one optimizer step per rollout with the advantage soft clip (SD3.5-M's; the ratio
# is exactly 1) and four clipped steps per rollout (FLUX's; the clip binds).
# The accuracy everything is measured by is the lower of the two judges' held-out accuracies (the CNN the reward
# comes from, and the gated k-NN): a gain counts only where both see it. (Judged by the CNN alone, full fine-tuning at
# 3e-4 scored V-GRPO +0.33 and DiffusionNFT +0.18 while the k-NN saw -0.01 and -0.34: images the CNN likes that look
# like no handwritten digit. The sweep would then pick them.)
# 1. A sweep on seed 0: each method's learning rate on the same grid (and its key knob), all learners in one process,
#    the same iterations; each method's setting is the one with the highest mean accuracy over the sweep (the area
#    under its learning curve, which favours fast learning). 2. Targets fixed before the measured runs, as
#    the paper frames its claims ("V-GRPO reaches DiffusionNFT's / MixGRPO's reward in a third / half of the steps"):
#    for each baseline, a gain over the base model of 3/4 of the final gain its chosen setting had in the sweep (the
#    quarter a margin for seed-to-seed spread). 3. Seeds 1-3 (not the sweep's), the chosen settings, every learner
#    run to the cap; the steps, forward rows and seconds at its first evaluation at or above each target. A learner
#    that never gets there is a failure, reported as one, never as a ratio.

HEADLINE_KINDS = ("V-GRPO", "DiffusionNFT", "MixGRPO", "MDP", "naive ELBO")
HEADLINE_COLOURS = {"V-GRPO": "tab:blue", "DiffusionNFT": "tab:red", "MixGRPO": "tab:purple", "MDP": "tab:green",
                    "naive ELBO": "tab:orange"}
# full fine-tuning of the digits transformer: from about a thirtieth of the demo's LoRA rate up, by factors of ~3
SWEEP_LRS = (3e-5, 1e-4, 3e-4, 1e-3)
TARGET_GAIN_FRACTION = 0.75
PAPER = {"DiffusionNFT": "3x (gradient steps, SD3.5-M)", "MixGRPO": "2x (iterations, FLUX.1-dev)",
         "MDP": "-", "naive ELBO": "- (the paper's ablation)"}
REGIMES = {  # learning.Setup fields of each regime
    "one-step": dict(inner_steps=1, adv_soft_clip=3.0),    # SD3.5-M's: on-policy, ratio 1, advantages soft-clipped
    "multi-step": dict(inner_steps=4, adv_soft_clip=0.0),  # FLUX's: 4 clipped steps on minibatches of each rollout
}
REGIME_TITLES = {"one-step": "one optimizer step per rollout, advantage soft clip 3 (SD3.5-M's regime)",
                 "multi-step": "four clipped optimizer steps per rollout (FLUX.1-dev's regime)"}


def sweep_specs(lrs=SWEEP_LRS, windows=(4, 2), betas=(1.0, 0.1)):
    """Each learning rate for each method, crossed with DiffusionNFT's beta and MixGRPO's window (V-GRPO has
    no such knob here: those baselines get twice its settings, which can only favour them)."""
    import learning

    out = []
    for lr in lrs:
        out += [learning.spec(kind, lr, name=f"{kind} lr {lr:g}") for kind in ("V-GRPO", "MDP", "naive ELBO")]
        out += [learning.spec("DiffusionNFT", lr, name=f"DiffusionNFT lr {lr:g} beta {b:g}", beta=b) for b in betas]
        out += [learning.spec("MixGRPO", lr, name=f"MixGRPO lr {lr:g} w {w}", window=w) for w in windows]
    return out


def accuracy(run):
    """A learner's [(iteration, accuracy)]: the lower of its two judges' at each evaluation (the comment above);
    the evaluation's own values where a task has no second judge."""
    if not run.get("check"):
        return run["eval"]
    return [(it, min(a, b)) for (it, a), (_, b) in zip(run["eval"], run["check"])]


def auc(evals):
    """Mean evaluation accuracy after the start (the area under the learning curve per evaluation)."""
    return sum(v for it, v in evals if it > 0) / max(1, sum(1 for it, _ in evals if it > 0))


def choose(sweep):
    """-> {kind: chosen spec, named after the kind, with its target_gain}: the best-AUC learner of each method;
    each baseline's target from its own sweep run, V-GRPO's the highest of them (the comment above)."""
    runs, chosen = sweep["methods"], {}
    for kind in HEADLINE_KINDS:
        best = max((r for r in runs.values() if r["settings"]["kind"] == kind), key=lambda r: auc(accuracy(r)))
        chosen[kind] = dict(best["settings"], name=kind,
                            target_gain=TARGET_GAIN_FRACTION * max(final_gain(accuracy(best)), 0.0))
    chosen["V-GRPO"]["target_gain"] = max(chosen[k]["target_gain"] for k in HEADLINE_KINDS[1:])
    return chosen


def final_gain(evals):
    """Mean of the last two evaluations minus the first (the base model's)."""
    return sum(v for _, v in evals[-2:]) / len(evals[-2:]) - evals[0][1]


def learning_command(regime, seed, iterations, methods, path, every, dense=0):
    return ([sys.executable, os.path.join(HERE, "learning.py"), "--reward", "digits", "--seed", str(seed),
             "--setup", json.dumps(REGIMES[regime]), "--iterations", str(iterations), "--eval-every", str(every),
             "--eval-dense", str(dense), "--run-to-end", "--methods", json.dumps(methods), "--out", path],
            path.replace(".json", ".log"))


def headline_full(out, regime, seeds, cap, sweep_iterations, jobs, reuse_sweep=False):
    """The sweep (its learners split over `jobs` processes), the choice, then the seeds -> (sweep, runs)."""
    raw = os.path.join(out, "headline", regime)
    os.makedirs(raw, exist_ok=True)
    sweep_path = os.path.join(raw, "sweep.json")
    done = json.load(open(sweep_path)) if reuse_sweep and os.path.exists(sweep_path) else None
    missing = [m for m in sweep_specs() if done is None or m["name"] not in done["methods"]]
    if missing:  # learners do not interact (each has its own weights; every draw is keyed): a sweep splits and grows
        print(f"headline {regime}: sweep of {len(missing)} learners x {sweep_iterations} iterations on seed 0",
              flush=True)
        parts = [missing[i::jobs] for i in range(jobs) if missing[i::jobs]]
        paths = [os.path.join(raw, f"sweep-part-{i}.json") for i in range(len(parts))]
        run_commands([learning_command(regime, 0, sweep_iterations, part, path, 4)
                      for part, path in zip(parts, paths)], jobs)
        merged = done or json.load(open(paths[0]))
        for path in paths:
            merged["methods"].update(json.load(open(path))["methods"])
            os.remove(path)
        json.dump(merged, open(sweep_path, "w"))
    sweep = json.load(open(sweep_path))
    chosen = choose(sweep)
    print(f"headline {regime}: chosen {json.dumps(chosen)}; {seeds} seeds, cap {cap}", flush=True)
    # with --reuse-sweep, a seed already run with exactly these settings and cap would give the same curves again
    todo = [seed for seed in range(1, seeds + 1)
            if not (reuse_sweep and same_run(os.path.join(raw, f"seed-{seed}.json"), chosen, cap))]
    run_commands([learning_command(regime, seed, cap, list(chosen.values()), os.path.join(raw, f"seed-{seed}.json"),
                                   4, dense=8) for seed in todo], jobs)
    return load_headline(out, regime)


def same_run(path, chosen, cap):
    if not os.path.exists(path):
        return False
    run = json.load(open(path))
    return run["setup"]["iterations"] == cap and [m["settings"] for m in run["methods"].values()] == list(
        chosen.values())


def load_headline(out, regime):
    raw = os.path.join(out, "headline", regime)
    sweep = json.load(open(os.path.join(raw, "sweep.json")))
    runs = [json.load(open(os.path.join(raw, f))) for f in sorted(os.listdir(raw)) if f.startswith("seed-")
            and f.endswith(".json")]
    return sweep, runs


def headline_quick(out):
    """The headline's whole path at toy sizes, in this process, for both regimes -> {regime: (sweep, runs)}."""
    import learning

    family, results = learning.digits_family(), {}
    for regime, fields in REGIMES.items():
        raw = os.path.join(out, "headline", regime)
        os.makedirs(raw, exist_ok=True)
        setup = learning.Setup(**{**learning.DIGITS_SETUP, **fields, "group_size": 4, "sample_steps": 4, "n_mc": 2,
                                  "iterations": 1, "eval_every": 1, "eval_samples": 4, "eval_prompts": 4,
                                  "mix_window": 2, "mix_shift_every": 1, "prompts_per_step": 2})
        specs = sweep_specs(lrs=(1e-4,), windows=(2, 1))
        sweep = {"reward": "digits", "seed": 0, "setup": dataclasses.asdict(setup),
                 "methods": learning.run_job("digits", 0, setup, family=family, verbose=False, methods=specs,
                                             stop_at_target=False)}
        json.dump(sweep, open(os.path.join(raw, "sweep.json"), "w"))
        setup = dataclasses.replace(setup, iterations=2)
        run = {"reward": "digits", "seed": 1, "setup": dataclasses.asdict(setup),
               "methods": learning.run_job("digits", 1, setup, family=family, verbose=False,
                                           methods=list(choose(sweep).values()), stop_at_target=False)}
        json.dump(run, open(os.path.join(raw, "seed-1.json"), "w"))
        results[regime] = (sweep, [run])
    return results


def reaching(run, gain, steps_per_iteration=1):
    """(gradient steps, NFE, seconds) at the first evaluation at least `gain` above the base model's, or None;
    and the totals run."""
    train = run["train"]
    nfe, secs = [0], [0.0]
    for t in train:
        nfe.append(nfe[-1] + t["nfe"])
        secs.append(secs[-1] + t["time_rollout"] + t["time_reward"] + t["time_old"] + t["time_update"])
    evals = accuracy(run)
    hit = next((it for it, v in evals if it > 0 and v - evals[0][1] >= gain), None)
    total = (len(train) * steps_per_iteration, nfe[-1], secs[-1])
    return ((hit * steps_per_iteration, nfe[hit], secs[hit]) if hit is not None else None), total


def ratio_cell(values, failed):
    """'mean ± std (per seed a / b / c)' of the ratios over the seeds where the baseline reached the target; a seed
    where it did not is a failure, shown as one ('failed'), never as a ratio or a bound."""
    import numpy as np

    seeds = " / ".join("failed" if f else f"{x:.2f}" for x, f in zip(values, failed))
    reached = np.array([x for x, f in zip(values, failed) if not f])
    if len(reached) == 0:
        return f"never reached ({seeds})"
    where = "" if len(reached) == len(values) else f" on the {len(reached)} of {len(values)} seeds reached"
    return f"{reached.mean():.2f} ± {reached.std():.2f}{where} ({seeds})"


def headline_table(sweep, runs, regime):
    cap, every, dense = (runs[0]["setup"][k] for k in ("iterations", "eval_every", "eval_dense"))
    chosen = {r["settings"]["kind"]: r["settings"] for r in runs[0]["methods"].values()}
    lines = [f"### Sweep (seed 0): {REGIME_TITLES[regime]}", "",
             f"{sweep['setup']['iterations']} iterations per learner, evaluation every {sweep['setup']['eval_every']}; "
             "accuracy = the lower of the two judges' held-out accuracies; score = its mean over the run (area under "
             "the curve); final gain = the mean of its last two evaluations minus the base model's, and the same for "
             "each judge alone. Bold: the setting taken for the measured runs.", "",
             "| learner | score | final gain | the CNN's final gain | the k-NN's final gain |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in sweep["methods"].items():
        pick = all(r["settings"].get(k) == v for k, v in chosen[r["settings"]["kind"]].items()
                   if k not in ("name", "target_gain"))
        check = f"{final_gain(r['check']):+.3f}" if r.get("check") else "-"
        lines.append(f"| {f'**{name}**' if pick else name} | {auc(accuracy(r)):.3f} | {final_gain(accuracy(r)):+.3f} "
                     f"| {final_gain(r['eval']):+.3f} | {check} |")
    base = [accuracy(r["methods"]["V-GRPO"])[0][1] for r in runs]
    lines += ["", f"### Time to the same accuracy ({len(runs)} seeds: {', '.join(str(r['seed']) for r in runs)})", "",
              f"Each baseline's target is an accuracy {TARGET_GAIN_FRACTION:g} x its own final sweep gain "
              "above the base model's (" + " / ".join(f"{b:.3f}" for b in base) + " on these seeds' evaluation "
              f"noises); V-GRPO is timed to the same target. Every learner runs all {cap} iterations, evaluated "
              f"after each of the first {dense} iterations, then every {every}; the count is taken at its first "
              "evaluation at or above the target. Ratios are the baseline's over V-GRPO's, per seed, then mean ± std "
              "over the seeds where the baseline reached its target; a seed where it did not is a failure.",
              "", "| baseline | target gain | settings (baseline; V-GRPO) | reached | gradient steps to target "
              "(baseline; V-GRPO) | forward rows (NFE) to target | seconds to target | steps / V-GRPO's "
              "| NFE / V-GRPO's | seconds / V-GRPO's | steps ratio x cost of an iteration | paper's claim |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind in HEADLINE_KINDS[1:]:
        lines.append(target_row(runs, kind, chosen))
    lines += ["", f"### At the cap ({cap} iterations)", "",
              "| method | accuracy, seeds | its gain | the CNN's accuracy, seeds | its gain | the k-NN's, seeds | "
              "its gain |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind in HEADLINE_KINDS:
        cells = []
        for curve in (accuracy, lambda m: m["eval"], lambda m: m.get("check")):
            curves = [curve(r["methods"][kind]) for r in runs]
            if not all(curves):
                cells += ["-", "-"]
                continue
            cells += [" / ".join(f"{c[-1][1]:.3f}" for c in curves), mean_std([c[-1][1] - c[0][1] for c in curves])]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", "Seconds are per-process training time (evaluation excluded), one torch thread, the methods "
              "interleaved iteration by iteration. On a shared machine the load changes during a run; the last ratio "
              "column is therefore the steps ratio times the cost of one of the baseline's iterations relative to "
              "V-GRPO's: the median, over every iteration both ran, of their seconds in that iteration (interleaved, "
              "so under about the same load).", ""]
    return "\n".join(lines)


def mean_std(values):
    import numpy as np

    return f"{np.mean(values):+.3f} ± {np.std(values):.3f}"


def target_row(runs, kind, chosen):
    """One baseline's row: its steps / NFE / seconds to its target and V-GRPO's to the same, and their ratios."""
    gain, k = chosen[kind]["target_gain"], runs[0]["setup"].get("inner_steps", 1)
    per = [reaching(r["methods"][kind], gain, k) for r in runs]
    ref = [reaching(r["methods"]["V-GRPO"], gain, k) for r in runs]

    def setting(kind):
        st = chosen[kind]
        return f"lr {st['lr']:g}" + {"DiffusionNFT": f", beta {st.get('beta', 1.0):g}",
                                     "MixGRPO": f", w {st.get('window', 4)}"}.get(kind, "")

    cells = [f"{seeds_k(per, k)}; {seeds_k(ref, k)}" for k in range(3)]
    ok = [(p, q[0]) for p, q in zip(per, ref) if q[0] is not None]
    failed = [p[0] is None for p, _ in ok]
    ratios = [ratio_cell([p[0][k] / q[k] if p[0] else 0.0 for p, q in ok], failed)
              if ok else "n/a (V-GRPO did not reach it)" for k in range(3)]
    # V-GRPO's few iterations measure seconds over a short stretch of a shared machine's load, the baseline's
    # later ones over another: also give the steps ratio times the cost of one iteration relative to V-GRPO's
    # (the median per-iteration ratio over the interleaved iterations both ran, robust to a load spike)
    c = cost_ratio(runs, kind)
    ratios.append(ratio_cell([p[0][0] / q[0] * c if p[0] else 0.0 for p, q in ok], failed)
                  + f", x {c:.2f} per iteration" if ok else "n/a")
    reached = f"{sum(h is not None for h, _ in per)}/{len(per)}; {sum(h is not None for h, _ in ref)}/{len(ref)}"
    return (f"| {kind} | {gain:+.3f} | {setting(kind)}; {setting('V-GRPO')} | {reached} | " + " | ".join(cells)
            + " | " + " | ".join(ratios) + f" | {PAPER[kind]} |")


def cost_ratio(runs, kind):
    """Median over the iterations where both ran (every seed) of kind's training seconds over V-GRPO's in the
    same iteration: interleaved, so the two saw about the same load."""
    import numpy as np

    def secs(t):
        return t["time_rollout"] + t["time_reward"] + t["time_old"] + t["time_update"]

    return float(np.median([secs(a) / secs(b) for r in runs
                            for a, b in zip(r["methods"][kind]["train"], r["methods"]["V-GRPO"]["train"])]))


def seeds_k(hits, k):
    """Quantity k (0 steps, 1 NFE, 2 seconds) per seed, 'failed' where the target was not reached."""
    return " / ".join("failed" if hit is None else f"{hit[k]:,.0f}" for hit, _ in hits)


def headline_plot(sweep, runs, regime, path):
    """Left: every sweep learner over the whole sweep (seed 0). Right: the measured runs (seeds 1-3, to the cap)
    against gradient steps, forward rows and seconds; accuracies as gains over the base model's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps_per_it = REGIMES[regime]["inner_steps"]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for name, m in sweep["methods"].items():
        kind = m["settings"]["kind"]
        chosen = all(m["settings"].get(k) == v for k, v in runs[0]["methods"][kind]["settings"].items()
                     if k not in ("name", "target_gain"))
        acc = accuracy(m)
        axes[0].plot([it * steps_per_it for it, _ in acc], [v - acc[0][1] for _, v in acc],
                     marker="o", ms=2, color=HEADLINE_COLOURS[kind], lw=1.8 if chosen else 0.6,
                     ls="-" if chosen else ":", label=name if chosen else None)
    axes[0].plot([], [], color="grey", lw=0.6, ls=":", label=f"the other {len(sweep['methods']) - 5} settings")
    axes[0].set_title("sweep, seed 0 (solid: chosen)", fontsize=9)
    axes[0].set_xlabel("gradient steps")
    axes[0].legend(fontsize=6)
    for ax, key, label in zip(axes[1:], (0, 1, 2), ("gradient steps", "transformer forward rows (NFE)",
                                                     "training seconds (2-core CPU)")):
        for kind in HEADLINE_KINDS:
            for n, r in enumerate(runs):
                m, cum = r["methods"][kind], [(0, 0, 0.0)]  # (steps, NFE, seconds) after each iteration
                for t in m["train"]:
                    cum.append((cum[-1][0] + steps_per_it, cum[-1][1] + t["nfe"], cum[-1][2] + t["time_rollout"]
                                + t["time_reward"] + t["time_old"] + t["time_update"]))
                acc = accuracy(m)
                ax.plot([cum[it][key] for it, _ in acc], [v - acc[0][1] for _, v in acc],
                        color=HEADLINE_COLOURS[kind], alpha=0.7, lw=1.0, marker="o", ms=1.5,
                        label=kind if n == 0 else None)
        ax.set_title(f"seeds {', '.join(str(r['seed']) for r in runs)}, to the cap", fontsize=9)
        ax.set_xlabel(label)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (lower judge) - base model's")
    axes[1].legend(loc="best", fontsize=7)
    fig.suptitle(f"Pretrained digits SD3, {REGIME_TITLES[regime]}: the same init, prompts, noises, P x G and "
                 "evaluation set for every learner", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_headline(out, headlines):
    """headline.md (both regimes) and headline-REGIME.png from {regime: (sweep, runs)}."""
    parts = []
    for regime, (sweep, runs) in headlines.items():
        s = runs[0]["setup"]
        parts.append(f"## {REGIME_TITLES[regime]}\n\nThe pretrained digits model (digits/pipeline), full fine-tuning, "
                     f"AdamW, {s['prompts_per_step']} prompts x {s['group_size']} images per iteration, "
                     f"{s['sample_steps']} sampling steps, N_MC = {s['n_mc']}, {s['inner_steps']} optimizer step(s) "
                     f"per rollout, advantage soft clip {s['adv_soft_clip']:g} (V-GRPO, naive ELBO); training reward: "
                     f"the CNN's probability of the prompted digit; evaluation: its accuracy on {s['eval_samples']} "
                     f"images of the {s['eval_prompts']} held-out prompts (and the k-NN judge's, a check); MixGRPO's "
                     f"window moves every {s['mix_shift_every']} iterations.\n\n" + headline_table(sweep, runs, regime))
        headline_plot(sweep, runs, regime, os.path.join(out, f"headline-{regime}.png"))
    with open(os.path.join(out, "headline.md"), "w") as f:
        f.write("\n".join(parts))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seconds-long toy run (for the test)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--only", choices=("all", "learning", "headline"), default="all",
                   help="learning: items 1-3 (variance, learning, cost); headline: V-GRPO vs DiffusionNFT, MixGRPO, "
                   "MDP, naive ELBO")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=24, help="iterations of the learning jobs")
    p.add_argument("--sweep-iterations", type=int, default=32, help="iterations of the headline's sweep")
    p.add_argument("--cap", type=int, default=64, help="headline: the iterations every measured learner runs")
    p.add_argument("--regime", choices=("both", *REGIMES), default="both", help="headline: which of the regimes")
    p.add_argument("--jobs", type=int, default=2, help="processes side by side (one torch thread each)")
    p.add_argument("--report-only", action="store_true", help="rebuild the tables and plots from OUT's raw JSON")
    p.add_argument("--reuse-sweep", action="store_true", help="headline: keep the sweep's learners already in "
                   "OUT/headline/REGIME/sweep.json and run only those missing from it; rerun only the seeds whose "
                   "settings changed")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t = time.perf_counter()
    results = headline = None
    if a.quick:
        results, headline = quick(a.out)
    else:
        if a.only in ("all", "learning"):
            results = load_results(a.out) if a.report_only else full(a.out, a.seeds, a.iterations, a.jobs)
        if a.only in ("all", "headline"):
            regimes = list(REGIMES) if a.regime == "both" else [a.regime]
            headline = {r: load_headline(a.out, r) if a.report_only else
                        headline_full(a.out, r, a.seeds, a.cap, a.sweep_iterations, a.jobs, a.reuse_sweep)
                        for r in regimes}
    if results:
        write_learning(a.out, results)
    if headline:
        write_headline(a.out, headline)
        print(open(os.path.join(a.out, "headline.md")).read())
    print(f"bench: done in {time.perf_counter() - t:.0f} s; results in {a.out}")


def write_learning(out, results):
    s, methods = results[0]["setup"], list(results[0]["methods"])
    header = (f"Tiny random SD3 (vgrpo.build_tiny_sd3_pipeline), full fine-tuning, AdamW lr {s['lr']}, "
              f"{s['prompts_per_step']} prompts x {s['group_size']} images per iteration, {s['sample_steps']} sampling "
              f"steps, N_MC = K = {s['n_mc']}, {s['inner_steps']} optimizer step(s) per iteration, {s['iterations']} "
              f"iterations. Seconds are per-process training time (evaluation excluded) with one torch thread, "
              f"{', '.join(methods)} interleaved iteration by iteration, on a 2-core machine shared with other "
              "work.\n\n")
    with open(os.path.join(out, "learning.md"), "w") as f:
        f.write(header + learning_table(results))
    plot(results, os.path.join(out, "learning.png"))
    print(open(os.path.join(out, "learning.md")).read())


if __name__ == "__main__":
    main()
