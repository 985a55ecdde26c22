"""Cost against its limit (item 3 of the benchmark) and the GPU-path changes' measures, before and after: where a
V-GRPO iteration's time goes, and how close it is to the cheapest thing that could do its job.

    python bench/cost.py --out /tmp/cost.md          # ten minutes on an idle 2-core machine
    python bench/cost.py --quick --out /tmp/cost.md  # seconds, for the test

All in one process on the tiny SD3 at vgrpo's tiny defaults (the test model's: 4 prompts x 8 images, 10 DPM-Solver++
steps, N_MC = 4, sampling passes and micro-batches of 16 samples, full fine-tuning, AdamW), one torch thread.
"Before" is vgrpo.py as of commit BEFORE (read from git, imported under another module name, with its reward.py),
"after" is vgrpo.py as it is now; both build the same tiny model (one pipeline, deep-copied). Every ratio comes
from contenders run alternately, in rotating order, timed in CPU seconds of this process (what the wall clock reads
on an idle machine; the wall clock's ratio is reported beside it); a ratio is the median of the per-round ratios,
with their interquartile range as the spread.

  iteration  vgrpo's train_iteration + iteration_metrics (what the training loop does every iteration) before and
             after, divided by the floor: StableDiffusion3Pipeline.__call__ (its Euler sampler, VAE decoding) on
             the same noises and prompt embeddings, then a plain flow-matching step (velocity MSE, same rows and
             micro-batches, gradient clip, AdamW) on the pipeline's latents. Per phase: sampling, decoding,
             reward, pairs + old surrogate, update, bookkeeping (everything else: noise, prompt order,
             statistics) against the pipeline's denoising loop, its decoding and the flow-matching step
  dispatch   aten operations dispatched per sampling forward (the launch-overhead proxy): a rollout's operations
             (TorchDispatchMode) over its transformer calls, split into the transformer's own and the glue around
             it; and, with the rollout run on the meta device, its copies from host tensors to the device
  syncs      aten::_local_scalar_dense (.item(), float(t), bool(t): a host-device synchronisation on a GPU when the
             tensor lives there) per iteration, at two micro-batch sizes, and how many of them AdamW's CPU loop makes
  peft       LoRA on a bf16 base (the real models' setting): per sampling forward, the operations and time that
             peft's casting of each adapter's input to the adapters' float32 costs, against casting disabled,
             adapters cast to bf16 for sampling, and the LoRA branch off (what merged weights would cost)
  update     vgrpo.update / a plain flow-matching step, and / a bare forward+backward (item 3)
  rollout    vgrpo.rollout (Euler, DPM-Solver++) / the pipeline in one batch; Euler's latents must agree exactly
  memory     peak bytes of live tensors (torch.profiler) and peak RSS growth of a fresh process, V-GRPO step
             against a flow-matching step on the same rows
"""

import argparse
import collections
import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
import vgrpo  # noqa: E402

BEFORE = "f2eafba"  # the last commit before the GPU-path changes to vgrpo.py
CPU = torch.device("cpu")


# --------------------------------------------------------------------------- the two versions of the code


def load_before(commit=BEFORE):
    """vgrpo.py of `commit` as module vgrpo_before (with that commit's reward.py as its `reward`) -> (module, None),
    or (None, why) where the git history is not at hand (a shallow clone, an exported tree)."""
    with tempfile.TemporaryDirectory() as d:
        for name in ("reward.py", "vgrpo.py"):
            p = subprocess.run(["git", "-C", REPO, "show", f"{commit}:{name}"], capture_output=True, text=True)
            if p.returncode:
                return None, f"git show {commit}:{name} failed: {p.stderr.strip()[:200]}"
            with open(os.path.join(d, name), "w") as f:
                f.write(p.stdout)
        modules = {}
        current_reward = sys.modules["reward"]
        try:
            for name in ("reward", "vgrpo"):
                spec = importlib.util.spec_from_file_location(f"{name}_before", os.path.join(d, f"{name}.py"))
                modules[name] = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = modules[name]  # dataclasses look their module up while the class is made
                if name == "vgrpo":  # its `import reward` must find the reward.py of the same commit
                    sys.modules["reward"] = modules["reward"]
                spec.loader.exec_module(modules[name])
        finally:
            sys.modules["reward"] = current_reward
    return modules["vgrpo"], None


def quiet_pipeline(pipe):
    pipe.set_progress_bar_config(disable=True)
    for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        part.requires_grad_(False)
    return pipe


