"""Tests of the benchmark (bench/): the pieces of the MDP, DiffusionNFT and MixGRPO baselines against independent
formulas, the headline table's arithmetic on made-up curves, and `python bench/run.py --quick` run as a user
would, its outputs checked.

    python -m pytest tests/test_bench.py -q
"""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
sys.path.insert(0, os.path.join(ROOT, "bench"))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

import mdp_baseline as mdp  # noqa: E402
import mixgrpo_baseline as mix  # noqa: E402
import nft_baseline as nft  # noqa: E402
import run as bench_run  # noqa: E402


@pytest.mark.parametrize("a", [0.0, 0.7, 1.5])
@pytest.mark.parametrize("t", [0.9, 0.6, 0.2])
def test_sde_step_keeps_a_gaussian_flow_on_its_marginals(a, t):
    """For data o ~ N(0, s0^2) the velocity is linear, v = k x, with k known in closed form, so one SDE step
    maps N(0, Var x_t) to N(0, c^2 Var x_t + std^2) exactly. That must be the marginal Var x_{t - dt} up to
    Euler-Maruyama's local error O(dt^2), for every noise level a: halving dt must cut the error about 4x
    (a wrong drift or noise term leaves an O(dt) error, which only halves)."""
    s0 = 0.5
    var = lambda u: (1 - u) ** 2 * s0 ** 2 + u ** 2                         # noqa: E731  Var x_u
    k = (t - (1 - t) * s0 ** 2) / var(t)                                    # E[eps - o | x] = k x

    def error(dt):
        x, f64 = torch.ones(1, 1, dtype=torch.float64), torch.float64
        mean, std = mdp.sde_step(x, k * x, torch.tensor(t, dtype=f64), torch.tensor(t - dt, dtype=f64), t_cap=0.99, a=a)
        assert std.item() == pytest.approx(a * math.sqrt(t / (1 - t)) * math.sqrt(dt), rel=1e-9)
        return abs(mean.item() ** 2 * var(t) + std.item() ** 2 - var(t - dt))

    errors = [error(dt) for dt in (0.004, 0.002, 0.001)]
    assert all(e2 < e1 / 3.5 + 1e-15 for e1, e2 in zip(errors, errors[1:])), errors


def test_noise_level_is_capped_at_the_first_step():
    assert torch.isfinite(mdp.noise_level(torch.tensor(1.0), 0.96, 0.7))
    assert mdp.noise_level(torch.tensor(1.0), 0.96, 0.7).item() == pytest.approx(0.7 * math.sqrt(0.96 / 0.04))


def test_gaussian_log_prob_matches_torch_distributions():
    x, m = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    std = torch.tensor([0.1, 0.5, 2.0]).view(3, 1, 1)
    ref = torch.distributions.Normal(m, std.expand_as(m)).log_prob(x).flatten(1).mean(1)
    assert torch.allclose(mdp.gaussian_log_prob(x, m, std), ref, atol=1e-5)


def test_mdp_loss_clips_per_step():
    A = torch.tensor([1.0, -1.0, 1.0])
    old = torch.zeros(3)
    new = torch.tensor([math.log(1.5), math.log(0.5), 0.0])
    loss, stats = mdp.mdp_loss(new, old, A, clip_eps=1e-4)
    # row 0: min(1.5, 1.0001) = 1.0001; row 1: min(-0.5, -0.9999) = -0.9999; row 2: 1
    assert loss.item() == pytest.approx(-(1.0001 - 0.9999 + 1.0) / 3, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)


def test_train_steps_are_distinct_per_sample():
    steps = mdp.train_steps(5, 10, 4, torch.Generator().manual_seed(0))
    assert steps.shape == (5, 4) and all(len(set(r.tolist())) == 4 for r in steps)
    assert steps.min() >= 0 and steps.max() < 10


# --------------------------------------------------------------------------- DiffusionNFT


def test_optimality_probability_by_hand():
    # group (1, 2, 3, 6): mean 3, population std sqrt(3.5); z = (-2, -1, 0, 3) / 1.8708 -> clipped to [-1, 1]
    r = nft.optimality_probability(torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0]), 4)
    z1 = -1 / math.sqrt(3.5)
    expected = [0.0, 0.5 + 0.5 * z1, 0.5, 1.0, 0.5, 0.5, 0.5, 0.5]   # an all-equal group carries no signal: 1/2
    assert r.tolist() == pytest.approx(expected, abs=1e-4)


def test_implicit_policies_by_hand():
    v_pos, v_neg = nft.implicit_policies(torch.tensor([1.0]), torch.tensor([3.0]), beta=0.5)
    assert v_pos.item() == pytest.approx(0.5 * 1 + 0.5 * 3) and v_neg.item() == pytest.approx(1.5 * 1 - 0.5 * 3)


@pytest.mark.parametrize("weighting, expected", [
    # v = eps - o = (0.8, 0.9); v+ = v_theta = (1.0, 0.6), v- = 2 v_old - v_theta = (0.0, 1.4)
    ("none", 0.75 * (0.2 ** 2 + 0.3 ** 2) / 2 + 0.25 * (0.8 ** 2 + 0.5 ** 2) / 2),
    # x0 errors are -sigma (v_hat - v): (-0.1, 0.15) and (0.4, -0.25); each MSE over its mean |error|
    ("adaptive", 0.75 * (0.01 + 0.0225) / 2 / 0.125 + 0.25 * (0.16 + 0.0625) / 2 / 0.325),
])
def test_nft_loss_by_hand(weighting, expected):
    o, eps, sigma = torch.tensor([[0.2, -0.4]]), torch.tensor([[1.0, 0.5]]), torch.tensor([0.5])
    x_t = (1 - 0.5) * o + 0.5 * eps
    loss, _ = nft.nft_loss(torch.tensor([[1.0, 0.6]]), torch.tensor([[0.5, 1.0]]), x_t, o, sigma,
                           torch.tensor([0.75]), beta=1.0, weighting=weighting)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("beta", [1.0, 0.3])
@pytest.mark.parametrize("r", [0.1, 0.5, 0.9])
def test_nft_loss_is_minimal_at_the_papers_optimum(beta, r):
    """With the plain flow-matching weighting the loss is a quadratic in v_theta whose minimiser is
    v_old + (2 r - 1) (v - v_old) / beta (the paper's improvement direction): the gradient vanishes there (a wrong
    sign or a swapped branch moves the minimiser), and its curvature is 2 beta^2 / (rows x dims) whatever r."""
    g = torch.Generator().manual_seed(0)
    o, eps, v_old = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([0.3, 0.6, 0.9])
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * o + sigma.view(-1, 1, 1, 1) * eps
    optimum = v_old + (2 * r - 1) * ((eps - o) - v_old) / beta

    def grad_at(v):
        v = v.clone().requires_grad_(True)
        nft.nft_loss(v, v_old, x_t, o, sigma, torch.full((3,), r), beta, weighting="none")[0].backward()
        return v.grad

    assert grad_at(optimum).abs().max() < 1e-6
    assert torch.allclose(grad_at(optimum + 0.1), torch.full_like(o, 2 * beta ** 2 * 0.1 / (3 * 32)), rtol=1e-3)


def test_nft_on_policy_gradient_is_beta_times_the_signed_flow_matching_error():
    """At v_theta = v_old (one step per rollout) the gradient is 2 beta (2 r - 1) (v_old - v) / (rows x dims):
    beta only scales it (the README's reason for not needing a wide beta sweep)."""
    g = torch.Generator().manual_seed(1)
    o, eps, v_old = (torch.randn(2, 3, 2, 2, generator=g) for _ in range(3))
    sigma, r = torch.tensor([0.4, 0.8]), torch.tensor([0.9, 0.2])
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * o + sigma.view(-1, 1, 1, 1) * eps
    for beta in (1.0, 0.1):
        v = v_old.clone().requires_grad_(True)
        nft.nft_loss(v, v_old, x_t, o, sigma, r, beta, weighting="none")[0].backward()
        expected = 2 * beta * (2 * r - 1).view(-1, 1, 1, 1) * (v_old - (eps - o)) / (2 * 12)
        assert torch.allclose(v.grad, expected, atol=1e-7)


# --------------------------------------------------------------------------- MixGRPO


def test_window_slides_one_step_every_shift_interval_and_rolls_back():
    # 10 steps, w = 4: starts 0..5 (the last step is never in the window), one step later every 8 iterations
    assert mix.window(0, 10, 4, 8) == [0, 1, 2, 3] and mix.window(7, 10, 4, 8) == [0, 1, 2, 3]
    assert mix.window(8, 10, 4, 8) == [1, 2, 3, 4] and mix.window(47, 10, 4, 8) == [5, 6, 7, 8]
    assert mix.window(48, 10, 4, 8) == [0, 1, 2, 3]                      # rolled back after 6 positions
    assert mix.window(3 * 8, 10, 2, 8) == [3, 4] and mix.window(8 * 8, 10, 2, 8) == [0, 1]
    with pytest.raises(ValueError, match="window size"):
        mix.window(0, 10, 10, 8)


class LinearFamily:
    """A stand-in model family whose velocity is v = 0.5 x + sigma (the model argument is ignored)."""

    @staticmethod
    def velocity(model, x, sigma, cond):
        return 0.5 * x + torch.as_tensor(sigma, dtype=torch.float32)


def test_mixed_rollout_is_the_euler_ode_outside_the_window_and_the_sde_inside():
    sigmas = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    noise, step_noise = torch.randn(3, 2, 2, 2, generator=g), torch.randn(3, 5, 2, 2, 2, generator=g)
    a, steps = 0.7, [2, 3]
    states, log_probs = mix.mixed_rollout(LinearFamily, None, (torch.zeros(3, 1),), noise, step_noise, sigmas,
                                          steps, a, micro_batch=2)
    x = noise
    for i in range(5):
        t, t_next = sigmas[i].item(), sigmas[i + 1].item()
        v = 0.5 * x + t
        if i in steps:   # Flow-GRPO's step, written out: level a sqrt(t / (1 - t)), drift with the score term
            level = a * math.sqrt(t / (1 - t))
            mean = x + (v + level ** 2 / (2 * t) * (x + (1 - t) * v)) * (t_next - t)
            std = level * math.sqrt(t - t_next)
            x = mean + std * step_noise[:, i]
            lp = torch.distributions.Normal(mean, std).log_prob(x).flatten(1).mean(1)
            assert torch.allclose(log_probs[:, i], lp, atol=1e-5)
        else:
            x = x + (t_next - t) * v
            assert (log_probs[:, i] == 0).all()
        assert torch.allclose(states[:, i + 1], x, atol=1e-5), i
    # the step noises outside the window are never used
    other = step_noise.clone()
    other[:, [0, 1, 4]] = 100.0
    again, _ = mix.mixed_rollout(LinearFamily, None, (torch.zeros(3, 1),), noise, other, sigmas, steps, a, 2)
    assert torch.equal(again, states)


# --------------------------------------------------------------------------- the headline table


def made_up_run(seed, curves, targets, inner_steps=1):
    """A run file as learning.py writes it: each method trains 1 s and 224 rows per iteration."""
    return {"seed": seed, "setup": {"iterations": 10, "eval_every": 2, "eval_dense": 0, "inner_steps": inner_steps},
            "methods": {kind: {"settings": {"kind": kind, "name": kind, "lr": 1e-3, "target_gain": targets[kind]},
                               "eval": ev, "check": [(it, 0.5) for it, _ in ev],
                               "train": [dict(nfe=224, time_rollout=0.5, time_reward=0.1, time_old=0.0,
                                              time_update=0.4)] * 10}
                        for kind, ev in curves.items()}}


