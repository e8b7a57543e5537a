#!/usr/bin/env bash
# Installs what is missing, builds, and runs the flagship examples on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/deps.sh
distrpc_install_deps
# Only what this script runs: a newcomer waits for the examples, not for the test suites.
DISTRPC_TARGETS="examples/rendezvous examples/hello_rpc examples/parameter_server examples/remote_module examples/rnn examples/data_parallel examples/ddp_train examples/ddp_rpc" \
  distrpc_build build
echo "== 4 local processes rendezvous through a TCP store on 127.0.0.1"
./build/examples/rendezvous --world 4
echo
echo "== 4 local workers call each other over RPC (TCP on 127.0.0.1)"
./build/examples/hello_rpc --world 4
echo
echo "== a parameter server (worker0) and 3 trainers over RRef proxies"
./build/examples/parameter_server --iterations 20
echo
echo "== a model split over two workers: local features on worker0, a RemoteModule head on worker1"
./build/examples/remote_module --batches 100
echo
echo "== a distributed RNN: embedding and decoder on a parameter server, the LSTM local; distributed autograd + DistributedOptimizer"
./build/examples/rnn --iterations 40
echo
echo "== data-parallel training by hand: 4 replicas average their gradients with all_reduce (shared memory)"
./build/examples/data_parallel --world 4 --steps 30
echo
echo "== data-parallel training with DistributedDataParallel: 2 replicas, gradients averaged during backward"
./build/examples/ddp_train --world 2 --epochs 3 --timeout 120
echo
echo "== DDP beside RPC: an EmbeddingBag on a parameter server, a DDP Linear on 2 trainers, DistributedOptimizer"
./build/examples/ddp_rpc --epochs 10 --timeout 120
