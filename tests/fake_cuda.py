"""Fake CUDA: run vgrpo's GPU code paths (--device cuda) on a CPU-only torch, every CUDA tensor a fake one.

    with Worker(env) as worker:                       # a subprocess with the fake device (see below)
        result = worker.call("tests.test_fake_cuda", "one_iteration", flags=[...])
    # inside the worker, a scenario does:
    with FakeCuda(strict=True) as gpu:
        run, start = vgrpo.start_run(args)            # args.device == "cuda"
        vgrpo.train_iteration(run, 0)
    gpu.counts["d2h_sync"], gpu.counts["h2d_copy"], gpu.mixes, gpu.where, gpu.memory.peak (bytes)
    # rank 0 of 8 processes under --fsdp (not DDP): with fake_processes(8): ... vgrpo.start_run(args) ...
    # (vgrpo.check_ranks_agree and any_rank read other ranks' values: tests/test_fake_cuda.py replaces their verdicts)

How it works. A CUDA tensor is a torch._subclasses.fake_tensor.FakeTensor whose fake device is cuda:0: shape,
dtype, strides and autograd history but no data (its storage is on "meta"), so a 12 B-parameter model costs no
memory and every op only its shape computation. CPU tensors stay real: a dispatch mode above the FakeTensorMode
(`_Audit`) runs every op whose inputs are all real CPU tensors for real (keyed random draws, tokenizers, the sigma
grid, JPEG rewards of PIL images) and hands the others to the FakeTensorMode. What crosses from the GPU to the host
gets values: `.item()` / `.tolist()` / `.cpu()` of a fake tensor give dummy values (`dummy_value`: 0.5 for floats,
1 for integers, True), each counted as a device-to-host synchronisation; a non-scalar CPU tensor going to the GPU
is counted as a host-to-device copy (`counts`, with the call sites in `where`). An op that mixes a non-scalar CPU
tensor with a CUDA one, or writes a CUDA result into a CPU tensor (even a 0-dim one), is recorded in `mixes` and,
with strict=True, raises DeviceMixError with the op, the shapes and the call site: on a GPU most such ops raise,
and the rest (CUDA data indexed with CPU indices, index_put_ of CPU values) silently copy the CPU tensor to the
device and synchronise, every time they run. A 0-dim CPU tensor as an input is allowed, as CUDA kernels allow it.

Why a subprocess. The autograd engine asks at::accelerator::getAccelerator() for the current stream of every CUDA
gradient, and that asks the CUDA hooks (at::detail::getCUDAHooks()), which torch caches in a once_flag the first
time anything asks, at `import torch`. So the fake hooks must be registered before torch is imported: the worker
starts with the harness's small C++ library in LD_PRELOAD, whose static initialisers register them (and the device
guard) before Python runs. The test process itself is left untouched.

What it relies on (torch internals, checked against torch 2.13; a change breaks the harness, not vgrpo):
  - the C++ library (GUARD_SOURCE, ~40 lines, built once with torch.utils.cpp_extension.load_inline in ~20 s on a
    loaded 2-core machine, then cached in TORCH_EXTENSIONS_DIR): a no-op c10::impl::DeviceGuardImplInterface for
    DeviceType::CUDA (C10_REGISTER_GUARD_IMPL; without it `.to("cuda")` without an index fails with "not linked
    with support for cuda devices") and an at::CUDAHooksInterface registered as "CUDAHooks" in CUDAHooksRegistry
    saying CUDA is built and has one device (without it backward fails: "Cannot access accelerator device");
  - FakeTensorMode(allow_non_fake_inputs=True) turning real inputs into fake ones, FakeTensor.fake_device, and
    FakeTensorMode.avoid_device_init (patched to stay True, its CPU-build value, so that the mode never
    constant-folds a copy to CUDA by running it for real); mode.from_tensor for the copies to CUDA;
  - TorchDispatchMode and _disable_current_modes (the audit runs host ops for real), and the aten overloads named
    in `_Audit` (_to_copy, copy_, _local_scalar_dense, is_pinned, _pin_memory, factories' pin_memory / device);
    pinned memory is modelled there (the audit remembers pinned storages), the hooks have no pinned allocator;
  - torch.nn.Module._apply, replaced while the harness runs: its swap of fake Parameters fails (a weak reference
    held by the fake mode), so a second .to() of a module already on the fake GPU assigns .data instead;
  - torch.load, run outside the modes (under a FakeTensorMode it would give fake tensors without data);
  - Python patches of torch.cuda (is_available, device_count, current_device, set_device, is_bf16_supported,
    synchronize, memory queries): the CPU build's torch._C lacks what they call. torch.autocast("cuda") reads
    torch.cuda.is_available() and silently disables itself without the patch. Stream, Event, current_stream
    and stream are Python stand-ins (FakeStream, FakeEvent: FSDP2 makes streams for its collectives);
  - torch.UntypedStorage.resize_, wrapped so that DeviceMemory sees FSDP2 free and regrow all-gathered weights;
  - for several processes (fake_processes): the "fake" process-group backend of
    torch.testing._internal.distributed.fake_pg, the fake kernels of torch.distributed._tools.fake_collectives,
    and FSDP2's move of CPU weights to the device by .data assignment (worked around: see fake_processes).

What it cannot see: numerics (fake tensors hold no values: no NaN / Inf path, no overflow, no loss-scale change, no
value to test), real pixels and rewards of real images (the host sees dummy values), the branch a real value would
take (`.item()` always answers the same), kernels and their speed, streams and asynchrony (a non_blocking copy is
counted like any other; one from pageable memory is counted apart, `h2d_pageable_non_blocking`), NCCL beyond its
rule that collectives move CUDA tensors only (which fake_processes keeps), what other processes send (fake_processes
runs rank 0 alone: collectives move nothing, object collectives fail), the caching allocator, CUDA generators, and
anything saved with torch.save from a fake tensor.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import importlib
import os
import pickle
import struct
import subprocess
import sys
import traceback
import warnings
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

GUARD_SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace fake_cuda {
using c10::Device; using c10::DeviceType; using c10::Stream; using c10::DeviceIndex;
// device 0 always, one default stream, events that are always complete
struct Guard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream exchangeStream(Stream s) const override { return s; }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
};
// what getAccelerator() and the autograd engine ask: CUDA is built, one device, its context exists
struct Hooks final : at::CUDAHooksInterface {
  explicit Hooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
};
}  // namespace fake_cuda
C10_REGISTER_GUARD_IMPL(CUDA, fake_cuda::Guard);
namespace at { C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", fake_cuda::Hooks); }
"""
LIBRARY_NAME = "vgrpo_fake_cuda"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def build_library():
    """-> (path of the compiled library, "") or (None, the reason it cannot be had, one line). The build runs in a
    subprocess, so this process never loads the library."""
    if torch.version.cuda is not None or torch.version.hip is not None:
        return None, f"torch {torch.__version__} has a GPU backend: fake CUDA is for CPU-only builds"
    code = ("import sys, torch\nfrom torch.utils.cpp_extension import load_inline, _get_build_directory\n"
            "from tests.fake_cuda import GUARD_SOURCE, LIBRARY_NAME\n"
            "load_inline(LIBRARY_NAME, cpp_sources=[GUARD_SOURCE], is_python_module=False)\n"
            "print(_get_build_directory(LIBRARY_NAME, False))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()] or ["?"]
        # the compiler's own complaint ("g++: not found", "error: ..."), else the last line
        told = [line for line in lines if "not found" in line or "error:" in line or "No such file" in line]
        return None, f"cannot build the fake CUDA library for torch {torch.__version__}: {(told or lines)[-1][:200]}"
    path = os.path.join(done.stdout.strip().splitlines()[-1], LIBRARY_NAME + ".so")
    return (path, "") if os.path.isfile(path) else (None, f"the fake CUDA library is not at {path}")


def worker_env(library, extra=None):
    """The worker's environment: the library preloaded, torch's own libraries on the loader's path (the library
    links to them), the repository importable."""
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    def joined(first, name):
        return os.pathsep.join(filter(None, [first, os.environ.get(name)]))

    return {**os.environ, **(extra or {}), "LD_PRELOAD": library, "PYTHONPATH": joined(ROOT, "PYTHONPATH"),
            "LD_LIBRARY_PATH": joined(torch_lib, "LD_LIBRARY_PATH")}


def fake_cuda_ready():
    """Inside a process: are the hooks registered before import (LD_PRELOAD)? -> (ok, why not)."""
    if torch.version.cuda is not None:
        return False, "a CUDA build of torch"
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "cuda":
        return False, "start the process with the fake CUDA library in LD_PRELOAD (tests/fake_cuda.py: Worker)"
    return True, ""


# ---------------------------------------------------------------------------- the worker process


def _send(stream, obj):
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("the fake CUDA worker exited")
    return pickle.loads(stream.read(struct.unpack("<Q", header)[0]))


class WorkerError(RuntimeError):
    """A scenario raised in the worker: its type and traceback, as text."""


class Worker:
    """A persistent subprocess with fake CUDA: call(module, function, **kwargs) runs module.function(**kwargs)
    there and returns its (picklable) result, or raises WorkerError with the worker's traceback."""

    def __init__(self, library, env=None):
        requests_r, self._requests = os.pipe()
        self._replies, replies_w = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-m", "tests.fake_cuda", str(requests_r), str(replies_w)],
                                        cwd=ROOT, env=worker_env(library, env), pass_fds=(requests_r, replies_w))
        os.close(requests_r)
        os.close(replies_w)
        self._out, self._in = os.fdopen(self._requests, "wb"), os.fdopen(self._replies, "rb")

    def call(self, module, function, **kwargs):
        _send(self._out, (module, function, kwargs))
        status, value = _receive(self._in)
        if status != "ok":
            raise WorkerError(value)
        return value

    def close(self):
        self._out.close()
        self._in.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(requests_fd, replies_fd):
    requests, replies = os.fdopen(requests_fd, "rb"), os.fdopen(replies_fd, "wb")
    while True:
        try:
            module, function, kwargs = _receive(requests)
        except EOFError:
            return
        try:
            _send(replies, ("ok", getattr(importlib.import_module(module), function)(**kwargs)))
        except BaseException as e:  # the scenario's failure is the test's, with its traceback
            _send(replies, ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# ---------------------------------------------------------------------------- the fake device, in the worker


class DeviceMixError(RuntimeError):
    """An op took a non-scalar CPU tensor and a CUDA tensor (strict mode)."""


def dummy_value(dtype):
    """What a fake tensor's element reads as on the host: finite, nonzero, True (so "is it finite?" says yes)."""
    if dtype == torch.bool:
        return True
    return 0.5 if dtype.is_floating_point or dtype.is_complex else 1


def is_cuda(t):
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def is_host_array(t):
    """A CPU tensor that is not a scalar: what a CUDA op cannot take without a copy."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0


def written(func, args, kwargs):
    """The tensors an op writes into (in-place and out= arguments): a CPU one cannot take a CUDA result, even a
    scalar (a GPU raises; only CPU scalars as *inputs* of CUDA kernels are allowed)."""
    out = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


def describe(t):
    return f"{t.device.type}{tuple(t.shape)}"


# ops whose purpose is to move data between devices: counted, never "mixing"
TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten.copy.default}
# ops whose output shape depends on the values: on a GPU each waits for the device
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
FACTORY_PIN = "pin_memory"
ELEMENT_READS = {aten.select.int, aten.alias.default, aten.detach.default}


class _Audit(TorchDispatchMode):
    """Runs host ops for real, counts transfers and synchronisations, and records (strict: raises on) device mixes."""

    def __init__(self, harness):
        super().__init__()
        self.harness = harness
        self.reading = None  # the storage whose elements are being read one by one (.tolist())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        h, kwargs = self.harness, kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        fake = any(isinstance(t, FakeTensor) for t in tensors)
        target = kwargs.get("device")
        to_cuda = target is not None and torch.device(target).type == "cuda"
        if func is aten.is_pinned.default:
            return not fake and h.is_pinned(args[0])
        if func is aten._pin_memory.default:
            return h.pin(self.real(aten.clone.default, (args[0],), {}))
        if kwargs.get(FACTORY_PIN) and not to_cuda:
            return h.pin(self.real(func, args, {**kwargs, FACTORY_PIN: False}))
        if not fake and not to_cuda:
            return self.real(func, args, kwargs)
        if func in TRANSFERS:
            return self.transfer(func, args, kwargs)
        if func is aten._local_scalar_dense.default:
            # .tolist() of a fake tensor reads it element by element (select, then this): one copy on a GPU
            storage = args[0].untyped_storage()._cdata
            if storage != self.reading:
                h.count("d2h_sync", func)
            self.reading = storage
            return dummy_value(args[0].dtype)
        if func not in ELEMENT_READS:
            self.reading = None
        if func in DATA_DEPENDENT:
            h.count("d2h_sync", func)
        if any(is_cuda(t) for t in tensors) and (any(is_host_array(t) for t in tensors) or
                                                  any(t.device.type == "cpu" for t in written(func, args, kwargs))):
            h.mix(func, tensors)
        out = func(*args, **kwargs)
        h.memory.track(out)
        return out

    @staticmethod
    def real(func, args, kwargs):
        with _disable_current_modes():
            return func(*args, **kwargs)

    def transfer(self, func, args, kwargs):
        h = self.harness
        if func is aten._to_copy.default:
            src, device = args[0], torch.device(kwargs.get("device") or args[0].device)
            if src.device.type == "cpu" and device.type == "cuda":
                h.count("h2d_copy", func, non_blocking_pageable=kwargs.get("non_blocking") and not h.is_pinned(src))
                if not isinstance(src, FakeTensor):  # else the fake mode would "constant-fold" the copy for real
                    args = (h.mode.from_tensor(src), *args[1:])
                out = func(*args, **kwargs)
                h.memory.track(out)
                return out
            elif src.device.type == "cuda" and device.type == "cpu":
                h.count("d2h_sync", func)
                dtype = kwargs.get("dtype") or src.dtype
                return self.real(aten.full.default, (src.shape, dummy_value(dtype)), {"dtype": dtype})
            out = func(*args, **kwargs)   # on the device: a cast (x.float(), autocast's) is a new storage there too
            h.memory.track(out)
            return out
        dst, src = args[0], args[1]
        if dst.device.type == "cuda" and src.device.type == "cpu":
            if src.dim() > 0:
                h.count("h2d_copy", func, non_blocking_pageable=len(args) > 2 and args[2] and not h.is_pinned(src))
        elif dst.device.type == "cpu" and src.device.type == "cuda":
            h.count("d2h_sync", func)
            return self.real(aten.fill_.Scalar, (dst, dummy_value(dst.dtype)), {})
        return func(*args, **kwargs)


class DeviceMemory:
    """Bytes of live CUDA storage, and their peak: every fake CUDA tensor an op returns is counted once per storage
    (views share it) until the last tensor on that storage dies. Autograd's saved tensors keep theirs alive, so
    this is what the caching allocator would have to hold: torch.cuda.memory_allocated(), without the rounding.
    `param.data = other` swaps a tensor's storage outside the dispatcher: reconcile() (called by reset_peak) moves
    such tensors to their new storage, so a cast model is not counted twice, and adopts CUDA tensors made outside
    the dispatcher."""

    def __init__(self):
        self.live = {}                                # storage id -> [bytes, tensors alive on it, the storage]
        self.cells = {}                               # id(tensor) -> (weak reference, [storage id it is counted on])
        self.current = self.peak = 0

    def track(self, out):
        for t in tree_leaves(out):
            if isinstance(t, FakeTensor) and t.device.type == "cuda" and id(t) not in self.cells:
                cell = [None]
                self._attach(cell, t)
                self.cells[id(t)] = (weakref.ref(t), cell)
                weakref.finalize(t, self._forget, id(t), cell)

    def _attach(self, cell, t):
        storage = t.untyped_storage()
        entry = self.live.get(storage._cdata)
        if entry is None:
            # holding the storage keeps its address (the id) from being reused by a new storage while counted: a
            # tensor whose storage is swapped (`.data = other`) leaves its old one here until reconcile() moves it,
            # and a new storage at the old address would otherwise be taken for it (and its bytes never counted)
            entry = self.live[storage._cdata] = [storage.nbytes(), 0, storage]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        cell[0] = storage._cdata

    def _detach(self, cell):
        entry = self.live.get(cell[0])
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self.live[cell[0]]

    def _forget(self, key, cell):
        self._detach(cell)
        self.cells.pop(key, None)

    def resized(self, storage, nbytes):
        """UntypedStorage.resize_ bypasses the dispatcher: FSDP2 frees each block's all-gathered weights with
        resize_(0) after use and grows them back for the next all-gather, on the same storage."""
        entry = self.live.get(storage._cdata)
        if entry is not None:
            self.current += nbytes - entry[0]
            entry[0] = nbytes
            self.peak = max(self.peak, self.current)

    def reconcile(self):
        """Moves tracked tensors whose storage was swapped (`param.data = other`) to it, and adopts the live CUDA
        tensors no op returned (a Parameter made around a tensor, which outlives it): without the scan of the
        garbage collector's objects a model's weights go uncounted once the tensors they were made from die."""
        for ref, cell in list(self.cells.values()):
            t = ref()
            if t is not None and t.untyped_storage()._cdata != cell[0]:
                self._detach(cell)
                self._attach(cell, t)
        with warnings.catch_warnings():  # isinstance() on some modules' deprecated attributes warns
            warnings.simplefilter("ignore")
            untracked = [t for t in gc.get_objects() if isinstance(t, FakeTensor) and id(t) not in self.cells]
        self.track(untracked)

    def reset_peak(self):
        self.reconcile()
        self.peak = self.current

    def allocated(self):
        self.reconcile()
        return self.current


class FakeCuda:
    """The context: torch.cuda patched, a FakeTensorMode whose CUDA tensors are fake, the audit mode on top.

    strict: raise DeviceMixError on the first op mixing a non-scalar CPU tensor with a CUDA one (else record it).
    counts: Counter of "d2h_sync" (.item(), .tolist(), .cpu() of CUDA data, data-dependent shapes), "h2d_copy"
    (a non-scalar CPU tensor copied to the GPU) and "h2d_pageable_non_blocking" (such a copy asked to be
    asynchronous from unpinned memory, which a GPU makes synchronous); where[kind] the call sites (file:line).
    memory: DeviceMemory, which also answers torch.cuda.memory_allocated, max_memory_allocated and
    reset_peak_memory_stats, so code that measures itself with them runs unchanged here and on a GPU.
    """

    def __init__(self, strict=True):
        self.strict = strict
        self.counts = collections.Counter()
        self.where = collections.defaultdict(collections.Counter)
        self.mixes = []
        self.memory = DeviceMemory()
        self._pinned = weakref.WeakValueDictionary()  # untyped storage's data_ptr -> a tensor keeping it alive
        self._stack = None

    # ---- bookkeeping used by the audit mode
    def count(self, kind, func, non_blocking_pageable=False):
        site = caller()
        self.counts[kind] += 1
        self.where[kind][site] += 1
        if non_blocking_pageable:
            self.counts["h2d_pageable_non_blocking"] += 1
            self.where["h2d_pageable_non_blocking"][site] += 1

    def mix(self, func, tensors):
        message = f"{func} mixes {', '.join(describe(t) for t in tensors)} at {caller()}"
        self.mixes.append(message)
        if self.strict:
            raise DeviceMixError(message)

    def pin(self, t):
        self._pinned[t.untyped_storage().data_ptr()] = t
        return t

    def is_pinned(self, t):
        return not isinstance(t, FakeTensor) and t.device.type == "cpu" and \
            self._pinned.get(t.untyped_storage().data_ptr()) is not None

    def reset_counts(self):
        self.counts.clear()
        self.where.clear()

    # ---- the context
    def __enter__(self):
        ok, reason = fake_cuda_ready()
        if not ok:
            raise RuntimeError(f"fake CUDA is not set up in this process: {reason}")
        stack = contextlib.ExitStack()
        patches = {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
                   "set_device": lambda device: None, "is_bf16_supported": lambda *a, **k: True,
                   "synchronize": lambda device=None: self.count("d2h_sync", "torch.cuda.synchronize"),
                   "is_initialized": lambda: True, "get_device_name": lambda device=None: "fake CUDA",
                   "memory_allocated": lambda device=None: self.memory.allocated(),
                   "max_memory_allocated": lambda device=None: self.memory.peak,
                   "reset_peak_memory_stats": lambda device=None: self.memory.reset_peak(),
                   "empty_cache": lambda: None}
        # one stream in effect: FSDP2 makes its own for all-gathers and reduce-scatters, and every wait between
        # them is already satisfied
        default_stream = FakeStream()
        patches.update(Stream=FakeStream, Event=FakeEvent, current_stream=lambda device=None: default_stream,
                       default_stream=lambda device=None: default_stream,
                       stream=lambda stream: contextlib.nullcontext(stream))
        for name, value in patches.items():
            stack.enter_context(_patched(torch.cuda, name, value))
        resize = torch.UntypedStorage.resize_

        def tracked_resize(storage, nbytes):
            resize(storage, nbytes)
            self.memory.resized(storage, nbytes)
            return storage

        stack.enter_context(_patched(torch.UntypedStorage, "resize_", tracked_resize))
        stack.enter_context(_patched(FakeTensorMode, "avoid_device_init", property(lambda mode: True)))
        stack.enter_context(_patched(torch.nn.Module, "_apply", _apply_keeping_fake_parameters))
        stack.enter_context(_patched(torch, "load", _load_for_real))
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        stack.enter_context(self.mode)
        stack.enter_context(_Audit(self))
        self._stack = stack
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)


class FakeStream:
    """torch.cuda.Stream without the CUDA runtime: work is never queued, so every wait is already satisfied."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cuda", 0)

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return (event or FakeEvent()).record(self)

    def query(self):
        return True

    def synchronize(self):
        pass


