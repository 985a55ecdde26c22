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
