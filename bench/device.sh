#!/usr/bin/env bash
# The GPU check: one short run on a GPU machine, each part under a time limit, at most 8 minutes in all.
#   bench/gpu.py           seconds, TFLOP/s and peak memory of rollout / old surrogate / update at the real shapes
#   bench/memory.py --gpu  every phase's peak (allocated and reserved) beside results/memory.json's fake-CUDA bytes,
#                          and the CUDA context's size
# Results go to $OUT (or bench/results/): gpu.md, gpu.json, memory-gpu.md, memory-gpu.json, device.txt.
#
#   bash bench/device.sh
#
# A machine whose Python lacks diffusers or has an older transformers / peft than requirements.txt asks for: put
# their wheels in .whl/ (ignored by git) and they are installed into /tmp/site first, e.g. on a machine with pip
# access, for the remote Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl diffusers==0.42.1 transformers==5.24.0 \
#       peft==0.21.2 tokenizers huggingface_hub
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, diffusers, transformers, peft
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__,
      'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$out/device.txt"
timeout 240 python3 bench/gpu.py --time-limit 170 --out "$out/gpu.md"
echo "bench/gpu.py: exit $?"
timeout 240 python3 bench/memory.py --gpu --time-limit 170 --out "$out/memory-gpu.md"
echo "bench/memory.py --gpu: exit $?"
