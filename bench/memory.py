"""Peak GPU memory of each phase of a V-GRPO iteration at the real SD3.5-Medium and FLUX.1-dev shapes, measured
without a GPU: the real architectures (their published configurations, below) are built on fake CUDA
(tests/fake_cuda.py), so no weight is allocated and every op costs only its shape computation, and the harness's
DeviceMemory adds up the bytes of the live CUDA storages through vgrpo's own update / surrogate / rollout / decode
and reward.py's CLIP reward. (torch.distributed._tools.mem_tracker.MemTracker does not fit: it hooks a gradient
on every parameter, which fails on LoRA's frozen base, and refuses a module called twice while it tracks, which
gradient checkpointing's recomputation and every ODE step do.) Writes bench/results/memory.md.

    python bench/memory.py                 # all four models, LoRA and full fine-tuning, without and with --fsdp:
                                           # about 15 min on 2 CPU cores -> results/memory.md and memory.json
    python bench/memory.py --models sd3 --lora-only
    python bench/memory.py --gpu --time-limit 300   # on a GPU machine: the same code with the caching allocator's
                                           # own counters, beside memory.json's numbers -> results/memory-gpu.md
    python bench/memory.py --guide         # docs/guide.md's memory table from memory.json (and memory-gpu.json,
                                           # where a GPU measured)

Each phase is run the way an iteration runs it, with the recipe's batch settings (vgrpo.RECIPES, one process of
8: P/8 prompt groups of G), and what the iteration keeps alive across phases (the weights, LoRA and AdamW states,
the rollout's latents and conditioning, the decoded images) is resident in every measurement. The update is
measured over one micro-batch and the optimizer step, with AdamW's states already made, as in every update but a
run's first: further micro-batches of a step run one after another into the same gradient buffers, so they reach
the same peak. Attention goes to the fused kernels a GPU picks
(flash attention for bf16 without a mask, else memory-efficient attention): without that, the CPU build's math
path would materialise every attention matrix and double the estimate.

--fsdp: the process is rank 0 of 8 whose process group is torch's fake backend (tests/fake_cuda.py's
fake_processes): FSDP2 shards, all-gathers and reduce-scatters into its own buffers as on a GPU; the collectives
move no data.

Where the bytes are (one process): the resident state by part (the transformer, the VAE, the reward model, AdamW's
states, the rollout's tensors, and what none of them holds), and a census of the update without checkpointing:
every tensor autograd saved for the backward, by kind of node (saved_by_op), beside what else the forward left
allocated and the backward's rise. `--gpu` records the same on the GPU, and memory-gpu.md sets the two side by
side, so a difference between the fake count and the GPU's is found where it is, not guessed. On the GPU it also
finds, per op, the memory an op holds only while it runs (workspace_by_op: cuDNN's convolution workspaces,
attention's scratch), which no tensor holds, for the checkpointed update and the decode of a whole rollout pass.

Not counted (stated apart in the table): the CUDA context and the libraries' workspaces (cuBLAS, cuDNN), and the
caching allocator's rounding and fragmentation (reserved minus allocated). The numbers are bytes of tensors, the
`torch.cuda.max_memory_allocated()` a GPU would report for the same code: the measuring code calls exactly that
(and reset_peak_memory_stats), which the fake-CUDA harness answers, so `--gpu` runs it unchanged on a GPU.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from report_files import read_runs, write_whole  # noqa: E402
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
# Qwen/Qwen-Image, transformer/config.json (diffusers' QwenImageTransformer2DModel defaults are this configuration): 60
# double-stream blocks of 24 heads x 128 (width 3072), 2x2 patches of 16 latent channels, rotary axes (16, 56, 56),
# Qwen2.5-VL-7B's 3584-wide hidden states, no guidance embedding. Its VAE: AutoencoderKLQwenImage's defaults (base
# width 96, multipliers 1, 2, 4, 4, two residual blocks per level, 16 latent channels).
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# black-forest-labs/FLUX.2-klein-base-4B, transformer/config.json: 5 double- and 20 single-stream blocks of 24 heads x
# 128 (width 3072), 2x2-patchified 32 latent channels -> 128 inputs, 4D rotary axes (32, 32, 32, 32) with theta 2000,
# MLP ratio 3, three stacked Qwen3-4B layers (3 x 2560 = 7680) as text, no guidance embedding. Its VAE: FLUX.2's,
# AutoencoderKLFlux2's defaults (128, 256, 512, 512; 32 latent channels; the batch norm over 128 patchified ones).
FLUX2_KLEIN_4B = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                      num_attention_heads=24, joint_attention_dim=7680, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                      rope_theta=2000, guidance_embeds=False)
# text conditioning per sample, (shape, what): SD3.5 = CLIP-L + CLIP-G (77 tokens) then T5 (256), width 4096, and the
# pooled CLIPs; FLUX = T5 (512) and pooled CLIP-L; Qwen-Image = the recipe's 256 Qwen2.5-VL tokens and their mask;
# FLUX.2 [klein] = 512 tokens of three Qwen3 layers
COND_SHAPES = {"sd3": (((77 + 256, 4096), "embedding"), ((2048,), "embedding")),
               "flux": (((512, 4096), "embedding"), ((768,), "embedding")),
               "qwen-image": (((256, 3584), "embedding"), ((256,), "mask")),
               "flux2-klein": (((512, 7680), "embedding"),)}
# laion/CLIP-ViT-H-14 (PickScore_v1 and HPSv2.1 are fine-tunes of it): vision 32 layers x 1280 (16 heads, MLP 5120,
# 14 px patches at 224 px), text 24 layers x 1024 (16 heads, MLP 4096, 77 tokens, vocabulary 49408), projection 1024
VIT_H14 = dict(vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                           image_size=224, patch_size=14, hidden_act="gelu"),
               text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                         max_position_embeddings=77, vocab_size=49408, hidden_act="gelu"),
               projection_dim=1024)
REWARD_OF = {"sd3": "PickScore (ViT-H/14)", "flux": "HPSv2.1 (ViT-H/14)", "qwen-image": "PickScore (ViT-H/14)",
             "flux2-klein": "PickScore (ViT-H/14)"}
TITLES = {"sd3": "SD3.5-Medium", "flux": "FLUX.1-dev", "qwen-image": "Qwen-Image",
          "flux2-klein": "FLUX.2 [klein] base 4B"}
WORLD = 8  # the recipes' processes
REAL_GPU = False  # --gpu: measuring on this machine's GPU, not on fake CUDA
GIB = 2 ** 30


# --------------------------------------------------------------------------- building the real shapes on fake CUDA


def build_family(kind, args):
    """A vgrpo Family around the real-size transformer and VAE, built on the fake GPU (weights cost nothing)."""
    import torch

    import vgrpo

    amp = vgrpo.AMP_DTYPES[args.mixed_precision]
    weights_dtype = torch.float32 if args.full_finetune or amp is None else amp
    with torch.device("cuda"):
        transformer, vae, scheduler, pipe_parts = build_parts(kind)
    # .to("cuda") too: buffers made from numpy (SD3's positional embedding grid) ignore the default device
    transformer.to("cuda", weights_dtype).requires_grad_(False).eval()
    vae.to("cuda", amp or torch.float32).requires_grad_(False).eval()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    pipe = types.SimpleNamespace(transformer=transformer, vae=vae, scheduler=scheduler, vae_scale_factor=8,
                                 **pipe_parts)
    device = torch.device("cuda", 0)
    extra = {"guidance": args.guidance} if kind == "flux" else {}
    return vgrpo.PIPELINES[kind][1](pipe, args.resolution, args.max_sequence_length, device, amp_dtype=amp, **extra)


# each pipeline's scheduler configuration (FLUX.1: resolution-dependent shift; Qwen-Image: its exponential shift;
# klein: its pipeline computes mu itself)
SCHEDULERS = {"sd3": dict(shift=3.0),
              "flux": dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                           base_image_seq_len=256, max_image_seq_len=4096),
              "qwen-image": dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                 time_shift_type="exponential"),
              "flux2-klein": dict(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")}


def pipeline_parts(kind):
    """What a Family reads of its pipeline besides the transformer, the VAE and the scheduler (static methods)."""
    import types as _types

    import diffusers

    if kind == "flux":
        return dict(_prepare_latent_image_ids=diffusers.FluxPipeline._prepare_latent_image_ids,
                    _unpack_latents=diffusers.FluxPipeline._unpack_latents)
    if kind == "qwen-image":
        return dict(_unpack_latents=diffusers.QwenImagePipeline._unpack_latents)
    if kind == "flux2-klein":
        pipeline = diffusers.Flux2KleinPipeline
        return dict(config=_types.SimpleNamespace(is_distilled=False), _prepare_latent_ids=pipeline._prepare_latent_ids,
                    _prepare_text_ids=pipeline._prepare_text_ids, _unpatchify_latents=pipeline._unpatchify_latents)
    return {}


def build_vae(kind, quick=False):
    """The model's VAE at its published configuration (quick: the same class at toy width, for CPU tests)."""
    import diffusers

    if kind == "qwen-image":
        return diffusers.AutoencoderKLQwenImage(**(dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
                                                   if quick else {}))
    if kind == "flux2-klein":
        return diffusers.AutoencoderKLFlux2(**(dict(block_out_channels=(8, 16, 16, 32), layers_per_block=1,
                                                    norm_num_groups=8) if quick else {}))
    config = dict(VAE_16CH, block_out_channels=(8, 16, 16, 32), layers_per_block=1, norm_num_groups=8) \
        if quick else VAE_16CH
    scaling, shift = VAE_FACTORS[kind]
    return diffusers.AutoencoderKL(**config, scaling_factor=scaling, shift_factor=shift)


