"""Peak GPU memory of each phase of a V-GRPO iteration at the real SD3.5-Medium and FLUX.1-dev shapes, measured
without a GPU: the real architectures (their published configurations, below) are built on fake CUDA
(tests/fake_cuda.py), so no weight is allocated and every op costs only its shape computation, and the harness's
DeviceMemory adds up the bytes of the live CUDA storages through vgrpo's own update / surrogate / rollout / decode
and reward.py's CLIP reward. (torch.distributed._tools.mem_tracker.MemTracker does not fit: it hooks a gradient
on every parameter, which fails on LoRA's frozen base, and refuses a module called twice while it tracks, which
gradient checkpointing's recomputation and every ODE step do.) Writes bench/results/memory.md.

    python bench/memory.py                 # both models, LoRA and full fine-tuning: ~80 s on 2 busy CPU cores
    python bench/memory.py --models sd3    # one model

Each phase is run the way an iteration runs it, with the recipe's batch settings (vgrpo.RECIPES, one process of
8: P/8 prompt groups of G), and what the iteration keeps alive across phases (the weights, LoRA and AdamW states,
the rollout's latents and conditioning, the decoded images) is resident in every measurement. The update is
measured over one micro-batch and the optimizer step: further micro-batches of a step run one after another into
the same gradient buffers, so they reach the same peak. Attention goes to the fused kernels a GPU picks
(flash attention for bf16 without a mask, else memory-efficient attention): without that, the CPU build's math
path would materialise every attention matrix and double the estimate.

Not counted (stated apart in the table): the CUDA context and the libraries' workspaces (cuBLAS, cuDNN), and the
caching allocator's rounding and fragmentation (reserved minus allocated). The numbers are bytes of tensors, the
`torch.cuda.max_memory_allocated()` a GPU would report for the same code.
"""

import argparse
import dataclasses
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests import fake_cuda  # noqa: E402

# --------------------------------------------------------------------------- the published configurations (facts)
# stabilityai/stable-diffusion-3.5-medium, transformer/config.json: MMDiT-X, 24 blocks of 24 heads x 64 (width
# 1536), dual (self + joint) attention in blocks 0-12, RMS qk-norm, patch 2 over 16 latent channels, T5 width 4096,
# pooled CLIP-L + CLIP-G 2048, positional embedding grid 384.
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                   qk_norm="rms_norm")
# black-forest-labs/FLUX.1-dev, transformer/config.json: 19 double-stream + 38 single-stream blocks of 24 heads x 128
# (width 3072), 64 packed input channels, rotary axes (16, 56, 56), guidance embedding, T5 4096, CLIP-L pooled 768.
FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56))
# vae/config.json of both: AutoencoderKL, 4 levels (128, 256, 512, 512), 2 ResNets per level, 16 latent channels,
# no quant convs; only the scaling / shift factors differ.
VAE_16CH = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                latent_channels=16, norm_num_groups=32, sample_size=1024, use_quant_conv=False,
                use_post_quant_conv=False)
VAE_FACTORS = {"sd3": (1.5305, 0.0609), "flux": (0.3611, 0.1159)}
# text conditioning per sample: SD3.5 = CLIP-L + CLIP-G (77 tokens) then T5 (256), width 4096; FLUX = T5 (512)
COND_SHAPES = {"sd3": ((77 + 256, 4096), (2048,)), "flux": ((512, 4096), (768,))}
# laion/CLIP-ViT-H-14 (PickScore_v1 and HPSv2.1 are fine-tunes of it): vision 32 layers x 1280 (16 heads, MLP 5120,
# 14 px patches at 224 px), text 24 layers x 1024 (16 heads, MLP 4096, 77 tokens, vocabulary 49408), projection 1024
VIT_H14 = dict(vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                           image_size=224, patch_size=14, hidden_act="gelu"),
               text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                         max_position_embeddings=77, vocab_size=49408, hidden_act="gelu"),
               projection_dim=1024)
REWARD_OF = {"sd3": "PickScore (ViT-H/14)", "flux": "HPSv2.1 (ViT-H/14)"}
WORLD = 8  # the recipes' processes
AMP_OF = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}
GIB = 2 ** 30


