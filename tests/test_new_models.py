"""Qwen-Image and FLUX.2 [klein] (base and distilled) from the stand-ins under their real ids (hub_standins.py):
vgrpo's Euler rollout and decoding against each model's own diffusers pipeline with the same noise, the family's
choices (CFG, shift, LoRA targets, padded prompts), and whole runs launched as users launch them: 2 processes,
resume, FSDP2 over compiled blocks, and the trained LoRA loading into the pipeline."""

import os
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from safetensors.torch import load_file

import vgrpo
from tests.test_launch import SHRINK, launch, read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KLEIN_DISTILLED = "black-forest-labs/FLUX.2-klein-4B"
PROMPTS = ["a red apple", "a blue car on a long road"]


def family(model, max_sequence_length=None):
    args = vgrpo.Args(model=model, mixed_precision="no", resolution=32, gradient_checkpointing=False,
                      max_sequence_length=max_sequence_length)
    return vgrpo.load_family(args, torch.device("cpu")), args


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_euler_rollout_and_decoding_reproduce_the_qwen_image_pipeline(use_hub_cache, guidance):
    """Qwen2.5-VL's prompt template and dropped prefix (the pipeline's encode_prompt), prompts padded to 256 tokens
    behind their mask, packed latents, the exponential dynamic shift, true CFG with the " " negative prompt and
    its per-token rescaling, the VAE's per-channel mean and std: the same latents and pictures as QwenImagePipeline."""
    fam, args = family("qwen-image", max_sequence_length=256)
    assert (type(fam).__name__, fam.latent_shape, fam.cfg, fam.negative_prompt) == ("QwenImageFamily", (4, 64), True,
                                                                                     " ")
    noise = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    call = dict(prompt=PROMPTS, num_inference_steps=4, height=32, width=32, latents=noise.clone(),
                true_cfg_scale=guidance, negative_prompt=" " if guidance > 1 else None, max_sequence_length=256)
    want = fam.pipe(**call, output_type="latent").images
    run_args = vgrpo.Args(model="qwen-image", sampler="euler", guidance=guidance, resolution=32,
                          max_sequence_length=256)
    negative = fam.encode([" "]) if guidance > 1 else None
    emb, mask = fam.encode(PROMPTS)
    assert emb.shape[1] == mask.shape[1] == 256 and mask[:, -1].eq(0).all()       # padded, the padding masked
    got = vgrpo.rollout(fam, fam.transformer, (emb, mask), noise, fam.sigma_grid(4), run_args, negative)
    assert (got - want).abs().max().item() < 1e-4
    pictures = fam.pipe(**{**call, "latents": noise.clone()}, output_type="pt").images
    assert (fam.decode(got) - pictures).abs().max() < 1e-4


def test_qwen_image_cuts_the_padding_every_prompt_of_the_run_has(use_hub_cache, tmp_path):
    """After encode_all has seen every prompt, forwards carry the longest prompt's tokens rounded up to 64, not all
    256: the same velocities (the cut tokens were masked), less work."""
    fam, _ = family("qwen-image", max_sequence_length=256)
    padded = fam.encode(PROMPTS)
    assert fam.encode_all(PROMPTS + [" "], str(tmp_path / "embeddings.pt"))
    longest = int(padded[1].sum(1).max())
    assert fam.text_tokens == -(-longest // 64) * 64 < 256
    cut = fam.encode(PROMPTS)
    assert cut[0].shape[1] == cut[1].shape[1] == fam.text_tokens and fam.encode([" "])[0].shape[1] == fam.text_tokens
    x, sigma = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(2)), torch.tensor([0.7, 0.2])
    with torch.no_grad():
        assert torch.allclose(fam.velocity(fam.transformer, x, sigma, cut),
                              fam.velocity(fam.transformer, x, sigma, padded), atol=1e-5)


@pytest.mark.parametrize("model,guidance", [("flux2-klein", 4.0), ("flux2-klein", 1.0), (KLEIN_DISTILLED, 1.0)])
def test_euler_rollout_and_decoding_reproduce_the_flux2_klein_pipeline(use_hub_cache, model, guidance):
    """Qwen3's three stacked hidden layers through the chat template, 4D text and image ids, packed patchified
    latents, the empirical mu of the shift, true CFG for the base model and none for the distilled one, the VAE's
    batch-norm statistics: the same pictures as Flux2KleinPipeline with the same noise."""
    fam, args = family(model)
    assert fam.cfg == (model != KLEIN_DISTILLED) and fam.latent_shape == (4, 128)
    noise = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    unpacked = noise.transpose(1, 2).reshape(2, 128, 2, 2)                    # the pipeline's (B, 4C, h/2, w/2)
    pictures = fam.pipe(prompt=PROMPTS, num_inference_steps=4, height=32, width=32, latents=unpacked,
                        guidance_scale=guidance, output_type="pt").images
    run_args = vgrpo.Args(model=model, sampler="euler", guidance=guidance, resolution=32)
    negative = fam.encode([""]) if fam.cfg and guidance > 1 else None
    got = vgrpo.rollout(fam, fam.transformer, fam.encode(PROMPTS), noise, fam.sigma_grid(4), run_args, negative)
    assert (fam.decode(got) - pictures).abs().max() < 1e-4