def test_headline_ratios_by_hand():
    b = 0.3
    targets = {"V-GRPO": 0.0399, "DiffusionNFT": 0.0399, "MixGRPO": 0.0199, "MDP": 0.0199, "naive ELBO": 0.0399}
    flat = [(0, b), (10, b + 0.01)]                                                  # never reaches anything
    runs = [made_up_run(1, {"V-GRPO": [(0, b), (2, b + 0.025), (4, b + 0.05), (10, b + 0.05)],  # 0.02 at 2, 0.04 at 4
                            "DiffusionNFT": [(0, b), (4, b + 0.02), (8, b + 0.041), (10, b)],   # 0.04 at 8
                            "MixGRPO": flat, "MDP": flat, "naive ELBO": flat}, targets),
            made_up_run(2, {"V-GRPO": [(0, b), (2, b + 0.04), (10, b)],                         # both at 2
                            "DiffusionNFT": [(0, b), (6, b + 0.04), (10, b)],                   # 0.04 at 6
                            "MixGRPO": [(0, b), (2, b + 0.01), (4, b + 0.02), (10, b)],         # 0.02 at 4
                            "MDP": flat, "naive ELBO": flat}, targets)]
    assert bench_run.reaching(runs[0]["methods"]["DiffusionNFT"], 0.04)[0] == (8, 8 * 224, pytest.approx(8.0))
    assert bench_run.reaching(runs[0]["methods"]["MixGRPO"], 0.02) == (None, (10, 2240, pytest.approx(10.0)))
    # with 4 optimizer steps per rollout, 8 iterations are 32 gradient steps
    assert bench_run.reaching(runs[0]["methods"]["DiffusionNFT"], 0.04, 4)[0][0] == 32
    sweep = {"setup": {"iterations": 4, "eval_every": 2}, "methods": {
        k: {"settings": {"kind": k, "lr": 1e-3}, "eval": [(0, b), (2, b + 0.1)], "check": [(0, b), (2, b + 0.05)]}
        for k in bench_run.HEADLINE_KINDS}}
    table = bench_run.headline_table(sweep, runs, "one-step")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.split("### Time to")[1].split("### At the cap")[0].splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in bench_run.HEADLINE_KINDS}
    assert set(rows) == set(bench_run.HEADLINE_KINDS[1:])               # one row per baseline, V-GRPO in each
    # NFT at 0.04: 8 / 4 and 6 / 2 -> 2 and 3, mean 2.5 ± 0.5
    assert rows["DiffusionNFT"][:7] == ["+0.040", "lr 0.001, beta 1; lr 0.001", "2/2; 2/2", "8 / 6; 4 / 2",
                                        "1,792 / 1,344; 896 / 448", "8 / 6; 4 / 2", "2.50 ± 0.50 (2.00 / 3.00)"]
    # MixGRPO at 0.02 (V-GRPO reaches it at 2 in both seeds): a failure on seed 1, 4 / 2 on seed 2
    assert rows["MixGRPO"][2:4] == ["1/2; 2/2", "failed / 4; 2 / 2"]
    # a failure enters no mean and is shown as one, never as a ratio or a bound
    assert rows["MixGRPO"][6] == "2.00 ± 0.00 on the 1 of 2 seeds reached (failed / 2.00)"
    assert rows["MixGRPO"][9] == "2.00 ± 0.00 on the 1 of 2 seeds reached (failed / 2.00), x 1.00 per iteration"
    assert rows["MDP"][6] == "never reached (failed / failed)"
    assert bench_run.ratio_cell([5.0, 3.0], [True, True]) == "never reached (failed / failed)"
    # at the cap: each method's final accuracy and gain per seed, and the k-NN check's
    cap = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
           for line in table.split("### At the cap")[1].splitlines() if line.startswith("| ") and "---" not in line}
    # (accuracy is the lower judge's: here the CNN's, below the k-NN's constant 0.5)
    assert cap["V-GRPO"] == ["0.350 / 0.300", "+0.025 ± 0.025", "0.350 / 0.300", "+0.025 ± 0.025", "0.500 / 0.500",
                             "+0.000 ± 0.000"]
    # the sweep's row: the lower judge's curve (0.3, then min(0.4, 0.35)): score 0.35, final gain (the last two
    # evaluations' mean) +0.025; the CNN's and the k-NN's final gains
    assert "| **V-GRPO** | 0.350 | +0.025 | +0.050 | +0.025 |" in table


def test_the_full_runs_jobs_run_side_by_side_logged_and_a_failure_names_its_command_and_log(tmp_path, capsys):
    """bench/run.py's full mode (hours: never run here) launches its learners through run_commands: each command's
    output goes to its log, `jobs` at a time, and one failing command fails the run, naming it and its log."""
    ok, bad = tmp_path / "ok.log", tmp_path / "bad.log"
    script = "import os, sys; print(os.environ['OMP_NUM_THREADS'], os.environ['HF_HUB_OFFLINE']); sys.exit({})"
    bench_run.run_commands([([sys.executable, "-c", script.format(0)], str(ok))], jobs=2)
    assert ok.read_text() == "1 1\n"   # one thread each: the jobs share the cores; never a download
    assert "done in" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match=rf"failed \(exit 3\); see {bad}$"):
        bench_run.run_commands([([sys.executable, "-c", script.format(0)], str(ok)),
                                ([sys.executable, "-c", script.format(3)], str(bad))], jobs=2)
    assert bad.read_text() == "1 1\n"


