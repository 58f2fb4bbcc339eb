#!/usr/bin/env bash
# Several machines with torchrun: run this on every machine, with the same MASTER_ADDR (the first
# machine's address) and NODE_RANK 0, 1, ... Lightning reads torchrun's environment (its
# TorchElasticEnvironment), so the script is the single-machine one with --num-nodes.
#
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 NNODES=2 NPROC=4 bash examples/multi_node/torchrun.sh
#   (on one machine, to try it: NNODES=1 NPROC=2 bash examples/multi_node/torchrun.sh --offline --epochs 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
NNODES=${NNODES:-1}
NPROC=${NPROC:-2}
torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    examples/node_classification.py --devices "$NPROC" --num-nodes "$NNODES" "$@"