def test_the_klein_shift_is_its_empirical_mu_and_guidance_doubles_the_rollout_rows(use_hub_cache):
    fam, _ = family("flux2-klein")
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    import numpy as np

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(fam.pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=np.linspace(1, 1 / 8, 8), mu=compute_empirical_mu(4, 8))
    assert torch.allclose(fam.sigma_grid(8), scheduler.sigmas.float())
    assert fam.shift_mu(8) != fam.shift_mu(50)                                # mu depends on the steps too
    rows = []
    fam.transformer.register_forward_pre_hook(lambda m, a, k: rows.append(k["hidden_states"].shape[0]),
                                              with_kwargs=True)
    noise = torch.randn(3, *fam.latent_shape)
    for guidance in (4.0, 1.0):
        args = vgrpo.Args(model="flux2-klein", guidance=guidance, sampler="euler", resolution=32, sample_batch=3)
        vgrpo.rollout(fam, fam.transformer, fam.encode(["a", "b", "c"]), noise, fam.sigma_grid(2), args,
                      fam.encode([""]))
    assert rows == [6, 6, 3, 3]                                               # CFG: negative and positive in one pass


@pytest.mark.parametrize("dynamic_shift", [False, True])
def test_a_klein_scheduler_with_flow_sigmas_keeps_the_grid_its_pipeline_samples_on(use_hub_cache, dynamic_shift):
    """A multistep scheduler with use_flow_sigmas (UniPC here) in a klein folder: Flux2KleinPipeline then leaves the
    grid to the scheduler (no linspace sigmas), and the rollout's grid is that one (1e-3 off the linspace's)."""
    from diffusers import UniPCMultistepScheduler

    fam, _ = family("flux2-klein")
    fam.pipe.scheduler = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                                 flow_shift=3.0, use_dynamic_shifting=dynamic_shift)
    fam.pipe(prompt=PROMPTS[:1], num_inference_steps=4, height=32, width=32, guidance_scale=1.0, output_type="pt")
    sampled = fam.pipe.scheduler.sigmas                                       # what the pipeline just sampled on
    assert sampled[-1] == 0 and torch.allclose(fam.sigma_grid(4), sampled.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("model", ["qwen-image", "flux2-klein"])
def test_lora_targets_cover_attention_and_feed_forwards_of_every_block(use_hub_cache, model):
    fam, args = family(model)
    args.full_finetune = False
    vgrpo.add_trainable_weights(fam, args)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in fam.transformer.named_parameters() if ".lora_A" in n}
    per_double = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out"}
    if model == "qwen-image":   # the last block's text-stream output feeds nothing: no adapter (DDP's rule)
        per_double |= {"img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"}
        want = {f"transformer_blocks.{i}.{n}" for i in range(2) for n in per_double} - {
            "transformer_blocks.1.attn.to_add_out", "transformer_blocks.1.txt_mlp.net.0.proj",
            "transformer_blocks.1.txt_mlp.net.2"}
    else:
        per_double |= {"ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"}
        want = {f"transformer_blocks.0.{n}" for n in per_double} | {
            "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_out"}
    assert adapted == want
    x, sigma = torch.randn(2, *fam.latent_shape), torch.tensor([0.5, 0.3])
    v = fam.velocity(fam.transformer, x, sigma, fam.encode(["a", "b"]))
    v.square().sum().backward()
    assert all(p.grad is not None for p in fam.transformer.parameters() if p.requires_grad)   # DDP needs every one
    assert (args.lora_rank, args.lora_alpha) == (64, 128.0)                   # the public recipes' LoRA


def test_the_recipes_and_the_kind_of_each_id():
    for model, kind in (("qwen-image", "qwen-image"), ("Qwen/Qwen-Image", "qwen-image"), ("flux2-klein", "flux2-klein"),
                        (KLEIN_DISTILLED, "flux2-klein"), ("black-forest-labs/FLUX.1-dev", "flux"), ("sd3", "sd3")):
        assert vgrpo.model_kind(model) == kind, model
    q, k = vgrpo.Args(model="qwen-image"), vgrpo.Args(model="flux2-klein")
    assert (q.resolution, q.sample_steps, q.guidance, q.group_size, q.inner_steps, q.lr) == (512, 10, 4.0, 16, 2, 3e-4)
    assert (k.resolution, k.sample_steps, k.guidance, k.group_size, k.prompts_per_step) == (384, 8, 4.0, 16, 48)
    assert (vgrpo.Args(model="sd3").lora_rank, vgrpo.Args(model="sd3").lora_alpha) == (32, 64.0)
    assert vgrpo.Args(model="qwen-image", lora_rank=8).lora_alpha == 16.0