def build_parts(kind):
    """(transformer, VAE, scheduler, what else of the pipeline the Family reads) at the published configurations."""
    import diffusers

    transformer = {"sd3": ("SD3Transformer2DModel", SD35_MEDIUM), "flux": ("FluxTransformer2DModel", FLUX1_DEV),
                   "qwen-image": ("QwenImageTransformer2DModel", QWEN_IMAGE),
                   "flux2-klein": ("Flux2Transformer2DModel", FLUX2_KLEIN_4B)}[kind]
    return (getattr(diffusers, transformer[0])(**transformer[1]), build_vae(kind),
            diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULERS[kind]), pipeline_parts(kind))


def build_reward():
    """A CLIP ViT-H/14 reward (PickScore's and HPSv2.1's architecture) on the GPU, in float32 as vgrpo loads it."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    import reward
    from tests.hub_standins import clip_processor

    config = CLIPConfig(text_config=VIT_H14["text"], vision_config=VIT_H14["vision"],
                        projection_dim=VIT_H14["projection_dim"])
    with torch.device("cuda"):
        model = CLIPModel(config).eval().to("cuda")
    return reward.clip_similarity_reward(model, clip_processor(), torch.device("cuda", 0), True, 1.0), model


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


def release_freed():
    """Collects Python's garbage and hands the caching allocator's free blocks back: what one measurement freed is
    not the next one's reservation."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def peak_bytes(fn):
    """Peak bytes of CUDA tensors while fn() runs, what is resident before it included, from torch.cuda's own
    counters: on a GPU the caching allocator's; under fake CUDA tests/fake_cuda.py's DeviceMemory answers them
    (storages of fake CUDA tensors, counted until their last tensor dies). -> (allocated, reserved): reserved is
    the allocator's peak reservation on a GPU (None under fake CUDA); (None, None) if it does not fit."""
    import torch

    torch.cuda.synchronize()
    release_freed()
    torch.cuda.reset_peak_memory_stats()
    try:
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), (torch.cuda.max_memory_reserved() if REAL_GPU else None)
    except torch.cuda.OutOfMemoryError:
        return None, None
    finally:
        release_freed()


def saved_by_op(loss, exclude=(), device_type=None):
    """What autograd holds for the backward of `loss`: {kind of node: bytes}, largest first. Every tensor a node saved
    (its `_saved_*` attributes; a custom Function's saved_tensors) counts with its whole storage, once, at the first
    node found holding it; the storages of `exclude` (weights, the batch: resident anyway) are left out, and with
    `device_type` those elsewhere (a CPU scalar, attention's random seeds). Read with checkpointing off: under
    checkpointing, reading a saved tensor recomputes it."""
    import collections

    import torch

    counted = {t.untyped_storage()._cdata for t in exclude}
    by_op, stack, visited = collections.Counter(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in [a for a in dir(node) if a.startswith("_saved_")] + ["saved_tensors"]:
            try:
                value = getattr(node, name, None)
            except RuntimeError:   # a custom Function's tensors already freed
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in counted and \
                        device_type in (None, t.device.type):
                    counted.add(t.untyped_storage()._cdata)
                    by_op[type(node).__name__] += t.untyped_storage().nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return dict(by_op.most_common())


def allocator_counters():
    """What workspace_by_op reads around every op: (a function -> (bytes allocated now, their peak since the last
    reset), a function resetting the peak), the caching allocator's on a GPU: one read of its nested statistics
    (torch.cuda.max_memory_allocated would build and flatten them once per number)."""
    import torch

    def current_and_peak():
        allocated = torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]
        return allocated["current"], allocated["peak"]

    return current_and_peak, torch.cuda.reset_peak_memory_stats


