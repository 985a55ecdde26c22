"""--compile. What decides it on a GPU (the CUDA device pretended, in-process and in two gloo processes: a toolchain
missing, other ranks, the flags, the counters the metrics read); then, in the slow tier, --compile on the CPU
(inductor runs there): each transformer block compiled in place, with LoRA, gradient checkpointing, several inner
steps and the KL term. The properties the eager path keeps hold compiled: the old surrogate and the update's first
forward agree bit for bit, shapes stop recompiling after the first iteration, a resumed run continues exactly, one
and two processes train the same weights. The first compile takes a minute or two on 2 cores (inductor's cache makes
later ones seconds)."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import vgrpo  # noqa: E402
from test_vgrpo import FAST, metrics, run_script, run_two_gloo_ranks, weights  # noqa: E402


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
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)   # most machines
    assert vgrpo.missing_compile_toolchain(cuda) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))   # V100, and T4's 7.5
    assert vgrpo.missing_compile_toolchain(cuda) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
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
    outputs = run_two_gloo_ranks(COMPILE_ON_TWO_NODES, tmp_path)
    lacks = ["triton, a GPU of compute capability 7.0+ and a C compiler, and rank 1 lacks one",
             "a C compiler on rank 1"]
    for (out, _), what in zip(outputs, lacks):
        assert out.splitlines() == ["auto: False", f"on: --compile on: torch.compile on CUDA needs {what}; or "
                                                   "--compile off (eager, slower)"], out
    assert f"blocks run eagerly (slower): torch.compile on CUDA needs {lacks[0]}" in outputs[0][1]


def test_compile_auto_compiles_real_models_on_cuda_only(monkeypatch):
    """--compile auto: a real model's blocks compile on CUDA; on the CPU, for the tiny models and for the digits demo
    (whose whole run takes less than compiling) they stay eager; --compile on and off decide alone."""
    monkeypatch.setattr(vgrpo, "missing_compile_toolchain", lambda device: None)   # a GPU machine's triton and gcc
    models, devices = ("sd3", "flux", "digits", "tiny"), (torch.device("cuda"), torch.device("cpu"))
    decided = {(model, flag, device.type): vgrpo.compile_wanted(vgrpo.Args(model=model, compile=flag), 1, device)
               for model in models for flag in ("auto", "on", "off") for device in devices}
    compiled = {key for key, wanted in decided.items() if wanted}
    assert compiled == {("sd3", "auto", "cuda"), ("flux", "auto", "cuda"),
                        *((model, "on", device.type) for model in models for device in devices)}


class FakeGroup:
    """torch.distributed as one rank of two sees it, the other rank's answer to the all-reduce scripted."""

    def __init__(self, monkeypatch, backend, other_rank_lacks):
        self.backend, self.other_rank_lacks, self.reduced = backend, other_rank_lacks, []
        monkeypatch.setattr(vgrpo.dist, "get_rank", lambda: 1)
        monkeypatch.setattr(vgrpo.dist, "get_backend", lambda: self.backend)
        monkeypatch.setattr(vgrpo.dist, "all_reduce", self.all_reduce)
        real = torch.tensor   # a CUDA tensor cannot be made here: made on the CPU, its device recorded
        monkeypatch.setattr(torch, "tensor", lambda data, device=None: self.reduced.append(str(device)) or real(data))

    def all_reduce(self, t, op):
        assert op == vgrpo.dist.ReduceOp.MAX   # the last rank that lacks a part, whatever the number of ranks
        t.copy_(t.clamp(min=1 if self.other_rank_lacks else 0))   # rank 0 answers 0 + 1 when it lacks one