@pytest.mark.slow
def test_run_quick_writes_every_result(tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), "--quick", "--out", str(out)],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    for name in ("variance.md", "learning.md", "learning.png", "cost.md", "learning/jpeg-0.json",
                 "learning/colour-0.json", "headline.md", "headline-one-step.png", "headline-multi-step.png",
                 "headline/one-step/sweep.json", "headline/one-step/seed-1.json", "headline/multi-step/seed-1.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    learning_md = (out / "learning.md").read_text()
    assert "1 optimizer step(s) per iteration" in learning_md and "V-GRPO, naive ELBO, MDP interleaved" in learning_md
    for method in ("V-GRPO", "naive ELBO", "MDP"):
        assert learning_md.count(f"| {method} |") == 2, method          # one row per reward
    rows = [line.split("|") for line in learning_md.splitlines() if line.startswith("| ") and "---" not in line
            and "method" not in line]
    for row in rows:
        final = float(row[2].split("±")[0])
        assert math.isfinite(final) and -2 < final < 0                 # both rewards are negative, above -sqrt(3)
    assert "V-GRPO 0.0e+00" in learning_md                              # V-GRPO's first ratio is exactly 1 (measured)
    headline_md = (out / "headline.md").read_text()
    assert (out / "headline-one-step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert headline_md.count("## ") - headline_md.count("### ") == 2    # both regimes
    for kind in bench_run.HEADLINE_KINDS[1:]:
        assert headline_md.count(f"| {kind} | +") == 2, kind            # one row per baseline and regime
    for kind in bench_run.HEADLINE_KINDS:
        assert headline_md.count(f"| {kind} | 0.") + headline_md.count(f"| {kind} | 1.") == 2, kind   # at the cap
    assert headline_md.count("| MixGRPO lr") + headline_md.count("| **MixGRPO lr") == 4   # w = 2 and 1, twice
    assert headline_md.count("DiffusionNFT lr") == 4                    # beta 1 and 0.1, in each regime
    assert headline_md.count("| **") == 10                              # one chosen setting per method and regime
    multi = json.loads((out / "headline" / "multi-step" / "seed-1.json").read_text())
    assert multi["setup"]["inner_steps"] == 4 and all(len(m["train"]) == 2 for m in multi["methods"].values())
    assert multi["methods"]["V-GRPO"]["train"][0]["time_old"] > 0       # several steps: an old-surrogate pass
    cost_md = (out / "cost.md").read_text()
    ratios = [float(c.strip().rstrip("x")) for line in cost_md.splitlines() for c in line.split("|")
              if c.strip().endswith("x") and c.strip()[:-1].replace(".", "").isdigit()]
    assert len(ratios) == 5 and all(0.05 < r < 20 for r in ratios)     # update x2, rollout x2, memory
    assert "max |difference| 0.00e+00" in cost_md                      # Euler rollout == the diffusers pipeline
    variance_md = (out / "variance.md").read_text()
    assert variance_md.count("\n| ") == 7                              # header, rule, 5 settings
    assert variance_md.startswith("Pretrained digits SD3")
    rows = {line.split("|")[1].strip(): [float(c.split("±")[0]) for c in line.split("|")[2:4]]
            for line in variance_md.splitlines()
            if line.startswith("| ") and "---" not in line and "setting" not in line}
    naive, full = rows["naive (FPO-style)"], rows["all three (V-GRPO)"]
    assert full[0] < naive[0] and full[1] < naive[1] / 3    # the reductions reduce, sharing most within groups


@pytest.mark.slow
def test_gpu_bench_quick_mode(tmp_path):
    """bench/gpu.py: its real configurations have the released checkpoints' sizes (built on the meta device, no
    memory); `--quick` (the GPU mode's code on tiny transformers, CPU) run as a user runs it times every phase of
    both models, its tables follow from the measured seconds, and it says it did not run on a GPU; with
    --time-limit 0 it measures nothing and says so."""
    import json

    import gpu

    # bf16 files: SD3.5-M's transformer 4.94 GB (with its 384 x 384 x 1536 positional-embedding buffer), FLUX.1-dev's
    # 23.8 GB; a wrong depth, width or number of dual-attention layers is off by more than 1%
    for cls_name, config, size in (("SD3Transformer2DModel", gpu.SD3_CONFIG, 4.94e9),
                                   ("FluxTransformer2DModel", gpu.FLUX_CONFIG, 23.8e9)):
        model = gpu.build_transformer(cls_name, config, "meta", torch.bfloat16)
        assert {(t.device.type, t.dtype) for t in model.parameters()} == {("meta", torch.bfloat16)}
        assert 2 * sum(t.numel() for t in [*model.parameters(), *model.buffers()]) == pytest.approx(size, rel=0.01)

    out = tmp_path / "gpu.md"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--quick", "--modes", "eager",
                        "--kernels", "--out", str(out)], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    md, data = out.read_text(), json.loads((tmp_path / "gpu.json").read_text())
    assert "**Not run on a GPU.**" in md and not data["gpu"] and data["dtype"] == "float32"
    # --kernels: every kernel at every shape, in a child process; on the CPU torch's flash and math kernels run and
    # agree with float32 math attention, the CUDA-only ones report that they have no kernel here
    kernels = data["kernels"]
    assert kernels["kernels"][:3] == ["flash", "efficient", "math"] and kernels["kernels"][-1] == "cudnn"
    assert len(kernels["rows"]) == len(kernels["kernels"]) * len(kernels["shapes"]) == len(kernels["kernels"]) * 6
    for r in kernels["rows"]:
        s = next(s for s in kernels["shapes"] if (s["model"], s["phase"]) == (r["model"], r["phase"]))
        if r["kernel"] in ("flash", "math"):
            assert r["error"] is None and r["max_rel_diff"] < 1e-5 and r["ms"] > 0
            flops = gpu.attention_flops(s["rows"], s["heads"], s["tokens"], s["head_dim"], r["phase"].startswith("update"))
            assert r["tflops"] == pytest.approx(flops / r["ms"] / 1e9)
        elif r["kernel"] in ("efficient", "cudnn"):
            assert "No viable backend" in r["error"]
    assert set(kernels["picked"].values()) == {"flash"}                    # the CPU's choice under the default
    # the same results as a GPU run reports them: rates against the chip's peak, and the speed targets met or not
    measured = json.loads(json.dumps(data["results"]))
    ph = measured[0]["phases"]
    ph["rollout"]["tflops"], ph["update"]["tflops"] = 0.41 * 989, 0.29 * 989
    assert data["matmul_tflops"] > 0                                       # the CPU's float32 rate, in quick mode
    on_gpu = gpu.report(measured, dict(data, gpu=True, device="NVIDIA H200", peak_tflops=989, gpus=8,
                                       matmul_tflops=791))
    assert "NVIDIA H200 (dense bf16 peak 989 TFLOP/s; an 8192^3 bf16 matrix product ran at 791 TFLOP/s here" in on_gpu
    assert "SD3.5-M rollout 41% of peak, 51% of the matrix product's (target 40%: met); SD3.5-M update 29% of " \
           "peak, 36% of the matrix product's (target 30%: missed); FLUX.1-dev rollout 0% of peak" in on_gpu
    fastest = min(split["total"] for split in (measured[0]["split"], measured[0]["split_compiled"]) if split)
    assert f"SD3.5-M iteration {fastest:.1f} s per GPU of 8 (target 69.7 s: met)." in on_gpu    # (tiny: fast)
    # a split without its decode and reward (--time-limit) is a lower bound, never judged against the target
    cut = json.loads(json.dumps(measured[:1]))
    for phase in ("decode", "reward"):
        del cut[0]["phases"][phase]
    cut = [gpu.with_splits(res, data["gpus"]) for res in cut]     # as the run split them
    whole = measured[0]["split"]
    assert cut[0]["split"]["unmeasured"] == ["decode", "reward"] and cut[0]["split"]["decode"] is None
    assert cut[0]["split"]["total"] == pytest.approx(whole["total"] - whole["decode"] - whole["reward"])
    text = gpu.report(cut, dict(data, gpu=True, device="NVIDIA H200", peak_tflops=989, gpus=8))
    assert "SD3.5-M iteration not measured whole (target 69.7 s)." in text
    assert f"| not measured | not measured | {whole['old surrogate']:.1f} (0%) |" in text
    assert f"| > {cut[0]['split']['total']:.1f} | < " in text
    assert "FLUX.1-dev update not measured (target 45%)" in gpu.report(
        measured[:1], dict(data, gpu=True, device="NVIDIA H200", peak_tflops=989, gpus=8))
    assert f"| SD3.5-M 64 px | rollout | 16 | 16 x 10 steps | {ph['rollout']['seconds']:.3f} | 405 | 41.0% |" in on_gpu
    assert "on 8 GPUs, seconds per GPU projected from this one's phases" in on_gpu
    assert "**Not run on a GPU.**" not in on_gpu
    assert "| SD3.5-M | update (image tokens) | 64 x 2 x 16 x 8 | " in md and "no such kernel for these inputs" in md
    assert [r["model"] for r in data["results"]] == ["SD3.5-M", "FLUX.1-dev"]
    for r in data["results"]:
        ph, split, recipe = r["phases"], r["split"], r["recipe"]
        assert list(ph) == ["rollout", "forwards", "old surrogate", "update", "decode", "reward"]
        assert r["lora_rank"] == 32
        assert r["image_tokens"] == 16 and r["text_tokens"] == 8       # 64 px, 8x VAE, 2x2 patches; 8 text tokens
        # one sample's update: N_MC rows forward, recomputed (checkpointing) and backward: 2 to 5 forwards a row
        assert 2 * r["n_mc"] < r["flops_update_sample"] / r["flops_forward_row"] < 5 * r["n_mc"]
        rollout, upd = ph["rollout"], ph["update"]
        assert rollout["tflops"] == pytest.approx(
            r["flops_forward_row"] * r["sample_batch"] * r["steps"] / rollout["seconds"] / 1e12)
        # the rollout's forwards alone: the same FLOPs, scaled to the recipe's steps as the rollout is
        forwards = ph["forwards"]
        assert forwards["tflops"] * forwards["seconds"] == pytest.approx(rollout["tflops"] * rollout["seconds"])
        assert f"{r['model']} eager {rollout['seconds'] / forwards['seconds']:.3f}x" in md
        assert upd["tflops"] == pytest.approx(r["flops_update_sample"] * r["micro_batch"] / upd["seconds"] / 1e12)
        assert upd["images_per_s"] == pytest.approx(r["micro_batch"] / upd["seconds"])
        n = recipe["P"] * recipe["G"]                                  # one process holds every sample
        assert split["rollout"] == pytest.approx(n / r["sample_batch"] * rollout["seconds"])
        assert split["update"] == pytest.approx(n / r["micro_batch"] * upd["seconds"])
        assert split["decode"] == pytest.approx(n / r["decode_batch"] * ph["decode"]["seconds"])
        assert split["reward"] == pytest.approx(n / ph["reward"]["samples"] * ph["reward"]["seconds"])
        assert split["total"] == pytest.approx(sum(split[k] for k in ("rollout", "decode", "reward", "old surrogate",
                                                                       "update")))
        assert recipe["inner_steps"] == 1 and split["old surrogate"] == 0   # one inner step: no old pass
        assert r["text_s_per_prompt"] > 0 and r["compiled"] is None and r["split_compiled"] is None
        assert md.count(f"| {r['model']} 64 px (tiny) | ") == 6 and md.count(f"| {r['model']} | 4 x 8, ") == 1
    assert "Where the time goes" not in md                          # no --profile
    compiled_out = tmp_path / "compiled.md"   # both modes, one model: the compiled phases beside the eager ones
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--quick", "--models", "sd3",
                        "--rollout-steps", "2", "--profile", "--out", str(compiled_out)], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads((tmp_path / "compiled.json").read_text())["results"][0]
    assert list(r["compiled"]) == ["rollout", "forwards", "old surrogate", "update"]
    # the first run of each compiled graph compiled: the rollout's (no gradients; the forwards run it again) and the
    # old surrogate's (with gradients, as vgrpo runs it compiled: the update's forward reuses it)
    for phase, c in r["compiled"].items():
        assert c["seconds"] > 0 and (phase in ("forwards", "update") or c["warm_up_s"] > c["seconds"] and
                                     c["compile_s"] > 0)
    assert r["split_compiled"]["update"] == pytest.approx(n / r["micro_batch"] * r["compiled"]["update"]["seconds"])
    assert r["split_compiled"]["decode"] == r["split"]["decode"]     # the VAE is not compiled: the eager figure
    md = compiled_out.read_text()
    assert "| SD3.5-M | 4 x 8, 10 steps, N_MC 4, 1 inner step(s) | compiled |" in md
    # --profile: the top operations of one rollout and one update, of the compiled blocks (their calls are listed)
    assert r["profile_mode"] == "compiled" and list(r["profile"]) == ["rollout", "update"]
    for phase in ("rollout", "update"):
        assert f"Where the time goes: SD3.5-M, one {phase} (compiled)" in md
        assert "Self CPU time total" in r["profile"][phase] and "aten::mm" in r["profile"][phase]
    assert "CompiledFunction" in r["profile"]["update"] and "Torch-Compiled Region" in r["profile"]["rollout"]
    # --modes compiled: the transformer's phases measured compiled only, reported in the compiled columns (the VAE
    # and the reward, never compiled, in the eager ones) and split as compiled
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--quick", "--models", "sd3",
                        "--rollout-steps", "2", "--modes", "compiled", "--out", str(tmp_path / "only.md")], env=ENV,
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    only = json.loads((tmp_path / "only.json").read_text())["results"][0]
    assert list(only["phases"]) == ["decode", "reward"] and only["split"] is None
    assert list(only["compiled"]) == ["rollout", "forwards", "old surrogate", "update"] and only["split_compiled"]
    c, md = only["compiled"]["update"], (tmp_path / "only.md").read_text()
    assert f"| SD3.5-M 64 px (tiny) | update | {c['samples']} | {r['micro_batch'] * r['n_mc']}, fwd + bwd |  | |  | " \
           f"{c['seconds']:.3f} |" in md
    assert "| compiled |" in md and "| eager |" not in md

    gpu.main(["--quick", "--time-limit", "0", "--out", str(tmp_path / "nothing.md")])
    nothing = (tmp_path / "nothing.md").read_text()
    assert "Not measured, --time-limit reached first: SD3.5-M, FLUX.1-dev." in nothing and "(tiny) |" not in nothing

    # --merge (bench/device.sh's rerun of the models a first run had no time for): one report, measuring nothing, of
    # each model's last result; a skip that a later run measured is gone, one that none did stays
    runs = [str(tmp_path / name) for name in ("nothing.json", "gpu.json", "compiled.json")]
    assert gpu.main(["--merge", ",".join(runs), "--out", str(tmp_path / "merged.md")]) == 0
    merged, merged_md = json.loads((tmp_path / "merged.json").read_text()), (tmp_path / "merged.md").read_text()
    assert merged["results"] == [r, data["results"][1]]                # SD3.5-M compiled (the last run), FLUX eager
    assert merged["skipped"] == [] and merged["kernels"] == data["kernels"] and merged["command"].count("; then ") == 2
    assert "| SD3.5-M | 4 x 8, 10 steps, N_MC 4, 1 inner step(s) | compiled |" in merged_md
    assert "| FLUX.1-dev 64 px (tiny) | update |" in merged_md and "Not measured" not in merged_md
    gpu.main(["--merge", f"{runs[0]},{runs[2]}", "--out", str(tmp_path / "partly.md")])
    assert "Not measured, --time-limit reached first: FLUX.1-dev." in (tmp_path / "partly.md").read_text()
    gpu.main(["--merge", f"{runs[1]},{runs[0]}", "--out", str(tmp_path / "later.md")])   # skipped after measured
    assert "Not measured" not in (tmp_path / "later.md").read_text()
    assert json.loads((tmp_path / "later.json").read_text())["results"] == data["results"]
    # a run cut off while measuring SD3.5-M (device.sh's kill) after its first phase: alone, its partial result is
    # shown as unfinished; after a run that measured more of it, it replaces nothing
    first_phase = dict(list(data["results"][0]["phases"].items())[:1])
    partial = {k: v for k, v in data["results"][0].items() if k not in ("compiled", "profile", "text_s_per_prompt")}
    cut = dict(data, results=[dict(partial, phases=first_phase, cut_off=True)], command="python bench/gpu.py (cut)",
               unfinished=["SD3.5-M (being measured)", "FLUX.1-dev"])
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    gpu.main(["--merge", str(tmp_path / "cut.json"), "--out", str(tmp_path / "alone.md")])
    alone = json.loads((tmp_path / "alone.json").read_text())
    assert alone["unfinished"] == cut["unfinished"] and alone["results"][0]["cut_off"]
    assert "**Incomplete**" in (tmp_path / "alone.md").read_text()
    gpu.main(["--merge", f"{runs[1]},{tmp_path / 'cut.json'}", "--out", str(tmp_path / "after.md")])
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["results"] == data["results"] and after["unfinished"] == []
    assert "Incomplete" not in (tmp_path / "after.md").read_text()
    # a file of the older bench/gpu.py, whose split counted a decode and reward cut by --time-limit as 0 s: merged,
    # the split is made again, a lower bound not judged against the target
    old = json.loads(json.dumps(data))
    for phase in ("decode", "reward"):
        del old["results"][0]["phases"][phase]
    old["results"][0]["split"].update(decode=0.0, reward=0.0)
    del old["results"][0]["split"]["unmeasured"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    gpu.main(["--merge", str(tmp_path / "old.json"), "--out", str(tmp_path / "from-old.md")])
    assert json.loads((tmp_path / "from-old.json").read_text())["results"][0]["split"]["decode"] is None
    assert "| not measured | not measured |" in (tmp_path / "from-old.md").read_text()
    gpu.main(["--merge", f"{runs[0]},{runs[0]}", "--out", str(tmp_path / "twice.md")])   # each entry once
    assert "Not measured, --time-limit reached first: SD3.5-M, FLUX.1-dev." in (tmp_path / "twice.md").read_text()
    (tmp_path / "other.json").write_text(json.dumps(dict(json.loads(open(runs[0]).read()), device="NVIDIA H200")))
    with pytest.raises(SystemExit, match="differ in device"):
        gpu.main(["--merge", f"{runs[0]},{tmp_path / 'other.json'}", "--out", str(tmp_path / "refused.md")])


@pytest.mark.parametrize("name", ["sd3", "qwen-image"])
def test_the_gpu_bench_times_the_rollouts_own_forwards_against_it(name):
    """bench/gpu.py's "forwards" phase calls the transformer exactly as vgrpo.rollout does on the same inputs (rows,
    CFG's doubled rows for Qwen-Image, sigmas, conditioning), once per ODE step, so rollout / forwards is the ODE
    loop's own cost."""
    import gpu
    import vgrpo

    family, args, cond_shapes = gpu.make_family(name, True, torch.device("cpu"))
    cond, noise, sigmas, _ = gpu.inputs(family, args, cond_shapes, 4, torch.device("cpu"))
    first_k = torch.cat([sigmas[:3], sigmas[-1:]])                  # 3 steps, as --rollout-steps 3 times them
    negative = vgrpo.rows_of(cond, slice(0, 1)) if family.cfg and args.guidance > 1 else None
    assert (negative is not None) == (name == "qwen-image")
    calls, velocity = {}, family.velocity

    def counted(key):
        def call(model, x, sigma, c):
            calls.setdefault(key, []).append((x.shape, x.dtype, sigma.item(), [(t.shape, t.dtype) for t in c]))
            return velocity(model, x, sigma, c)
        return call

    sb = args.sample_batch
    family.velocity = counted("rollout")
    vgrpo.rollout(family, family.transformer, vgrpo.rows_of(cond, slice(0, sb)), noise[:sb], first_k, args, negative)
    family.velocity = counted("forwards")
    gpu.bare_forwards(family, family.transformer, vgrpo.rows_of(cond, slice(0, sb)), noise[:sb], first_k, negative)
    assert len(calls["rollout"]) == 3 and calls["forwards"] == calls["rollout"]
    assert calls["rollout"][0][0][0] == sb * (2 if negative is not None else 1)


def test_the_gpu_bench_writes_after_every_phase_and_reports_a_failing_one(tmp_path, monkeypatch):
    """bench/gpu.py writes its report after every phase, marked incomplete until the end, so a run that device.sh's
    timeout kills keeps what it measured and says so; a phase that raises (out of memory, a compile error) ends
    that part of the model's measurement, named in the report with what was measured kept, the next part and the
    next model still run and the exit status is 1. A compiled split is not made of eager and compiled phases mixed."""
    import gpu
    import vgrpo

    real_update, written, real_write = vgrpo.update, [], gpu.write

    def failing_update(family, model, optimizer, params, batch, args, *a):   # the FLOP count's (one sample) runs
        if args.micro_batch > 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_update(family, model, optimizer, params, batch, args, *a)

    def recording_write(results, kernels, a, where, gpus, skipped, failed, unfinished, argv):
        written.append(([sorted(res["phases"]) for res in results], list(unfinished)))
        return real_write(results, kernels, a, where, gpus, skipped, failed, unfinished, argv)

    monkeypatch.setattr(vgrpo, "update", failing_update)
    monkeypatch.setattr(gpu, "write", recording_write)
    out = tmp_path / "gpu.md"
    assert gpu.main(["--quick", "--modes", "eager", "--repeats", "1", "--out", str(out)]) == 1
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["model"] for r in data["results"]] == ["SD3.5-M", "FLUX.1-dev"]        # the next model ran
    for r in data["results"]:   # the update failed; the decode, the reward and the text encoders still ran
        assert list(r["phases"]) == ["rollout", "forwards", "old surrogate", "decode", "reward"]
        assert r["error"] == "eager: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
        assert r["text_s_per_prompt"] > 0
    md = out.read_text()
    assert "**Failed** (what was measured before the error is above): SD3.5-M: eager: RuntimeError: CUDA out " in md
    assert "**Incomplete**" not in md and not data["unfinished"]
    # written at the start, after each phase as it was measured (5 and the text encoders), after each model and at
    # the end; all but the last say what is unfinished
    assert written[0] == ([], ["SD3.5-M", "FLUX.1-dev"]) and len(written) == 1 + 2 * 7 + 1
    assert written[1] == ([["rollout"]], ["SD3.5-M (being measured)", "FLUX.1-dev"])
    assert written[2] == ([["forwards", "rollout"]], ["SD3.5-M (being measured)", "FLUX.1-dev"])
    assert written[7] == ([["decode", "forwards", "old surrogate", "reward", "rollout"]], ["FLUX.1-dev"])
    assert written[8][1] == ["FLUX.1-dev (being measured)"] and written[-2][1] == written[-1][1] == []
    # a compiled split needs the compiled rollout, old surrogate and update: not eager ones filling in
    eager = data["results"][0]["phases"]
    partial = dict(data["results"][0], phases=dict(eager, update=eager["old surrogate"]),   # every eager phase
                   compiled={"rollout": eager["rollout"]})                                    # one compiled phase
    assert gpu.with_splits(partial, 1)["split"] is not None and partial["split_compiled"] is None
    assert gpu.main(["--quick", "--time-limit", "0", "--out", str(tmp_path / "none.md")]) == 0