# --------------------------------------------------------------------------- building the real shapes on fake CUDA


def build_family(kind, args):
    """A vgrpo Family around the real-size transformer and VAE, built on the fake GPU (weights cost nothing)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel, \
        SD3Transformer2DModel

    import vgrpo

    amp = vgrpo.AMP_DTYPES[args.mixed_precision]
    weights_dtype = torch.float32 if args.full_finetune or amp is None else amp
    with torch.device("cuda"):
        if kind == "sd3":
            transformer = SD3Transformer2DModel(**SD35_MEDIUM)
            scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        else:
            transformer = FluxTransformer2DModel(**FLUX1_DEV)
            scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
        scaling, shift = VAE_FACTORS[kind]
        vae = AutoencoderKL(**VAE_16CH, scaling_factor=scaling, shift_factor=shift)
    # .to("cuda") too: buffers made from numpy (SD3's positional embedding grid) ignore the default device
    transformer.to("cuda", weights_dtype).requires_grad_(False).eval()
    vae.to("cuda", amp or torch.float32).requires_grad_(False).eval()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    pipe = types.SimpleNamespace(transformer=transformer, vae=vae, scheduler=scheduler, vae_scale_factor=8,
                                 _prepare_latent_image_ids=FluxPipeline._prepare_latent_image_ids,
                                 _unpack_latents=FluxPipeline._unpack_latents)
    device = torch.device("cuda", 0)
    family_class = vgrpo.FluxFamily if kind == "flux" else vgrpo.SD3Family
    extra = {"guidance": args.guidance} if kind == "flux" else {}
    return family_class(pipe, args.resolution, args.max_sequence_length, device, amp_dtype=amp, **extra)


def build_reward(dtype_name):
    import torch

    amp = getattr(torch, dtype_name)
    from transformers import CLIPConfig, CLIPModel

    import reward
    from tests.hub_standins import clip_processor

    config = CLIPConfig(text_config=VIT_H14["text"], vision_config=VIT_H14["vision"],
                        projection_dim=VIT_H14["projection_dim"])
    with torch.device("cuda"):
        model = CLIPModel(config).eval().to("cuda")
    return reward.clip_similarity_reward(model, clip_processor(), torch.device("cuda", 0), True, 1.0, amp), model


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """What scaled_dot_product_attention runs on a GPU: flash attention (bf16 / fp16, no mask) or the
    memory-efficient kernel; both keep O(L) memory per head instead of the math path's L x L matrix."""
    import torch

    aten = torch.ops.aten
    if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and key.shape[1] == query.shape[1]:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, query.requires_grad,
                                                        dropout_p, is_causal, scale=scale)[0]


# --------------------------------------------------------------------------- measuring


