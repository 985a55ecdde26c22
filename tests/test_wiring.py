"""The fast tier's wiring tests: how the method's formulas are put together in the loop, each piece checked
against a computation written here independently -- the transformer called directly at timestep 1000 sigma,
the surrogate and the clipped loss written out, a hand-written AdamW step, DPM-Solver++ from its formulas.
The formulas alone are tested in test_vgrpo.py. Everything runs in-process on the tiny SD3 / FLUX models
(no subprocess), a few seconds per test: `pytest -m "not slow"` runs these with the other fast tests.

Calls into vgrpo that an API change could break are kept in the helpers below (make_args, new_run,
old_values_then_update, checkpoint_round_trip, call_old_surrogate, call_rollout), so such a change is a one-place
fix; the tests pin behaviour (weights after an update, advantages, which sigma / eps / conditioning each sample
gets, returned metrics), not call sequences. Where a test needs a tensor on another device than the CPU, "meta"
stands in for a GPU. bench/mutation.py measures how many injected bugs these tests catch."""

import base64
import copy
import dataclasses
import io
import json
import math
import os
import signal
import time
import types

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

import reward
import vgrpo
from tests.test_rewards import _serve

CPU = torch.device("cpu")
# AdamW's eps in these tests: near the gradients' size, so a step depends on the gradient's scale (with the
# default 1e-8 Adam is scale-invariant and a missing 1/n in gradient accumulation would not show)
ADAM_EPS = 1e-4
SEED, IT = 7, 3  # not 0: a seed or iteration replaced by a constant 0 must show
TINY = ["--model", "tiny", "--sample-steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--n-mc", "2",
        "--seed", str(SEED)]


# --------------------------------------------------------------------------- helpers: the calls into vgrpo


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("wiring"))


def make_args(out_dir, *flags):
    args = vgrpo.parse_args([*TINY, *map(str, flags), "--output-dir", out_dir])
    vgrpo.validate(args, 1)
    return args


@pytest.fixture(scope="module")
def sd3(out_dir):
    """The tiny SD3 family, built once; new_run() puts its initial weights back for every test."""
    family = vgrpo.load_family(make_args(out_dir), CPU)
    family.initial = copy.deepcopy(family.transformer.state_dict())
    return family


@pytest.fixture(scope="module")
def flux(out_dir):
    return vgrpo.load_family(make_args(out_dir, "--model", "tiny-flux"), CPU)


def new_run(family, args, reward_fn=None, prompts=None, metadata=None, scaler=None, model=None):
    """A Run as build_run makes it, on the module's family with its initial weights and AdamW(eps=ADAM_EPS);
    or, given a stand-in `model`, on that one (no sampling: no sigma grid, no prompts)."""
    if model is None:
        family.transformer.load_state_dict(family.initial)
        params = vgrpo.add_trainable_weights(family, args)
    else:
        params = list(model.parameters())
    for p in params:
        p.grad = None
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, eps=ADAM_EPS)
    prompts = prompts or list(vgrpo.DEFAULT_PROMPTS)
    return vgrpo.Run(args=args, family=family, model=family.transformer, optimizer=optimizer, params=params,
                     reward_fn=reward_fn, prompts=prompts, metadata=metadata or [{} for _ in prompts],
                     sigmas=None if model is not None else family.sigma_grid(args.sample_steps),
                     negative=family.encode([""]) if args.guidance > 1 and model is None else None,
                     rank=0, world=1, device=CPU, scaler=scaler)


def old_values_then_update(run, batch):
    """The old surrogate with the sampling weights, then update(): -> update's stats."""
    batch["s_old"], batch["x0_old"] = call_old_surrogate(run.family, run.family.transformer, batch, run.args,
                                                         run.n_prompts)
    return vgrpo.update(run.family, run.model, run.optimizer, run.params, batch, run.args, run.n_prompts, run.scaler)


def checkpoint_round_trip(run, directory, fresh):
    """save_checkpoint from `run`, then everything a resume restores into the Run `fresh`: -> the iteration saved."""
    run.args = dataclasses.replace(run.args, output_dir=directory)
    path = vgrpo.save_checkpoint(run, 5)
    iteration = vgrpo.load_trained_weights(path, fresh.family, fresh.args)
    vgrpo.load_training_state(path, fresh)
    return iteration


def call_old_surrogate(family, model, batch, args, n_prompts):
    return vgrpo.old_surrogate(family, model, batch, args, n_prompts)


def call_rollout(family, cond, noise, sigmas, args, negative=None):
    return vgrpo.rollout(family, None, cond, noise, sigmas, args, negative)


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# --------------------------------------------------------------------------- references written here


def sd3_velocity(transformer, x, sigma, emb, pooled):
    """SD3's transformer called directly: timestep = 1000 sigma (sigma a float or one value per row)."""
    t = (1000 * torch.as_tensor(sigma, dtype=torch.float32)).expand(len(x))
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=emb, pooled_projections=pooled,
                       return_dict=False)[0]


def flux_velocity(transformer, x, sigma, emb, pooled, guidance=3.5):
    """FLUX's transformer called directly: timestep = sigma (it multiplies by 1000 inside), the guidance
    embedding, text ids 0 and image ids (0, row, column) of the packed 8 x 8 token grid."""
    rows, cols = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    img_ids = torch.stack([torch.zeros(64), rows.flatten(), cols.flatten()], 1)
    t = torch.as_tensor(sigma, dtype=torch.float32).expand(len(x))
    return transformer(hidden_states=x, timestep=t, guidance=torch.full((len(x),), guidance),
                       pooled_projections=pooled, encoder_hidden_states=emb, txt_ids=torch.zeros(emb.shape[1], 3),
                       img_ids=img_ids, return_dict=False)[0]


def gaussian_velocity(a):
    """Data o ~ N(0, a^2): E[o | x_s] = (1-s) a^2 x / ((1-s)^2 a^2 + s^2) and v = (x - E[o | x_s]) / s, the exact
    velocity of the rectified flow; the probability-flow ODE then maps noise z exactly to a z."""
    def velocity(x, s):
        s = float(s)
        return (x - (1 - s) * a**2 * x / ((1 - s) ** 2 * a**2 + s**2)) / s
    return velocity


def numpy_surrogate(v, o, sig, eps, weighting):
    """s (B,) and x0_hat (B, N, *lat) from the velocities v (B, N, *lat), in float64."""
    s = sig.reshape(*sig.shape, *[1] * (o.ndim - 1))
    x = (1 - s) * o[:, None] + s * eps
    x0 = x - s * v
    axes = tuple(range(2, x0.ndim))
    err = x0 - o[:, None]
    loss = (err ** 2).mean(axes)
    if weighting == "adaptive":
        loss = loss / np.abs(err).mean(axes)
    return -loss.mean(1), x0


def torch_surrogate(model, o, sig, eps, emb, pooled, weighting):
    """The same surrogate in torch, differentiable, one batched call of the SD3 transformer."""
    B, N = sig.shape
    s = sig.view(B, N, 1, 1, 1)
    x = (1 - s) * o[:, None] + s * eps
    v = sd3_velocity(model, x.flatten(0, 1), sig.flatten(), emb.repeat_interleave(N, 0),
                     pooled.repeat_interleave(N, 0)).view_as(x)
    err = x - s * v - o[:, None]
    loss = err.pow(2).mean((2, 3, 4))
    if weighting == "adaptive":
        loss = loss / err.abs().mean((2, 3, 4)).detach()
    return -loss.mean(1), x - s * v


