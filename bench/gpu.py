"""GPU benchmark: V-GRPO's phases on SD3.5-Medium-, FLUX.1-dev-, Qwen-Image- and FLUX.2 [klein]-shaped transformers.

    python bench/gpu.py                                    # one GPU, a few minutes -> bench/results/gpu.md, gpu.json
    python bench/gpu.py --time-limit 240 --models flux     # stop measuring after 240 s, write what was measured
    python bench/gpu.py --models qwen-image,flux2-klein    # the newer models (not in the default run)
    python bench/gpu.py --quick --out /tmp/gpu.md          # CPU, tiny shapes, float32, seconds (test_bench.py)
    python bench/gpu.py --merge a/gpu.json,b/gpu.json      # one report of runs on one GPU; measures nothing

The transformers are the real architectures (configurations below and in bench/memory.py, from the models'
config.json) with random weights: nothing is downloaded. They are built directly on the GPU in bf16 (factory functions
default there while the modules are made, so no full-size weights ever exist on the CPU), get the recipe's LoRA
(r32, alpha 64; r64, alpha 128 for Qwen-Image and klein; the families' targets) and gradient checkpointing, and run
through vgrpo's own functions with the recipe's settings (vgrpo.RECIPES: SD3.5-M at 512 px, 40 steps; FLUX.1-dev at
720 px, 16 steps; Qwen-Image at 512 px, 10 steps with true CFG; klein at 384 px, 8 steps with true CFG; N_MC 4,
micro-batches of 4):

  rollout  vgrpo.rollout on one --sample-batch of noises, timed over --rollout-steps ODE steps, scaled to all S
  forwards the rollout's forwards alone (the same rows, conditioning and sigmas, none of the solver's arithmetic):
           rollout / forwards is what the ODE loop adds to the forwards it runs
  old      vgrpo.old_surrogate on one micro-batch (micro-batch x N_MC rows; without gradients, or compiled with
           them, as vgrpo runs it)
  update   vgrpo.update on one micro-batch: forward + backward of its rows, gradient clip, AdamW on the LoRA weights
  decode   vgrpo.decode of --decode-batch latents by the model's VAE (its published configuration)
  reward   the reward on a --sample-batch of images: a random CLIP ViT-H/14 read as PickScore (SD3.5-M, Qwen-Image,
           klein) or HPSv2.1 (FLUX.1-dev), as reward.py reads the real ones
  text     the text encoders at their published sizes (CLIP-L, bigG, T5-XXL; Qwen2.5-7B; Qwen3-4B), per prompt: a
           cost at start only

--modes eager,compiled (the default) measures rollout, old surrogate and update twice in one run: eager, then with
vgrpo's --compile (each transformer block compiled in place), whose compile time is the warm-up's excess over a
timed run. Random text embeddings have the real shapes (SD3: 333 tokens = 77 CLIP + 256 T5, pooled 2048; FLUX: 512
T5 tokens, pooled 768; Qwen-Image: 256 tokens of 3584 and their mask; klein: 512 tokens of 7680). Seconds are the
fastest of --repeats runs after a warm-up; peak memory is torch.cuda.max_memory_allocated over the phase (weights
included). TFLOP/s counts the FLOPs of one forward of one row and of one update of one sample with
torch.utils.flop_counter (backward and checkpointing's recomputation included) and divides by the measured time; "of
peak" compares it with the device's dense bf16 peak, and the targets' line also with the rate a plain 8192^3 bf16
matrix product reaches on the same chip (measured first: the ceiling in practice). The split multiplies the
measured times out to one iteration of the recipe on --gpus GPUs, per GPU, eager and compiled. --profile adds
torch.profiler's table of the top kernels of one rollout and one update (compiled where measured) to the report:
where the time goes. --quick runs the same code on tiny transformers on the CPU in float32.
"""

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import subprocess
import sys
import time
import types

import torch
from torch.utils.flop_counter import FlopCounterMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import memory  # noqa: E402
import vgrpo  # noqa: E402
from memory import one_line  # noqa: E402
from report_files import read_runs, write_whole  # noqa: E402

# stabilityai/stable-diffusion-3.5-medium's transformer (2.24B) and black-forest-labs/FLUX.1-dev's (11.9B)
SD3_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                  num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                  dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
FLUX_CONFIG = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))
# --quick: the same architectures (dual attention, RMS qk-norm, guidance embedding) at toy width and depth, with
# every kind of block as torch.compile sees them: the first block (its input needs no gradient), later ones of its
# class, SD3.5-M's plain and last (no text output) blocks, FLUX's single blocks
SD3_QUICK = dict(SD3_CONFIG, sample_size=8, num_layers=4, attention_head_dim=8, num_attention_heads=2,
                 joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=8,
                 dual_attention_layers=(0, 1))
FLUX_QUICK = dict(FLUX_CONFIG, num_layers=2, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
# Qwen-Image (20.4B) and FLUX.2 [klein] base 4B (3.9B): bench/memory.py's published configurations; --quick: toys
QWEN_QUICK = dict(memory.QWEN_IMAGE, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                  axes_dims_rope=(4, 6, 6))
KLEIN_QUICK = dict(memory.FLUX2_KLEIN_4B, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4))
# name: (diffusers class, config, quick config, the conditioning per sample: (tokens, width) then what follows it,
# pooled (width,) or the tokens' mask)
MODELS = {
    "sd3": ("SD3Transformer2DModel", SD3_CONFIG, SD3_QUICK, (333, "pooled")),
    "flux": ("FluxTransformer2DModel", FLUX_CONFIG, FLUX_QUICK, (512, "pooled")),
    "qwen-image": ("QwenImageTransformer2DModel", memory.QWEN_IMAGE, QWEN_QUICK, (256, "mask")),
    "flux2-klein": ("Flux2Transformer2DModel", memory.FLUX2_KLEIN_4B, KLEIN_QUICK, (512, None)),
}
TITLES = {"sd3": "SD3.5-M", "flux": "FLUX.1-dev", "qwen-image": "Qwen-Image", "flux2-klein": "FLUX.2 [klein] 4B"}
# dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets (half their figures "with sparsity"), matched
# in order against the device name: the PCIe and NVL boards of a chip run slower clocks than its SXM one
PEAK_TFLOPS = [("H100 PCIe", 756), ("H100 NVL", 835), ("H200 NVL", 835), ("H100", 989), ("H200", 989), ("H800", 989),
               ("A100", 312), ("A800", 312), ("L40S", 362), ("RTX 4090", 165), ("B200", 2250)]


def peak_tflops(device):
    return peak_tflops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_tflops_of(name):
    """A GPU's name as torch gives it -> its dense bf16 peak, or None for a GPU not in PEAK_TFLOPS."""
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


MATMUL_N = 8192   # matmul_tflops' size on a GPU: two 128 MiB bf16 operands, far beyond the L2 cache