def build_run(module, pristine, shape, directory):
    """module.build_run at the tiny defaults (shape overrides them), on a deep copy of the pristine pipeline, so
    that before and after train the same model and neither pays for building one."""
    fields = {f.name for f in dataclasses.fields(module.Args)}
    args = module.Args(model="tiny", output_dir=directory, **{k: v for k, v in shape.items() if k in fields})
    module.validate(args, 1)
    os.makedirs(directory, exist_ok=True)
    builder = module.build_tiny_sd3_pipeline
    module.build_tiny_sd3_pipeline = lambda seed=0: copy.deepcopy(pristine)
    try:
        run, _ = module.build_run(args, 0, 1, CPU)
    finally:
        module.build_tiny_sd3_pipeline = builder
    return run


def iteration_inputs(run, it):
    """Prompts, noise, prompt embeddings and pairs of iteration `it`, drawn as vgrpo's train_iteration draws them."""
    a = run.args
    order = torch.randperm(len(run.prompts), generator=vgrpo.keyed_generator(a.seed, "prompts", it)).tolist()
    ids = [(j, m) for j in range(a.prompts_per_step) for m in range(a.group_size)]
    prompts = [run.prompts[order[j % len(order)]] for j, _ in ids]
    noise = torch.stack([torch.randn(run.family.latent_shape, generator=vgrpo.keyed_generator(a.seed, "noise", it, j,
                                                                                                m)) for j, m in ids])
    sig, eps = vgrpo.draw_pairs(run.sigmas, a.n_mc, run.family.latent_shape, ids, a.pair_sharing, a.stratified,
                                a.seed, it)
    return dict(prompts=prompts, noise=noise, cond=run.family.encode(prompts), sigmas=sig, eps=eps)


# --------------------------------------------------------------------------- contenders of one iteration


def clock():
    """CPU seconds of this process: with one torch thread, what the wall clock reads on an idle machine, without
    the time other processes hold the core. They still change it (shared caches, a busy sibling hyperthread), so
    contenders are alternated all the same."""
    return time.process_time()


def timing(fn, seconds, key):
    """fn, adding its CPU seconds to seconds[key] at every call."""
    def timed_fn(*args, **kwargs):
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[key] += clock() - t
    return timed_fn


class Version:
    """One version of vgrpo's iteration, timed by phase in CPU seconds: the module's rollout and the family's
    decode (both versions call it per chunk) are wrapped while it runs, and its own phase clocks (time.perf_counter
    in train_iteration) read CPU seconds instead; bookkeeping is whatever the phases do not cover (noise, prompt
    order, embeddings, statistics)."""

    def __init__(self, name, module, run):
        self.name, self.module, self.run = name, module, run
        self.cpu_time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
        self.cpu_time.perf_counter = clock

    def __call__(self, it):
        seconds, family, rollout = collections.Counter(), self.run.family, self.module.rollout
        self.module.rollout, self.module.time = timing(rollout, seconds, "sampling"), self.cpu_time
        family.decode = timing(type(family).decode.__get__(family), seconds, "decoding")
        try:
            t, wall = clock(), time.perf_counter()
            stats, images, prompts, r, A = self.module.train_iteration(self.run, it)
            self.module.iteration_metrics(self.run, it, stats, r, A)
            total, wall = clock() - t, time.perf_counter() - wall
        finally:
            self.module.rollout, self.module.time = rollout, time
            family.__dict__.pop("decode", None)
        phases = {"sampling": seconds["sampling"], "decoding": seconds["decoding"], "reward": stats["time_reward"],
                  "pairs + old surrogate": stats["time_old"], "update": stats["time_update"]}
        phases["bookkeeping"] = total - sum(phases.values())
        return dict(phases, total=total, wall=wall)


class Floor:
    """The cheapest iteration: the diffusers pipeline samples and decodes, a plain flow-matching step trains on
    the same rows and micro-batches (flow_matching_step)."""

    def __init__(self, pristine, after_run):
        self.pipe = quiet_pipeline(copy.deepcopy(pristine))
        self.model = self.pipe.transformer.requires_grad_(True)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=after_run.args.lr,  # vgrpo's, as on the CPU
                                           weight_decay=after_run.args.weight_decay)
        self.after, self.name = after_run, "floor"

    def __call__(self, it):
        a, x = self.after.args, iteration_inputs(self.after, it)
        emb, pooled = x["cond"]
        seen = {}

        def at_step_end(pipe, i, t, kw):  # the last call marks the end of the denoising loop
            seen.update(latents=kw["latents"], t=clock())
            return kw

        t0, wall = clock(), time.perf_counter()
        self.pipe(prompt_embeds=emb, pooled_prompt_embeds=pooled, latents=x["noise"], guidance_scale=1.0,
                  num_inference_steps=a.sample_steps, height=a.resolution, width=a.resolution, output_type="pt",
                  callback_on_step_end=at_step_end)
        t1 = clock()
        flow_matching_step(self.model, self.params, self.optimizer, seen["latents"], x["sigmas"], x["eps"],
                           x["cond"], a, a.prompts_per_step)
        t2, wall = clock(), time.perf_counter() - wall
        phases = {"denoising": seen["t"] - t0, "decoding": t1 - seen["t"], "flow-matching step": t2 - t1}
        return dict(phases, total=t2 - t0, wall=wall)