class FakeEvent:
    """torch.cuda.Event without the CUDA runtime: recorded and complete at once."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return self

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


@contextlib.contextmanager
def fake_processes(world):
    """Rank 0 of `world` processes, alone: torchrun's environment variables, and vgrpo's init_process_group
    answered by torch's "fake" backend (torch.testing._internal.distributed.fake_pg), whose collectives complete at
    once without moving data; torch.distributed._tools.fake_collectives gives them their fake-tensor outputs. What
    rank 0 allocates is what each of `world` real processes would, so FSDP2's sharded memory can be measured and
    its code paths checked for device placement. Values that come from other ranks are dummies (a comparison of
    ranks' checksums cannot pass), and what needs them cannot run: object collectives (dist.gather_object, which
    DCP's checkpoint planning uses) and DDP's constructor (it compares the ranks' parameter counts).

    fully_shard is wrapped: FSDP2 moves a CPU block's weights to the GPU by assigning .data (a fake tensor into a
    real Parameter, which the fake mode cannot represent), so the wrapper first moves each CPU module's own weights
    the way Module.to does (torch swaps in new Parameters), one block at a time as FSDP2 would, then calls it.

    The tensor collectives named in `collectives` (those vgrpo and FSDP2 call, and their kin) keep NCCL's rule: NCCL,
    the backend of GPU processes, moves CUDA tensors only (a CPU tensor there raises), while the fake backend, like
    gloo in the CPU tests, takes any: a CPU tensor in one raises DeviceMixError here, naming the collective and its
    caller."""
    import torch.distributed as dist
    import torch.distributed._tools.fake_collectives  # noqa: F401 - registers the collectives' fake kernels
    import torch.distributed.fsdp as fsdp
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    init, shard = dist.init_process_group, fsdp.fully_shard

    def init_fake(backend=None, **kwargs):
        init("fake", store=FakeStore(), rank=0, world_size=world)

    def fully_shard(module, *args, **kwargs):
        cuda = torch.device("cuda", 0)
        for m in module.modules():
            own = [t for t in [*m._parameters.values(), *m._buffers.values()] if t is not None]
            if any(not isinstance(t, DTensor) and t.device.type == "cpu" for t in own):
                m._apply(lambda t: t if isinstance(t, DTensor) or t.is_cuda else t.to(cuda), recurse=False)
        return shard(module, *args, **kwargs)

    def cuda_tensors_only(name):
        real = getattr(dist, name)

        def collective(*args, **kwargs):
            given = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])]
            on_cpu = [tuple(t.shape) for t in given if isinstance(t, torch.Tensor) and t.device.type != "cuda"]
            if on_cpu:
                raise DeviceMixError(f"dist.{name} of CPU tensor(s) of shape {on_cpu}, which NCCL cannot move, "
                                     f"from {caller()}")
            return real(*args, **kwargs)

        return collective

    collectives = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                   "reduce", "gather", "scatter", "all_to_all_single")
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_patched(dist, "init_process_group", init_fake))
            stack.enter_context(_patched(fsdp, "fully_shard", fully_shard))
            for name in collectives:
                stack.enter_context(_patched(dist, name, cuda_tensors_only(name)))
            yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_MODULE_APPLY = torch.nn.Module._apply
_TORCH_LOAD = torch.load


def _load_for_real(*args, **kwargs):
    """torch.load under a FakeTensorMode makes fake tensors of what a file holds (no data to copy into a model):
    files hold real weights, loaded as real CPU tensors as without the harness."""
    with _disable_current_modes():
        return _TORCH_LOAD(*args, **kwargs)


def _apply_keeping_fake_parameters(module, fn, recurse=True):
    """Module._apply (behind .to / .float / .cuda) for a module whose weights are already fake: torch's own swaps
    each Parameter for a new one (torch.utils.swap_tensors), which fails on a fake tensor the fake mode holds a
    weak reference to. Here a fake Parameter keeps its identity and takes the new value through .data, as a real
    one does on a copy to a compatible tensor type; other modules go through torch's _apply unchanged."""
    if recurse:
        for child in module.children():
            child._apply(fn)
    own = [*module._parameters.values(), *module._buffers.values()]
    if not any(isinstance(t, FakeTensor) for t in own):
        return _MODULE_APPLY(module, fn, recurse=False)
    with torch.no_grad():
        for param in module._parameters.values():
            if param is not None:
                param.data = fn(param)
                if param.grad is not None:
                    param.grad.data = fn(param.grad)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = fn(buffer)
    return module


@contextlib.contextmanager
def _patched(owner, name, value):
    missing = object()
    old = owner.__dict__.get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


SKIP_FILES = (os.path.abspath(__file__), os.path.join(os.path.dirname(torch.__file__), ""))


def caller():
    """Where an op came from: the innermost frame in this repository's own code (vgrpo.py, reward.py, a test),
    else the innermost outside torch and this file (a library's)."""
    frames = [f for f in reversed(traceback.extract_stack()) if not f.filename.startswith(SKIP_FILES)
              and "contextlib" not in f.filename]
    own = [f for f in frames if f.filename.startswith(ROOT + os.sep) and "site-packages" not in f.filename]
    frame = (own or frames or [None])[0]
    return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}" if frame else "?"


if __name__ == "__main__":  # the worker: python -m tests.fake_cuda REQUESTS_FD REPLIES_FD (started by Worker)
    serve(int(sys.argv[1]), int(sys.argv[2]))
