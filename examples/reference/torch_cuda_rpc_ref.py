#!/usr/bin/env python3
"""Reference GPU figures from PyTorch's own RPC stack (TensorPipe agent with a device map), two
processes sharing cuda:0, beside `bench_rpc --cuda`.

Needs a PyTorch with CUDA and one GPU. Prints one JSON object (nulls and "skipped" without a GPU):
  echo_cuda_64MiB_GBps  bytes moved (there and back) per second echoing a 64 MiB float tensor on
                        cuda:0 through rpc_sync with the device map {0: 0} both ways (median of 10)
  cuda_d2d_copy_GBps    bytes per second of a 64 MiB device-to-device copy on cuda:0 (median of 20
                        samples of 10 copies)
Usage: torch_cuda_rpc_ref.py [PORT]
"""
import json, os, sys, tempfile
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

# The same echo function and timing as the CPU reference beside this file.
from torch_rpc_ref import ident, median_us


def bench(rank, world, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=120)
    opts.set_device_map(f"worker{1 - rank}", {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        res = {}
        big = torch.ones(16 * 1024 * 1024, device="cuda:0")
        torch.cuda.synchronize()

        def echo():
            rpc.rpc_sync("worker1", ident, args=(big,))
            torch.cuda.synchronize()  # the reply's tensor may still be arriving on its stream

        t = median_us(echo, 10, 1)
        res["echo_cuda_64MiB_GBps"] = 2 * big.numel() * 4 / (t / 1e6) / 1e9
        dst = torch.empty_like(big)

        def copy():  # 10 copies per sample: launches and the sync are not what is measured
            for _ in range(10):
                dst.copy_(big)
            torch.cuda.synchronize()

        t = median_us(copy, 20, 2) / 10
        res["cuda_d2d_copy_GBps"] = big.numel() * 4 / (t / 1e6) / 1e9
        with open(out, "w") as f:
            json.dump(res, f)
    rpc.shutdown()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print(json.dumps({"echo_cuda_64MiB_GBps": None, "cuda_d2d_copy_GBps": None,
                          "skipped": "no GPU"}))
        sys.exit(0)
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 29613
    out = os.path.join(tempfile.mkdtemp(), "torch_cuda_rpc_ref.json")
    mp.spawn(bench, args=(2, port, out), nprocs=2, join=True)
    print(open(out).read())
