"""Cost against its limit, issue 5 item 3: where a V-GRPO iteration's time goes, and how close each part
is to the cheapest thing that could do its job.

    python bench/cost.py --out /tmp/cost.md          # about two minutes
    python bench/cost.py --quick --out /tmp/cost.md  # seconds, for the test

All in one process on the tiny SD3 (vgrpo's CPU demo shape: 4 prompts x 8 images, 10 steps, N_MC = 4,
micro-batches of 16 samples x 4 pairs = 64 rows, full fine-tuning, AdamW), one torch thread. Every ratio
is measured by running the two contenders alternately, several times, and taking the median of the
per-pair ratios, so that load from other processes on the machine hits both alike.

  split     seconds of rollout (sampling + VAE decoding), reward (JPEG), old surrogate, update
  update    vgrpo.update divided by the floor: a plain flow-matching fine-tuning step (velocity MSE,
            same rows, same micro-batches, same gradient clip and AdamW step), and by a bare
            forward+backward over those rows
  rollout   vgrpo.rollout divided by diffusers' StableDiffusion3Pipeline.__call__ with the same prompt
            embeddings, starting latents, steps and batch (output_type="latent", no CFG), for Euler (the
            pipeline's own scheduler, so the latents must agree) and for DPM-Solver++ (vgrpo's default)
  memory    peak bytes of live tensors during one V-GRPO step (old surrogate + update) divided by those of
            one plain flow-matching step on the same rows, from torch.profiler's memory timeline (what torch
            allocates, without allocator caching); and the growth of the peak RSS of a fresh process over
            the same step (kernel high-water mark reset after the set-up), which includes allocator overhead
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import learning  # noqa: E402
import reward as rewards_lib  # noqa: E402
import vgrpo  # noqa: E402


def demo_args(micro_batch=16):
    """The attributes vgrpo.rollout / old_surrogate / update read, at vgrpo's tiny defaults."""
    return types.SimpleNamespace(sampler="dpmpp2m", guidance=1.0, micro_batch=micro_batch, group_size=8, inner_steps=1,
                                 n_mc=4, beta=0.0, clip_eps=0.01, max_grad_norm=1.0, pair_sharing="batch",
                                 stratified=True, weighting="adaptive")


class Bench:
    """The tiny model, an optimizer, one rollout batch with its pairs and advantages, ready to time."""

    def __init__(self, prompts=4, group_size=8, steps=10, n_mc=4, micro_batch=16):
        self.family = learning.tiny_family()
        self.model = self.family.transformer.requires_grad_(True)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=2e-3)
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
        """Old surrogate + vgrpo.update: everything a V-GRPO iteration does after the reward."""
        b = self.batch
        b["s_old"], b["x0_old"] = vgrpo.old_surrogate(self.family, self.model, b, self.args, self.P)
        vgrpo.update(self.family, self.model, self.optimizer, self.params, b, self.args, self.P)

    def update_only(self):
        b = self.batch
        if "s_old" not in b:
            b["s_old"], b["x0_old"] = vgrpo.old_surrogate(self.family, self.model, b, self.args, self.P)
        vgrpo.update(self.family, self.model, self.optimizer, self.params, b, self.args, self.P)

    def flow_matching_step(self, optimizer_step=True):
        """The floor: a plain flow-matching fine-tuning step on the same (sample, pair) rows and micro-batches,
        loss = mean (v_theta(x_sigma) - (eps - o))^2, then the same gradient clip and AdamW step."""
        b, n = self.batch, self.args.n_mc
        for _, idx in vgrpo.micro_batches(self.P, self.args.group_size, 1, self.args.micro_batch):
            o, sig, eps = b["o"][idx], b["sigmas"][idx], b["eps"][idx]
            x_t = vgrpo.noisy_latents(o, sig, eps)
            v = self.family.velocity(self.model, x_t.flatten(0, 1), sig.flatten(), vgrpo.take(self.cond, idx, n))
            loss = (v.view_as(eps).float() - (eps - o.unsqueeze(1))).pow(2).mean()
            (loss * len(idx) / len(b["o"])).backward()
        if optimizer_step:
            torch.nn.utils.clip_grad_norm_(self.params, self.args.max_grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


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


# --------------------------------------------------------------------------- the four measurements


def iteration_split(bench, repeats):
    """Median seconds of each phase of a V-GRPO iteration at the demo's shape (as vgrpo's train_iteration)."""
    phases = {"rollout": [], "reward": [], "old surrogate": [], "update": []}
    fam, b, a = bench.family, bench.batch, bench.args
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        o = vgrpo.rollout(fam, bench.model, bench.cond, bench.noise, bench.sigmas, a)
        images = learning.decode(fam, o, a.micro_batch)
        t1 = time.perf_counter()
        r = 100 * rewards_lib.jpeg_reward(images, bench.prompts)
        vgrpo.group_advantages(r, a.group_size)
        t2 = time.perf_counter()
        b["s_old"], b["x0_old"] = vgrpo.old_surrogate(fam, bench.model, b, a, bench.P)
        t3 = time.perf_counter()
        vgrpo.update(fam, bench.model, bench.optimizer, bench.params, b, a, bench.P)
        t4 = time.perf_counter()
        for k, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k].append(seconds)
    return {k: statistics.median(v[1:]) for k, v in phases.items()}  # the first round is a warm-up


