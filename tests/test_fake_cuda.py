"""The fake-CUDA tier: vgrpo's --device cuda paths run on a CPU-only torch with fake CUDA tensors (tests/fake_cuda.py:
what it relies on and what it cannot see). A whole iteration (start_run, train_iteration, iteration_metrics,
record) per configuration, --fsdp as rank 0 of 8 processes, the evaluation (alone and as rank 0 of 8) and the
checkpoint, in strict mode: any op that mixes a non-scalar CPU tensor with a CUDA one, and any collective of a CPU
tensor (NCCL's rule), fails the test with the op and its call site. And the iteration's device-to-host
synchronisations and host-to-device copies, which must not grow with the micro-batches or the ODE steps.

    python -m pytest -q -m fake_cuda      # about 2 min on 2 CPU cores (20-30 s of it building the library once);
                                          # skips with one line if it cannot be built (no C++ compiler, a CUDA torch)

The scenarios (the functions below the tests) run in one worker subprocess started with the fake CUDA library in
LD_PRELOAD (the CUDA hooks must exist before torch is imported); each test calls one and checks what it returns.
"""

import contextlib
import dataclasses
import json
import os

import pytest

pytestmark = pytest.mark.fake_cuda

# small shapes of each real configuration (the stand-ins of tests/hub_standins.py): whole iterations in seconds
SMALL = ["--resolution", "64", "--sample-steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--n-mc", "2"]
CONFIGS = {
    "tiny": ["--model", "tiny", "--sample-steps", "4", "--prompts-per-step", "2", "--group-size", "4"],
    "tiny-flux": ["--model", "tiny-flux", "--sample-steps", "4", "--prompts-per-step", "2", "--group-size", "4"],
    # the SD3.5-M recipe: LoRA, bf16, gradient checkpointing, PickScore
    "sd3-lora-bf16-pickscore": ["--model", "sd3", "--reward", "pickscore", *SMALL],
    # CFG (two passes per step), fp16 with the GradScaler, three rewards normalised one by one
    "sd3-cfg-fp16-three-rewards": ["--model", "sd3", *SMALL, "--guidance", "4.5", "--mixed-precision", "fp16",
                                   "--reward", "pickscore:1,clipscore:1,aesthetic:0.5",
                                   "--reward-advantage", "per-reward"],
    "sd3-full-finetune": ["--model", "sd3", "--reward", "pickscore", *SMALL, "--full-finetune"],
    # the FLUX.1-dev recipe's shape of update: several inner steps (the old-surrogate pass) and the KL term
    "flux-2-inner-steps-kl": ["--model", "flux", "--reward", "hpsv2", *SMALL, "--inner-steps", "2", "--beta", "0.3"],
}

# --fsdp as rank 0 of 8 processes (tests/fake_cuda.py: fake_processes): each rank's share of the recipe's sharding
FSDP_CONFIGS = {
    # the SD3.5-M recipe sharded: LoRA over a bf16 base, gradient checkpointing
    "sd3-lora-bf16": ["--model", "sd3", "--reward", "pickscore", *SMALL, "--prompts-per-step", "8", "--fsdp"],
    # FLUX.1-dev fully fine-tuned as MixGRPO runs it, with the old-surrogate pass and the KL term
    "flux-full-finetune-2-inner-steps-kl": ["--model", "flux", "--reward", "hpsv2", *SMALL, "--prompts-per-step", "8",
                                            "--full-finetune", "--inner-steps", "2", "--beta", "0.3", "--fsdp"],
}