def workspace_by_op(fn, device_type="cuda"):
    """Runs fn() and finds the memory its ops hold only while they run: cuDNN's convolution workspaces, attention
    kernels' scratch, the allocator's rounding. No tensor holds these bytes, so a count of tensors (fake CUDA) misses
    them, while the caching allocator's peak includes them. For every op (a TorchDispatchMode, so autograd's
    backward and checkpointing's recomputation included): its rise of the allocator's peak above the bytes allocated
    before it, less the bytes of the new storages it returned and of its inputs' storages' growth (an `out=`
    tensor resized). -> {"peak": the allocator's peak over fn, "peak_between_ops": the most bytes allocated between
    two ops (what a count of tensors sees), "by_op": {op: [its largest workspace, its inputs' shapes there]},
    largest first}; the allocator's own peak counter is left at the last op's. Not for DTensors (FSDP), whose
    storage is not what the op allocates."""
    import threading

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    current_and_peak, reset_peak = allocator_counters()
    now, _ = current_and_peak()
    found = {"peak": now, "peak_between_ops": now, "by_op": {}}
    one_op_at_a_time = threading.Lock()   # autograd may run CPU nodes beside the GPU's: one peak counter for both

    def storages(tree):
        return {t.untyped_storage()._cdata: t.untyped_storage() for t in tree_leaves(tree)
                if isinstance(t, torch.Tensor) and t.device.type == device_type and t.layout == torch.strided}

    class Workspaces(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            with one_op_at_a_time:
                inputs = storages((args, kwargs))
                sizes_before = {key: storage.nbytes() for key, storage in inputs.items()}
                shapes = [list(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)][:3]
                before, _ = current_and_peak()
                reset_peak()
                out = func(*args, **(kwargs or {}))
                after, peak = current_and_peak()
                made = sum(storage.nbytes() for key, storage in storages(out).items() if key not in inputs)
                grown = sum(max(storage.nbytes() - sizes_before[key], 0) for key, storage in inputs.items())
                workspace = peak - before - made - grown
                found["peak"] = max(found["peak"], peak)
                found["peak_between_ops"] = max(found["peak_between_ops"], after)
                if workspace > found["by_op"].get(str(func), [0])[0]:
                    found["by_op"][str(func)] = [workspace, " ".join("x".join(map(str, s)) for s in shapes)]
            return out

    with Workspaces():
        fn()
    found["by_op"] = dict(sorted(found["by_op"].items(), key=lambda item: -item[1][0]))
    return found


def state_of(module):
    """A module's weights and buffers."""
    return [*module.parameters(), *module.buffers()]


def one_line(error, limit=300):
    """An exception as one line: its type and the first `limit` characters of its message."""
    return f"{type(error).__name__}: " + " ".join(str(error).split())[:limit]


def tensor_bytes(tensors):
    """Bytes this process holds: a DTensor (FSDP2's shard) counts its local part."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def measure(kind, full_finetune, fsdp=False):
    """Every phase of one configuration -> (rows of (phase, bytes, reserved bytes or None, what), its args, where
    the bytes are: in one process the resident state's parts and, where the update without checkpointing fits, its
    census (saved_census); None under --fsdp).
    fsdp: as rank 0 of WORLD processes in torch's fake process group (tests/fake_cuda.py's fake_processes)."""
    with fake_cuda.fake_processes(WORLD) if fsdp else contextlib.nullcontext():
        return measure_phases(kind, full_finetune, fsdp)


def measure_phases(kind, full_finetune, fsdp):
    import gc

    import torch

    import vgrpo

    flags = ["--model", kind, "--device", "cuda", "--output-dir", "/tmp/vgrpo-memory"]
    flags += ["--full-finetune"] if full_finetune else []
    flags += ["--fsdp"] if fsdp else []
    args = vgrpo.parse_args(flags)
    args.micro_batch = math_gcd_micro_batch(args)
    if fsdp:
        vgrpo.setup_distributed("cuda")
    reward_fn, reward_model = build_reward()  # on the GPU for the whole run
    family = build_family(kind, args)
    vgrpo.add_trainable_weights(family, args)
    model = vgrpo.wrap_for_training(family, args, WORLD if fsdp else 1, family.device)
    params = [p for p in family.transformer.parameters() if p.requires_grad]  # after sharding: the local shards
    optimizer = torch.optim.AdamW(params, lr=args.lr, fused=True)
    device, amp = family.device, family.amp_dtype
    samples = args.prompts_per_step // WORLD * args.group_size          # this process's rollout
    cond = tuple(torch.ones(samples, *shape, dtype=torch.long, device=device) if what == "mask" else
                 torch.zeros(samples, *shape, dtype=amp or torch.float32, device=device)
                 for shape, what in COND_SHAPES[kind])
    o = torch.zeros(samples, *family.latent_shape, device=device)
    images = torch.zeros(samples, 3, args.resolution, args.resolution, device=device)
    sigmas = family.sigma_grid(args.sample_steps)

    def minibatch(n):
        eps = torch.zeros(args.n_mc, *family.latent_shape, device=device).expand(n, args.n_mc, *family.latent_shape)
        return {"o": o[:n], "cond": tuple(t[:n] for t in cond), "A": torch.zeros(n, device=device),
                "sigmas": sigmas[:args.n_mc].to(device).expand(n, args.n_mc), "eps": eps}

    one = dataclasses.replace(args, group_size=args.micro_batch, inner_steps=1)   # one micro-batch and the step

    def one_update(batch):
        return vgrpo.update(family, model, optimizer, params, batch, one, 1)

    def update_peak(checkpointing):
        if checkpointing:
            family.transformer.enable_gradient_checkpointing()
        else:
            family.transformer.disable_gradient_checkpointing()
        batch = minibatch(args.micro_batch)
        row = (f"update, checkpointing {'on' if checkpointing else 'off'}", *peak_bytes(
            lambda: one_update(batch)),
            f"{args.micro_batch} samples x {args.n_mc} pairs per forward, then fused AdamW")
        optimizer.zero_grad(set_to_none=True)  # what an update that ran out of memory left
        family.transformer.enable_gradient_checkpointing()
        return row

    def saved_census():
        """One micro-batch's update forward without checkpointing, its inputs indexed as vgrpo.update indexes them:
        what autograd saved for the backward per kind of node (saved_by_op), the bytes the forward left allocated,
        and the backward's peak above them. On a GPU beside the same under fake CUDA, it says which tensors make the
        difference between the two counts. {} if it does not fit; {"error": ...} if it fails (the rows stay)."""
        family.transformer.disable_gradient_checkpointing()
        batch = minibatch(args.micro_batch)
        resident = [*state_of(family.transformer), o, *cond, sigmas,
                    *(t for value in batch.values() for t in (value if isinstance(value, tuple) else (value,)))]
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        try:
            idx = torch.arange(args.micro_batch, device=device)
            s_new, _ = vgrpo.surrogate(family, model, batch["o"][idx], batch["sigmas"][idx], batch["eps"][idx],
                                       vgrpo.rows_of(batch["cond"], idx), args.weighting)
            loss, _ = vgrpo.vgrpo_loss(s_new, s_new.detach(), batch["A"][idx], args.clip_eps)
            torch.cuda.synchronize()
            end_of_forward = torch.cuda.memory_allocated()
            saved = saved_by_op(loss, resident, device.type)
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            torch.cuda.synchronize()
            return dict(saved=saved, forward=end_of_forward - before,
                        backward_peak=torch.cuda.max_memory_allocated() - end_of_forward)
        except torch.cuda.OutOfMemoryError:
            return {}
        except Exception as e:  # noqa: BLE001 - the census only explains the rows: they must not be lost with it
            return {"error": one_line(e, 200)}
        finally:
            del batch, resident
            optimizer.zero_grad(set_to_none=True)
            family.transformer.enable_gradient_checkpointing()
            release_freed()

    # AdamW's states first: every update but a run's first holds them through its forward and backward, while the
    # first makes them only at its step, after the backward's peak (measured so, the checkpointed rows lacked them,
    # all of them where the peak comes before the step). Made by a step of zero gradients: on a real GPU under the
    # fake process group the all-gathered weights are never filled, and the non-finite gradient of an update would
    # skip its step.
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    phases = [update_peak(True)]
    n_weights = sum(p.numel() for p in family.transformer.parameters())
    gc.collect()
    resident = {"the transformer's weights and buffers": tensor_bytes(state_of(family.transformer)),
                "the VAE": tensor_bytes(state_of(family.pipe.vae)),
                "the reward model": tensor_bytes(state_of(reward_model)),
                "AdamW states": tensor_bytes(t for s in optimizer.state.values() for t in s.values()),
                "the rollout's latents, conditioning and images": tensor_bytes([o, *cond, images])}
    resident["none of these"] = torch.cuda.memory_allocated() - sum(resident.values())
    sizes = [("weights (transformer)", tensor_bytes(family.transformer.parameters()), None,
              f"{n_weights / 1e9:.2f} B parameters, {len(params)} trained tensors "
              f"({sum(p.numel() for p in params) / 1e6:.1f} M)"),
             ("AdamW states", tensor_bytes(t for s in optimizer.state.values() for t in s.values() if t.dim() > 0),
              None, "exp_avg + exp_avg_sq (float32) of the trained weights"),
             ("resident between phases", torch.cuda.memory_allocated(), None, "weights, VAE, reward model, AdamW "
              "states, the rollout's latents and conditioning, the images: in every row below")]
    batch = minibatch(args.micro_batch)
    phases.append(("old surrogate (one micro-batch)", *peak_bytes(
        lambda: torch.no_grad()(vgrpo.surrogate)(family, family.transformer, batch["o"], batch["sigmas"],
                                                 batch["eps"], batch["cond"], args.weighting)),
        "no gradients" + ("; the recipe has 1 inner step, so no old pass" if args.inner_steps == 1 else "")))
    n = min(args.sample_batch, samples)
    noise = torch.zeros(n, *family.latent_shape, device=device)
    two_steps = sigmas[-3:]  # every ODE step costs the same: two of them reach the rollout's peak
    cfg = family.cfg and args.guidance > 1   # true CFG: the negative prompt's rows beside the positive ones
    negative = tuple(t[:1] for t in cond) if cfg else None
    phases.append((f"rollout ({n} per pass)", *peak_bytes(
        lambda: vgrpo.rollout(family, family.transformer, tuple(t[:n] for t in cond), noise, two_steps, args,
                              negative)),
        f"--sample-batch {args.sample_batch}, {args.sampler}" + (f", CFG {args.guidance:g}: {2 * n} rows" if cfg
                                                                   else "")))
    phases.append((f"VAE decode ({args.decode_batch} per pass)", *peak_bytes(
        lambda: vgrpo.decode(family, o, args.decode_batch)),
        f"all {samples} latents of the rollout, {args.resolution} px; VAE "
        f"{tensor_bytes(family.pipe.vae.parameters()) / GIB:.2f} GiB"))

    def decode_per_rollout_pass():
        return vgrpo.decode(family, o, n)

    whole_pass_decode_row = (f"VAE decode ({n} per pass, one per rollout pass)",
                             *peak_bytes(decode_per_rollout_pass), "for comparison: what --decode-batch avoids")
    phases.append(whole_pass_decode_row)
    prompts = ["a photograph of a red fox in the snow"] * samples
    phases.append((f"reward: {REWARD_OF[kind]}", *peak_bytes(lambda: reward_fn(images, prompts)),
                   f"all {samples} images in one call, {tensor_bytes(reward_model.parameters()) / GIB:.2f} GiB of "
                   "weights"))
    # last: on a GPU it runs out of memory for FLUX.1-dev, which can leave FSDP2 holding gathered weights
    phases.insert(1, update_peak(False))
    if fsdp:
        return sizes + phases, args, None
    census = dict(resident=resident, **(saved_census() if phases[1][1] is not None else {}))
    if REAL_GPU:
        # what the GPU holds beyond tensors where the recipe peaks (the checkpointed update) and where an H200 held 3
        # GiB more than the fake count (decoding a whole rollout pass at once); not where the row ran out of memory
        passes = {phases[0][0]: lambda: one_update(minibatch(args.micro_batch)),
                  whole_pass_decode_row[0]: decode_per_rollout_pass}
        fits = {row[0] for row in phases if row[1] is not None}
        census["workspaces"] = {phase: workspaces(fn) for phase, fn in passes.items() if phase in fits}
    return sizes + phases, args, census


def workspaces(fn):
    """workspace_by_op(fn) after what earlier phases freed is released; {"error": ...} where it fails (the rows and
    the rest of the census stay)."""
    release_freed()
    try:
        return workspace_by_op(fn)
    except Exception as e:  # noqa: BLE001 - out of memory included
        return {"error": one_line(e, 200)}
    finally:
        release_freed()


def math_gcd_micro_batch(args):
    import math

    return math.gcd(args.prompts_per_step // WORLD * args.group_size // args.inner_steps, 4)


def gib(value):
    return "OOM" if value is None else f"{value / GIB:.2f}"


def measured_with():
    """When and with which torch and diffusers a configuration was measured: a report that keeps earlier rows beside
    a rerun's (--models) says which are which."""
    from importlib.metadata import version

    return f"{time.strftime('%Y-%m-%d')} with torch {version('torch')}, diffusers {version('diffusers')}"