def rollout_vs_pipeline(bench, repeats):
    """vgrpo.rollout / StableDiffusion3Pipeline for the same batch, one micro-batch (the pipeline takes one)."""
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
    """Peak bytes of live torch tensors while fn runs (torch.profiler memory timeline, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "timeline.json")
        import warnings

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
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
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
    bench = Bench()
    step = bench.vgrpo_step if kind == "vgrpo" else bench.flow_matching_step
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


def measure(quick=False, rss=True):
    repeats = 1 if quick else 5
    bench = Bench(prompts=1, group_size=2, steps=2, n_mc=2, micro_batch=2) if quick else Bench()
    res = {"split": iteration_split(bench, repeats)}
    res["update"] = median_ratio(bench.update_only, bench.flow_matching_step, repeats)
    res["update_bare"] = median_ratio(bench.update_only, lambda: bench.flow_matching_step(False), repeats)
    res["rollout"] = rollout_vs_pipeline(bench, repeats)
    res["memory"] = memory(bench, rss and not quick)
    res["shape"] = dict(P=bench.P, G=bench.args.group_size, S=len(bench.sigmas) - 1, n_mc=bench.args.n_mc,
                        micro_batch=bench.args.micro_batch, repeats=repeats)
    return res


def report(res):
    s, sh = res["split"], res["shape"]
    total = sum(s.values())
    lines = [f"Tiny random SD3, {sh['P']} prompts x {sh['G']} images, {sh['S']} DPM-Solver++ steps, N_MC = {sh['n_mc']}, "
             f"micro-batches of {sh['micro_batch']} samples, 1 torch thread, medians of {sh['repeats']} interleaved runs.",
             "", "Per-iteration seconds:", "", "| rollout (+ decode) | reward | old surrogate | update | total |",
             "| --- | --- | --- | --- | --- |",
             "| " + " | ".join(f"{v:.3f} ({v / total:.0%})" for v in s.values()) + f" | {total:.3f} |", "",
             "Against the limits:", "", "| measure | ours | reference | ratio | goal |", "| --- | --- | --- | --- | --- |"]
    u, ub = res["update"], res["update_bare"]
    lines.append(f"| update (vgrpo.update) / plain flow-matching step, same rows, clip + AdamW | {u[0]:.3f} s | {u[1]:.3f} s "
                 f"| {u[2]:.2f}x | <= 1.15x |")
    lines.append(f"| update / bare flow-matching forward+backward | {ub[0]:.3f} s | {ub[1]:.3f} s | {ub[2]:.2f}x | <= 1.15x |")
    for sampler in ("euler", "dpmpp2m"):
        t_ours, t_pipe, ratio = res["rollout"][sampler]
        lines.append(f"| rollout ({sampler}) / StableDiffusion3Pipeline (Euler), same batch and steps | {t_ours:.3f} s "
                     f"| {t_pipe:.3f} s | {ratio:.2f}x | <= 1.0x |")
    vg, fm = res["memory"]["profiler"]
    lines.append(f"| peak live-tensor memory, V-GRPO step / flow-matching step (torch.profiler) | {vg / 2**20:.1f} MiB "
                 f"| {fm / 2**20:.1f} MiB | {vg / fm:.2f}x | |")
    if "rss" in res["memory"]:
        vg, fm = res["memory"]["rss"]
        lines.append(f"| peak RSS growth over the step, fresh process each (VmHWM) | {vg / 2**20:.1f} MiB "
                     f"| {fm / 2**20:.1f} MiB | {vg / max(fm, 1):.2f}x | |")
    lines += ["", f"Euler rollout vs the pipeline's latents: max |difference| {res['rollout']['euler max |diff|']:.2e}.",
              "", "Seconds are from different moments of a run on a machine shared with other work, so compare "
              "seconds within one row (the two contenders ran alternately) rather than across rows or tables."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-rss", dest="rss", action="store_false", help="skip the two fresh-process RSS measurements")
    p.add_argument("--out", default=os.path.join(HERE, "results", "cost.md"))
    p.add_argument("--report-only", action="store_true", help="rewrite OUT from the measurements in OUT's .json")
    a = p.parse_args()
    torch.set_num_threads(1)
    import diffusers
    diffusers.utils.logging.set_verbosity_error()
    if a.report_only:
        with open(os.path.splitext(a.out)[0] + ".json") as f:
            res = json.load(f)
    else:
        res = measure(a.quick, a.rss)
    text = report(res)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
