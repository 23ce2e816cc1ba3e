#!/usr/bin/env bash
# two_nodes.sh NP COMMAND...: NP ranks as two hosts on this machine, two launchers
# (bagua-run --num-nodes 2, NP / 2 ranks each) meeting at one rendezvous; exit 0 when both do.
# For the GPU check (native/tests/run_gpu_check.sh): Horovod's GPU Adasum across hosts.
set -u
np=$1
shift
py=${PYTHON:-python3}
port=$($py -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export BAGUA_HVD_SECRET=${BAGUA_HVD_SECRET:-$($py -c 'import secrets; print(secrets.token_hex(32))')}
pids=()
for node in 0 1; do
  $py -m bagua_hvd.runner.launch -np "$np" --num-nodes 2 --node-rank "$node" \
    --rendezvous-addr "127.0.0.1:$port" "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
