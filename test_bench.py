"""Tests of the benchmark (bench/): the MDP baseline's pieces against independent formulas, and
`python bench/run.py --quick` run as a user would, its outputs checked.

    python -m pytest test_bench.py -q
"""

import math
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "bench"))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

import mdp_baseline as mdp  # noqa: E402


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


def test_run_quick_writes_every_result(tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench", "run.py"), "--quick", "--out", str(out)],
                       env=ENV, cwd=HERE, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    for name in ("variance.md", "learning.md", "learning.png", "cost.md", "learning/jpeg-0.json", "learning/colour-0.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    learning_md = (out / "learning.md").read_text()
    for method in ("V-GRPO", "naive ELBO", "MDP"):
        assert learning_md.count(f"| {method} |") == 2, method          # one row per reward
    rows = [line.split("|") for line in learning_md.splitlines() if line.startswith("| ") and "---" not in line
            and "method" not in line]
    for row in rows:
        final = float(row[2].split("±")[0])
        assert math.isfinite(final) and -2 < final < 0                 # both rewards are negative, above -sqrt(3)
    assert "V-GRPO 0.0e+00" in learning_md                              # V-GRPO's first ratio is exactly 1
    cost_md = (out / "cost.md").read_text()
    ratios = [float(c.strip().rstrip("x")) for line in cost_md.splitlines() for c in line.split("|")
              if c.strip().endswith("x") and c.strip()[:-1].replace(".", "").isdigit()]
    assert len(ratios) == 5 and all(0.05 < r < 20 for r in ratios)     # update x2, rollout x2, memory
    assert "max |difference| 0.00e+00" in cost_md                      # Euler rollout == the diffusers pipeline
    variance_md = (out / "variance.md").read_text()
    assert variance_md.count("\n| ") == 7                              # header, rule, 5 settings
    rows = {line.split("|")[1].strip(): [float(c.split("±")[0]) for c in line.split("|")[2:4]]
            for line in variance_md.splitlines() if line.startswith("| ") and "---" not in line and "setting" not in line}
    naive, full = rows["naive (FPO-style)"], rows["all three (V-GRPO)"]
    assert full[0] < naive[0] and full[1] < naive[1] / 3    # the reductions reduce, sharing most within groups
