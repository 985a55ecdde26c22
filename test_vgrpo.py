"""Tests for vgrpo: pure functions against formulas written here, the sampler against diffusers' pipeline
and an analytic ODE, and whole runs launched as a user would (subprocess, torchrun with 2 processes).
CPU only, offline: every model is a tiny random one built in code, except the demo's learning run, which uses the
shipped digits model (digits/pipeline)."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import vgrpo
from tests.test_rewards import _serve   # the local reward server, for the run that trains against one
from tests.test_wiring import gaussian_velocity, numpy_surrogate   # reference formulas shared with the wiring tests

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
FAST = ["--model", "tiny", "--iterations", "3", "--sample-steps", "6", "--prompts-per-step", "2", "--group-size", "4",
        "--micro-batch", "4", "--n-mc", "2", "--lr", "1e-3", "--no-full-finetune"]


def run_script(*args, nproc=None, timeout=600):
    launcher = [sys.executable] if nproc is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(launcher + [os.path.join(HERE, "vgrpo.py"), *map(str, args)], env=ENV, cwd=HERE,
                          capture_output=True, text=True, timeout=timeout)


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def metrics(out_dir):
    return read(os.path.join(out_dir, "metrics.jsonl"))


def lora(out_dir, iteration):
    return load_file(os.path.join(out_dir, f"checkpoint-{iteration}", "pytorch_lora_weights.safetensors"))


def weights(out_dir, iteration):
    """The trained weights in a checkpoint: the LoRA file, or the full transformer's safetensors."""
    full = os.path.join(out_dir, f"checkpoint-{iteration}", "transformer", "diffusion_pytorch_model.safetensors")
    return load_file(full) if os.path.exists(full) else lora(out_dir, iteration)


# --------------------------------------------------------------------------- group advantages


@pytest.mark.parametrize("group_size,soft_clip", [(2, None), (4, None), (8, None), (8, 1.0), (5, 3.0)])
def test_group_advantages_match_formula(group_size, soft_clip):
    rng = np.random.default_rng(group_size)
    r = rng.normal(size=3 * group_size)
    want = []
    for g in r.reshape(3, group_size):
        std = np.sqrt(np.mean((g - g.mean()) ** 2))   # population std
        a = (g - g.mean()) / (std + 1e-4)
        want.append(soft_clip * np.tanh(a / soft_clip) if soft_clip else a)
    got = vgrpo.group_advantages(torch.tensor(r, dtype=torch.float32), group_size, soft_clip=soft_clip)
    np.testing.assert_allclose(got.numpy(), np.concatenate(want), rtol=1e-5, atol=1e-5)


def test_all_equal_rewards_give_exactly_zero_advantages():
    # in float32 the mean of eight 0.1s is off by 7.5e-9 and so is the std: the plain formula gives
    # 7.5e-9 / (7.5e-9 + 1e-4) = 7e-5 for every member of a group whose rewards are all equal
    eights = torch.full((8,), 0.1)
    naive = (eights - eights.mean()) / (eights.std(unbiased=False) + 1e-4)
    assert naive.abs().min() > 1e-5                      # the premise: without the special case this test fails
    r = torch.cat([eights, torch.full((8,), 5.0), torch.arange(8.0)])
    A = vgrpo.group_advantages(r, 8)
    assert torch.equal(A[:16], torch.zeros(16))
    assert torch.isfinite(A).all() and A[16] < 0 < A[23]
    assert torch.equal(vgrpo.group_advantages(eights, 8, soft_clip=3.0), torch.zeros(8))   # (groups of 4: mean exact)
    two = torch.cat([eights, torch.arange(8.0)])          # per reward: each reward's equal group stays exactly 0
    A = vgrpo.per_reward_advantages({"a": two, "b": -2 * two}, {"a": 1.0, "b": 0.5}, 8, soft_clip=3.0)
    assert torch.equal(A[:8], torch.zeros(8)) and (A[8:] != 0).all()


def test_group_size_one_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        vgrpo.group_advantages(torch.ones(4), 1)


# --------------------------------------------------------------------------- stratified sigmas and pairs


@pytest.mark.parametrize("floor", [0.0, 0.1, 1.0])
def test_advantages_with_a_std_floor_follow_the_formula(floor):
    """--adv-std-floor F: A = (r - mean) / (max(std, F) + 1e-4). A saturated group (rewards near 1, std 0.006) gets
    unit-scale advantages from its noise without a floor, small ones with it; F = 1 on rewards in [0, 1] leaves
    r - mean (Dr. GRPO's advantage, up to the 1e-4)."""
    r = np.array([0.99, 0.995, 1.0, 0.985, 0.1, 0.9, 0.5, 0.3])
    want = np.concatenate([(g - g.mean()) / (max(g.std(), floor) + 1e-4) for g in (r[:4], r[4:])])
    got = vgrpo.group_advantages(torch.tensor(r, dtype=torch.float32), 4, std_floor=floor)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    saturated = np.abs(got[:4].numpy()).max()
    assert saturated > 1 if floor == 0 else saturated < 0.1
    per_reward = vgrpo.per_reward_advantages({"a": torch.tensor(r)}, {"a": 1.0}, 4, std_floor=floor)
    np.testing.assert_allclose(per_reward.numpy(), want, rtol=1e-4, atol=1e-5)
    equal = torch.full((8,), 0.7)                                    # (their float32 mean is inexact)
    assert torch.equal(vgrpo.group_advantages(equal, 8, std_floor=floor), torch.zeros(8))


def test_zero_adv_groups_counts_the_groups_whose_advantages_are_all_zero_under_either_combination():
    """zero_adv_groups is the share of groups with no signal. Under --reward-advantage per-reward a group whose summed
    reward is all equal can still move (its rewards disagree), and that group must not be counted."""
    import types
    parts = {"a": torch.tensor([1., 1, 1, 1, 0, 2, 0, 2, 2, 2, 3, 3]),     # group 2: a + 2 b is 2 everywhere
             "b": torch.tensor([0., 0, 0, 0, 1, 0, 1, 0, 5, 6, 5, 6])}
    r = parts["a"] + 2 * parts["b"]
    run = types.SimpleNamespace(args=types.SimpleNamespace(group_size=4), world=1, device=torch.device("cpu"),
                                stages=[None], family=types.SimpleNamespace(transformer=torch.nn.Linear(1, 1),
                                                                            compiled=False),
                                optimizer=types.SimpleNamespace(state={}))
    stats = {f"time_{k}": 0.0 for k in ("rollout", "reward", "old", "update")}
    summed = vgrpo.iteration_metrics(run, 0, dict(stats), r, vgrpo.group_advantages(r, 4))
    assert summed["zero_adv_groups"] == pytest.approx(2 / 3)                  # groups 1 and 2: equal sums
    A = vgrpo.per_reward_advantages(parts, {"a": 1.0, "b": 2.0}, 4)
    assert torch.allclose(A[4:8].abs(), torch.full((4,), 1 / 3), atol=1e-3)   # group 2 moves after all
    assert vgrpo.iteration_metrics(run, 0, dict(stats), r, A)["zero_adv_groups"] == pytest.approx(1 / 3)


def test_the_iteration_metrics_follow_their_formulas():
    """One process's metrics of an iteration, each written out here: population standard deviations, the stage
    (1-based) of a 2-stage curriculum, the transformer's and AdamW's bytes, the phases' total."""
    import types
    r = torch.tensor([1., 2, 4, 8, 3, 3, 3, 3])
    A = torch.tensor([-1.5, -0.5, 0.25, 1.75, 0, 0, 0, 0])
    model = torch.nn.Linear(3, 2)                                           # 8 float32 weights
    adam = {"exp_avg": torch.zeros(5), "step": torch.tensor(1.0)}           # 6 more
    stages = [types.SimpleNamespace(start=0, end=2), types.SimpleNamespace(start=2, end=9)]
    run = types.SimpleNamespace(args=types.SimpleNamespace(group_size=4), world=1, device=torch.device("cpu"),
                                stages=stages, family=types.SimpleNamespace(transformer=model, compiled=False),
                                optimizer=types.SimpleNamespace(state={0: adam}))
    stats = {"time_rollout": 1.0, "time_reward": 2.0, "time_old": 0.25, "time_update": 4.0, "policy_loss": 0.5,
             "ratio_min": 0.75}
    m = vgrpo.iteration_metrics(run, 2, dict(stats), r, A)
    rn, An = r.double().numpy(), A.double().numpy()
    expected = {**stats, "iteration": 3, "reward_mean": rn.mean(), "reward_std": rn.std(),
                "reward_group_std": (rn[:4].std() + 0.0) / 2, "zero_adv_groups": 0.5, "flat_groups": 0.5,
                "adv_mean": An.mean(), "adv_std": An.std(), "adv_abs_max": 1.75, "stage": 2,
                "state_mb": 14 * 4 / 2**20, "time_total": 7.25}
    assert m.keys() == expected.keys()
    assert {k: pytest.approx(v, rel=1e-6) for k, v in expected.items()} == m
    assert [vgrpo.iteration_metrics(run, it, dict(stats), r, A)["stage"] for it in (0, 1, 8)] == [1, 1, 2]
    run.stages = stages[:1]                                                 # no curriculum: no stage
    assert "stage" not in vgrpo.iteration_metrics(run, 2, dict(stats), r, A)


def test_flat_groups_are_those_whose_std_is_within_a_thousandth_of_their_mean():
    # the last group is flat by the population std (0.95e-3 of its mean), not by the sample std (1.10e-3)
    groups = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.999, 1.0, 1.0, 1.0], [0.9, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0],
                           [-0.2, -0.2001, -0.2, -0.2], [0.0, 0.001, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0022]])
    std, mean = groups.std(1, unbiased=False), groups.mean(1)
    assert [bool(x) for x in std <= 1e-3 * mean.abs()] == [True, True, False, True, True, False, True]   # by hand
    assert not groups[-1].std() <= 1e-3 * groups[-1].mean()
    assert vgrpo.flat_group_share(groups) == pytest.approx(5 / 7)
    # each group against its own mean: [0, 0.001, 0, 0] is not flat beside a group of ones either
    assert vgrpo.flat_group_share(groups[[0, 5]]) == 0.5


def test_pixel_and_embedding_diversity_follow_their_formulas():
    """The evaluation's diversity of one prompt's images: the mean over pairs of the RMS pixel difference, and of
    1 - cosine of their embeddings; identical images (or embeddings, at any scale) give 0."""
    g = torch.Generator().manual_seed(0)
    assert vgrpo.pixel_diversity(torch.rand(1, 3, 8, 8, generator=g).expand(4, 3, 8, 8)) == 0.0
    x = (torch.rand(3, 3, 8, 8, generator=g) * 255).round() / 255       # uint8 levels, which the measure rounds to
    rms = [((x[i] - x[j]) ** 2).mean().sqrt().item() for i, j in ((0, 1), (0, 2), (1, 2))]
    assert vgrpo.pixel_diversity(x) == pytest.approx(sum(rms) / 3, rel=1e-5)
    assert vgrpo.pixel_diversity(x) > 0.3                              # independent uniform noise: about 0.41
    assert vgrpo.pixel_diversity(x + 1e-4) == vgrpo.pixel_diversity(x)   # float noise below a uint8 level: none
    beyond = x.clone()
    beyond[0, :, 0], beyond[1, :, 0] = -0.5, 0.0                           # the rewards see both as black
    beyond[0, :, 1], beyond[1, :, 1] = 1.5, 1.0                            # and both as white
    clipped = beyond.clamp(0, 1)
    assert beyond.ne(clipped).any() and vgrpo.pixel_diversity(beyond) == vgrpo.pixel_diversity(clipped)
    # 30 pictures, one a uint8 level off in one pixel: 29 pairs 1/255 apart, exactly (torch's matmul shortcut for
    # many rows, |a|^2 + |b|^2 - 2 a.b, rounds such a distance to 0)
    near = x[:1].repeat(30, 1, 1, 1)
    near[1, 0, 0, 0] += 1 / 255 if near[1, 0, 0, 0] < 1 else -1 / 255
    assert vgrpo.pixel_diversity(near) == pytest.approx(2 * 29 / 255 / (30 * 29) / (3 * 8 * 8) ** 0.5, rel=1e-4)
    same = torch.randn(1, 16, generator=g) * torch.arange(1.0, 6.0)[:, None]
    assert abs(vgrpo.embedding_diversity(same)) < 1e-6
    f = torch.randn(4, 16, generator=g)
    cos = [torch.nn.functional.cosine_similarity(f[i], f[j], dim=0).item() for i in range(4) for j in range(i + 1, 4)]
    assert vgrpo.embedding_diversity(f) == pytest.approx(1 - sum(cos) / len(cos), rel=1e-5)
    assert vgrpo.embedding_diversity(torch.eye(4)) == pytest.approx(1.0)


