"""--kl-to: the reference of the KL term --beta weights. `sampling` (the paper's (7)) is the policy that drew the
batch, so with one optimizer step per iteration the term is 0; `initial` is the model before training, taken by
switching the LoRA off, so the term grows as the LoRA moves. Checked against an independent copy of the model whose
LoRA is zeroed, in-process on the tiny SD3; then the flag's refusals and the note on a KL that does nothing."""

import copy
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import vgrpo  # noqa: E402
from test_vgrpo import FAST, lora, metrics, run_script  # noqa: E402


def lora_zeroed(transformer):
    """A copy of the transformer whose LoRA adds nothing (every lora_B zero): the initial model, computed apart
    from peft's own switch."""
    initial = copy.deepcopy(transformer)
    for name, p in initial.named_parameters():
        if "lora_B" in name:
            p.data.zero_()
    return initial


@pytest.mark.parametrize("inner_steps", [1, 2])
def test_the_kl_to_the_initial_model_is_the_mean_squared_x_prediction_gap_to_the_lora_free_model(tmp_path,
                                                                                             monkeypatch, inner_steps):
    """Every row's reference equals the zeroed copy's x-prediction (with 2 inner steps too: the rows of each
    minibatch); with one inner step every forward of the update precedes its step, so the logged kl is the formula's
    on the weights before the update."""
    args = vgrpo.parse_args([*FAST, "--iterations", "2", "--beta", "1", "--kl-to", "initial", "--inner-steps",
                             str(inner_steps), "--micro-batch", "2", "--output-dir", str(tmp_path)])
    vgrpo.validate(args, 1)
    run, _ = vgrpo.start_run(args)
    seen = []
    reference = vgrpo.initial_x0

    @torch.no_grad()
    def spy(family, batch, args, n_prompts):
        x0_ref = reference(family, batch, args, n_prompts)
        # what the test computes itself, before the update moves the weights: x0_hat of the zeroed copy (the
        # reference) and of the current model (the update's forwards: one inner step, so all before its step)
        seen.append({name: torch.stack([
            vgrpo.surrogate(family, model, batch["o"][i:i + 1], batch["sigmas"][i:i + 1], batch["eps"][i:i + 1],
                            vgrpo.rows_of(batch["cond"], slice(i, i + 1)), args.weighting)[1][0]
            for i in range(len(batch["o"]))]) for name, model in (("initial", lora_zeroed(family.transformer)),
                                                                  ("current", family.transformer))})
        seen[-1]["x0_ref"] = x0_ref
        return x0_ref

    monkeypatch.setattr(vgrpo, "initial_x0", spy)
    stats = [vgrpo.train_iteration(run, it)[0] for it in range(2)]
    assert len(seen) == 2
    for it, s in enumerate(seen):
        torch.testing.assert_close(s["x0_ref"], s["initial"], rtol=0, atol=1e-6)
        if inner_steps == 1:
            expected = (s["current"] - s["initial"]).pow(2).mean().item()
            assert stats[it]["kl"] == pytest.approx(expected, rel=1e-4, abs=1e-12)
    # LoRA starts at zero (lora_B = 0): before the first step the reference pass and the update's forwards (the
    # same micro-batches) compute the same thing, bit for bit; a second inner step starts from moved weights
    assert (stats[0]["kl"] == 0.0) == (inner_steps == 1)
    assert stats[1]["kl"] > 1e-9                       # one step later the LoRA has moved the policy
    # the LoRA is back on after the reference pass: the trained model still differs from the initial one
    assert (seen[1]["current"] - seen[1]["x0_ref"]).abs().max() > 1e-5


def test_with_one_inner_step_the_kl_to_the_sampling_policy_is_zero_and_says_so(tmp_path, capsys):
    args = vgrpo.parse_args([*FAST, "--iterations", "2", "--beta", "1", "--output-dir", str(tmp_path)])
    vgrpo.validate(args, 1)
    assert "does nothing with --inner-steps 1" in capsys.readouterr().err
    run, _ = vgrpo.start_run(args)
    assert [vgrpo.train_iteration(run, it)[0]["kl"] for it in range(2)] == [0.0, 0.0]
    initial = vgrpo.parse_args([*FAST, "--beta", "1", "--kl-to", "initial", "--output-dir", str(tmp_path)])
    vgrpo.validate(initial, 1)
    assert "does nothing" not in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--full-finetune"], ["--compile", "on"]])
def test_the_kl_to_the_initial_model_needs_lora_and_eager_blocks(tmp_path, extra):
    args = vgrpo.parse_args([*FAST, "--beta", "1", "--kl-to", "initial", *extra, "--output-dir", str(tmp_path)])
    with pytest.raises(vgrpo.UsageError, match="--kl-to initial .* needs LoRA"):
        vgrpo.validate(args, 1)


