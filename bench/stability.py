"""Long runs of the CPU demo: does the held-out accuracy hold past its peak, and which setting keeps it?

    python bench/stability.py                          # every candidate, 3 seeds, 240 iterations (about 7 min a run)
    python bench/stability.py --configs default,lr-3e-4 --seeds 0
    python bench/stability.py --report                 # tables and plot from the runs already made (copies too)
    python bench/stability.py --quick --work /tmp/s    # 4 iterations, two candidates, one seed (test_bench.py)
    python bench/stability.py --methods                # V-GRPO, DiffusionNFT, MixGRPO: 240 iterations, seeds 1-3

Each run is the demo's command as a user launches it, `python vgrpo.py --iterations 240 --eval-every 20 --seed S`
plus the candidate's flags, in its own process, one at a time (two at once on 2 cores run 4x slower). A run whose
eval.jsonl is complete (in --work, or its copy in results/stability/) is not run again. Its eval.jsonl is copied to
results/stability/NAME-seedS.eval.jsonl, and results/stability.md (and .json, and stability.png) gets, per candidate
and seed, by both judges (the CNN, digit_correct; the independent k-NN, digit_knn): the peak, the final accuracy,
the largest fall below the best reached before (the issue's criterion: at most 0.05), the accuracy at iteration 80
(the demo's length), and the held-out diversity at the start and the end (eval_diversity: the mean pairwise RMS
pixel distance of a prompt's 8 images; it falls when a prompt's images turn into one picture).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, ROOT)     # vgrpo's recipes (the demo's evaluation)

# the candidates: flags added to the demo's defaults (vgrpo.RECIPES["digits"]: lr 1e-3, 4 prompts x 8, no KL, no
# soft clip, advantages divided by the group std + 1e-4)
CONFIGS = {
    "default": [],
    "lr-5e-4": ["--lr", "5e-4"],
    "lr-3e-4": ["--lr", "3e-4"],
    "no-std": ["--adv-std-floor", "1"],              # A = r - mean (rewards in [0, 1]): Dr. GRPO's advantage
    "std-floor-0.1": ["--adv-std-floor", "0.1"],
    "kl-0.3": ["--beta", "0.3"],                     # the paper's KL weight (to the sampling policy: 0 here)
    "kl-initial-1": ["--beta", "1", "--kl-to", "initial"],    # a KL to the model before training (LoRA off)
    "kl-initial-0.3": ["--beta", "0.3", "--kl-to", "initial"],
    "kl-initial-0.1": ["--beta", "0.1", "--kl-to", "initial"],
    "kl-initial-0.3-ema-0.95": ["--beta", "0.3", "--kl-to", "initial", "--ema", "0.95"],
    "kl-initial-0.3-ema-0.9": ["--beta", "0.3", "--kl-to", "initial", "--ema", "0.9"],  # a shorter EMA lags less at 80
    "kl-initial-0.1-ema-0.95": ["--beta", "0.1", "--kl-to", "initial", "--ema", "0.95"],
    "soft-clip-1": ["--adv-soft-clip", "1"],
    "group-16": ["--group-size", "16", "--prompts-per-step", "2"],  # the same 32 images per iteration
    "ema-0.95": ["--ema", "0.95"],                   # the evaluation reads an EMA of the LoRA (horizon ~20 steps)
}
JUDGES = {"CNN": "eval_digit_correct", "k-NN": "eval_digit_knn"}

# The paper's stability claim: V-GRPO and two baselines of the headline (bench/run.py), each at the setting its
# one-step sweep chose (full fine-tuning of the digits transformer, one optimizer step per rollout, V-GRPO's
# advantages soft-clipped at 3: SD3.5-M's regime), all in one bench/learning.py process per seed, on the
# headline's measured seeds (1-3; its sweep ran on 0)
METHOD_KINDS = ("V-GRPO", "DiffusionNFT", "MixGRPO")
METHOD_SEEDS = "1,2,3"
HEADLINE_SWEEP = os.path.join(RESULTS, "headline", "one-step", "sweep.json")


def earlier_runs(copies, iterations):
    """{(name, seed): eval rows} of the complete runs whose copies are in `copies` (results/stability/)."""
    runs = {}
    for name in CONFIGS:
        for file in sorted(os.listdir(copies)):
            if file.startswith(f"{name}-seed") and file.endswith(".eval.jsonl"):
                rows = rows_of(os.path.join(copies, file))
                seed = file[len(f"{name}-seed"):-len(".eval.jsonl")]
                if seed.isdigit() and rows and rows[-1]["iteration"] == iterations:
                    runs[name, int(seed)] = rows
    return runs


def run_one(name, seed, work, iterations, eval_every, threads):
    """One run, or nothing if its evaluation is already complete -> its eval.jsonl rows."""
    out = os.path.join(work, f"{name}-seed{seed}")
    eval_file = os.path.join(out, "eval.jsonl")
    if os.path.isfile(eval_file) and rows_of(eval_file) and rows_of(eval_file)[-1]["iteration"] == iterations:
        return rows_of(eval_file)
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, os.path.join(ROOT, "vgrpo.py"), "--iterations", str(iterations), "--eval-every",
               str(eval_every), "--seed", str(seed), "--save-every", str(iterations), "--output-dir", out,
               *CONFIGS[name]]
    print(f"{name} seed {seed}: {' '.join(command[1:])}", flush=True)
    start = time.time()
    with open(os.path.join(work, f"{name}-seed{seed}.log"), "w") as log:
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1"))
    print(f"  done in {time.time() - start:.0f} s", flush=True)
    return rows_of(eval_file)


def method_specs(sweep_path=HEADLINE_SWEEP):
    """The learner specs of METHOD_KINDS the headline's one-step sweep chose (bench/run.py's choose)."""
    import run
    with open(sweep_path) as f:
        chosen = run.choose(json.load(f))
    return [{k: v for k, v in chosen[kind].items() if k != "target_gain"} for kind in METHOD_KINDS]


def run_methods(seed, work, iterations, eval_every, threads, specs, setup=None):
    """One bench/learning.py job training the three methods side by side, or nothing if its output exists ->
    {method: eval rows} as run_one's (eval_digit_correct: the CNN, eval_digit_knn: the k-NN, eval_diversity)."""
    import run
    out = os.path.join(work, f"methods-seed{seed}.json")
    done = os.path.isfile(out) and complete(method_rows(out), [m["name"] for m in specs], iterations)
    if not done:
        command = [sys.executable, os.path.join(HERE, "learning.py"), "--reward", "digits", "--seed", str(seed),
                   "--setup", json.dumps(setup or run.REGIMES["one-step"]), "--iterations", str(iterations),
                   "--eval-every", str(eval_every), "--run-to-end", "--methods", json.dumps(specs),
                   "--threads", str(threads), "--out", out]
        print(f"methods seed {seed}: {' '.join(command[1:])}", flush=True)
        start = time.time()
        with open(out.replace(".json", ".log"), "w") as log:
            subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                           env=dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1"))
        print(f"  done in {time.time() - start:.0f} s", flush=True)
    return method_rows(out)