def test_the_evaluation_tally_groups_each_prompts_images_across_chunks():
    """EvalTally as evaluate feeds it: 3 prompts x 3 images in chunks of 4, so the second prompt's images arrive in
    two chunks; tags "a", none, "a". Every metric against its formula over the prompts' images."""
    g = torch.Generator().manual_seed(1)
    images = (torch.rand(9, 3, 4, 4, generator=g) * 255).round() / 255
    images[:3] = images[0]                                            # prompt 0: three copies of one picture
    features, reward = torch.randn(9, 8, generator=g), torch.rand(9, generator=g)
    local = [(i, k) for i in range(3) for k in range(3)]
    tally = vgrpo.EvalTally(["r", "s"], ["a", None, "a"], 3, counts=["s_unparsed"])
    shares = {0: 0.25, 4: 0.5, 8: 1.0}                                   # a count: each chunk's share of its images
    for start in range(0, 9, 4):
        rows = slice(start, start + 4)
        tally.add(local[rows], images[rows], {"r": reward[rows], "s": 2 * reward[rows]}, 3 * reward[rows],
                  features[rows], {"s_unparsed": shares[start]})
    m = tally.metrics(1, "cpu", objective=True)
    assert m["eval_s_unparsed"] == pytest.approx((0.25 * 4 + 0.5 * 4 + 1.0 * 1) / 9)   # per image, not per chunk
    pixel = [vgrpo.pixel_diversity(images[3 * i:3 * i + 3]) for i in range(3)]
    embedded = [vgrpo.embedding_diversity(features[3 * i:3 * i + 3]) for i in range(3)]
    assert pixel[0] == 0.0 and min(pixel[1:]) > 0
    assert m["eval_r"] == pytest.approx(reward.mean().item()) and m["eval_s"] == pytest.approx(2 * m["eval_r"])
    assert m["eval_reward"] == pytest.approx(3 * m["eval_r"])
    assert m["eval_r/a"] == pytest.approx(torch.cat([reward[:3], reward[6:]]).mean().item())
    assert m["eval_r/mean_of_tags"] == m["eval_r/a"] and "eval_s/a" not in m
    assert m["eval_diversity"] == pytest.approx(sum(pixel) / 3)
    assert m["eval_diversity/a"] == pytest.approx((pixel[0] + pixel[2]) / 2)
    assert m["eval_diversity_clip"] == pytest.approx(sum(embedded) / 3)
    assert "eval_reward" not in tally.metrics(1, "cpu")
    one_each = vgrpo.EvalTally(["r"], [None] * 3, 1)                  # one image per prompt: no pairs, no diversity
    one_each.add([(0, 0), (1, 0), (2, 0)], images[:3], {"r": reward[:3]}, reward[:3], None)
    assert not any(k.startswith("eval_diversity") for k in one_each.metrics(1, "cpu"))
    unequal = vgrpo.EvalTally(["r"], ["a", "b", "a"], 1)              # tags of 2 prompts and of 1
    unequal.add([(0, 0), (1, 0), (2, 0)], images[:3], {"r": reward[:3]}, reward[:3], None)
    tags = unequal.metrics(1, "cpu")
    by_tag = [(reward[0] + reward[2]).item() / 2, reward[1].item()]
    assert tags["eval_r/a"] == pytest.approx(by_tag[0]) and tags["eval_r/b"] == pytest.approx(by_tag[1])
    assert tags["eval_r/mean_of_tags"] == pytest.approx(sum(by_tag) / 2)     # each tag alike, as GenEval's overall
    assert abs(sum(by_tag) / 2 - reward[:3].mean().item()) > 0.01            # (not the mean over images)


