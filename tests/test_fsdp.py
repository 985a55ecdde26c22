"""FSDP2 sharding (--fsdp) on CPU with gloo and 2 torchrun processes, against DDP on the same global batch:
the same weights within float rounding, half the per-process state, exact resumes (also on another number of
processes), and a full fine-tuning checkpoint that diffusers loads and that reproduces the trained model's rollout.

    python -m pytest tests/test_fsdp.py -q  # about 6 runs of a tiny model, a few minutes on 2 cores
"""

import json
import os
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from safetensors.torch import load_file

import vgrpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SMALL = ["--model", "tiny", "--sample-steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "2",
         "--n-mc", "2", "--sample-batch", "2", "--sample-every", "100", "--save-every", "1"]
pytestmark = pytest.mark.slow


def torchrun(*args, nproc=2):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        os.path.join(ROOT, "vgrpo.py"), *SMALL, *map(str, args)], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def transformer_weights(out, iteration):
    return load_file(os.path.join(out, f"checkpoint-{iteration}", "transformer", "diffusion_pytorch_model.safetensors"))


def lora_weights(out, iteration):
    return load_file(os.path.join(out, f"checkpoint-{iteration}", "pytorch_lora_weights.safetensors"))


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def distance(a, b):
    assert a.keys() == b.keys() and a, "the two checkpoints hold different (or no) tensors"
    return sum((a[k].double() - b[k].double()).pow(2).sum() for k in a).sqrt().item()


@pytest.fixture(scope="module")
def brightness_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "bright.py"
    path.write_text("def brightness(images, prompts):\n    return images.mean((1, 2, 3))\n")
    prompts = path.parent / "eval.txt"
    prompts.write_text("a red cube\na blue sphere\na green cone\n")   # 3 prompts over 2 ranks: uneven passes
    return f"{path}:brightness", str(prompts)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory, brightness_reward):
    """FSDP full fine-tuning for 2 iterations (checkpoints 1 and 2, an evaluation at the end), DDP for 1."""
    root = tmp_path_factory.mktemp("fsdp")
    reward, eval_prompts = brightness_reward
    fsdp, ddp = str(root / "fsdp"), str(root / "ddp")
    torchrun("--fsdp", "--iterations", "2", "--eval-prompts", eval_prompts, "--eval-every", "2",
             "--eval-rewards", reward, "--output-dir", fsdp)
    torchrun("--iterations", "1", "--output-dir", ddp)
    return fsdp, ddp


def test_fsdp_full_finetuning_trains_like_ddp_with_half_the_state_per_process(full_runs):
    fsdp, ddp = full_runs
    start = vgrpo.build_tiny_sd3_pipeline().transformer.state_dict()
    sharded, replicated = transformer_weights(fsdp, 1), transformer_weights(ddp, 1)
    moved = distance(replicated, start)
    assert moved > 0.1 and distance(sharded, replicated) < 1e-4 * moved   # measured: 4.5e-6
    f, d = metrics(fsdp)[0], metrics(ddp)[0]
    assert f["grad_norm"] == pytest.approx(d["grad_norm"], rel=1e-5) and f["reward_mean"] == d["reward_mean"]
    assert 0.45 < f["state_mb"] / d["state_mb"] < 0.55                      # weights + AdamW, measured 0.500


def test_fsdp_resume_continues_exactly_and_on_another_number_of_processes(full_runs, tmp_path):
    fsdp, _ = full_runs
    straight = transformer_weights(fsdp, 2)
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    os.symlink(os.path.join(fsdp, "checkpoint-1"), os.path.join(resumed, "checkpoint-1"))
    torchrun("--fsdp", "--iterations", "2", "--resume", "auto", "--output-dir", resumed)
    again = transformer_weights(resumed, 2)
    assert all(torch.equal(again[k], straight[k]) for k in straight)         # bit for bit
    assert metrics(resumed)[-1]["reward_mean"] == metrics(fsdp)[1]["reward_mean"]
    # one process: the sharded AdamW states are resharded; the same global batch, so equal within rounding
    single = str(tmp_path / "single")
    torchrun("--fsdp", "--iterations", "2", "--resume", os.path.join(fsdp, "checkpoint-1"), "--output-dir", single,
             nproc=1)
    one = transformer_weights(single, 2)
    step = distance(straight, transformer_weights(fsdp, 1))
    assert step > 0.1 and distance(one, straight) < 1e-3 * step


