"""Mutation testing of the method's functions and the iteration's wiring against the fast tier, with mutmut 3.

    python bench/mutation.py                         # every function of FUNCTIONS (about an hour on 2 CPU cores)
    python bench/mutation.py update rows_of          # some of them
    python bench/mutation.py --survivors             # then: the diff of every surviving mutant
    python bench/mutation.py --module reward         # reward.py's scoring functions against the reward tests

mutmut turns each function of vgrpo.py into a trampoline that runs one mutant at a time, and runs the fast-tier
tests that call the function (tests/mutmut.cfg, copied into the project's copy as setup.cfg). It leaves decorated
functions alone, so sample_ode, rollout and generate, which are @torch.no_grad(), would never be
mutated: the run works on a copy of the project in which those are wrapped after their definition instead
(`rollout = torch.no_grad()(rollout)`, the same function).
Prints the score per function as a markdown table; bench/results/mutation.md holds the last one and the survivors.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUNCTIONS = ["group_advantages", "per_reward_advantages", "soft_clip_advantages", "stratified_sigmas", "noise_levels",
             "per_pair", "noisy_latents", "elbo_surrogate", "vgrpo_loss", "draw_pairs", "sample_ode", "rollout",
             "surrogate", "old_surrogate", "update", "micro_batches", "rows_of", "train_iteration", "local_samples",
             "generate", "iteration_advantages"]
# reward.py: what turns images, prompts and metadata into the numbers the advantages are made of, and the parsing of
# the reward spec (loaders, HTTP and the served judge's transport are left out: they fail loudly or not at all)
REWARD_FUNCTIONS = ["to_uint8_images", "jpeg_reward", "clip_pixel_values", "clip_similarity_reward",
                    "openclip_to_transformers", "aesthetic_reward", "imagereward_key", "imagereward_pixel_values",
                    "imagereward_reward", "digit_ink", "prompted_digit", "digit_reward", "geneval_objects",
                    "relative_position", "geneval_clause_problem", "geneval_metadata_problem", "geneval_rules",
                    "geneval_correct", "geneval_partial_score", "detector_input", "mask2former_detections",
                    "_first_and_last", "jpeg_round_trip", "edit_distance", "quoted_text", "ocr_score", "ocr_target",
                    "ocr_reward", "prompt_file_problem", "unifiedreward_instruction", "unifiedreward_score",
                    "parse_unifiedreward_spec", "_split_weight", "parse_reward_spec", "metric_name", "as_rewards"]
# module: (its mutmut settings in tests/, the functions mutated by default)
MODULES = {"vgrpo": ("mutmut.cfg", FUNCTIONS), "reward": ("mutmut_reward.cfg", REWARD_FUNCTIONS)}
MUTMUT = os.path.join(os.path.dirname(sys.executable), "mutmut")  # its entry point (`python -m mutmut` re-imports)
SKIP = shutil.ignore_patterns(".git", ".venv", ".whl", "mutants", "runs", "__pycache__", ".pytest_cache", "hub_cache")


def prepare(work, tests, deselect, module="vgrpo"):
    """A copy of the project in `work` whose @torch.no_grad() functions of `module` are wrapped after their
    definition; `tests`, when given, replace the configuration's test files there, and `deselect` leaves some out
    (node ids)."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(HERE, work, ignore=SKIP)
    shutil.copy(os.path.join(HERE, "tests", MODULES[module][0]), os.path.join(work, "setup.cfg"))  # mutmut reads it
    if tests or deselect:
        with open(os.path.join(work, "setup.cfg")) as f:
            cfg = f.read()
        cfg = re.sub(r"(pytest_add_cli_args_test_selection =\n)((?:    .*\n)+)", lambda m: m.group(1) + "".join(
            f"    {t}\n" for t in tests or [line.strip() for line in m.group(2).splitlines()]) + "".join(
            f"    --deselect\n    {t}\n" for t in deselect), cfg)
        with open(os.path.join(work, "setup.cfg"), "w") as f:
            f.write(cfg)
    path = os.path.join(work, f"{module}.py")
    with open(path) as f:
        source = f.read()
    decorated = re.findall(r"^@torch\.no_grad\(\)\ndef (\w+)\(", source, flags=re.M)
    source = re.sub(r"^@torch\.no_grad\(\)\n(?=def )", "", source, flags=re.M)
    wraps = "".join(f"{name} = torch.no_grad()({name})\n" for name in decorated)
    if wraps:
        source = source.replace('\nif __name__ == "__main__":', f"\n{wraps}\n\nif __name__ == \"__main__\":", 1)
    with open(path, "w") as f:
        f.write(source)
    return decorated


def score(work, functions, module="vgrpo"):
    """mutmut's results -> {function: Counter(status)} for the functions asked."""
    out = subprocess.run([MUTMUT, "results", "--all", "true"], cwd=work, capture_output=True,
                         text=True, check=True).stdout
    counts = collections.defaultdict(collections.Counter)
    survivors = []
    for line in out.splitlines():
        m = re.match(rf"\s*{module}\.x_(\w+)__mutmut_\d+: (.+)", line)
        if m and m.group(1) in functions:
            counts[m.group(1)][m.group(2)] += 1
            if m.group(2) != "killed":
                survivors.append(line.split(":")[0].strip())
    return counts, survivors


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("functions", nargs="*", help="functions of the module to mutate (default: all of its list)")
    p.add_argument("--module", choices=MODULES, default="vgrpo", help="vgrpo.py (the method) or reward.py")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "vgrpo-mutation"),
                   help="scratch copy of the project, where mutmut keeps its mutants/ and results")
    p.add_argument("--max-children", type=int, default=1, help="mutants tested at once (2 cores: 1 leaves room)")
    p.add_argument("--tests", nargs="+", help="test files or node ids instead of tests/mutmut.cfg's (all must pass)")
    p.add_argument("--deselect", action="append", default=[], help="a test node id to leave out (repeatable)")
    p.add_argument("--survivors", action="store_true", help="only print the diffs of the last run's survivors")
    a = p.parse_args()
    a.functions = a.functions or MODULES[a.module][1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if not a.survivors:
        print("wrapped after definition:", ", ".join(prepare(a.work, a.tests, a.deselect, a.module)), flush=True)
        patterns = [f"{a.module}.x_{name}__mutmut_*" for name in a.functions]
        subprocess.run([MUTMUT, "run", "--max-children", str(a.max_children), *patterns],
                       cwd=a.work, env=env, check=True)
    counts, survivors = score(a.work, a.functions, a.module)
    if a.survivors:
        for name in survivors:
            print(subprocess.run([MUTMUT, "show", name], cwd=a.work, capture_output=True,
                                 text=True).stdout)
        return
    print("| function | mutants | killed | survived | other |\n| --- | --- | --- | --- | --- |")
    for name in a.functions:
        c = counts[name]
        other = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("killed", "survived"))
        print(f"| {name} | {sum(c.values())} | {c['killed']} | {c['survived']} | {other} |")
    total = sum(counts.values(), collections.Counter())
    print(f"| all | {sum(total.values())} | {total['killed']} | {total['survived']} | |")


if __name__ == "__main__":
    main()