def config_title(name):
    kind, training = name.split(" ", 1)
    return f"{TITLES[kind]}, {training}"


NOT_COUNTED = [
    "## Not in these numbers", "",
    "- The CUDA context, allocated at the first CUDA call: about 0.5-1 GiB on H100 / H200 class GPUs with CUDA 12 "
    "(driver, kernels of torch, cuBLAS / cuDNN handles; cuBLAS adds a workspace per stream, tens of MiB). "
    "`python bench/memory.py --gpu` measures it: `torch.cuda.mem_get_info()`'s used memory after `torch.cuda.init()` "
    "minus `torch.cuda.memory_reserved()`.",
    "- The workspaces ops take from torch's allocator only while they run (cuDNN's convolutions, attention's "
    "scratch): in a GPU's peaks, not in these. `--gpu` measures them per op (workspace_by_op) in the checkpointed "
    "update and the decode of a whole rollout pass.",
    "- The caching allocator's overhead: allocations are rounded up (512 B, and 2 MiB segments for large blocks) and "
    "freed blocks stay reserved; `memory_reserved() - memory_allocated()` is typically 5-20% over a training "
    "iteration, more when many shapes alternate (rollout vs. update here). `--gpu` reports each phase's reservation.",
    "- Pinned host memory (the prompt-embedding store) and everything on the CPU (text encoders offloaded).",
    "- `--ema` (off in every recipe): a float32 copy of the trained weights on the GPU, half the AdamW states row "
    "(its shards under --fsdp), in every phase.",
    "- DDP's gradient buckets (several processes without --fsdp): vgrpo wraps with gradient_as_bucket_view, so the "
    "gradients are views into DDP's buckets, which stay allocated between steps instead of being freed by zero_grad. "
    "The update rows already hold the gradients; add the trained weights' float32 size (half the AdamW states row) "
    "to the other phases' rows: 0.1 / 0.5 GiB with LoRA (SD3.5-M / FLUX.1-dev), 8.4 / 44 GiB with full "
    "fine-tuning. One process (one GPU) has no buckets; under --fsdp the sharded gradients are counted.",
    "- The blocks compiled (`--compile`, on CUDA by default): the rows are eager. Compiled, the old surrogate runs "
    "with gradients, as the update's forward does (so that the two see one compiled graph), and holds what that "
    "forward holds for one micro-batch at a time: more than its row, less than the update's.", ""]


