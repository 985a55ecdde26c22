"""The launch lines users copy, tested as written: every command in the README and in vgrpo.py's docstring
validates for its own process count, and the main command trains the real model ids from a Hugging Face cache
of tiny stand-ins (hub_standins.py), on as many processes as it says, and its LoRA loads into diffusers.

    python -m pytest tests/test_launch.py -q
"""

import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
from safetensors.torch import load_file

import vgrpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
MAIN_COMMAND = "torchrun --nproc_per_node=8 vgrpo.py --model sd3 --reward pickscore"
# The only flags the real-model runs add: they shrink the work (image side, ODE steps, iterations), nothing else.
SHRINK = ["--resolution", "32", "--sample-steps", "4", "--iterations", "2"]


def find_launch_lines(text):
    """`torchrun ... vgrpo.py ...` and `python vgrpo.py ...` commands in text, continuation lines joined, shell
    comments and markdown table cells cut off."""
    text = re.sub(r"\\\n\s*", " ", text)
    word = r"[ \t]+(?!torchrun\b|python\b)[^\s`|#]+"   # a word on the same line that starts no other command
    pattern = rf"(?:torchrun|python)(?:{word})*?[ \t]+vgrpo\.py(?:{word})*"
    return [m.group(0).strip() for m in re.finditer(pattern, text)]


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def launch_lines():
    """Every launch line of the README and of vgrpo.py's docstring, with where it was found."""
    return [(where, line) for where, text in (("README.md", readme()), ("vgrpo.py docstring", vgrpo.__doc__))
            for line in find_launch_lines(text)]


def world_size(tokens):
    """Processes a launcher line starts: torchrun's --nnodes x --nproc_per_node, 1 for python."""
    if tokens[0] != "torchrun":
        return 1
    flags = dict(re.fullmatch(r"--([\w-]+)=(\S+)", t).groups() for t in tokens if re.fullmatch(r"--[\w-]+=\S+", t))
    nodes = int(flags.get("nnodes", "1").split(":")[-1])
    return nodes * int(flags.get("nproc_per_node", flags.get("nproc-per-node", "1")))


def test_the_quick_start_leads_with_the_main_command_and_enough_lines_are_checked():
    assert find_launch_lines(readme().split("## Quick start", 1)[1])[0] == MAIN_COMMAND
    assert MAIN_COMMAND in find_launch_lines(vgrpo.__doc__)
    lines = launch_lines()   # a pattern that stopped matching would pass every line's test vacuously
    assert sum(where == "README.md" for where, _ in lines) >= 6 and len(lines) >= 12, lines