def spread(values):
    """(median, first quartile, third quartile) of a list."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q1, q3


def iteration_rounds(contenders, rounds, first_it=0):
    """Each contender once per round, in rotating order, after a warm-up round -> {name: [phases per round]}."""
    seconds = {c.name: [] for c in contenders}
    for i in range(rounds + 1):
        k = i % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            phases = c(first_it + i)
            if i:
                seconds[c.name].append(phases)
    return seconds


def iteration_summary(seconds):
    """Per-round ratios of each version's total (and of after's phases) to the floor's -> medians and spreads."""
    floor = seconds["floor"]
    out = {"seconds": {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                       for name, rows in seconds.items()}, "ratio": {}, "rounds": len(floor), "per_round": seconds}
    for name in seconds:
        if name != "floor":
            out["ratio"][name] = spread([r["total"] / f["total"] for r, f in zip(seconds[name], floor)])
            out["ratio"][name + " without reward"] = spread([(r["total"] - r["reward"]) / f["total"]
                                                             for r, f in zip(seconds[name], floor)])
            out["ratio"][name + " wall clock"] = spread([r["wall"] / f["wall"] for r, f in zip(seconds[name], floor)])
    if "before" in seconds:
        out["ratio"]["after / before"] = spread([a["total"] / b["total"] for a, b in zip(seconds["after"],
                                                                                         seconds["before"])])
    pairs = {"sampling / pipeline denoising": ("sampling", "denoising"), "decoding / pipeline decoding":
             ("decoding", "decoding"), "update / flow-matching step": ("update", "flow-matching step")}
    out["phase_ratio"] = {label: spread([r[mine] / f[theirs] for r, f in zip(seconds["after"], floor)])
                          for label, (mine, theirs) in pairs.items()}
    return out


# --------------------------------------------------------------------------- counting dispatched operations


class CountOps(TorchDispatchMode):
    """Counts aten operations dispatched inside the block, and apart those inside `model`'s forward; with
    devices=True also those that only touch host tensors and the copies from host tensors to another device."""

    def __init__(self, model=None, devices=False):
        super().__init__()
        self.counts, self.inside, self.forwards, self.depth = collections.Counter(), collections.Counter(), 0, 0
        self.track_devices, self.host_to_device, self.host_ops = devices, 0, 0
        self.hooks = [] if model is None else [model.register_forward_pre_hook(self._enter),
                                               model.register_forward_hook(self._leave)]

    def _enter(self, module, args):
        self.depth += 1
        self.forwards += self.depth == 1

    def _leave(self, module, args, output):
        self.depth -= 1

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] += 1
        if self.depth:
            self.inside[name] += 1
        out = func(*args, **(kwargs or {}))
        if self.track_devices:
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            devices = {t.device.type for t in inputs}, {t.device.type for t in tree_flatten(out)[0]
                                                         if isinstance(t, torch.Tensor)}
            self.host_ops += devices[0] | devices[1] == {"cpu"}
            self.host_to_device += devices[0] == {"cpu"} and bool(devices[1] - {"cpu"})
        return out


def per_forward(mode):
    total, inside = sum(mode.counts.values()), sum(mode.inside.values())
    return {"per forward": total / mode.forwards, "transformer": inside / mode.forwards,
            "glue": (total - inside) / mode.forwards, "forwards": mode.forwards}


def rollout_ops(module, run, x):
    """Operations per transformer call of module.rollout (the model's own, and the glue: solver, timestep, slicing)."""
    with torch.no_grad(), CountOps(run.family.transformer) as mode:
        module.rollout(run.family, run.family.transformer, x["cond"], x["noise"], run.sigmas, run.args, run.negative)
    return per_forward(mode)


def host_to_device_copies(module, run, x):
    """module.rollout on the meta device (shapes only, nothing computed), counting per transformer call the copies
    from host tensors to the device (on a GPU each is a synchronous copy: the host waits for the queue to drain)
    and the operations left on the host."""
    meta = torch.device("meta")
    model = copy.deepcopy(run.family.transformer).to(meta)
    cond, noise = tuple(t.to(meta) for t in x["cond"]), x["noise"].to(meta)
    with torch.no_grad(), CountOps(model, devices=True) as mode:
        module.rollout(run.family, model, cond, noise, run.sigmas, run.args, None)
    return {"host to device": mode.host_to_device / mode.forwards, "host ops": mode.host_ops / mode.forwards}


def pipeline_ops(floor, x, a):
    emb, pooled = x["cond"]
    with CountOps(floor.model) as mode:
        floor.pipe(prompt_embeds=emb, pooled_prompt_embeds=pooled, latents=x["noise"], guidance_scale=1.0,
                   num_inference_steps=a.sample_steps, height=a.resolution, width=a.resolution, output_type="latent")
    return per_forward(mode)