# --------------------------------------------------------------------------- whole runs


LOAD_AND_COMPARE = """
import torch, diffusers
p = getattr(diffusers, '{cls}').from_pretrained('{model}')
g = lambda: p(prompt='a cat', num_inference_steps=2, height=32, width=32, output_type='pt',
              generator=torch.Generator().manual_seed(0), **{extra}).images
a = g(); p.load_lora_weights('{checkpoint}'); b = g()
print('LORA', len(p.transformer.peft_config), tuple(b.shape), float((a - b).abs().max()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("model,cls,extra", [("qwen-image", "QwenImagePipeline", {"true_cfg_scale": 1.0}),
                                             ("flux2-klein", "Flux2KleinPipeline", {"guidance_scale": 4.0})])
def test_two_processes_train_resume_exactly_shard_alike_and_the_lora_loads_into_the_pipeline(hub_cache, tmp_path,
                                                                                              model, cls, extra):
    """The recipe on 2 gloo processes (shrunk: 32 px, 4 steps, 2 prompts x 4, 2 inner steps so the old surrogate
    runs), a checkpoint after iteration 1; resuming from it reproduces iteration 2's weights bit for bit; FSDP2 over
    the family's blocks, compiled (the way a 20B Qwen-Image is trained on GPUs, where --compile auto compiles them),
    trains the same weights to float rounding; the LoRA loads into the model's own pipeline and changes its
    pictures."""
    small = [*SHRINK, "--prompts-per-step", "2", "--group-size", "4", "--mixed-precision", "no", "--save-every", "1",
             "--max-sequence-length", "32"]
    first = launch(os.path.join(ROOT, "vgrpo.py"), "--model", model, *small, "--output-dir", tmp_path / "a",
                   nproc=2, cache=hub_cache)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert [m["iteration"] for m in lines] == [1, 2] and all(m["skipped_steps"] == 0 for m in lines)
    assert all(m["grad_norm"] > 0 for m in lines) and any(m["ratio_min"] < 1 or m["ratio_max"] > 1 for m in lines)
    resumed = launch(os.path.join(ROOT, "vgrpo.py"), "--model", model, *small, "--output-dir", tmp_path / "b",
                     "--resume", tmp_path / "a" / "checkpoint-1", nproc=2, cache=hub_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load_file(tmp_path / "a" / "checkpoint-2" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "b" / "checkpoint-2" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sharded = launch(os.path.join(ROOT, "vgrpo.py"), "--model", model, *small, "--output-dir", tmp_path / "c",
                     "--fsdp", "--compile", "on", nproc=2, cache=hub_cache)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "blocks compiled" in sharded.stdout
    m = read_jsonl(tmp_path / "c" / "metrics.jsonl")
    assert m[0]["compiled_graphs"] > 0 and m[1]["compiled_graphs"] == m[0]["compiled_graphs"]   # no recompiling
    assert m[0]["reward_mean"] == pytest.approx(lines[0]["reward_mean"], rel=1e-4)
    assert m[0]["grad_norm"] == pytest.approx(lines[0]["grad_norm"], rel=1e-3)
    # Compiled kernels round differently, which AdamW's first steps magnify where a gradient is near its eps: measured
    # per tensor, |sharded - DDP| / |DDP| at most 2.5e-3 (klein; 1.5e-5 for Qwen-Image), 0 sharded but not compiled.
    # Shards updated from one process's gradients alone would differ by the order of the weights themselves.
    c = load_file(tmp_path / "c" / "checkpoint-2" / "pytorch_lora_weights.safetensors")
    assert c.keys() == a.keys() and all((c[k] - a[k]).norm() <= 1e-2 * a[k].norm() for k in a)
    code = LOAD_AND_COMPARE.format(cls=cls, model=vgrpo.MODEL_IDS[model], extra=extra,
                                   checkpoint=tmp_path / "a" / "checkpoint-2")
    check = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HF_HUB_CACHE": str(hub_cache)},
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert "LORA 1 (1, 3, 32, 32)" in check.stdout and float(check.stdout.split()[-1]) > 0


def test_a_pipeline_folder_of_another_class_is_named_not_loaded_as_sd3(tmp_path):
    import json

    for cls, kind in (("FluxKontextPipeline", "flux"), ("Flux2KleinPipeline", "flux2-klein"),
                      ("QwenImagePipeline", "qwen-image"), ("WanPipeline", None)):
        folder = tmp_path / cls
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": cls}))
        if kind:
            assert vgrpo.model_kind(str(folder)) == kind
        else:
            with pytest.raises(vgrpo.UsageError, match="its pipeline is a WanPipeline, none of StableDiffusion3Pipeline"):
                vgrpo.model_kind(str(folder))
