#!/bin/bash
# usage: run.sh NAME MINUTES MIX [extra node -p params...]   (env: PROBE_* passed to the probe)

NAME=$1; MIN=$2; MIX=$3; shift 3
cd /work/main && source scripts/env.sh
export ROS_DOMAIN_ID=$((150 + RANDOM % 60)) OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
D=/tmp/soak-probe/$NAME; mkdir -p $D; rm -f $D/probe.jsonl $D/stress.txt
PARAMS=(-p engine.max_batch:=4 -p engine.device:=cpu)
for p in "$@"; do PARAMS+=(-p "$p"); done
PROBE_OUT=$D/probe.jsonl nice -n 5 python bench/results/2026-12-07-soak-rss/probe_node.py --ros-args --params-file config/orin.yaml "${PARAMS[@]}" > $D/node.log 2>&1 &
NODE=$!
echo $NODE > $D/node.pid
if [ -n "$WAIT_WARM" ]; then
  until grep -q ', true\]' $D/probe.jsonl 2>/dev/null; do sleep 10; kill -0 $NODE || exit 1; done
  echo "warm at $(date)" >> $D/stress.txt
fi
nice -n 5 python -m gemma_spec_ros stress --attach --clients 4 --goals 1 --minutes $MIN --cancel 0.15 --mix $MIX --max-new-tokens 48 >> $D/stress.txt 2>&1
echo "stress rc=$?" >> $D/stress.txt
kill -INT $NODE; sleep 10; kill -0 $NODE 2>/dev/null && kill -9 $NODE