def test_compile_auto_leaves_the_blocks_eager_for_the_kl_to_the_initial_model(monkeypatch):
    """On CUDA, --compile auto compiles a real model's blocks, except where the LoRA is switched off for the KL's
    reference (peft cannot do that under torch.compile)."""
    monkeypatch.setattr(vgrpo, "missing_compile_toolchain", lambda device: None)   # a GPU machine's triton and gcc
    args = vgrpo.Args(model="sd3", compile="auto", kl_to="initial")
    assert vgrpo.compile_wanted(args, 1, torch.device("cuda")) is False
    assert vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="auto"), 1, torch.device("cuda"))   # kl_to sampling


def test_compile_on_cuda_without_triton_or_a_c_compiler_runs_eagerly_or_refuses(monkeypatch, capsys, tmp_path):
    """torch.compile's CUDA kernels need triton, a GPU of compute capability 7.0+, a C compiler and Python's C headers
    (a slim container image has neither): --compile auto then leaves the blocks eager with one note, --compile on
    refuses in one line, before the models load. What is missing is told apart."""
    import shutil
    import sysconfig
    import torch.utils._triton as triton_utils

    cuda = torch.device("cuda")
    real_paths, schemes = sysconfig.get_paths, []

    def get_paths(*args, **kwargs):   # this machine's paths, but the headers in tmp_path: CI's may have none
        schemes.append(kwargs.get("scheme", args[0] if args else None))
        return dict(real_paths(*args, **kwargs), include=str(tmp_path))

    monkeypatch.setattr(sysconfig, "get_paths", get_paths)
    (tmp_path / "Python.h").touch()
    monkeypatch.setattr(triton_utils, "has_triton_package", lambda: False)
    assert vgrpo.missing_compile_toolchain(cuda) == "triton (pip install triton)"
    monkeypatch.setattr(triton_utils, "has_triton_package", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (6, 1))
    assert vgrpo.missing_compile_toolchain(cuda) == "a GPU of compute capability 7.0 or newer (this one: 6.1)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert vgrpo.missing_compile_toolchain(cuda) == "a C compiler for triton (gcc or clang, or its path in $CC)"
    monkeypatch.setenv("CC", "/opt/cc")
    assert vgrpo.missing_compile_toolchain(cuda) is None
    monkeypatch.delenv("CC")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/clang" if name == "clang" else None)
    assert vgrpo.missing_compile_toolchain(cuda) is None
    (tmp_path / "Python.h").unlink()
    assert vgrpo.missing_compile_toolchain(cuda) == (f"Python's C headers for triton ({tmp_path}/Python.h: the "
                                                     "python3-dev package of this Python)")
    (tmp_path / "Python.h").touch()
    monkeypatch.setattr(sysconfig, "get_default_scheme", lambda: "posix_local")   # Debian's system Python
    schemes.clear()
    assert vgrpo.missing_compile_toolchain(cuda) is None and schemes == ["posix_prefix"]   # where triton looks

    monkeypatch.setattr(shutil, "which", lambda name: None)   # no compiler
    assert vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="auto"), 1, cuda) is False
    assert "blocks run eagerly (slower): torch.compile on CUDA needs a C compiler" in capsys.readouterr().err
    with pytest.raises(vgrpo.UsageError, match=r"^--compile on: torch.compile on CUDA needs a C compiler .*--compile "
                                               r"off \(eager, slower\)$"):
        vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="on"), 1, cuda)
    cpu = torch.device("cpu")
    assert vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="on"), 1, cpu) is True   # inductor's C++

    # the refusal comes before the minutes of loading the models, encoding the prompts and loading the rewards
    loaded = []
    monkeypatch.setattr(vgrpo, "load_family", lambda *args: loaded.append(args))
    with pytest.raises(vgrpo.UsageError, match="needs a C compiler"):
        vgrpo.build_run(vgrpo.Args(model="sd3", compile="on"), 0, 1, cuda)
    assert loaded == []


# One of 2 ranks, on a node without a C compiler: what --compile auto and --compile on decide there.
COMPILE_ON_TWO_NODES = """
import sys, torch, torch.distributed as dist
import vgrpo
rank = int(sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method="file://" + sys.argv[1])
vgrpo.missing_compile_toolchain = lambda device: "a C compiler" if rank == 1 else None
cuda = torch.device("cuda")   # only its type is read: the toolchain check is replaced above
print("auto:", vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="auto"), 2, cuda))
try:
    vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="on"), 2, cuda)
except vgrpo.UsageError as e:
    print("on:", e)
dist.barrier()
dist.destroy_process_group()
"""