def host_syncs(version, micro_batches, it):
    """aten::_local_scalar_dense per iteration (train_iteration + iteration_metrics) at each micro-batch size ->
    {size: (all, those inside AdamW's step)}: the CPU's for-loop AdamW reads each parameter's step count with
    .item(); fused AdamW (vgrpo's on CUDA) does not."""
    out, args, optimizer = {}, version.run.args, version.run.optimizer
    default = args.micro_batch
    try:
        for mb in micro_batches:
            args.micro_batch = mb
            with CountOps() as mode:
                optimizer.step = counted_apart(type(optimizer).step.__get__(optimizer), mode)
                stats, _, _, r, A = version.module.train_iteration(version.run, it)
                version.module.iteration_metrics(version.run, it, stats, r, A)
            out[mb] = (mode.counts["aten._local_scalar_dense"], mode.inside["aten._local_scalar_dense"])
    finally:
        args.micro_batch = default
        optimizer.__dict__.pop("step", None)
    return out


def counted_apart(fn, mode):
    """fn, whose operations `mode` also counts apart (as if inside a model)."""
    def apart(*args, **kwargs):
        mode.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            mode.depth -= 1
    return apart


# --------------------------------------------------------------------------- peft's input casting (item 5)


@contextlib.contextmanager
def adapters_as(params, dtype):
    """The trained (float32) adapter weights cast to `dtype` for a sampling pass, and restored after: AdamW keeps
    its float32 weights, the pass reads low-precision copies made once."""
    kept = [p.data for p in params]
    for p in params:
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, data in zip(params, kept):
            p.data = data


def lora_bf16_family(pristine):
    """The tiny SD3 as vgrpo loads a real model: bf16 base weights, float32 LoRA (rank 32) on the attention. B is
    drawn at random as after some training: at its initial 0 every variant would agree trivially."""
    pipe = quiet_pipeline(copy.deepcopy(pristine))
    pipe.transformer.to(torch.bfloat16).requires_grad_(False)
    family = vgrpo.SD3Family(pipe, 32, 8, CPU, amp_dtype=torch.bfloat16)
    lora = types.SimpleNamespace(full_finetune=False, lora_rank=32, lora_alpha=64.0, seed=0)
    params = vgrpo.add_trainable_weights(family, lora)
    for layer in lora_layers(family.transformer):  # peft's default, which vgrpo switches off: the reference here
        layer.cast_input_dtype_enabled = True
    generator = torch.Generator().manual_seed(0)
    for name, p in family.transformer.named_parameters():
        if "lora_B" in name:
            p.data = 0.02 * torch.randn(p.shape, generator=generator)
    return family, params


def peft_variants(family, params):
    from peft.helpers import disable_input_dtype_casting

    model = family.transformer
    return {"peft's default input cast": contextlib.nullcontext, "input casting disabled (vgrpo's setting)":
            lambda: disable_input_dtype_casting(model), "adapters cast to bf16 for sampling":
            lambda: adapters_as(params, torch.bfloat16), "LoRA branch off (what merged weights cost)":
            lambda: adapters_off(model)}


@contextlib.contextmanager
def adapters_off(model):
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def peft_casting(pristine, x, rows, rounds, forwards):
    """Per sampling forward on `rows` samples: operations, casts, seconds and output difference of each variant."""
    family, params = lora_bf16_family(pristine)
    model, variants = family.transformer, peft_variants(family, params)
    noise, sigma = x["noise"][:rows], torch.tensor(0.7)
    cond = vgrpo.rows_of(x["cond"], slice(0, rows))
    fires = []
    hooks = [m.register_forward_pre_hook(lambda m, a: fires.append(a[0].dtype != torch.float32))
             for m in lora_layers(model)]
    with torch.no_grad():
        family.velocity(model, noise, sigma, cond)
    for h in hooks:
        h.remove()
    out = {"lora layers": len(fires), "casts": sum(fires), "rows": rows, "variants": {}}
    with torch.no_grad():
        reference = family.velocity(model, noise, sigma, cond)
        for name, variant in variants.items():
            with variant(), CountOps() as mode:
                v = family.velocity(model, noise, sigma, cond)
            out["variants"][name] = {"ops": sum(mode.counts.values()), "casts": mode.counts["aten._to_copy"],
                                     "max |diff|": (v - reference).abs().max().item()}
        seconds = {name: [] for name in variants}
        for i in range(rounds + 1):
            names = list(variants)[i % len(variants):] + list(variants)[:i % len(variants)]
            for name in names:
                with variants[name]():
                    t = clock()
                    for _ in range(forwards):
                        family.velocity(model, noise, sigma, cond)
                    if i:
                        seconds[name].append((clock() - t) / forwards)
    now = seconds["peft's default input cast"]
    for name, s in seconds.items():
        out["variants"][name].update(seconds=statistics.median(s), ratio=spread([a / b for a, b in zip(s, now)]))
    out["training gradients identical"] = training_gradients_identical(family, params, noise, sigma, cond)
    t = clock()  # what casting the adapters costs once per rollout
    [p.detach().to(torch.bfloat16) for p in params]
    out["adapter cast seconds"] = clock() - t
    return out