def reference_update(model, batch, args, n_prompts):
    """What update() must do, written out: for inner step k the minibatch holds members [kG/K, (k+1)G/K) of every
    group; loss = -mean min(ratio A, clip(ratio) A) + beta mean (x0 - x0_old)^2 over the whole minibatch; the
    gradient-norm clip; one AdamW step (hand-written). model: a copy at the sampling weights, trained in place.
    -> per-step stats."""
    beta, clip_eps = args.beta, args.clip_eps
    G, K = args.group_size, args.inner_steps
    emb, pooled = batch["cond"]
    params = list(model.parameters())
    with torch.no_grad():
        s_old, x0_old = torch_surrogate(model, batch["o"], batch["sigmas"], batch["eps"], emb, pooled, args.weighting)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    stats = []
    for k in range(K):
        idx = torch.tensor([g * G + j for g in range(n_prompts) for j in range(k * G // K, (k + 1) * G // K)])
        s_new, x0_new = torch_surrogate(model, batch["o"][idx], batch["sigmas"][idx], batch["eps"][idx], emb[idx],
                                        pooled[idx], args.weighting)
        ratio, A = torch.exp(s_new - s_old[idx]), batch["A"][idx]
        policy = -torch.minimum(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A).mean()
        kl = (x0_new - x0_old[idx]).pow(2).mean()
        grads = torch.autograd.grad(policy + beta * kl, params)
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads)).item()
        clip = min(1.0, args.max_grad_norm / (norm + 1e-6))
        b1, b2, t = 0.9, 0.999, k + 1
        with torch.no_grad():
            for p, g, m_, v_ in zip(params, grads, m, v):
                g = g * clip
                p.mul_(1 - args.lr * args.weight_decay)
                m_.mul_(b1).add_((1 - b1) * g)
                v_.mul_(b2).add_((1 - b2) * g * g)
                p.sub_(args.lr * (m_ / (1 - b1 ** t)) / ((v_ / (1 - b2 ** t)).sqrt() + ADAM_EPS))
        stats.append(dict(policy_loss=policy.item(), kl=kl.item(), grad_norm=norm, ratio_mean=ratio.mean().item(),
                          clip_frac=((ratio - 1).abs() > clip_eps).float().mean().item(),
                          ratio_min=ratio.min().item(), ratio_max=ratio.max().item()))
    return stats


def reference_sample(velocity, x, sigmas, sampler, min_r=0.5):
    """Euler, or DPM-Solver++(2M) in data prediction (Lu et al. 2022) with alpha = 1 - sigma, lambda = log(alpha /
    sigma), h_i = lambda_{i+1} - lambda_i: x_{i+1} = sigma_{i+1} / sigma_i x_i + alpha_{i+1} (1 - e^-h_i) D_i with
    D_i = x0_i, or (1 + 1/2r) x0_i - 1/2r x0_{i-1}, r = h_{i-1} / h_i, when r >= 1/2 (a step at most twice the
    last); the step to sigma = 0 returns x0. min_r=0 drops that guard (to show what it changes)."""
    sig = [float(s) for s in sigmas]
    lam = [-math.inf if s == 1 else math.log((1 - s) / s) for s in sig[:-1]]
    prev = None
    for i in range(len(sig) - 1):
        v = velocity(x, sig[i])
        if sampler == "euler":
            x = x + (sig[i + 1] - sig[i]) * v
            continue
        x0 = x - sig[i] * v
        if sig[i + 1] == 0:
            return x0
        h = lam[i + 1] - lam[i]
        D = x0
        if prev is not None and prev[1] / h >= min_r:
            r = prev[1] / h
            D = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * prev[0]
        x = sig[i + 1] / sig[i] * x + (1 - sig[i + 1]) * -math.expm1(-h) * D
        prev = (x0, h)
    return x


# --------------------------------------------------------------------------- the method's pieces, alone


@pytest.mark.parametrize("weights,soft_clip,eps", [({"a": 1.0, "b": -0.5}, None, 1e-4),
                                                    ({"a": -2.0, "b": 0.5, "c": 1.0}, 1.0, 1e-2)])
def test_per_reward_advantages_with_negative_weights(weights, soft_clip, eps):
    rng = np.random.default_rng(5)
    parts = {name: rng.normal(size=12) * scale for name, scale in zip(weights, (1.0, 50.0, 0.01))}
    want = 0
    for name, w in weights.items():
        g = parts[name].reshape(3, 4)
        want = want + w * (g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + eps)
    want = want.reshape(-1) / sum(abs(w) for w in weights.values())   # |w|: a negative weight must not cancel
    if soft_clip:
        want = soft_clip * np.tanh(want / soft_clip)
    got = vgrpo.per_reward_advantages({k: torch.tensor(v, dtype=torch.float32) for k, v in parts.items()}, weights, 4,
                                      eps=eps, soft_clip=soft_clip)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sharing", ["batch", "group", "none"])
def test_unstratified_pairs_draw_grid_values_with_replacement_never_zero(sharing):
    grid = torch.cat([torch.linspace(1.0, 0.1, 6), torch.zeros(1)])
    ids = [(p, m) for p in range(3) for m in range(2)]
    seen, repeated = set(), 0
    for seed in range(60):
        sig, eps = vgrpo.draw_pairs(grid, 4, (2, 3), ids, sharing, False, seed, IT)
        assert sig.shape == (6, 4) and eps.shape == (6, 4, 2, 3)
        assert (sig > 0).all(), sig                          # sigma = 0 (the grid's end) makes 0/0 in the weight
        assert all(any(np.isclose(s, grid[:-1].numpy(), rtol=0, atol=1e-7)) for s in sig.flatten().tolist())
        seen.update(round(s, 6) for s in sig.flatten().tolist())
        repeated += sum(len(set(row.tolist())) < 4 for row in sig)
        assert not torch.equal(eps[:, 0], eps[:, 1])         # each pair its own eps
    assert seen == {round(s, 6) for s in grid[:-1].tolist()}   # every non-zero grid value is drawn
    assert repeated > 0                                       # uniform with replacement, not one per chunk
    sig, eps = vgrpo.draw_pairs(grid, 4, (2, 3), ids, sharing, False, 0, IT, device="meta")
    assert sig.device.type == eps.device.type == "meta"
    # and stratified draws: one value per contiguous chunk, so a row never repeats and spans the grid
    sig, _ = vgrpo.draw_pairs(grid, 3, (2,), ids, sharing, True, 0, IT)
    chunks = np.array_split(grid[:-1].numpy(), 3)
    assert all(any(np.isclose(row[j].item(), chunks[j])) for row in sig for j in range(3))


@pytest.mark.parametrize("stratified", [False, True])
def test_a_grid_without_a_final_zero_is_drawn_from_whole(stratified):
    grid = torch.linspace(1.0, 0.1, 6)                 # no final 0 to drop: its last value is a valid noise level
    want = {round(v, 6) for v in grid.tolist()}
    pairs = {round(v, 6) for seed in range(40)
             for v in vgrpo.draw_pairs(grid, 3, (1,), [(0, 0)], "none", stratified, seed, IT)[0].flatten().tolist()}
    alone = {round(v, 6) for seed in range(40)
             for v in vgrpo.stratified_sigmas(grid, 3, torch.Generator().manual_seed(seed)).tolist()}
    assert pairs == want and alone == want


def test_eps_of_the_pairs_is_standard_normal_and_differs_per_pair():
    grid = torch.cat([torch.linspace(1.0, 0.1, 6), torch.zeros(1)])
    _, eps = vgrpo.draw_pairs(grid, 4, (8, 16, 16), [(0, 0)], "none", True, SEED, IT)
    assert abs(eps.mean().item()) < 0.03 and abs(eps.std().item() - 1) < 0.03
    assert all(not torch.equal(eps[0, i], eps[0, j]) for i in range(4) for j in range(i))


def test_micro_batches_take_each_inner_steps_members_of_every_group():
    # P = 3 groups of G = 4, 2 inner steps: step k holds members 2k, 2k + 1 of every group, in micro-batches of 2
    got = [(k, idx.tolist()) for k, idx in vgrpo.micro_batches(3, 4, 2, 2)]
    assert got == [(0, [0, 1]), (0, [4, 5]), (0, [8, 9]), (1, [2, 3]), (1, [6, 7]), (1, [10, 11])]
    got = [(k, idx.tolist()) for k, idx in vgrpo.micro_batches(2, 6, 3, 4)]
    assert got == [(0, [0, 1, 6, 7]), (1, [2, 3, 8, 9]), (2, [4, 5, 10, 11])]
    assert [(k, idx.tolist()) for k, idx in vgrpo.micro_batches(2, 2, 1, 4)] == [(0, [0, 1, 2, 3])]
    # made where the batch lives ("meta" stands in for a GPU here: no copy of the indices at every micro-batch)
    assert {idx.device.type for _, idx in vgrpo.micro_batches(2, 4, 2, 2, device="meta")} == {"meta"}


def test_rows_of_repeats_each_row_for_its_pairs():
    a, b = torch.arange(5.0)[:, None] * torch.ones(5, 2), torch.arange(10, 15)
    got = vgrpo.rows_of((a, b), torch.tensor([3, 1]), 2)
    assert torch.equal(got[0], torch.tensor([[3.0, 3], [3, 3], [1, 1], [1, 1]]))
    assert torch.equal(got[1], torch.tensor([13, 13, 11, 11]))
    assert torch.equal(vgrpo.rows_of((b,), torch.tensor([4, 0]))[0], torch.tensor([14, 10]))


def test_vgrpo_loss_has_no_kl_term_unless_given_a_beta_and_stays_on_the_device():
    s_new, s_old, A = torch.tensor([0.05, -0.02, 0.004]), torch.zeros(3), torch.tensor([1.0, 1.0, -2.0])
    x0_new, x0_old = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    loss, stats = vgrpo.vgrpo_loss(s_new, s_old, A, 0.01, x0_new=x0_new, x0_old=x0_old)   # beta left at its default
    ratio = np.exp(s_new.numpy())
    policy = -np.mean(np.minimum(ratio * A.numpy(), np.clip(ratio, 0.99, 1.01) * A.numpy()))
    assert loss.item() == pytest.approx(policy, rel=1e-6)
    assert stats["kl"].item() == pytest.approx((x0_new - x0_old).pow(2).mean().item(), rel=1e-6)
    # statistics are tensors on the loss's device, read once per iteration ("meta" stands in for a GPU)
    _, stats = vgrpo.vgrpo_loss(*(t.to("meta") for t in (s_new, s_old, A)), 0.01)
    assert {v.device.type for v in stats.values()} == {"meta"}


def test_elbo_surrogate_defaults_to_the_adaptive_weighting_and_names_an_unknown_one():
    g = torch.Generator().manual_seed(10)
    v, eps, o, sig = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g), torch.randn(2, 4), \
        torch.tensor([[0.9, 0.5, 0.1], [0.7, 0.3, 0.2]])
    assert torch.equal(vgrpo.elbo_surrogate(v, o, sig, eps)[0], vgrpo.elbo_surrogate(v, o, sig, eps, "adaptive")[0])
    assert not torch.allclose(vgrpo.elbo_surrogate(v, o, sig, eps)[0], vgrpo.elbo_surrogate(v, o, sig, eps, "none")[0])
    with pytest.raises(ValueError, match="unknown weighting 'mse'"):
        vgrpo.elbo_surrogate(v, o, sig, eps, "mse")