def method_rows(path):
    """A bench/learning.py output -> {method: eval rows}, keyed as vgrpo.py's eval.jsonl (methods of METHOD_KINDS
    with both judges' curves; the diversity where the file has it)."""
    with open(path) as f:
        result = json.load(f)
    out = {}
    for name, m in result["methods"].items():
        if name in METHOD_KINDS and m.get("check"):
            spread = dict(m.get("diversity", []))
            out[name] = [{"iteration": it, "eval_digit_correct": cnn, "eval_digit_knn": knn,
                          **({"eval_diversity": spread[it]} if it in spread else {})}
                         for (it, cnn), (_, knn) in zip(m["eval"], m["check"])]
    return out


def method_meta(path):
    """A bench/learning.py output -> ({method: the settings it ran with}, (held-out prompts, images per prompt) of
    its evaluation, on the demo's held-out prompts, or None where the file does not say)."""
    with open(path) as f:
        result = json.load(f)
    setup = result.get("setup", {})
    prompts = min(setup.get("eval_prompts", 0), demo_eval_size()[0])     # learning.py takes the first ones there are
    size = (prompts, max(1, setup["eval_samples"] // prompts)) if prompts else None
    return {name: m["settings"] for name, m in result["methods"].items() if "settings" in m}, size


def demo_eval_size():
    """(held-out prompts, images per prompt) of the demo's evaluation, which every candidate keeps."""
    import vgrpo

    recipe = vgrpo.RECIPES["digits"]
    with open(os.path.join(ROOT, recipe["eval_prompts"])) as f:
        return sum(1 for line in f if line.strip()), recipe["eval_images"]


def complete(rows, names, iterations):
    """Has every method of `names` been evaluated up to `iterations`?"""
    return all(rows.get(name) and rows[name][-1]["iteration"] == iterations for name in names)


def earlier_methods(copies, iterations):
    """{(method, seed): eval rows} of the complete method runs whose copies are in `copies`."""
    runs = {}
    for file in sorted(os.listdir(copies)):
        seed = file[len("methods-seed"):-len(".json")]
        if file.startswith("methods-seed") and file.endswith(".json") and seed.isdigit():
            for name, rows in method_rows(os.path.join(copies, file)).items():
                if rows and rows[-1]["iteration"] == iterations:
                    runs[name, int(seed)] = rows
    return runs


def rows_of(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def largest_fall(values):
    """The largest drop below the best value reached before (0 for a curve that never falls)."""
    best, fall = -float("inf"), 0.0
    for v in values:
        best = max(best, v)
        fall = max(fall, best - v)
    return fall


def summarize_run(rows):
    """Peak, final, largest fall, value at 80 per judge; diversity at the start and end; digits that end at 0."""
    out = {}
    for judge, key in JUDGES.items():
        values = [r[key] for r in rows]
        at_80 = next((r[key] for r in rows if r["iteration"] == 80), None)
        out[judge] = dict(start=values[0], peak=max(values), peak_at=rows[values.index(max(values))]["iteration"],
                          final=values[-1], fall=largest_fall(values), at_80=at_80)
    out["diversity"] = dict(start=rows[0].get("eval_diversity"), final=rows[-1].get("eval_diversity"),
                            lowest=min((r["eval_diversity"] for r in rows if "eval_diversity" in r), default=None))
    last = rows[-1]
    out["digits_at_zero"] = sorted(k.partition("/")[2] for k, v in last.items()
                                   if k.startswith("eval_digit_correct/") and not k.endswith("mean_of_tags") and v == 0)
    return out


def mean_sd(values):
    values = [v for v in values if v is not None]
    if not values:
        return ""
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def summary_rows(runs, summaries, names, label):
    """One table row per candidate (or method) `name`: mean ± std over its seeds, the worst seed's fall."""
    lines = []
    for name in names:
        s = [summaries[k] for k in sorted(runs) if k[0] == name]
        seeds = [k[1] for k in sorted(runs) if k[0] == name]
        cnn, knn = [x["CNN"] for x in s], [x["k-NN"] for x in s]
        lines.append(
            f"| {name} | {label(name)} | {','.join(map(str, seeds))} | "
            f"{mean_sd([c['at_80'] for c in cnn])} | {mean_sd([c['peak'] for c in cnn])} | "
            f"{mean_sd([c['final'] for c in cnn])} | {max(c['fall'] for c in cnn):.3f} | "
            f"{mean_sd([k['peak'] for k in knn])} | {mean_sd([k['final'] for k in knn])} | "
            f"{max(k['fall'] for k in knn):.3f} | {mean_sd([x['diversity']['start'] for x in s])} -> "
            f"{mean_sd([x['diversity']['final'] for x in s])} |")
    return lines


def per_run_rows(runs, summaries, order, per_digit=True):
    """One row per run; `per_digit`: the digits whose held-out accuracy ends at 0 (vgrpo.py's runs log them)."""
    lines = []
    for (name, seed) in sorted(runs, key=lambda k: (order.index(k[0]), k[1])):
        x = summaries[name, seed]
        c, k = x["CNN"], x["k-NN"]
        zeros = f" {', '.join(x['digits_at_zero']) or '-'} |" if per_digit else ""
        lines.append(f"| {name} | {seed} | {c['peak']:.3f} ({c['peak_at']}) / {k['peak']:.3f} ({k['peak_at']}) | "
                     f"{c['final']:.3f} / {k['final']:.3f} | {c['fall']:.3f} / {k['fall']:.3f} |{zeros}")
    return lines


TABLE_HEAD = ["| {} | {} | seeds | CNN at 80 | CNN peak | CNN final | CNN fall (worst seed) | k-NN peak | "
              "k-NN final | k-NN fall (worst seed) | diversity start -> end |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
RUN_HEAD = ["| {} | seed | peak (at) | final | fall | digits at 0 in the end |", "| --- | --- | --- | --- | --- | --- |"]
METHOD_RUN_HEAD = ["| method | seed | peak (at) | final | fall |", "| --- | --- | --- | --- | --- |"]


def report(runs, iterations, eval_every, out_dir, method_runs=None):
    """runs: {(name, seed): eval rows} of the demo's candidates, method_runs: the same of the three methods (their
    settings and evaluation read from the copies of their outputs in out_dir/stability/) -> the markdown, and the
    plots beside it."""
    method_runs = method_runs or {}
    summaries = {key: summarize_run(rows) for key, rows in runs.items()}
    names = [n for n in CONFIGS if any(k[0] == n for k in runs)]
    demo_prompts, demo_images = demo_eval_size()
    lines = ["# Long runs of the CPU demo (`bench/stability.py`)", "",
             f"`python vgrpo.py --iterations {iterations} --eval-every {eval_every} --seed S` plus each candidate's "
             f"flags, held-out accuracy of {demo_prompts} prompts x {demo_images} images by the two judges. fall: the "
             "largest drop below the best reached before (the target: at most 0.05 on every seed). Mean ± std over "
             "the seeds run."]
    if runs:
        lines += ["", TABLE_HEAD[0].format("candidate", "flags"), TABLE_HEAD[1],
                  *summary_rows(runs, summaries, names, lambda n: f"`{' '.join(CONFIGS[n]) or '(the demo)'}`"),
                  "", "Per run (CNN / k-NN):", "", RUN_HEAD[0].format("candidate"), RUN_HEAD[1],
                  *per_run_rows(runs, summaries, list(CONFIGS))]
    if method_runs:
        method_summaries = {key: summarize_run(rows) for key, rows in method_runs.items()}
        kinds = [k for k in METHOD_KINDS if any(key[0] == k for key in method_runs)]
        # as each run was made (a run kept from before may have used other settings than the sweep chooses now)
        metas = {seed: method_meta(os.path.join(out_dir, "stability", f"methods-seed{seed}.json"))
                 for seed in sorted({seed for _, seed in method_runs})}
        settings = {kind: " / ".join(dict.fromkeys(
            ", ".join(f"{k} {v:g}" for k, v in metas[seed][0][kind].items() if k not in ("name", "kind"))
            for name, seed in sorted(method_runs) if name == kind and kind in metas[seed][0])) for kind in kinds}
        sizes = " / ".join(dict.fromkeys(f"{size[0]} held-out prompts x {size[1]} images"
                                         for _, size in metas.values() if size)) or "held-out prompts"
        lines += ["", f"## V-GRPO, DiffusionNFT and MixGRPO to {iterations} iterations", "",
                  f"`python bench/stability.py --methods`: one `bench/learning.py --reward digits --iterations "
                  f"{iterations} --eval-every {eval_every} --run-to-end` per seed, training the three side by side "
                  "from the same pretrained digits model on the same prompts and noises; each at the setting the "
                  "headline's one-step sweep chose (full fine-tuning, one optimizer step per rollout, V-GRPO's "
                  "advantages soft-clipped at 3; not the demo's LoRA), evaluated with the deterministic sampler on "
                  f"{sizes} (the demo's candidates: {demo_prompts} x {demo_images}).", "",
                  TABLE_HEAD[0].format("method", "settings"), TABLE_HEAD[1],
                  *summary_rows(method_runs, method_summaries, kinds, lambda n: settings.get(n, "")),
                  "", "Per run (CNN / k-NN):", "", *METHOD_RUN_HEAD,
                  *per_run_rows(method_runs, method_summaries, list(METHOD_KINDS), per_digit=False)]
        plot(method_runs, method_summaries, kinds, os.path.join(out_dir, "stability-methods.png"))
    path = os.path.join(out_dir, "stability.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "stability.json"), "w") as f:
        json.dump({**{f"{n}-seed{s}": dict(summary=summaries[n, s], rows=runs[n, s]) for n, s in runs},
                   **{f"method {n}-seed{s}": dict(rows=rows) for (n, s), rows in method_runs.items()}}, f, indent=1)
    if runs:
        plot(runs, summaries, names, os.path.join(out_dir, "stability.png"))
    return path


def plot(runs, summaries, names, path):
    """One panel per candidate (both judges, a colour per seed, the worst falls in its title, so 0.05 can be read
    off each), and a last panel with every candidate's diversity averaged over its seeds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [n for n in names if any(key[0] == n for key in runs)]
    cols = min(4, len(names) + 1)
    n_rows = -(-(len(names) + 1) // cols)  # the candidates' panels and the diversity's
    fig, axes = plt.subplots(n_rows, cols, figsize=(3.5 * cols, 2.7 * n_rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        seeds = sorted(s for n, s in runs if n == name)
        falls = {judge: max(summaries[name, s][judge]["fall"] for s in seeds) for judge in JUDGES}
        for i, seed in enumerate(seeds):
            for (judge, key), style in zip(JUDGES.items(), ("-", "--")):
                rows = [r for r in runs[name, seed] if key in r]
                ax.plot([r["iteration"] for r in rows], [r[key] for r in rows], style, color=f"C{i}", lw=1.1,
                        label=f"{judge}, seed {seed}")
        ax.set_title(f"{name}\nworst fall CNN {falls['CNN']:.2f}, k-NN {falls['k-NN']:.2f}", fontsize=8)
        ax.set_ylim(0, 1)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=6, loc="lower right")
    diversity = axes.flat[len(names)]
    for j, name in enumerate(names):
        seeds = sorted(s for n, s in runs if n == name)
        iterations = [r["iteration"] for r in runs[name, seeds[0]] if "eval_diversity" in r]
        mean = [statistics.mean(next(r["eval_diversity"] for r in runs[name, s] if r["iteration"] == it)
                                for s in seeds) for it in iterations]
        diversity.plot(iterations, mean, color=plt.cm.tab20(j % 20), lw=1.1, label=name)
    diversity.set_title("held-out diversity (pixels), mean over seeds", fontsize=8)
    diversity.tick_params(labelsize=7)
    diversity.grid(alpha=0.3)
    diversity.legend(fontsize=5, ncol=2)
    for ax in axes.flat[len(names) + 1:]:
        ax.axis("off")
    fig.supxlabel("iteration", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--seeds", help="comma-separated (default 0,1,2; with --methods 1,2,3)")
    p.add_argument("--iterations", type=int, default=240)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    p.add_argument("--work", default="runs/stability", help="where the runs' folders go")
    p.add_argument("--out", default=RESULTS, help="where stability.md / .json / .png and the eval.jsonl copies go")
    p.add_argument("--report", action="store_true", help="run nothing: report the runs found in --work")
    p.add_argument("--quick", action="store_true", help="4 iterations, evaluated every 2: the script's own test")
    p.add_argument("--methods", action="store_true", help="run V-GRPO, DiffusionNFT and MixGRPO side by side "
                   f"(bench/learning.py) instead of the demo's candidates; --seeds default {METHOD_SEEDS}")
    a = p.parse_args(argv)
    if a.quick:
        a.iterations, a.eval_every, a.configs = 4, 2, "default,no-std"
        a.seeds = "1" if a.methods else "0"
    names, seeds = a.configs.split(","), [int(s) for s in (a.seeds or (METHOD_SEEDS if a.methods else "0,1,2"))
                                          .split(",")]
    if not set(names) <= set(CONFIGS):
        p.error(f"--configs: choose from {', '.join(CONFIGS)}")
    os.makedirs(a.work, exist_ok=True)
    copies = os.path.join(a.out, "stability")
    os.makedirs(copies, exist_ok=True)
    # the tables keep every run made before
    runs = {} if a.quick else earlier_runs(copies, a.iterations)
    method_runs = {} if a.quick else earlier_methods(copies, a.iterations)
    specs = method_specs() if a.methods else None
    for name in [] if a.methods else names:
        for seed in seeds:
            eval_file = os.path.join(a.work, f"{name}-seed{seed}", "eval.jsonl")
            if (name, seed) in runs:          # made before: its copy is in results/stability/
                continue
            if a.report:
                if os.path.isfile(eval_file):
                    runs[name, seed] = rows_of(eval_file)
                continue
            runs[name, seed] = run_one(name, seed, a.work, a.iterations, a.eval_every, a.threads)
            shutil.copy(eval_file, os.path.join(copies, f"{name}-seed{seed}.eval.jsonl"))
            # after every run: an interrupted sweep keeps its tables
            report(runs, a.iterations, a.eval_every, a.out, method_runs)
    for seed in seeds if a.methods and not a.report else []:
        if all((kind, seed) in method_runs for kind in METHOD_KINDS):
            continue
        # quick: a small evaluation set, fewer sampling steps
        setup = dict(run_regime(), eval_samples=16, eval_prompts=2, sample_steps=4) if a.quick else None
        rows = run_methods(seed, a.work, a.iterations, a.eval_every, a.threads, specs, setup)
        method_runs.update({(name, seed): r for name, r in rows.items()})
        shutil.copy(os.path.join(a.work, f"methods-seed{seed}.json"), os.path.join(copies, f"methods-seed{seed}.json"))
        report(runs, a.iterations, a.eval_every, a.out, method_runs)
    if not runs and not method_runs:
        p.error(f"no runs in {a.work}")
    print(f"wrote {report(runs, a.iterations, a.eval_every, a.out, method_runs)}")


def run_regime():
    import run
    return dict(run.REGIMES["one-step"])


if __name__ == "__main__":
    main()