def test_the_sharded_checkpoint_loads_into_diffusers_and_reproduces_the_trained_rollout(full_runs, brightness_reward):
    """The evaluation at iteration 2 ran on the sharded model; the same evaluation (same keyed noises, same
    sampler) with the saved transformer/ loaded by SD3Transformer2DModel.from_pretrained gives the same reward."""
    from diffusers import SD3Transformer2DModel

    fsdp, _ = full_runs
    with open(os.path.join(fsdp, "eval.jsonl")) as f:
        logged = [json.loads(line) for line in f][-1]
    assert logged["iteration"] == 2
    pipe = vgrpo.build_tiny_sd3_pipeline()
    pipe.transformer = SD3Transformer2DModel.from_pretrained(os.path.join(fsdp, "checkpoint-2", "transformer"))
    family = vgrpo.SD3Family(pipe, 32, 0, torch.device("cpu"))           # the tiny SD3 has no T5: no T5 tokens
    args = vgrpo.Args(model="tiny", sample_steps=4, sample_batch=2)
    prompts, _ = vgrpo.load_prompts(brightness_reward[1])
    values = []
    for i, prompt in enumerate(prompts):
        noise = torch.stack([torch.randn(family.latent_shape, generator=vgrpo.keyed_generator("eval", i, k))
                             for k in range(2)])
        o = vgrpo.rollout(family, family.transformer, family.encode([prompt] * 2), noise,
                          family.sigma_grid(4), args)
        values += family.decode(o).mean((1, 2, 3)).tolist()
    assert sum(values) / len(values) == pytest.approx(logged["eval_brightness"], abs=1e-5)


def test_fsdp_lora_with_checkpointing_and_accumulation_trains_like_ddp(tmp_path):
    # each rank: 2 samples per optimizer step, in 2 accumulated micro-batches
    flags = ["--iterations", "1", "--no-full-finetune", "--lr", "1e-3", "--gradient-checkpointing",
             "--inner-steps", "2", "--micro-batch", "1"]
    torchrun(*flags, "--fsdp", "--output-dir", tmp_path / "fsdp")
    torchrun(*flags, "--output-dir", tmp_path / "ddp")
    sharded, replicated = lora_weights(tmp_path / "fsdp", 1), lora_weights(tmp_path / "ddp", 1)
    trained = [k for k in replicated if "lora_B" in k]                          # B starts at 0
    moved = distance({k: replicated[k] for k in trained}, {k: torch.zeros_like(replicated[k]) for k in trained})
    assert moved > 1e-3 and distance(sharded, replicated) < 1e-4 * moved        # measured: 0 (bit for bit)
    f, d = metrics(tmp_path / "fsdp")[0], metrics(tmp_path / "ddp")[0]
    assert f["grad_norm"] == pytest.approx(d["grad_norm"], rel=1e-5) and f["skipped_steps"] == 0


# One sharded process: which dtypes a transformer layer sees in the forward pass, and which it keeps and reduces in.
DTYPES_UNDER_FSDP = """
import json, sys, torch, torch.distributed as dist
import vgrpo
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
args, device = vgrpo.Args(model=sys.argv[2], fsdp=True, mixed_precision="bf16", n_mc=2), torch.device("cpu")
family = vgrpo.load_family(args, device)
vgrpo.add_trainable_weights(family, args)
model = vgrpo.wrap_for_training(family, args, 1, device)
block, seen = family.transformer.transformer_blocks[0], {}
block.attn.to_q.register_forward_pre_hook(lambda module, inputs: seen.update(compute=str(module.weight.dtype)))
if sys.argv[2] == "tiny":   # SD3 embeds 1000 sigma as the root's input gives it
    family.transformer.time_text_embed.register_forward_pre_hook(
        lambda m, inputs: seen.update(timestep=str(inputs[0].dtype)))
else:                       # FLUX's rotary cos / sin, made in the root and handed to every block
    block.register_forward_pre_hook(lambda m, a, kw: seen.update(rope=str(kw["image_rotary_emb"][0].dtype)),
                                    with_kwargs=True)
layer = block.attn.to_q
sigmas, eps = vgrpo.draw_pairs(family.sigma_grid(4), 2, family.latent_shape, [(0, 0), (0, 1)], "batch", True, 0, 0)
s, _ = vgrpo.surrogate(family, model, torch.randn(2, *family.latent_shape), sigmas, eps.contiguous(),
                       family.encode(["a cat", "a dog"]), "adaptive")
s.sum().backward()
seen.update(master=str(layer.weight.dtype), gradient=str(layer.weight.grad.dtype), surrogate=str(s.dtype))
print(json.dumps(seen))
"""


