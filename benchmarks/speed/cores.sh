#!/usr/bin/env bash
# The multi-process speed comparison on a machine with enough cores that no process shares one
# (docs/benchmarks.md, "On a machine with 16 cores"): 32-layer GCNII / GCN / ResGCN+ on 4 and 8
# processes, gnnpipe against graph_parallel and one process with as many threads, each setting pinned
# to its own physical cores (benchmarks/speed/speed_sweep.py). Then, where a GPU is present and time is
# left, the tests marked `gpu`. Results go to $OUT (default docs/results/cores); BUDGET: seconds after
# which no setting starts (default 330); LIMIT: the seconds the whole script may take (default 560);
# JOBS: the settings (model:graph:procs:chunks:bandwidth, space-separated) instead of the default list.
#
#   bash benchmarks/speed/cores.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-docs/results/cores}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
{
    echo "logical CPUs: $(nproc)"
    grep -m1 "model name" /proc/cpuinfo
    python -c "import torch, torch_geometric, lightning; print('torch', torch.__version__, 'pyg', torch_geometric.__version__, 'lightning', lightning.__version__)"
    python -c "import pymetis" 2>/dev/null && echo "pymetis: yes" || echo "pymetis: no (the pure-torch partitioner cuts the chunks)"
    python -c "from pyg_pipe.ops import backend; print('CPU kernels:', backend('cpu'))"
} 2>&1 | tee "$out/machine.txt"
jobs="${JOBS:-gcnii:community:8:32:0 gcn:community:8:32:0 resgcn:community:8:32:0 gcnii:community:8:32:1e8 \
    gcnii:community:4:16:0 gcn:community:4:16:0 resgcn:community:4:16:0 gcnii:random:4:16:0 \
    gcnii:community:4:16:1e8 resgcn:community:4:16:1e8 gcnii:community:2:8:0}"
# shellcheck disable=SC2086
# each job's own files stay outside $OUT; $OUT gets all.json (results, outputs, each rank's timeline)
python benchmarks/speed/speed_sweep.py --out "$out" --work "$(mktemp -d)" --trace --budget "${BUDGET:-330}" \
    --jobs $jobs 2>&1 | tee "$out/sweep.txt"
left=$(( ${LIMIT:-560} - ($(date +%s) - start) ))
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && [ "$left" -gt 60 ]; then
    timeout "$left" python -m pytest -q -m gpu tests -x -p no:cacheprovider 2>&1 | tail -30 | tee "$out/gpu_tests.txt"
fi
echo "cores.sh: $(( $(date +%s) - start )) s"