def test_clip_fraction_counts_ratios_the_clip_changes():
    # a ratio exactly at 1 + clip_eps is not changed by the clip, so it is not counted
    ratio = torch.exp(torch.tensor([0.02, 0.0]))
    clip_eps = (ratio[0] - 1).item()
    _, stats = vgrpo.vgrpo_loss(torch.tensor([0.02, 0.0]), torch.zeros(2), torch.ones(2), clip_eps)
    assert stats["clip_frac"].item() == 0.0
    _, stats = vgrpo.vgrpo_loss(torch.tensor([0.02, 0.0]), torch.zeros(2), torch.ones(2), clip_eps / 2)
    assert stats["clip_frac"].item() == 0.5


def test_surrogate_feeds_the_model_samples_in_their_own_dtype():
    seen = []

    class Recording(LinearFamily):
        def velocity(self, model, x, sigma, cond):
            seen.append(x.dtype)
            return super().velocity(model, x.float(), sigma, cond)

    batch = linear_batch(2)
    o, eps = batch["o"].bfloat16(), batch["eps"].bfloat16()         # float32 sigmas would promote x_t
    s, _ = vgrpo.surrogate(Recording(), 0.7, o, batch["sigmas"], eps, batch["cond"], "adaptive")
    assert seen == [torch.bfloat16] and s.dtype == torch.float32


@pytest.mark.parametrize("sampler", ["dpmpp2m", "euler"])
def test_sample_ode_keeps_the_states_dtype_and_device(sampler):
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0])
    z = torch.randn(4, 3, dtype=torch.float64)
    assert vgrpo.sample_ode(gaussian_velocity(0.6), z, sigmas, sampler).dtype == torch.float64
    seen = []

    def velocity(x, sigma):
        seen.append(sigma.device.type)
        return 0.5 * x

    out = vgrpo.sample_ode(velocity, torch.empty(4, 3, device="meta"), sigmas, sampler)
    assert out.device.type == "meta" and seen == ["meta"] * 4        # sigma goes to the model on its device