@pytest.fixture(scope="module")
def worker(hub_cache):
    from tests import fake_cuda

    library, why = fake_cuda.build_library()
    if library is None:
        pytest.skip(why)
    env = {"HF_HUB_CACHE": hub_cache, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with fake_cuda.Worker(library, env) as w:
        yield w


def call(worker, scenario, **kwargs):
    return worker.call(__name__, scenario, **kwargs)


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", CONFIGS)
def test_one_iteration_on_fake_cuda_keeps_every_tensor_on_the_gpu(worker, tmp_path, name):
    got = call(worker, "one_iteration", flags=CONFIGS[name], output_dir=str(tmp_path))
    assert got["device"] == "cuda:0"
    assert got["mixes"] == []
    assert got["trainable_devices"] == ["cuda"]           # every trained weight, and the AdamW states
    assert got["optimizer_devices"] == ["cuda"] and got["fused"]
    assert got["stats_device"] == "cuda" and got["images_device"] == "cuda"
    assert got["metrics"]["iteration"] == 1 and got["metrics"]["skipped_steps"] == 0
    assert got["logged_iterations"] == [1]                # record() wrote metrics.jsonl and the sample grid
    # the iteration's peak GPU memory (the harness's DeviceMemory answers torch.cuda's counters), then reset
    assert got["metrics"]["peak_memory_gib"] == got["peak"] / 2**30 and got["peak"] > got["resident"] > 0
    assert got["peak_after_reset"] == got["resident"]
    assert got["sample_grid"]
    # cuDNN attention is left out for the whole process (it fails in the backward on Hopper: docs/method.md)
    assert got["attention"] == ["efficient", "flash", "math"]
    # a pageable non_blocking copy is synchronous on a GPU: every host-to-device copy that asks to overlap must
    # come from pinned memory
    assert got["counts"].get("h2d_pageable_non_blocking", 0) == 0
    # --compile auto on CUDA: the real models' blocks compiled (a GPU machine's triton, gcc and compute capability),
    # so the compiled path's wiring runs here (the old surrogate with gradients on); the tiny ones stay eager
    assert got["compiled"] == (not name.startswith("tiny"))
    # the reward models score in float32 under bf16 / fp16 training: the advantages scale their rounding up
    if not name.startswith("tiny"):   # (the tiny models train on the JPEG reward, which has no model)
        assert got["reward_dtypes"] == ["torch.float32"]
    if "fp16" in name:
        assert got["scaler"] and got["metrics"]["loss_scale"] == 0.5   # read from the device, once
    if "inner-steps" in name:
        assert got["old_pass_rows"] > 0


@pytest.mark.parametrize("name", FSDP_CONFIGS)
def test_fsdp_on_fake_cuda_shards_every_trained_weight_on_the_gpu_as_rank_0_of_8(worker, tmp_path, name):
    got = call(worker, "sharded_iteration", flags=FSDP_CONFIGS[name], output_dir=str(tmp_path), world=8)
    assert got["mixes"] == []
    assert got["param_types"] == ["DTensor"] and got["local_devices"] == ["cuda"]
    assert got["optimizer_devices"] == ["cuda"] and got["fused"]    # a step was taken: AdamW holds states
    # rank 0's shard of each weight: the first ceil(rows / 8) rows (FSDP2 splits dimension 0, the last rank padded)
    shard = sum(-(-shape[0] // 8) * (numel // shape[0]) for shape, numel in got["global_shapes"])
    assert got["local_numel"] == shard and shard < 0.2 * sum(numel for _, numel in got["global_shapes"])
    # rank 0's own count (the logged metrics are averaged over the ranks by a collective: dummies here)
    assert got["metrics"]["iteration"] == 1 and got["skipped_steps"] == 0
    if "inner-steps" in name:
        assert got["old_pass_rows"] > 0
    # what a checkpoint writes: every trained weight gathered whole to the host, one transfer per tensor
    assert got["gathered"] == [list(shape) for shape, _ in got["global_shapes"]]
    assert got["gathered_devices"] == ["cpu"] and got["gather_d2h"] == got["n_gathered"]


def test_a_collective_of_a_cpu_tensor_fails_as_under_nccl(worker):
    """The fake processes keep NCCL's rule (the FSDP test above runs under it): a CPU tensor in a collective, which
    the CPU tests' gloo moves and a GPU's NCCL refuses, fails naming the collective and vgrpo's line; the same
    statistics on the GPU pass."""
    got = call(worker, "reduced_on", devices=["cpu", "cuda"])
    assert got["cpu"].startswith("DeviceMixError: dist.all_reduce of CPU tensor(s) of shape [(2,)], which NCCL "
                                 "cannot move, from vgrpo.py:")
    assert got["cuda"] == "reduced"


def test_the_evaluation_runs_on_fake_cuda(worker, tmp_path):
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": p, "tag": t}) + "\n" for p, t in
                                 [("a red cube", "colour"), ("two cats", "count"), ("a blue ball", "colour")]))
    flags = [*CONFIGS["tiny"], "--eval-prompts", str(eval_file), "--eval-every", "1", "--eval-images", "2",
             "--eval-rewards", "jpeg", "--attention", "efficient,math"]   # and a choice of attention kernels
    got = call(worker, "evaluation", flags=flags, output_dir=str(tmp_path / "out"))
    assert got["mixes"] == []
    assert got["attention"] == ["efficient", "math"]
    assert got["eval"]["iteration"] == 0 and set(got["eval"]) >= {"eval_jpeg", "eval_jpeg/colour", "eval_jpeg/count"}
    assert got["eval_images"] == 6


def test_the_evaluation_of_rank_0_of_8_under_fsdp_runs_on_fake_cuda(worker, tmp_path):
    """The held-out evaluation under --fsdp as rank 0 of 8: its share of the prompts, its sums reduced over the
    ranks on the GPU (NCCL's rule), no CPU tensor mixed with a CUDA one."""
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": f"a photo of {n} cats", "tag": "count"}) + "\n"
                                 for n in ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")))
    flags = [*FSDP_CONFIGS["sd3-lora-bf16"], "--eval-prompts", str(eval_file), "--eval-every", "1",
             "--eval-images", "2"]
    got = call(worker, "evaluation", flags=flags, output_dir=str(tmp_path / "out"), world=8)
    assert got["mixes"] == []
    assert got["eval"]["iteration"] == 0 and {"eval_pickscore", "eval_pickscore/count"} <= set(got["eval"])
    assert got["eval_prompts"] == ["a photo of one cats"] * 2 + ["a photo of nine cats"] * 2   # 0 and 8 of 9


def test_the_checkpoint_gathers_the_trained_weights_to_the_host(worker, tmp_path):
    got = call(worker, "checkpoint", flags=CONFIGS["sd3-lora-bf16-pickscore"], output_dir=str(tmp_path))
    assert got["mixes"] == []
    assert got["weights"] and got["weight_devices"] == ["cpu"]
    # one device-to-host copy per LoRA tensor: trained_weights gathers tensor by tensor
    assert got["counts"]["d2h_sync"] == got["weights"]
    assert got["files"] == ["optimizer.pt", "pytorch_lora_weights.safetensors", "state.json"]
    assert got["restored_iteration"] == 1 and got["lora_devices"] == ["cuda"]   # loaded back onto the GPU
    assert got["optimizer"] == "restored"


def test_strict_mode_fails_on_an_op_mixing_a_cpu_array_with_a_cuda_tensor(worker):
    got = call(worker, "mixing_ops")
    assert got["strict_add"].startswith("DeviceMixError: aten.add.Tensor mixes cuda(3,), cpu(3,)")
    assert "test_fake_cuda.py" in got["strict_add"]    # the call site is named
    # indexing CUDA data with CPU indices works on a GPU too (a hidden copy and sync): strict mode catches it
    assert got["strict_index"].startswith("DeviceMixError: aten.index.Tensor")
    # a CUDA result written into a CPU flag, even a 0-dim one, fails on a GPU
    assert got["strict_written_scalar"].startswith("DeviceMixError: aten.bitwise_and_.Tensor")
    assert got["lenient_index_shape"] == [2, 4] and len(got["lenient_mixes"]) == 1
    # three copies to the GPU, of which the pageable one that asked to overlap is counted apart (the iteration's test
    # asserts there is none)
    assert got["scalar_ok"] and got["transfer_counts"] == {"h2d_copy": 3, "d2h_sync": 2, "h2d_pageable_non_blocking": 1}


def test_device_memory_counts_what_a_gpu_holds(worker):
    """The harness's byte count (what torch.cuda.memory_allocated answers): a cast on the device is a new storage
    from the moment it is made (autocast's and x.float()'s: uncounted until the next reconcile, such casts once hid
    16 GiB of saved float32 activations from a no-checkpointing update's peak), a view is none, a freed tensor
    leaves the count and stays in the peak, and what autograd saves stays counted."""
    got = call(worker, "memory_counts")
    mib = 2 ** 20
    assert got["cast"] == mib and got["view"] == 0 and got["cast_freed"] == 0 and got["peak"] == mib
    # (w.to(bf16).float() ** 2).sum(): pow keeps its float32 input (1 MiB) for the backward, and the loss (4 bytes)
    assert got["graph"] == mib + 4 and got["after_backward"] == mib   # then only w's gradient


def test_the_tier_skips_with_one_line_where_the_library_cannot_be_built(tmp_path, monkeypatch):
    from tests import fake_cuda

    monkeypatch.setenv("PATH", str(tmp_path))                           # no compiler, no ninja
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))   # nothing built before
    library, why = fake_cuda.build_library.__wrapped__()
    if fake_cuda.torch.version.cuda is not None or fake_cuda.torch.version.hip is not None:
        # a GPU build of torch (a GPU machine's) is refused before any build, in its own line
        assert library is None and why.endswith("has a GPU backend: fake CUDA is for CPU-only builds")
        return
    assert library is None and why.startswith("cannot build the fake CUDA library for torch ")
    assert "\n" not in why and len(why) < 300 and why.split(": ", 1)[1].strip()