def training_gradients_identical(family, params, noise, sigma, cond):
    """Does disabling peft's input cast change a training pass? (Under autocast the adapters' matmuls run in bf16
    either way: the cast to float32 is undone by autocast's cast back.)"""
    from peft.helpers import disable_input_dtype_casting

    grads = []
    for context in (contextlib.nullcontext(), disable_input_dtype_casting(family.transformer)):
        with context:
            family.velocity(family.transformer, noise, sigma, cond).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    return all(torch.equal(a, b) for a, b in zip(*grads))


# --------------------------------------------------------------------------- item 3: update, rollout, memory


def flow_matching_step(model, params, optimizer, o, sigmas, eps, cond, args, n_prompts, optimizer_step=True):
    """A plain flow-matching fine-tuning step on V-GRPO's (sample, pair) rows and micro-batches: per row
    x_sigma = (1 - sigma) o + sigma eps and loss = mean (v_theta(x_sigma) - (eps - o))^2; then (optimizer_step)
    the same gradient clip and AdamW step."""
    B, n = len(o), sigmas.shape[1]
    for _, idx in vgrpo.micro_batches(n_prompts, args.group_size, 1, args.micro_batch):
        s = sigmas[idx].view(-1, n, *[1] * (o.dim() - 1))                          # (b, N, 1, 1, 1)
        x_t = (1 - s) * o[idx].unsqueeze(1) + s * eps[idx]                         # (b, N, C, h, w)
        rows = [t[idx].repeat_interleave(n, 0) for t in cond]
        v = model(hidden_states=x_t.flatten(0, 1), timestep=sigmas[idx].flatten() * 1000,
                  encoder_hidden_states=rows[0], pooled_projections=rows[1], return_dict=False)[0]
        loss = (v.view_as(eps[idx]) - (eps[idx] - o[idx].unsqueeze(1))).pow(2).mean()
        (loss * len(idx) / B).backward()
    if optimizer_step:
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def demo_args(micro_batch=16):
    """The attributes vgrpo.rollout / update read, at vgrpo's tiny defaults."""
    return types.SimpleNamespace(sampler="dpmpp2m", guidance=1.0, micro_batch=micro_batch, sample_batch=micro_batch,
                                 group_size=8, inner_steps=1, n_mc=4, beta=0.0, clip_eps=0.01, max_grad_norm=1.0,
                                 pair_sharing="batch", stratified=True, weighting="adaptive")


class Bench:
    """The tiny model, an optimizer, one rollout batch with its pairs and advantages, ready to time."""

    def __init__(self, pristine, prompts=4, group_size=8, steps=10, n_mc=4, micro_batch=16):
        self.family = vgrpo.SD3Family(quiet_pipeline(copy.deepcopy(pristine)), 32, 8, CPU)
        self.model = self.family.transformer.requires_grad_(True)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=2e-3, weight_decay=0.0)  # vgrpo's tiny defaults
        self.args = demo_args(micro_batch)
        self.args.group_size, self.args.n_mc = group_size, n_mc
        self.P, self.sigmas = prompts, self.family.sigma_grid(steps)
        ids = [(j, m) for j in range(prompts) for m in range(group_size)]
        names = [vgrpo.DEFAULT_PROMPTS[j] for j, _ in ids]
        self.prompts, self.cond = names, self.family.encode(names)
        self.noise = torch.randn(len(ids), *self.family.latent_shape, generator=torch.Generator().manual_seed(0))
        o = vgrpo.rollout(self.family, self.model, self.cond, self.noise, self.sigmas, self.args)
        sig, eps = vgrpo.draw_pairs(self.sigmas, self.args.n_mc, self.family.latent_shape, ids, "batch", True, 0, 0)
        A = vgrpo.group_advantages(torch.randn(len(ids), generator=torch.Generator().manual_seed(1)), group_size)
        self.batch = {"o": o, "cond": self.cond, "A": A, "sigmas": sig, "eps": eps}

    def vgrpo_step(self):
        """Everything a V-GRPO iteration does after the reward: with one inner step, vgrpo.update alone (its first
        forward supplies the old surrogate)."""
        vgrpo.update(self.family, self.model, self.optimizer, self.params, self.batch, self.args, self.P)

    def flow_matching_step(self, optimizer_step=True):
        b = self.batch
        flow_matching_step(self.model, self.params, self.optimizer, b["o"], b["sigmas"], b["eps"], self.cond,
                           self.args, self.P, optimizer_step)