def test_dpmpp2m_is_first_order_exactly_where_the_step_more_than_doubles():
    # lambda steps of this grid: inf, 0.81, 0.54, 1.69 (over twice the last: first order), 0.25, 0.29, then to 0
    sigmas = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.3, 0.25, 0.2, 0.0], dtype=torch.float64)
    z = torch.randn(64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    velocity = gaussian_velocity(0.6)
    want = reference_sample(velocity, z, sigmas, "dpmpp2m")
    got = vgrpo.sample_ode(velocity, z, sigmas, "dpmpp2m")                # its state is float32
    assert (got - want).abs().max() < 1e-6
    assert (reference_sample(velocity, z, sigmas, "dpmpp2m", min_r=0) - want).abs().max() > 1e-3  # the guard matters
    euler = vgrpo.sample_ode(velocity, z, sigmas, "euler")
    assert (euler - reference_sample(velocity, z, sigmas, "euler")).abs().max() < 1e-6


# --------------------------------------------------------------------------- the surrogate on the model


@pytest.mark.parametrize("kind,weighting", [("sd3", "adaptive"), ("sd3", "none"), ("flux", "adaptive")])
def test_surrogate_calls_the_transformer_at_1000_sigma_with_each_samples_conditioning(request, kind, weighting):
    family = request.getfixturevalue(kind)
    velocity = sd3_velocity if kind == "sd3" else flux_velocity
    emb, pooled = family.encode(["a red apple", "two cats on a sofa", "a lighthouse"])   # a different prompt each
    g = torch.Generator().manual_seed(1)
    o = torch.randn(3, *family.latent_shape, generator=g)
    sig = torch.tensor([[0.9, 0.2], [0.6, 0.05], [0.35, 0.75]])     # all different: a misplaced sigma shows
    eps = torch.randn(3, 2, *family.latent_shape, generator=g)
    with torch.no_grad():
        s, x0 = vgrpo.surrogate(family, family.transformer, o, sig, eps, (emb, pooled), weighting)
        # one (sample, pair) at a time: row b must see sigma[b, j], eps[b, j] and sample b's conditioning
        s_ = sig.view(3, 2, *[1] * (o.dim() - 1))
        x = (1 - s_) * o[:, None] + s_ * eps
        v = torch.stack([torch.stack([velocity(family.transformer, x[b, j][None], sig[b, j], emb[b:b + 1],
                                               pooled[b:b + 1])[0] for j in range(2)]) for b in range(3)])
    want_s, want_x0 = numpy_surrogate(*(t.double().numpy() for t in (v, o, sig, eps)), weighting)
    assert s.shape == (3,) and s.dtype == torch.float32
    np.testing.assert_allclose(s.numpy(), want_s, rtol=1e-4)
    np.testing.assert_allclose(x0.numpy(), want_x0, rtol=1e-4, atol=1e-5)
    assert len(set(np.round(want_s, 4))) == 3      # the rows differ, so a swap of two rows would show


def test_surrogate_gradient_is_the_velocitys_with_a_constant_weight(sd3, out_dir):
    """d s / d theta = sum_j 2 sigma_j err_j / (N D c_j) . d v_j / d theta with c_j = mean|err_j| held constant
    (the adaptive weight is a stop-gradient): the transformer's own vector-Jacobian product with that cotangent."""
    run = new_run(sd3, make_args(out_dir))
    emb, pooled = sd3.encode(["a red apple", "two cats on a sofa", "a lighthouse"])
    g = torch.Generator().manual_seed(2)
    o = torch.randn(3, *sd3.latent_shape, generator=g)
    sig = torch.tensor([[0.9, 0.2], [0.6, 0.05], [0.35, 0.75]])
    eps = torch.randn(3, 2, *sd3.latent_shape, generator=g)
    w = torch.tensor([1.0, -2.0, 0.5])                             # a different weight per sample
    s, _ = vgrpo.surrogate(sd3, sd3.transformer, o, sig, eps, (emb, pooled), "adaptive")
    got = torch.autograd.grad((w * s).sum(), run.params)
    s_ = sig.view(3, 2, 1, 1, 1)
    x = (1 - s_) * o[:, None] + s_ * eps
    v = sd3_velocity(sd3.transformer, x.flatten(0, 1), sig.flatten(), emb.repeat_interleave(2, 0),
                     pooled.repeat_interleave(2, 0)).view_as(x)
    err = (x - s_ * v - o[:, None]).detach()
    D = err[0, 0].numel()
    cotangent = w.view(3, 1, 1, 1, 1) * 2 * s_ * err / (2 * D * err.abs().mean((2, 3, 4), keepdim=True))
    want = torch.autograd.grad(v, run.params, grad_outputs=cotangent)
    scale = max(t.abs().max().item() for t in want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)


class AnalyticFamily:
    """The model seam rollout() talks to (velocity(model, x, sigma, cond), cfg and guide, vgrpo.Family's CFG) with the
    exact velocity of a Gaussian flow plus one shift per conditioning row, so a wrong sampler or a conditioning row
    out of place shows."""

    guide = vgrpo.Family.guide

    def __init__(self, cfg):
        self.cfg, self.gaussian = cfg, gaussian_velocity(0.6)

    def velocity(self, model, x, sigma, cond):
        return self.gaussian(x, sigma) + cond[0]


@pytest.mark.parametrize("sampler,cfg,guidance,sample_batch", [("dpmpp2m", True, 1.0, 3), ("euler", True, 1.5, 2),
                                                                ("dpmpp2m", True, 2.5, 5), ("dpmpp2m", False, 3.5, 4)])
def test_rollout_integrates_each_sample_under_its_own_conditioning(out_dir, sampler, cfg, guidance, sample_batch):
    """Any number of samples per pass; with CFG (SD3, guidance > 1) the guided velocity v_neg + g (v_c - v_neg); FLUX
    (cfg False) takes the guidance in its embedding, so its rollout is never guided."""
    args = make_args(out_dir, "--sampler", sampler, "--guidance", guidance, "--sample-batch", sample_batch)
    shift = torch.tensor([0.3, -0.2, 0.5, 0.1, -0.4])[:, None]        # sample i's conditioning: v + shift_i
    negative = (torch.tensor([[0.05]]),)
    noise = torch.randn(5, 8, generator=torch.Generator().manual_seed(6))
    sigmas = torch.tensor([1.0, 0.9, 0.7, 0.45, 0.25, 0.1, 0.0])
    got = call_rollout(AnalyticFamily(cfg), (shift,), noise, sigmas, args, negative if cfg else None)
    guided = negative[0] + guidance * (shift - negative[0]) if cfg and guidance > 1 else shift
    want = reference_sample(lambda x, s: gaussian_velocity(0.6)(x, s) + guided, noise, sigmas, sampler)
    assert (got - want).abs().max() < 1e-5
    other = reference_sample(lambda x, s: gaussian_velocity(0.6)(x, s) + guided, noise, sigmas,
                             "euler" if sampler == "dpmpp2m" else "dpmpp2m")
    assert (other - want).abs().max() > 1e-2                       # the samplers differ on this flow


class LinearModel(torch.nn.Module):
    def __init__(self, a=0.7):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a))


class LinearFamily:
    """The seam surrogate() uses, with a stand-in model v = a x + c (a the "model", a number or a LinearModel; c
    one value per sample's conditioning): the surrogate is known in closed form and runs on any device, "meta" too."""
    compiled = False   # as vgrpo.Family without --compile

    def __init__(self, transformer=None):
        self.transformer = transformer

    def velocity(self, model, x, sigma, cond):
        return (model.a if isinstance(model, torch.nn.Module) else model) * x + cond[0]


def linear_batch(n, seed=8, lat=(2, 3, 3)):
    g = torch.Generator().manual_seed(seed)
    return dict(o=torch.randn(n, *lat, generator=g), sigmas=torch.rand(n, 2, generator=g) * 0.9 + 0.05,
                eps=torch.randn(n, 2, *lat, generator=g), cond=(torch.randn(n, 1, 1, 1, generator=g),))


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_old_surrogate_holds_the_sampling_policys_values_of_the_later_minibatches(out_dir, beta):
    """With 2 inner steps the second minibatch (members 2, 3 of each group of 4) needs old values from the
    sampling weights; x0_hat_old is kept only when the KL term uses it."""
    args = make_args(out_dir, "--inner-steps", "2", "--micro-batch", "2", "--beta", beta)
    batch = linear_batch(8)
    s_old, x0_old = call_old_surrogate(LinearFamily(), 0.7, batch, args, 2)
    o, sig, eps, c = (t.double().numpy() for t in (batch["o"], batch["sigmas"], batch["eps"], batch["cond"][0]))
    x = (1 - sig[:, :, None, None, None]) * o[:, None] + sig[:, :, None, None, None] * eps
    want_s, want_x0 = numpy_surrogate(0.7 * x + c[:, None], o, sig, eps, args.weighting)
    later = [0 * 4 + 2, 0 * 4 + 3, 1 * 4 + 2, 1 * 4 + 3]
    np.testing.assert_allclose(s_old[later].numpy(), want_s[later], rtol=1e-5)
    assert (x0_old is None) == (beta == 0)
    if beta:
        np.testing.assert_allclose(x0_old[later].numpy(), want_x0[later], rtol=1e-5, atol=1e-6)
        meta = {k: tuple(t.to("meta") for t in v) if k == "cond" else v.to("meta") for k, v in batch.items()}
        s_old, x0_old = call_old_surrogate(LinearFamily(), 0.7, meta, args, 2)
        assert s_old.device.type == x0_old.device.type == "meta"   # made where the batch lives