def test_every_rank_decides_compile_alike_on_nccl_and_names_rank_0(monkeypatch, capsys):
    """The ranks' answers are reduced on the GPU under NCCL (which cannot reduce a CPU tensor), on the CPU under gloo;
    rank 1 with the toolchain follows rank 0 without it: eager under auto (rank 0 prints the note), refusing under
    on, naming rank 0."""
    monkeypatch.setattr(vgrpo, "missing_compile_toolchain", lambda device: None)
    monkeypatch.setenv("RANK", "1")   # as torchrun sets it for rank 1: notes are rank 0's
    cuda = torch.device("cuda")
    group = FakeGroup(monkeypatch, "nccl", other_rank_lacks=False)
    assert vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="auto"), 2, cuda) is True
    group.backend, group.other_rank_lacks = "gloo", True
    assert vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="auto"), 2, cuda) is False
    assert group.reduced == ["cuda", "cpu"] and capsys.readouterr().err == ""
    with pytest.raises(vgrpo.UsageError, match="and rank 0 lacks one; or --compile off"):
        vgrpo.compile_wanted(vgrpo.Args(model="sd3", compile="on"), 2, cuda)


def test_compile_blocks_compiles_each_block_in_place_and_raises_the_recompile_limit():
    """Each block compiled in place (its calls go through torch.compile, the module stays the one FSDP2 shards) and
    the limit of compiled variants per block class raised to what SD3.5-M needs under FSDP2 (14), never lowered."""
    import types

    limit = torch._dynamo.config.recompile_limit   # set and restored by hand: monkeypatch's undo deletes the entry
    try:
        torch._dynamo.config.recompile_limit = 8
        blocks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        family = types.SimpleNamespace(blocks=lambda: blocks, compiled=False)
        vgrpo.compile_blocks(family)
        assert family.compiled and all(b._compiled_call_impl is not None for b in blocks)
        assert torch._dynamo.config.recompile_limit == vgrpo.RECOMPILE_LIMIT >= 14
        torch._dynamo.config.recompile_limit = 100
        vgrpo.compile_blocks(types.SimpleNamespace(blocks=lambda: [], compiled=False))
        assert torch._dynamo.config.recompile_limit == 100
    finally:
        torch._dynamo.config.recompile_limit = limit


def test_the_metrics_count_the_frames_compiled_and_the_seconds_compiling(monkeypatch):
    """compiled_graphs: the frames torch.compile compiled (not those it tried and gave up on, which run eagerly);
    compile_s: its frame compiles and lazily compiled backwards, None where torch keeps no such timer; both logged
    each iteration of a compiled run."""
    import collections
    import types

    from torch._dynamo import utils

    monkeypatch.setitem(utils.counters, "frames", collections.Counter(total=5, ok=3))
    assert vgrpo.compiled_graphs() == 3
    monkeypatch.setattr(utils, "compilation_time_metrics", {})
    assert vgrpo.compile_seconds() is None
    monkeypatch.setattr(utils, "compilation_time_metrics", {"_compile.compile_inner": [1.0, 2.0], "backward."
                        "_backward_impl": [0.5], "OutputGraph.call_user_compiler": [9.0]})   # the last inside the first
    assert vgrpo.compile_seconds() == 3.5
    monkeypatch.setattr(vgrpo, "compiled_graphs", lambda: 7)
    monkeypatch.setattr(vgrpo, "compile_seconds", lambda: 1.5)
    run = types.SimpleNamespace(args=types.SimpleNamespace(group_size=2), world=1, device=torch.device("cpu"),
                                stages=[None], optimizer=types.SimpleNamespace(state={}),
                                family=types.SimpleNamespace(transformer=torch.nn.Linear(1, 1), compiled=True))
    stats = {f"time_{k}": 0.0 for k in ("rollout", "reward", "old", "update")}
    m = vgrpo.iteration_metrics(run, 0, stats, torch.tensor([0.0, 1.0]), torch.tensor([-1.0, 1.0]))
    assert (m["compiled_graphs"], m["compile_s"]) == (7, 1.5)
    run.family.compiled = False
    assert "compile_s" not in vgrpo.iteration_metrics(run, 0, stats, torch.tensor([0.0, 1.0]), torch.tensor([-1., 1.]))