def timed(fn):
    t = clock()
    fn()
    return clock() - t


def median_ratio(fn_a, fn_b, repeats):
    """Run a and b alternately (order flipped each round) `repeats` times after a warm-up of each ->
    (median seconds of a, median of b, median of the per-round ratios a / b)."""
    fn_a(), fn_b()
    ta, tb = [], []
    for i in range(repeats):
        if i % 2:
            tb.append(timed(fn_b)), ta.append(timed(fn_a))
        else:
            ta.append(timed(fn_a)), tb.append(timed(fn_b))
    return statistics.median(ta), statistics.median(tb), statistics.median(a / b for a, b in zip(ta, tb))


def rollout_vs_pipeline(bench, repeats):
    """vgrpo.rollout / StableDiffusion3Pipeline for the same batch, in one pass (the pipeline takes one)."""
    fam, B, S = bench.family, len(bench.noise), len(bench.sigmas) - 1
    pipe = fam.pipe
    emb, pooled = bench.cond

    def pipeline():
        return pipe(prompt_embeds=emb, pooled_prompt_embeds=pooled, latents=bench.noise.clone(), num_inference_steps=S,
                    guidance_scale=1.0, height=32, width=32, output_type="latent", return_dict=False)[0]

    def ours(sampler):
        a = demo_args(micro_batch=B)
        a.sampler = sampler
        return vgrpo.rollout(fam, bench.model, bench.cond, bench.noise, bench.sigmas, a)

    out = {}
    with torch.no_grad():
        for sampler in ("euler", "dpmpp2m"):
            out[sampler] = median_ratio(lambda: ours(sampler), pipeline, repeats)
        out["euler max |diff|"] = (ours("euler") - pipeline()).abs().max().item()
    return out