@pytest.mark.slow
def test_syncs_and_copies_do_not_grow_with_micro_batches_or_ode_steps(worker, tmp_path):
    """At the SD3.5-M stand-in's shape (LoRA, bf16, checkpointing, PickScore): 16 samples per iteration in 1, 4 or
    16 micro-batches, with 4 or 8 ODE steps: the same device-to-host syncs and host-to-device copies."""
    flags = ["--model", "sd3", "--reward", "pickscore", "--resolution", "64", "--prompts-per-step", "4",
             "--group-size", "4", "--n-mc", "2", "--sample-batch", "16", "--decode-batch", "16"]
    variants = [dict(micro_batch=16, sample_steps=4), dict(micro_batch=4, sample_steps=4),
                dict(micro_batch=1, sample_steps=4), dict(micro_batch=4, sample_steps=8)]
    got = call(worker, "iteration_counts", flags=flags, output_dir=str(tmp_path), variants=variants)
    first = got[0]
    assert first["mixes"] == [] and first["counts"]["d2h_sync"] > 0 and first["counts"]["h2d_copy"] > 0
    for variant, other in zip(variants[1:], got[1:]):
        assert other["counts"] == first["counts"], (variant, other["where"], first["where"])


@pytest.mark.slow
def test_the_memory_benchmarks_gpu_mode_runs_and_its_table_reaches_the_guide(worker, tmp_path):
    """bench/memory.py --gpu, as bench/device.sh runs it on a GPU machine, with fake CUDA's byte count answering the
    caching allocator's counters (a 141 GiB card, 0.5 GiB outside torch): it measures FLUX.2 [klein] LoRA in one
    process and under --fsdp, writes memory-gpu.md beside results/memory.json's fake-CUDA bytes and memory-gpu.json,
    with the census and the ops' workspaces (none here, where only tensors take memory); `--guide`'s table then takes
    klein's figures from it and marks the other configurations' as fake CUDA. About 80 s on 2 cores (the workspace
    pass 21 of them)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import memory

    out = tmp_path / "memory-gpu.md"
    assert call(worker, "memory_on_gpu", out=str(out)) == 0
    gpu = json.loads((tmp_path / "memory-gpu.json").read_text())
    assert gpu["device"] == "fake CUDA" and gpu["outside_torch"] == [2 ** 29, 2 ** 29]
    klein = gpu["results"]["flux2-klein LoRA r64"]
    assert klein["notes"] == [] and list(gpu["results"]) == ["flux2-klein LoRA r64"]
    with open(os.path.join(memory.RESULTS, "memory.json")) as f:
        fake = json.load(f)
    for key in ("one", "fsdp"):
        rows = {row[0]: row for row in klein[key]}
        assert list(rows) == [row[0] for row in fake["flux2-klein LoRA r64"][key]]   # the same phases
        phases = list(rows.values())[3:]   # after the sizes (weights, AdamW states, resident): the phases' peaks
        assert len(phases) == 7 and all(row[2] == row[1] for row in phases)   # reserved: here the fake peak
    # the same code on the same counters as results/memory.json's rows (runs give the same bytes; 5% is left for
    # newer torch and diffusers releases) on the rows the guide's table reads; sharding the weights and AdamW states
    # over 8 must lower every peak
    one, sharded = ({row[0]: row[1] for row in klein[key]} for key in ("one", "fsdp"))
    made = {row[0]: row[1] for row in fake["flux2-klein LoRA r64"]["one"]}
    for phase in ("resident between phases", "update, checkpointing on", "update, checkpointing off"):
        assert one[phase] == pytest.approx(made[phase], rel=0.05), phase
    assert all(sharded[phase] < one[phase] for phase in one if "update" in phase or "resident" in phase)
    # where the bytes are: the resident state is its parts (a storage counted with another's bytes once left 0.9 GiB
    # of it to none of them), the forward holds what autograd saved (and the micro-batch's indexed inputs, a few
    # MiB), and the update's peak is the resident state, that forward and the backward's rise (casts left out of
    # the count once hid 16 GiB)
    census = klein["census"]
    resident = sum(census["resident"].values())
    assert abs(census["resident"]["none of these"]) < 2 ** 20
    assert 0 <= census["forward"] - sum(census["saved"].values()) < 64 * 2 ** 20 and census["forward"] > 10 * 2 ** 30
    assert sum(v for op, v in census["saved"].items() if op.startswith("ScaledDotProduct")) > 2 ** 30   # attention
    assert census["backward_peak"] > 2 ** 30
    assert one["update, checkpointing off"] == pytest.approx(resident + census["forward"] + census["backward_peak"],
                                                             rel=0.02)
    # what the ops hold beyond tensors: nothing under fake CUDA, so each phase's peak is its peak between two ops,
    # and the same as the phase's row (the per-op peaks put together make the phase's)
    decode = next(row[0] for row in klein["one"] if row[0].startswith("VAE decode") and "rollout pass" in row[0])
    assert list(census["workspaces"]) == ["update, checkpointing on", decode]
    for phase, found in census["workspaces"].items():
        assert found["by_op"] == {} and found["peak"] == found["peak_between_ops"], phase
        assert found["peak"] == pytest.approx(one[phase], rel=0.01), phase
    md = out.read_text()
    assert md.startswith("# Peak GPU memory per phase, measured on fake CUDA")
    assert f"| {decode}: the peak between two ops | - | {memory.gib(census['workspaces'][decode]['peak'])} |" in md
    assert "| | fake CUDA | GPU |" in md and "| **saved for the backward, in all** | " in md
    on = klein["one"][[row[0] for row in klein["one"]].index("update, checkpointing on")][1]
    assert f"| update, checkpointing on | {memory.gib(fake['flux2-klein LoRA r64']['one'][3][1])} | " \
           f"{memory.gib(on)} | {memory.gib(on)} |" in md
    table = memory.guide_table(fake, gpu).splitlines()
    row = next(line for line in table if line.startswith("| FLUX.2 [klein]"))
    assert "(fake CUDA)" not in row and f"| {on / 2 ** 30:.1f} / " in row
    assert memory.fits_on((on + 2 ** 29) / 2 ** 30, (on + 2 ** 29) / 2 ** 30 * 0.05) in row
    assert all("(fake CUDA)" in line for line in table[2:] if not line.startswith("| FLUX.2 [klein]"))


@pytest.mark.slow
def test_the_memory_benchmark_remeasures_one_configuration_and_keeps_the_others(tmp_path):
    """`python bench/memory.py --models flux2-klein --lora-only`, as a user reruns one configuration of
    results/memory.md: its own fake-CUDA workers (one process, then rank 0 of 8 under --fsdp) measure the same phases
    as the committed results, within 5% (exactly the same bytes with the torch and diffusers that made them), and the
    report keeps every other configuration's rows from the JSON beside it. About 70 s on 2 cores."""
    import shutil
    import subprocess
    import re
    import sys

    from tests import fake_cuda

    library, why = fake_cuda.build_library()   # bench/memory.py builds (or finds) the same library itself
    if library is None:
        pytest.skip(why)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    committed = os.path.join(root, "bench", "results", "memory.json")
    shutil.copy(committed, tmp_path / "memory.json")
    p = subprocess.run([sys.executable, os.path.join(root, "bench", "memory.py"), "--models", "flux2-klein",
                        "--lora-only", "--out", str(tmp_path / "memory.md")], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == f"wrote {tmp_path / 'memory.md'}"
    with open(committed) as f:
        before = json.load(f)
    after = json.loads((tmp_path / "memory.json").read_text())
    name = "flux2-klein LoRA r64"
    assert list(after) == list(before)   # the configurations not measured now keep their place and rows
    assert all(after[other] == before[other] for other in before if other != name)
    assert after[name]["settings"] == before[name]["settings"]
    for key in ("one", "fsdp"):
        assert [row[0] for row in after[name][key]] == [row[0] for row in before[name][key]]
        for (phase, got, *_), (_, made, *_) in zip(after[name][key], before[name][key]):
            assert got == pytest.approx(made, rel=0.05), (key, phase)
    md = (tmp_path / "memory.md").read_text()
    assert md.startswith("# Peak GPU memory per phase (fake CUDA, the real shapes)")
    sys.path.insert(0, os.path.join(root, "bench"))
    import memory
    for (phase, one, *_), (_, sharded, *_) in zip(after[name]["one"], after[name]["fsdp"]):
        assert f"| {phase} | {memory.gib(one)} | {memory.gib(sharded)} |" in md, phase
    assert [line for line in md.splitlines() if line.startswith("## ")][:len(before)] == \
        [f"## {memory.config_title(other)}" for other in before]
    # the rerun's section says when and with what it was measured (kept ones: as their JSON has it)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d with torch \S+, diffusers \S+", after[name]["measured"])
    assert f"Measured in {after[name]['seconds']:.0f} s on {after[name]['measured']}." in md


# --------------------------------------------------------------------------- the scenarios (run in the worker)


def _start(flags, output_dir, world=1, **overrides):
    import vgrpo

    args = vgrpo.parse_args([*flags, "--device", "cuda", "--output-dir", output_dir, "--iterations", "1",
                             *[f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]])
    vgrpo.validate(args, world)
    # a GPU machine's torch has triton and gcc, and its GPU is new enough: --compile auto compiles the real models'
    # blocks (torch.compile runs them eagerly under the fake mode, through the compiled path's code in vgrpo)
    vgrpo.missing_compile_toolchain = lambda device: None
    return vgrpo.start_run(args)


@contextlib.contextmanager
def _counting_old_surrogate_rows():
    """A list that gets the rows of every old-surrogate pass while the block runs (the pass runs with inner steps
    > 1)."""
    import vgrpo

    rows, real = [], vgrpo.old_surrogate

    def counting(*a, **k):
        s_old, x0_old = real(*a, **k)
        rows.append(len(s_old))
        return s_old, x0_old

    vgrpo.old_surrogate = counting
    try:
        yield rows
    finally:
        vgrpo.old_surrogate = real


def _device_types(tensors):
    return sorted({t.device.type for t in tensors})


def one_iteration(flags, output_dir):
    import torch

    import vgrpo
    from tests.fake_cuda import FakeCuda

    with FakeCuda(strict=True) as gpu:
        run, start = _start(flags, output_dir)
        gpu.reset_counts()
        with _counting_old_surrogate_rows() as old_rows:
            stats, images, prompts, r, A = vgrpo.train_iteration(run, start)
        peak = gpu.memory.peak
        m = vgrpo.iteration_metrics(run, start, stats, r, A)
        peak_after_reset, resident = gpu.memory.peak, torch.cuda.memory_allocated()
        vgrpo.record(run, m, (images, prompts, r), first=True, last=True)
        states = [t for s in run.optimizer.state.values() for t in s.values() if t.dim() > 0]
        with open(os.path.join(output_dir, "metrics.jsonl")) as f:
            logged = [json.loads(line)["iteration"] for line in f]
        return {"device": str(run.device), "mixes": gpu.mixes, "counts": dict(gpu.counts),
                "trainable_devices": _device_types(run.params),
                "optimizer_devices": _device_types(states), "fused": run.optimizer.defaults.get("fused"),
                "stats_device": A.device.type, "images_device": images.device.type, "metrics": m,
                "logged_iterations": logged, "scaler": run.scaler is not None, "old_pass_rows": sum(old_rows),
                "peak": peak, "peak_after_reset": peak_after_reset, "resident": resident,
                "attention": _attention_kernels(),
                "sample_grid": os.path.isfile(os.path.join(output_dir, "samples", "iter-00001.png")),
                "compiled": run.family.compiled, "reward_dtypes": _reward_model_dtypes()}


def _reward_model_dtypes():
    """The dtypes of the CLIP reward models alive in this process (PickScore, CLIPScore, HPSv2.1, the aesthetic
    predictor's tower: the text encoders of SD3 and FLUX are other classes)."""
    import gc

    from transformers import CLIPModel

    gc.collect()
    # issubclass(type(...)): isinstance reads __class__, which raises on a dead weakref.proxy (dynamo makes them)
    return sorted({str(p.dtype) for m in gc.get_objects() if issubclass(type(m), CLIPModel) for p in m.parameters()})


def _attention_kernels():
    """The SDPA kernels torch may pick now (the process-wide flags --attention sets)."""
    import torch

    b = torch.backends.cuda
    return sorted(name for name, on in (("flash", b.flash_sdp_enabled()), ("efficient", b.mem_efficient_sdp_enabled()),
                                        ("cudnn", b.cudnn_sdp_enabled()), ("math", b.math_sdp_enabled())) if on)


def reduced_on(devices):
    """vgrpo.reduce_stats over 8 fake processes with its tensors on each device -> "reduced" or the error."""
    import torch

    import vgrpo
    from tests.fake_cuda import FakeCuda, fake_processes

    got = {}
    with fake_processes(8), FakeCuda(strict=True):
        torch.distributed.init_process_group("nccl")
        for device in devices:
            try:
                vgrpo.reduce_stats({"policy_loss": 0.5, "ratio_max": 1.0}, 8, torch.device(device))
                got[device] = "reduced"
            except Exception as e:  # noqa: BLE001
                got[device] = f"{type(e).__name__}: {e}"
    return got


@contextlib.contextmanager
def _rank_0_of(world):
    """fake_processes(world), with the two verdicts that compare ranks' values answered by rank 0's own."""
    import vgrpo
    from tests.fake_cuda import fake_processes

    real = vgrpo.check_ranks_agree, vgrpo.any_rank

    # Their collectives run (on the fake GPU, in strict mode), but what they answer comes from other ranks' values,
    # which fake collectives do not carry: every .item() reads a dummy. Rank 0's own answer stands in.
    def check_ranks_agree(*a, **k):
        try:
            real[0](*a, **k)
        except vgrpo.FatalError:  # two dummies compared: "different"
            pass

    def any_rank(flag, processes, device):
        real[1](flag, processes, device)
        return bool(flag)

    vgrpo.check_ranks_agree, vgrpo.any_rank = check_ranks_agree, any_rank
    try:
        with fake_processes(world):
            yield
    finally:
        vgrpo.check_ranks_agree, vgrpo.any_rank = real


def sharded_iteration(flags, output_dir, world):
    """One iteration of rank 0 of `world` processes under --fsdp, then the weights a checkpoint gathers."""
    import vgrpo
    from tests.fake_cuda import FakeCuda

    with _rank_0_of(world), FakeCuda(strict=True) as gpu:
        run, start = _start(flags, output_dir, world)
        with _counting_old_surrogate_rows() as old_rows:
            stats, images, prompts, r, A = vgrpo.train_iteration(run, start)
        m = vgrpo.iteration_metrics(run, start, stats, r, A)
        names = [n for n, p in run.family.transformer.named_parameters() if p.requires_grad]
        gpu.reset_counts()
        weights = vgrpo.trained_weights(run)
        states = [t for s in run.optimizer.state.values() for t in s.values() if t.dim() > 0]
        return {"mixes": gpu.mixes, "metrics": m, "skipped_steps": stats["skipped_steps"],
                "fused": run.optimizer.defaults.get("fused"),
                "param_types": sorted({type(p).__name__ for p in run.params}),
                "local_devices": _device_types(p.to_local() for p in run.params),
                "optimizer_devices": _device_types(t.to_local() for t in states),
                "global_shapes": [(tuple(p.shape), p.numel()) for p in run.params],
                "local_numel": sum(p.to_local().numel() for p in run.params),
                "old_pass_rows": sum(old_rows), "gather_d2h": gpu.counts["d2h_sync"],
                "gathered": [list(weights[n].shape) if n in weights else None for n in names],
                "n_gathered": len(weights), "gathered_devices": _device_types(weights.values())}


def evaluation(flags, output_dir, world=1):
    """The held-out evaluation of one process, or of rank 0 of `world` under --fsdp (its sums reduced over ranks)."""
    import vgrpo
    from tests.fake_cuda import FakeCuda

    with _rank_0_of(world) if world > 1 else contextlib.nullcontext(), FakeCuda(strict=True) as gpu:
        run, _ = _start(flags, output_dir, world)
        m, images, prompts, r = vgrpo.evaluate(run, 0)
        return {"mixes": gpu.mixes, "eval": m, "eval_images": len(images), "eval_prompts": prompts,
                "attention": _attention_kernels()}


def checkpoint(flags, output_dir):
    """save_checkpoint on the fake GPU (the weights gathered to the host hold dummy values), then what a resume
    restores: the LoRA weights into the model on the GPU, and the AdamW states (which hold fake tensors, saved
    by torch.save as storage-less fakes, and load back as fakes of the same shapes)."""
    import vgrpo
    from tests.fake_cuda import FakeCuda

    with FakeCuda(strict=True) as gpu:
        run, _ = _start(flags, output_dir)
        gpu.reset_counts()
        weights = vgrpo.trained_weights(run)
        counts = dict(gpu.counts)
        path = vgrpo.save_checkpoint(run, 1)
        restored = vgrpo.load_trained_weights(path, run.family, run.args)
        try:
            vgrpo.load_training_state(path, run)
            optimizer = "restored"
        except Exception as e:  # noqa: BLE001 - reported to the test, which names what fake tensors cannot do
            optimizer = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return {"mixes": gpu.mixes, "counts": counts, "weights": len(weights),
                "weight_devices": _device_types(weights.values()), "files": sorted(os.listdir(path)),
                "restored_iteration": restored, "optimizer": optimizer,
                "lora_devices": _device_types(p for n, p in run.family.transformer.named_parameters()
                                              if "lora_" in n)}


def memory_counts():
    """DeviceMemory's bytes (no reconcile in between, as during a phase) around casts, views, frees and a graph."""
    import torch

    from tests.fake_cuda import FakeCuda

    out = {}
    with FakeCuda(strict=True) as gpu:
        x = torch.zeros(256, 1024, dtype=torch.bfloat16, device="cuda")   # 0.5 MiB
        torch.cuda.reset_peak_memory_stats()
        base = gpu.memory.current
        y = x.float()
        out["cast"] = gpu.memory.current - base
        view = x[:, :512]
        out["view"] = gpu.memory.current - base - out["cast"]
        del y, view
        out["cast_freed"], out["peak"] = gpu.memory.current - base, gpu.memory.peak - base
        w = torch.zeros(256, 1024, device="cuda", requires_grad=True)
        base = gpu.memory.current
        loss = w.to(torch.bfloat16).float().pow(2).sum()
        out["graph"] = gpu.memory.current - base
        loss.backward()
        del loss
        out["after_backward"] = gpu.memory.current - base
    return out


def mixing_ops():
    import torch

    from tests.fake_cuda import DeviceMixError, FakeCuda

    out = {}
    with FakeCuda(strict=True):
        x = torch.randn(3, device="cuda")
        try:
            x + torch.randn(3)
        except DeviceMixError as e:
            out["strict_add"] = f"DeviceMixError: {e}"
        try:
            torch.randn(5, 4, device="cuda")[torch.arange(2)]
        except DeviceMixError as e:
            out["strict_index"] = f"DeviceMixError: {e}"
        try:
            flag = torch.ones((), dtype=torch.bool)
            flag &= torch.isfinite(x.sum())
        except DeviceMixError as e:
            out["strict_written_scalar"] = f"DeviceMixError: {e}"
    with FakeCuda(strict=False) as gpu:
        out["lenient_index_shape"] = list(torch.randn(5, 4, device="cuda")[torch.arange(2)].shape)
        out["lenient_mixes"] = gpu.mixes
        gpu.reset_counts()
        y = torch.randn(3, device="cuda") * torch.tensor(2.0)   # a CPU scalar is a kernel argument: fine
        y = y + torch.arange(3.0).to("cuda")                      # one copy
        out["scalar_ok"] = y.device.type == "cuda" and y.sum().item() == 0.5 and y.cpu().tolist() == [0.5] * 3
        torch.arange(4.0).to("cuda", non_blocking=True)                # asked to overlap from pageable memory
        torch.arange(4.0).pin_memory().to("cuda", non_blocking=True)   # from pinned memory: it may
        out["transfer_counts"] = dict(gpu.counts)
    return out


def iteration_counts(flags, output_dir, variants):
    """One start, then an iteration per variant of (micro_batch, sample_steps): each one's counts."""
    import vgrpo
    from tests.fake_cuda import FakeCuda

    results = []
    with FakeCuda(strict=True) as gpu:
        run, _ = _start(flags, output_dir)
        for variant in variants:
            run.args = dataclasses.replace(run.args, **variant)
            run.sigmas = run.family.sigma_grid(run.args.sample_steps)
            gpu.reset_counts()
            vgrpo.train_iteration(run, 0)
            results.append({"mixes": list(gpu.mixes), "counts": dict(gpu.counts),
                            "where": {k: dict(v) for k, v in gpu.where.items()}})
    return results


def memory_on_gpu(out):
    """bench/memory.py --gpu with fake CUDA's byte count answering the caching allocator's counters: reserved =
    allocated, a 141 GiB card with 0.5 GiB used outside torch; attention as bench/memory.py's fake mode takes it
    (the fused kernels' memory, which a GPU's SDPA picks)."""
    import sys

    import torch

    from tests.fake_cuda import FakeCuda, _patched

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import memory

    total, outside = 141 * 2 ** 30, 2 ** 29
    with FakeCuda(strict=False) as gpu, contextlib.ExitStack() as stack:
        for name, value in {"init": lambda: None,
                            "memory_reserved": lambda device=None: gpu.memory.allocated(),
                            "max_memory_reserved": lambda device=None: gpu.memory.peak,
                            "mem_get_info": lambda device=None: (total - outside - gpu.memory.allocated(), total),
                            }.items():
            stack.enter_context(_patched(torch.cuda, name, value))
        stack.enter_context(_patched(torch.nn.functional, "scaled_dot_product_attention", memory.fused_attention))
        # the workspace census reads the counters around every op: DeviceMemory's own, without the scan of every
        # Python object that torch.cuda's answers start with (no op swaps a tensor's storage)
        stack.enter_context(_patched(memory, "allocator_counters", lambda: (
            lambda: (gpu.memory.current, gpu.memory.peak), lambda: setattr(gpu.memory, "peak", gpu.memory.current))))
        try:
            return memory.main(["--gpu", "--models", "flux2-klein", "--lora-only", "--out", out])
        finally:
            memory.REAL_GPU = False   # the worker goes on to other scenarios