def test_compiled_the_old_surrogate_runs_with_gradients_and_frees_each_micro_batchs_graph(out_dir, monkeypatch):
    """With compiled blocks the old pass runs with gradients, as the update's forward does (torch compiles the two
    modes apart, and they round differently in bf16): the values it keeps are detached and the eager pass's, no
    gradient reaches the model, and no micro-batch's graph outlives its forward (two alive would double the pass's
    memory)."""
    import weakref

    args = make_args(out_dir, "--inner-steps", "2", "--micro-batch", "1", "--beta", 0.5)
    batch, model, real_surrogate = linear_batch(8), LinearModel(), vgrpo.surrogate
    graphs, grad_modes = [], []

    def watched(*a, **kw):
        assert all(ref() is None for ref in graphs), "an earlier micro-batch's graph is still alive"
        grad_modes.append(torch.is_grad_enabled())
        s, x0 = real_surrogate(*a, **kw)
        graphs.extend(weakref.ref(t) for t in (s, x0) if t.requires_grad)
        return s, x0

    monkeypatch.setattr(vgrpo, "surrogate", watched)
    eager = call_old_surrogate(LinearFamily(), model, batch, args, 2)
    compiled_family = LinearFamily()
    compiled_family.compiled = True
    compiled = call_old_surrogate(compiled_family, model, batch, args, 2)
    assert grad_modes == [False] * 4 + [True] * 4 and len(graphs) == 8   # the second minibatch: 4 micro-batches
    for e, c in zip(eager, compiled):
        assert not c.requires_grad and torch.equal(e.nan_to_num(), c.nan_to_num())
    assert model.a.grad is None


# --------------------------------------------------------------------------- update()


def _update_batch(family, args, run):
    g = torch.Generator().manual_seed(3)
    B = args.prompts_per_step * args.group_size
    grid = run.sigmas[:-1]
    return dict(o=torch.randn(B, *family.latent_shape, generator=g),
                cond=family.encode(["a cat"] * args.group_size + ["a red dog on a bike"] * args.group_size),
                sigmas=grid[torch.randint(len(grid), (B, args.n_mc), generator=g)],
                eps=torch.randn(B, args.n_mc, *family.latent_shape, generator=g),
                A=torch.tensor([1.2, -0.7, 0.4, -0.9, -1.1, 0.8, 0.3, -0.2]))


@pytest.mark.parametrize("scaler", [False, True])
@pytest.mark.parametrize("bad_steps", [(0,), (0, 1)])
def test_a_non_finite_step_is_skipped_and_counted(out_dir, scaler, bad_steps):
    """An infinite advantage in the first micro-batch of a step makes that step's loss and gradient non-finite: the
    step is dropped (by the check, or by fp16's loss scaler), counted, and the weights stay finite."""
    args = make_args(out_dir, "--inner-steps", "2", "--micro-batch", "2")
    model = LinearModel()
    run = dataclasses.replace(new_run(LinearFamily(model), args, model=model), scaler=torch.amp.GradScaler(
        "cpu", init_scale=2.0 ** 8) if scaler else None)
    batch = linear_batch(8, seed=9)
    batch["A"] = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    for k in bad_steps:
        batch["A"][2 * k] = float("inf")           # step k's first micro-batch holds members 2k, 2k + 1 of group 0
    start = model.a.item()
    stats = old_values_then_update(run, batch)
    assert stats["skipped_steps"] == len(bad_steps)
    assert math.isfinite(model.a.item()) and (model.a.item() != start) == (len(bad_steps) == 1)


UPDATE_CASES = {
    "accumulated micro-batches": (["--inner-steps", "2", "--micro-batch", "2", "--clip-eps", "0.02", "--beta", "3",
                                   "--max-grad-norm", "1e6"], None),
    "norm clip binds, plain MSE": (["--inner-steps", "2", "--micro-batch", "4", "--clip-eps", "0.0116", "--beta", "1",
                                    "--max-grad-norm", "0.01", "--weighting", "none", "--weight-decay", "0.1"], None),
    "fp16 loss scaler": (["--inner-steps", "2", "--micro-batch", "2", "--clip-eps", "0.02", "--beta", "3",
                          "--max-grad-norm", "1e6"], 2.0 ** 12),
}


@pytest.mark.parametrize("case", UPDATE_CASES)
def test_update_takes_the_hand_written_clipped_steps(sd3, out_dir, case):
    """Two inner steps with the ratio clip and beta > 0 against the loss written out, the gradient-norm clip and
    a hand-written AdamW step. The second step sees moved weights, so the clip and the KL both act there."""
    flags, init_scale = UPDATE_CASES[case]
    args = make_args(out_dir, *flags)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if init_scale else None
    run = new_run(sd3, args, scaler=scaler)
    batch = _update_batch(sd3, args, run)
    reference = copy.deepcopy(sd3.transformer)
    start = weights(reference)
    stats = old_values_then_update(run, batch)
    steps = reference_update(reference, batch, args, args.prompts_per_step)
    assert 0 < steps[1]["clip_frac"] < 1 and steps[1]["kl"] > 0          # the clip and the KL term matter here
    if args.max_grad_norm < 1:
        assert all(s["grad_norm"] > 2 * args.max_grad_norm for s in steps)
    torch.testing.assert_close(weights(sd3.transformer) - start, weights(reference) - start, rtol=0, atol=1e-6)
    mean = lambda name: sum(s[name] for s in steps) / len(steps)
    assert stats["skipped_steps"] == 0
    for name in ("policy_loss", "kl", "grad_norm", "clip_frac", "ratio_mean"):
        assert stats[name] == pytest.approx(mean(name), rel=1e-4), name
    assert stats["ratio_min"] == pytest.approx(min(s["ratio_min"] for s in steps), rel=1e-6)
    assert stats["ratio_max"] == pytest.approx(max(s["ratio_max"] for s in steps), rel=1e-6)


# --------------------------------------------------------------------------- one iteration


def brightness(images, prompts):
    return images.mean((1, 2, 3))


def make_redness(seen):
    def redness(images, prompts, metadata=None):
        seen.append((list(prompts), metadata))
        return 10 * (images[:, 0] - images[:, 2]).mean((1, 2)) + torch.tensor([m["bonus"] for m in metadata])
    return redness


ITERATION_CASES = {
    "batch pairs, soft clip, summed rewards": (["--pair-sharing", "batch", "--adv-soft-clip", "1.0"],
                                               {"brightness": 100.0, "redness": 0.5}),
    "per-reward with a single reward: the sum's advantage": (
        ["--reward-advantage", "per-reward", "--sample-steps", "2"], {"brightness": 100.0}),
    "group pairs, unstratified, per-reward, 2 clipped steps": (
        ["--pair-sharing", "group", "--no-stratified", "--reward-advantage", "per-reward", "--inner-steps", "2",
         "--micro-batch", "2", "--sample-batch", "3", "--beta", "1", "--clip-eps", "0.01"],
        {"brightness": 1.0, "redness": -0.5}),
    "own pairs, per-reward soft clip, euler with CFG, loss scaler": (
        ["--pair-sharing", "none", "--reward-advantage", "per-reward", "--adv-soft-clip", "0.8", "--sampler", "euler",
         "--guidance", "2.5", "--weighting", "none", "--micro-batch", "4", "--sample-batch", "5"],
        {"brightness": 2.0, "redness": -1.0}),
}