@pytest.mark.parametrize("name", ["sd3", "flux", "qwen-image"])
def test_the_kernel_probes_shapes_are_those_the_models_attend_at(name, monkeypatch):
    """bench/gpu.py --kernels times attention at attention_shapes: they must be the (rows, heads, tokens, head dim)
    that scaled_dot_product_attention receives in the model's rollout (CFG's doubled rows for Qwen-Image) and in its
    update (a micro-batch of N_MC rows a sample), SD3's image-only attention included, with a mask where the model
    passes one (Qwen-Image's text mask), recorded here from the tiny models' own passes."""
    import dataclasses

    import gpu
    import vgrpo

    device = torch.device("cpu")
    family, args, cond_shapes = gpu.make_family(name, True, device)
    params = vgrpo.add_trainable_weights(family, args)
    mb = gpu.micro_batch(args, 1, True)
    cond, noise, sigmas, batch = gpu.inputs(family, args, cond_shapes, mb, device)
    seen, sdpa = {}, torch.nn.functional.scaled_dot_product_attention

    def recorded(phase):
        def call(*a, **kw):   # diffusers' attention dispatch passes query= ...
            mask = kw.get("attn_mask", a[3] if len(a) > 3 else None)
            seen.setdefault(phase, set()).add((*(a[0] if a else kw["query"]).shape, mask is not None))
            return sdpa(*a, **kw)
        return call

    negative = vgrpo.rows_of(cond, slice(0, 1)) if family.cfg and args.guidance > 1 else None
    sb = args.sample_batch
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded("rollout"))
    vgrpo.rollout(family, family.transformer, vgrpo.rows_of(cond, slice(0, sb)), noise[:sb],
                  torch.cat([sigmas[:1], sigmas[-1:]]), args, negative)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded("update"))
    one = dataclasses.replace(args, micro_batch=mb, group_size=mb, inner_steps=1)
    vgrpo.update(family, family.transformer, torch.optim.AdamW(params), params, batch, one, 1)
    expected = {}
    for model, phase, rows, heads, tokens, dim, masked in gpu.attention_shapes([name], True, 1):
        assert model == gpu.TITLES[name]
        expected.setdefault(phase.split(" (")[0], set()).add((rows, heads, tokens, dim, masked))
    assert seen == expected, (seen, expected)
    assert len(expected["rollout"]) == (2 if name == "sd3" else 1)     # SD3's dual blocks: the image tokens alone


def test_attention_flops_are_torchs_count_of_a_fused_kernel():
    """The kernel probe's FLOPs (bench/gpu.attention_flops) equal what torch's FlopCounterMode counts for a fused
    attention kernel (the memory-efficient one, on meta tensors), forward alone and forward + backward: the count
    the phases' TFLOP/s get on a GPU, so the probe's rates compare with theirs."""
    import gpu

    q, k, v = (torch.randn(3, 2, 24, 8, device="meta", requires_grad=True) for _ in range(3))

    def attend():
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[0]

    with torch.no_grad():
        assert gpu.count_flops(attend) == gpu.attention_flops(3, 2, 24, 8, backward=False)
    grad = torch.ones(3, 2, 24, 8, device="meta")
    assert gpu.count_flops(lambda: torch.autograd.grad(attend(), (q, k, v), grad)) == \
        gpu.attention_flops(3, 2, 24, 8, backward=True)


def test_the_kernel_probe_keeps_what_it_measured_before_its_process_died(tmp_path, monkeypatch):
    """cuDNN attention's known failure kills the probe's process (an illegal memory access): the rows it printed
    before are kept, and every kernel and shape it did not reach is reported with the process's last error line,
    not left out. Likewise for a probe that runs past its time."""
    import gpu

    shapes = gpu.attention_shapes(["sd3"], True, 1)
    first = dict(kernel="flash", model="SD3.5-M", phase="rollout", ms=1.0, tflops=2.0, error=None, max_rel_diff=0.0)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(first)}'\necho 'warning: something' >&2\n"
                    "echo 'RuntimeError: CUDA error: an illegal memory access was encountered' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(gpu.sys, "executable", str(fake))
    probe = gpu.measure_kernels(["sd3"], True, 1, timeout=30)
    assert probe["kernels"] == gpu.sdpa_kernels() and probe["kernels"][-1] == "cudnn"
    assert probe["rows"][0] == first and len(probe["rows"]) == len(probe["kernels"]) * len(shapes)
    for r in probe["rows"][1:]:
        assert r["error"] == "the probe stopped: exit 1: RuntimeError: CUDA error: an illegal memory access was " \
                             "encountered"
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(first)}'\nsleep 30\n")
    probe = gpu.measure_kernels(["sd3"], True, 1, timeout=2)
    assert probe["rows"][0] == first and probe["rows"][1]["error"] == "the probe stopped: timed out after 2 s"
    lines = gpu.kernel_lines(probe, dict(peak_tflops=None, gpu=False))
    assert "| SD3.5-M | rollout | 16 x 2 x 24 x 8 | 1 ms, 2, diff 0 | the probe stopped: timed out after 2 s |" in \
        "\n".join(lines)


def test_gpu_bench_quick_mode_runs_the_newer_models_with_true_cfg(tmp_path):
    """bench/gpu.py --models qwen-image,flux2-klein: their real configurations have the published sizes (Qwen-Image's
    transformer 20B, klein's 4B, on the meta device), and --quick runs every phase through their families, the
    rollout with CFG's two rows per sample counted in its FLOPs, their own LoRA rank."""
    import json

    import gpu

    for name, size in (("qwen-image", 20e9), ("flux2-klein", 4e9)):
        cls_name, config, _, _ = gpu.MODELS[name]
        model = gpu.build_transformer(cls_name, config, "meta", torch.bfloat16)
        assert sum(t.numel() for t in model.parameters()) == pytest.approx(size, rel=0.05)
    out = tmp_path / "gpu.md"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--quick", "--modes", "eager",
                        "--models", "qwen-image,flux2-klein", "--out", str(out)], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["model"] for r in data["results"]] == ["Qwen-Image", "FLUX.2 [klein] 4B"]
    for r in data["results"]:
        assert list(r["phases"]) == ["rollout", "forwards", "old surrogate", "update", "decode", "reward"]
        assert r["cfg"] and r["lora_rank"] == 64 and r["split"]["total"] > 0
        rollout = r["phases"]["rollout"]
        assert rollout["tflops"] == pytest.approx(
            2 * r["flops_forward_row"] * r["sample_batch"] * r["steps"] / rollout["seconds"] / 1e12)


def test_reuse_keeps_only_a_seed_run_with_the_same_settings_and_cap(tmp_path):
    chosen = {"V-GRPO": {"name": "V-GRPO", "kind": "V-GRPO", "lr": 0.006, "target_gain": 0.17},
              "MixGRPO": {"name": "MixGRPO", "kind": "MixGRPO", "lr": 0.02, "window": 4, "target_gain": 0.17}}
    path = tmp_path / "seed-1.json"
    assert not bench_run.same_run(str(path), chosen, 96)                 # never run
    path.write_text(json.dumps({"setup": {"iterations": 96},
                                "methods": {k: {"settings": v} for k, v in chosen.items()}}))
    assert bench_run.same_run(str(path), chosen, 96)
    assert not bench_run.same_run(str(path), chosen, 48)                 # another cap
    other = {**chosen, "MixGRPO": {**chosen["MixGRPO"], "window": 2}}
    assert not bench_run.same_run(str(path), other, 96)                  # another setting


def test_largest_fall_is_the_deepest_drop_below_the_best_so_far():
    import stability

    assert stability.largest_fall([0.3, 0.6, 0.5, 0.7, 0.55, 0.69]) == pytest.approx(0.15)
    assert stability.largest_fall([0.3, 0.4, 0.4, 0.5]) == 0.0
    assert stability.largest_fall([0.8, 0.2, 0.9]) == pytest.approx(0.6)