def table_head(columns):
    """The head of a table with one column per (label, census)."""
    return ["| | " + " | ".join(label for label, _ in columns) + " |", "| --- |" + " ---: |" * len(columns)]


def census_lines(columns, top=10):
    """Where one configuration's bytes are (measure's third result), one column per (label, census): the resident
    state's parts, then, where its update without checkpointing was measured in every column, the `top` kinds of
    node by their largest column, the rest summed, and the totals."""
    columns = [(label, census) for label, census in columns if census]
    if not columns:
        return []

    def row(name, values):
        return f"| {name} | " + " | ".join(gib(v) for v in values) + " |"

    lines = ["Where the bytes are, in one process (GiB): the resident state by part, and in the update without "
             "checkpointing (one micro-batch) the tensors autograd saved for the backward, by kind of node "
             "(`saved_by_op`; the weights and the batch, resident, left out), what else the forward left "
             "allocated, and how far the backward rose above the forward's end.", "", *table_head(columns)]
    lines += [row(f"resident: {part}", [census["resident"].get(part) for _, census in columns])
              for part in columns[0][1]["resident"]]
    if all("saved" in census for _, census in columns):
        ops = sorted({op for _, census in columns for op in census["saved"]},
                     key=lambda op: -max(census["saved"].get(op, 0) for _, census in columns))
        lines += [row(f"saved by {op}", [census["saved"].get(op, 0) for _, census in columns]) for op in ops[:top]]
        if len(ops) > top:
            lines.append(row(f"saved by {len(ops) - top} other kinds of node", [
                sum(census["saved"].get(op, 0) for op in ops[top:]) for _, census in columns]))
        saved = [sum(census["saved"].values()) for _, census in columns]
        lines += [row("**saved for the backward, in all**", saved),
                  row("allocated by the forward, saved by no node", [
                      census["forward"] - total for (_, census), total in zip(columns, saved)]),
                  row("the backward's peak above the forward's end", [
                      census["backward_peak"] for _, census in columns])]
    errors = [f"{label}: the census failed: {census['error']}" for label, census in columns if "error" in census]
    return lines + [""] + ([f"- {error}" for error in errors] + [""] if errors else []) + workspace_lines(columns)


def workspace_lines(columns, top=3):
    """census_lines' part for the workspaces (measured on a GPU: workspace_by_op) of the phases where they were."""
    phases = list(dict.fromkeys(phase for _, census in columns for phase in census.get("workspaces", {})))
    if not phases:
        return []

    def cell(value):   # "-": not measured in that column (gib's "OOM" means it did not fit)
        return "-" if value is None else gib(value)

    lines = ["Memory the ops hold only while they run (`workspace_by_op`, GiB): per op, its rise of the allocator's "
             "peak less the tensors it returned. A count of tensors (fake CUDA) has none; on a GPU, the phase's peak "
             "less its peak between two ops is what they added to it.", "", *table_head(columns)]
    errors = []
    for phase in phases:
        found = [census.get("workspaces", {}).get(phase, {}) for _, census in columns]
        errors += [f"{label}, {phase}: {f['error']}" for (label, _), f in zip(columns, found) if "error" in f]
        lines += [f"| {phase}: the peak | " + " | ".join(cell(f.get("peak")) for f in found) + " |",
                  f"| {phase}: the peak between two ops | " + " | ".join(cell(f.get("peak_between_ops"))
                                                                           for f in found) + " |"]
        ops = sorted({op for f in found for op in f.get("by_op", {})},
                     key=lambda op: -max(f.get("by_op", {}).get(op, [0])[0] for f in found))
        for op in ops[:top]:
            where = next(f["by_op"][op][1] for f in found if op in f.get("by_op", {}))
            lines.append(f"| {phase}: the largest workspace of `{op}` (inputs {where}) | " + " | ".join(
                cell(f["by_op"].get(op, [0])[0] if "by_op" in f else None) for f in found) + " |")
    return lines + [""] + ([f"- the workspaces failed: {error}" for error in errors] + [""] if errors else [])