@pytest.mark.parametrize("where,line", launch_lines())
def test_every_launch_line_validates_for_its_world_size(where, line, tmp_path, monkeypatch):
    """Parses and validates each line exactly as vgrpo would on that many processes (no model is loaded).
    Files the line names (prompt sets, reward files) are the user's: empty stand-ins are created for them."""
    tokens = shlex.split(line)
    script = next(i for i, t in enumerate(tokens) if t.endswith("vgrpo.py"))
    argv = tokens[script + 1:]
    for folder in ("prompts", "docs"):  # what the line may name from the repository, run from its root
        shutil.copytree(os.path.join(ROOT, folder), tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    for flag, value in zip(argv, argv[1:]):
        if flag in ("--prompts", "--eval-prompts") and not (tmp_path / value).exists():
            (tmp_path / value).write_text("a prompt\nanother prompt\n")
    world = world_size(tokens[:script])
    if tokens[0] == "torchrun":   # as torchrun sets them for each process
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
    else:
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = vgrpo.parse_args(argv)
    vgrpo.validate(args, world)
    assert args.micro_batch >= 1


def test_a_prompt_count_that_does_not_split_names_the_nearest_valid_ones(tmp_path):
    args = vgrpo.parse_args(["--model", "sd3", "--output-dir", str(tmp_path)])
    with pytest.raises(vgrpo.UsageError, match=r"not divisible by the 32 processes.*use --prompts-per-step 32 or 64$"):
        vgrpo.validate(args, 32)
    args = vgrpo.parse_args(["--model", "sd3", "--output-dir", str(tmp_path), "--prompts-per-step", "5"])
    with pytest.raises(vgrpo.UsageError, match=r"use --prompts-per-step 8$"):   # 0 is no choice
        vgrpo.validate(args, 8)


# --------------------------------------------------------------------------- model-dependent defaults


def test_real_models_default_to_the_papers_recipe_and_the_digits_model_to_the_cpu_demo():
    sd3 = vgrpo.parse_args(["--model", "sd3"])
    paper_sd3 = dict(reward="pickscore", resolution=512, sampler="dpmpp2m", sample_steps=40, guidance=1.0,
                     prompts_per_step=48, group_size=24, n_mc=4, inner_steps=1, adv_soft_clip=3.0, lora_rank=32,
                     lora_alpha=64.0, lr=3e-4, full_finetune=False, mixed_precision="bf16",
                     gradient_checkpointing=True, iterations=150, clip_eps=0.01, beta=0.0)
    assert {k: getattr(sd3, k) for k in paper_sd3} == paper_sd3
    assert os.path.abspath(sd3.prompts) == os.path.join(ROOT, "prompts", "train.txt")
    # an SD3 pipeline given by id or folder gets the same recipe
    assert vgrpo.parse_args(["--model", "stabilityai/stable-diffusion-3.5-large"]).group_size == 24
    flux = vgrpo.parse_args(["--model", "flux"])
    assert (flux.reward, flux.resolution, flux.sample_steps, flux.guidance, flux.group_size, flux.inner_steps,
            flux.iterations, flux.mixed_precision) == ("hpsv2", 720, 16, 3.5, 12, 4, 300, "bf16")
    demo = vgrpo.parse_args([])   # the CPU demo: the pretrained digits model, a held-out evaluation
    assert (demo.model, demo.reward, demo.resolution, demo.prompts_per_step, demo.group_size, demo.full_finetune,
            demo.lr, demo.mixed_precision, demo.eval_every, demo.eval_rewards) == (
        "digits", "digit", 16, 4, 8, False, 1e-3, "no", 20, "digit_correct,digit_knn,digit")
    assert os.path.abspath(demo.prompts) == os.path.join(ROOT, "prompts", "digits_train.jsonl")
    assert os.path.abspath(demo.eval_prompts) == os.path.join(ROOT, "prompts", "digits_eval.jsonl")
    assert (sd3.eval_every, sd3.eval_prompts) == (0, "")   # real models: no evaluation unless asked
    tiny = vgrpo.parse_args(["--model", "tiny"])
    assert (tiny.reward, tiny.resolution, tiny.prompts_per_step, tiny.group_size, tiny.full_finetune, tiny.lr,
            tiny.prompts, tiny.mixed_precision) == ("jpeg:100", 32, 4, 8, True, 2e-3, "", "no")
    assert vgrpo.parse_args(["--model", "tiny-flux"]).guidance == 3.5


def test_explicit_flags_win_over_presets_which_win_over_the_recipe(tmp_path):
    args = vgrpo.parse_args(["--preset", "sd3-ocr", "--lr", "1e-4", "--group-size", "12"])
    assert (args.model, args.reward, args.n_mc, args.iterations, args.adv_soft_clip) == ("sd3", "ocr", 10, 30, 0.0)
    assert (args.lr, args.group_size, args.prompts_per_step) == (1e-4, 12, 48)   # flag, flag, recipe
    assert vgrpo.parse_args(["--model", "sd3", "--full-finetune"]).lr == 1e-5
    assert vgrpo.parse_args(["--model", "sd3", "--no-gradient-checkpointing"]).gradient_checkpointing is False
    assert vgrpo.parse_args(["--model", "sd3", "--adv-soft-clip", "0"]).adv_soft_clip == 0.0   # 0 is not "unset"
    for argv in (["--model", "sd3"], ["--model", "flux"], [], *[["--preset", name] for name in vgrpo.PRESETS]):
        a = vgrpo.parse_args(argv)  # the printed configuration reproduces itself
        assert vgrpo.parse_args(shlex.split(vgrpo.command_line(a))) == dataclasses.replace(a, preset="")
    with pytest.raises(vgrpo.UsageError, match="unknown --preset 'sd4': valid choices are sd3-preference"):
        vgrpo.parse_args(["--preset", "sd4"])


def test_what_the_code_derives_for_unset_flags_and_keeps_for_set_ones(tmp_path, monkeypatch):
    """resolve_defaults beyond the recipes' values: LoRA's alpha twice its rank unless given; the micro-batch, the
    largest divisor of the per-process minibatch up to 16 (tiny models) or 4; the recipe's prompt files relative to
    wherever vgrpo is launched; --resume auto: the newest complete checkpoint, or a fresh start."""
    monkeypatch.chdir(tmp_path)
    parse = vgrpo.parse_args
    lora = [parse(["--model", "sd3", *flags]) for flags in ([], ["--lora-rank", "8"],
                                                            ["--lora-rank", "8", "--lora-alpha", "3"])]
    assert [(a.lora_rank, a.lora_alpha) for a in lora] == [(32, 64.0), (8, 16.0), (8, 3.0)]
    assert parse(["--model", "tiny"]).micro_batch == math.gcd(4 * 8, 16) == 16
    assert parse(["--model", "sd3"]).micro_batch == math.gcd(48 * 24, 4) == 4
    assert parse(["--model", "sd3", "--prompts-per-step", "1", "--group-size", "6"]).micro_batch == 2
    assert parse(["--model", "sd3", "--micro-batch", "3"]).micro_batch == 3
    demo = parse([])
    assert not os.path.isabs(demo.prompts) and os.path.samefile(demo.prompts, os.path.join(ROOT, "prompts",
                                                                                          "digits_train.jsonl"))
    assert os.path.samefile(demo.eval_prompts, os.path.join(ROOT, "prompts", "digits_eval.jsonl"))
    out = tmp_path / "out"
    assert parse(["--model", "tiny", "--resume", "auto", "--output-dir", str(out)]).resume == ""
    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-11"):
        os.makedirs(out / name)
        if name != "checkpoint-11":   # a save cut short: no state.json
            (out / name / "state.json").write_text("{}")
    assert parse(["--model", "tiny", "--resume", "auto", "--output-dir", str(out)]).resume == str(out / "checkpoint-10")


def test_the_shipped_prompt_set_is_large_varied_and_disjoint_from_the_held_out_one():
    train, _ = vgrpo.load_prompts(os.path.join(ROOT, "prompts", "train.txt"))
    held_out, _ = vgrpo.load_prompts(os.path.join(ROOT, "prompts", "eval.txt"))
    assert len(train) >= 300 and len(set(train)) == len(train)
    assert not set(train) & set(held_out) and not set(train) & set(vgrpo.DEFAULT_PROMPTS)
    assert len({p.split()[-1] for p in train}) > len(train) // 4   # not one template with a word swapped


# --------------------------------------------------------------------------- the real loading path, offline


def launch(*args, nproc, cache, timeout=900, env=None, launcher=()):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launcher]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(command + [*map(str, args)], env=environment, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_the_main_command_trains_sd35_medium_on_8_processes_and_its_lora_loads_into_diffusers(hub_cache, tmp_path):
    """MAIN_COMMAND exactly, plus only SHRINK and an output folder: the SD3.5-M recipe on 8 gloo processes, the
    stand-ins loaded by their real ids through from_pretrained, PickScore through load_reward."""
    out = tmp_path / "run"
    tokens = shlex.split(MAIN_COMMAND)
    assert tokens[:2] == ["torchrun", "--nproc_per_node=8"] and tokens[2] == "vgrpo.py"
    result = launch(os.path.join(ROOT, "vgrpo.py"), *tokens[3:], *SHRINK, "--output-dir", out, nproc=8, cache=hub_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no --prompts given: training on the" in result.stdout            # the shipped set, said once
    config = json.loads((out / "config.json").read_text())
    recipe = dict(model="sd3", reward="pickscore", prompts_per_step=48, group_size=24, n_mc=4, inner_steps=1,
                  sampler="dpmpp2m", guidance=1.0, adv_soft_clip=3.0, lora_rank=32, lora_alpha=64.0, lr=3e-4,
                  full_finetune=False, mixed_precision="bf16", gradient_checkpointing=True, micro_batch=4)
    assert {k: config[k] for k in recipe} == recipe
    assert "48 prompts x 24 images = 1152 samples per iteration over 8 process(es)" in result.stdout
    lines = read_jsonl(out / "metrics.jsonl")
    assert [m["iteration"] for m in lines] == [1, 2]
    for m in lines:
        assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["grad_norm"] > 0 and m["skipped_steps"] == 0
        assert abs(m["adv_abs_max"]) <= 3.0 + 1e-6                           # the soft clip at eta = 3
        assert 0 < m["reward_std"] and abs(m["reward_mean"]) < 10            # PickScore logits / 26, random CLIP
    # the LoRA loads into the diffusers pipeline from the same cache, and changes its output
    state = load_file(out / "checkpoint-2" / "pytorch_lora_weights.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items())   # trained: B left zero at init
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    code = (f"import torch; from diffusers import StableDiffusion3Pipeline as P; p = P.from_pretrained("
            f"'stabilityai/stable-diffusion-3.5-medium'); g = lambda: p('a cat', num_inference_steps=2, height=32, "
            f"width=32, guidance_scale=1.0, output_type='pt', generator=torch.Generator().manual_seed(0)).images; "
            f"a = g(); p.load_lora_weights('{out / 'checkpoint-2'}'); b = g(); "
            f"print('LORA', len(p.transformer.peft_config), float((a - b).abs().max()))")
    check = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    n_adapters, change = check.stdout.split("LORA")[1].split()
    assert int(n_adapters) == 1 and float(change) > 0


@pytest.mark.slow
def test_flux_preference_trains_flux_dev_on_2_processes_and_its_lora_loads_into_flux_pipeline(hub_cache, tmp_path):
    """--preset flux-preference: FLUX.1-dev on HPSv2.1 + PickScore + ImageReward, all three in this process."""
    out = tmp_path / "run"
    result = launch(os.path.join(ROOT, "vgrpo.py"), "--preset", "flux-preference", *SHRINK,
                    "--prompts-per-step", "2", "--group-size", "4", "--inner-steps", "2", "--output-dir", out,
                    nproc=2, cache=hub_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["guidance"], config["mixed_precision"], config["gradient_checkpointing"]) == (3.5, "bf16", True)
    lines = read_jsonl(out / "metrics.jsonl")
    assert len(lines) == 2 and all(m["grad_norm"] > 0 and m["skipped_steps"] == 0 for m in lines)
    for m in lines:   # HPSv2.1 a cosine, PickScore a cosine x logit_scale / 26, ImageReward standardised
        assert -1 <= m["reward_hpsv2"] <= 1 and -1 <= m["reward_pickscore"] <= 1
        assert math.isfinite(m["reward_imagereward"]) and m["reward_imagereward"] != 0
        assert m["reward_mean"] == pytest.approx(m["reward_hpsv2"] + m["reward_pickscore"] + m["reward_imagereward"],
                                                 abs=1e-5)
    code = (f"import torch; from diffusers import FluxPipeline as P; p = P.from_pretrained("
            f"'black-forest-labs/FLUX.1-dev'); g = lambda: p('a cat', num_inference_steps=2, height=32, width=32, "
            f"output_type='pt', generator=torch.Generator().manual_seed(0)).images; "
            f"a = g(); p.load_lora_weights('{out / 'checkpoint-2'}'); im = g(); "
            f"print('LORA', len(p.transformer.peft_config), tuple(im.shape), float((a - im).abs().max()))")
    check = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HF_HUB_CACHE": str(hub_cache)},
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert "LORA 1 (1, 3, 32, 32)" in check.stdout
    assert float(check.stdout.split()[-1]) > 0                              # the trained LoRA changes the images


@pytest.mark.slow
def test_the_sd3_curriculum_runs_its_five_stages_with_every_reward_in_process_on_2_processes(hub_cache, tmp_path):
    """--curriculum sd3's five stages, one iteration each (the only change: N_MC within 4 ODE steps), on the
    stand-ins: every stage's reward (PickScore + HPSv2.1 + CLIPScore, GenEval's partial credit on the shipped
    GenEval prompts, OCR on the shipped OCR prompts with the KL term) runs in this environment, the stage is
    logged with every metric, and a GenEval evaluation reports GenEval's score per task."""
    stages = [dict(stage, iterations=1, **({"n_mc": 2} if stage["preset"] != "sd3-preference" else {}))
              for stage in vgrpo.CURRICULA["sd3"]]
    (tmp_path / "short.json").write_text(json.dumps(stages))
    evaluation = tmp_path / "geneval_eval.jsonl"   # GenEval's format: two tasks
    evaluation.write_text("".join(json.dumps(line) + "\n" for line in [
        {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
        {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
    ]))
    out = tmp_path / "run"
    result = launch(os.path.join(ROOT, "vgrpo.py"), "--curriculum", tmp_path / "short.json", "--resolution", "32",
                    "--sample-steps", "4", "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", evaluation,
                    "--eval-rewards", "geneval,geneval_partial", "--eval-every", "5", "--eval-images", "1",
                    "--output-dir", out, nproc=2, cache=hub_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = read_jsonl(out / "metrics.jsonl")
    assert [m["stage"] for m in lines] == [1, 2, 3, 4, 5] and [m["iteration"] for m in lines] == [1, 2, 3, 4, 5]
    for m in (lines[0], lines[2]):                                    # the preference stages log their three parts
        assert all(f"reward_{name}" in m for name in ("pickscore", "hpsv2", "clipscore"))
    for m in lines[1], lines[3], lines[4]:          # GenEval's partial credit (at most 1), then OCR (in [0, 1])
        assert m["reward_mean"] <= 1 and "reward_pickscore" not in m
    assert lines[4]["reward_mean"] >= 0
    for number, text in ((2, "reward geneval_partial, prompts prompts/geneval_train.jsonl, N_MC 2, soft clip 0"),
                         (5, "reward ocr, prompts prompts/ocr_train.txt, N_MC 2, soft clip 0, beta 0.3")):
        assert f"vgrpo: stage {number}/5 " in result.stdout and text in result.stdout
    evaluated = read_jsonl(out / "eval.jsonl")[-1]
    assert evaluated["iteration"] == 5
    tasks = {"eval_geneval/single_object", "eval_geneval/colors"}
    assert {k for k in evaluated if k.startswith("eval_geneval/")} == {*tasks, "eval_geneval/mean_of_tags"}
    assert evaluated["eval_geneval/mean_of_tags"] == pytest.approx(sum(evaluated[k] for k in tasks) / 2)
    assert all(0 <= evaluated[k] <= 1 for k in ("eval_geneval", "eval_geneval_partial"))


@pytest.mark.slow
def test_ranks_whose_model_files_differ_refuse_to_start(hub_cache, hub_cache_other_seed, tmp_path):
    """The same flags on both ranks, but rank 1's cache holds other weights under the same id (a node with a
    different download): the check runs before DDP's broadcast would hide it."""
    wrapper = tmp_path / "per_rank_cache.sh"
    wrapper.write_text(f'if [ "$RANK" = 1 ]; then export HF_HUB_CACHE="{hub_cache_other_seed}"; fi\n'
                       f'exec "{sys.executable}" "$@"\n')
    result = launch(wrapper, os.path.join(ROOT, "vgrpo.py"), "--model", "sd3", "--reward", "jpeg", *SHRINK,
                    "--prompts-per-step", "2", "--group-size", "2", "--output-dir", tmp_path / "run",
                    nproc=2, cache=hub_cache, launcher=["--no-python", "bash"], timeout=300)
    assert result.returncode != 0
    assert "rank 1 starts from different weights than rank 0" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- trackers


def wandb_history(run_dir):
    """The history rows of an offline W&B run, read from its .wandb file (a log of 32 KiB blocks whose records,
    split into chunks with a 7-byte header each, are protobuf Records), as {step: {key: value}}."""
    import glob
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0], "rb") as f:
        data = f.read()
    rows, pos, chunk, block = {}, 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:           # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):                    # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                rows.setdefault(row.get("_step"), {}).update(row)
    return rows


@pytest.mark.slow
def test_report_to_tensorboard_and_wandb_writes_what_metrics_jsonl_has(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    (tmp_path / "eval.txt").write_text("a red cube\na blue sphere\n")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "vgrpo.py"), "--model", "tiny", "--iterations", "2",
                        "--sample-steps", "4",
                        "--prompts-per-step", "2", "--group-size", "4", "--eval-prompts", tmp_path / "eval.txt",
                        "--eval-every", "2", "--report-to", "tensorboard,wandb", "--output-dir", out],
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
                            "WANDB_SILENT": "true"}, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    logged = read_jsonl(out / "metrics.jsonl")
    evaluated = read_jsonl(out / "eval.jsonl")
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0}).Reload()
    for key in ("reward_mean", "grad_norm", "policy_loss"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == \
            [(m["iteration"], pytest.approx(m[key], rel=1e-6)) for m in logged]
    assert [(e.step, e.value) for e in events.Scalars("eval_jpeg")] == \
        [(m["iteration"], pytest.approx(m["eval_jpeg"], rel=1e-6)) for m in evaluated]   # before training and at 2
    assert [e.step for e in events.Images("samples")] == [1, 2] and events.Images("eval_samples")
    assert "--group-size 4" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    run_dir = next((out / "wandb").glob("offline-run-*"))
    history = wandb_history(run_dir)
    for m in logged:
        assert history[m["iteration"]]["reward_mean"] == pytest.approx(m["reward_mean"], rel=1e-6)
    assert history[0]["eval_jpeg"] == pytest.approx(evaluated[0]["eval_jpeg"], rel=1e-6)
    assert len(list((run_dir / "files" / "media" / "images").glob("samples_*.png"))) == 2