def test_every_rank_decides_compile_alike_when_one_node_lacks_the_toolchain(tmp_path):
    """2 ranks, the second on a node without gcc: --compile auto runs every rank's blocks eagerly (a rank compiled
    among eager ones would train with other numerics), with rank 0's note naming the rank; --compile on refuses on
    both ranks, naming it."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", COMPILE_ON_TWO_NODES, str(tmp_path / "group"), str(rank)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    lacks = ["triton, a GPU of compute capability 7.0+ and a C compiler, and rank 1 lacks one",
             "a C compiler on rank 1"]
    for (out, _), what in zip(outputs, lacks):
        assert out.splitlines() == ["auto: False", f"on: --compile on: torch.compile on CUDA needs {what}; or "
                                                   "--compile off (eager, slower)"], out
    assert f"blocks run eagerly (slower): torch.compile on CUDA needs {lacks[0]}" in outputs[0][1]


@pytest.mark.slow
def test_the_kl_to_the_initial_model_trains_alike_on_one_and_two_processes_and_under_fsdp(tmp_path):
    """The reference pass runs on each process's own rows with the LoRA switched off on the unwrapped (DDP) or
    sharded (FSDP2) transformer: 1 and 2 processes train the same weights bit for bit (the same rows per micro-batch,
    as test_vgrpo.py's), FSDP to rounding, and log the same KL (about 40 s)."""

    common = [*FAST, "--iterations", "2", "--beta", "1", "--kl-to", "initial", "--save-every", "2",
              "--inner-steps", "2", "--micro-batch", "2"]
    for name, extra, nproc in (("one", [], None), ("two", [], 2), ("fsdp", ["--fsdp"], 2)):
        p = run_script(*common, *extra, "--output-dir", tmp_path / name, nproc=nproc)
        assert p.returncode == 0, (name, p.stderr[-3000:])
    weights = {name: lora(tmp_path / name, 2) for name in ("one", "two", "fsdp")}
    kl = {name: [m["kl"] for m in metrics(tmp_path / name)] for name in ("one", "two", "fsdp")}
    assert kl["one"][0] > 0 and kl["one"][1] > 0     # the second inner step of each iteration has moved the LoRA
    assert weights["one"].keys() == weights["two"].keys() == weights["fsdp"].keys()
    assert all(torch.equal(weights["one"][k], v) for k, v in weights["two"].items())
    assert all(torch.allclose(weights["one"][k], v, rtol=0, atol=1e-6) for k, v in weights["fsdp"].items())
    assert kl["two"] == pytest.approx(kl["one"], rel=1e-5) and kl["fsdp"] == pytest.approx(kl["one"], rel=1e-3)


def test_an_error_in_the_reference_pass_leaves_the_lora_switched_on(tmp_path, monkeypatch):
    from peft.tuners.tuners_utils import BaseTunerLayer

    args = vgrpo.parse_args([*FAST, "--beta", "1", "--kl-to", "initial", "--output-dir", str(tmp_path)])
    run, _ = vgrpo.start_run(args)
    layers = [m for m in run.family.transformer.modules() if isinstance(m, BaseTunerLayer)]
    seen = []

    def failing(*_):
        seen.append([layer.disable_adapters for layer in layers])
        raise RuntimeError("out of memory")

    monkeypatch.setattr(vgrpo, "surrogate", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        vgrpo.train_iteration(run, 0)
    assert layers and all(seen[0])                                   # off during the pass
    assert not any(layer.disable_adapters for layer in layers)       # on again after it


def test_a_demo_run_past_its_80_iterations_is_told_which_setting_held(tmp_path, capsys):
    """bench/stability.py: past 80 iterations the demo swings; the run that goes there without the KL to the start
    is told the setting that held (and the default 80-iteration demo, or a run with that setting, is not)."""
    told = "--beta 0.3 --kl-to initial --ema 0.95 held within 0.05"
    for flags, expected in [([], False), (["--iterations", "240"], True),
                            (["--iterations", "81", "--beta", "0.3"], True),
                            (["--iterations", "240", "--beta", "0.3", "--kl-to", "initial", "--ema", "0.95"], False)]:
        vgrpo.validate(vgrpo.parse_args([*flags, "--output-dir", str(tmp_path)]), 1)
        assert (told in capsys.readouterr().err) == expected, flags


def test_notes_are_printed_once_by_rank_0(tmp_path, capsys, monkeypatch):
    """Hints print on rank 0 only (torchrun would print 8 copies), with vgrpo's prefix: the long-run note above and the
    FLUX.1-dev preset's UnifiedReward note."""
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        vgrpo.validate(vgrpo.parse_args(["--iterations", "240", "--output-dir", str(tmp_path)]), 1)
        err = capsys.readouterr().err
        assert err.startswith("vgrpo: note: past about 80 iterations") and err.count("\n") == 1 if rank == "0" \
            else err == ""
        vgrpo.check_reward_specs(vgrpo.parse_args(["--preset", "flux-preference", "--output-dir", str(tmp_path)]))
        assert capsys.readouterr().err == ("vgrpo: note: " + vgrpo.UNIFIEDREWARD_NOTE + "\n" if rank == "0" else "")