def write_report(results, path):
    """results: {"sd3 LoRA r32": {"settings": str, "one": rows, "fsdp": rows}, ...} -> markdown, and the same as
    JSON beside it (what --gpu compares with)."""
    lines = ["# Peak GPU memory per phase (fake CUDA, the real shapes)", "",
             "`python bench/memory.py` (bench/memory.py says how). One process of 8, each recipe's batch settings "
             "(vgrpo.RECIPES), without and with `--fsdp`. The first three rows are sizes; the phases' rows are "
             "the GiB of live CUDA tensors at the phase's peak, the resident state included "
             "(transformer weights, LoRA / trained weights, AdamW states, the rollout's latents and conditioning, "
             "the decoded images for the reward). Measured under fake CUDA, not on a GPU, in "
             "the seconds of CPU on a 2-core machine that each section gives where it was timed. Runs give the "
             "same bytes (FLUX.1-dev and FLUX.2 [klein] LoRA, with and without --fsdp, three runs under different "
             "hash seeds).", "",
             "Checked against an H200's allocated bytes (SD3.5-M, in the project's GPU issue; both counts with the "
             "reward model in bf16, as then, 1.84 GiB less than now): within 1% on the resident state and the LoRA "
             "update, the 24-image decode 15% under; row by row and why in "
             "bench/README.md, \"Checked against a GPU\".", "",
             "Under `--fsdp` the process is rank 0 of 8 with torch's fake process group (tests/fake_cuda.py, "
             "fake_processes): FSDP2's own all-gather and reduce-scatter buffers are allocated as on a GPU, and the "
             "collectives move no data. Its rows count the block being computed and the next one FSDP2 prefetches.",
             ""]
    for name, result in results.items():
        sharded = {row[0]: row[1] for row in result["fsdp"]}
        when = f" on {result['measured']}" if "measured" in result else ""   # a rerun's beside earlier rows
        took = f". Measured in {result['seconds']:.0f} s{when}." if "seconds" in result else ""
        lines += [f"## {config_title(name)}", "", result["settings"] + took, "",
                  f"| phase | GiB | GiB with --fsdp over {WORLD} | what |", "| --- | ---: | ---: | --- |"]
        lines += [f"| {phase} | {gib(value)} | {gib(sharded[phase])} | {what} |"
                  for phase, value, _, what in result["one"]]
        lines.append("")
        lines += census_lines([("fake CUDA", result.get("census"))])
    with open(path, "w") as f:
        f.write("\n".join(lines + NOT_COUNTED))
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(results, f, indent=1)


