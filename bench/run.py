"""Every table and plot of the benchmark (issue 5), from scratch.

    python bench/run.py                          # about 20-30 minutes on 2 CPU cores; writes bench/results/
    python bench/run.py --quick --out /tmp/b     # seconds: tiny settings, checks that everything runs

Full mode runs, two processes at a time with one torch thread each: the surrogate-variance table
(bench/variance.py), then the learning-efficiency jobs (bench/learning.py, one per reward and seed, each
training V-GRPO, the naive ELBO and the MDP baseline side by side), and finally, alone, the cost
measurements (bench/cost.py). It writes, under --out:

  variance.md    item 1: coefficient of variation of the surrogate under each variance reduction
  learning.md    item 2: final rewards, steps / NFE / seconds to a common target, MDP-time / V-GRPO-time
  learning.png   item 2: evaluation reward against gradient steps, NFE and seconds, mean ± std over seeds
  learning/*.json  the raw curves of every job
  cost.md        item 3: per-phase seconds, update vs flow-matching floor, rollout vs the diffusers
                 pipeline, peak memory of a V-GRPO step vs a flow-matching step
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
                 ([py, os.path.join(HERE, "cost.py"), "--out", os.path.join(out, "cost.md")], os.path.join(out, "cost.log"))]
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
    variance.run(seeds=1, draws=2, n_prompts=2, group_size=2, out=os.path.join(out, "variance.md"), family=family)
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
    return results


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
        phases = {k: float(np.median([t[f"time_{k}"] for tr in train for t in tr])) for k in ("rollout", "reward", "old", "update")}
        out[method] = dict(steps=steps, nfe=[int(nfe[s]) for s in steps], seconds=[float(secs[s]) for s in steps],
                           mean=values.mean(0), std=values.std(0), per_seed=values, phases=phases,
                           nfe_per_it=train[0][0]["nfe"], ratio_dev=max(t["ratio_dev_first"] for tr in train for t in tr))
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
                  f"Evaluation reward of DPM-Solver++ samples on a fixed set, mean ± std over {n_seeds} seed(s). Base model "
                  f"{c['V-GRPO']['mean'][0]:+.4f}; target = base + {TARGET_FRACTION:g} x the best final gain = "
                  + (f"{target:+.4f}." if target is not None else "none (no method gained)."), "",
                  f"| method | final reward (step {last}) | gain | steps to target | NFE to target | seconds to target "
                  "| NFE / step | s / step (rollout, old, update) | time to target / V-GRPO's |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for method, v in c.items():
            i, p = hit[method], v["phases"]
            to_target = (f"{v['steps'][i]} | {v['nfe'][i]:,} | {v['seconds'][i]:.0f}" if i is not None else
                         f"not in {last} | > {v['nfe'][-1]:,} | > {v['seconds'][-1]:.0f}")
            lines.append(f"| {method} | {v['mean'][-1]:+.4f} ± {v['std'][-1]:.4f} | {v['mean'][-1] - v['mean'][0]:+.4f} "
                         f"| {to_target} | {v['nfe_per_it']} | {sum(p.values()):.2f} ({p['rollout']:.2f}, {p['old']:.2f}, "
                         f"{p['update']:.2f}) | {time_ratio(c, method, hit)} |")
        lines += ["", "Final reward per seed: " + "; ".join(
            f"{m} " + " / ".join(f"{x:+.4f}" for x in v["per_seed"][:, -1]) for m, v in c.items()) + "."]
        lines += ["", "Largest |ratio - 1| at the first (on-policy) forward of each update: "
                  + ", ".join(f"{m} {v['ratio_dev']:.1e}" for m, v in c.items()) + ".", ""]
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seconds-long toy run (for the test)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=24)
    p.add_argument("--jobs", type=int, default=2, help="processes side by side (one torch thread each)")
    p.add_argument("--report-only", action="store_true", help="rebuild learning.md and the plot from OUT/learning/*.json")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t = time.perf_counter()
    if a.report_only:
        results = load_results(a.out)
    else:
        results = quick(a.out) if a.quick else full(a.out, a.seeds, a.iterations, a.jobs)
    s = results[0]["setup"]
    header = (f"Tiny random SD3 (vgrpo.build_tiny_sd3_pipeline), full fine-tuning, AdamW lr {s['lr']}, "
              f"{s['prompts_per_step']} prompts x {s['group_size']} images per iteration, {s['sample_steps']} sampling "
              f"steps, N_MC = K = {s['n_mc']}, one optimizer step per iteration, {s['iterations']} iterations. "
              f"Seconds are per-process training time (evaluation excluded) with one torch thread, the three methods "
              f"interleaved iteration by iteration, on a 2-core machine shared with other work.\n\n")
    with open(os.path.join(a.out, "learning.md"), "w") as f:
        f.write(header + learning_table(results))
    plot(results, os.path.join(a.out, "learning.png"))
    print(open(os.path.join(a.out, "learning.md")).read())
    print(f"bench: done in {time.perf_counter() - t:.0f} s; results in {a.out}")


if __name__ == "__main__":
    main()