def peak_bytes(gpu, fn):
    """Peak bytes of live CUDA tensors while fn() runs, what is resident before it included (tests/fake_cuda.py's
    DeviceMemory: storages of fake CUDA tensors, counted until their last tensor dies)."""
    import gc

    gc.collect()
    gpu.memory.reset_peak()
    fn()
    gc.collect()
    return gpu.memory.peak


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(gpu, kind, full_finetune):
    """Every phase of one configuration -> (rows of (phase, GiB, what is resident / the batch), its args)."""
    import torch

    import vgrpo

    flags = ["--model", kind, "--device", "cuda", "--output-dir", "/tmp/vgrpo-memory"]
    flags += ["--full-finetune"] if full_finetune else []
    args = vgrpo.parse_args(flags)
    args.micro_batch = math_gcd_micro_batch(args)
    reward_fn, reward_model = build_reward(AMP_OF[args.mixed_precision])  # on the GPU for the whole run
    family = build_family(kind, args)
    params = vgrpo.add_trainable_weights(family, args)
    optimizer = torch.optim.AdamW(params, lr=args.lr, fused=True)
    device, amp = family.device, family.amp_dtype
    samples = args.prompts_per_step // WORLD * args.group_size          # this process's rollout
    (emb_shape, pooled_shape), cond_dtype = COND_SHAPES[kind], amp or torch.float32
    cond = (torch.zeros(samples, *emb_shape, dtype=cond_dtype, device=device),
            torch.zeros(samples, *pooled_shape, dtype=cond_dtype, device=device))
    o = torch.zeros(samples, *family.latent_shape, device=device)
    images = torch.zeros(samples, 3, args.resolution, args.resolution, device=device)
    rows = []
    weights = tensor_bytes(family.transformer.parameters())
    n_weights = sum(p.numel() for p in family.transformer.parameters())
    n_trained = sum(p.numel() for p in params)
    rows.append(("weights (transformer)", weights, f"{n_weights / 1e9:.2f} B parameters, {len(params)} trained "
                 f"tensors ({n_trained / 1e6:.1f} M)"))
    sigmas = family.sigma_grid(args.sample_steps)

    def minibatch(n):
        eps = torch.zeros(args.n_mc, *family.latent_shape, device=device).expand(n, args.n_mc, *family.latent_shape)
        return {"o": o[:n], "cond": tuple(t[:n] for t in cond), "A": torch.zeros(n, device=device),
                "sigmas": sigmas[:args.n_mc].to(device).expand(n, args.n_mc), "eps": eps}

    one = dataclasses.replace(args, group_size=args.micro_batch, inner_steps=1)   # one micro-batch and the step
    for checkpointing in (True, False):
        if checkpointing:
            family.transformer.enable_gradient_checkpointing()
        else:
            family.transformer.disable_gradient_checkpointing()
        batch = minibatch(args.micro_batch)
        peak = peak_bytes(gpu, lambda: vgrpo.update(family, family.transformer, optimizer, params, batch, one, 1))
        rows.append((f"update, checkpointing {'on' if checkpointing else 'off'}", peak,
                     f"{args.micro_batch} samples x {args.n_mc} pairs per forward, then fused AdamW"))
    states = tensor_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    rows.insert(1, ("AdamW states", states, "exp_avg + exp_avg_sq (float32) of the trained weights"))
    import gc

    gc.collect()
    gpu.memory.reconcile()
    rows.insert(2, ("resident between phases", gpu.memory.current, "weights, VAE, reward model, AdamW states, the "
                    "rollout's latents and conditioning, the images: in every row below"))
    family.transformer.enable_gradient_checkpointing()
    batch = minibatch(args.micro_batch)
    rows.append(("old surrogate (one micro-batch)", peak_bytes(
        gpu, lambda: torch.no_grad()(vgrpo.surrogate)(family, family.transformer, batch["o"], batch["sigmas"],
                                                 batch["eps"], batch["cond"], args.weighting)),
        "no gradients" + ("; the recipe has 1 inner step, so no old pass" if args.inner_steps == 1 else "")))
    n = min(args.sample_batch, samples)
    noise = torch.zeros(n, *family.latent_shape, device=device)
    two_steps = sigmas[-3:]  # every ODE step costs the same: two of them reach the rollout's peak
    rows.append((f"rollout ({n} per pass)", peak_bytes(
        gpu, lambda: vgrpo.rollout(family, family.transformer, tuple(t[:n] for t in cond), noise, two_steps, args),
        ), f"--sample-batch {args.sample_batch}, {args.sampler}"))
    rows.append((f"VAE decode ({args.decode_batch} per pass)", peak_bytes(
        gpu, lambda: vgrpo.decode(family, o, args.decode_batch)),
        f"all {samples} latents of the rollout, {args.resolution} px; VAE "
        f"{tensor_bytes(family.pipe.vae.parameters()) / GIB:.2f} GiB"))
    prompts = ["a photograph of a red fox in the snow"] * samples
    rows.append((f"reward: {REWARD_OF[kind]}", peak_bytes(gpu, lambda: reward_fn(images, prompts)),
                 f"all {samples} images in one call, {tensor_bytes(reward_model.parameters()) / GIB:.2f} GiB of "
                 "weights"))
    return rows, args