def test_fsdp_in_bf16_trains_like_ddp_in_bf16_and_keeps_float32_master_weights(tmp_path):
    """In bf16, FSDP2 trains the same LoRA as DDP, SD3 and FLUX, bit for bit (measured; 34% and 49% of the step apart
    while FSDP2 cast the modules' inputs to bf16), and what it saves is float32. Then, in one sharded process, a
    layer's weights are bf16 in the forward pass and float32 outside it, its gradient float32, and the surrogate
    float32; the inputs that are not matmuls' keep their float32, as without FSDP (FSDP2's default casts every
    floating input of a sharded module: SD3's timestep 1000 sigma would round to steps of 4 near 1000, and FLUX's
    rotary cos / sin lose their precision; autocast already casts the matmuls)."""
    for model in ("tiny", "tiny-flux"):   # with the default cast: 34% and 49% of the step apart
        flags = ["--model", model, "--iterations", "1", "--no-full-finetune", "--lr", "1e-3", "--mixed-precision",
                 "bf16"]
        torchrun(*flags, "--fsdp", "--output-dir", tmp_path / model / "fsdp")
        torchrun(*flags, "--output-dir", tmp_path / model / "ddp")
        saved, replicated = lora_weights(tmp_path / model / "fsdp", 1), lora_weights(tmp_path / model / "ddp", 1)
        assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in saved.values())
        trained = [k for k in replicated if "lora_B" in k]                      # B starts at 0
        moved = distance({k: replicated[k] for k in trained}, {k: torch.zeros_like(replicated[k]) for k in trained})
        assert moved > 1e-3 and distance(saved, replicated) < 1e-4 * moved, model   # measured: 0 (bit for bit)
        f, d = metrics(tmp_path / model / "fsdp")[0], metrics(tmp_path / model / "ddp")[0]
        assert f["skipped_steps"] == 0 and f["grad_norm"] == pytest.approx(d["grad_norm"], rel=1e-5), model
    for model, kept in (("tiny", "timestep"), ("tiny-flux", "rope")):
        p = subprocess.run([sys.executable, "-c", DTYPES_UNDER_FSDP, str(tmp_path / f"group-{model}"), model],
                           env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.splitlines()[-1]) == {"compute": "torch.bfloat16", "master": "torch.float32",
                                                         "gradient": "torch.float32", "surrogate": "torch.float32",
                                                         kept: "torch.float32"}, model


def test_fsdp_shards_flux_like_ddp_and_saves_a_transformer_diffusers_loads(tmp_path):
    """FLUX's double- and single-stream blocks sharded: full fine-tuning equals DDP's within rounding, and the
    saved transformer/ loads with FluxTransformer2DModel.from_pretrained."""
    from diffusers import FluxTransformer2DModel

    fsdp, ddp = str(tmp_path / "fsdp"), str(tmp_path / "ddp")
    torchrun("--model", "tiny-flux", "--fsdp", "--iterations", "1", "--output-dir", fsdp)
    torchrun("--model", "tiny-flux", "--iterations", "1", "--output-dir", ddp)
    start = vgrpo.build_tiny_flux_pipeline().transformer.state_dict()
    sharded, replicated = transformer_weights(fsdp, 1), transformer_weights(ddp, 1)
    moved = distance(replicated, start)
    assert moved > 0.1 and distance(sharded, replicated) < 1e-4 * moved
    loaded = FluxTransformer2DModel.from_pretrained(os.path.join(fsdp, "checkpoint-1", "transformer")).state_dict()
    assert loaded.keys() == sharded.keys() and all(torch.equal(loaded[k], sharded[k]) for k in sharded)