class Started(Exception):
    """Raised where start_run would load the models: what it set before is what the test reads."""


@pytest.mark.parametrize("tf32", [True, False])
def test_a_run_on_cuda_sets_tf32_and_leaves_cudnn_attention_out(monkeypatch, tf32):
    """On CUDA, start_run sets TF32 matmuls as --tf32 says and lets torch pick among --attention's kernels only: by
    default flash, memory-efficient and math, never cuDNN attention, which fails in the backward on Hopper at some
    sequence lengths (docs/method.md#attention-kernels). The flags are torch's own, read back."""
    cuda_flags = torch.backends.cuda
    # TF32 is kept as fp32_precision (allow_tf32 reads and writes it): saved and restored as it is
    saved = (cuda_flags.matmul.fp32_precision, torch.backends.cudnn.fp32_precision, cuda_flags.flash_sdp_enabled(),
             cuda_flags.mem_efficient_sdp_enabled(), cuda_flags.cudnn_sdp_enabled(), cuda_flags.math_sdp_enabled())

    def build_run(*args):
        raise Started

    monkeypatch.setattr(vgrpo, "setup_distributed", lambda device, timeout: (0, 1, torch.device("cuda")))
    monkeypatch.setattr(vgrpo, "announce", lambda args: None)
    monkeypatch.setattr(vgrpo, "build_run", build_run)
    try:
        cuda_flags.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
        cuda_flags.enable_cudnn_sdp(True)   # torch's default (since 2.10 it is the first it picks on Hopper)
        with pytest.raises(Started):
            vgrpo.start_run(vgrpo.Args(model="sd3", tf32=tf32))
        assert cuda_flags.matmul.allow_tf32 == torch.backends.cudnn.allow_tf32 == tf32
        assert (cuda_flags.flash_sdp_enabled(), cuda_flags.mem_efficient_sdp_enabled(), cuda_flags.cudnn_sdp_enabled(),
                cuda_flags.math_sdp_enabled()) == (True, True, False, True)
        with pytest.raises(Started):
            vgrpo.start_run(vgrpo.Args(model="sd3", attention="cudnn,math"))
        assert (cuda_flags.flash_sdp_enabled(), cuda_flags.mem_efficient_sdp_enabled(), cuda_flags.cudnn_sdp_enabled(),
                cuda_flags.math_sdp_enabled()) == (False, False, True, True)
    finally:
        cuda_flags.matmul.fp32_precision, torch.backends.cudnn.fp32_precision = saved[:2]
        for enable, on in zip((cuda_flags.enable_flash_sdp, cuda_flags.enable_mem_efficient_sdp,
                               cuda_flags.enable_cudnn_sdp, cuda_flags.enable_math_sdp), saved[2:]):
            enable(on)


# --------------------------------------------------------------------------- the slow tier: compiled runs on the CPU
# LoRA on the tiny SD3 with gradient checkpointing, 2 inner steps (the old-surrogate pass) and the KL term
FLAGS = [*FAST, "--iterations", "2", "--inner-steps", "2", "--micro-batch", "2", "--beta", "0.1",
         "--gradient-checkpointing"]


def start(tmp_path, compile_flag, *extra):
    args = vgrpo.parse_args([*FLAGS, "--compile", compile_flag, *extra, "--output-dir",
                             str(tmp_path / (compile_flag + "".join(extra)))])
    vgrpo.validate(args, 1)
    return vgrpo.start_run(args)[0]


@pytest.mark.slow
def test_compiled_blocks_see_the_old_surrogates_numerics_and_stop_recompiling(tmp_path):
    import smoke

    assert not start(tmp_path, "auto").family.compiled                    # auto: on CUDA only
    runs = {flag: start(tmp_path, flag) for flag in ("off", "on")}
    runs["bf16"] = start(tmp_path, "on", "--mixed-precision", "bf16")   # where compiled graphs round differently
    assert runs["on"].family.compiled and all(b._compiled_call_impl is not None for b in runs["on"].family.blocks())
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