def math_gcd_micro_batch(args):
    import math

    return math.gcd(args.prompts_per_step // WORLD * args.group_size // args.inner_steps, 4)


def write_report(results, seconds, path):
    lines = ["# Peak GPU memory per phase (fake CUDA, the real shapes)", "",
             "`python bench/memory.py` (bench/memory.py says how). One process of 8, each recipe's batch settings "
             "(vgrpo.RECIPES). The first two rows are sizes; the phases' rows are the GiB of live CUDA tensors at "
             "the phase's peak, the resident state included "
             "(transformer weights, LoRA / trained weights, AdamW states, the rollout's latents and conditioning, "
             "the decoded images for the reward). Measured in "
             f"{seconds:.0f} s of CPU on a 2-core machine, no GPU.", ""]
    for (kind, full), (rows, args) in results.items():
        lines += [f"## {'SD3.5-Medium' if kind == 'sd3' else 'FLUX.1-dev'}, "
                  f"{'full fine-tuning' if full else f'LoRA r{args.lora_rank}'}", "",
                  f"{args.resolution} px, {args.mixed_precision}, P {args.prompts_per_step} x G {args.group_size} "
                  f"over {WORLD} processes, N_MC {args.n_mc}, micro-batch {args.micro_batch}, sample batch "
                  f"{args.sample_batch}, decode batch {args.decode_batch}, {args.inner_steps} inner step(s)", "",
                  "| phase | GiB | what |", "| --- | ---: | --- |"]
        lines += [f"| {phase} | {value / GIB:.2f} | {what} |" for phase, value, what in rows]
        lines.append("")
    lines += ["## Not in these numbers", "",
              "- The CUDA context, allocated at the first CUDA call: about 0.5-1 GiB on H100 / H200 class GPUs with "
              "CUDA 12 (driver, kernels of torch, cuBLAS / cuDNN handles; cuBLAS adds a workspace per stream, "
              "tens of MiB). Read it on the GPU as `torch.cuda.mem_get_info()` used after `torch.cuda.init()` minus "
              "`torch.cuda.memory_reserved()`.",
              "- The caching allocator's overhead: allocations are rounded up (512 B, and 2 MiB segments for large "
              "blocks) and freed blocks stay reserved; `memory_reserved() - memory_allocated()` is typically 5-20% "
              "over a training iteration, more when many shapes alternate (rollout vs. update here).",
              "- Pinned host memory (the prompt-embedding store) and everything on the CPU (text encoders offloaded).",
              "- --fsdp (8 processes): not measured. torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker needs "
              "fully_shard over a process group, and FSDP2 makes CUDA streams and events for its all-gathers, which "
              "the CPU build of torch cannot create (torch.cuda.Stream needs the CUDA runtime); a fake process group "
              "with Python stand-ins for the streams was not attempted. By construction FSDP2 divides the weights, "
              "gradients and AdamW states (the first two rows, and the gradients inside the update rows) by the "
              "number of processes and adds the all-gathered blocks being computed (one or two).",
              ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def measure_one(kind, full_finetune):
    """One configuration, in a fresh fake-CUDA worker process (so nothing of an earlier one is still counted)."""
    import torch

    import vgrpo

    vgrpo.quiet_libraries()
    with fake_cuda.FakeCuda(strict=False) as gpu, \
            fake_cuda._patched(torch.nn.functional, "scaled_dot_product_attention", fused_attention):
        rows, args = measure(gpu, kind, full_finetune)
        if gpu.mixes:
            print(f"device mixes seen: {gpu.mixes[:3]}", file=sys.stderr)
    return rows, types.SimpleNamespace(**dataclasses.asdict(args))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd3,flux")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "memory.md"))
    parser.add_argument("--lora-only", action="store_true")
    args = parser.parse_args(argv)
    library, why = fake_cuda.build_library()
    if library is None:
        print(f"bench/memory.py: {why}", file=sys.stderr)
        return 2
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start, results = time.time(), {}
    for kind in args.models.split(","):
        for full in (False,) if args.lora_only else (False, True):
            t = time.time()
            with fake_cuda.Worker(library, env) as worker:  # the fake CUDA hooks exist only in a preloaded process
                results[kind, full] = worker.call("bench.memory", "measure_one", kind=kind, full_finetune=full)
            print(f"{kind} {'full' if full else 'lora'}: {time.time() - t:.0f} s", flush=True)
            for phase, value, _ in results[kind, full][0]:
                print(f"  {phase:40s} {value / GIB:8.2f} GiB", flush=True)
    write_report(results, time.time() - start, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