def write_gpu_report(results, fake, device_name, context, seconds, path):
    """The GPU's own counters per phase beside the fake-CUDA numbers of the same code (results/memory.json)."""
    lines = [f"# Peak GPU memory per phase, measured on {device_name}", "",
             f"`python bench/memory.py --gpu`, {'?' if seconds is None else f'{seconds:.0f}'} s: the same code as "
             "results/memory.md (random weights "
             "of the real shapes), run on the GPU. allocated: `torch.cuda.max_memory_allocated()` over the phase, "
             "to compare with the fake-CUDA bytes; reserved: `max_memory_reserved()`, the caching allocator's "
             "slack included. `--fsdp` columns: rank 0 of 8 with the fake process group on one GPU. OOM: does not "
             f"fit on this GPU. Memory used outside torch's allocator (used memory minus what torch reserved): "
             f"{gib(context[0])} GiB after `torch.cuda.init()`, " + ("not measured after the runs (the device stopped "
             "answering)" if context[1] is None else f"{gib(context[1])} GiB after the runs") + " (the CUDA "
             "context, kernels loaded lazily, cuBLAS / cuDNN handles and workspaces).", ""]
    for name, result in results.items():
        columns = []
        for key in ("one", "fsdp"):
            faked = {row[0]: row[1] for row in fake.get(name, {}).get(key, [])}
            measured = {row[0]: row[1:3] for row in result.get(key, [])}
            columns.append((faked, measured))
        phases = [row[0] for row in result.get("one") or result.get("fsdp") or []]
        lines += [f"## {config_title(name)}", ""]
        if phases:
            lines += [result["settings"], "", "| phase | fake CUDA | allocated | reserved | fake CUDA, --fsdp | "
                      "allocated, --fsdp | reserved, --fsdp |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for phase in phases:
            cells = []
            for faked, measured in columns:
                allocated, reserved = measured.get(phase, (None, None))
                cells += [gib(faked[phase]) if phase in faked else "-", gib(allocated) if phase in measured else "-",
                          "" if reserved is None else gib(reserved)]
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
        lines += [""] + [f"- {note}" for note in result["notes"]] + [""]
        if result.get("census"):   # beside fake CUDA's: which tensors make the difference between the two counts
            lines += census_lines([("fake CUDA", fake.get(name, {}).get("census")), ("GPU", result["census"])])
    write_whole(path, "\n".join(lines))


def fake_results(path):
    """results/memory.json's fake-CUDA bytes, the GPU report's column beside its own ({} where there are none)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_gpu_files(run, fake, out):
    """The --gpu report (markdown) and its JSON beside it (what --guide and --merge read)."""
    write_gpu_report(run["results"], fake, run["device"], run["outside_torch"], run.get("seconds"), out)
    write_whole(os.path.splitext(out)[0] + ".json", json.dumps(run, indent=1))


def merge_gpu_runs(paths):
    """Several --gpu runs' JSON on one device, in the order they ran -> one run's: each configuration's measurements
    (one process, --fsdp) from the last run that made them, and for what no run measured the last run's notes, where
    they say more than that the run never reached it (a rerun stopped early keeps the first run's failure)."""
    def says_only_not_reached(note):   # for time or because the device had stopped answering: nothing measured
        return ": not run, --time-limit" in note or ": not run, the device stopped answering" in note

    runs = read_runs(paths, ("device", "torch"), "memory.py")
    results = {}
    for run in runs:
        for name, result in run["results"].items():
            into = results.setdefault(name, {"notes": {}})
            for key in ("one", "fsdp"):   # a note says "one process: ..." or "--fsdp over 8: ..."
                if key in result:
                    into[key], into["notes"][key] = result[key], []
                elif key not in into:
                    notes = [n for n in result["notes"] if n.startswith("--fsdp") == (key == "fsdp")]
                    if not into["notes"].get(key) or not all(says_only_not_reached(note) for note in notes):
                        into["notes"][key] = notes
            into.update({k: result[k] for k in ("settings", "census") if result.get(k)})
    for result in results.values():
        result["notes"] = [note for key in ("one", "fsdp") for note in result["notes"].get(key, [])]
    seconds = [run.get("seconds") for run in runs]
    return dict(device=runs[0]["device"], torch=runs[0]["torch"], results=results,
                outside_torch=[runs[0]["outside_torch"][0], runs[-1]["outside_torch"][1]],
                seconds=None if None in seconds else sum(seconds))


# GPU memory sizes on sale (GB) -> the GiB the smallest common card of each size reports: x 0.93 up to 48 GB (L4 and
# A10, 24 GB: 22.5 GiB; L40S, 48 GB: 45 GiB), 79.6 for the H100 80 GB, 140.4 for the H200
CARDS = {16: 14.9, 24: 22.3, 32: 29.8, 48: 44.6, 80: 79.6, 141: 140.4}
GUIDE = os.path.join(ROOT, "docs", "guide.md")
GUIDE_MARKS = ("<!-- memory table: python bench/memory.py --guide -->", "<!-- end of the memory table -->")


def fits_on(need, slack):
    """The smallest card that holds `need` + `slack` GiB, and a smaller one that holds `need` alone (tight); need
    None: the peak was not measured (out of memory)."""
    if need is None:
        return "none: use `--fsdp`"
    roomy = next((card for card, gib in CARDS.items() if need + slack <= gib), None)
    tight = next((card for card, gib in CARDS.items() if need <= gib), None)
    if roomy is None:
        return "none: use `--fsdp`" if tight is None else f"{tight} GB (tight)"
    return f"{roomy} GB" + (f" ({tight} GB is tight)" if tight < roomy else "")


def guide_table(fake, gpu=None):
    """docs/guide.md's memory table: per configuration the resident state and the update's peak (checkpointing on /
    off), in one process and under --fsdp over 8, and the smallest GPU each fits on. From the GPU's counters where
    `--gpu` measured it (gpu: memory-gpu.json; allocated bytes shown, the reserved peak plus the memory outside
    torch's allocator decide the fit, with 5% to spare), else from fake CUDA (its bytes plus 1 GiB of CUDA context,
    with 10% to spare for the allocator; marked as such in a table that has GPU figures)."""
    def size(value):
        return "OOM" if value is None else f"{value / GIB:.1f}" if value < 100 * GIB else f"{value / GIB:.0f}"

    if gpu is not None and "results" not in gpu:
        raise ValueError("memory-gpu.json is in the format before the device and the memory outside torch were "
                         "recorded: run bench/memory.py --gpu again")
    measured = (gpu or {}).get("results", {})
    # the memory outside torch's allocator: its last reading (after the runs), else the one at start (a device that
    # stopped answering), else none read: the 1 GiB of context the fake figures assume, never 0
    outside = next((v for v in reversed((gpu or {}).get("outside_torch") or []) if v is not None), GIB)

    def figures(name, key):   # resident, update peaks on / off, the fit, "(fake CUDA)" where the GPU did not measure
        on_gpu = {row[0]: row[1:3] for row in measured.get(name, {}).get(key, [])}
        rows = on_gpu or {row[0]: row[1:3] for row in fake[name][key]}
        (on, reserved), (off, _) = rows["update, checkpointing on"], rows["update, checkpointing off"]
        if on is None:   # out of memory on the GPU
            need = slack = None
        else:
            need = (reserved + outside) / GIB if on_gpu else on / GIB + 1
            slack = need * 0.05 if on_gpu else on / GIB * 0.1
        fit = fits_on(need, slack)
        mark = " (fake CUDA)" if measured and not on_gpu else ""   # only a table that mixes the two marks them
        return size(rows["resident between phases"][0]), size(on), size(off), fit, mark

    lines = ["| model, training | resident: weights, AdamW, rollout | peak: update, checkpointing on / off | fits on | "
             f"`--fsdp` over {WORLD}: resident, peak | fits on, with `--fsdp` |",
             "| --- | ---: | ---: | --- | ---: | --- |"]
    for name in fake:
        kind, training = name.split(" ", 1)
        label = f"{TITLES[kind]}, {training}" + (", bf16 base" if training.startswith("LoRA") else "") + \
            (" (stand-ins only)" if kind in ("qwen-image", "flux2-klein") else "")
        resident, on, off, fit, mark = figures(name, "one")
        resident_sharded, on_sharded, _, fit_sharded, mark_sharded = figures(name, "fsdp")
        lines.append(f"| {label} | {resident} GiB{mark} | {on} / {off} GiB{mark} | {fit} | {resident_sharded}, "
                     f"{on_sharded} GiB{mark_sharded} | {fit_sharded} |")
    return "\n".join(lines)


def results_table():
    """guide_table of results/memory.json and, where it exists, results/memory-gpu.json."""
    found = []
    for name in ("memory.json", "memory-gpu.json"):
        path = os.path.join(RESULTS, name)
        if os.path.isfile(path):
            with open(path) as f:
                found.append(json.load(f))
    return guide_table(*found)


def update_guide(table, path=GUIDE):
    """Put `table` between docs/guide.md's two marks (in place of what was there)."""
    with open(path) as f:
        text = f.read()
    start, end = text.index(GUIDE_MARKS[0]) + len(GUIDE_MARKS[0]), text.index(GUIDE_MARKS[1])
    with open(path, "w") as f:
        f.write(text[:start] + "\n" + table + "\n" + text[end:])


def describe_settings(args):
    return (f"{args.resolution} px, {args.mixed_precision}, P {args.prompts_per_step} x G {args.group_size} over "
            f"{WORLD} processes, N_MC {args.n_mc}, micro-batch {args.micro_batch}, sample batch {args.sample_batch}, "
            f"decode batch {args.decode_batch}, {args.inner_steps} inner step(s)")


def measure_one(kind, full_finetune, fsdp):
    """One configuration on fake CUDA, in a fresh worker process (nothing of an earlier one is still counted)."""
    import torch

    import vgrpo

    vgrpo.quiet_libraries()
    with fake_cuda.FakeCuda(strict=False) as gpu, \
            fake_cuda._patched(torch.nn.functional, "scaled_dot_product_attention", fused_attention):
        rows, args, census = measure(kind, full_finetune, fsdp)
        if gpu.mixes:
            print(f"device mixes seen: {gpu.mixes[:3]}", file=sys.stderr)
    return rows, describe_settings(args), census


def measure_on_gpu(kind, full_finetune, fsdp):
    """One configuration on this machine's GPU; its weights are freed before the next one starts."""
    try:
        rows, args, census = measure(kind, full_finetune, fsdp)
    finally:
        with contextlib.suppress(Exception):   # after a CUDA error this raises it again: the first one is reported
            release_freed()
    return rows, describe_settings(args), census


def config_name(kind, full):
    import vgrpo

    return f"{kind} {'full fine-tuning' if full else f'LoRA r{vgrpo.Args(model=kind).lora_rank}'}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd3,flux,qwen-image,flux2-klein")
    parser.add_argument("--out", help="markdown, its JSON beside it (default: results/memory.md; with --gpu, "
                        "results/memory-gpu.md)")
    parser.add_argument("--lora-only", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="measure on this machine's GPU with the caching "
                        "allocator's own counters, beside the fake-CUDA numbers of --fake-results")
    parser.add_argument("--fake-results", default=os.path.join(RESULTS, "memory.json"))
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="--gpu: seconds after which no configuration starts")
    parser.add_argument("--guide", action="store_true", help="measure nothing: write docs/guide.md's memory table "
                        "from results/memory.json and, where it measured, results/memory-gpu.json")
    parser.add_argument("--merge", help="measure nothing: comma-separated memory-gpu.json files of --gpu runs on one "
                        "GPU (a rerun of what the first had no time for) -> one report, --out (results/memory-gpu.md)")
    args = parser.parse_args(argv)
    if args.merge:
        run = merge_gpu_runs(args.merge.split(","))
        out = args.out or os.path.join(RESULTS, "memory-gpu.md")
        write_gpu_files(run, fake_results(args.fake_results), out)
        print(f"wrote {out}")
        return 0
    if args.guide:
        update_guide(results_table())
        print(f"wrote the memory table of {GUIDE}")
        return 0
    args.out = args.out or os.path.join(RESULTS, "memory-gpu.md" if args.gpu else "memory.md")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    configs = [(kind, full) for kind in args.models.split(",")
               for full in ((False,) if args.lora_only else (False, True))]
    start, results = time.time(), {}
    if args.gpu:
        return main_on_gpu(args, configs, start)
    library, why = fake_cuda.build_library()
    if library is None:
        print(f"bench/memory.py: {why} (on a GPU machine: --gpu)", file=sys.stderr)
        return 2
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for kind, full in configs:
        t, name, result = time.time(), config_name(kind, full), {}
        for key, fsdp in (("one", False), ("fsdp", True)):
            with fake_cuda.Worker(library, env) as worker:  # the fake CUDA hooks exist only in a preloaded process
                result[key], result["settings"], census = worker.call("bench.memory", "measure_one", kind=kind,
                                                                      full_finetune=full, fsdp=fsdp)
                result["census"] = result.get("census") or census
        result["seconds"], result["measured"] = time.time() - t, measured_with()
        results[name] = result
        print(f"{name}: {time.time() - t:.0f} s  (GiB; with --fsdp over {WORLD})", flush=True)
        for row, sharded in zip(result["one"], result["fsdp"]):
            print(f"  {row[0]:48s} {gib(row[1]):>8s} {gib(sharded[1]):>8s}", flush=True)
    earlier = os.path.splitext(args.out)[0] + ".json"   # the configurations not measured now keep their rows
    if os.path.isfile(earlier):
        with open(earlier) as f:
            results = {**json.load(f), **results}
    write_report(results, args.out)
    print(f"wrote {args.out}")
    return 0