def matmul_tflops(device, n=MATMUL_N, batches=5, per_batch=10):
    """The rate a plain n x n x n matrix product reaches here (bf16 on a GPU, float32 on the CPU), TFLOP/s: the ceiling
    a transformer's matrix products can approach on this chip, which a data sheet's peak overstates (an H100 / H200
    of this project's machines: about 790 of the 989 quoted). Random inputs (zeros run faster), a warm-up of a
    batch's length (clocks ramp, cuBLAS picks its kernel), then the fastest of `batches` batches of `per_batch`
    products, as the phases take the fastest of their repeats."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=generator) for _ in range(2))
    seconds = []
    for _ in range(batches + 1):
        sync(device)
        t = time.perf_counter()
        for _ in range(per_batch):
            a @ b
        sync(device)
        seconds.append(time.perf_counter() - t)
    return 2 * n ** 3 * per_batch / min(seconds[1:]) / 1e12   # the first batch was the warm-up


def build_transformer(cls_name, config, device, dtype):
    """Random weights made on `device` in `dtype` by the modules' own initialisation (seed 0)."""
    import diffusers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = getattr(diffusers, cls_name)(**config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device).eval().requires_grad_(False)


def build_vae(name, quick, device, amp):
    """The model's VAE (bench/memory.py's published configuration; --quick: the same class at toy width)."""
    with torch.device(device):
        torch.manual_seed(0)
        vae = memory.build_vae(name, quick)
    return vae.to(device, amp or torch.float32).eval().requires_grad_(False)


# the text encoders' published configurations: CLIP-L/14 and OpenCLIP bigG/14 text towers (SD3's two CLIPs; FLUX
# reads CLIP-L's pooled output), T5 v1.1 XXL's encoder (both, at 256 / 512 tokens); --quick: two-layer toys
TEXT_ENCODERS = {
    "clip_l": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   projection_dim=768, vocab_size=49408, max_position_embeddings=77, hidden_act="quick_gelu"),
    "clip_g": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                   projection_dim=1280, vocab_size=49408, max_position_embeddings=77, hidden_act="gelu"),
    "t5": dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
               feed_forward_proj="gated-gelu", dropout_rate=0.0),
    # Qwen-Image's Qwen2.5-VL-7B (its language model reads the prompt) and klein's Qwen3-4B, all their layers
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
}
ENCODERS_OF = {"sd3": ("clip_l", "clip_g", "t5"), "flux": ("clip_l", "t5"), "qwen-image": ("qwen2.5-7b",),
               "flux2-klein": ("qwen3-4b",)}
# tokens each encoder reads per prompt: CLIP 77, T5 the recipe's, Qwen-Image's template (34 tokens dropped after) and
# the recipe's 256, klein's 512 (its pipeline pads to them)
TEXT_TOKENS = {"clip_l": 77, "clip_g": 77, "t5": None, "qwen2.5-7b": 34 + 256, "qwen3-4b": 512}


def text_encoding(name, quick, device, dtype, max_t5_tokens, prompts=32):
    """Seconds per prompt of the model's text encoders at their real sizes (random weights, random token ids of the
    real lengths): what encoding a prompt file once at start costs (vgrpo's embedding store)."""
    import transformers

    classes = {"clip_l": ("CLIPTextModelWithProjection", "CLIPTextConfig"), "t5": ("T5EncoderModel", "T5Config"),
               "qwen2.5-7b": ("Qwen2Model", "Qwen2Config"), "qwen3-4b": ("Qwen3Model", "Qwen3Config")}
    encoders = []
    for key in ENCODERS_OF[name]:
        config = TEXT_ENCODERS[key]
        if quick:
            config = dict(config, **(dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2) if key == "t5" else
                                     dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, **({"projection_dim": 32} if "clip" in key else
                                                                    dict(num_key_value_heads=1, head_dim=16)))))
        model_class, config_class = classes.get(key, classes["clip_l"])
        with torch.device(device):
            torch.manual_seed(0)
            model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
        tokens = 8 if quick else TEXT_TOKENS[key] or max_t5_tokens
        ids = torch.randint(config["vocab_size"], (prompts, tokens), device=device)
        encoders.append((model.to(dtype).eval(), ids))

    @torch.no_grad()
    def encode():
        for model, ids in encoders:
            model(input_ids=ids)

    seconds, _, _ = timed(encode, device, 1)
    encoders.clear()   # the encoders free their memory before the next measurement
    return seconds / prompts


def recipe_args(name, quick):
    """The recipe's Args with its LoRA; --quick: the tiny models' batch settings with the model's own LoRA rank (r32,
    or r64 for the newer ones)."""
    args = vgrpo.Args(model=name)
    if quick:
        tiny = vgrpo.Args(model="tiny-flux" if name == "flux" else "tiny")
        args = dataclasses.replace(tiny, model=name, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                                   guidance=args.guidance if name != "sd3" else tiny.guidance)
    return dataclasses.replace(args, full_finetune=False)   # LoRA in --quick too


def micro_batch(args, gpus, quick):
    """vgrpo.validate's default micro-batch for the recipe on `gpus` GPUs (16 for the tiny models)."""
    minibatch = args.prompts_per_step // gpus * args.group_size // args.inner_steps
    return math.gcd(minibatch, 16 if quick else 4)


def make_family(name, quick, device):
    """vgrpo's Family of the model around a bare transformer, and the recipe's Args with its LoRA. A stand-in
    pipeline holds the transformer, the VAE, the scheduler (for the sigma grid) and the pipeline's static helpers."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    cls_name, config, quick_config, (tokens, after) = MODELS[name]
    args = recipe_args(name, quick)
    config, tokens, resolution = (quick_config, 8, 64) if quick else (config, tokens, args.resolution)
    amp = None if quick else torch.bfloat16
    transformer = build_transformer(cls_name, config, device, amp or torch.float32)
    transformer.enable_gradient_checkpointing()
    pipe = types.SimpleNamespace(transformer=transformer, vae_scale_factor=8, vae=build_vae(name, quick, device, amp),
                                 scheduler=FlowMatchEulerDiscreteScheduler(**memory.SCHEDULERS[name]),
                                 **memory.pipeline_parts(name))
    kw = dict(guidance=args.guidance) if name == "flux" else {}
    family = vgrpo.PIPELINES[name][1](pipe, resolution, tokens, device, amp_dtype=amp, **kw)
    cond = [(tokens, config["joint_attention_dim"])]
    cond += [(config["pooled_projection_dim"],)] if after == "pooled" else [(tokens, "mask")] if after else []
    return family, args, cond


def inputs(family, args, cond_shapes, mb, device):
    """Random conditioning (a mask of ones) and starting noises for a sample batch, the sigma grid, and one
    micro-batch's V-GRPO batch (rollout latents, conditioning, pairs shared over the batch, advantages)."""
    n, dtype = max(args.sample_batch, mb), family.amp_dtype or torch.float32
    g = torch.Generator(device).manual_seed(0)
    cond = tuple(torch.ones(n, shape[0], dtype=torch.long, device=device) if shape[-1] == "mask" else
                 torch.randn(n, *shape, device=device, dtype=dtype, generator=g) for shape in cond_shapes)
    noise = torch.randn(n, *family.latent_shape, device=device, generator=g)
    sigmas = family.sigma_grid(args.sample_steps)
    sig, eps = vgrpo.draw_pairs(sigmas, args.n_mc, family.latent_shape, [(0, m) for m in range(mb)],
                                "batch", True, 0, 0, device)
    batch = {"o": noise[:mb], "cond": vgrpo.rows_of(cond, slice(0, mb)), "sigmas": sig, "eps": eps,
             "A": torch.randn(mb, device=device, generator=g)}
    return cond, noise, sigmas, batch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats):
    """Fastest of `repeats` runs after one warm-up, the peak memory over them (GiB; None on the CPU) and the warm-up's
    seconds (which include torch.compile's compiling, when the blocks are compiled)."""
    t = time.perf_counter()
    fn()
    sync(device)
    warm_up = time.perf_counter() - t
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return best, peak, warm_up


