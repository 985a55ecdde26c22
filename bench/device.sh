#!/usr/bin/env bash
# The GPU check: one short run on a GPU machine, each part under a time limit, 8.2 minutes of limits in all; with
# 10 s each for a kill (a part past its limit is killed 10 s later) and about 20 s for the wheels' install and the
# version line, 9 minutes at most.
#   bench/smoke.py         one whole iteration of every configuration at the real shapes (random weights): no crash,
#                          the ratio at the first inner step, finite losses, peak memory; exits 1 naming a failure
#   bench/memory.py --gpu  every phase's peak (allocated and reserved) beside results/memory.json's fake-CUDA bytes,
#                          and the CUDA context's size
#   bench/gpu.py           each attention kernel alone at both models' shapes (--kernels: flash, memory-efficient,
#                          math, FlashAttention 3 / 4 where installed, cuDNN last in its child process), then seconds,
#                          TFLOP/s and peak memory of rollout / old surrogate / update at the real shapes, eager and
#                          compiled, the ODE loop's cost and the top kernels (--profile)
# Results go to $OUT (or bench/results/), 8 files: smoke-gpu.md, smoke-gpu.json, memory-gpu.md, memory-gpu.json,
# gpu.md, gpu.json, device.txt, device.log (this script's whole output). Back here, with memory-gpu.json in
# bench/results/: `python bench/memory.py --guide` writes docs/guide.md's memory table from the GPU's figures.
#
#   bash bench/device.sh                 all three parts (about 9 minutes)
#   bash bench/device.sh memory gpu      only the parts named: a rerun after a fix fits what a session has left
#   SMOKE_ONLY=sd3-full,flux-lora-fsdp bash bench/device.sh smoke     the smoke run's configurations named (--only)
#   GPU_MODELS=flux bash bench/device.sh gpu    bench/gpu.py's models named (--models; default sd3,flux); back here,
#       python bench/gpu.py --merge FIRST/gpu.json,RERUN/gpu.json    one report of both runs, each model's last result
#   MEMORY_MODELS=flux bash bench/device.sh memory      the same for bench/memory.py (and its --merge), and
#       bench/smoke.py --merge for the smoke run's
#
# A machine whose Python lacks diffusers or has an older transformers / peft than requirements.txt asks for: put
# their wheels in .whl/ (ignored by git) and they are installed into /tmp/site first, e.g. on a machine with pip
# access, for the remote Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 \
#       transformers==5.24.0 peft==0.21.2 regex importlib_metadata
# (about 21 MB; an H200 machine of this project had torch 2.11.0+cu130 and transformers 5.17, no diffusers.)
set -uo pipefail
cd "$(dirname "$0")/.."
parts=" ${*:-smoke memory gpu} "
for part in $parts; do
    case $part in
        smoke | memory | gpu) ;;
        *) echo "bench/device.sh: no part '$part' (the parts: smoke, memory, gpu)" >&2; exit 2 ;;
    esac
done
out=${OUT:-bench/results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# diffusers' attention dispatcher as vgrpo expects it: torch's SDPA under vgrpo's choice of kernels (--attention)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DIFFUSERS_ATTN_BACKEND=native
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # torch.compile on CUDA needs triton, a C compiler and Python's headers: a missing one makes every
    # configuration eager (--compile auto), so the compiled figures would be missing
    python3 -c "import shutil, os, torch, diffusers, transformers, peft, vgrpo
headers = vgrpo.python_headers()   # where triton looks for Python.h
try:
    import triton
    triton = triton.__version__
except ImportError as e:
    triton = f'missing ({e})'
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__,
      'transformers', transformers.__version__, 'peft', peft.__version__, 'triton', triton,
      'cc', shutil.which('cc') or shutil.which('gcc') or 'missing',
      'Python.h', 'found' if os.path.isfile(os.path.join(headers, 'Python.h')) else 'missing')"
} 2>&1 | tee "$out/device.txt"
{
    if [[ $parts == *" smoke "* ]]; then
        # each configuration compiles its blocks (--compile auto on CUDA) within its own --timeout (long enough for
        # a cold compile: one that ran out would run out again in a rerun, while what --budget leaves out does not);
        # -k: a part that outlives its limit by 10 s (a kill's clean-up) is killed, so the parts after it keep
        # their time
        timeout -k 10 195 python3 bench/smoke.py --timeout 140 --budget 180 ${SMOKE_ONLY:+--only "$SMOKE_ONLY"} \
            --out "$out/smoke-gpu.md"
        echo "bench/smoke.py: exit $?"
    fi
    if [[ $parts == *" memory "* ]]; then
        # what else holds the GPU's memory (a killed configuration's process not yet gone would count as the context)
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
        # SD3.5-M and FLUX.1-dev, LoRA and full fine-tuning, one process and --fsdp: the README's table
        timeout -k 10 135 python3 bench/memory.py --gpu --models "${MEMORY_MODELS:-sd3,flux}" --time-limit 90 \
            --out "$out/memory-gpu.md"
        echo "bench/memory.py --gpu: exit $?"
    fi
    if [[ $parts == *" gpu "* ]]; then
        # the kernel probe first (about 15 s of the 115), then the models until --time-limit
        timeout -k 10 160 python3 bench/gpu.py --kernels --time-limit 115 --repeats 1 --profile ${GPU_MODELS:+--models \
            "$GPU_MODELS"} --out "$out/gpu.md"
        echo "bench/gpu.py: exit $?"
    fi
} 2>&1 | tee "$out/device.log"
