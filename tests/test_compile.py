"""--compile on the CPU (inductor runs there): each transformer block compiled in place, with LoRA, gradient
checkpointing, several inner steps and the KL term. The properties the eager path keeps hold compiled: the old
surrogate and the update's first forward agree bit for bit, shapes stop recompiling after the first iteration, a
resumed run continues exactly, one and two processes train the same weights. The first compile takes a minute or two
on 2 cores (inductor's cache makes later ones seconds)."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import vgrpo  # noqa: E402
from test_vgrpo import FAST, metrics, run_script, weights  # noqa: E402

pytestmark = pytest.mark.slow
# LoRA on the tiny SD3 with gradient checkpointing, 2 inner steps (the old-surrogate pass) and the KL term
FLAGS = [*FAST, "--iterations", "2", "--inner-steps", "2", "--micro-batch", "2", "--beta", "0.1",
         "--gradient-checkpointing"]


def start(tmp_path, compile_flag, *extra):
    args = vgrpo.parse_args([*FLAGS, "--compile", compile_flag, *extra, "--output-dir",
                             str(tmp_path / (compile_flag + "".join(extra)))])
    vgrpo.validate(args, 1)
    return vgrpo.start_run(args)[0]


def test_compiled_blocks_see_the_old_surrogates_numerics_and_stop_recompiling(tmp_path):
    import smoke

    assert not start(tmp_path, "auto").family.compiled                    # auto: on CUDA only
    runs = {flag: start(tmp_path, flag) for flag in ("off", "on")}
    runs["bf16"] = start(tmp_path, "on", "--mixed-precision", "bf16")   # where compiled graphs round differently
    assert runs["on"].family.compiled and all(hasattr(b, "_compiled_call_impl") for b in runs["on"].family.blocks())
    first, stats, graphs = {}, {}, []
    real_update = vgrpo.update
    try:
        for flag, run in runs.items():
            vgrpo.update = smoke.first_step_check(real_update, first.setdefault(flag, {}))
            stats[flag] = []
            for it in range(2):
                stats[flag].append(vgrpo.train_iteration(run, it)[0])
                graphs.append(vgrpo.compiled_graphs())
    finally:
        vgrpo.update = real_update
    # the old-surrogate pass and the update's first forward (checkpointing): one numerics, in float32 and in bf16,
    # where the graphs torch compiles for passes with and without gradients round differently (3.1e-5 here when the
    # old pass ran without gradients)
    assert first["on"]["ratio"] == 0.0 and first["off"]["ratio"] == 0.0 and first["bf16"]["ratio"] == 0.0
    assert graphs[0] == graphs[1] and graphs[2] > graphs[1] and graphs[3] == graphs[2]   # compiled once, then reused
    assert graphs[4] > graphs[3] and graphs[5] == graphs[4]
    # the same training, to float rounding, over the first iteration's two inner steps (the second runs on weights
    # the first step changed). Not after it: the next rollout starts from weights that differ by rounding, and the
    # JPEG reward counts bytes, which a last-bit change of a pixel can change (measured with transformers 5.25 and
    # torch 2.13: grad_norm 0.00188 compiled against 0.00210 eager at iteration 2, equal to 1e-7 at iteration 1)
    compiled, eager = stats["on"][0], stats["off"][0]
    for key in ("policy_loss", "grad_norm", "kl"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-3, abs=1e-7), key
    assert all(s["skipped_steps"] == 0 for s in stats["on"])
    assert stats["on"][1]["ratio_max"] > 1 or stats["on"][1]["ratio_min"] < 1       # the second inner step moved


def test_compiled_runs_resume_exactly_and_train_the_same_on_two_processes(tmp_path):
    common = [*FLAGS, "--compile", "on", "--save-every", "1"]
    whole = run_script(*common, "--output-dir", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "blocks compiled" in whole.stdout
    resumed = run_script(*common, "--output-dir", tmp_path / "resumed", "--resume", tmp_path / "whole" / "checkpoint-1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    two = run_script(*common, "--output-dir", tmp_path / "two", nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    # FSDP2 shards the compiled blocks (compile first, then fully_shard): the same training as DDP, to float rounding
    # (its gradients are reduce-scattered rather than all-reduced)
    sharded = run_script(*common, "--fsdp", "--output-dir", tmp_path / "sharded", nproc=2)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    w = weights(tmp_path / "whole", 2)
    for other in ("resumed", "two"):
        other_w = weights(tmp_path / other, 2)
        assert other_w.keys() == w.keys() and all(torch.equal(w[k], v) for k, v in other_w.items()), other
    w_sharded = weights(tmp_path / "sharded", 2)
    assert w_sharded.keys() == w.keys()
    assert all(torch.allclose(w_sharded[k], v, rtol=1e-4, atol=1e-8) for k, v in w.items())   # LoRA's B moved ~1e-3
    assert metrics(tmp_path / "sharded")[1]["compiled_graphs"] == metrics(tmp_path / "sharded")[0]["compiled_graphs"]
    m = metrics(tmp_path / "whole")
    assert m[0]["compiled_graphs"] > 0 and m[1]["compiled_graphs"] == m[0]["compiled_graphs"]
    assert m[0]["compile_s"] > 0 and m[1]["compile_s"] == m[0]["compile_s"]     # compiled in the first iteration only
    assert m[0]["compile_s"] < m[0]["time_total"]                                # and within it
    assert metrics(tmp_path / "resumed")[-1]["policy_loss"] == m[1]["policy_loss"]


def test_every_compiled_variant_of_the_sd35_blocks_stays_compiled(tmp_path, monkeypatch):
    """SD3.5-M's kinds of block (dual attention, plain, the last without a text output; the first, whose input needs
    no gradient) share one forward, and its compiled variants count against one limit: smoke's iteration and
    evaluation compile 11 of them here (without gradients at the rollout's batch and at the evaluation's, with them
    in the update), past torch's default of 8, beyond which torch runs the rest eagerly without an error. Guards and
    limits are dynamo's, the same for any backend, so the blocks compile with the "eager" backend (seconds)."""
    import reward
    import smoke
    from torch._dynamo.utils import counters

    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: real_compile(self, backend="eager"))
    # torch's default, which compile_blocks raises (set and put back by hand: monkeypatch's undo deletes a torch
    # config's entry, and every later compile in this process would fail)
    limit, torch._dynamo.config.recompile_limit = torch._dynamo.config.recompile_limit, 8
    monkeypatch.setattr(smoke, "QUICK", [*smoke.QUICK, "--compile", "on"])
    for name in ("update", "load_pipeline"):       # smoke.run_config replaces them for its own process
        monkeypatch.setattr(vgrpo, name, getattr(vgrpo, name))
    for name in ("pickscore", "hpsv2"):
        monkeypatch.setitem(reward.REWARDS, name, reward.REWARDS[name])
    torch._dynamo.reset()
    before = dict(counters["frames"])
    try:
        result = smoke.run_config("sd3-lora", True, str(tmp_path))   # SD3.5-M's blocks at toy width, an evaluation
    finally:
        torch._dynamo.reset()   # the eager backend's entries must not count against later tests' limit
        torch._dynamo.config.recompile_limit = limit
    attempted, compiled = (counters["frames"][k] - before.get(k, 0) for k in ("total", "ok"))
    assert compiled >= 9 and attempted == compiled          # more variants than the default limit, every one compiled
    assert result["first_step_ratio"] == 0.0 and result["skipped_steps"] == 0


def test_compile_seconds_count_a_backward_compiled_at_its_first_backward():
    """torch compiles a backward graph that keeps no symbolic sizes only when the first backward runs, under a timer of
    its own (not the frame's): the run's compile_s counts it. (Compiled anew: a graph found in inductor's caches
    comes back with its backward.)"""
    import torch._functorch.config
    import torch._inductor.config

    class Block(torch.nn.Module):      # (torch.compile does not trace torch.nn's own containers' forward)
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.b(torch.nn.functional.gelu(self.a(x)))

    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            block = Block()
            block.compile()
            loss = block(torch.randn(4, 8)).sum()
            after_forward = vgrpo.compile_seconds()
            loss.backward()
            assert after_forward > 0 and vgrpo.compile_seconds() > after_forward
    finally:
        torch._dynamo.reset()