def test_each_rank_takes_its_own_slots_of_the_iterations_keyed_prompt_order():
    """Slot j of iteration it (counted over all ranks) takes prompt order[j % len(prompts)], where order is the
    permutation drawn with keyed_generator(seed, "prompts", it); rank r of W holds slots [r P/W, (r+1) P/W), each
    as G members. 8 slots over a 5-prompt file wrap around."""
    prompts, metadata = [f"prompt {i}" for i in range(5)], [{"line": i} for i in range(5)]
    P, W, G = 8, 2, 3
    orders = []
    for it in (IT, IT + 1):
        order = torch.randperm(5, generator=vgrpo.keyed_generator(SEED, "prompts", it)).tolist()
        orders.append(order)
        for rank in range(W):
            run = types.SimpleNamespace(prompts=prompts, metadata=metadata, rank=rank, n_prompts=P // W,
                                        args=types.SimpleNamespace(seed=SEED, group_size=G))
            ids, got_prompts, got_metadata = vgrpo.local_samples(run, it)
            slots = range(rank * P // W, (rank + 1) * P // W)
            assert ids == [(j, m) for j in slots for m in range(G)]
            assert got_prompts == [prompts[order[j % 5]] for j in slots for _ in range(G)]
            assert got_metadata == [metadata[order[j % 5]] for j in slots for _ in range(G)]
    assert orders[0] != orders[1]


@pytest.mark.parametrize("case", ITERATION_CASES)
def test_train_iteration_lines_up_samples_rewards_advantages_pairs_and_conditioning(sd3, out_dir, case, monkeypatch):
    """One iteration against a reference built here from its parts: the rollout from each sample's keyed noise
    and prompt (the transformer called directly, the sampler from its formulas), the reward of those images, the
    advantages from the formula, the pairs drawn for each sample's (prompt, member), and the update written out."""
    flags, reward_weights = ITERATION_CASES[case]
    args = make_args(out_dir, *flags)
    seen = []
    fns = {"brightness": brightness, "redness": make_redness(seen)}
    reward_fn = reward.WeightedReward([(name, w, fns[name]) for name, w in reward_weights.items()])
    prompts_all = list(vgrpo.DEFAULT_PROMPTS)
    metadata_all = [{"prompt": p, "bonus": 0.01 * i} for i, p in enumerate(prompts_all)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if "scaler" in case else None   # exact in float32
    run = new_run(sd3, args, reward_fn=reward_fn, prompts=prompts_all, metadata=metadata_all, scaler=scaler)
    rollouts, decode = [], vgrpo.decode  # the rollout's latents o, as the update received them
    monkeypatch.setattr(vgrpo, "decode", lambda family, o, size: rollouts.append(o) or decode(family, o, size))
    reference = copy.deepcopy(sd3.transformer)
    start = weights(reference)
    t0 = time.perf_counter()
    stats, images, prompts, r, A = vgrpo.train_iteration(run, IT)
    elapsed = time.perf_counter() - t0
    times = [stats[k] for k in ("time_rollout", "time_reward", "time_old", "time_update")]
    assert all(t >= 0 for t in times) and sum(times) <= elapsed
    assert stats.get("loss_scale") == (2.0 ** 10 if scaler else None)
    if scaler:  # the update went through the scaler: it counts one good step per optimizer step
        assert scaler.state_dict()["_growth_tracker"] == args.inner_steps
    P, G = args.prompts_per_step, args.group_size
    # prompts: whole groups of one prompt, P different ones; each reward saw each sample's own metadata
    assert len(prompts) == P * G and len({prompts[g * G] for g in range(P)}) == P
    assert all(prompts[i] == prompts[i // G * G] for i in range(P * G))
    assert all(m == [metadata_all[prompts_all.index(p)] for p in ps] for ps, m in seen)
    # the rollout: sample (j, m) starts from the noise keyed (seed, "noise", iteration, j, m), under its prompt
    ids = [(j, m) for j in range(P) for m in range(G)]
    noise = torch.stack([torch.randn(sd3.latent_shape, generator=vgrpo.keyed_generator(SEED, "noise", IT, j, m))
                         for j, m in ids])
    emb, pooled = (torch.cat(t) for t in zip(*(sd3.encode([p]) for p in prompts)))
    neg_emb, neg_pooled = (t.expand(P * G, *t.shape[1:]) for t in sd3.encode([""]))

    def velocity(x, sigma):
        with torch.no_grad():
            v = sd3_velocity(reference, x, sigma, emb, pooled)
            if args.guidance > 1:
                v_neg = sd3_velocity(reference, x, sigma, neg_emb, neg_pooled)
                v = v_neg + args.guidance * (v - v_neg)
        return v

    o = reference_sample(velocity, noise, run.sigmas, args.sampler)
    assert (images - sd3.decode(o)).abs().max() < 1e-4
    assert len(rollouts) == 1 and (rollouts[0] - o).abs().max() < 1e-5
    # rewards and advantages
    parts = {name: fns[name](images, prompts, metadata=[metadata_all[prompts_all.index(p)] for p in prompts])
             if name == "redness" else fns[name](images, prompts) for name in reward_weights}
    torch.testing.assert_close(r, sum(w * parts[name] for name, w in reward_weights.items()), rtol=1e-6, atol=1e-7)

    def advantage(x):
        g = x.double().numpy().reshape(P, G)
        return ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4)).reshape(-1)

    if args.reward_advantage == "per-reward" and len(parts) > 1:
        want = sum(w * advantage(parts[name]) for name, w in reward_weights.items())
        want = want / sum(abs(w) for w in reward_weights.values())
    else:
        want = advantage(r)
    if args.reward_advantage == "per-reward" and len(parts) == 1:   # the sum's advantage, which differs from the
        assert np.abs(advantage(parts["brightness"]) - want).max() > 1e-3    # lone reward's by its weight vs epsilon
    # each reward's mean is logged when there are several
    assert {k: v for k, v in stats.items() if k.startswith("reward_")} == pytest.approx(
        {f"reward_{name}": parts[name].mean().item() for name in parts} if len(parts) > 1 else {}, rel=1e-6)
    if args.adv_soft_clip:
        want = args.adv_soft_clip * np.tanh(want / args.adv_soft_clip)
    np.testing.assert_allclose(A.numpy(), want, rtol=1e-4, atol=1e-5)
    assert np.abs(want).max() > 0.5
    # the update, on the pairs of each sample's (global prompt, member) and the sample's own conditioning
    sig, eps = vgrpo.draw_pairs(run.sigmas, args.n_mc, sd3.latent_shape, ids, args.pair_sharing, args.stratified,
                                SEED, IT)
    # the rollout's own o and advantages, each equal to the reference's within float rounding (checked above):
    # AdamW (eps 1e-4) would turn those rounding differences of the gradients into steps of ~1e-5
    batch = dict(o=rollouts[0], cond=(emb, pooled), sigmas=sig, eps=eps, A=A)
    steps = reference_update(reference, batch, args, P)
    if args.inner_steps > 1:
        assert 0 < steps[1]["clip_frac"] < 1 and steps[1]["kl"] > 0, steps
    torch.testing.assert_close(weights(sd3.transformer) - start, weights(reference) - start, rtol=0, atol=1e-6)
    assert stats["kl"] == pytest.approx(sum(s["kl"] for s in steps) / len(steps), rel=1e-3, abs=1e-12)
    assert stats["skipped_steps"] == 0


def nan_reward(images, prompts):
    return torch.full((len(images),), float("nan"))


def huge_reward(images, prompts):
    # finite rewards whose group mean overflows float32: the advantages are not finite
    return torch.tensor([3e38, 2e38] * (len(images) // 2))


SKIP_CASES = {
    "one NaN reward": ([("brightness", 1.0, brightness), ("broken", 0.5, nan_reward)], "broken"),
    "two NaN rewards": ([("broken", 1.0, nan_reward), ("gone", 1.0, nan_reward)], "broken, gone"),
    "advantages overflow": ([("huge", 1.0, huge_reward)], "the reward"),
    "a bare function": (lambda images, prompts, metadata: nan_reward(images, prompts), "the reward"),
}


@pytest.mark.parametrize("case", SKIP_CASES)
def test_a_non_finite_reward_or_advantage_skips_the_update_and_says_why(sd3, out_dir, capsys, case):
    rewards, names = SKIP_CASES[case]
    args = make_args(out_dir, "--sample-steps", "2", "--group-size", "2", "--n-mc", "1", "--inner-steps", "2")
    fn = reward.WeightedReward(rewards) if isinstance(rewards, list) else rewards
    run = new_run(sd3, args, reward_fn=fn, prompts=["the only prompt"])     # fewer prompts than P: reused
    start = weights(sd3.transformer)
    t0 = time.perf_counter()
    stats, images, prompts, r, A = vgrpo.train_iteration(run, IT)
    elapsed = time.perf_counter() - t0
    assert prompts == ["the only prompt"] * 4 and images.shape == (4, 3, 32, 32) and not A.isfinite().all()
    assert torch.equal(weights(sd3.transformer), start)
    assert stats["skipped_steps"] == 2 and stats["time_old"] == stats["time_update"] == 0
    assert all(math.isnan(stats[k]) for k in ("policy_loss", "kl", "clip_frac", "ratio_min", "ratio_max", "grad_norm"))
    assert 0 < stats["time_rollout"] and 0 <= stats["time_reward"]
    assert stats["time_rollout"] + stats["time_reward"] <= elapsed
    assert f"iteration {IT + 1}: non-finite values from {names}; update skipped" in capsys.readouterr().err


def test_a_reward_error_stops_the_run_with_its_message(sd3, out_dir):
    args = make_args(out_dir, "--sample-steps", "2", "--group-size", "2", "--n-mc", "1")
    fn = reward.WeightedReward([("flat", 1.0, lambda images, prompts: torch.zeros(len(images), 3))])
    with pytest.raises(vgrpo.FatalError, match=r"reward 'flat' returned Tensor \(4, 3\)"):
        vgrpo.train_iteration(new_run(sd3, args, reward_fn=fn), IT)


def test_each_iteration_and_seed_draws_its_own_prompts_reproducibly(sd3, out_dir):
    """Whole groups of one prompt, P different prompts while there are enough, another draw for each iteration and
    seed, the same draw again for the same ones (NaN rewards: only the rollout runs)."""
    fn = reward.WeightedReward([("broken", 1.0, nan_reward)])

    def groups(seed, it):
        args = make_args(out_dir, "--sample-steps", "2", "--group-size", "2", "--n-mc", "1", "--seed", seed,
                         "--prompts-per-step", "3")
        prompts = vgrpo.train_iteration(new_run(sd3, args, reward_fn=fn), it)[2]
        assert prompts[1::2] == prompts[::2] and len(set(prompts[::2])) == 3
        return tuple(prompts[::2])

    drawn = {(seed, it): groups(seed, it) for seed in (SEED, SEED + 1) for it in range(3)}
    assert len(set(drawn.values())) == len(drawn)
    assert groups(SEED + 1, 1) == drawn[SEED + 1, 1]


# --------------------------------------------------------------------------- around the loop


def test_checkpoint_restores_weights_optimizer_and_the_fp16_loss_scale(sd3, out_dir, tmp_path):
    args = make_args(out_dir, "--inner-steps", "2", "--micro-batch", "2")
    run = new_run(sd3, args, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))
    old_values_then_update(run, _update_batch(sd3, args, run))       # AdamW state and a used scaler
    run.scaler.update(new_scale=96.0)                                # as if fp16 overflows had lowered it
    saved = {"weights": weights(sd3.transformer), "scaler": run.scaler.state_dict(),
             "adam": copy.deepcopy(run.optimizer.state_dict())}
    # fresh pieces: other weights, an empty optimizer, a scaler at its default scale
    fresh = copy.copy(sd3)
    fresh.transformer = copy.deepcopy(sd3.transformer)
    with torch.no_grad():
        for p in fresh.transformer.parameters():
            p.add_(1.0)
    params = vgrpo.add_trainable_weights(fresh, args)
    optimizer = torch.optim.AdamW(params, lr=args.lr, eps=ADAM_EPS)
    scaler = torch.amp.GradScaler("cpu")
    other = dataclasses.replace(run, family=fresh, model=fresh.transformer, optimizer=optimizer, params=params,
                                scaler=scaler)
    assert checkpoint_round_trip(run, str(tmp_path), other) == 5
    assert scaler.get_scale() == 96.0 and scaler.state_dict() == saved["scaler"]
    assert torch.equal(weights(fresh.transformer), saved["weights"])
    state = optimizer.state_dict()["state"]
    assert state.keys() == saved["adam"]["state"].keys()
    assert all(torch.equal(state[i][k], saved["adam"]["state"][i][k]) for i in state for k in state[i])


LORA = ["--no-full-finetune", "--micro-batch", "4", "--lr", "1e-3"]


def started(out, *flags):
    """A LoRA run as `python vgrpo.py` starts it: start_run loads the model, adds the LoRA and the EMA, and reads a
    checkpoint to resume (what new_run leaves out). -> (Run, first iteration)"""
    return vgrpo.start_run(make_args(out, *LORA, *flags))


def same_optimizer_state(a, b):
    state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    return state_a.keys() == state_b.keys() and len(state_a) > 0 and all(
        state_a[i].keys() == state_b[i].keys() and all(torch.equal(state_a[i][k], state_b[i][k]) for k in state_a[i])
        for i in state_a)


def test_a_lora_run_resumes_its_weights_ema_adamw_loss_scale_and_next_iteration_exactly(tmp_path):
    """In-process, the path `--resume` takes: a LoRA checkpoint with its EMA (ema/) and fp16's loss scale read back
    by start_run into a new run, which then trains its next iteration exactly as the saved run does."""
    out = str(tmp_path / "run")
    run, start = started(out, "--ema", "0.6", "--mixed-precision", "fp16")
    assert start == 0 and run.scaler is not None
    vgrpo.train_iteration(run, 0)
    run.scaler.update(new_scale=96.0)   # as if fp16 overflows had lowered it
    path = vgrpo.save_checkpoint(run, 1)
    assert path == os.path.join(out, "checkpoint-1") and not os.path.exists(path + ".tmp")
    assert sorted(os.listdir(path)) == ["ema", "optimizer.pt", "pytorch_lora_weights.safetensors", "scaler.pt",
                                        "state.json"]
    assert os.listdir(os.path.join(path, "ema")) == ["pytorch_lora_weights.safetensors"]
    from safetensors import safe_open
    for folder in (path, os.path.join(path, "ema")):   # the rank and alpha a pipeline's load_lora_weights scales by
        with safe_open(os.path.join(folder, "pytorch_lora_weights.safetensors"), "pt") as f:
            config = json.loads(f.metadata()["lora_adapter_metadata"])
        assert (config["transformer.r"], config["transformer.lora_alpha"]) == (32, 64.0)
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    assert (state["iteration"], state["world_size"]) == (1, 1)
    assert vgrpo.Args(**state["args"]) == run.args   # what --resume checks its configuration against

    resumed, start = started(out, "--ema", "0.6", "--mixed-precision", "fp16", "--resume", path)
    assert start == 1
    # the EMA lags the weights, so weights restored from ema/ (or the EMA from the weights) would show
    assert max((p - e).abs().max().item() for p, e in zip(run.params, run.ema.shadow)) > 1e-5
    assert len(resumed.params) == len(run.params) > 0
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, run.params))
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, run.ema.shadow))
    assert len(run.optimizer.state_dict()["state"]) == len(run.params)
    assert same_optimizer_state(resumed, run)   # AdamW's step, exp_avg and exp_avg_sq of every weight
    assert resumed.scaler.get_scale() == 96.0
    vgrpo.train_iteration(run, 1)
    vgrpo.train_iteration(resumed, 1)
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, run.params))
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, run.ema.shadow))


