#!/usr/bin/env bash
# One run on two nodes of 8 GPUs each, torchrun style: run this script on both nodes, with the same
# MASTER_ADDR (node 0's address) and each node's own NODE_RANK:
#
#   node0$ CONFIG=run.yaml NODE_RANK=0 MASTER_ADDR=node0.cluster examples/multinode/two_nodes.sh
#   node1$ CONFIG=run.yaml NODE_RANK=1 MASTER_ADDR=node0.cluster examples/multinode/two_nodes.sh
#
# verl reads trainer.node_rank from NODE_RANK and trainer.rdzv_endpoint from MASTER_ADDR:MASTER_PORT
# (torchrun's names) when the config leaves them out. Node 0's daemon holds the run's control: watch,
# `verl set` and `verl stop` there. SHARED must be a file system both nodes see: the sharded checkpoints
# go to one folder; each node keeps its own run directory (logs, metrics.jsonl, the daemon's lock).
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK: 0 on the first node, 1 on the second}"
: "${MASTER_ADDR:?set MASTER_ADDR: the address of node 0, the same on both nodes}"
export NODE_RANK MASTER_ADDR
export MASTER_PORT="${MASTER_PORT:-29500}"
: "${CONFIG:?set CONFIG to the YAML file of the run, the same on every node}"
SHARED="${SHARED:-/shared/verl}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"

exec verl train --config "$CONFIG" \
  trainer.nnodes=2 \
  trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  trainer.default_local_dir="$SHARED/checkpoints/run" \
  trainer.runs_dir="$SHARED/runs/node$NODE_RANK" \
  "$@"