def main_on_gpu(args, configs, start):
    global REAL_GPU
    import torch

    if not torch.cuda.is_available():
        print("bench/memory.py --gpu: no CUDA device here (without --gpu it measures on fake CUDA)", file=sys.stderr)
        return 2
    REAL_GPU = True
    import vgrpo

    vgrpo.quiet_libraries()
    vgrpo.choose_attention_kernels(vgrpo.default_flags()["attention"])   # as a run on CUDA: no cuDNN attention
    def outside_torch():  # the CUDA context, the libraries' handles and workspaces (and any other process)
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved(), total

    def outside_torch_now():   # None once the device stopped answering (a CUDA error poisons the process's context)
        try:
            torch.cuda.synchronize()
            return outside_torch()[0]
        except Exception:  # noqa: BLE001 - whatever the error, the report of what was measured is written
            return None

    torch.cuda.init()
    context_at_init, total = outside_torch()
    device = torch.cuda.get_device_name()
    fake = fake_results(args.fake_results)
    results, answering = {}, True
    for kind, full in configs:
        name, result, notes = config_name(kind, full), {}, []
        results[name] = result
        for key, fsdp in (("one", False), ("fsdp", True)):
            label = f"--fsdp over {WORLD}" if fsdp else "one process"
            need = {row[0]: row[1] for row in fake.get(name, {}).get(key, [])}.get("update, checkpointing on")
            if not answering:
                notes.append(f"{label}: not run, the device stopped answering")
            elif need and need > total:
                notes.append(f"{label}: not run, fake CUDA's update peak {gib(need)} GiB exceeds this GPU's "
                             f"{gib(total)} GiB")
            elif time.time() - start > args.time_limit:
                notes.append(f"{label}: not run, --time-limit {args.time_limit:.0f} s reached")
            else:
                try:
                    result[key], result["settings"], census = measure_on_gpu(kind, full, fsdp)
                    result["census"] = result.get("census") or census
                except torch.cuda.OutOfMemoryError:
                    notes.append(f"{label}: the weights and optimizer states alone do not fit")
                except Exception as e:  # noqa: BLE001 - one configuration's failure is reported, the rest run
                    notes.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    answering = outside_torch_now() is not None
            result["notes"] = notes
            # after every measurement, so that a run cut short by a timeout leaves what it measured
            context = (context_at_init, outside_torch_now() if answering else None)
            write_gpu_files(dict(device=device, torch=torch.__version__, outside_torch=context,
                                 seconds=time.time() - start, results=results), fake, args.out)
        print(f"{name}: {time.time() - start:.0f} s {'; '.join(notes)}", flush=True)
    print(f"wrote {args.out}")
    return 0 if answering else 1


if __name__ == "__main__":
    sys.exit(main())