@pytest.mark.parametrize("w2", [0.5, -0.5])   # a negative weight penalises a reward; |w| still sets its share
def test_per_reward_advantages_normalise_each_reward_then_sum(w2):
    rng = np.random.default_rng(3)
    r1, r2 = rng.normal(size=8), 1000 * rng.normal(size=8)   # very different scales
    r2[4:] = 7.0                                             # reward 2 all equal in group 2
    want = []
    for g in range(2):
        a = 0.0
        for r, w in ((r1, 1.0), (r2, w2)):
            x = r[4 * g:4 * g + 4]
            a = a + w * (x - x.mean()) / (x.std() + 1e-4)
        a = a / 1.5                                          # 1 + |w2|: A stays on one advantage's scale
        want.append(2.0 * np.tanh(a / 2.0))
    got = vgrpo.per_reward_advantages({"a": torch.tensor(r1), "b": torch.tensor(r2)}, {"a": 1.0, "b": w2}, 4,
                                      soft_clip=2.0)
    np.testing.assert_allclose(got.numpy(), np.concatenate(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps,n", [(10, 4), (10, 10), (7, 3), (40, 4)])
def test_stratified_sigmas_one_per_chunk(steps, n):
    grid = torch.cat([torch.linspace(1.0, 0.05, steps), torch.zeros(1)])
    chunks = np.array_split(grid[:-1].numpy(), n)     # independent split of the grid without its 0
    seen = [set() for _ in range(n)]
    for seed in range(200):
        s = vgrpo.stratified_sigmas(grid, n, torch.Generator().manual_seed(seed))
        assert s.shape == (n,)
        for j, value in enumerate(s.tolist()):
            assert any(np.isclose(value, chunks[j])), (value, chunks[j])
            seen[j].add(round(value, 6))
    assert all(len(seen[j]) == len(chunks[j]) for j in range(n))   # every grid point of a chunk is reachable
    a = vgrpo.stratified_sigmas(grid, n, torch.Generator().manual_seed(3))
    assert torch.equal(a, vgrpo.stratified_sigmas(grid, n, torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("sharing", ["batch", "group", "none"])
def test_pairs_are_shared_as_requested(sharing):
    grid = torch.cat([torch.linspace(1.0, 0.1, 10), torch.zeros(1)])
    ids = [(p, m) for p in (0, 1) for m in range(3)]
    sig, eps = vgrpo.draw_pairs(grid, 4, (2, 3, 3), ids, sharing, True, seed=0, iteration=5)
    assert sig.shape == (6, 4) and eps.shape == (6, 4, 2, 3, 3)
    same = lambda i, j: torch.equal(sig[i], sig[j]) and torch.equal(eps[i], eps[j])
    assert same(0, 1) == (sharing != "none")            # members of one group
    assert same(0, 3) == (sharing == "batch")           # two groups
    # keyed by (seed, iteration, global prompt, member): rank 1 holding only prompt 1 sees the same draws
    sig1, eps1 = vgrpo.draw_pairs(grid, 4, (2, 3, 3), ids[3:], sharing, True, seed=0, iteration=5)
    assert torch.equal(sig1, sig[3:]) and torch.equal(eps1, eps[3:])
    _, eps_next = vgrpo.draw_pairs(grid, 4, (2, 3, 3), ids, sharing, True, seed=0, iteration=6)
    assert not torch.equal(eps_next, eps)                # a new iteration draws new pairs


# --------------------------------------------------------------------------- ELBO surrogate and loss


@pytest.mark.parametrize("weighting", ["adaptive", "none"])
def test_elbo_surrogate_matches_formula(weighting):
    rng = np.random.default_rng(0)
    B, N, lat = 3, 4, (2, 4, 4)
    v, eps = rng.normal(size=(B, N, *lat)), rng.normal(size=(B, N, *lat))
    o, sig = rng.normal(size=(B, *lat)), rng.uniform(0.05, 1.0, size=(B, N))
    s_want, x0_want = numpy_surrogate(v, o, sig, eps, weighting)
    err = x0_want - o[:, None]
    v_t = torch.tensor(v, dtype=torch.float32, requires_grad=True)
    s, x0 = vgrpo.elbo_surrogate(v_t, *(torch.tensor(a, dtype=torch.float32) for a in (o, sig, eps)), weighting=weighting)
    np.testing.assert_allclose(s.detach().numpy(), s_want, rtol=1e-5)
    np.testing.assert_allclose(x0.detach().numpy(), err + o[:, None], rtol=1e-5, atol=1e-6)
    # gradient: the adaptive denominator is a stop-grad constant c, so ds/dv = 2 sigma err / (N D c)
    s.sum().backward()
    D = np.prod(lat)
    c = np.abs(err).mean(axis=(2, 3, 4), keepdims=True) if weighting == "adaptive" else 1.0
    want_grad = 2 * sig[:, :, None, None, None] * err / (N * D * c)
    np.testing.assert_allclose(v_t.grad.numpy(), want_grad, rtol=1e-4, atol=1e-7)


def test_vgrpo_loss_matches_formula():
    rng = np.random.default_rng(1)
    s_new, s_old, A = rng.normal(0, 0.02, 16), rng.normal(0, 0.02, 16), rng.normal(size=16)
    x0n, x0o = rng.normal(size=(16, 2, 3)), rng.normal(size=(16, 2, 3))
    ratio = np.exp(s_new - s_old)
    want = -np.mean(np.minimum(ratio * A, np.clip(ratio, 0.99, 1.01) * A)) + 0.3 * np.mean((x0n - x0o) ** 2)
    t = lambda a: torch.tensor(a, dtype=torch.float32)
    loss, stats = vgrpo.vgrpo_loss(t(s_new), t(s_old), t(A), 0.01, 0.3, t(x0n), t(x0o))
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(np.mean(np.abs(ratio - 1) > 0.01))
    assert stats["ratio_max"] == pytest.approx(ratio.max(), rel=1e-6)
    assert stats["kl"] == pytest.approx(np.mean((x0n - x0o) ** 2), rel=1e-5)


@pytest.mark.parametrize("log_ratio,A,binds", [(0.05, 1.0, True), (-0.05, -1.0, True), (0.05, -1.0, False),
                                               (-0.05, 1.0, False), (0.005, 1.0, False)])
def test_zero_gradient_where_the_clip_binds(log_ratio, A, binds):
    s_new = torch.tensor([log_ratio], requires_grad=True)
    loss, _ = vgrpo.vgrpo_loss(s_new, torch.zeros(1), torch.tensor([A]), clip_eps=0.01)
    loss.backward()
    if binds:
        assert s_new.grad.item() == 0.0
    else:
        assert s_new.grad.item() == pytest.approx(-A * np.exp(log_ratio), rel=1e-5)


# --------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("shift,steps", [(1.0, 10), (3.0, 16), (3.0, 40)])
def test_ode_samplers_against_the_exact_gaussian_flow(shift, steps):
    from diffusers import FlowMatchEulerDiscreteScheduler
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    z = torch.randn(256, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    velocity = gaussian_velocity(0.5)
    err = {name: (vgrpo.sample_ode(velocity, z, scheduler.sigmas.double(), name) - 0.5 * z).abs().max().item()
           for name in vgrpo.SAMPLERS}
    assert err["dpmpp2m"] < err["euler"] / 2, err


@pytest.mark.parametrize("steps", [10, 16])
def test_dpmpp2m_equals_diffusers_dpm_solver_on_its_grid(steps):
    from diffusers import DPMSolverMultistepScheduler
    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction",
                                            algorithm_type="dpmsolver++", solver_order=2, final_sigmas_type="zero")
    scheduler.set_timesteps(steps)
    velocity = gaussian_velocity(0.7)
    x = z = torch.randn(64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity(x, scheduler.sigmas[i]), t, x).prev_sample
    ours = vgrpo.sample_ode(velocity, z, scheduler.sigmas.double(), "dpmpp2m")
    assert (ours - x).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def tiny():
    return vgrpo.load_family(vgrpo.Args(model="tiny"), torch.device("cpu"))


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_euler_rollout_reproduces_stable_diffusion3_pipeline(tiny, guidance):
    prompts = ["a red apple", "a blue car on a road"]
    noise = torch.randn(2, *tiny.latent_shape, generator=torch.Generator().manual_seed(1))
    want = tiny.pipe(prompt=prompts, num_inference_steps=8, guidance_scale=guidance, latents=noise.clone(),
                     height=32, width=32, max_sequence_length=0, output_type="latent").images
    args = vgrpo.Args(model="tiny", sampler="euler", guidance=guidance, micro_batch=2)
    got = vgrpo.rollout(tiny, tiny.transformer, tiny.encode(prompts), noise, tiny.sigma_grid(8), args,
                        tiny.encode([""]))
    assert (got - want).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def tiny_flux():
    return vgrpo.load_family(vgrpo.Args(model="tiny-flux"), torch.device("cpu"))


@pytest.mark.parametrize("guidance", [3.5, 1.0])
def test_euler_rollout_reproduces_flux_pipeline(tiny_flux, guidance):
    """Packed latents, image ids, the guidance embedding and FLUX's resolution-shifted schedule: the same
    latents as FluxPipeline with the same noise."""
    fam = vgrpo.FluxFamily(tiny_flux.pipe, 32, 16, torch.device("cpu"), guidance=guidance)
    prompts = ["a red apple", "a blue car on a road"]
    noise = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    want = fam.pipe(prompt=prompts, num_inference_steps=8, guidance_scale=guidance, latents=noise.clone(), height=32,
                    width=32, max_sequence_length=16, output_type="latent").images
    args = vgrpo.Args(model="tiny-flux", sampler="euler", guidance=guidance, micro_batch=2)
    got = vgrpo.rollout(fam, fam.transformer, fam.encode(prompts), noise, fam.sigma_grid(8), args)
    assert got.shape == (2, 64, 16)
    assert (got - want).abs().max().item() < 1e-5
    pictures = fam.pipe(prompt=prompts, num_inference_steps=8, guidance_scale=guidance, latents=noise.clone(), height=32,
                        width=32, max_sequence_length=16, output_type="pt").images
    assert (fam.decode(got) - pictures).abs().max() < 1e-5     # unpacking, VAE scale and shift as the pipeline


def test_prompt_embeddings_are_cached_per_prompt_within_a_byte_budget(tiny_flux):
    fam = vgrpo.FluxFamily(tiny_flux.pipe, 32, 16, torch.device("cpu"))
    alone = [fam.encode([p]) for p in ("a cat", "a dog", "a fox")]
    one_entry = sum(t.numel() * t.element_size() for t in fam._cache["a cat"])
    fam._cache.clear()
    fam.cache_bytes = 2 * one_entry                      # room for two prompts
    batch = fam.encode(["a dog", "a cat", "a dog"])
    assert all(torch.equal(b, torch.stack([alone[1][k][0], alone[0][k][0], alone[1][k][0]])) for k, b in enumerate(batch))
    fam.encode(["a fox"])
    assert list(fam._cache) == ["a cat", "a fox"]        # "a dog", used least recently, was dropped


# --------------------------------------------------------------------------- ratio before the first step


@pytest.mark.parametrize("model,precision,full,inner_steps,micro_batch", [
    ("tiny", "no", True, 1, 8), ("tiny", "no", True, 2, 2), ("tiny", "bf16", False, 2, 2),
    ("tiny-flux", "no", False, 2, 2), ("tiny-flux", "bf16", True, 1, 8), ("tiny-flux", "fp16", False, 1, 4)])
def test_ratio_is_exactly_one_before_the_first_update(model, precision, full, inner_steps, micro_batch):
    args = vgrpo.Args(model=model, prompts_per_step=2, group_size=4, sample_steps=6, inner_steps=inner_steps,
                      micro_batch=micro_batch, beta=0.1, mixed_precision=precision, full_finetune=full)
    run, _ = vgrpo.build_run(args, 0, 1, torch.device("cpu"))
    ids = [(p, m) for p in range(2) for m in range(4)]
    cond = run.family.encode(["a cat"] * 4 + ["a dog"] * 4)
    noise = torch.randn(8, *run.family.latent_shape)
    o = vgrpo.rollout(run.family, run.family.transformer, cond, noise, run.sigmas, args)
    sig, eps = vgrpo.draw_pairs(run.sigmas, args.n_mc, run.family.latent_shape, ids, "batch", True, 0, 0)
    batch = {"o": o, "cond": cond, "sigmas": sig, "eps": eps}
    s_old, x0_old = vgrpo.old_surrogate(run.family, run.family.transformer, batch, args, 2, from_step=0)
    for k, idx in vgrpo.micro_batches(2, 4, inner_steps, micro_batch):
        if k > 0:
            break
        s_new, x0_new = vgrpo.surrogate(run.family, run.model, o[idx], sig[idx], eps[idx],
                                        vgrpo.rows_of(cond, idx), args.weighting)
        assert s_new.requires_grad and s_new.dtype == torch.float32   # the surrogate stays float32
        assert torch.equal(torch.exp(s_new - s_old[idx]), torch.ones(len(idx)))
        assert torch.equal(x0_new, x0_old[idx])
    if precision != "no":  # the matmuls really ran in low precision, the trained weights did not
        assert all(p.dtype == torch.float32 for p in run.params)
        frozen = {p.dtype for p in run.family.transformer.parameters() if not p.requires_grad}
        assert frozen == (set() if full else {vgrpo.AMP_DTYPES[precision]})


# --------------------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("short")
    p = run_script(*FAST, "--inner-steps", "2", "--micro-batch", "2", "--beta", "0.1", "--adv-soft-clip", "3",
                   "--sample-every", "2", "--output-dir", out)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p


def grid_pictures(path, groups, members, side=32):
    """The uint8 images of a sample grid: rows of `members` pictures, upscaled 4x (nearest) to 128 px, with 14 px
    for the prompt above and 12 px for the rewards below each row -> (groups * members, side, side, 3)."""
    from PIL import Image
    grid = np.asarray(Image.open(path).convert("RGB"))
    assert grid.shape == (groups * (14 + 128 + 12), members * 128, 3)
    out = []
    for g in range(groups):
        for m in range(members):
            big = grid[g * 154 + 14:g * 154 + 142, m * 128:(m + 1) * 128]
            small = big[::128 // side, ::128 // side]
            assert (np.repeat(np.repeat(small, 128 // side, 0), 128 // side, 1) == big).all()   # nothing drawn on it
            out.append(small)
    return np.stack(out)


def jpeg_kb(picture):
    import io
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(picture).save(buf, "JPEG", quality=95)
    return len(buf.getvalue()) / 1000


def initial_lora():
    """The LoRA a --no-full-finetune run of the tiny model starts from (seeded), keyed as in the saved file."""
    from peft.utils import get_peft_model_state_dict
    args = vgrpo.parse_args(["--model", "tiny", "--no-full-finetune"])
    family = vgrpo.load_family(args, torch.device("cpu"))
    vgrpo.add_trainable_weights(family, args)
    return {"transformer." + k: v for k, v in get_peft_model_state_dict(family.transformer).items()}


@pytest.mark.slow
def test_script_run_writes_its_outputs(short_run):
    out, p = short_run
    m = metrics(out)
    assert [x["iteration"] for x in m] == [1, 2, 3]
    for x, it in zip(m, (1, 2, 3)):
        assert all(np.isfinite(v) for v in x.values())
        assert x["skipped_steps"] == 0 and x["grad_norm"] > 0
        assert x["kl"] > 0 and (x["ratio_max"] > 1.0 or x["ratio_min"] < 1.0)   # the 2nd inner step sees moved weights
        # every logged reward and advantage statistic, recomputed from the 8 pictures in that iteration's grid:
        # jpeg:100 = -100 kB / 500, advantages with the soft clip eta = 3
        r = np.array([-100 * jpeg_kb(im) / 500 for im in grid_pictures(out / "samples" / f"iter-{it:05d}.png", 2, 4)])
        groups = r.reshape(2, 4)
        A = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-4)
        A = 3 * np.tanh(A / 3)
        assert x["reward_mean"] == pytest.approx(r.mean(), rel=1e-6)
        assert x["reward_std"] == pytest.approx(r.std(), rel=1e-4)
        assert x["reward_group_std"] == pytest.approx(groups.std(1).mean(), rel=1e-4)
        assert x["adv_abs_max"] == pytest.approx(np.abs(A).max(), rel=1e-4)
        assert x["adv_std"] == pytest.approx(A.std(), rel=1e-4)
        assert x["adv_mean"] == pytest.approx(A.mean(), abs=1e-5)
    assert sum(line.startswith("it ") for line in p.stdout.splitlines()) == 3
    assert "batch: 2 prompts x 4 images = 8 samples" in p.stdout
    assert sorted(os.listdir(out / "samples")) == ["iter-00001.png", "iter-00002.png", "iter-00003.png"]
    ckpt = out / "checkpoint-3"
    assert {"pytorch_lora_weights.safetensors", "optimizer.pt", "state.json"} <= set(os.listdir(ckpt))
    assert json.loads((ckpt / "state.json").read_text())["iteration"] == 3
    start, trained = initial_lora(), lora(out, 3)
    assert trained.keys() == start.keys()
    still = [k for k in start if torch.equal(trained[k], start[k])]
    # the last MMDiT block discards its text stream, so its text queries get no gradient; all else trained
    assert still == [f"transformer.transformer_blocks.1.attn.add_q_proj.lora_{ab}.weight" for ab in "AB"]
    # AdamW moves a weight by about lr per step: 3 iterations x 2 inner steps at --lr 1e-3
    assert 1e-3 < max((trained[k] - start[k]).abs().max().item() for k in start) < 6 * 1.1e-3


@pytest.mark.slow
def test_saved_lora_loads_into_stable_diffusion3_pipeline(short_run, tiny):
    out, _ = short_run
    pipe = vgrpo.build_tiny_sd3_pipeline()
    base = pipe(prompt="a cat", num_inference_steps=4, height=32, width=32, max_sequence_length=0,
                output_type="latent", generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(out / "checkpoint-3"))
    tuned = pipe(prompt="a cat", num_inference_steps=4, height=32, width=32, max_sequence_length=0,
                 output_type="latent", generator=torch.Generator().manual_seed(0)).images
    # the same LoRA put into vgrpo's own model (alpha / r scaling included) must give the same images
    args = vgrpo.Args(model="tiny", full_finetune=False)
    family = vgrpo.load_family(args, torch.device("cpu"))
    vgrpo.add_trainable_weights(family, args)
    from peft import set_peft_model_state_dict
    set_peft_model_state_dict(family.transformer, {k.removeprefix("transformer."): v for k, v in lora(out, 3).items()})
    family.pipe.transformer = family.transformer
    ours = family.pipe(prompt="a cat", num_inference_steps=4, height=32, width=32, max_sequence_length=0,
                       output_type="latent", generator=torch.Generator().manual_seed(0)).images
    assert (tuned - base).abs().max() > 1e-4
    assert torch.allclose(tuned, ours, atol=1e-5)


def one_and_torchrun(flags, one_dir, many_dir, nproc):
    """The same command in one process and under torchrun with `nproc` -> the two runs' metrics.jsonl rows."""
    one = run_script(*flags, "--output-dir", one_dir)
    many = run_script(*flags, "--output-dir", many_dir, nproc=nproc)
    assert one.returncode == 0, one.stderr[-3000:]
    assert many.returncode == 0, many.stderr[-3000:]
    return metrics(one_dir), metrics(many_dir)


@pytest.mark.slow
def test_two_processes_train_exactly_like_one(tmp_path):
    """The default pair sharing (`batch`): one process or two, the same run bit for bit. Why exactly: the two
    micro-batches of an optimizer step are the same rows either way, and halving a float is exact, so DDP's
    average of two ranks' gradients equals one process's sum of two half-weighted micro-batches."""
    (tmp_path / "eval.txt").write_text("a red cube\na green ball\na blue cone\n")   # 3 prompts: 2 + 1 per rank
    common = [*FAST, "--iterations", "2", "--inner-steps", "2", "--micro-batch", "2",
              "--eval-prompts", tmp_path / "eval.txt", "--eval-every", "2"]
    m1, m2 = one_and_torchrun(common, tmp_path / "one", tmp_path / "two", 2)
    assert [x["iteration"] for x in m1] == [x["iteration"] for x in m2] == [1, 2]
    for a, b in zip(m1, m2):
        for key in ("reward_mean", "reward_std", "adv_abs_max", "adv_std", "grad_norm", "ratio_max", "ratio_min",
                    "clip_frac"):
            assert a[key] == b[key], (a["iteration"], key, a[key], b[key])
        # means over micro-batches: float32 on one process, float64 over ranks on two; the policy loss is a
        # near-cancelling mean of O(1) terms, so its rounding is absolute (~1e-8), not relative
        assert a["policy_loss"] == pytest.approx(b["policy_loss"], rel=0, abs=1e-7)
        assert a["ratio_mean"] == pytest.approx(b["ratio_mean"], rel=1e-6)
    assert m1[1]["ratio_max"] > 1.0 or m1[1]["ratio_min"] < 1.0      # the 2nd inner step saw moved weights
    e1, e2 = (read(tmp_path / d / "eval.jsonl") for d in ("one", "two"))
    assert [x["iteration"] for x in e1] == [x["iteration"] for x in e2] == [0, 2]
    for a, b in zip(e1, e2):                                          # the same images, summed over ranks
        assert a["eval_jpeg"] == pytest.approx(b["eval_jpeg"], rel=1e-12)
        assert a["eval_diversity"] == pytest.approx(b["eval_diversity"], rel=1e-12) and a["eval_diversity"] > 0
    w1, w2, w0 = lora(tmp_path / "one", 2), lora(tmp_path / "two", 2), initial_lora()
    assert w1.keys() == w2.keys() == w0.keys()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert sum(not torch.equal(w1[k], w0[k]) for k in w1) > len(w1) / 2          # and training moved them


@pytest.mark.slow
def test_eight_processes_train_like_one(tmp_path):
    """The same global batch over 8 processes as in one, 2 prompt groups per rank, 2 inner steps, and the same rows
    in every transformer and VAE pass (--sample-batch, --decode-batch: a pass of another size rounds differently).
    The first rollout is the same bit for bit (prompts, noises, rewards, advantages), and so were the first
    iteration's ratios and gradient norms (compared here to 1e-6). The weights then drift by rounding: gloo adds 8
    ranks' gradients in another order than one process accumulates them, and float addition is not associative;
    the next rollout's JPEG byte counts amplify it. Measured: the trained weights 0.2% of how far training moved them
    apart (in norm; 2 processes agree bit for bit, test_two_processes_train_exactly_like_one). The margin is 25x
    that; rank j training another prompt slot, or a gradient summed instead of averaged, moves them by a whole step."""
    common = [*FAST, "--iterations", "2", "--prompts-per-step", "16", "--inner-steps", "2", "--micro-batch", "2",
              "--sample-batch", "8", "--decode-batch", "8"]
    m1, m8 = one_and_torchrun(common, tmp_path / "one", tmp_path / "eight", 8)
    assert [x["iteration"] for x in m1] == [x["iteration"] for x in m8] == [1, 2]
    for key in ("reward_mean", "reward_std", "adv_abs_max", "adv_std"):    # before any update: exactly
        assert m1[0][key] == m8[0][key], (key, m1[0][key], m8[0][key])
    for key in ("grad_norm", "ratio_max", "ratio_min"):
        assert m1[0][key] == pytest.approx(m8[0][key], rel=1e-6, abs=1e-12), (key, m1[0][key], m8[0][key])
    assert m1[0]["ratio_max"] > 1.0                                   # the 2nd inner step saw moved weights
    w1, w8, w0 = lora(tmp_path / "one", 2), lora(tmp_path / "eight", 2), initial_lora()
    moved = sum(((w1[k] - w0[k]).double() ** 2).sum() for k in w1).sqrt().item()
    apart = sum(((w1[k] - w8[k]).double() ** 2).sum() for k in w1).sqrt().item()
    assert moved > 0 and apart < 0.05 * moved, (apart, moved)


@pytest.mark.slow
def test_training_with_classifier_free_guidance(tmp_path):
    """--guidance 3 on SD3: the rollouts are StableDiffusion3Pipeline's CFG images from the same noises (compared
    in the saved grid, to the uint8 rounding), and the conditional surrogate trains on them."""
    (tmp_path / "one.txt").write_text("a red apple\n")           # both groups get this prompt
    p = run_script(*FAST, "--iterations", "2", "--guidance", "3", "--sampler", "euler", "--prompts",
                   tmp_path / "one.txt", "--output-dir", tmp_path / "o")
    assert p.returncode == 0, p.stderr[-3000:]
    m = metrics(tmp_path / "o")
    assert all(x["skipped_steps"] == 0 and np.isfinite(x["grad_norm"]) and x["grad_norm"] > 0 for x in m)
    got = grid_pictures(tmp_path / "o" / "samples" / "iter-00001.png", 2, 4).astype(int)
    # the run's starting noises: keyed by (seed, "noise", iteration, prompt slot, member), on any number of ranks
    noise = torch.stack([torch.randn(4, 16, 16, generator=vgrpo.keyed_generator(0, "noise", 0, j, k))
                         for j in range(2) for k in range(4)])
    pipe = vgrpo.build_tiny_sd3_pipeline()

    def pictures(guidance):
        images = pipe(prompt=["a red apple"] * 8, num_inference_steps=6, guidance_scale=guidance, latents=noise.clone(),
                      height=32, width=32, max_sequence_length=0, output_type="np").images
        return np.round(images * 255).astype(int)

    assert np.abs(got - pictures(3.0)).max() <= 1
    assert np.abs(got - pictures(1.0)).max() > 20               # and guidance changed them


@pytest.mark.slow
def test_pairs_shared_by_nobody_train(short_run, tmp_path):
    """--pair-sharing none: the short run's flags for one iteration. Same rollouts and advantages (the pairs are
    drawn after them); a different update, since every sample now has its own (sigma, eps) pairs."""
    p = run_script(*FAST, "--inner-steps", "2", "--micro-batch", "2", "--beta", "0.1", "--adv-soft-clip", "3",
                   "--iterations", "1", "--pair-sharing", "none", "--output-dir", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    none, batch = metrics(tmp_path)[0], metrics(short_run[0])[0]
    for key in ("reward_mean", "reward_std", "adv_abs_max", "adv_std"):
        assert none[key] == batch[key], key
    assert none["skipped_steps"] == 0 and np.isfinite(none["grad_norm"]) and none["kl"] > 0
    assert none["grad_norm"] != pytest.approx(batch["grad_norm"], rel=1e-3)
    assert none["kl"] != pytest.approx(batch["kl"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--no-full-finetune --mixed-precision fp16",
                                  "--no-full-finetune --mixed-precision bf16", "--full-finetune"])
def test_resume_continues_exactly(tmp_path, mode):
    common = [*FAST, "--iterations", "4", "--save-every", "2", *mode.split()]
    full = run_script(*common, "--output-dir", tmp_path / "full")
    first = run_script(*common, "--iterations", "2", "--output-dir", tmp_path / "part")
    assert full.returncode == 0 and first.returncode == 0, full.stderr[-2000:] + first.stderr[-2000:]
    with open(tmp_path / "part" / "metrics.jsonl", "a") as f:   # as if the run had died after iteration 3
        f.write(json.dumps({"iteration": 3, "reward_mean": 0.0}) + "\n")
    rest = run_script(*common, "--output-dir", tmp_path / "part", "--resume", tmp_path / "part" / "checkpoint-2")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout
    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "part")
    assert [x["iteration"] for x in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["grad_norm"] == y["grad_norm"]
        assert x.get("loss_scale") == y.get("loss_scale") and ("fp16" in mode) == ("loss_scale" in x)
    w_full, w_part, w_start = weights(tmp_path / "full", 4), weights(tmp_path / "part", 4), weights(tmp_path / "part", 2)
    assert any(not torch.equal(w_full[k], w_start[k]) for k in w_full)   # training moved the weights
    for k in w_full:
        assert torch.equal(w_full[k], w_part[k]), k


@pytest.mark.slow
def test_keep_last_and_resume_auto_skip_incomplete_checkpoints(tmp_path):
    p = run_script(*FAST, "--iterations", "4", "--save-every", "1", "--keep-last", "2", "--output-dir", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(x for x in os.listdir(tmp_path) if x.startswith("checkpoint")) == ["checkpoint-3", "checkpoint-4"]
    os.makedirs(tmp_path / "checkpoint-9.tmp")          # a save cut short before its rename
    os.makedirs(tmp_path / "checkpoint-7")              # a folder without state.json
    p = run_script(*FAST, "--iterations", "5", "--save-every", "1", "--keep-last", "2", "--resume", "auto",
                   "--output-dir", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoint-4'}" in p.stdout
    assert [x["iteration"] for x in metrics(tmp_path)] == [1, 2, 3, 4, 5]
    fresh = run_script(*FAST, "--iterations", "1", "--resume", "auto", "--output-dir", tmp_path / "new")
    assert fresh.returncode == 0 and "resumed" not in fresh.stdout, fresh.stderr[-3000:]


@pytest.mark.slow
def test_default_command_learns(tmp_path):
    """The README's demo, `python vgrpo.py` on 2 CPU cores: the pretrained digits model learns to draw the digit its
    prompt names. Held-out accuracy (prompts phrased as training never phrased them, fixed noises) must rise by a
    margin a broken update, advantage or surrogate cannot reach, and the independent k-NN judge must agree."""
    env = {**ENV}
    env.pop("OMP_NUM_THREADS")
    p = subprocess.run([sys.executable, os.path.join(HERE, "vgrpo.py"), "--output-dir", str(tmp_path)],
                       env=env, cwd=HERE, capture_output=True, text=True,
                       timeout=1800)   # about 2.5 min on 2 idle cores
    assert p.returncode == 0, p.stderr[-3000:]
    evals = read(tmp_path / "eval.jsonl")
    assert [e["iteration"] for e in evals] == [0, 20, 40, 60, 80]
    before, after = evals[0], evals[-1]
    assert before["eval_digit_correct"] == pytest.approx(0.3125)      # the committed model, the fixed noises
    # measured gains of this command, seeds 0-3: +0.450, +0.325, +0.331, +0.363 (std 0.050); the k-NN's +0.300,
    # +0.188, +0.213, +0.213. The bars are about 60% and half of the smallest, far above what an update that does
    # nothing gives (exactly 0: the evaluation's noises are fixed)
    assert after["eval_digit_correct"] - before["eval_digit_correct"] > 0.2, (before, after)
    assert after["eval_digit_knn"] - before["eval_digit_knn"] > 0.1, (before, after)
    per_digit = [after[f"eval_digit_correct/{w}"] for w in ("zero", "one", "two", "three", "four", "five", "six",
                                                            "seven", "eight", "nine")]
    assert np.mean(per_digit) == pytest.approx(after["eval_digit_correct"])   # 16 images per digit
    assert "held-out, iteration 0 -> 80: digit_correct 0.3125 -> " in p.stdout
    assert 0.1 < after["eval_diversity"] < 0.5 and len([k for k in after if k.startswith("eval_diversity/")]) == 10
    assert (tmp_path / "samples" / "eval-00080.png").exists() and (tmp_path / "rewards.png").exists()


@pytest.mark.slow
def test_tiny_flux_trains_with_bf16_and_checkpointing_and_its_lora_loads_into_flux_pipeline(tmp_path, tiny_flux):
    p = run_script(*FAST, "--model", "tiny-flux", "--inner-steps", "2", "--micro-batch", "2", "--mixed-precision",
                   "bf16", "--gradient-checkpointing", "--output-dir", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "64 image tokens" in p.stdout and "bf16 matmuls" in p.stdout
    m = metrics(tmp_path)
    assert [x["iteration"] for x in m] == [1, 2, 3]
    assert all(x["skipped_steps"] == 0 and np.isfinite(x["grad_norm"]) for x in m)
    assert any(x["ratio_max"] > 1.0 or x["ratio_min"] < 1.0 for x in m)  # the second inner step moved
    lora_file = lora(tmp_path, 3)
    assert any("single_transformer_blocks" in k for k in lora_file) and all(v.dtype == torch.float32 for v in lora_file.values())

    def images(pipe):
        return pipe(prompt="a cat", num_inference_steps=4, height=32, width=32, max_sequence_length=16,
                    guidance_scale=3.5, output_type="latent", generator=torch.Generator().manual_seed(0)).images

    pipe = vgrpo.build_tiny_flux_pipeline()
    base = images(pipe)
    pipe.load_lora_weights(str(tmp_path / "checkpoint-3"))
    tuned = images(pipe)
    args = vgrpo.Args(model="tiny-flux", full_finetune=False)        # the same LoRA in vgrpo's own model
    family = vgrpo.load_family(args, torch.device("cpu"))
    vgrpo.add_trainable_weights(family, args)
    from peft import set_peft_model_state_dict
    set_peft_model_state_dict(family.transformer, {k.removeprefix("transformer."): v for k, v in lora_file.items()})
    family.pipe.transformer = family.transformer
    assert (tuned - base).abs().max() > 1e-4
    assert torch.allclose(tuned, images(family.pipe), atol=1e-5)


@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_gradient_checkpointing_gives_the_same_gradients(model):
    args = vgrpo.Args(model=model, full_finetune=True)
    family = vgrpo.load_family(args, torch.device("cpu"))
    params = vgrpo.add_trainable_weights(family, args)
    o = torch.randn(2, *family.latent_shape, generator=torch.Generator().manual_seed(0))
    sig, eps = vgrpo.draw_pairs(family.sigma_grid(6), 2, family.latent_shape, [(0, 0), (0, 1)], "batch", True, 0, 0)
    cond = family.encode(["a cat", "a cat"])
    grads, calls = [], []
    family.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    for checkpointing in (False, True):
        (family.transformer.enable_gradient_checkpointing if checkpointing else family.transformer.disable_gradient_checkpointing)()
        family.transformer.zero_grad()
        s, _ = vgrpo.surrogate(family, family.transformer, o, sig, eps, cond, "adaptive")
        s.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in params]))
        calls.append(0)
    assert calls == [1, 0, 1, 1, 0]                  # with checkpointing the block runs again in the backward pass
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


PROMPT_REWARDS = '''
import torch

def from_metadata(images, prompts, metadata=None):
    return torch.tensor([float(m["value"]) for m in metadata])

def brightness(images, prompts):
    return images.mean((1, 2, 3))
'''


@pytest.mark.slow
def test_jsonl_metadata_reaches_rewards_and_evaluation_is_deterministic(tmp_path):
    (tmp_path / "rw.py").write_text(PROMPT_REWARDS)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a red square", "value": 1.0}\n'
                                          '{"prompt": "a blue circle", "value": 2.0, "tag": "colors"}\n')
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": f"held-out {i}", "value": i, "tag": tag}) + "\n"
                                                 for i, tag in enumerate(["low", "low", "high"])))
    rw = tmp_path / "rw.py"
    common = [*FAST, "--full-finetune", "--prompts", tmp_path / "train.jsonl",
              "--reward", f"{rw}:brightness,{rw}:from_metadata:0.5", "--reward-advantage", "per-reward",
              "--eval-prompts", tmp_path / "eval.jsonl", "--eval-every", "2",
              "--eval-rewards", f"{rw}:from_metadata,{rw}:brightness"]
    runs = {}
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        p = run_script(*common, "--lr", lr, "--output-dir", tmp_path / name)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = [json.loads(line) for line in (tmp_path / name / "eval.jsonl").read_text().splitlines()]
    m = metrics(tmp_path / "a")
    for x in m:  # both prompts every iteration: the metadata value of each reached the reward
        assert x["reward_from_metadata"] == 1.5
        assert x["reward_mean"] == pytest.approx(x["reward_brightness"] + 0.5 * 1.5, rel=1e-5)
        # brightness carries the advantage (the metadata part is constant in each group, its advantage 0), weighted
        # 1 / (1 + 0.5): at most sqrt(G - 1) / 1.5 = 1.15 for G = 4
        assert 0.3 < x["adv_abs_max"] < 1.16
    a, b = runs["a"], runs["b"]
    assert [x["iteration"] for x in a] == [0, 2, 3]
    assert all(x["eval_from_metadata"] == 1.0 for x in a)        # mean of 0, 1, 2 over 2 images each
    # the first evaluation reward per tag: "low" holds the values 0 and 1, "high" the value 2
    assert all(x["eval_from_metadata/low"] == 0.5 and x["eval_from_metadata/high"] == 2.0 for x in a)
    assert not any(k.startswith("eval_brightness/") for k in a[0])
    assert a[0] == b[0]                                           # fixed noises: the same before training
    assert a[-1]["eval_brightness"] != b[-1]["eval_brightness"]   # and different after different training
    header = (tmp_path / "a" / "rewards.csv").read_text().splitlines()[0].split(",")
    assert header[:2] == ["iteration", "reward_mean"] and "eval_brightness" in header
    assert "eval_reward" not in header   # the evaluation's rewards are not the training objective: no weighted total
    assert len((tmp_path / "a" / "rewards.csv").read_text().splitlines()) == 1 + 4      # iterations 0..3
    assert (tmp_path / "a" / "samples" / "eval-00000.png").exists()
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "a" / "rewards.png").stat().st_size > 10_000


# presets and model-dependent defaults: test_launch.py
# rewards on their own, without a training run: test_rewards.py


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("flags,message", [
    (["--model", "nonsense"], "--model nonsense: no such folder, and not a Hugging Face id"),
    (["--reward", "nope"], "unknown reward 'nope'"),
    (["--sampler", "heun"], "unknown sampler 'heun'"),
    (["--ema", "1"], "--ema is a decay in [0, 1) (0: off), got 1.0"),
    (["--attention", "flash,cudnn2"], "--attention 'flash,cudnn2': a comma-separated list of flash, efficient, cudnn"),
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--inner-steps", "3"], "must divide --group-size"),
    (["--micro-batch", "5"], "--micro-batch 5 must divide"),
    (["--prompts", "/no/such/file.txt"], "prompt file not found"),
    (["--model", "stabilityai/stable-diffusion-3.5-medium"], "could not load"),
])
@pytest.mark.slow
def test_bad_input_is_one_clear_line(flags, message, tmp_path):
    p = run_script(*flags, "--output-dir", tmp_path, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("vgrpo: error: ") and message in p.stderr, p.stderr


# each bound refused with its own line, and the value on the bound accepted (an off-by-one fails one of the two)
@pytest.mark.parametrize("flags,message", [
    (["--sample-steps", "0"], "--sample-steps must be at least 1, got 0"),
    (["--decode-batch", "0"], "--decode-batch must be at least 1, got 0"),
    (["--n-mc", "5", "--sample-steps", "4"], "--n-mc 5 exceeds --sample-steps 4"),
    (["--n-mc", "4", "--sample-steps", "4"], None),
    (["--resolution", "40"], "--resolution must be a positive multiple of 16, got 40"),
    (["--resolution", "0"], "--resolution must be a positive multiple of 16, got 0"),
    (["--resolution", "16"], None),
    (["--clip-eps", "0"], "--clip-eps, --lr and --max-grad-norm must be positive"),
    (["--lr", "0"], "--clip-eps, --lr and --max-grad-norm must be positive"),
    (["--max-grad-norm", "0"], "--clip-eps, --lr and --max-grad-norm must be positive (a clip at 0 zeroes every"),
    (["--max-grad-norm", "-1"], "--clip-eps, --lr and --max-grad-norm must be positive"),
    (["--max-grad-norm", "1e-9"], None),
    (["--beta", "-0.1"], "--beta, --adv-soft-clip, --adv-std-floor and --weight-decay non-negative"),
    (["--adv-std-floor", "-1"], "--beta, --adv-soft-clip, --adv-std-floor and --weight-decay non-negative"),
    (["--weight-decay", "-0.01"], "--beta, --adv-soft-clip, --adv-std-floor and --weight-decay non-negative"),
    (["--beta", "0", "--adv-soft-clip", "0", "--adv-std-floor", "0", "--weight-decay", "0"], None),
    (["--no-full-finetune", "--lora-alpha", "0"], "--lora-rank must be at least 1 and --lora-alpha positive"),
    (["--no-full-finetune", "--lora-rank", "0"], "--lora-rank must be at least 1 and --lora-alpha positive"),
    (["--no-full-finetune", "--lora-rank", "1", "--lora-alpha", "0.5"], None),
    (["--full-finetune", "--lora-alpha", "0"], None),                    # no adapters: the LoRA flags do nothing
    # --prompts '' (an unset shell variable?) would give a real model the tiny models' 12 built-in prompts
    (["--model", "sd3", "--prompts", ""], "--prompts is empty: give a prompt file"),
    (["--model", "digits", "--prompts", ""], "--prompts is empty: give a prompt file"),
    (["--prompts", ""], None),
    (["--guidance", "-1"], "--guidance must be >= 0, got -1"),
    (["--guidance", "0"], None),
    (["--device", "cuda:1"], "unknown --device 'cuda:1': valid choices are auto, cpu, cuda"),
    (["--device", "gpu"], "unknown --device 'gpu': valid choices are auto, cpu, cuda"),
    (["--device", "cpu"], None),
    (["--reward", "jpeg:0"], "--reward: every weight in 'jpeg:0' is 0: the reward would be 0 for every image"),
    (["--reward", "jpeg:0,digit:0"], "every weight in"),
    (["--reward", "jpeg:1,clipscore:0"], None),
    (["--eval-images", "0"], "--eval-images must be >= 1"),
    (["--keep-last", "-1"], "--keep-last must be >= 0"),
    (["--keep-last", "0"], None),
    (["--max-bad-steps", "0"], "--max-bad-steps and --dist-timeout >= 1"),
    (["--ema", "0"], None),
    (["--fsdp"], "--fsdp shards over torchrun's processes (launch with torchrun)"),
    (["--report-to", "mlflow"], "unknown --report-to 'mlflow': valid choices are tensorboard, wandb"),
    (["--kl-to", "initial", "--beta", "0.1", "--no-full-finetune", "--compile", "on"],
     "it needs LoRA (not --full-finetune) and eager"),
    (["--kl-to", "initial", "--beta", "0.1", "--full-finetune"], "it needs LoRA (not --full-finetune) and eager"),
    (["--kl-to", "initial", "--beta", "0.1", "--no-full-finetune"], None),   # LoRA; --compile auto: eager blocks
])
def test_flags_out_of_range_are_refused_before_any_model_loads(flags, message, tmp_path):
    args = vgrpo.parse_args(["--model", "tiny", *flags, "--output-dir", str(tmp_path)])
    if message is None:
        vgrpo.validate(args, 1)
        return
    with pytest.raises(vgrpo.UsageError) as e:
        vgrpo.validate(args, 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_help_gives_every_flags_default(capsys):
    """--help: each flag's entry says its default once: the Args field's value or, where --model decides it, each
    model's value from RECIPES (all of them: a hand-written list had left out the models added later) or the
    recipe's values in the flag's own words."""
    with pytest.raises(SystemExit):
        vgrpo.parse_args(["--help"])
    text = capsys.readouterr().out
    entries = {}
    for block in re.split(r"\n(?=  --)", text.split("options:", 1)[1]):
        entries[block.split()[0].rstrip(",")] = " ".join(block.split()).replace("- ", "-")  # unwrap "--no-gradient-"
    fields = {"--" + f.name.replace("_", "-"): f for f in dataclasses.fields(vgrpo.Args)}
    assert set(fields) <= set(entries)
    assert [flag for flag in fields if entries[flag].count("default") != 1] == []
    for flag, f in fields.items():
        if "default" not in f.metadata["help"]:   # the suffix parse_args writes, the field's value in it
            by_model = [f"{model} {recipe[f.name]}" for model, recipe in vgrpo.RECIPES.items() if f.name in recipe]
            shown = ("set by --model: " + ", ".join(by_model) if f.default is None else "none" if f.default == "" else
                     (flag if f.default else "--no-" + flag[2:]) if isinstance(f.default, bool) else f.default)
            assert f.default is not None or len(by_model) == len(vgrpo.RECIPES), flag   # no model left unnamed
            assert entries[flag].endswith(f"(default: {shown})"), entries[flag]
    assert "(default: 4)" in entries["--n-mc"] and "(default: 0.01)" in entries["--clip-eps"]
    assert vgrpo.recipe_defaults("micro_batch") == "set by --model"   # a flag some recipes leave to the code
    assert entries["--beta"].endswith("(default: 0.0)")
    assert entries["--resolution"].endswith("(default: set by --model: sd3 512, flux 720, qwen-image 512, flux2-klein "
                                            "384, digits 16, tiny 32, tiny-flux 32)")
    assert "flux hpsv2, qwen-image pickscore, flux2-klein pickscore, digits digit" in entries["--reward"]
    assert entries["--tf32"].endswith("(default: --tf32)") and entries["--fsdp"].endswith("(default: --no-fsdp)")
    assert entries["--attention"].endswith("(default: flash,efficient,math)")
    assert "default: on for real models" in entries["--gradient-checkpointing"]


def test_fsdp_under_torchrun_is_refused_with_fp16_only(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")   # launched by torchrun: --fsdp computes in bf16 or float32, not fp16
    for precision, refused in (("fp16", True), ("bf16", False), ("no", False)):
        args = vgrpo.parse_args(["--model", "tiny", "--fsdp", "--mixed-precision", precision,
                                 "--output-dir", str(tmp_path)])
        if refused:
            with pytest.raises(vgrpo.UsageError, match="fp16's loss scaler is not sharded"):
                vgrpo.validate(args, 1)
        else:
            vgrpo.validate(args, 1)


def test_a_prompt_file_line_that_is_not_json_is_named_with_its_number(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a cat", "tag": "animals"}\n\n{"prompt": "a dog",\n')
    with pytest.raises(vgrpo.UsageError, match=rf"prompt file {path}, line 3: not JSON \(Expecting"):
        vgrpo.load_prompts(str(path))
    path.write_text('{"prompt": "a cat", "tag": "animals"}\n\n{"prompt": "a dog"}\n')   # blank lines skipped
    assert vgrpo.load_prompts(str(path)) == (["a cat", "a dog"], [{"prompt": "a cat", "tag": "animals"},
                                                                  {"prompt": "a dog"}])


def test_prompt_files_are_read_by_their_suffix_and_json_in_a_text_file_is_refused(tmp_path):
    """.jsonl in any case keeps each line's metadata; a .json (or .csv) file, or JSON lines in a text file, would
    train on the lines' raw text with the metadata lost, and is refused; an editor's byte-order mark is dropped."""
    line = '{"prompt": "a cat", "tag": "animals"}\n'
    (tmp_path / "p.JSONL").write_text(line)
    assert vgrpo.load_prompts(str(tmp_path / "p.JSONL")) == (["a cat"], [{"prompt": "a cat", "tag": "animals"}])
    for name in ("p.json", "p.csv"):   # would train on the lines' raw text
        (tmp_path / name).write_text(line)
        with pytest.raises(vgrpo.UsageError, match=rf"prompts are read from .txt \(one per line\) or .jsonl .*, not "
                                                   rf"\.{name[2:]}$"):
            vgrpo.load_prompts(str(tmp_path / name))
    (tmp_path / "p.txt").write_text("\n" + line)
    with pytest.raises(vgrpo.UsageError, match=r"p.txt, line 2: a JSON object in a text file; name the file .jsonl"):
        vgrpo.load_prompts(str(tmp_path / "p.txt"))
    (tmp_path / "p.txt").write_bytes("\ufeff{subject} in oil, {style}\n{}\n".encode())   # text that is no object
    assert vgrpo.load_prompts(str(tmp_path / "p.txt"))[0] == ["{subject} in oil, {style}", "{}"]
    (tmp_path / "p.ndjson").write_text(line)                                        # JSON lines by another name
    assert vgrpo.load_prompts(str(tmp_path / "p.ndjson"))[1] == [{"prompt": "a cat", "tag": "animals"}]


def test_held_out_prompts_given_are_evaluated_every_20_iterations_unless_told_otherwise(tmp_path):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("a cat\n")
    given = ["--model", "sd3", "--eval-prompts", str(held_out)]
    assert vgrpo.parse_args(given).eval_every == 20                      # was 0: the file was never read
    assert vgrpo.parse_args([*given, "--eval-every", "0"]).eval_every == 0
    assert vgrpo.parse_args(["--model", "sd3"]).eval_every == 0
    assert vgrpo.parse_args(["--model", "digits", "--eval-every", "0"]).eval_every == 0


@pytest.mark.parametrize("flags,lines,problem", [
    (["--preset", "sd3-geneval"], ['{"prompt": "a dog", "include": [{"class": "dog", "count": 1}]}',
                                   '{"prompt": "a mouse", "include": [{"class": "mouse", "count": 1}]}'],
     "prompt 2 ('a mouse') has no usable GenEval metadata: include clause 0: class 'mouse' is none of GenEval's 80"),
    (["--preset", "sd3-geneval"], ['{"prompt": "a dog"}'], "prompt 1 ('a dog') has no usable GenEval metadata: no"),
    (["--model", "digits"], ['{"prompt": "the number seven"}', '{"prompt": "a cat"}'],
     "prompt 2: digit rewards: prompt 'a cat' names no digit"),
    (["--model", "digits"], ['{"prompt": "a digit", "digit": "seven"}'], """gives "digit": 'seven', not 0-9"""),
    (["--model", "digits"], ['{"prompt": "a digit", "digit": 12}'], """gives "digit": 12, not 0-9"""),
    (["--preset", "sd3-ocr"], ['{"prompt": "a sign"}', '{"prompt": "a shop front"}'],
     "no prompt quotes a text to render"),
    (["--preset", "sd3-ocr"], ['{"prompt": "a blank sign \\"\\""}', '{"prompt": "a shop front", "text": " "}'],
     "no prompt quotes a text to render"),                                        # empty texts are no texts
    (["--preset", "sd3-ocr"], ['{"prompt": "a sign"}', '{"prompt": "a shop front", "text": "OPEN"}'], None),
    (["--preset", "sd3-ocr"], ['{"prompt": "a sign reading \\"OPEN\\""}'], None),
])
def test_prompts_the_reward_cannot_score_are_refused_before_any_model_loads(tmp_path, flags, lines, problem):
    """A prompt GenEval or the digit rewards cannot score would fail only when training draws it (hours in); a file
    in which no prompt names a text trains the ocr reward on zeros."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    args = vgrpo.parse_args([*flags, "--prompts", str(path), "--output-dir", str(tmp_path / "out")])
    if problem is None:
        vgrpo.validate(args, 1)
        return
    with pytest.raises(vgrpo.UsageError) as e:
        vgrpo.validate(args, 1)
    assert str(e.value).startswith(f"--prompts {path}: ") and problem in str(e.value), str(e.value)
    held_out = vgrpo.parse_args([*flags, "--eval-prompts", str(path), "--output-dir", str(tmp_path / "out")])
    with pytest.raises(vgrpo.UsageError, match=f"^--eval-prompts {re.escape(str(path))}: "):  # held-out prompts too
        vgrpo.validate(held_out, 1)


def test_a_flux_model_without_a_guidance_embedding_says_guidance_is_ignored(monkeypatch, capsys):
    """FLUX.1 [schnell] has no guidance embedding: --guidance (3.5 by default) would do nothing without a word."""
    build = vgrpo.build_tiny_flux_pipeline

    def without_embedding(seed=0):
        pipe = build(seed)
        pipe.transformer.register_to_config(guidance_embeds=False)
        return pipe

    for tiny_flux, said in ((build, False), (without_embedding, True)):
        monkeypatch.setattr(vgrpo, "build_tiny_flux_pipeline", tiny_flux)
        family = vgrpo.load_family(vgrpo.parse_args(["--model", "tiny-flux"]), torch.device("cpu"))
        assert (family.guidance is None) == said
        assert ("no guidance embedding (as FLUX.1 [schnell]): --guidance 3.5 is ignored" in capsys.readouterr().err) \
            == said


def test_a_curriculum_checks_its_held_out_prompts_against_the_runs_evaluation_rewards(tmp_path):
    """Every stage evaluates with the run's --eval-rewards (default: the first stage's reward), so held-out prompts
    without GenEval metadata are fine beside GenEval stages; with geneval as the evaluation reward they are not."""
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("a cat\n")
    flags = ["--curriculum", "sd3", "--eval-prompts", str(held_out), "--output-dir", str(tmp_path / "out")]
    vgrpo.validate(vgrpo.parse_args(flags), 8)
    with pytest.raises(vgrpo.UsageError, match=f"^--eval-prompts {re.escape(str(held_out))}: prompt 1 .* no usable "
                                               "GenEval metadata"):
        vgrpo.validate(vgrpo.parse_args([*flags, "--eval-rewards", "geneval"]), 8)


@pytest.mark.parametrize("flag", ["--lr", "--max-grad-norm", "--weight-decay", "--clip-eps", "--guidance",
                                  "--lora-alpha", "--beta", "--ema"])
def test_a_float_flag_that_is_not_a_number_is_refused(tmp_path, flag):
    """NaN passes every range check (each comparison is False); inf only makes sense as a clip."""
    for value in ("nan", "inf", "-inf"):
        args = vgrpo.parse_args(["--model", "tiny", f"{flag}={value}", "--output-dir", str(tmp_path)])
        if flag == "--max-grad-norm" and value == "inf":
            vgrpo.validate(args, 1)                                    # no clipping
            continue
        with pytest.raises(vgrpo.UsageError, match=f"^{flag} must be a finite number, got {value}$"):
            vgrpo.validate(args, 1)


def test_abbreviated_flags_are_refused(capsys):
    """argparse would take --bet for --beta: past --curriculum's refusal of the flags it sets stage by stage."""
    for argv in (["--model", "tiny", "--bet", "0.1"], ["--curriculum", "sd3", "--n-m", "2"]):
        with pytest.raises(SystemExit):
            vgrpo.parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_each_recipe_has_its_own_default_output_folder(tmp_path):
    """runs/NAME: the README's commands one after another do not meet an earlier run's checkpoints (refused)."""
    pipeline = tmp_path / "my-pipeline"
    curriculum = tmp_path / "mine.json"
    curriculum.write_text('[{"preset": "sd3-preference", "iterations": 2}]')
    for argv, folder in (([], "digits"), (["--model", "tiny-flux"], "tiny-flux"), (["--model", "sd3"], "sd3"),
                         (["--preset", "sd3-geneval"], "sd3-geneval"), (["--curriculum", "sd3"], "curriculum-sd3"),
                         (["--curriculum", str(curriculum)], "curriculum-mine"),
                         (["--model", "stabilityai/stable-diffusion-3.5-medium"], "stable-diffusion-3.5-medium"),
                         (["--model", f"{pipeline}/"], "my-pipeline")):
        assert vgrpo.parse_args(argv).output_dir == os.path.join("runs", folder), argv
    assert vgrpo.parse_args(["--model", "."]).output_dir == os.path.join("runs", os.path.basename(os.getcwd()))
    assert vgrpo.parse_args(["--output-dir", "x"]).output_dir == "x"


def test_a_new_run_among_an_earlier_runs_checkpoints_is_refused_and_resume_auto_continues_it(tmp_path):
    """A fresh start in a folder with checkpoints would clear its metrics, have --keep-last delete the new run's first
    checkpoints (the old ones are newer) and a --resume auto after a preemption take the old run's."""
    flags = ["--model", "tiny", "--output-dir", str(tmp_path)]
    os.makedirs(tmp_path / "checkpoint-7")                 # incomplete (no state.json): no earlier run's checkpoint
    vgrpo.validate(vgrpo.parse_args(flags), 1)
    os.makedirs(tmp_path / "checkpoint-5")
    args = vgrpo.parse_args(flags)
    with open(tmp_path / "checkpoint-5" / "state.json", "w") as f:
        json.dump({"iteration": 5, "args": vars(args)}, f)
    with pytest.raises(vgrpo.UsageError, match=rf"^--output-dir {re.escape(str(tmp_path))} holds an earlier run's "
                                               r"checkpoint-5: continue that run with --resume auto, or start anew"):
        vgrpo.validate(vgrpo.parse_args(flags), 1)
    resumed = vgrpo.parse_args([*flags, "--resume", "auto"])
    vgrpo.validate(resumed, 1)
    assert resumed.resume == str(tmp_path / "checkpoint-5")
    # a finished run, or one of another configuration, cannot be continued: only another folder is advised
    for other in (["--iterations", "5"], ["--resolution", "64"]):
        with pytest.raises(vgrpo.UsageError, match=r"holds an earlier run's checkpoint-5: start anew in another "
                                                   r"--output-dir \(or delete its checkpoint-\* folders\)$"):
            vgrpo.validate(vgrpo.parse_args([*flags, *other]), 1)


def test_a_resume_trains_at_this_launchs_learning_rate_and_weight_decay(tmp_path):
    """optimizer.load_state_dict restores the saved param_groups, lr included: the flags of the launch win, while
    AdamW's moments are the checkpoint's."""
    import types

    weight = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.AdamW([weight], lr=3e-4, weight_decay=0.0)
    weight.grad = torch.tensor([1.0, -2.0, 0.5])
    saved.step()
    torch.save(saved.state_dict(), tmp_path / "optimizer.pt")
    optimizer = torch.optim.AdamW([weight], lr=1e-4, weight_decay=0.01)
    run = types.SimpleNamespace(args=types.SimpleNamespace(fsdp=False, lr=1e-4, weight_decay=0.01),
                                optimizer=optimizer, device=torch.device("cpu"), scaler=None)
    vgrpo.load_training_state(str(tmp_path), run)
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(1e-4, 0.01)]
    assert torch.equal(optimizer.state[weight]["exp_avg"], saved.state[weight]["exp_avg"])
    assert optimizer.state[weight]["step"] == 1


def test_resume_from_a_folder_without_a_checkpoint_is_refused(tmp_path):
    args = vgrpo.parse_args(["--model", "tiny", "--resume", str(tmp_path), "--output-dir", str(tmp_path / "out")])
    with pytest.raises(vgrpo.UsageError, match=r"not a checkpoint directory \(no state.json\)"):
        vgrpo.validate(args, 1)


def write_state_json(directory, args, iteration, **changed):
    """A checkpoint folder holding only the state.json save_checkpoint writes, for `args` with some flags changed:
    all that check_resume_matches reads. -> the folder."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump({"iteration": iteration, "args": dataclasses.asdict(dataclasses.replace(args, **changed)),
                   "world_size": 1}, f)
    return str(directory)


def test_a_resume_is_checked_against_the_checkpoints_iteration_configuration_and_ema(tmp_path):
    args = vgrpo.parse_args([*FAST, "--iterations", "5", "--output-dir", str(tmp_path / "out")])  # LoRA r32, 32 px

    def check(path, **flags):
        vgrpo.check_resume_matches(dataclasses.replace(args, resume=path, **flags))

    last = write_state_json(tmp_path / "last", args, 5)
    check(last)   # a finished run launched again: nothing left to train, not an error (a requeued job ends at once)
    with pytest.raises(vgrpo.UsageError, match=r"^--resume \S+ is at iteration 6 and --iterations is 5: nothing to "
                                               r"train; --iterations is the total, counted from the start$"):
        check(write_state_json(tmp_path / "past", args, 6))
    # listed in RESUME_MUST_MATCH's order
    with pytest.raises(vgrpo.UsageError, match=r"^--resume \S+ belongs to a different configuration: --lora-rank 8 "
                                               r"there, 32 here; --resolution 64 there, 32 here$"):
        check(write_state_json(tmp_path / "other", args, 2, lora_rank=8, resolution=64))
    # full fine-tuning trains no LoRA: the rank and alpha it saved are not compared
    full = write_state_json(tmp_path / "full", args, 2, full_finetune=True, lora_rank=8, lora_alpha=3.0)
    check(full, full_finetune=True)
    with pytest.raises(vgrpo.UsageError, match=r"configuration: --full-finetune True there, False here; --lora-rank"):
        check(full)
    with pytest.raises(vgrpo.UsageError, match=r"^--resume \S+: no ema/ in it \(saved without --ema\); resume "
                                               r"without --ema$"):
        check(last, ema=0.5)
    os.makedirs(tmp_path / "last" / "ema")
    check(last, ema=0.5)


def test_checkpoints_are_complete_folders_in_numeric_order_and_keep_last_removes_the_oldest(tmp_path):
    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-100", "checkpoint-7", "checkpoint-200.tmp",
                 "checkpoint-x", "run-3"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "state.json").write_text("{}")
    os.remove(tmp_path / "checkpoint-7" / "state.json")   # a folder whose save never finished
    expected = [str(tmp_path / f"checkpoint-{n}") for n in (9, 10, 100)]   # 9 < 10 < 100, not as strings sort
    assert vgrpo.complete_checkpoints(str(tmp_path)) == expected
    assert vgrpo.latest_checkpoint(str(tmp_path)) == expected[-1]
    assert vgrpo.latest_checkpoint(str(tmp_path / "nothing")) is None
    everything = sorted(os.listdir(tmp_path))
    vgrpo.prune_checkpoints(str(tmp_path), 0)   # --keep-last 0: all kept
    assert sorted(os.listdir(tmp_path)) == everything
    vgrpo.prune_checkpoints(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == [name for name in everything if name != "checkpoint-9"]


def test_a_resume_drops_the_metrics_logged_after_its_checkpoint_and_a_fresh_run_drops_them_all(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "reward_mean": i / 2}) + "\n" for i in range(5)) + "\n")
    vgrpo.trim_metrics(str(path), 2)   # resumed from checkpoint-2: iterations 3 and 4 will be logged again
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"iteration": i, "reward_mean": i / 2} for i in range(3)]
    vgrpo.trim_metrics(str(path), 0)
    assert path.read_text() == ""
    vgrpo.trim_metrics(str(tmp_path / "eval.jsonl"), 2)   # nothing logged yet: nothing written
    assert not (tmp_path / "eval.jsonl").exists()


def test_each_process_steps_on_its_share_of_the_prompt_groups_split_over_the_inner_steps():
    def local(world, **flags):
        return vgrpo.local_minibatch(vgrpo.Args(model="sd3", **flags), world)
    # SD3.5-M's recipe on 8 GPUs: 6 groups of 24 per GPU, 2 optimizer steps of 72
    assert local(8, prompts_per_step=48, group_size=24, inner_steps=2) == 72
    assert local(2, prompts_per_step=48, group_size=24, inner_steps=3) == 192
    # (validate refuses a split that leaves a remainder; the floor is what the function promises)
    assert local(8, prompts_per_step=48, group_size=24, inner_steps=5) == 28   # 144 / 5 = 28.8
    assert all(type(local(1, prompts_per_step=4, group_size=8, inner_steps=k)) is int for k in (1, 3))


# One of 2 ranks: what the metrics' collectives make of each rank's statistics, rewards and flags.
TWO_RANKS = """
import json, sys, torch, torch.distributed as dist
import vgrpo
rank, cpu = int(sys.argv[2]), torch.device("cpu")
dist.init_process_group("gloo", rank=rank, world_size=2, init_method="file://" + sys.argv[1])
stats = {"policy_loss": [1.0, 4.0][rank], "clip_frac": [0.125, 0.375][rank], "ratio_min": [0.5, 0.25][rank],
         "ratio_max": [1.5, 2.0][rank]}
rewards = (torch.arange(6).view(2, 3) + 10 * rank).T   # (3, 2): a transposed view, gathered as it reads
print(json.dumps({"stats": vgrpo.reduce_stats(stats, 2, cpu), "rewards": vgrpo.all_gather_cat(rewards, 2).tolist(),
                  "any": [vgrpo.any_rank(rank == 1, 2, cpu), vgrpo.any_rank(False, 2, cpu)]}))
dist.barrier()
dist.destroy_process_group()
"""


def run_two_gloo_ranks(script, tmp_path):
    """`script` run by `python -c` as rank 0 and rank 1 of a gloo group (sys.argv[1]: the rendezvous file,
    sys.argv[2]: the rank); both must exit 0. -> their (stdout, stderr)"""
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "group"), str(rank)], cwd=HERE,
                              env={**ENV, "PYTHONPATH": HERE}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300) for p in ranks]
    finally:   # a rank that hangs in a collective is not left running
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    return outputs


def test_two_ranks_metrics_are_the_mean_of_their_statistics_the_extremes_of_the_ratio_and_every_sample(tmp_path):
    for out, _ in run_two_gloo_ranks(TWO_RANKS, tmp_path):   # every rank gets the same, rank 0's samples first
        assert json.loads(out) == {
            "stats": {"clip_frac": 0.25, "policy_loss": 2.5, "ratio_max": 2.0, "ratio_min": 0.25},
            "rewards": [[0, 3], [1, 4], [2, 5], [10, 13], [11, 14], [12, 15]], "any": [True, False]}


@pytest.mark.slow
def test_prompts_that_do_not_split_over_processes_are_refused(tmp_path):
    p = run_script("--prompts-per-step", "3", "--micro-batch", "4", "--output-dir", tmp_path, nproc=2, timeout=300)
    assert p.returncode != 0
    # torchrun adds its own report; each process's own message is the one clear line
    # (whichever rank speaks first: the launcher stops the other)
    assert re.search(r"vgrpo: error \(rank [01]\): --prompts-per-step 3 is not divisible by the 2 processes", p.stderr)
    assert 'vgrpo.py", line' not in p.stderr


# --------------------------------------------------------------------------- faults (each test provokes one)

FAULTY_REWARDS = '''
import os
import time

import torch

calls = [0]
HERE = os.path.dirname(__file__)


def brightness(images, prompts):
    return images.mean((1, 2, 3)).float()


def nan_at_calls_1_and_3(images, prompts):
    calls[0] += 1
    r = brightness(images, prompts)
    if calls[0] in (1, 3):
        r[0] = float("nan")
    return r


def nan_on_rank_1_at_call_2(images, prompts):
    calls[0] += 1
    r = brightness(images, prompts)
    if calls[0] == 2 and os.environ["RANK"] == "1":
        r[-1] = float("nan")
    return r


def brightness_noting_pid(images, prompts):
    path = os.path.join(HERE, f"pid-{os.environ['RANK']}")   # the test signals one worker
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)                          # whole: the test may read it at any moment
    return brightness(images, prompts)


def always_nan(images, prompts):
    return torch.full((len(images),), float("nan"))


def wrong_shape(images, prompts):
    return torch.zeros(len(images), 2)


def raise_on_rank_1(images, prompts):
    if os.environ.get("RANK") == "1":
        with open(os.path.join(HERE, "raised_at"), "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError("reward exploded on purpose")
    return brightness(images, prompts)
'''


@pytest.fixture
def faulty(tmp_path):
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY_REWARDS)
    return str(path)


@pytest.mark.slow
def test_nan_reward_skips_the_update_on_that_iteration(tmp_path, faulty):
    # NaN at iterations 1 and 3 with --max-bad-steps 2: never 2 in a row, so the run goes on to the end
    p = run_script(*FAST, "--iterations", "4", "--reward", f"{faulty}:nan_at_calls_1_and_3", "--max-bad-steps", "2",
                   "--save-every", "1", "--output-dir", tmp_path / "o")
    assert p.returncode == 0, p.stderr[-3000:]
    for it in (1, 3):
        assert f"rank 0, iteration {it}: non-finite values from {faulty}:nan_at_calls_1_and_3" in p.stderr
    m = metrics(tmp_path / "o")
    assert [x["skipped_steps"] for x in m] == [1, 0, 1, 0]
    assert np.isnan(m[0]["reward_mean"]) and np.isnan(m[0]["grad_norm"]) and np.isfinite(m[1]["grad_norm"])
    w = [initial_lora()] + [weights(tmp_path / "o", i) for i in (1, 2, 3, 4)]
    same = [all(torch.equal(w[i][k], w[i + 1][k]) for k in w[0]) for i in range(4)]
    assert same == [True, False, True, False]             # iterations 1 and 3 left the weights alone
    assert all(torch.isfinite(v).all() for v in w[4].values())


SHARDINGS = pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])


@pytest.mark.slow
@SHARDINGS
def test_nan_reward_on_one_rank_skips_the_update_on_every_rank(tmp_path, faulty, sharding):
    p = run_script(*FAST, *sharding, "--reward", f"{faulty}:nan_on_rank_1_at_call_2", "--save-every", "1",
                   "--output-dir", tmp_path, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]            # no rank waited alone in a collective
    assert "rank 1, iteration 2: non-finite values" in p.stderr and "rank 0, iteration 2" not in p.stderr
    m = metrics(tmp_path)
    assert [x["skipped_steps"] for x in m] == [0, 1, 0]   # averaged over ranks: both skipped
    assert np.isnan(m[1]["reward_mean"]) and np.isfinite(m[2]["reward_mean"])
    before, skipped, after = (weights(tmp_path, i) for i in (1, 2, 3))
    assert all(torch.equal(before[k], skipped[k]) for k in before)
    assert any(not torch.equal(skipped[k], after[k]) for k in before)
    assert "vgrpo: done" in p.stdout


@pytest.mark.slow
def test_persistent_nan_stops_the_run_after_max_bad_steps(tmp_path, faulty):
    p = run_script(*FAST, "--reward", f"{faulty}:always_nan", "--max-bad-steps", "2", "--iterations", "6",
                   "--output-dir", tmp_path)
    assert p.returncode == 1
    assert "vgrpo: error: 2 consecutive iterations with NaN/Inf" in p.stderr and "Traceback" not in p.stderr
    assert len(metrics(tmp_path)) == 2


def test_nonfinite_gradient_skips_the_optimizer_step():
    args = vgrpo.Args(model="tiny", prompts_per_step=2, group_size=4, sample_steps=6, micro_batch=4)
    run, _ = vgrpo.build_run(args, 0, 1, torch.device("cpu"))
    cond = run.family.encode(["a cat"] * 4 + ["a dog"] * 4)
    o = vgrpo.rollout(run.family, run.family.transformer, cond, torch.randn(8, *run.family.latent_shape), run.sigmas, args)
    sig, eps = vgrpo.draw_pairs(run.sigmas, args.n_mc, run.family.latent_shape,
                                [(p, m) for p in range(2) for m in range(4)], "batch", True, 0, 0)
    batch = {"o": o, "cond": cond, "sigmas": sig, "eps": eps, "x0_old": None}
    batch["s_old"], _ = vgrpo.old_surrogate(run.family, run.family.transformer, batch, args, 2)
    start = [p.detach().clone() for p in run.params]
    batch["A"] = torch.tensor([1.0, -1.0, float("inf"), 0.0] * 2)
    stats = vgrpo.update(run.family, run.model, run.optimizer, run.params, batch, args, 2)
    assert stats["skipped_steps"] == 1 and not np.isfinite(stats["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(start, run.params))
    batch["A"] = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    stats = vgrpo.update(run.family, run.model, run.optimizer, run.params, batch, args, 2)
    assert stats["skipped_steps"] == 0 and any(not torch.equal(a, b) for a, b in zip(start, run.params))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_of_non_finite_weights_is_refused(tmp_path, bad):
    args = vgrpo.parse_args(["--model", "tiny", "--no-full-finetune", "--micro-batch", "4", "--output-dir", str(tmp_path)])
    run, _ = vgrpo.build_run(args, 0, 1, torch.device("cpu"))
    vgrpo.save_checkpoint(run, 1)                                                # finite: saved
    with torch.no_grad():
        run.params[-1].view(-1)[0] = bad                                         # one LoRA entry
    with pytest.raises(vgrpo.FatalError, match="refusing to save non-finite weights at iteration 2"):
        vgrpo.save_checkpoint(run, 2)
    # no checkpoint-2, and no half-written checkpoint-2.tmp either
    assert sorted(x for x in os.listdir(tmp_path) if x.startswith("checkpoint")) == ["checkpoint-1"]
    assert vgrpo.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    assert all(torch.isfinite(v).all() for v in lora(tmp_path, 1).values())


@pytest.mark.slow
def test_reward_with_the_wrong_shape_is_named(tmp_path, faulty):
    p = run_script(*FAST, "--reward", f"jpeg,{faulty}:wrong_shape", "--output-dir", tmp_path)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (f"vgrpo: error: reward '{faulty}:wrong_shape' returned Tensor (8, 2), "
                                                 "expected one number per image: a tensor, array or list of shape (8,)")


def lines_in(path):
    """Complete lines in a file another process may be appending to (0 while it does not exist)."""
    return open(path).read().count("\n") if os.path.exists(path) else 0


def wait_for(condition, timeout=300):
    import time
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out waiting for the run"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_auto_continues(tmp_path):
    import signal
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "vgrpo.py"), *FAST, "--iterations", "100",
                             "--save-every", "1000", "--output-dir", str(tmp_path)],
                            env=ENV, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: lines_in(tmp_path / "metrics.jsonl") >= 2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    done = len(metrics(tmp_path))
    assert 2 <= done < 100 and f"stopped after iteration {done}" in out
    assert vgrpo.latest_checkpoint(str(tmp_path)) == str(tmp_path / f"checkpoint-{done}")
    p = run_script(*FAST, "--iterations", done + 1, "--resume", "auto", "--output-dir", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [x["iteration"] for x in metrics(tmp_path)] == list(range(1, done + 2))


@pytest.mark.slow
@SHARDINGS
def test_sigterm_to_one_worker_stops_every_rank_at_a_checkpoint(tmp_path, faulty, sharding):
    """Preemption may signal one process only (a node's agent, a user's kill): every rank must stop after the same
    iteration, rank 0 must save, torchrun must exit 0, and --resume auto must continue on 2 processes."""
    import signal
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "vgrpo.py"), *FAST, *sharding, "--iterations", "100", "--save-every", "1000",
           "--reward", f"{faulty}:brightness_noting_pid", "--output-dir", str(out_dir)]
    proc = subprocess.Popen(cmd, env=ENV, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: lines_in(out_dir / "metrics.jsonl") >= 1 and os.path.exists(tmp_path / "pid-1"))
        worker = int((tmp_path / "pid-1").read_text())
        assert worker not in (proc.pid, int((tmp_path / "pid-0").read_text()))
        os.kill(worker, signal.SIGTERM)                    # rank 1 only; rank 0 and torchrun are not signalled
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert err.count("SIGTERM received") == 1
    done = len(metrics(out_dir))
    assert 1 <= done < 100 and f"stopped after iteration {done}" in out
    assert vgrpo.latest_checkpoint(str(out_dir)) == str(out_dir / f"checkpoint-{done}")
    p = run_script(*FAST, *sharding, "--iterations", done + 1, "--reward", f"{faulty}:brightness_noting_pid",
                   "--resume", "auto", "--output-dir", out_dir, nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {out_dir / f'checkpoint-{done}'}" in p.stdout
    assert [x["iteration"] for x in metrics(out_dir)] == list(range(1, done + 2))


@pytest.mark.slow
@SHARDINGS
def test_one_failing_rank_stops_every_rank_quickly(tmp_path, faulty, sharding):
    import time
    p = run_script(*FAST, *sharding, "--reward", f"{faulty}:raise_on_rank_1", "--dist-timeout", "60",
                   "--output-dir", tmp_path, nproc=2, timeout=300)
    stopped = time.time()
    assert p.returncode != 0
    assert "reward exploded on purpose" in p.stderr and "vgrpo: rank 1 failed" in p.stderr
    # rank 0 waits in a collective for rank 1; left to --dist-timeout it would take 60 s more after the failure
    assert stopped - float((tmp_path / "raised_at").read_text()) < 30


@pytest.mark.slow
def test_ranks_with_different_configurations_refuse_to_start(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, lr in ((0, "1e-3"), (1, "2e-3")):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "vgrpo.py"), *FAST, "--lr", lr,
                                       "--output-dir", str(tmp_path)], env=env, cwd=HERE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1
        assert "rank 1 runs a different configuration than rank 0" in err
    assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.slow
def test_bad_files_and_directories_are_one_clear_line(tmp_path, short_run):
    (tmp_path / "latin1.txt").write_bytes("a cat\n\nun caf\xe9\n".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a cat"}\n{"text": "a dog"}\n')
    (tmp_path / "rw.py").write_text("def mean(images, prompts):\n    return images.mean((1, 2, 3))\n")
    cases = [
        (["--prompts", tmp_path / "latin1.txt"], "line 3: not UTF-8"),
        (["--prompts", tmp_path / "blank.txt"], "has no prompts"),
        (["--output-dir", tmp_path / "a_file" / "out"], "is not writable"),
        (["--resume", short_run[0] / "checkpoint-3", "--model", "tiny", "--no-full-finetune", "--lora-rank", "8",
          "--iterations", "4"],
         "belongs to a different configuration: --lora-rank 32 there, 8 here"),
        (["--resume", short_run[0] / "checkpoint-3", "--model", "tiny", "--no-full-finetune", "--iterations", "2"],
         "is at iteration 3 and --iterations is 2: nothing to train"),
        (["--resume", short_run[0] / "checkpoint-3", "--model", "tiny", "--no-full-finetune", "--iterations", "4",
          "--ema", "0.9"], "no ema/ in it (saved without --ema); resume without --ema"),
        (["--prompts", tmp_path / "bad.jsonl"], 'line 2: expected an object with a "prompt" string'),
        (["--model", "tiny", "--eval-every", "2"], "--eval-every needs --eval-prompts"),
        (["--mixed-precision", "fp8"], "unknown --mixed-precision 'fp8'"),
        (["--preset", "sd4"], "unknown --preset 'sd4': valid choices are sd3-preference"),
        (["--reward", "jpeg:1,jpeg:2"], "a reward is named twice"),
        (["--reward", f"{tmp_path / 'rw.py'}:mean"], "its metric name clashes"),
    ]
    with ThreadPoolExecutor(2) as pool:   # each case is one process, mostly a single-threaded start-up: two at a time
        results = list(pool.map(lambda flags: run_script("--output-dir", tmp_path / "out", "--iterations", "1", *flags,
                                                         timeout=300), [flags for flags, _ in cases]))  # flags win
    for (flags, message), p in zip(cases, results):
        assert p.returncode == 2, (flags, p.stderr[-2000:])
        assert p.stderr.strip().startswith("vgrpo: error: ") and message in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.slow
def test_training_with_a_reward_server(tmp_path):
    rows = [{"prompt": "a red square", "value": 1}, {"prompt": "a blue circle", "value": 2, "tag": "colors"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = []
    server, url = _serve("ok", seen)
    try:
        p = run_script(*FAST, "--iterations", "1", "--reward", url, "--prompts", tmp_path / "p.jsonl",
                       "--output-dir", tmp_path / "o")
    finally:
        server.shutdown()
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(seen) == 1 and len(seen[0]["images"]) == 8
    # 2 prompts x 4 images: each image's prompt and its prompt file row, in the same order
    assert sorted(seen[0]["prompts"]) == ["a blue circle"] * 4 + ["a red square"] * 4
    assert seen[0]["metadata"] == [rows[["a red square", "a blue circle"].index(q)] for q in seen[0]["prompts"]]
    import base64
    import io
    from PIL import Image
    answers = [np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))).mean() / 255 for b in seen[0]["images"]]
    assert metrics(tmp_path / "o")[0]["reward_mean"] == pytest.approx(np.mean(answers), rel=1e-6)   # what it answered