def test_a_resume_may_change_the_precision_with_or_without_fp16s_loss_scale(tmp_path):
    """--mixed-precision is not part of what a resume must match: an fp16 checkpoint (scaler.pt) resumes in float32
    (or bf16) without a loss scaler, and a float32 one (none saved) in fp16 with a new scaler at its initial scale."""
    fp16 = str(tmp_path / "fp16")
    run, _ = started(fp16, "--mixed-precision", "fp16")
    path = vgrpo.save_checkpoint(run, 1)
    assert os.path.isfile(os.path.join(path, "scaler.pt"))
    resumed, start = started(fp16, "--resume", path)
    assert (start, resumed.scaler) == (1, None)
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, run.params))
    plain = str(tmp_path / "plain")
    run, _ = started(plain)
    resumed, start = started(plain, "--mixed-precision", "fp16", "--resume", vgrpo.save_checkpoint(run, 1))
    assert start == 1 and resumed.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale() == 65536.0
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, run.params))


def test_a_save_replaces_a_stale_or_earlier_folder_of_its_iteration_and_keep_last_prunes_the_oldest(tmp_path):
    """A save is written to checkpoint-N.tmp and renamed: a .tmp left by a save cut short, or a checkpoint-N saved
    before (a run resumed there and preempted again), must not stop it."""
    out = str(tmp_path)
    run, _ = started(out)
    os.makedirs(os.path.join(out, "checkpoint-1.tmp", "optimizer"))   # a save cut short: a folder inside
    path = vgrpo.save_checkpoint(run, 1)
    with torch.no_grad():
        run.params[0].add_(1.0)
    assert vgrpo.save_checkpoint(run, 1) == path
    assert [name for name in os.listdir(out) if name.startswith("checkpoint")] == ["checkpoint-1"]
    resumed, start = started(out, "--resume", path)
    assert start == 1 and all(torch.equal(a, b) for a, b in zip(resumed.params, run.params))   # the later save
    resumed.args = dataclasses.replace(resumed.args, keep_last=1)
    vgrpo.save_checkpoint(resumed, 2)
    assert [name for name in os.listdir(out) if name.startswith("checkpoint")] == ["checkpoint-2"]


