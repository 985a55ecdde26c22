"""Costs that can be counted rather than timed: transformer passes per iteration, host-device synchronisations
(`.item()` and friends dispatch aten::_local_scalar_dense), bytes of the pairs' noise; and that the sampling
batch changes nothing but float rounding. Seconds are measured in bench/, never asserted here.

    python -m pytest tests/test_costs.py -q
"""

import collections
import os
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vgrpo


class CountOps(TorchDispatchMode):
    """Counts every aten operation dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def build(**flags):
    args = vgrpo.Args(**{"model": "tiny", "prompts_per_step": 2, "group_size": 4, "sample_steps": 4, "n_mc": 2,
                         "output_dir": "/tmp/vgrpo-test-costs", **flags})
    vgrpo.validate(args, 1)
    run, _ = vgrpo.build_run(args, 0, 1, torch.device("cpu"))
    return run


def count_forwards(run):
    calls = []
    handle = run.family.transformer.register_forward_pre_hook(
        lambda module, a, kw: calls.append(kw["hidden_states"].shape[0]), with_kwargs=True)
    return calls, handle


@pytest.mark.parametrize("inner_steps", [1, 2])
def test_one_inner_step_runs_no_old_surrogate_pass(inner_steps):
    """Rollout: ceil(B / sample batch) passes per ODE step; update: B / micro-batch passes; the old surrogate only
    for the minibatches after the first (none with one inner step, the paper's SD3.5-M setting)."""
    run = build(inner_steps=inner_steps, micro_batch=2, sample_batch=3)
    calls, handle = count_forwards(run)
    vgrpo.train_iteration(run, 0)
    handle.remove()
    B, S, N = 8, 4, 2
    rollout = [3, 3, 2] * S                       # sample batch 3 over 8 samples, per ODE step
    old = [2 * N] * ((B // inner_steps) // 2) * (inner_steps - 1)  # micro-batches of 2 samples x N pairs
    update = [2 * N] * (B // 2)
    assert sorted(calls) == sorted(rollout + old + update)


def test_host_syncs_per_iteration_do_not_grow_with_micro_batches_or_ode_steps(monkeypatch):
    """Reading a value on the host (.item(), a comparison's bool: aten._local_scalar_dense) and copying to it
    (.tolist(), .cpu(), .numpy(): no op on the CPU, a wait on a GPU) happen a fixed number of times per iteration."""
    def syncs(**flags):
        run = build(**flags)
        vgrpo.train_iteration(run, 0)  # warm-up: lazy initialisations may read a value once
        copies = collections.Counter()
        with monkeypatch.context() as patched:
            for name in ("tolist", "cpu", "numpy"):
                def counted(self, *args, _name=name, _method=getattr(torch.Tensor, name), **kwargs):
                    copies[_name] += 1
                    return _method(self, *args, **kwargs)
                patched.setattr(torch.Tensor, name, counted)
            with CountOps() as mode:
                vgrpo.train_iteration(run, 1)
        return mode.counts["aten._local_scalar_dense"], dict(copies)

    base = syncs(micro_batch=8, sample_steps=4)
    assert base[0] > 0 and base[1].get("cpu", 0) > 0   # both counts see something (the reward reads the pictures)
    assert syncs(micro_batch=2, sample_steps=4) == base     # 4x the micro-batches
    assert syncs(micro_batch=8, sample_steps=8) == base     # 2x the ODE steps
    passes = syncs(micro_batch=8, sample_steps=4, sample_batch=2)       # 4x the sampling passes,
    passes[1].pop("tolist"), base[1].pop("tolist")                       # each reading the CPU grid (sample_ode)
    assert passes == base


def test_each_phase_is_timed_to_the_end_of_its_gpu_work_with_one_sync(monkeypatch):
    """An iteration's time_* on CUDA: one torch.cuda.synchronize of the run's device as each phase ends, so a phase's
    queued kernels count in it (4 syncs per iteration, however many micro-batches); none on the CPU."""
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(str(device)))
    for device, expected in (("cuda:1", ["cuda:1"] * 4), ("cpu", [])):
        waited.clear()
        timer = vgrpo.PhaseTimer(torch.device(device))
        for phase in ("rollout", "reward", "old", "update"):
            with timer(phase):
                time.sleep(0.01)
        assert waited == expected and all(s >= 0.01 for s in timer.stats().values()), device
    assert set(timer.stats()) == {"time_rollout", "time_reward", "time_old", "time_update"}


def test_batch_shared_noise_is_stored_once():
    grid = torch.linspace(1, 0, 11)
    ids = [(p, m) for p in range(3) for m in range(4)]
    sig, eps = vgrpo.draw_pairs(grid, 4, (4, 8, 8), ids, "batch", True, 0, 0)
    assert eps.shape == (12, 4, 4, 8, 8) and eps.stride(0) == 0 and sig.stride(0) == 0   # one draw, expanded
    _, eps_group = vgrpo.draw_pairs(grid, 4, (4, 8, 8), ids, "group", True, 0, 0)
    assert eps_group.stride(0) != 0 and torch.equal(eps_group[0], eps_group[3]) and not torch.equal(eps_group[0],
                                                                                                  eps_group[4])


def test_the_sampling_batch_changes_nothing_but_float_rounding():
    """Noise is keyed per sample, so a rollout in passes of 8 or of 3 gives the same samples up to the rounding
    of batched matmuls."""
    # the JPEG reward reads uint8 pictures, so a rounding difference may move one image's size by a byte: the
    # images themselves are the comparison (the update never compares a sampling pass with a training pass)
    im1, im2 = (vgrpo.train_iteration(build(sample_batch=sample_batch, micro_batch=4), 0)[1] for sample_batch in (8, 3))
    assert (im1 - im2).abs().max() < 1e-5


# --------------------------------------------------------------------------- text encoders: once, at start


def test_every_prompt_is_encoded_once_at_start_into_a_store_that_a_resume_reads_back(tmp_path, monkeypatch):
    run = build(output_dir=str(tmp_path))
    family = run.family
    assert set(family._store) == set(run.prompts) | {""}      # the empty prompt for CFG too
    for prompt in (run.prompts[0], run.prompts[-1], ""):     # batched encoding = one prompt at a time
        one = family.encode_texts([prompt])
        for stored, single in zip(family.encode([prompt]), one):
            assert torch.allclose(stored, single, atol=1e-5)
    assert (tmp_path / "embeddings.pt").exists()

    def no_encoding(self, prompts):
        raise AssertionError("encoded again although the store was saved")

    monkeypatch.setattr(vgrpo.SD3Family, "encode_texts", no_encoding)
    again = build(output_dir=str(tmp_path))                   # a resume: the store is read back, nothing encoded
    assert all(torch.equal(a, b) for a, b in zip(again.family._stored, family._stored))


def test_offloaded_text_encoders_are_freed_once_the_store_is_made(tmp_path):
    family = vgrpo.load_family(vgrpo.Args(model="tiny-flux"), torch.device("cpu"))
    family.offload = True                                     # as on CUDA
    assert family.encode_all(["a cat", "a dog"], str(tmp_path / "e.pt"))
    assert family.pipe.text_encoder is None and family.pipe.text_encoder_2 is None
    assert family.encode(["a dog", "a cat", "a dog"])[0].shape[0] == 3
    with pytest.raises(vgrpo.FatalError, match="'a fox' is not in the embedding store"):
        family.encode(["a fox"])


def test_a_store_that_would_not_fit_falls_back_to_encoding_on_demand(tmp_path):
    family = vgrpo.load_family(vgrpo.Args(model="tiny"), torch.device("cpu"))
    family.store_bytes = 1000                                 # less than one prompt's embeddings
    assert not family.encode_all(["a cat", "a dog"], str(tmp_path / "e.pt"))
    assert family._store is None and not (tmp_path / "e.pt").exists() and family.text_encoders()
    assert family.encode(["a fox"])[0].shape[0] == 1 and "a fox" in family._cache


def test_lora_inputs_are_not_cast_to_float32_under_autocast_and_nothing_else_changes():
    """A bf16 base with float32 LoRA: peft would cast every adapter's input to float32 and autocast would cast it
    back. Switched off, a forward dispatches one cast fewer per LoRA layer, with the same output and gradients."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    run = build(mixed_precision="bf16", full_finetune=False, lora_rank=4)
    family = run.family
    layers = [m for m in family.transformer.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and all(m.cast_input_dtype_enabled is False for m in layers)
    x = torch.randn(2, *family.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = family.encode(["a red cube", "a blue sphere"])

    def forward_and_grads():
        with CountOps() as ops:
            v = family.velocity(family.transformer, x, torch.tensor([0.3, 0.7]), cond)
        grads = torch.autograd.grad(v.square().mean(), run.params)
        return v.detach(), grads, ops.counts["aten._to_copy"]

    v_off, grads_off, casts_off = forward_and_grads()
    for m in layers:
        m.cast_input_dtype_enabled = True
    v_on, grads_on, casts_on = forward_and_grads()
    assert casts_on - casts_off >= len(layers)
    assert torch.equal(v_off, v_on)
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))


@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_under_fsdp_no_device_ever_holds_the_whole_transformer_before_it_is_sharded(model):
    """--fsdp: the transformer is loaded onto the CPU and fully_shard moves it block by block as shards (12B FLUX in
    float32 is 48 GB); everything else goes to the device at once. ('meta' stands for the GPU here.)"""
    family = vgrpo.load_family(vgrpo.Args(model=model, fsdp=True), torch.device("meta"))
    assert {p.device.type for p in family.transformer.parameters()} == {"cpu"}
    assert {p.device.type for p in family.pipe.vae.parameters()} == {"meta"}
    assert {p.device.type for enc in family.text_encoders() for p in enc.parameters()} == {"meta"}
    unsharded = vgrpo.load_family(vgrpo.Args(model=model), torch.device("meta"))
    assert {p.device.type for p in unsharded.transformer.parameters()} == {"meta"}
