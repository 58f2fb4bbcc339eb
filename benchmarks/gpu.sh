#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one call, for the day one is lent (about 8 minutes of device time):
#   0. the compiled kernels' first build (about 2 minutes; a step of its own, so that no later step's time limit
#      kills it: the seventh GPU run lost a call to that);
#   1. the tests marked `gpu` (the kernels against their reference on CUDA, the engine streaming on one
#      GPU and through Lightning equal to plain PyG (also under bf16-mixed), the captured streamed step (CUDA graphs)
#      equal to the uncaptured one, 2 processes on one GPU over gloo with the transport
#      staging through host memory, gnnpipe over NCCL when there are two GPUs), with benchmarks/gpu/diagnose_tests.py
#      as a plugin: for a test that fails, the exceptions raised inside CUDA graph captures go to raised_in_capture.txt;
#   2. benchmarks/gpu/diagnose_capture.py: the last operations before the one capture measured failing
#      (PyG's GCN keeping activations inside the capture; prints only);
#   3. benchmarks/gpu/gpu_summary.py: the GPU issue's figures in one summary.json (streamed epoch against plain
#      PyG at 20k and 200k vertices, host time per chunk and layer, GPU busy share and copies per step,
#      the largest graph plain PyG and streaming train under a memory cap, 2 processes on one GPU);
#   4. benchmarks/speed/copies.py on the GPU: the row copies of one uncaptured streamed step and one with history, by
#      the line that made them (seconds; the profile counts the captured step's copies, not where they come from);
#   5. benchmarks/speed/grid_choice.py on the GPU: grid="auto" (opt-in until measured on a GPU) with 2 processes
#      sharing it over gloo, every candidate grid timed beside the cost model's prediction and its choice
#      (added 2026-11-29, not yet run: about a minute expected);
#   the default steps took 387 s on an H100 in the eighth run (the build about 110 s, the tests 106 s in 4
#   processes, the summary 163 s with GPU_SWEEP_SECONDS=60); with GPU_FULL=1 also (not yet timed together):
#   6. benchmarks/gpu/host_tier.py: streaming with every value in pinned host memory at 200k vertices against
#      plain PyG, profiled (where the host's time goes: the halo gathers and gradient adds, the waits);
#   7. the fused kernels against cuSPARSE (torch.sparse.mm) and PyG's scatter path, with the kernel's
#      achieved bandwidth (benchmarks/kernels/aggregate.py --device cuda);
#   8. one engine epoch on CUDA (benchmarks/speed/gnnpipe_epoch.py) and a profile of one GPU's step
#      (benchmarks/gpu/gpu_profile.py: wall time against GPU busy time, host synchronisations and copies).
# A failing step does not stop the later ones (the script exits non-zero at the end if one failed).
# Results go to $OUT (default docs/results/gpu). Without a CUDA device it says so and exits 0.
# The first CUDA build of the kernels takes about 2 minutes (measured on an H200 machine).
#
#   bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-docs/results/gpu}"
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" = "0" ]; then
    echo "benchmarks/gpu.sh: no CUDA device here; nothing to run (the tests marked gpu skip without one)."
    exit 0
fi
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt" || true
procs=$(( gpus >= 2 ? 2 : 1 ))
failed=0
step() { echo "+ $*"; "$@" || { echo "benchmarks/gpu.sh: failed: $*"; failed=1; }; }
step bash -c "set -o pipefail; python -c 'from pyg_pipe.ops.build import backend; print(\"kernels:\", \
    backend(\"cuda\"))' 2>&1 | tee '$out/kernels.txt'"
# the tests in 4 processes where pytest-xdist is there (eighth run, H100: 106 s; the seventh ran them in one
# process, the kernels' build inside: 272 s)
par=$(python -c "import xdist" 2>/dev/null && echo "-n 4" || true)
step bash -c "set -o pipefail; RAISED_LOG='$out/raised_in_capture.txt' python -m pytest -q -m gpu tests $par \
    -p benchmarks.gpu.diagnose_tests --durations=25 2>&1 | tee '$out/tests.txt'"
step bash -c "set -o pipefail; python benchmarks/gpu/diagnose_capture.py 2>&1 | tee '$out/diagnose_capture.txt'"
step bash -c "set -o pipefail; PYTHONUNBUFFERED=1 python benchmarks/gpu/gpu_summary.py --out '$out/summary.json' \
    --sweep-seconds ${GPU_SWEEP_SECONDS:-90} 2>&1 | tee '$out/summary.txt'"
step bash -c "set -o pipefail; python benchmarks/speed/copies.py --adj-t --device cuda --out '$out/copies_cuda.json' \
    2>&1 | tee '$out/copies_cuda.txt'"
step bash -c "set -o pipefail; python benchmarks/speed/grid_choice.py --device cuda --cases gcnii:community:2:0 \
    --nodes 20000 --steps 4 --max-per-way 8 --timeout 300 --out '$out/grid_choice_cuda.json' 2>&1 \
    | tee '$out/grid_choice_cuda.txt'"
if [ "${GPU_FULL:-0}" = "1" ]; then
    step bash -c "set -o pipefail; PYTHONUNBUFFERED=1 python benchmarks/gpu/host_tier.py --nodes 200000 --chunks 4 \
        --out '$out/host_tier_200k.json' 2>&1 | tee '$out/host_tier_200k.txt'"
    step bash -c "set -o pipefail; python benchmarks/kernels/aggregate.py --device cuda --widths 64 128 --repeats 5 \
        --out '$out/aggregate_cuda.json' 2>&1 | tee '$out/aggregate_cuda.txt'"
    step bash -c "set -o pipefail; python benchmarks/speed/gnnpipe_epoch.py --device cuda --procs $procs --nodes 20000 \
        --layers 16 --chunks 4 8 --epochs 6 --out '$out/epoch_cuda.json' 2>&1 | tee '$out/epoch_cuda.txt'"
    step bash -c "set -o pipefail; python benchmarks/gpu/gpu_profile.py --nodes 20000 --layers 16 --chunks 4 8 --steps 3 \
        --out '$out/profile.json' 2>&1 | tee '$out/profile.txt'"
fi
exit $failed