def test_a_lora_folder_that_does_not_fit_the_model_is_refused_in_one_line(tmp_path, flux):
    """load_weights: a folder without the LoRA file (as a full fine-tuning checkpoint is) is refused with the likely
    reason; a LoRA of another model's layers (FLUX's, into SD3) leaves keys unused, and the first is named."""
    args = make_args(str(tmp_path), *LORA)
    family = vgrpo.load_family(args, CPU)
    vgrpo.add_trainable_weights(family, args)
    with pytest.raises(vgrpo.UsageError, match=r"^--resume .*: no pytorch_lora_weights.safetensors \(was it a "
                                               r"--full-finetune run\?\)$"):
        vgrpo.load_weights(str(tmp_path), family, args)
    flux_args = make_args(str(tmp_path), *LORA, "--model", "tiny-flux")
    flux_lora = copy.deepcopy(flux)
    vgrpo.add_trainable_weights(flux_lora, flux_args)
    vgrpo.write_weights(flux_lora, flux_args, {k: v for k, v in flux_lora.transformer.state_dict().items()
                                               if "lora_" in k}, str(tmp_path))
    with pytest.raises(vgrpo.UsageError, match=r"^--resume .*: LoRA does not fit this model \(\S*single_transformer"
                                               r"_blocks\S*lora_\S*, \.\.\.\)$"):
        vgrpo.load_weights(str(tmp_path), family, args)


def test_http_reward_sends_prompts_metadata_and_images_in_order():
    seen = []
    server, url = _serve("ok", seen)
    try:
        images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(4))
        prompts = ["a cat", "a dog", "a quoted \"sign\""]
        metadata = [{"tag": "animal", "n": 1}, {"tag": "animal", "include": [{"class": "dog", "count": 2}]},
                    {"text": "sign"}]
        fn = reward.load_reward(f"{url}:2")
        got = fn(images, prompts, metadata)
        pixels = [np.asarray(im) for im in reward.to_uint8_images(images)]
        assert seen[0]["prompts"] == prompts and seen[0]["metadata"] == metadata
        from PIL import Image
        sent = [np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))) for b in seen[0]["images"]]
        assert all(np.array_equal(a, b) for a, b in zip(sent, pixels)) and len(sent) == 3
        np.testing.assert_allclose(got.numpy(), [2 * p.mean() / 255 for p in pixels], rtol=1e-6)
        fn(images, prompts)                                   # without a prompt file's metadata: empty dicts
        assert seen[1]["metadata"] == [{}, {}, {}]
    finally:
        server.shutdown()


NAN_AT = '''
import torch

calls = [0]


def nan_at(images, prompts):
    calls[0] += 1
    r = images.mean((1, 2, 3)).float()
    return r * float("nan") if calls[0] in ({calls}) else r
'''


@pytest.mark.parametrize("nan_calls,finishes", [((2, 4), True), ((2, 3), False)])
def test_the_bad_step_streak_counts_consecutive_iterations_only(tmp_path, nan_calls, finishes):
    """main() in-process: NaN rewards at iterations 2 and 4 with --max-bad-steps 2 are never two in a row, so the
    run finishes; at 2 and 3 it stops with one line."""
    (tmp_path / "nan.py").write_text(NAN_AT.replace("{calls}", ", ".join(map(str, nan_calls))))
    flags = ["--iterations", "4", "--sample-steps", "2", "--n-mc", "1", "--prompts-per-step", "1", "--group-size", "2",
             "--reward", f"{tmp_path / 'nan.py'}:nan_at", "--max-bad-steps", "2", "--save-every", "100",
             "--sample-every", "100", "--output-dir", str(tmp_path / "out")]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if finishes:
            vgrpo.main(flags)
        else:
            with pytest.raises(vgrpo.FatalError, match="2 consecutive iterations with NaN/Inf"):
                vgrpo.main(flags)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        skipped = [json.loads(line)["skipped_steps"] for line in f]
    assert skipped == ([0, 1, 0, 1] if finishes else [0, 1, 1])