@pytest.mark.slow
def test_stability_quick_mode_runs_the_demo_per_candidate_and_reports_from_its_evaluations(tmp_path):
    """bench/stability.py --quick: each candidate is the demo's command with its flags, in a process of its own
    (its config.json says so); the report's numbers follow from the runs' eval.jsonl; a finished run is not rerun."""
    import stability

    work, out = tmp_path / "work", tmp_path / "out"
    command = [sys.executable, os.path.join(ROOT, "bench", "stability.py"), "--quick", "--work", str(work),
               "--out", str(out)]
    p = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    configs = {name: json.loads((work / f"{name}-seed0" / "config.json").read_text()) for name in ("default", "no-std")}
    assert configs["default"]["adv_std_floor"] == 0.0 and configs["no-std"]["adv_std_floor"] == 1.0
    assert configs["default"]["iterations"] == 4 and configs["default"]["model"] == "digits"
    data = json.loads((out / "stability.json").read_text())
    for name in ("default", "no-std"):
        rows = [json.loads(line) for line in (out / "stability" / f"{name}-seed0.eval.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [0, 2, 4] and all("eval_diversity" in r for r in rows)
        cnn = [r["eval_digit_correct"] for r in rows]
        summary = data[f"{name}-seed0"]["summary"]
        assert summary["CNN"]["peak"] == max(cnn) and summary["CNN"]["final"] == cnn[-1]
        assert summary["CNN"]["fall"] == pytest.approx(stability.largest_fall(cnn))
        assert summary["diversity"]["start"] == rows[0]["eval_diversity"]
    md = (out / "stability.md").read_text()
    assert "| default | `(the demo)` | 0 |" in md and "| no-std | `--adv-std-floor 1` | 0 |" in md
    assert (out / "stability.png").stat().st_size > 10_000
    again = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "seed 0:" not in again.stdout    # both runs were complete: nothing reran


def test_learning_diversity_is_the_mean_over_prompts_of_each_prompts_pixel_diversity():
    """bench/learning.py's evaluation diversity: per prompt the mean pairwise RMS pixel distance of its images,
    averaged over prompts (images in any order): two equal images score 0, a black and a white one 1."""
    import learning

    black, white, grey = torch.zeros(3, 4, 4), torch.ones(3, 4, 4), torch.full((3, 4, 4), 0.5)
    images = torch.stack([black, grey, white, grey])
    prompts = ["a two", "a one", "a two", "a one"]
    assert learning.diversity(images, prompts) == pytest.approx((1.0 + 0.0) / 2)
    # three images of one prompt, grey rounded to 128 of 255: pairs (black, white) 1, (black, grey) 128 / 255,
    # (grey, white) 127 / 255
    assert learning.diversity(torch.stack([black, white, grey]), ["a"] * 3) == pytest.approx((1 + 255 / 255) / 3)
    assert learning.diversity(torch.stack([grey, grey]), ["a", "b"]) == 0.0        # no prompt with two images


def test_stability_reads_method_runs_that_are_partial_old_or_hold_other_learners(tmp_path):
    """A learning.py output with a finished V-GRPO, a DiffusionNFT cut short, an MDP (not one of the three) and no
    diversity curve (written before it was recorded): the rows are what the file holds, the run counts as
    incomplete (so --methods reruns it), and the report takes what is complete."""
    import stability

    ev = [(0, 0.3), (4, 0.5), (8, 0.45)]
    path = tmp_path / "methods-seed1.json"
    path.write_text(json.dumps({"methods": {
        "V-GRPO": {"eval": ev, "check": [(it, v - 0.1) for it, v in ev], "diversity": [(it, 0.2) for it, _ in ev]},
        "DiffusionNFT": {"eval": ev[:2], "check": ev[:2]},
        "MDP": {"eval": ev, "check": ev}}}))
    rows = stability.method_rows(str(path))
    assert sorted(rows) == ["DiffusionNFT", "V-GRPO"]
    assert rows["V-GRPO"][2] == {"iteration": 8, "eval_digit_correct": 0.45, "eval_digit_knn": 0.45 - 0.1,
                                 "eval_diversity": 0.2}
    assert "eval_diversity" not in rows["DiffusionNFT"][0]
    assert stability.complete(rows, ["V-GRPO"], 8) and not stability.complete(rows, ["V-GRPO", "DiffusionNFT"], 8)
    assert not stability.complete(rows, ["V-GRPO", "MixGRPO"], 8)
    assert stability.earlier_methods(str(tmp_path), 8).keys() == {("V-GRPO", 1)}
    summary = stability.summarize_run(rows["DiffusionNFT"])
    assert summary["CNN"]["fall"] == 0.0 and summary["diversity"]["final"] is None


def test_stability_report_says_what_each_kept_run_ran_with(tmp_path, monkeypatch):
    """The methods' settings and evaluation size come from each run's own output (a run kept from before the
    sweep chose again keeps its settings in the table), the candidates' evaluation size from the demo's recipe."""
    import stability
    import vgrpo

    monkeypatch.setitem(vgrpo.RECIPES["digits"], "eval_images", 4)
    ev = [(0, 0.3), (4, 0.5)]
    (tmp_path / "stability").mkdir()
    for seed, lr in ((1, 3e-4), (2, 1e-4)):
        (tmp_path / "stability" / f"methods-seed{seed}.json").write_text(json.dumps({
            "setup": {"eval_prompts": 5, "eval_samples": 30}, "methods": {
                "V-GRPO": {"settings": {"name": "V-GRPO", "kind": "V-GRPO", "lr": lr}, "eval": ev, "check": ev}}}))
    method_runs = stability.earlier_methods(str(tmp_path / "stability"), 4)
    assert method_runs.keys() == {("V-GRPO", 1), ("V-GRPO", 2)}
    md = open(stability.report({}, 4, 4, str(tmp_path), method_runs)).read()
    n_eval = len([line for line in open(os.path.join(ROOT, "prompts", "digits_eval.jsonl")) if line.strip()])
    assert f"held-out accuracy of {n_eval} prompts x 4 images" in md
    assert "on 5 held-out prompts x 6 images" in md and "| V-GRPO | lr 0.0003 / lr 0.0001 | 1,2 |" in md


@pytest.mark.slow
def test_stability_methods_mode_trains_the_headlines_choices_side_by_side_and_reports_them(tmp_path):
    """bench/stability.py --methods --quick: one bench/learning.py job with V-GRPO, DiffusionNFT and MixGRPO at the
    settings the headline's one-step sweep chose; the report's rows follow from the job's curves (CNN = its eval,
    k-NN = its check, the diversity); its copy is kept and a second call runs nothing (about 35 s)."""
    import stability

    work, out = tmp_path / "work", tmp_path / "out"
    command = [sys.executable, os.path.join(ROOT, "bench", "stability.py"), "--methods", "--quick", "--work", str(work),
               "--out", str(out), "--threads", "1"]
    p = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    result = json.loads((work / "methods-seed1.json").read_text())
    assert [m["settings"] for m in result["methods"].values()] == stability.method_specs()
    assert [m["kind"] for m in stability.method_specs()] == ["V-GRPO", "DiffusionNFT", "MixGRPO"]
    assert result["setup"]["adv_soft_clip"] == 3.0 and result["setup"]["inner_steps"] == 1
    rows = stability.method_rows(str(out / "stability" / "methods-seed1.json"))
    md = (out / "stability.md").read_text()
    for name, m in result["methods"].items():
        assert [r["iteration"] for r in rows[name]] == [0, 2, 4]
        assert [r["eval_digit_correct"] for r in rows[name]] == [v for _, v in m["eval"]]
        assert [r["eval_digit_knn"] for r in rows[name]] == [v for _, v in m["check"]]
        assert all(0 < r["eval_diversity"] < 0.5 for r in rows[name])
        s = stability.summarize_run(rows[name])
        assert f"| {name} | 1 | {s['CNN']['peak']:.3f} ({s['CNN']['peak_at']}) / {s['k-NN']['peak']:.3f}" in md
    assert "| DiffusionNFT | lr 0.0001, beta 1 | 1 |" in md and (out / "stability-methods.png").stat().st_size > 10_000
    again = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "methods seed 1:" not in again.stdout


@pytest.mark.slow
def test_smoke_quick_mode_runs_one_iteration_of_every_configuration_and_fails_loudly(tmp_path):
    """bench/smoke.py --quick: every configuration (the digits demo, SD3 LoRA and full fine-tuning, FLUX LoRA, FLUX
    under --fsdp as torchrun's one process) runs one whole iteration in its own process through vgrpo's own functions; the update's
    first forward equals the old-surrogate pass bit for bit; SD3's evaluate on held-out prompts; a configuration that
    fails (here: out of time) or is not run (--budget spent) is named and the exit code is 1."""
    out = tmp_path / "smoke.md"
    command = [sys.executable, os.path.join(ROOT, "bench", "smoke.py"), "--quick", "--out", str(out), "--work",
               str(tmp_path / "work")]
    p = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    results = {r["name"]: r for r in data["results"]}
    assert list(results) == ["flux-lora", "sd3-lora", "flux-lora-fsdp", "sd3-full", "digits"]
    for name, r in results.items():
        assert "error" not in r, (name, r)
        assert r["skipped_steps"] == 0 and math.isfinite(r["policy_loss"])
        # the update's first forward against an old-surrogate pass (not for the demo, run as a user runs it)
        assert r["first_step_ratio"] == (None if name == "digits" else 0.0)
    assert results["flux-lora"]["inner_steps"] == 4 and results["sd3-lora"]["inner_steps"] == 1   # the recipes'
    assert results["flux-lora"]["ratio_max"] > 1 or results["flux-lora"]["ratio_min"] < 1   # later steps moved
    assert results["sd3-lora"]["images"] == 4 and results["flux-lora"]["images"] == 8
    # the demo's row: the settings its run resolved and its first iteration's time, from its own files
    import vgrpo

    digits, recipe = results["digits"], vgrpo.RECIPES["digits"]
    first = json.loads((tmp_path / "work" / "digits" / "metrics.jsonl").read_text().splitlines()[0])
    assert (digits["resolution"], digits["steps"], digits["images"]) == (
        recipe["resolution"], recipe["sample_steps"], recipe["prompts_per_step"] * recipe["group_size"])
    assert digits["iteration_s"] == first["time_total"] and first["iteration"] == 1
    for name in ("sd3-lora", "sd3-full"):   # the evaluation ran, and its number is eval.jsonl's
        evaluation = json.loads((tmp_path / "work" / name / "eval.jsonl").read_text())
        assert results[name]["held_out_reward"] == evaluation["eval_pickscore"] and evaluation["iteration"] == 1
        assert f"| {results[name]['held_out_reward']:.4g} |" in out.read_text()
    assert results["flux-lora"]["held_out_reward"] is None
    assert "**Not run on a GPU.**" in out.read_text() and out.read_text().count("| eager | ok |") == 5
    # on a GPU the blocks must have compiled (--compile auto): a configuration that ran eager there fails, named
    import smoke

    on_gpu = dict(results["sd3-lora"], gpu="NVIDIA H200")
    assert smoke.problems(on_gpu) == ["the transformer's blocks ran eager on CUDA"]
    on_gpu.update(compiled=True, compiled_graphs=11, compile_s=41.6)
    assert smoke.problems(on_gpu) == [] and "| 11, 42 | ok |" in smoke.report([on_gpu], data)
    scratch = tmp_path / "tmp"   # without --work: a temporary folder, removed at the end, a failure or not
    scratch.mkdir()
    failing = subprocess.run([*command[:-4], "--only", "sd3-lora,flux-lora", "--budget", "2", "--heartbeat", "0.2",
                              "--out", str(tmp_path / "f.md")], env=dict(ENV, TMPDIR=str(scratch)), cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert failing.returncode == 1 and "FAILED: sd3-lora, flux-lora" in failing.stdout
    assert not [f for f in os.listdir(scratch) if f.startswith("vgrpo-smoke-")]
    report = (tmp_path / "f.md").read_text()   # the first gets the budget's 2 s, the second nothing
    # the timed-out configuration's last progress line (how long, which phase) is in its error, its output's end
    # in the log
    assert "**failed**: no result within the 2 s left of --budget 2 (last: [sd3-lora] " in report
    assert "**failed**: not run: --budget 2 s spent |" in report
    assert "sd3-lora failed; its output ended:\n    [sd3-lora] " in failing.stdout
    # --merge (a rerun of what a GPU session's first run had no time for): each configuration's last result, where
    # "not run" replaces nothing
    merged_md = tmp_path / "merged.md"
    assert smoke.main(["--merge", f"{tmp_path / 'f.json'},{tmp_path / 'smoke.json'}", "--out", str(merged_md)]) == 0
    assert json.loads((tmp_path / "merged.json").read_text())["results"] == data["results"]
    assert merged_md.read_text().count("| eager | ok |") == 5
    assert smoke.main(["--merge", f"{tmp_path / 'smoke.json'},{tmp_path / 'f.json'}", "--out", str(merged_md)]) == 1
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [r["name"] for r in merged["results"]] == list(results)
    assert merged["results"][0] == results["flux-lora"]                    # "not run" in the later run
    assert merged["results"][1]["error"].startswith("no result within")   # the later run's failure
    assert merged["command"].count("; then ") == 1


def processes_naming(text):
    """The running processes whose command line contains `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text in f.read().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(pid))
        except OSError:   # it ended meanwhile
            pass
    return found


@pytest.mark.slow
def test_smoke_stopped_by_sigterm_ends_the_running_configuration_and_writes_the_report(tmp_path):
    """bench/device.sh's `timeout` sends SIGTERM to bench/smoke.py, whose configurations run in sessions of their
    own: the one running then (here FLUX under --fsdp) is ended with everything it started, so that nothing keeps
    the GPU's memory into the next part, and the report names it and the one not run. The parent then exits 1."""
    import time

    work, out = tmp_path / "work", tmp_path / "s.md"
    smoke = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "smoke.py"), "--quick", "--only",
                              "flux-lora-fsdp,sd3-lora", "--heartbeat", "0.2", "--out", str(out), "--work", str(work)],
                             env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not processes_naming(f"--child flux-lora-fsdp --work {work}") and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(3)                                            # into its imports and model building
    assert smoke.poll() is None and processes_naming(str(work)), "the configuration never started"
    smoke.terminate()
    output = smoke.communicate(timeout=120)[0]
    assert smoke.returncode == 1, output[-3000:]
    assert processes_naming(str(work)) == []                 # the configuration's process is gone
    report = out.read_text()
    assert "**failed**: stopped by SIGTERM (last: [flux-lora-fsdp] " in report, report + output[-3000:]
    assert "| sd3-lora | `" in report and "**failed**: not run: stopped by SIGTERM |" in report, report
    assert "FAILED: flux-lora-fsdp, sd3-lora" in output, output[-3000:]


def test_a_stopped_configurations_last_line_is_its_last_progress_line_not_a_warning_after_it():
    """The report's "(last: ...)" says where the time went: the heartbeat's last line, though a warning (or a
    traceback) came after it. (A CI run once reported a warning there and failed the SIGTERM test above.)"""
    import smoke

    output = ("[flux-lora-fsdp] 2 s: starting\n[flux-lora-fsdp] 3 s: build_transformer\n"
              "UserWarning: something\n  warnings.warn(\n[sd3-lora] 9 s: rollout\n")
    assert smoke.last_heartbeat("flux-lora-fsdp", output) == ["[flux-lora-fsdp] 3 s: build_transformer"]
    assert smoke.last_heartbeat("digits", output) == []


def test_the_smoke_runs_progress_lines_name_the_vgrpo_phase_running(monkeypatch):
    """bench/smoke.py's track_phases: PHASE["now"] names the vgrpo function running, nested (the evaluation's
    rollout), and is empty again after it returns or raises."""
    import smoke
    import vgrpo

    seen = []
    monkeypatch.setattr(vgrpo, "rollout", lambda: seen.append(smoke.PHASE["now"]))
    monkeypatch.setattr(vgrpo, "evaluate", lambda: vgrpo.rollout())
    for name in ("start_run", "decode", "score", "old_surrogate", "update"):
        monkeypatch.setattr(vgrpo, name, lambda: 1 / 0)   # undone at the end, with track_phases' wrapping
    smoke.track_phases()
    vgrpo.evaluate()
    vgrpo.rollout()
    assert seen == ["evaluate > rollout", "rollout"] and smoke.PHASE["now"] == ""
    with pytest.raises(ZeroDivisionError):
        vgrpo.update()
    assert smoke.PHASE["now"] == ""


def test_the_saved_tensor_census_counts_each_storage_once_by_the_node_that_holds_it():
    """bench/memory.py's saved_by_op: the bytes autograd keeps for a backward, per kind of node, against the graph's
    own arithmetic; and census_lines' table of it beside another census."""
    import memory

    class Twice(torch.autograd.Function):   # a custom Function keeps its tensors in saved_tensors
        @staticmethod
        def forward(ctx, x):
            doubled = x * 2
            ctx.save_for_backward(doubled)
            return doubled.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    a, weight = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32)   # the weight: resident, left out
    y = a @ weight               # mm keeps the weight (for a's gradient)
    s = y.sin()                  # sin keeps y: 8 x 32 float32 = 1024 bytes
    e = s.exp()                  # exp keeps its output e: 1024
    m = s[:4] * s[4:]            # mul keeps both halves of s: one storage, 1024
    t = Twice.apply(e[:, :2])    # its 8 x 2 product: 64
    loss = e.sum() + m.sum() + t.sum()
    census = memory.saved_by_op(loss, exclude=[weight])
    assert census == {"SinBackward0": 1024, "ExpBackward0": 1024, "MulBackward0": 1024, "TwiceBackward": 64}
    assert memory.saved_by_op(loss)["MmBackward0"] == 16 * 32 * 4
    assert memory.saved_by_op(loss, exclude=[weight], device_type="cuda") == {}     # all of it on the CPU here

    gib = 2 ** 30
    fake = dict(resident={"the VAE": gib, "none of these": 0}, saved={"MulBackward0": 3 * gib, "MmBackward0": 2 * gib,
                "GeluBackward0": gib}, forward=6 * gib, backward_peak=gib)
    gpu = dict(resident={"the VAE": gib, "none of these": gib // 4}, saved={"MulBackward0": 3 * gib,
               "MmBackward0": 2 * gib, "ToCopyBackward0": gib // 2, "GeluBackward0": gib}, forward=8 * gib,
               backward_peak=2 * gib)
    lines = memory.census_lines([("fake CUDA", fake), ("GPU", gpu), ("nowhere", None)], top=2)
    assert lines[2:] == ["| | fake CUDA | GPU |", "| --- | ---: | ---: |",
                         "| resident: the VAE | 1.00 | 1.00 |", "| resident: none of these | 0.00 | 0.25 |",
                         "| saved by MulBackward0 | 3.00 | 3.00 |", "| saved by MmBackward0 | 2.00 | 2.00 |",
                         "| saved by 2 other kinds of node | 1.00 | 1.50 |",
                         "| **saved for the backward, in all** | 6.00 | 6.50 |",
                         "| allocated by the forward, saved by no node | 0.00 | 1.50 |",
                         "| the backward's peak above the forward's end | 1.00 | 2.00 |", ""]
    # an update that did not fit (out of memory on the GPU): the resident parts alone
    lines = memory.census_lines([("fake CUDA", fake), ("GPU", dict(resident=gpu["resident"]))])
    assert lines[4:] == ["| resident: the VAE | 1.00 | 1.00 |", "| resident: none of these | 0.00 | 0.25 |", ""]
    lines = memory.census_lines([("GPU", dict(resident=gpu["resident"], error="RuntimeError: CUDA error"))])
    assert lines[-2:] == ["- GPU: the census failed: RuntimeError: CUDA error", ""]
    assert memory.census_lines([("fake CUDA", None)]) == []


def test_the_memory_benchmarks_gpu_mode_reports_what_it_measured_once_the_device_stops_answering(tmp_path,
                                                                                                  monkeypatch):
    """bench/memory.py --gpu after a CUDA error that poisons the process's context (FLUX's cuDNN attention did, on an
    H200): every later CUDA call raises, emptying the cache and reading the free memory included. The first error is
    the one reported, nothing more is started, the report of what was measured is written with a note per
    measurement left out, and the exit status is 1. torch.cuda is scripted here (no GPU): the device answers until
    the second measurement fails."""
    import memory
    import vgrpo

    broken, calls = [], []

    def answer(value):
        def call(*args, **kwargs):
            if broken:   # worded apart from the first error, to tell which one the report names
                raise RuntimeError("CUDA error: an illegal memory access was encountered (a later call)")
            return value
        return call

    def measure(kind, full_finetune, fsdp):
        calls.append((kind, full_finetune, fsdp))
        if len(calls) == 2:
            broken.append(True)
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")
        return [["update, checkpointing on", 11 * 2 ** 30, 12 * 2 ** 30]], argparse.Namespace(), None

    for name, value in (("is_available", True), ("init", None), ("mem_get_info", (100 * 2 ** 30, 141 * 2 ** 30)),
                        ("memory_reserved", 40 * 2 ** 30), ("synchronize", None), ("empty_cache", None),
                        ("get_device_name", "NVIDIA H200")):
        monkeypatch.setattr(torch.cuda, name, answer(value))
    monkeypatch.setattr(memory, "measure", measure)
    monkeypatch.setattr(memory, "describe_settings", lambda args: "settings")
    monkeypatch.setattr(vgrpo, "choose_attention_kernels", lambda kernels: None)   # this process's flags stay
    out = tmp_path / "memory-gpu.md"
    assert memory.main(["--gpu", "--models", "sd3,flux", "--out", str(out)]) == 1
    assert calls == [("sd3", False, False), ("sd3", False, True)]             # nothing started after the error
    report = json.loads((tmp_path / "memory-gpu.json").read_text())
    assert report["device"] == "NVIDIA H200" and report["outside_torch"] == [1 * 2 ** 30, None]
    results = report["results"]
    assert results["sd3 LoRA r32"]["one"] == [["update, checkpointing on", 11 * 2 ** 30, 12 * 2 ** 30]]
    assert results["sd3 LoRA r32"]["notes"] == [
        "--fsdp over 8: RuntimeError: CUDA error: an illegal memory access was encountered"]
    assert list(results) == ["sd3 LoRA r32", "sd3 full fine-tuning", "flux LoRA r32", "flux full fine-tuning"]
    for name in list(results)[1:]:
        assert results[name]["notes"] == ["one process: not run, the device stopped answering",
                                          "--fsdp over 8: not run, the device stopped answering"], name
    md = out.read_text()
    assert "1.00 GiB after `torch.cuda.init()`, not measured after the runs (the device stopped answering)" in md
    assert "| update, checkpointing on | " in md and "| 11.00 | 12.00 |" in md
    # a rerun of FLUX.1-dev in a fresh process (MEMORY_MODELS=flux in bench/device.sh), then --merge: one report,
    # each configuration's measurements from the run that made them, the notes only of what neither measured
    broken.clear()
    monkeypatch.setattr(memory, "measure", lambda kind, full_finetune, fsdp: (
        [["update, checkpointing on", (21 + fsdp) * 2 ** 30, 22 * 2 ** 30]], argparse.Namespace(), None))
    assert memory.main(["--gpu", "--models", "flux", "--out", str(tmp_path / "rerun.md")]) == 0
    rerun = json.loads((tmp_path / "rerun.json").read_text())
    assert memory.main(["--merge", f"{tmp_path / 'memory-gpu.json'},{tmp_path / 'rerun.json'}",
                        "--out", str(tmp_path / "merged.md")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert list(merged["results"]) == list(results) and merged["outside_torch"] == [2 ** 30, 2 ** 30]
    keys = ("one", "fsdp", "notes", "settings")
    assert {k: merged["results"]["sd3 LoRA r32"].get(k) for k in keys} == \
        {k: results["sd3 LoRA r32"].get(k) for k in keys}                      # the first run's, its note kept
    assert merged["results"]["sd3 full fine-tuning"]["notes"] == results["sd3 full fine-tuning"]["notes"]
    for name in ("flux LoRA r32", "flux full fine-tuning"):                      # the rerun's
        assert {k: merged["results"][name].get(k) for k in keys} == {k: rerun["results"][name].get(k) for k in keys}
    assert merged["results"]["flux LoRA r32"]["notes"] == [] and "| 22.00 | 22.00 |" in \
        (tmp_path / "merged.md").read_text()
    # a later run that never reached SD3.5-M ("not run") leaves the first run's failure standing
    assert memory.main(["--gpu", "--models", "sd3", "--time-limit", "0", "--out", str(tmp_path / "late.md")]) == 0
    assert json.loads((tmp_path / "late.json").read_text())["results"]["sd3 LoRA r32"]["notes"] == [
        "one process: not run, --time-limit 0 s reached", "--fsdp over 8: not run, --time-limit 0 s reached"]
    memory.main(["--merge", f"{tmp_path / 'memory-gpu.json'},{tmp_path / 'late.json'}",
                 "--out", str(tmp_path / "m.md")])
    assert json.loads((tmp_path / "m.json").read_text())["results"]["sd3 LoRA r32"]["notes"] == \
        results["sd3 LoRA r32"]["notes"]


def test_the_workspace_census_is_each_ops_rise_of_the_peak_less_the_tensors_it_made(monkeypatch):
    """bench/memory.py's workspace_by_op: per op, the allocator's rise of the peak above the bytes allocated before
    it, less the new storages the op returned (a view and an in-place op return none; sort returns two) and the
    growth of an `out=` tensor, the largest per op kept with its inputs' shapes, against an allocator scripted here
    (CPU tensors: the arithmetic, not a GPU's sizes); and workspace_lines' table."""
    import memory

    base = 10_000                    # bytes allocated before fn
    script = [(4512, 4000),          # torch.add(x, y): the peak rises 4512, the float32 sum keeps 4000: 512 of workspace
              (0, 0),                # x.view(-1)
              (256, 0),              # x.add_(y): in place, 256 of workspace
              (13024, 12000),        # torch.sort(x): values 4000 + int64 indices 8000, 1024 of workspace
              (2100, 2000),          # torch.add(a, b) of 500 each: 100, less than the first add's
              (4064, 4000)]          # torch.add(x, y, out=z), z grown from 0 to 4000 bytes: 64
    state = {"current": base, "peak": base, "ops": 0}

    def reset_peak():   # workspace_by_op resets the peak just before each op: the script plays the op there
        rise, kept = script[state["ops"]]
        state["ops"] += 1
        state["peak"] = state["current"] + rise   # the peak the op reaches
        state["current"] += kept                  # and what it leaves allocated, read after it

    monkeypatch.setattr(memory, "allocator_counters", lambda: (lambda: (state["current"], state["peak"]), reset_peak))
    x, y, a, b, z = torch.ones(1000), torch.ones(1000), torch.ones(500), torch.ones(500), torch.empty(0)
    found = memory.workspace_by_op(lambda: (torch.add(x, y), x.view(-1), x.add_(y), torch.sort(x), torch.add(a, b),
                                            torch.add(x, y, out=z)), device_type="cpu")
    assert state["ops"] == len(script)   # one reset per op: no op of fn went unseen, none was seen twice
    assert found == {"peak": base + 4000 + 12000 + 2000 + 4064, "peak_between_ops": base + 4000 + 12000 + 2000 + 4000,
                     "by_op": {"aten.sort.default": [1024, "1000"], "aten.add.Tensor": [512, "1000 1000"],
                               "aten.add_.Tensor": [256, "1000 1000"], "aten.add.out": [64, "1000 1000 0"]}}
    state.update(current=base, ops=0)    # counting the GPU's tensors only, add's CPU output is all workspace
    assert memory.workspace_by_op(lambda: torch.add(x, y), device_type="cuda")["by_op"] == {
        "aten.add.Tensor": [4512, "1000 1000"]}

    gib = 2 ** 30
    decode = {"peak": 20 * gib, "peak_between_ops": 17 * gib,
              "by_op": {"aten.convolution.default": [3 * gib, "24x128x512x512 128x128x3x3 128"],
                        "aten.mm.default": [gib // 4, "8x8 8x8"], "aten.add.Tensor": [gib // 8, "8 8"],
                        "aten.mul.Tensor": [gib // 16, "8 8"]}}
    lines = memory.workspace_lines([("fake CUDA", dict(resident={})),
                                    ("GPU", dict(workspaces={"VAE decode (24 per pass)": decode,
                                                             "update, checkpointing on": {"error": "OOM"}}))])
    assert lines[2:] == [
        "| | fake CUDA | GPU |", "| --- | ---: | ---: |",
        "| VAE decode (24 per pass): the peak | - | 20.00 |",
        "| VAE decode (24 per pass): the peak between two ops | - | 17.00 |",
        "| VAE decode (24 per pass): the largest workspace of `aten.convolution.default` (inputs 24x128x512x512 "
        "128x128x3x3 128) | - | 3.00 |",
        "| VAE decode (24 per pass): the largest workspace of `aten.mm.default` (inputs 8x8 8x8) | - | 0.25 |",
        "| VAE decode (24 per pass): the largest workspace of `aten.add.Tensor` (inputs 8 8) | - | 0.12 |",
        "| update, checkpointing on: the peak | - | - |",
        "| update, checkpointing on: the peak between two ops | - | - |", "",
        "- the workspaces failed: GPU, update, checkpointing on: OOM", ""]
    assert memory.workspace_lines([("fake CUDA", dict(resident={}))]) == []


def test_the_guides_memory_table_is_the_one_the_results_give():
    """docs/guide.md's memory table is what `bench/memory.py --guide` makes of the committed results
    (results/memory.json, and memory-gpu.json once a GPU measured): it fails when one changes without the other.
    "Fits on": the smallest card that holds the peak and the spare; a smaller one that holds the peak alone is
    "tight"."""
    import memory

    with open(memory.GUIDE) as f:
        guide = f.read()
    start, end = (guide.index(mark) for mark in memory.GUIDE_MARKS)
    assert guide[start + len(memory.GUIDE_MARKS[0]):end].strip() == memory.results_table()
    # the cards' usable GiB: 16 GB 14.9, 24 GB 22.3, 32 GB 29.8, 48 GB 44.6, 80 GB 79.6, 141 GB 140.4
    assert memory.fits_on(10.0, 1.0) == "16 GB" and memory.fits_on(14.9, 0.0) == "16 GB"
    assert memory.fits_on(16.0, 0.0) == "24 GB"                              # 16 GiB needs more than a 16 GB card
    assert memory.fits_on(14.0, 1.4) == "24 GB (16 GB is tight)"
    assert memory.fits_on(42.0, 4.2) == "80 GB (48 GB is tight)"
    assert memory.fits_on(140.0, 14.0) == "141 GB (tight)"
    assert memory.fits_on(150.0, 15.0) == "none: use `--fsdp`" and memory.fits_on(None, None) == "none: use `--fsdp`"
    for card, usable in ((16, 14.9), (24, 22.3), (32, 29.8), (48, 44.6), (80, 79.6)):   # at each card's edge
        assert memory.fits_on(usable, 0.0) == f"{card} GB" and memory.fits_on(usable + 0.05, 0.0) != f"{card} GB"
    assert memory.fits_on(140.4, 0.0) == "141 GB" and memory.fits_on(140.45, 0.0) == "none: use `--fsdp`"
    with pytest.raises(ValueError, match="run bench/memory.py --gpu again"):   # the format before the device's name
        memory.guide_table({}, {"sd3 LoRA r32": {"one": []}})
    # the fit of a GPU row: its reserved peak (13.3 GiB) plus the memory outside torch, the last reading there is,
    # else the one at start, else 1 GiB (never 0): each case lands on another card than the other choices would
    GIB = memory.GIB
    rows = [["resident between phases", 5 * GIB, 6 * GIB], ["update, checkpointing on", 13 * GIB, 13.3 * GIB],
            ["update, checkpointing off", 40 * GIB, 41 * GIB]]
    fake = {"sd3 LoRA r32": {"one": rows, "fsdp": rows}}
    for readings, fit in (([0.2 * GIB, 2.5 * GIB], "24 GB"),                   # 15.8 (the first reading: 16 GB)
                          ([2.0 * GIB, None], "24 GB"),                         # 15.3 (1 GiB: 16 GB tight; 0: 16 GB)
                          ([None, None], "24 GB (16 GB is tight)")):            # 14.3 (0: 16 GB)
        row = memory.guide_table(fake, {"results": fake, "outside_torch": readings}).splitlines()[2]
        assert f"| {fit} |" in row, (readings, row)


def test_the_bench_readmes_memory_table_is_the_one_the_results_give():
    """bench/README.md's memory table (GiB, one process and --fsdp over 8) is results/memory.json's rows, rounded:
    it fails when the results are regenerated and the table is not."""
    import memory

    with open(os.path.join(memory.RESULTS, "memory.json")) as f:
        results = json.load(f)
    with open(os.path.join(ROOT, "bench", "README.md")) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| configuration | resident | update, ckpt on"))
    columns = ["resident between phases", "update, checkpointing on", "update, checkpointing off", "old surrogate",
               "rollout", "VAE decode", "reward"]
    names = [name for name in results for _ in ("one", "fsdp")]
    table = [line for line in lines[start + 2:] if line.startswith("|")][:len(names)]
    assert len(table) == len(names) == 16
    for line, name, key in zip(table, names, ["one", "fsdp"] * len(results)):
        rows = {row[0]: row[1] for row in results[name][key] if "one per rollout pass" not in row[0]}
        want = [next(value for phase, value in rows.items() if phase.startswith(column)) for column in columns]
        cells = [cell.strip().strip("*") for cell in line.split("|")[2:-1]]
        assert cells == [f"{value / 2 ** 30:.2f}" for value in want], (name, key)


def test_the_device_script_fits_its_9_minutes_and_8_files():
    """bench/device.sh: its three parts' time limits, each with the grace before its kill, and 20 s for the wheels'
    install and the version line, add up to at most 9 minutes; what it writes to $OUT is at most 8 files (the device
    tool brings back 8)."""
    import re

    script = open(os.path.join(ROOT, "bench", "device.sh")).read()
    limits = re.findall(r"^\s*timeout -k (\d+) (\d+) ", script, re.M)
    assert len(limits) == 3 and sum(int(grace) + int(limit) for grace, limit in limits) + 20 <= 9 * 60, limits
    names = re.findall(r'"\$out/([\w.-]+)"', script)
    # every use of the folder is one of those names, or its mkdir: no file goes there uncounted
    assert script.count("$out") + script.count("${out}") == len(names) + 1 and 'mkdir -p "$out"' in script
    written = set(names)
    written |= {os.path.splitext(f)[0] + ".json" for f in written if f.endswith(".md")}   # each .md's JSON beside it
    assert written == {"device.txt", "device.log", "smoke-gpu.md", "smoke-gpu.json", "memory-gpu.md",
                       "memory-gpu.json", "gpu.md", "gpu.json"}
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "device.sh")]).returncode == 0


def test_the_device_scripts_commands_are_accepted_by_the_scripts_they_call():
    """Each of bench/device.sh's three commands, as written there, run here: every flag is one its script accepts (an
    argparse error would cost the GPU session a part), and without a GPU each stops at its own "no CUDA device"."""
    import re
    import shlex

    script = open(os.path.join(ROOT, "bench", "device.sh")).read().replace("\\\n", " ")
    commands = re.findall(r"^\s*timeout -k \d+ \d+ python3 (bench/\w+\.py .*)$", script, re.M)
    assert [c.split()[0] for c in commands] == ["bench/smoke.py", "bench/memory.py", "bench/gpu.py"]
    for command in commands:
        command = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", re.sub(r"\$\{\w+:\+[^}]*\}", "", command))  # the defaults
        words = shlex.split(command.replace("$out", str(ROOT)))
        p = subprocess.run([sys.executable, *words], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "no CUDA device here" in p.stderr, (words, p.stderr[-2000:])


def test_the_mutation_runs_copy_of_the_project_for_each_module(tmp_path):
    """bench/mutation.py's copy (mutmut itself is not installed here): the module's settings become setup.cfg, the
    @torch.no_grad() functions of vgrpo.py are wrapped after their definition instead (mutmut skips decorated
    functions) and the copy still imports; --tests and --deselect replace the selection."""
    import importlib.util

    import mutation

    wrapped = mutation.prepare(str(tmp_path / "v"), None, [], "vgrpo")
    assert {"rollout", "generate", "sample_ode"} <= set(wrapped)
    source = (tmp_path / "v" / "vgrpo.py").read_text()
    assert "@torch.no_grad()\ndef" not in source and "rollout = torch.no_grad()(rollout)" in source
    spec = importlib.util.spec_from_file_location("vgrpo_mutation_copy", tmp_path / "v" / "vgrpo.py")
    copy = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # (its dataclasses look it up there)
    try:
        spec.loader.exec_module(copy)                   # it imports, each function wrapped after its definition
        assert all(getattr(copy, name).__wrapped__.__name__ == name for name in wrapped)
        with torch.enable_grad():                       # no_grad all the same
            noise = torch.ones(1, requires_grad=True)
            assert not copy.sample_ode(lambda x, sigma: x, noise, torch.tensor([1.0, 0.0])).requires_grad
    finally:
        del sys.modules[spec.name]
    assert "source_paths = vgrpo.py" in (tmp_path / "v" / "setup.cfg").read_text()
    assert not (tmp_path / "v" / ".git").exists()
    mutation.prepare(str(tmp_path / "r"), ["tests/test_geneval.py"], ["tests/test_geneval.py::test_x"], "reward")
    cfg = (tmp_path / "r" / "setup.cfg").read_text()
    assert "source_paths = reward.py" in cfg
    selection = cfg.split("pytest_add_cli_args_test_selection =\n")[1].split("pytest_add_cli_args =")[0].split()
    assert selection == ["tests/test_geneval.py", "--deselect", "tests/test_geneval.py::test_x"]
    assert (tmp_path / "r" / "reward.py").read_text() == open(os.path.join(ROOT, "reward.py")).read()


def test_a_gpus_peak_is_its_boards_own():
    """bench/gpu.py's share of peak divides by the board's dense bf16 peak: an H200 NVL or H100 PCIe board (slower
    clocks) is not taken for the SXM one its name contains, and a GPU not in the list gets no share at all."""
    import gpu

    expected = {"NVIDIA H200": 989, "NVIDIA H200 NVL": 835, "NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756,
                "NVIDIA H100 NVL": 835, "NVIDIA GH200 480GB": 989, "NVIDIA A100-SXM4-80GB": 312, "Tesla T4": None}
    assert {name: gpu.peak_tflops_of(name) for name in expected} == expected
    assert gpu.peak_tflops(torch.device("cpu")) is None


def test_the_device_scripts_version_line_runs_here():
    """The Python of bench/device.sh's version line (what device.txt holds: the packages, triton, a C compiler,
    Python's headers) runs with this machine's Python and names each (an error there would leave device.txt without
    the versions the GPU figures are quoted with)."""
    import re

    script = open(os.path.join(ROOT, "bench", "device.sh")).read()
    code = re.search(r'^\s*python3 -c "(.*?)"$', script, re.M | re.S).group(1)
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    line = p.stdout.split()
    for name in ("torch", "cuda", "diffusers", "transformers", "peft", "triton", "cc", "Python.h"):
        assert name in line, (name, p.stdout)
    assert line[line.index("torch") + 1] == torch.__version__
    assert line[line.index("Python.h") + 1] in ("found", "missing")


@pytest.mark.parametrize("parts, ran", [((), ["smoke", "memory", "gpu"]), (("gpu", "memory"), ["memory", "gpu"])])
def test_the_device_script_runs_the_parts_named_and_refuses_others(tmp_path, parts, ran):
    """bench/device.sh runs all three parts, or only those named (a rerun in what a session has left of its GPU
    minutes), each's exit status logged, SMOKE_ONLY's configurations passed to the smoke run as --only; an unknown
    part stops it before anything runs. The GPU's programs are stand-ins here that log their command lines: what is
    under test is the script's choice of what to run."""
    import shutil

    os.makedirs(tmp_path / "repo" / "bench")
    shutil.copy(os.path.join(ROOT, "bench", "device.sh"), tmp_path / "repo" / "bench")
    (tmp_path / "bin").mkdir()
    stand_ins = {"python3": 'echo "$*" | tr "\\n" " " >> "$CALLS"; echo >> "$CALLS"',   # one line per call
                 "nvidia-smi": "echo 'NVIDIA H200, 143771 MiB'"}
    for name, body in stand_ins.items():
        (tmp_path / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / "bin" / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               CALLS=str(tmp_path / "calls"))
    script = str(tmp_path / "repo" / "bench" / "device.sh")
    assert subprocess.run(["bash", script, *parts], env=env).returncode == 0
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith("-c ") and "torch.__version__" in calls[0]   # the version line
    assert [call.split()[0] for call in calls[1:]] == [f"bench/{part}.py" for part in ran]
    log = (tmp_path / "out" / "device.log").read_text()
    assert log.count(": exit 0") == len(ran)
    assert "NVIDIA H200" in (tmp_path / "out" / "device.txt").read_text()
    assert "--only" not in " ".join(calls)   # every configuration of the smoke run
    (tmp_path / "calls").unlink()
    assert subprocess.run(["bash", script, "smoke"], env=dict(env, SMOKE_ONLY="sd3-full,digits")).returncode == 0
    smoke = (tmp_path / "calls").read_text().splitlines()[1].split()
    assert smoke[smoke.index("--only") + 1] == "sd3-full,digits"   # the configurations named
    (tmp_path / "calls").unlink()
    assert subprocess.run(["bash", script, "gpu"], env=dict(env, GPU_MODELS="flux")).returncode == 0
    gpu = (tmp_path / "calls").read_text().splitlines()[1].split()
    assert gpu[gpu.index("--models") + 1] == "flux"   # GPU_MODELS: bench/gpu.py's models
    calls = (tmp_path / "calls").read_text().splitlines()
    refused = subprocess.run(["bash", script, "memory", "gpus"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "no part 'gpus'" in refused.stderr
    assert len((tmp_path / "calls").read_text().splitlines()) == len(calls)   # nothing more ran


# --------------------------------------------------------------------------- the GPU run's verdicts, on made-up results
# bench/device.sh runs once on a GPU machine lent for minutes: what its scripts conclude from what they measured (a
# configuration failed, a target met, which run a merge keeps) is checked here on results made up to fail each check.


def test_the_smoke_runs_verdict_fails_each_kind_of_bad_result():
    """bench/smoke.py's problems(): a configuration passes only with the ratio at the first inner step within 1e-6 of
    1 (measured: not None), a finite loss and gradient norm, no skipped step, compiled blocks on CUDA and a finite
    held-out number (digits: its last evaluation's)."""
    import smoke

    ok = dict(name="flux-lora", first_step_ratio=0.0, policy_loss=-0.012, grad_norm=0.4, skipped_steps=0,
              gpu="NVIDIA H200", compiled=True, held_out_reward=None)
    assert smoke.problems(ok) == [] and smoke.problems(dict(ok, first_step_ratio=1e-6)) == []
    for change, problem in [
            (dict(first_step_ratio=2e-6), "ratio at the first inner step off 1 by 2e-06"),
            (dict(first_step_ratio=0.5), "ratio at the first inner step off 1 by 0.5"),
            (dict(first_step_ratio=None), "ratio at the first inner step off 1 by None"),   # never compared
            (dict(policy_loss=math.nan), "non-finite loss nan or gradient norm 0.4"),
            (dict(grad_norm=math.inf), "non-finite loss -0.012 or gradient norm inf"),
            (dict(skipped_steps=1), "1 skipped step(s)"),
            (dict(compiled=False), "the transformer's blocks ran eager on CUDA"),
            (dict(held_out_reward=math.nan), "non-finite held-out evaluation nan")]:
        assert smoke.problems(dict(ok, **change)) == [problem], change
    assert smoke.problems(dict(ok, gpu=None, compiled=False)) == []   # --quick on the CPU runs eager
    assert smoke.problems(dict(ok, error="no result within 140 s")) == ["no result within 140 s"]
    assert len(smoke.problems(dict(ok, first_step_ratio=0.1, skipped_steps=2, grad_norm=math.nan))) == 3
    # the demo is run as users run it (one inner step, no old-surrogate pass): its ratio is not compared; its
    # held-out number is the last evaluation's accuracy
    digits = dict({k: v for k, v in ok.items() if k != "held_out_reward"}, name="digits", first_step_ratio=None)
    assert smoke.problems(dict(digits, held_out=[0.3125, 0.7625])) == []
    assert smoke.held_out_number(dict(digits, held_out=[0.3125, 0.7625])) == 0.7625
    assert smoke.problems(dict(digits, held_out=[math.nan, 0.7625])) == []
    assert smoke.problems(dict(digits, held_out=[0.3125, math.nan])) == ["non-finite held-out evaluation nan"]
    assert smoke.held_out_number(dict(digits, held_out=None)) is None


@pytest.mark.parametrize("shift", [0.0, 1e-3, -0.02])
def test_the_smoke_runs_ratio_check_reads_a_difference_between_the_old_pass_and_the_updates_first_forward(
        tmp_path, monkeypatch, shift):
    """bench/smoke.py's first_step_check records |exp(s_update - s_old) - 1| at the update's first micro-batch: 0 when
    the old-surrogate pass and the update see one numerics, |exp(-shift) - 1| when the old pass reads `shift` more
    (a check that compared a pass with itself would read 0 whatever happened)."""
    import smoke
    import vgrpo
    from test_vgrpo import FAST

    args = vgrpo.parse_args([*FAST, "--inner-steps", "2", "--micro-batch", "2", "--output-dir", str(tmp_path)])
    vgrpo.validate(args, 1)
    run, start = vgrpo.start_run(args)
    real_old_surrogate, record = vgrpo.old_surrogate, {}

    def shifted_old_surrogate(*args, **kwargs):
        s_old, x0_ref = real_old_surrogate(*args, **kwargs)
        return s_old + shift, x0_ref

    monkeypatch.setattr(vgrpo, "old_surrogate", shifted_old_surrogate)
    monkeypatch.setattr(vgrpo, "update", smoke.first_step_check(vgrpo.update, record))
    vgrpo.train_iteration(run, start)
    assert record["ratio"] == pytest.approx(abs(math.exp(-shift) - 1), rel=1e-3, abs=0)


def write_json(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def test_a_smoke_merge_keeps_a_configuration_no_run_ran_and_fails(tmp_path):
    """bench/smoke.py --merge: a configuration that no run ran ("not run" in each) stays in the report as failed and
    the exit status is 1; one that a rerun ran replaces the first run's "not run"."""
    import smoke

    meta = dict(gpu=True, device="NVIDIA H200", torch="2.11.0+cu130 (CUDA 13.0)", date="2026-12-07")
    passed = dict(first_step_ratio=0.0, policy_loss=0.01, grad_norm=0.3, skipped_steps=0, gpu="NVIDIA H200",
                  compiled=True, compiled_graphs=4, compile_s=30.0, flags="--model flux", resolution=720, steps=16,
                  n_mc=2, inner_steps=4, images=8, peak_gib=40.0, build_s=12.0, iteration_s=90.0)
    first = write_json(tmp_path / "first.json", dict(meta, command="python bench/smoke.py", results=[
        dict(passed, name="flux-lora"), dict(name="sd3-lora", error="not run: --budget 180 s spent"),
        dict(name="digits", error="not run: --budget 180 s spent")]))
    rerun = write_json(tmp_path / "rerun.json", dict(meta, command="python bench/smoke.py --only sd3-lora,digits",
                       results=[dict(passed, name="sd3-lora"),
                                dict(name="digits", error="not run: --budget 9 s spent")]))
    out = tmp_path / "merged.md"
    assert smoke.main(["--merge", f"{first},{rerun}", "--out", str(out)]) == 1
    merged = json.loads((tmp_path / "merged.json").read_text())["results"]
    assert [(r["name"], r.get("error")) for r in merged] == [("flux-lora", None), ("sd3-lora", None),
                                                             ("digits", "not run: --budget 180 s spent")]
    assert "| digits |" in out.read_text() and out.read_text().count("| ok |") == 2


def made_up_gpu_result(model, phases, compiled=None, inner_steps=4):
    return dict(model=model, resolution=512, steps=40, n_mc=4, sample_batch=12, decode_batch=6, micro_batch=2,
                recipe=dict(P=48, G=24, inner_steps=inner_steps), phases=phases, compiled=compiled)


def test_the_gpu_benchs_iteration_split_is_the_recipes_per_gpu_share():
    """bench/gpu.py's seconds per GPU of one iteration: P*G/gpus samples per GPU, in sample batches for the rollout,
    decode batches for the VAE, the reward's own batch; the old surrogate for the (inner_steps - 1) / inner_steps
    of the micro-batches after the first minibatch, the update for every micro-batch."""
    import gpu

    phases = {"rollout": dict(seconds=10.0), "decode": dict(seconds=1.0), "reward": dict(samples=24, seconds=3.0),
              "old surrogate": dict(seconds=0.5), "update": dict(seconds=1.5)}
    split = gpu.iteration_split(made_up_gpu_result("FLUX.1-dev", phases), 8, phases)
    n = 48 * 24 / 8                                                  # 144 samples on each of 8 GPUs
    expected = {"rollout": n / 12 * 10.0, "decode": n / 6 * 1.0, "reward": n / 24 * 3.0,
                "old surrogate": 3 / 4 * n / 2 * 0.5, "update": n / 2 * 1.5}
    assert {k: split[k] for k in expected} == pytest.approx(expected)
    assert split["samples_per_gpu"] == n and split["total"] == pytest.approx(sum(expected.values()))
    assert split["images_per_s"] == pytest.approx(n / sum(expected.values())) and split["unmeasured"] == []
    one_inner = gpu.iteration_split(made_up_gpu_result("SD3.5-M", phases, inner_steps=1), 1, phases)
    assert one_inner["old surrogate"] == 0 and one_inner["rollout"] == pytest.approx(48 * 24 / 12 * 10.0)
    partial = {k: v for k, v in phases.items() if k != "decode"}   # the decode not measured: a lower bound, named
    split = gpu.iteration_split(made_up_gpu_result("FLUX.1-dev", partial), 8, partial)
    assert split["decode"] is None and split["unmeasured"] == ["decode"]
    assert split["total"] == pytest.approx(sum(expected.values()) - expected["decode"])
    only_rollout = {"rollout": phases["rollout"]}
    assert gpu.iteration_split(made_up_gpu_result("FLUX.1-dev", only_rollout), 8, only_rollout) is None


def test_the_gpu_benchs_targets_judge_the_better_of_eager_and_compiled():
    """bench/gpu.py's targets: each phase's better rate of eager and compiled against its share of the peak, the
    faster whole iteration (one with a phase unmeasured is not judged) against half of 139.4 s, on 8 GPUs only."""
    import gpu

    meta = dict(gpu=True, peak_tflops=1000.0, matmul_tflops=800.0, gpus=8)
    sd3 = made_up_gpu_result("SD3.5-M", {"rollout": dict(tflops=300.0), "update": dict(tflops=350.0)},
                             compiled={"rollout": dict(tflops=450.0), "update": dict(tflops=250.0)})
    flux = made_up_gpu_result("FLUX.1-dev", {"rollout": dict(tflops=440.0)})
    sd3.update(split=dict(total=80.0, unmeasured=[]), split_compiled=dict(total=60.0, unmeasured=[]))
    line = gpu.target_lines([sd3, flux], meta)[-1]
    assert line == ("Targets (the better of eager and compiled): "
                    "SD3.5-M rollout 45% of peak, 56% of the matrix product's (target 40%: met); "
                    "SD3.5-M update 35% of peak, 44% of the matrix product's (target 30%: met); "
                    "FLUX.1-dev rollout 44% of peak, 55% of the matrix product's (target 45%: missed); "
                    "FLUX.1-dev update not measured (target 45%); "
                    "SD3.5-M iteration 60.0 s per GPU of 8 (target 69.7 s: met).")
    sd3.update(split=dict(total=75.0, unmeasured=[]), split_compiled=dict(total=50.0, unmeasured=["reward"]))
    assert "SD3.5-M iteration 75.0 s per GPU of 8 (target 69.7 s: missed)" in gpu.target_lines([sd3], meta)[-1]
    assert "iteration" not in gpu.target_lines([sd3], dict(meta, gpus=1))[-1]   # one GPU's split is not the recipe's
    assert gpu.target_lines([sd3], dict(meta, gpu=False)) == []


def test_a_gpu_bench_merge_keeps_the_failures_no_later_result_replaced(tmp_path):
    """bench/gpu.py's merge: each model's fullest result (the later run's on a tie), and a run's failure of a model
    only while no later run measured that model."""
    import gpu

    meta = dict(device="NVIDIA H200", torch="2.11.0+cu130", dtype="bf16", gpus=8, skipped=[], unfinished=[],
                kernels=None)
    whole = {"rollout": dict(seconds=10.0), "old surrogate": dict(seconds=0.5), "update": dict(seconds=1.5)}
    first = write_json(tmp_path / "first.json", dict(meta, command="first", failed=[
        "FLUX.1-dev: eager: RuntimeError: CUDA error"], results=[made_up_gpu_result("SD3.5-M", whole)]))
    sd3_again = write_json(tmp_path / "sd3.json", dict(meta, command="sd3 again", failed=[], results=[
        made_up_gpu_result("SD3.5-M", {k: dict(seconds=2 * v["seconds"]) for k, v in whole.items()})]))
    flux = write_json(tmp_path / "flux.json", dict(meta, command="flux", failed=[], results=[
        made_up_gpu_result("FLUX.1-dev", whole)]))
    results, merged = gpu.merge_runs([first])
    assert merged["failed"] == ["FLUX.1-dev: eager: RuntimeError: CUDA error"]
    results, merged = gpu.merge_runs([first, sd3_again])
    assert merged["failed"] == ["FLUX.1-dev: eager: RuntimeError: CUDA error"]
    assert results[0]["phases"]["rollout"]["seconds"] == 20.0            # a tie: the later run's
    assert results[0]["split"]["total"] > 0 and merged["command"] == "first; then sd3 again"
    results, merged = gpu.merge_runs([first, flux])
    assert merged["failed"] == [] and [r["model"] for r in results] == ["SD3.5-M", "FLUX.1-dev"]
    partial = write_json(tmp_path / "partial.json", dict(meta, command="cut", failed=[], results=[
        made_up_gpu_result("SD3.5-M", {"rollout": dict(seconds=1.0)})]))
    results, merged = gpu.merge_runs([first, partial])
    assert results[0]["phases"] == whole                                 # a fuller earlier result stays


def test_the_kernel_table_gives_each_kernels_share_of_peak_and_short_failures(monkeypatch):
    """bench/gpu.py's attention table: TFLOP/s as a share of the peak, failures in a few words, the kernel torch
    picks; a torch that cannot say which it picks leaves that column empty, not the report unwritten."""
    import gpu

    shape = dict(model="FLUX.1-dev", phase="update", rows=4, heads=24, tokens=2537, head_dim=128, masked=True)
    kernels = dict(shapes=[shape], kernels=["flash", "fa3", "cudnn"], picked={"FLUX.1-dev update": "flash"}, rows=[
        dict(model="FLUX.1-dev", phase="update", kernel="flash", ms=2.0, tflops=500.0, max_rel_diff=0.004),
        dict(model="FLUX.1-dev", phase="update", kernel="fa3", error="No module named 'flash_attn_interface'")])
    row = [line for line in gpu.kernel_lines(kernels, dict(peak_tflops=1000.0, gpu=True)) if "2537" in line]
    assert row == ["| FLUX.1-dev | update | 4 x 24 x 2537 x 128, masked | 2 ms, 500 (50%), diff 0.004 | not installed "
                   "(flash_attn_interface) | not run | flash |"]
    assert gpu.failure_cell("No viable backend for scaled_dot_product_attention") == \
        "no such kernel for these inputs here"
    assert gpu.failure_cell("not run: " + "x" * 100) == "not run: " + "x" * 68 + "..."
    assert gpu.failure_cell("the probe stopped: timed out after 2 s") == "the probe stopped: timed out after 2 s"
    assert gpu.failure_cell("E" * 80) == "fails: " + "E" * 80
    assert gpu.failure_cell("E" * 81) == "fails: " + "E" * 77 + "..."

    def unknown(*args):
        raise AttributeError("module 'torch' has no attribute '_fused_sdp_choice'")

    monkeypatch.setattr(gpu, "picked_kernels", unknown)
    assert gpu.default_kernel([("FLUX.1-dev", "update", 4, 24, 2537, 128, True)], True) == {}
    row = [line for line in gpu.kernel_lines(dict(kernels, picked={}), dict(peak_tflops=None, gpu=False))
           if "2537" in line][0]
    assert row.endswith("| 2 ms, 500, diff 0.004 | not installed (flash_attn_interface) | not run |  |")   # no share


def test_torch_is_asked_which_kernel_it_picks_with_each_passs_inputs(monkeypatch):
    """bench/gpu.py's "torch picks" column asks torch's own selection with the pass's inputs: a query of the shape's
    heads, tokens and head size that needs a gradient in the update, the model's mask where it passes one, under
    vgrpo's default --attention."""
    from torch.nn.attention import SDPBackend

    import gpu
    import vgrpo

    asked, chosen = [], []
    monkeypatch.setattr(vgrpo, "choose_attention_kernels", chosen.append)
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda q, k, v, mask: asked.append((
        tuple(q.shape), q.requires_grad, None if mask is None else tuple(mask.shape))) or (
        SDPBackend.FLASH_ATTENTION if mask is None else SDPBackend.EFFICIENT_ATTENTION).value)
    shapes = [("SD3.5-M", "rollout", 24, 24, 1178, 64, False), ("FLUX.1-dev", "update", 4, 24, 2537, 128, True)]
    assert gpu.picked_kernels(shapes, True) == {"SD3.5-M rollout": "flash", "FLUX.1-dev update": "efficient"}
    assert asked == [((1, 24, 1178, 64), False, None), ((1, 24, 2537, 128), True, (1, 1, 1, 2537))]
    assert chosen == [vgrpo.default_flags()["attention"]]


def test_a_memory_merge_keeps_a_failure_over_a_rerun_that_never_reached_it(tmp_path):
    """bench/memory.py --merge: a configuration no run measured keeps the first run's failure when the rerun never
    reached it (out of time, or the device stopped answering); the memory outside torch is the first run's reading at
    its start and the last run's at its end; the seconds are the runs' sum (unknown if one is)."""
    import memory

    names = ("sd3 LoRA r32", "flux LoRA r32")
    failed = ["one process: RuntimeError: CUDA error: an illegal memory access was encountered",
              "--fsdp over 8: not run, the device stopped answering"]
    first = write_json(tmp_path / "first.json", dict(device="NVIDIA H200", torch="2.11", outside_torch=[1, 2],
                       seconds=100.0, results={name: dict(notes=failed) for name in names}))
    unreached = {"sd3 LoRA r32": ["one process: not run, the device stopped answering",
                                  "--fsdp over 8: not run, the device stopped answering"],
                 "flux LoRA r32": ["one process: not run, --time-limit 90 s reached",
                                   "--fsdp over 8: not run, --time-limit 90 s reached"]}
    rerun = write_json(tmp_path / "rerun.json", dict(device="NVIDIA H200", torch="2.11", outside_torch=[3, 4],
                       seconds=50.0, results={name: dict(notes=notes) for name, notes in unreached.items()}))
    merged = memory.merge_gpu_runs([first, rerun])
    assert {name: merged["results"][name]["notes"] for name in names} == {name: failed for name in names}
    assert merged["outside_torch"] == [1, 4] and merged["seconds"] == 150.0
    rerun_failed = {name: dict(notes=["one process: torch.OutOfMemoryError: CUDA out of memory"]) for name in names}
    write_json(tmp_path / "rerun.json", dict(device="NVIDIA H200", torch="2.11", outside_torch=[3, 4], seconds=None,
               results=rerun_failed))
    merged = memory.merge_gpu_runs([first, rerun])   # a rerun that failed otherwise says more: its note replaces
    assert merged["results"]["sd3 LoRA r32"]["notes"] == [
        "one process: torch.OutOfMemoryError: CUDA out of memory", "--fsdp over 8: not run, the device stopped "
        "answering"] and merged["seconds"] is None
