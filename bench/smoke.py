"""GPU smoke run: one whole V-GRPO iteration of every configuration at the real shapes, random weights, one GPU.

    python bench/smoke.py                          # every configuration, each in its own process: results/smoke-gpu.md
    python bench/smoke.py --only sd3-lora,flux-lora --timeout 120
    python bench/smoke.py --quick --out /tmp/s.md  # the same code on the CPU at tiny shapes (test_bench.py)

Each configuration is a recipe's command (`--model sd3 --reward pickscore`, `--model flux --reward hpsv2`, LoRA or
--full-finetune, --fsdp as torchrun's one process) with the batch cut to one prompt group so that it runs in seconds;
the shapes of a row are the recipe's (resolution, text tokens, N_MC, ODE steps, inner steps). vgrpo builds the run as a
user's is built (parse_args, validate, start_run: the family, LoRA or full fine-tuning, DDP or FSDP2, AdamW, the
reward, the prompt store), except that no weights are read: vgrpo.load_pipeline is given a pipeline of random
weights made on the GPU, the transformer and VAE at the published configurations (bench/memory.py's), text encoders
at the real widths with two layers (so their outputs have the real shapes), and the reward is a random ViT-H/14
CLIP read as PickScore or HPSv2.1. Then vgrpo.train_iteration runs once: rollout, VAE decode, reward, advantages,
pairs, the old surrogate (FLUX's 4 inner steps) and the update. SD3.5-M's configurations then evaluate (4 held-out
prompts x 2 images: a batch the rollout did not have, without gradients), as --eval-every does; SD3.5-M's blocks have
the most compiled variants. The digits demo runs as `python vgrpo.py` on CUDA.

Checked for each, in its own process (a CUDA error poisons the process's context): the update's first forward and
the old-surrogate pass give the same surrogate (the ratio at the first inner step, exp(s_update - s_old) on the first
micro-batch, measured against an old pass over all minibatches made just before the update: exactly 1 when both
see the same numerics), a finite loss and gradient norm, no skipped step, and the peak memory. Any failure exits
non-zero naming the configuration, after the report of all of them is written. Each configuration prints a progress
line every --heartbeat seconds (its time so far, the vgrpo function running, what torch.compile has compiled and
in how long): one that times out is reported with its last such line, so the report says where its time went, and
the last 20 lines of a failed configuration's output are printed (bench/device.sh keeps them in device.log).
"""

import argparse
import datetime
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from report_files import read_runs, write_whole  # noqa: E402

# the recipe's command of each configuration, then the cut: one prompt group (FLUX: 8 images, 2 per inner step);
# in this order, in case --budget runs out: FLUX.1-dev first (its recipe is the one that crashed on an H200), the
# digits demo last (it ran on an H200 already)
CONFIGS = {
    "flux-lora": ["--model", "flux", "--reward", "hpsv2", "--prompts-per-step", "1", "--group-size", "8"],
    "sd3-lora": ["--model", "sd3", "--reward", "pickscore", "--prompts-per-step", "1", "--group-size", "4"],
    "flux-lora-fsdp": ["--model", "flux", "--reward", "hpsv2", "--prompts-per-step", "1", "--group-size", "8",
                       "--fsdp"],
    "sd3-full": ["--model", "sd3", "--reward", "pickscore", "--prompts-per-step", "1", "--group-size", "4",
                 "--full-finetune"],
    "digits": ["--model", "digits"],
}
# --quick: tiny transformers (bench/gpu.py's) in float32 at 64 px with 4 ODE steps and 8 text tokens
QUICK = ["--mixed-precision", "no", "--resolution", "64", "--sample-steps", "4", "--max-sequence-length", "8"]
PROMPTS = ["a red apple on a wooden table", "a lighthouse at sunset", "two cats on a sofa", "a bowl of ramen"]
HELD_OUT = ["a blue bicycle by a canal", "a snowy mountain village", "an owl on a branch", "a cup of green tea"]


# --------------------------------------------------------------------------- random weights at the real shapes