def count_flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def measure_model(name, a, gpus, device, deadline, save):
    """Build one model and time its phases -> a dict; phases not started before `deadline` are left out. save(res)
    writes the report with what has been measured so far: it is called after every phase. An error ends its part
    (eager, decode / reward, compiled, profile, text encoders) with res["error"]; what was measured stays, the next
    part runs."""
    family, args, cond_shapes = make_family(name, a.quick, device)
    model = family.transformer
    params = vgrpo.add_trainable_weights(family, args)
    optimizer = torch.optim.AdamW(params, lr=args.lr, fused=device.type == "cuda")   # as vgrpo.build_run
    mb = micro_batch(args, gpus, a.quick)
    sb, k = args.sample_batch, min(a.rollout_steps, args.sample_steps)
    one = dataclasses.replace(args, micro_batch=mb, group_size=mb, inner_steps=1)   # exactly one micro-batch
    cond, noise, sigmas, batch = inputs(family, args, cond_shapes, mb, device)
    first_k = torch.cat([sigmas[:k], sigmas[-1:]])    # k velocity evaluations, the last one straight to sigma = 0
    res = dict(model=TITLES[name], resolution=family.resolution, steps=args.sample_steps, sample_batch=sb,
               decode_batch=args.decode_batch, compiled=None,
               micro_batch=mb, n_mc=args.n_mc, lora_rank=args.lora_rank, image_tokens=family.image_tokens,
               text_tokens=cond_shapes[0][0], lora_params=sum(p.numel() for p in params), phases={},
               recipe=dict(P=args.prompts_per_step, G=args.group_size, inner_steps=args.inner_steps))
    res["params"] = sum(p.numel() for p in model.parameters()) - res["lora_params"]
    # FLOPs of one row's forward and of one sample's update (vgrpo.update on a micro-batch of one: forward,
    # backward with checkpointing's recomputation; AdamW's elementwise work is not counted)
    with torch.no_grad():
        res["flops_forward_row"] = count_flops(
            lambda: family.velocity(model, noise[:1], sigmas[:1], vgrpo.rows_of(cond, slice(0, 1))))
    single = {key: vgrpo.rows_of(v, slice(0, 1)) if key == "cond" else v[:1] for key, v in batch.items()}
    res["flops_update_sample"] = count_flops(lambda: vgrpo.update(
        family, model, optimizer, params, single, dataclasses.replace(one, micro_batch=1, group_size=1), 1))
    cfg = family.cfg and args.guidance > 1   # true CFG (Qwen-Image, klein): two rows per sample, a random negative
    negative = vgrpo.rows_of(cond, slice(0, 1)) if cfg else None
    res["cfg"] = cfg
    rollout_cond = vgrpo.rows_of(cond, slice(0, sb))
    rollout_flops = res["flops_forward_row"] * sb * k * (2 if cfg else 1)
    phases = {
        "rollout": (lambda: vgrpo.rollout(family, model, rollout_cond, noise[:sb], first_k, one, negative), sb,
                    rollout_flops),
        "forwards": (lambda: bare_forwards(family, model, rollout_cond, noise[:sb], first_k, negative), sb,
                     rollout_flops),
        "old surrogate": (lambda: vgrpo.old_surrogate(family, model, batch, one, 1, from_step=0), mb,
                          res["flops_forward_row"] * mb * args.n_mc),
        "update": (lambda: vgrpo.update(family, model, optimizer, params, batch, one, 1), mb,
                   res["flops_update_sample"] * mb),
    }
    def attempt(what, fn):   # an error (out of memory, a compile error) is reported; the next step still runs
        try:
            fn()
        except Exception as e:   # noqa: BLE001
            res["error"] = "; ".join(filter(None, [res.get("error"), f"{what}: {one_line(e)}"]))
            print(f"  {what} failed: {one_line(e)}", flush=True)

    def saved():
        save(res)

    if "eager" in a.modes:
        attempt("eager", lambda: run_phases(res["phases"], phases, args, k, a.repeats, device, deadline, saved))
    # what else an iteration does: decode, reward (never compiled)
    attempt("decode, reward", lambda: measure_beside(res, name, a.quick, family, args, cond, noise, device, deadline,
                                                     saved))

    def compiled():
        vgrpo.compile_wanted(dataclasses.replace(args, compile="on"), 1, device)   # refuses without triton / a C compiler
        vgrpo.compile_blocks(family)
        res["compiled"] = {}
        run_phases(res["compiled"], phases, args, k, a.repeats, device, deadline, saved)

    if "compiled" in a.modes and time.perf_counter() < deadline:
        attempt("compiled", compiled)

    def profile():   # the last mode measured: compiled where it was
        res["profile"] = {phase: profile_table(phases[phase][0], device) for phase in ("rollout", "update")}
        res["profile_mode"] = "compiled" if family.compiled else "eager"

    if a.profile and time.perf_counter() < deadline:
        attempt("profile", profile)
    # last, a cost at start only: the text encoders once per prompt
    attempt("text", lambda: measure_text(res, name, a.quick, family, device, deadline, saved))
    return res


@torch.no_grad()
def bare_forwards(family, model, cond, x, sigmas, negative):
    """vgrpo.rollout's forwards alone, one per ODE step of `sigmas` (whose last point is the end): the same rows,
    conditioning and sigmas, with CFG's rows made once, and none of the solver's arithmetic."""
    if negative is not None:   # true CFG: the negative prompt's rows beside the positive ones, as vgrpo.rollout
        cond = tuple(torch.cat([n.expand_as(t), t]) for n, t in zip(negative, cond))
        x = torch.cat([x, x])
    on_device = sigmas.to(x.device)
    for i in range(len(sigmas) - 1):
        family.velocity(model, x, on_device[i], cond)