def profiler_peak_bytes(fn):
    """Peak bytes of live torch tensors while fn runs, above those live when it starts (the weights, AdamW's states:
    what the step itself adds; torch.profiler memory timeline, CPU)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "timeline.json")
        with warnings.catch_warnings():  # deprecated for CUDA in favour of memory snapshots, still the CPU tool
            warnings.simplefilter("ignore")
            prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            times, sizes = json.load(f)
    total = [sum(s) for s in sizes]
    return max(total) - total[0]


def rss_growth(kind):
    """In a fresh process: peak RSS growth (bytes) over one step of `kind` (vgrpo or flow_matching), after
    the set-up (model, rollout, a warm-up step of the same kind, so both start from the same state)."""
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import cost; print(cost._rss_child({kind!r}))")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return int(p.stdout.strip().splitlines()[-1])


def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _rss_child(kind):
    """Peak RSS growth over one step: freed heap pages are handed back to the OS (malloc_trim) and the
    kernel's high-water mark is reset (clear_refs 5) after the set-up, so the set-up's own peak and the
    allocator's cache do not hide the step's allocations."""
    import ctypes

    torch.set_num_threads(1)
    bench = Bench(vgrpo.build_tiny_sd3_pipeline(0))
    step = bench.vgrpo_step if kind == "vgrpo" else bench.flow_matching_step
    step()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) * 1024


def memory(bench, rss):
    bench.flow_matching_step(), bench.vgrpo_step()  # optimizer state exists before either is measured
    out = {"profiler": (profiler_peak_bytes(bench.vgrpo_step), profiler_peak_bytes(bench.flow_matching_step))}
    if rss:  # the two fresh processes run side by side: RSS is per process, and importing torch is slow
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            out["rss"] = tuple(pool.map(rss_growth, ("vgrpo", "flow_matching")))
    return out


# --------------------------------------------------------------------------- the report

QUICK_SHAPE = dict(prompts_per_step=1, group_size=2, sample_steps=2, n_mc=2, micro_batch=2, sample_batch=2)


def before_after(pristine, quick, rounds, directory):
    """Before and after against the floor, interleaved; operations per sampling forward; host syncs; peft."""
    shape = QUICK_SHAPE if quick else {}
    before, why = load_before()
    after_run = build_run(vgrpo, pristine, shape, os.path.join(directory, "after"))
    versions = [Version("after", vgrpo, after_run)]
    if before is not None:
        versions.insert(0, Version("before", before, build_run(before, pristine, shape, os.path.join(directory, "b"))))
    floor = Floor(pristine, after_run)
    a = after_run.args
    res = {"before": BEFORE if before is not None else f"not measured: {why}",
           "iteration": iteration_summary(iteration_rounds(versions + [floor], rounds))}
    x = iteration_inputs(after_run, 10_000)
    res["dispatch"] = {v.name: dict(rollout_ops(v.module, v.run, x), **host_to_device_copies(v.module, v.run, x))
                       for v in versions}
    res["dispatch"]["pipeline"] = pipeline_ops(floor, x, a)
    sizes = (a.micro_batch, max(1, a.micro_batch // 4))
    res["syncs"] = {v.name: host_syncs(v, sizes, 20_000) for v in versions}
    res["peft"] = peft_casting(pristine, x, a.sample_batch, rounds, forwards=1 if quick else 5)
    res["iteration_shape"] = dict(P=a.prompts_per_step, G=a.group_size, S=a.sample_steps, n_mc=a.n_mc,
                                  micro_batch=a.micro_batch, sample_batch=a.sample_batch, rounds=rounds)
    return res


def measure(quick=False, rss=True, rounds=None):
    """Every measurement -> a JSON-able dict (report() turns it into cost.md). rounds: interleaved rounds of the
    iteration and peft timings (default 1 quick, 25 full)."""
    repeats = 1 if quick else 5
    pristine = quiet_pipeline(vgrpo.build_tiny_sd3_pipeline(0))
    with tempfile.TemporaryDirectory() as d:
        res = before_after(pristine, quick, rounds or (1 if quick else 25), d)
    bench = Bench(pristine, prompts=1, group_size=2, steps=2, n_mc=2, micro_batch=2) if quick else Bench(pristine)
    res["update"] = median_ratio(bench.vgrpo_step, bench.flow_matching_step, repeats)
    res["update_bare"] = median_ratio(bench.vgrpo_step, lambda: bench.flow_matching_step(False), repeats)
    res["rollout"] = rollout_vs_pipeline(bench, repeats)
    res["memory"] = memory(bench, rss and not quick)
    res["shape"] = dict(P=bench.P, G=bench.args.group_size, S=len(bench.sigmas) - 1, n_mc=bench.args.n_mc,
                        micro_batch=bench.args.micro_batch, repeats=repeats)
    return res


def cell(ratio):
    """(median, q1, q3) -> '1.02x [1.00-1.04]'."""
    return f"{ratio[0]:.3f}x [{ratio[1]:.3f}-{ratio[2]:.3f}]"


def before_after_lines(res):
    it, sh = res["iteration"], res["iteration_shape"]
    sec, r, names = it["seconds"], it["ratio"], [n for n in ("before", "after") if n in it["seconds"]]
    lines = [f"Issue 10: vgrpo.py before ({res['before']}) and after, tiny SD3 at vgrpo's tiny defaults ({sh['P']} "
             f"prompts x {sh['G']} images, {sh['S']} steps, N_MC = {sh['n_mc']}, micro-batches of {sh['micro_batch']}"
             f", sampling passes of {sh['sample_batch']}), 1 torch thread, CPU seconds; medians of {it['rounds']} "
             "interleaved rounds, [interquartile range] of the per-round ratios.", "",
             "| measure | " + " | ".join(names) + " | reference | goal |", "| --- |" + " --- |" * (len(names) + 2)]
    lines.append("| iteration / (pipeline rollout + flow-matching step) | " + " | ".join(cell(r[n]) for n in names)
                 + f" | {sec['floor']['total']:.3f} s | <= 1.03x |")
    lines.append("| the same, the reward's seconds left out | " + " | ".join(cell(r[n + ' without reward'])
                                                                        for n in names) + " | | |")
    lines.append("| the same, wall-clock seconds | " + " | ".join(cell(r[n + ' wall clock']) for n in names)
                 + " | | |")
    lines.append("| iteration seconds | " + " | ".join(f"{sec[n]['total']:.3f}" for n in names)
                 + f" | {sec['floor']['total']:.3f} | |")
    d = res["dispatch"]
    lines.append("| aten ops per sampling forward (transformer + glue) | " + " | ".join(
        f"{d[n]['per forward']:.1f} ({d[n]['transformer']:.0f} + {d[n]['glue']:.1f})" for n in names)
        + f" | pipeline {d['pipeline']['per forward']:.1f} ({d['pipeline']['transformer']:.0f} + "
        f"{d['pipeline']['glue']:.1f}) | |")
    lines.append("| host-to-device copies per sampling forward (the rollout on the meta device) | " + " | ".join(
        f"{d[n]['host to device']:.2f}" for n in names) + " | | |")
    sizes, syncs = list(res["syncs"]["after"]), res["syncs"]
    lines.append(f"| `.item()` (aten::_local_scalar_dense) per iteration, micro-batch {' / '.join(map(str, sizes))}"
                 " (of which AdamW's own) | " + " | ".join(" / ".join(f"{syncs[n][k][0]} ({syncs[n][k][1]})"
                                                                   for k in sizes) for n in names)
                 + " | | independent of micro-batches |")
    if "after / before" in r:
        lines += ["", f"after / before, whole iteration: {cell(r['after / before'])}."]
    lines += ["", "Median CPU seconds per phase (the floor's phases on the right):", "",
              "| phase | " + " | ".join(names) + " | floor |", "| --- |" + " --- |" * (len(names) + 1)]
    floor_of = {"sampling": "denoising", "decoding": "decoding", "update": "flow-matching step", "total": "total"}
    for phase in [k for k in sec["after"] if k != "wall"]:
        theirs = floor_of.get(phase)
        lines.append(f"| {phase} | " + " | ".join(f"{sec[n][phase]:.3f}" for n in names)
                     + (f" | {sec['floor'][theirs]:.3f} ({theirs}) |" if theirs else " | |"))
    lines += ["", "After's phases against the floor's: " + "; ".join(f"{k} {cell(v)}"
                                                                    for k, v in it["phase_ratio"].items()) + "."]
    return lines


def peft_lines(p):
    lines = [f"LoRA (rank 32, float32) on a bf16 base under bf16 autocast, one sampling forward of {p['rows']} "
             f"samples: peft casts a bf16 input to float32 at {p['casts']} of the {p['lora layers']} LoRA layers per "
             "forward (autocast casts it back to bf16 for the adapter's matmul).", "",
             "| sampling forward | aten ops | casts (aten._to_copy) | seconds | / peft's default | max abs difference |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, v in p["variants"].items():
        lines.append(f"| {name} | {v['ops']} | {v['casts']} | {v['seconds']:.4f} | {cell(v['ratio'])} "
                     f"| {v['max |diff|']:.1e} |")
    lines += ["", f"Training forward+backward with input casting disabled gives identical adapter gradients: "
                  f"{'yes' if p['training gradients identical'] else 'no'}. Casting every adapter weight to bf16 "
                  f"once (per rollout): {p['adapter cast seconds'] * 1e3:.2f} ms."]
    return lines


def against_floor_lines(res):
    sh = res["shape"]
    lines = [f"Issue 5: tiny random SD3, {sh['P']} prompts x {sh['G']} images, {sh['S']} steps, N_MC = {sh['n_mc']}, "
             f"micro-batches of {sh['micro_batch']} samples, CPU seconds, medians of {sh['repeats']} interleaved runs.",
             "",
             "| measure | ours | reference | ratio | goal |", "| --- | --- | --- | --- | --- |"]
    u, ub = res["update"], res["update_bare"]
    lines.append(f"| update (vgrpo.update) / plain flow-matching step, same rows, clip + AdamW | {u[0]:.3f} s "
                 f"| {u[1]:.3f} s | {u[2]:.2f}x | <= 1.15x |")
    lines.append(f"| update / bare flow-matching forward+backward | {ub[0]:.3f} s | {ub[1]:.3f} s | {ub[2]:.2f}x "
                 "| <= 1.15x |")
    for sampler in ("euler", "dpmpp2m"):
        t_ours, t_pipe, ratio = res["rollout"][sampler]
        lines.append(f"| rollout ({sampler}) / StableDiffusion3Pipeline (Euler), same batch in one pass "
                     f"| {t_ours:.3f} s | {t_pipe:.3f} s | {ratio:.2f}x | <= 1.0x |")
    vg, fm = res["memory"]["profiler"]
    lines.append("| peak live-tensor memory above the step's start, V-GRPO step / flow-matching step (torch.profiler) "
                 f"| {vg / 2**20:.1f} MiB | {fm / 2**20:.1f} MiB | {vg / fm:.2f}x | |")
    if "rss" in res["memory"]:
        vg, fm = res["memory"]["rss"]
        lines.append(f"| peak RSS growth over the step, fresh process each (VmHWM) | {vg / 2**20:.1f} MiB "
                     f"| {fm / 2**20:.1f} MiB | {vg / max(fm, 1):.2f}x | |")
    diff = res["rollout"]["euler max |diff|"]
    lines += ["", f"Euler rollout vs the pipeline's latents: max |difference| {diff:.2e}."]
    return lines


def report(res):
    lines = before_after_lines(res) + [""] + peft_lines(res["peft"]) + [""] + against_floor_lines(res)
    lines += ["", "Seconds are CPU seconds of the one process (one torch thread), from different moments of a run on "
              "a machine shared with other work: compare seconds within one row (the contenders ran alternately) "
              "rather than across rows or tables."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the iteration and peft timings")
    p.add_argument("--no-rss", dest="rss", action="store_false", help="skip the two fresh-process RSS measurements")
    p.add_argument("--out", default=os.path.join(HERE, "results", "cost.md"))
    p.add_argument("--report-only", action="store_true", help="rewrite OUT from the measurements in OUT's .json")
    a = p.parse_args()
    torch.set_num_threads(1)
    vgrpo.quiet_libraries()
    if a.report_only:
        with open(os.path.splitext(a.out)[0] + ".json") as f:
            res = json.load(f)
    else:
        res = measure(a.quick, a.rss, a.rounds)
    text = report(res)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
