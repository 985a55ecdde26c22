"""--ema: an exponential moving average of the trained weights. Against the formula over several optimizer steps
(in-process, the weights read after every step); then whole runs as users launch them: the EMA saved beside the
weights in the pipelines' format, loaded by diffusers, restored exactly on resume, the same on 1 and 2 processes, and
sharded under --fsdp like the weights."""

import os
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import vgrpo  # noqa: E402
from test_vgrpo import FAST, run_script  # noqa: E402


def test_the_ema_follows_its_formula_after_every_optimizer_step_and_swaps_back(tmp_path):
    """Full fine-tuning of the tiny SD3, 2 inner steps per iteration for 2 iterations: e <- 0.6 e + 0.4 w after each
    of the 4 steps, with w the weights right after that step (recorded here, in float64)."""
    args = vgrpo.parse_args([*FAST, "--full-finetune", "--iterations", "2", "--inner-steps", "2", "--micro-batch", "2",
                             "--ema", "0.6", "--output-dir", str(tmp_path)])
    vgrpo.validate(args, 1)
    run, _ = vgrpo.start_run(args)
    expected = [p.detach().double().clone() for p in run.params]
    steps = []

    def after_step(*_):   # registered after the EMA's hook, so it runs after the EMA took this step
        steps.append(1)
        for e, p in zip(expected, run.params):
            e.mul_(0.6).add_(0.4 * p.detach().double())

    run.optimizer.register_step_post_hook(after_step)
    for it in range(2):
        vgrpo.train_iteration(run, it)
    assert len(steps) == 4
    moved = max((e - s.double()).abs().max().item() for e, s in zip(expected, [p.detach() for p in run.params]))
    assert moved > 1e-4                                                   # the EMA lags the weights
    assert len(run.ema.shadow) == len(run.params) == len(expected) > 0
    for e, shadow in zip(expected, run.ema.shadow):
        torch.testing.assert_close(shadow.double(), e, rtol=0, atol=1e-6)
    trained = [p.detach().clone() for p in run.params]
    with run.ema.swapped_in():
        assert all(torch.equal(p, s) for p, s in zip(run.params, run.ema.shadow))
    assert all(torch.equal(p, t) for p, t in zip(run.params, trained))   # the trained weights are back, exactly


@pytest.mark.slow
def test_the_ema_is_saved_loaded_by_diffusers_resumed_exactly_and_equal_on_two_processes_and_under_fsdp(tmp_path):
    # 2 inner steps of micro-batches of 2: the same rows per step on 1 or 2 processes (test_vgrpo.py: bit for bit)
    common = [*FAST, "--iterations", "2", "--ema", "0.9", "--save-every", "1", "--inner-steps", "2",
              "--micro-batch", "2"]
    for name, extra, nproc in (("one", [], None), ("two", [], 2), ("fsdp", ["--fsdp"], 2),
                               ("resumed", ["--resume", tmp_path / "one" / "checkpoint-1"], None)):
        p = run_script(*common, *extra, "--output-dir", tmp_path / name, nproc=nproc)
        assert p.returncode == 0, (name, p.stderr[-3000:])

    def lora(name, ema=True):
        path = tmp_path / name / "checkpoint-2" / ("ema" if ema else "") / "pytorch_lora_weights.safetensors"
        return load_file(str(path))

    one, trained, first = lora("one"), lora("one", ema=False), load_file(
        str(tmp_path / "one" / "checkpoint-1" / "ema" / "pytorch_lora_weights.safetensors"))
    assert one.keys() == trained.keys()
    assert any(not torch.equal(one[k], trained[k]) for k in one)          # the EMA is not the weights
    assert any(not torch.equal(one[k], first[k]) for k in one)            # and it moved from iteration 1 to 2
    for name in ("two", "resumed"):                                       # bit for bit, as the weights
        assert lora(name).keys() == one.keys() and all(torch.equal(one[k], v) for k, v in lora(name).items()), name
    sharded = lora("fsdp")                                                # FSDP: equal to rounding (test_fsdp.py)
    assert sharded.keys() == one.keys()
    assert all(torch.allclose(one[k], v, rtol=0, atol=1e-6) for k, v in sharded.items())
    pipe = vgrpo.build_tiny_sd3_pipeline()                                # the format the pipelines load
    pipe.load_lora_weights(str(tmp_path / "one" / "checkpoint-2" / "ema"))
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_B" in n}
    assert loaded and any(p.abs().max() > 0 for p in loaded.values())