def profile_table(fn, device, rows=15):
    """torch.profiler's table of fn()'s top operations and kernels by their own time on the device (on the CPU: by
    their own CPU time), after one unprofiled run."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync(device)
    return prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                     row_limit=rows, max_name_column_width=60)


# --kernels: torch's SDPA kernels timed alone at each model's attention shapes, in this order; FlashAttention 3 and 4
# (torch's registered implementations of its flash kernel, where their packages are installed) come after torch's own
# flash kernel, which they replace for the rest of the process. cuDNN's runs last: its known failure in the backward
# (an illegal memory access, docs/method.md#attention-kernels) poisons the process's CUDA context, so the probe runs in
# a child process, and what it measured before a crash is kept.
def sdpa_kernels():
    lister = getattr(torch.nn.attention, "list_flash_attention_impls", None)   # torch 2.11+
    return ("flash", "efficient", "math", *(impl.lower() for impl in (lister() if lister else ())), "cudnn")


def attention_shapes(names, quick, gpus):
    """Each model's attention as its recipe runs it, (model, pass, rows, heads, tokens, head dim, masked): the rollout's
    forward at its sample batch (two rows a sample with CFG) and the update's forward and backward at a micro-batch
    of N_MC rows a sample. Image tokens: an 8x VAE and 2x2 patches, (resolution / 16)^2; SD3.5-M's dual-attention
    blocks attend over the image tokens alone as well (their second attention); Qwen-Image's attention takes its text
    mask (a boolean mask over the tokens, which torch's flash kernel does not accept)."""
    shapes = []
    for name in names:
        args = recipe_args(name, quick)
        _, config, quick_config, (tokens, after) = MODELS[name]
        config, tokens, resolution = (quick_config, 8, 64) if quick else (config, tokens, args.resolution)
        image_tokens = (resolution // 16) ** 2
        heads, dim = config["num_attention_heads"], config["attention_head_dim"]
        cfg = vgrpo.PIPELINES[name][1].cfg and args.guidance > 1
        lengths = [("", image_tokens + tokens)]
        lengths += [(" (image tokens)", image_tokens)] * bool(config.get("dual_attention_layers"))
        for phase, rows in (("rollout", args.sample_batch * (2 if cfg else 1)),
                            ("update", micro_batch(args, gpus, quick) * args.n_mc)):
            shapes += [(TITLES[name], phase + label, rows, heads, length, dim, after == "mask")
                       for label, length in lengths]
    return shapes


def attention_flops(rows, heads, tokens, dim, backward):
    """FLOPs of one attention as torch's FlopCounterMode counts a fused kernel's, as it counts the phases' attention
    on a GPU: QK^T and PV forward (2 matmuls of 2*L*L*D a head), five of the same size backward (QK^T recomputed,
    then the gradients of V, of the scores, of Q and of K)."""
    return 2 * rows * heads * tokens * tokens * dim * (7 if backward else 2)


def time_kernels(shapes, kernels, device, repeats=3):
    """Child process of --kernels: for each kernel and shape, print one JSON line with the fastest of `repeats` runs
    after a warm-up (milliseconds) and the largest difference from float32 math attention on the first row (relative
    to that output's largest value; gradients too for the update), or the error. After a CUDA error the context is
    unusable, so the rest are reported as not run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    broken = None
    for kernel in kernels:
        for model, phase, rows, heads, tokens, dim, masked in shapes:
            row = dict(kernel=kernel, model=model, phase=phase)
            if broken:
                print(json.dumps(dict(row, error=f"not run: {broken}")), flush=True)
                continue
            try:
                if kernel not in backends:   # fa3, fa4: torch's flash kernel, replaced by FlashAttention's package
                    torch.nn.attention.activate_flash_attention_impl(kernel.upper())
                    backends[kernel] = SDPBackend.FLASH_ATTENTION   # (activated now, once: not again per shape)
                g = torch.Generator(device).manual_seed(0)
                backward = phase.startswith("update")
                qkv = [torch.randn(rows, heads, tokens, dim, device=device, dtype=dtype, generator=g)
                       .requires_grad_(backward) for _ in range(3)]
                grad_out = torch.randn(rows, heads, tokens, dim, device=device, dtype=dtype, generator=g)
                mask = torch.ones(rows, 1, 1, tokens, dtype=torch.bool, device=device) if masked else None

                def attend(q, k, v, backend):
                    with sdpa_kernel(backend):
                        out = torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, attn_mask=None if mask is None else mask[:len(q)])
                    if not q.requires_grad:
                        return [out]
                    return [out, *torch.autograd.grad(out, (q, k, v), grad_out[:len(q)])]

                first = [t[:1].detach().float().requires_grad_(t.requires_grad) for t in qkv]
                with torch.enable_grad() if backward else torch.no_grad():
                    reference = attend(*first, SDPBackend.MATH)
                    got = attend(*qkv, backends[kernel])
                    error = max(((a[:1].float() - b).abs().max() / b.abs().max()).item()
                                for a, b in zip(got, reference))
                    seconds, _, _ = timed(lambda: attend(*qkv, backends[kernel]), device, repeats)
                flops = attention_flops(rows, heads, tokens, dim, backward)
                print(json.dumps(dict(row, ms=seconds * 1e3, tflops=flops / seconds / 1e12, error=None,
                                      max_rel_diff=error)), flush=True)
            except Exception as e:   # noqa: BLE001  (an unsupported kernel, a failing one: both are results)
                message = " ".join(str(e).split())[:200]
                print(json.dumps(dict(row, error=message)), flush=True)
                if device.type == "cuda" and ("CUDA error" in message or "illegal" in message):
                    broken = f"a CUDA error in {kernel} at {model} {phase} left the context unusable"
            finally:
                qkv = grad_out = first = mask = None


def measure_kernels(names, quick, gpus, timeout):
    """--kernels: every SDPA kernel at every shape of attention_shapes, timed in a child process (time_kernels) ->
    (shapes, kernels, rows, which kernel torch picks under vgrpo's default --attention)."""
    shapes, kernels = attention_shapes(names, quick, gpus), sdpa_kernels()
    spec = json.dumps(dict(shapes=shapes, kernels=kernels, quick=quick))
    failure = None
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--time-kernels", spec], capture_output=True,
                           text=True, timeout=timeout)
        stdout = p.stdout
        if p.returncode:   # a crash (a CUDA error, a signal): its last words, which a warning may precede
            failure = f"exit {p.returncode}: " + (p.stderr.strip().splitlines() or ["no message"])[-1]
    except subprocess.TimeoutExpired as e:   # killed: what it printed before is kept
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        failure = f"timed out after {timeout} s"
    rows = []
    for line in stdout.splitlines():
        try:
            row = json.loads(line)
        except ValueError:   # a line cut off by the crash, or a library's print
            continue
        if isinstance(row, dict) and {"kernel", "model", "phase", "error"} <= set(row):
            rows.append(row)
    failure = failure or "it ended without a row for these"
    done = {(r["kernel"], r["model"], r["phase"]) for r in rows}
    rows += [dict(kernel=kernel, model=model, phase=phase, error=f"the probe stopped: {failure}")
             for kernel in kernels for model, phase, *_ in shapes if (kernel, model, phase) not in done]
    return dict(shapes=[dict(zip(("model", "phase", "rows", "heads", "tokens", "head_dim", "masked"), s))
                        for s in shapes],
                kernels=kernels, rows=rows, picked=default_kernel(shapes, quick))


def default_kernel(shapes, quick):
    """The SDPA kernel torch picks for each shape under vgrpo's default --attention (its own selection logic, asked
    without running anything), e.g. {"SD3.5-M update": "flash"}; {} and a printed line if torch cannot say."""
    try:
        return picked_kernels(shapes, quick)
    except Exception as e:   # noqa: BLE001  (a private torch function: its failure must not cost the measurements)
        print(f"  which kernel torch picks: not known ({one_line(e)})", flush=True)
        return {}


def picked_kernels(shapes, quick):
    from torch.nn.attention import SDPBackend

    device = torch.device("cpu" if quick else "cuda")
    dtype = torch.float32 if quick else torch.bfloat16
    names = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
             SDPBackend.MATH: "math", SDPBackend.CUDNN_ATTENTION: "cudnn"}
    vgrpo.choose_attention_kernels(vgrpo.default_flags()["attention"])
    picked = {}
    for model, phase, _, heads, tokens, dim, masked in shapes:
        q = torch.empty(1, heads, tokens, dim, device=device, dtype=dtype, requires_grad=phase.startswith("update"))
        mask = torch.ones(1, 1, 1, tokens, dtype=torch.bool, device=device) if masked else None
        backend = SDPBackend(torch._fused_sdp_choice(q, q, q, mask))
        picked[f"{model} {phase}"] = names.get(backend, backend.name.lower())
    return picked


def failure_cell(error):
    """A kernel's error in a few words (the JSON keeps it whole)."""
    if "No viable backend" in error:
        return "no such kernel for these inputs here"
    if error.startswith("No module named"):
        return "not installed (" + error.split("'")[1] + ")"
    short = error if len(error) <= 80 else error[:77] + "..."
    return short if error.startswith(("not run", "the probe stopped")) else "fails: " + short


def kernel_lines(kernels, meta):
    """--kernels' table: a column per kernel, a row per model and pass."""
    if not kernels:
        return []
    peak = meta["peak_tflops"]
    by = {(r["model"], r["phase"], r["kernel"]): r for r in kernels["rows"]}
    dtype = "bf16" if meta["gpu"] else "float32"
    lines = ["", f"Attention alone (`scaled_dot_product_attention` under each kernel, random {dtype} inputs, a mask "
                 "of ones where the model passes one; "
                 "the update's pass includes the backward): ms, TFLOP/s (FLOPs as torch counts a fused kernel's, as "
                 "for the phases above; the math kernel skips the backward's recomputation, a seventh of them), and "
                 "the largest difference from float32 math attention relative to the output's largest value:", "",
             "| model | pass | rows x heads x tokens x dim | " + " | ".join(kernels["kernels"]) + " | torch picks |",
             "| --- | --- | --- |" + " --- |" * (len(kernels["kernels"]) + 1)]
    for s in kernels["shapes"]:
        cells = []
        for kernel in kernels["kernels"]:
            r = by.get((s["model"], s["phase"], kernel), {"error": "not run"})
            if r.get("error"):
                cells.append(failure_cell(r["error"]))
                continue
            share = f" ({r['tflops'] / peak:.0%})" if peak else ""
            cells.append(f"{r['ms']:.3g} ms, {r['tflops']:.3g}{share}, diff {r['max_rel_diff']:.1g}")
        picked = kernels["picked"].get(f"{s['model']} {s['phase']}", "")
        mask = ", masked" if s["masked"] else ""
        lines.append(f"| {s['model']} | {s['phase']} | {s['rows']} x {s['heads']} x {s['tokens']} x {s['head_dim']}"
                     f"{mask} | " + " | ".join(cells) + f" | {picked} |")
    lines += ["", "\"torch picks\": what torch's own selection chooses under vgrpo's default `--attention "
                  f"{vgrpo.default_flags()['attention']}`. fa3, fa4: torch's flash kernel replaced by FlashAttention 3 "
                  "or 4 (torch.nn.attention.activate_flash_attention_impl), which needs their packages "
                  "(flash_attn_interface; flash_attn.cute)."]
    return lines


def run_phases(out, phases, args, k, repeats, device, deadline, saved):
    """Time each phase into out[phase], then saved(); the warm-up's excess over a timed run is the compile time
    (compiled blocks)."""
    for phase, (fn, samples, flops) in phases.items():
        if time.perf_counter() > deadline:
            print(f"  {phase}: skipped, --time-limit reached", flush=True)
            continue
        seconds, peak, warm_up = timed(fn, device, repeats)
        compile_s = max(warm_up - seconds, 0.0)  # what the first run took beyond a timed one (before any scaling)
        if phase in ("rollout", "forwards"):  # k of the S steps were timed; every step costs the same: scale to S
            seconds, flops = seconds * args.sample_steps / k, flops * args.sample_steps / k
        out[phase] = dict(samples=samples, seconds=seconds, images_per_s=samples / seconds, peak_gib=peak,
                          tflops=flops / seconds / 1e12, warm_up_s=warm_up, compile_s=compile_s)
        print(f"  {phase}: {seconds:.3f} s for {samples} samples (warm-up {warm_up:.1f} s)", flush=True)
        saved()


def measure_beside(res, name, quick, family, args, cond, noise, device, deadline, saved):
    """The VAE decode of --decode-batch images and the reward (PickScore's ViT-H/14 for SD3.5-M, HPSv2.1's for
    FLUX.1-dev, random weights) on a --sample-batch of images."""
    import smoke

    sb, db = args.sample_batch, args.decode_batch
    images = vgrpo.decode(family, noise[:db], db)                     # (db, 3, H, W) in [0, 1]
    pickscore = name != "flux"   # the recipes' rewards: PickScore (logit scale, / 26), FLUX.1-dev's HPSv2.1 (cosine)
    fn = smoke.random_clip_reward(quick, pickscore, 26.0 if pickscore else 1.0)(device)   # float32, as vgrpo's
    pictures = images.repeat(-(-sb // db), 1, 1, 1)[:sb]
    beside = {"decode": (lambda: vgrpo.decode(family, noise[:db], db), db),
              "reward": (lambda: fn(pictures, ["a prompt"] * sb), sb)}
    for phase, (run, samples) in beside.items():
        if time.perf_counter() > deadline:
            continue
        seconds, peak, _ = timed(run, device, 2)
        res["phases"][phase] = dict(samples=samples, seconds=seconds, images_per_s=samples / seconds, peak_gib=peak)
        print(f"  {phase}: {seconds:.3f} s for {samples} images", flush=True)
        saved()


def measure_text(res, name, quick, family, device, deadline, saved):
    """The text encoders at their published sizes, seconds per prompt (res["text_s_per_prompt"])."""
    if time.perf_counter() < deadline:
        t5_tokens = {"sd3": 256, "flux": 512}.get(name)
        res["text_s_per_prompt"] = text_encoding(name, quick, device, family.amp_dtype or torch.float32, t5_tokens)
        print(f"  text encoders: {res['text_s_per_prompt'] * 1e3:.1f} ms per prompt", flush=True)
        saved()


def iteration_split(res, gpus, phases):
    """Seconds per GPU for one iteration of the recipe: P*G/gpus samples, rollouts in sample batches, the decode in
    decode batches and the reward on them all (where measured), the old surrogate for the minibatches after the first
    (as vgrpo.train_iteration), every micro-batch updated once. phases: the eager or the compiled timings. A decode or
    reward not measured (--time-limit, a failure) is None and named in "unmeasured": the total is then only what was
    measured, a lower bound, never judged against the iteration target."""
    r, ph = res["recipe"], phases
    if not all(k in ph for k in ("rollout", "old surrogate", "update")):
        return None
    n = r["P"] * r["G"] / gpus
    split = {"rollout": n / res["sample_batch"] * ph["rollout"]["seconds"],
             "decode": n / res["decode_batch"] * ph["decode"]["seconds"] if "decode" in ph else None,
             "reward": n / ph["reward"]["samples"] * ph["reward"]["seconds"] if "reward" in ph else None,
             "old surrogate": (r["inner_steps"] - 1) / r["inner_steps"] * n / res["micro_batch"]
             * ph["old surrogate"]["seconds"],
             "update": n / res["micro_batch"] * ph["update"]["seconds"]}
    total = sum(v for v in split.values() if v is not None)
    return dict(split, samples_per_gpu=n, total=total, images_per_s=n / total,
                unmeasured=[k for k, v in split.items() if v is None])


def report(results, meta):
    """The markdown file: where and how it was measured, the per-phase table (eager, then compiled), the per-iteration
    split of each."""
    peak = meta["peak_tflops"]
    lines = ["# GPU benchmark (`bench/gpu.py`)", ""]
    if not meta["gpu"]:
        lines += ["**Not run on a GPU.** These numbers are `python bench/gpu.py --quick`'s: tiny transformers on the "
                  "CPU in float32, which only show that the script runs end to end. Run `python bench/gpu.py` on a "
                  "GPU to measure the real shapes.", ""]
    where = "the CPU"
    if meta["gpu"]:
        practical = f"; an {MATMUL_N}^3 bf16 matrix product ran at {meta['matmul_tflops']:.0f} TFLOP/s here, the " \
            "ceiling in practice" if meta.get("matmul_tflops") else ""
        where = f"{meta['device']} (dense bf16 peak {peak or '?'} TFLOP/s{practical})"
    lines += [f"`{meta['command']}` on {where}, torch {meta['torch']}, diffusers {meta['diffusers']}, {meta['date']}; "
              f"weights in {meta['dtype']}, the recipe's LoRA (float32), gradient checkpointing, "
              f"fastest of {meta['repeats']} (the decode and the reward: of 2; the text encoders: one run); "
              "compiled: vgrpo's `--compile` (each transformer block), its compile time the first run's excess; peak "
              "GiB: the compiled run's where there is one.",
              "", "| model | phase | samples | rows | eager s | TFLOP/s | of peak | compiled s | TFLOP/s | of peak | "
              "compile s | peak GiB |", "| --- | --- | --- | --- |" + " ---: |" * 8]
    share = (lambda p: f"{p['tflops'] / peak:.1%}" if peak and "tflops" in p else "")  # noqa: E731
    for res in results:
        title = f"{res['model']} {res['resolution']} px" + ("" if meta["gpu"] else " (tiny)")
        rows = res["micro_batch"] * res["n_mc"]
        compiled = res.get("compiled") or {}
        for phase, what in (("rollout", f"{res['sample_batch']} x {res['steps']} steps"),
                            ("forwards", f"{res['sample_batch']} x {res['steps']} steps, forwards only"),
                            ("old surrogate", f"{rows}"), ("update", f"{rows}, fwd + bwd"),
                            ("decode", f"{res['decode_batch']} images"), ("reward", "ViT-H/14")):
            p, c = res["phases"].get(phase), compiled.get(phase)
            if p is None and c is None:
                lines.append(f"| {title} | {phase} | | | not run | | | | | | | |")
                continue
            p = p or {}
            eager = f"{p['seconds']:.3f} | {p['tflops']:.3g} | {share(p)}" if "tflops" in p else \
                (f"{p['seconds']:.3f} | | " if p else " | | ")
            comp = f"{c['seconds']:.3f} | {c['tflops']:.3g} | {share(c)} | {c['compile_s']:.1f}" if c else " | | | "
            memory = next((f"{x['peak_gib']:.1f}" for x in (c, p) if x and x.get("peak_gib") is not None), "")
            samples = (p or c)["samples"]
            lines.append(f"| {title} | {phase} | {samples} | {what} | {eager} | {comp} | {memory} |")
    return "\n".join(lines + loop_lines(results) + split_lines(results, meta) + target_lines(results, meta)
                     + kernel_lines(meta.get("kernels"), meta) + profile_lines(results, meta)) + "\n"


# The speed issue's targets on an H200: each phase's share of the bf16 peak (the better of eager and compiled), and
# one SD3.5-M recipe iteration per GPU of 8 at most half of the 139.4 s measured at commit 7b882c0
TARGETS = {("SD3.5-M", "rollout"): 0.40, ("SD3.5-M", "update"): 0.30, ("FLUX.1-dev", "rollout"): 0.45,
           ("FLUX.1-dev", "update"): 0.45}
ITERATION_TARGET = ("SD3.5-M", 139.4 / 2)


def target_lines(results, meta):
    """On a GPU with a known peak: each target, what was measured against it, met or not (or not measured)."""
    if not meta["gpu"] or not meta["peak_tflops"]:
        return []
    by_model, found = {res["model"]: res for res in results}, []
    for (model, phase), share in TARGETS.items():
        res = by_model.get(model)
        rates = [] if res is None else [p[phase]["tflops"] for p in (res["phases"], res.get("compiled") or {})
                                        if "tflops" in p.get(phase, {})]
        best = max(rates) / meta["peak_tflops"] if rates else None
        practical = f", {max(rates) / meta['matmul_tflops']:.0%} of the matrix product's" \
            if rates and meta.get("matmul_tflops") else ""
        found.append(f"{model} {phase} " + ("not measured" if best is None else f"{best:.0%} of peak{practical}") +
                     f" (target {share:.0%}" + ("" if best is None else f": {'met' if best >= share else 'missed'}") + ")")
    model, seconds = ITERATION_TARGET
    res = by_model.get(model) or {}
    totals = [s["total"] for s in (res.get("split"), res.get("split_compiled")) if s and not s.get("unmeasured")]
    if meta["gpus"] == 8:   # only a whole iteration is judged: one without its decode or reward would look faster
        found.append(f"{model} iteration " + (f"{min(totals):.1f} s per GPU of 8" if totals else "not measured whole") +
                     f" (target {seconds:.1f} s" + (f": {'met' if min(totals) <= seconds else 'missed'}" if totals
                                                    else "") + ")")
    return ["", "Targets (the better of eager and compiled): " + "; ".join(found) + "."]


def loop_cost(phases):
    """The rollout's seconds over its forwards' alone (1.05: the ODE loop adds 5% to the forwards), or None."""
    if "rollout" in phases and "forwards" in phases:
        return phases["rollout"]["seconds"] / phases["forwards"]["seconds"]
    return None


def loop_lines(results):
    costs = [f"{res['model']} {kind} {cost:.3f}x" for res in results
             for kind, ph in (("eager", res["phases"]), ("compiled", res.get("compiled") or {}))
             if (cost := loop_cost(ph)) is not None]
    return [] if not costs else ["", "The ODE loop's cost, the rollout's seconds over those of its forwards alone "
                                     "(1.05x: the loop adds 5%): " + "; ".join(costs) + "."]


def profile_lines(results, meta):
    """--profile: torch.profiler's top operations of one rollout and one update of each model."""
    by = "own time on the GPU" if meta["gpu"] else "own CPU time"
    lines = []
    for res in results:
        for phase, table in (res.get("profile") or {}).items():
            lines += ["", f"Where the time goes: {res['model']}, one {phase} ({res['profile_mode']}), "
                          f"torch.profiler's top operations by {by}:", "", "```", table.rstrip(), "```"]
    return lines


def split_lines(results, meta):
    """The per-iteration split of each model, eager and compiled, and the lines under it."""
    on = (f"on {meta['gpus']} GPUs, seconds per GPU projected from this one's phases (the gradients' all-reduce not "
          "counted)") if meta["gpu"] else "in one CPU process, seconds"
    lines = ["", f"One iteration of each model's recipe (vgrpo.RECIPES) {on}; the text encoders run once per prompt "
                 "at start, not per iteration:", "",
              "| model | recipe | blocks | samples per GPU | rollout | decode | reward | old surrogate | update | "
              "total | images/s per GPU |", "|" + " --- |" * 11]
    for res in results:
        r = res["recipe"]
        for kind, s in (("eager", res["split"]), ("compiled", res.get("split_compiled"))):
            if not s:
                continue
            parts = " | ".join("not measured" if s[k] is None else f"{s[k]:.1f} ({s[k] / s['total']:.0%})"
                               for k in ("rollout", "decode", "reward", "old surrogate", "update"))
            bound = ("> ", "< ") if s.get("unmeasured") else ("", "")   # the rest of the iteration, without them
            lines.append(f"| {res['model']} | {r['P']} x {r['G']}, {res['steps']} steps, N_MC {res['n_mc']}, "
                         f"{r['inner_steps']} inner step(s) | {kind} | {s['samples_per_gpu']:g} | {parts} | "
                         f"{bound[0]}{s['total']:.1f} | {bound[1]}{s['images_per_s']:.2f} |")
    text = [f"{res['model']} {res['text_s_per_prompt'] * 1e3:.3g} ms per prompt (600 prompts: "
            f"{600 * res['text_s_per_prompt']:.3g} s at start)" for res in results if "text_s_per_prompt" in res]
    sizes = "their real sizes" if meta["gpu"] else "two-layer toys (--quick)"
    lines += [] if not text else ["", f"Text encoders, random weights at {sizes}: " + "; ".join(text) + "."]
    lines += [] if not results else ["", "One row's forward (LoRA included): " + "; ".join(
        f"{res['model']} {res['flops_forward_row'] / 1e9:.4g} GFLOP, {res['image_tokens']} image + "
        f"{res['text_tokens']} text tokens, {res['params'] / 1e6:.4g} M weights + {res['lora_params'] / 1e6:.3g} M LoRA"
        for res in results) + "."]
    if meta["skipped"]:
        lines += ["", f"Not measured, --time-limit reached first: {', '.join(meta['skipped'])}."]
    if meta.get("failed"):
        lines += ["", "**Failed** (what was measured before the error is above): " + "; ".join(meta["failed"]) + "."]
    if meta.get("unfinished"):
        lines += ["", "**Incomplete**: written while the run went on; not finished: " + ", ".join(meta["unfinished"])
                  + "."]
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description="V-GRPO's phases on SD3.5-M- and FLUX.1-dev-shaped transformers")
    p.add_argument("--quick", action="store_true", help="tiny transformers on the CPU in float32 (seconds)")
    p.add_argument("--models", default="sd3,flux", help=f"comma-separated, from: {', '.join(MODELS)}")
    p.add_argument("--time-limit", type=float, default=300, help="seconds after which no phase starts; what was "
                                                                  "measured is written")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the per-iteration split (the paper's runs: 8)")
    p.add_argument("--rollout-steps", type=int, default=4, help="ODE steps timed per rollout, scaled to the recipe's")
    p.add_argument("--attention", default=vgrpo.default_flags()["attention"],
                   help="the SDPA kernels allowed, as vgrpo's --attention")
    p.add_argument("--modes", default="eager,compiled", help="eager, compiled (vgrpo's --compile: each block "
                                                             "compiled) or both, side by side")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per phase after a warm-up; the fastest counts")
    p.add_argument("--profile", action="store_true", help="add torch.profiler's top kernels of one rollout and one "
                                                          "update of each model to the report")
    p.add_argument("--kernels", action="store_true", help="first time each SDPA kernel alone at every model's "
                                                          "attention shapes (a child process, at most 60 s)")
    p.add_argument("--time-kernels", help=argparse.SUPPRESS)   # --kernels' child process: its JSON specification
    p.add_argument("--out", default=os.path.join(HERE, "results", "gpu.md"), help="markdown; the JSON goes beside it")
    p.add_argument("--merge", help="measure nothing: comma-separated gpu.json files of runs on one GPU (a rerun of the "
                                   "models the first had no time for) -> one report of each model's latest result")
    a = p.parse_args(argv)
    if a.merge:
        results, meta = merge_runs(a.merge.split(","))
        write_report(a.out, results, meta)
        print(f"wrote {a.out}")
        return 0
    if a.time_kernels:
        spec = json.loads(a.time_kernels)
        return time_kernels(spec["shapes"], spec["kernels"], torch.device("cpu" if spec["quick"] else "cuda"))
    names = a.models.split(",")
    if not set(names) <= set(MODELS) or not set(a.modes.split(",")) <= {"eager", "compiled"}:
        p.error(f"--models {a.models} --modes {a.modes}: choose from {', '.join(MODELS)}; eager, compiled")
    if not a.quick and not torch.cuda.is_available():
        p.error("no CUDA device here: the GPU benchmark needs one (--quick runs tiny shapes on the CPU)")
    device = torch.device("cpu" if a.quick else "cuda")
    deadline, gpus = time.perf_counter() + a.time_limit, 1 if a.quick else a.gpus
    kernels = None
    if a.kernels:   # before --attention's choice below: measure_kernels sets vgrpo's default to see what torch picks
        print("attention kernels:", flush=True)
        try:
            kernels = measure_kernels(names, a.quick, gpus, timeout=60)
            for r in kernels["rows"]:
                print(f"  {r['kernel']} {r['model']} {r['phase']}: " +
                      (r["error"] if r["error"] else f"{r['ms']:.3g} ms, {r['tflops']:.3g} TFLOP/s"), flush=True)
        except Exception as e:   # noqa: BLE001  (the probe must not cost the models' measurements)
            print(f"  failed: {one_line(e)}", flush=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True   # as vgrpo's --tf32 default
        vgrpo.choose_attention_kernels(a.attention)   # as vgrpo's --attention (cuDNN's fails in the backward)
    vgrpo.quiet_libraries()
    # read once: after a CUDA error the device may not answer, and the report must still be written
    where = dict(gpu=device.type == "cuda", peak_tflops=peak_tflops(device),
                 device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU")
    try:   # the chip's practical ceiling beside the data sheet's peak (a second on a GPU)
        where["matmul_tflops"] = matmul_tflops(device, MATMUL_N if device.type == "cuda" else 512)
        print(f"a plain matrix product: {where['matmul_tflops']:.3g} TFLOP/s", flush=True)
    except Exception as e:   # noqa: BLE001  (it must not cost the models' measurements)
        where["matmul_tflops"] = None
        print(f"the matrix product failed: {one_line(e)}", flush=True)
    results, skipped, failed, pending = [], [], [], [TITLES[name] for name in names]

    def save(current=None):   # the report so far: a run cut short (device.sh's timeout) keeps what it measured
        unfinished = ([f"{current['model']} (being measured)"] if current else []) + pending
        write([with_splits(res, gpus) for res in results + ([current] if current else [])], kernels, a, where,
              gpus, skipped, failed, unfinished, argv)

    save()
    for name in names:
        pending.remove(TITLES[name])
        if time.perf_counter() > deadline:
            print(f"{TITLES[name]}: skipped, --time-limit reached", flush=True)
            skipped.append(TITLES[name])
            continue
        print(f"{TITLES[name]}:", flush=True)
        try:
            res = measure_model(name, a, gpus, device, deadline, save)
            results.append(res)
            if res.get("error"):
                failed.append(f"{TITLES[name]}: {res['error']}")
        except Exception as e:   # noqa: BLE001  (the model could not be built: named, and the next one runs)
            failed.append(f"{TITLES[name]}: {one_line(e)}")
            print(f"  failed: {one_line(e)}", flush=True)
        save()
        try:   # after a CUDA error the allocator may fail too: the report is already written
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:   # noqa: BLE001
            print(f"  freeing memory failed: {one_line(e)}", flush=True)
    save()   # with the models skipped for time
    print(f"wrote {a.out}" + (f"; failed: {'; '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def with_splits(res, gpus):
    """res with its per-iteration splits (iteration_split): eager, and compiled once the compiled rollout, old
    surrogate and update are all measured (the decode and the reward are never compiled: their eager figures)."""
    res["split"] = iteration_split(res, gpus, res["phases"])
    compiled = res.get("compiled") or {}
    res["split_compiled"] = iteration_split(res, gpus, {**res["phases"], **compiled}) \
        if all(phase in compiled for phase in ("rollout", "old surrogate", "update")) else None
    return res


def write(results, kernels, a, where, gpus, skipped, failed, unfinished, argv):
    """results/gpu.md and gpu.json, with where and how they were measured; each written to a temporary file first, so
    that a run killed while writing leaves the previous complete one."""
    import diffusers

    meta = dict(where, torch=torch.__version__, diffusers=diffusers.__version__,
                date=datetime.date.today().isoformat(), dtype="bf16" if where["gpu"] else "float32",
                repeats=a.repeats, gpus=gpus, skipped=skipped, failed=failed, unfinished=unfinished, kernels=kernels,
                command=" ".join(["python bench/gpu.py", *(sys.argv[1:] if argv is None else argv)]))
    write_report(a.out, results, meta)


def write_report(out, results, meta):
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_whole(out, report(results, meta))
    write_whole(os.path.splitext(out)[0] + ".json", json.dumps(dict(meta, results=results), indent=1))


def merge_runs(paths):
    """Several runs' gpu.json, in the order they ran, on one device -> (results, meta): each model's result from the
    run that measured the most of it, the later one on a tie (a run cut off or out of time partway through a model
    replaces no fuller result), the first run's setting with every run's command, the failures and cut-off
    measurements that no later result replaced, and the skipped or never started models that no run measured."""
    def parts_measured(res):
        return (len(res.get("phases") or {}) + len(res.get("compiled") or {}) + bool(res.get("profile"))
                + ("text_s_per_prompt" in res))

    runs = read_runs(paths, ("device", "torch", "dtype", "gpus"), "gpu.py")
    latest = {}   # model -> (run number, result)
    for number, run in enumerate(runs):
        latest.update({res["model"]: (number, res) for res in run["results"] if res["model"] not in latest
                       or parts_measured(res) >= parts_measured(latest[res["model"]][1])})

    def still(key, number, entry):   # an entry of run `number` that the merged results do not make obsolete
        model = entry.split(":")[0].removesuffix(" (being measured)")
        if key == "failed":
            return latest.get(model, (number, None))[0] <= number
        if entry.endswith(" (being measured)"):   # its partial result is the one shown
            return latest.get(model, (None,))[0] == number
        return model not in latest   # skipped, or never started

    meta = {k: v for k, v in runs[0].items() if k != "results"}
    meta.update(command="; then ".join(run["command"] for run in runs),
                kernels=next((run["kernels"] for run in runs if run.get("kernels")), None))
    for key in ("skipped", "failed", "unfinished"):   # each entry once
        meta[key] = list(dict.fromkeys(entry for number, run in enumerate(runs) for entry in run.get(key) or []
                                       if still(key, number, entry)))
    order = list(dict.fromkeys(res["model"] for run in runs for res in run["results"]))
    # the splits made again from the phases: a file of an older bench/gpu.py may hold them made otherwise
    return [with_splits(latest[model][1], meta["gpus"]) for model in order], meta


if __name__ == "__main__":
    sys.exit(main())