def text_widths(kind, config):
    """The text encoders' widths the transformer reads: SD3 concatenates CLIP-L and CLIP-G (pooled: their sum) and
    pads them to T5's width; FLUX pools CLIP-L and attends over T5."""
    pooled, joint = config["pooled_projection_dim"], config["joint_attention_dim"]
    return ((768, 1280) if pooled == 2048 else (pooled // 2, pooled // 2), joint) if kind == "sd3" else \
        ((pooled,), joint)


def random_pipeline(kind, dtype, device, quick):
    """A StableDiffusion3Pipeline / FluxPipeline with random weights: the transformer and VAE built on `device`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    import gpu
    from tests import hub_standins as standins

    import memory

    cls_name, config, quick_config, _ = gpu.MODELS[kind]
    scheduler = memory.SCHEDULERS[kind]
    config = quick_config if quick else config
    transformer = gpu.build_transformer(cls_name, config, device, dtype)
    vae = gpu.build_vae(kind, quick, device, dtype)
    clip_widths, t5_width = text_widths(kind, config)
    clips = [standins.clip_text_encoder(0, f"{kind}/clip{i}", w, kind == "sd3") for i, w in enumerate(clip_widths)]
    t5_tokenizer = standins.t5_tokenizer()
    t5 = standins.t5_encoder(0, f"{kind}/t5", t5_width, len(t5_tokenizer))
    common = dict(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
                  text_encoder=clips[0].to(dtype), tokenizer=standins.clip_tokenizer())
    if kind == "sd3":
        return StableDiffusion3Pipeline(**common, text_encoder_2=clips[1].to(dtype),
                                        tokenizer_2=standins.clip_tokenizer(), text_encoder_3=t5.to(dtype),
                                        tokenizer_3=t5_tokenizer)
    return FluxPipeline(**common, text_encoder_2=t5.to(dtype), tokenizer_2=t5_tokenizer)


def random_clip_reward(quick, use_logit_scale, divide_by):
    """A loader in reward.REWARDS' form: a random CLIP ViT-H/14 (PickScore's and HPSv2.1's architecture) made on the
    device, read as reward.py reads the real one."""

    def load(device, dtype=None):
        import torch
        from transformers import CLIPConfig, CLIPModel

        import memory
        import reward
        from tests import hub_standins as standins

        config = standins.clip_config(32, 32, "gelu") if quick else CLIPConfig(
            text_config=memory.VIT_H14["text"], vision_config=memory.VIT_H14["vision"],
            projection_dim=memory.VIT_H14["projection_dim"])
        with torch.device(device):
            torch.manual_seed(0)
            model = CLIPModel(config).eval()
        return reward.clip_similarity_reward(model.to(device), standins.clip_processor(), device, use_logit_scale,
                                             divide_by, dtype)

    return load


# --------------------------------------------------------------------------- one configuration, in its own process


def run_config(name, quick, out_dir):
    """One iteration of configuration `name` through vgrpo's own functions -> what the report shows."""
    import torch

    import reward
    import vgrpo

    device = "cpu" if quick else "cuda"
    prompts, held_out_prompts = os.path.join(out_dir, "prompts.txt"), os.path.join(out_dir, "held_out.txt")
    for path, lines in ((prompts, PROMPTS), (held_out_prompts, HELD_OUT)):
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    vgrpo.load_pipeline = lambda _name, kind, dtype: random_pipeline(kind, dtype, device, quick)
    reward.REWARDS.update(pickscore=random_clip_reward(quick, True, 26.0), hpsv2=random_clip_reward(quick, False, 1.0))
    vgrpo.quiet_libraries()
    track_phases()
    evaluation = ["--eval-prompts", held_out_prompts, "--eval-every", "1", "--eval-images", "2"] \
        if name.startswith("sd3") else []
    args = vgrpo.parse_args([*CONFIGS[name], *(QUICK if quick else []), "--device", device, "--prompts", prompts,
                             "--iterations", "1", *evaluation, "--output-dir", out_dir])
    world = int(os.environ.get("WORLD_SIZE", 1))
    vgrpo.validate(args, world)
    started = time.perf_counter()
    run, start = vgrpo.start_run(args)
    built = time.perf_counter() - started
    first = {}
    vgrpo.update = first_step_check(vgrpo.update, first)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    vgrpo.use_stage(run, start)
    stats, images, prompts_, r, A = vgrpo.train_iteration(run, start)
    m = vgrpo.iteration_metrics(run, start, stats, r, A)
    held_out = None
    if args.eval_every:   # the held-out reward's mean, as eval.jsonl has it
        vgrpo.log_evaluation(run, start + 1)
        with open(os.path.join(out_dir, "eval.jsonl")) as f:
            held_out = json.loads(f.readline())[f"eval_{args.reward}"]
    return dict(name=name, flags=" ".join(CONFIGS[name]), resolution=args.resolution, steps=args.sample_steps,
                n_mc=args.n_mc, inner_steps=args.inner_steps, micro_batch=args.micro_batch, images=len(images),
                image_tokens=run.family.image_tokens, build_s=built, iteration_s=m["time_total"],
                phases={k: m[f"time_{k}"] for k in ("rollout", "reward", "old", "update")},
                policy_loss=m["policy_loss"], grad_norm=m["grad_norm"], skipped_steps=m["skipped_steps"],
                ratio_min=m["ratio_min"], ratio_max=m["ratio_max"], first_step_ratio=first.get("ratio"),
                peak_gib=m.get("peak_memory_gib"), device=str(run.device), held_out_reward=held_out,
                gpu=torch.cuda.get_device_name() if device == "cuda" else None, compiled=run.family.compiled,
                # frames compiled in the whole run (the evaluation's included) and torch's seconds compiling them
                compiled_graphs=vgrpo.compiled_graphs() if run.family.compiled else None,
                compile_s=vgrpo.compile_seconds() if run.family.compiled else None)


PHASE = {"now": ""}   # the child's phase of vgrpo's, nested with " > " (track_phases), for the heartbeat


def heartbeat(name, every):
    """Print every `every` s how long this configuration has run, the vgrpo function it is in and what torch.compile
    has compiled so far: the last such line of a configuration that timed out says where its time went."""
    started = time.perf_counter()

    def beat():
        while True:
            time.sleep(every)
            vgrpo = sys.modules.get("vgrpo")   # once imported (its functions defined) and torch.compile loaded
            try:   # torch's counters change while it compiles: a line without them rather than no more lines
                loaded = hasattr(vgrpo, "compile_seconds") and "torch._dynamo.utils" in sys.modules
                frames = vgrpo.compiled_graphs() if loaded else 0
                compiled = f"; compiled {frames} frames in {vgrpo.compile_seconds() or 0:.0f} s" if frames else ""
            except Exception:   # noqa: BLE001
                compiled = ""
            print(f"[{name}] {time.perf_counter() - started:.0f} s: {PHASE['now'] or 'starting'}{compiled}",
                  flush=True)

    threading.Thread(target=beat, daemon=True).start()


def track_phases():
    """vgrpo's phases wrapped in place, so that PHASE["now"] names the one running (the evaluation's rollout is
    "evaluate > rollout")."""
    import vgrpo

    for name in ("start_run", "rollout", "decode", "score", "old_surrogate", "update", "evaluate"):
        def tracked(*args, _real=getattr(vgrpo, name), _name=name, **kwargs):
            outer = PHASE["now"]
            PHASE["now"] = f"{outer} > {_name}" if outer else _name
            try:
                return _real(*args, **kwargs)
            finally:
                PHASE["now"] = outer

        setattr(vgrpo, name, tracked)


def first_step_check(real_update, record):
    """vgrpo.update, preceded by an old-surrogate pass over every minibatch with the same weights; the update's first
    forward (its first micro-batch) is compared with it: record["ratio"] = the largest |exp(s_update - s_old) - 1|
    there."""
    import vgrpo

    def update(family, model, optimizer, params, batch, args, n_prompts, scaler=None):
        s_old, _ = vgrpo.old_surrogate(family, family.transformer, batch, args, n_prompts, from_step=0)
        _, idx = next(vgrpo.micro_batches(n_prompts, args.group_size, args.inner_steps, args.micro_batch,
                                          s_old.device))
        real_loss = vgrpo.vgrpo_loss

        def loss(s_new, *rest, **kw):  # the first call is the first micro-batch's
            if "ratio" not in record:
                record["ratio"] = (s_new.detach() - s_old[idx]).exp().sub(1).abs().max().item()
            return real_loss(s_new, *rest, **kw)

        vgrpo.vgrpo_loss = loss
        try:
            return real_update(family, model, optimizer, params, batch, args, n_prompts, scaler)
        finally:
            vgrpo.vgrpo_loss = real_loss

    return update


def run_digits(quick, out_dir):
    """The CPU demo's command on the GPU (or the CPU with --quick), 2 iterations evaluated at the end."""
    command = [sys.executable, os.path.join(ROOT, "vgrpo.py"), "--device", "cpu" if quick else "cuda",
               "--iterations", "2", "--eval-every", "2", "--output-dir", out_dir]
    p = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"python vgrpo.py exited {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        m = json.loads(f.readline())
    with open(os.path.join(out_dir, "eval.jsonl")) as f:
        evals = [json.loads(line) for line in f]
    # the first iteration's figures, as the other rows (its peak includes the evaluation before it), and the
    # settings the run resolved (config.json)
    return dict(name="digits", flags="--model digits (the CPU demo), --iterations 2 --eval-every 2",
                resolution=config["resolution"], steps=config["sample_steps"], n_mc=config["n_mc"],
                inner_steps=config["inner_steps"], micro_batch=config["micro_batch"],
                images=config["prompts_per_step"] * config["group_size"], build_s=None, iteration_s=m["time_total"],
                phases={k: m[f"time_{k}"] for k in ("rollout", "reward", "old", "update")},
                policy_loss=m["policy_loss"], grad_norm=m["grad_norm"], skipped_steps=m["skipped_steps"],
                ratio_min=m["ratio_min"], ratio_max=m["ratio_max"], first_step_ratio=None,
                peak_gib=m.get("peak_memory_gib"), held_out=[e["eval_digit_correct"] for e in evals],
                device="cpu" if quick else "cuda")


def problems(res):
    """What is wrong with one configuration's result (an empty list: it passed)."""
    out = []
    if res.get("error"):
        return [res["error"]]
    # the digits demo runs as a user runs it, without the old-surrogate comparison (one inner step: the ratio is 1
    # by construction there)
    if res["name"] != "digits" and (res["first_step_ratio"] is None or res["first_step_ratio"] > 1e-6):
        out.append(f"ratio at the first inner step off 1 by {res['first_step_ratio']}")
    if not (math.isfinite(res["policy_loss"]) and math.isfinite(res["grad_norm"])):
        out.append(f"non-finite loss {res['policy_loss']} or gradient norm {res['grad_norm']}")
    if res["skipped_steps"]:
        out.append(f"{res['skipped_steps']} skipped step(s)")
    if res.get("gpu") and not res.get("compiled"):   # --compile auto compiles the blocks of every model on CUDA
        out.append("the transformer's blocks ran eager on CUDA")
    held_out = held_out_number(res)
    if held_out is not None and not math.isfinite(held_out):
        out.append(f"non-finite held-out evaluation {held_out}")
    return out


def held_out_number(res):
    """The held-out reward's mean (SD3.5-M), the accuracy of the last evaluation (digits), or None (not evaluated)."""
    return res.get("held_out_reward", (res.get("held_out") or [None])[-1])


# --------------------------------------------------------------------------- all of them, and the report


class Stopped(Exception):
    """This script was sent SIGTERM (device.sh's `timeout`) while it waited for a configuration."""


SIGTERM = {"received": False, "waiting": False}


def stop_on_sigterm(signum, frame):
    """Ends the wait for the running configuration (launch kills it); no configuration starts after it."""
    SIGTERM["received"] = True
    if SIGTERM["waiting"]:
        raise Stopped


def wait_for(proc, timeout):
    """proc's output once it exits; TimeoutExpired after `timeout` seconds, Stopped on SIGTERM (before it too)."""
    SIGTERM["waiting"] = True
    try:
        if SIGTERM["received"]:   # it came while the process started
            raise Stopped
        return proc.communicate(timeout=timeout)[0]
    finally:
        SIGTERM["waiting"] = False   # a later SIGTERM must not interrupt the kill


def one_process_group():
    """The environment torchrun gives its one worker: --fsdp's process group of one, on a free port. (torchrun itself
    would start that worker in a session of its own, which outlives the kill of a timed-out configuration and keeps
    the GPU's memory.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def launch(name, quick, timeout, work, limit, heartbeat):
    """Configuration `name` in a fresh process (for --fsdp, with the environment of torchrun's one process) -> its
    result or its error. limit: what the timeout is, for the error (None: --timeout); heartbeat: seconds between the
    child's lines. A timeout, or SIGTERM to this script, ends the configuration's process and all it started."""
    out_dir = os.path.join(work, name)
    os.makedirs(out_dir, exist_ok=True)
    result_file = os.path.join(out_dir, "result.json")
    command = [sys.executable, os.path.join(HERE, "smoke.py"), "--child", name, "--work", work, "--heartbeat",
               str(heartbeat)] + (["--quick"] if quick else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               **(one_process_group() if "--fsdp" in CONFIGS[name] else {}))
    # a session of its own, so that one kill ends it and what it started (the digits demo's vgrpo.py)
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output = wait_for(proc, timeout)
    except (subprocess.TimeoutExpired, Stopped) as e:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:   # something outside the session holds the pipe open: leave the output
            output = ""
        show_tail(name, output)
        last = last_heartbeat(name, output)
        why = "stopped by SIGTERM" if isinstance(e, Stopped) else \
            f"no result within {limit or f'--timeout {timeout:g} s'}"
        return dict(name=name, error=why + (f" (last: {last[0][-200:]})" if last else ""))
    if proc.returncode or not os.path.isfile(result_file):
        last = show_tail(name, output)[-3:]
        return dict(name=name, error=f"exit {proc.returncode}: {' / '.join(last)[-400:]}")
    with open(result_file) as f:
        return json.load(f)


def last_heartbeat(name, output):
    """[the last progress line of configuration `name`'s output] (the phase it was in, what it had compiled), or []
    if it printed none; a warning printed after it is not it."""
    return [line for line in output.splitlines() if line.startswith(f"[{name}] ")][-1:]


def show_tail(name, output, lines=20):
    """Print the last `lines` lines of a failed configuration's output (device.sh's log keeps them) -> them."""
    tail = [line for line in output.strip().splitlines() if line.strip()][-lines:]
    print("\n".join([f"{name} failed; its output ended:", *(f"    {line}" for line in tail)]), flush=True)
    return tail


def report(results, meta):
    lines = ["# GPU smoke run (`bench/smoke.py`)", ""]
    if not meta["gpu"]:
        lines += ["**Not run on a GPU.** This is `--quick`: tiny transformers on the CPU in float32, which only shows "
                  "that every configuration runs end to end. `python bench/smoke.py` on a GPU runs the real shapes.",
                  ""]
    lines += [f"`{meta['command']}` on {meta['device']}, torch {meta['torch']}, {meta['date']}. Random weights at the "
              "real shapes, one prompt group per configuration; ratio: the largest |exp(s_update - s_old) - 1| at the "
              "first inner step (0: the update's first forward and the old-surrogate pass agree bit for bit); "
              "held-out: the mean reward on 4 held-out prompts (digits: the accuracy of its last evaluation); peak: "
              "`max_memory_allocated` over this first iteration of one prompt group, where AdamW's states appear at "
              "its first optimizer step (results/memory-gpu.md has each phase at the recipe's batch, the states "
              "held throughout); iteration s: this first iteration with its compiles and the check's extra "
              "old-surrogate pass over every minibatch (results/gpu.md has the speeds).", "",
              "| configuration | flags | px, steps, N_MC, inner steps | images | ratio at step 1 | policy loss | "
              "grad norm | held-out | peak GiB | build s | iteration s | compiled: frames, s | result |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for res in results:
        if res.get("error"):
            lines.append(f"| {res['name']} | `{' '.join(CONFIGS[res['name']])}` | | | | | | | | | | | **failed**: "
                         f"{res['error']} |")
            continue
        bad = problems(res)
        peak = "" if res["peak_gib"] is None else f"{res['peak_gib']:.1f}"
        build = "" if res["build_s"] is None else f"{res['build_s']:.0f}"
        ratio = "" if res["first_step_ratio"] is None else f"{res['first_step_ratio']:.1e}"
        held_out = "" if held_out_number(res) is None else f"{held_out_number(res):.4g}"
        compiled = "eager" if not res.get("compiled") else f"{res['compiled_graphs']}" + \
            ("" if res["compile_s"] is None else f", {res['compile_s']:.0f}")
        lines.append(f"| {res['name']} | `{res['flags']}` | {res['resolution']}, {res['steps']}, {res['n_mc']}, "
                     f"{res['inner_steps']} | {res['images']} | {ratio} | "
                     f"{res['policy_loss']:+.3e} | {res['grad_norm']:.3g} | {held_out} | {peak} | {build} | "
                     f"{res['iteration_s']:.1f} | {compiled} | {'ok' if not bad else '**failed**: ' + '; '.join(bad)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: the script's own test")
    p.add_argument("--only", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--timeout", type=float, default=150, help="seconds each configuration may take, its start included")
    p.add_argument("--budget", type=float, default=math.inf, help="seconds for all of them: a configuration gets "
                   "what is left, if less than --timeout, and none is started once it is spent")
    p.add_argument("--out", default=os.path.join(HERE, "results", "smoke-gpu.md"), help="markdown; JSON beside it")
    p.add_argument("--work", default=None, help="the runs' folders (default: a temporary one)")
    p.add_argument("--child", help=argparse.SUPPRESS)   # inside the child process: this configuration
    p.add_argument("--heartbeat", type=float, default=10, help="seconds between the progress lines of a "
                   "configuration (the last one of a configuration that timed out says where its time went)")
    p.add_argument("--merge", help="run nothing: comma-separated smoke-gpu.json files of runs on one GPU (a rerun of "
                   "the configurations the first had no time for) -> one report, --out; exit 1 if any failed")
    a = p.parse_args(argv)
    if a.merge:
        results, meta = merge_runs(a.merge.split(","))
        write_report(a.out, results, meta)
        failed = [res["name"] for res in results if problems(res)]
        print(f"wrote {a.out}" + (f"; FAILED: {', '.join(failed)}" if failed else "; every configuration passed"))
        return 1 if failed else 0
    if a.child:
        heartbeat(a.child, a.heartbeat)   # first, so that a configuration stuck anywhere says where
    import torch

    if a.child:
        result = run_digits(a.quick, os.path.join(a.work, a.child)) if a.child == "digits" else \
            run_config(a.child, a.quick, os.path.join(a.work, a.child))
        if int(os.environ.get("RANK", 0)) == 0:
            with open(os.path.join(a.work, a.child, "result.json"), "w") as f:
                json.dump(result, f)
        # leave without tearing down --fsdp's process group, whose destructor can hang at exit (vgrpo.finish)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    names = a.only.split(",")
    if not set(names) <= set(CONFIGS):
        p.error(f"--only: choose from {', '.join(CONFIGS)}")
    if not a.quick and not torch.cuda.is_available():
        p.error("no CUDA device here: the smoke run needs one (--quick runs tiny shapes on the CPU)")
    if a.work:
        return run_all(names, a, argv, a.work)
    # the runs' checkpoints and logs go with it; a file it cannot remove must not turn the run's verdict into an error
    with tempfile.TemporaryDirectory(prefix="vgrpo-smoke-", ignore_cleanup_errors=True) as work:
        return run_all(names, a, argv, work)


def write_report(out, results, meta):
    """The markdown report and its JSON beside it, each written whole (a kill while writing leaves the last one)."""
    write_whole(out, report(results, meta))
    write_whole(os.path.splitext(out)[0] + ".json", json.dumps(dict(meta, results=results), indent=1))


def merge_runs(paths):
    """Several runs' smoke-gpu.json on one device, in the order they ran -> (results, meta): each configuration's
    result from the last run that ran it ("not run" replaces nothing), in CONFIGS' order, every run's command."""
    runs = read_runs(paths, ("device", "torch"), "smoke.py")
    latest = {}
    for run in runs:
        for res in run["results"]:
            if not str(res.get("error", "")).startswith("not run") or res["name"] not in latest:
                latest[res["name"]] = res
    meta = {k: v for k, v in runs[0].items() if k != "results"}
    meta["command"] = "; then ".join(run["command"] for run in runs)
    return [latest[name] for name in CONFIGS if name in latest], meta


def run_all(names, a, argv, work):
    """Every configuration in `names`, one after another in its own process, each result written as it comes ->
    the exit status: 1 if any failed."""
    import torch

    results = []
    meta = dict(gpu=not a.quick, device=torch.cuda.get_device_name() if not a.quick else "the CPU",
                torch=f"{torch.__version__} (CUDA {torch.version.cuda})" if not a.quick else torch.__version__,
                date=datetime.date.today().isoformat(),
                command=" ".join(["python bench/smoke.py", *(sys.argv[1:] if argv is None else argv)]))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    deadline = time.perf_counter() + a.budget
    signal.signal(signal.SIGTERM, stop_on_sigterm)   # a configuration running then is ended, and the report written
    for name in names:
        started = time.perf_counter()
        left = deadline - started
        budget_left = f"the {left:.0f} s left of --budget {a.budget:g}" if left < a.timeout else None
        if SIGTERM["received"]:
            res = dict(name=name, error="not run: stopped by SIGTERM")
        elif left > 0:
            res = launch(name, a.quick, min(a.timeout, left), work, budget_left, a.heartbeat)
        else:
            res = dict(name=name, error=f"not run: --budget {a.budget:g} s spent")
        results.append(res)
        print(f"{name}: {'; '.join(problems(res)) or 'ok'} ({time.perf_counter() - started:.0f} s)", flush=True)
        write_report(a.out, results, meta)   # after every configuration: a run cut short keeps what it did
    failed = [res["name"] for res in results if problems(res)]
    print(f"wrote {a.out}" + (f"; FAILED: {', '.join(failed)}" if failed else "; every configuration passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
