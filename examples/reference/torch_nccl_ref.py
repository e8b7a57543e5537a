#!/usr/bin/env python3
"""Reference figures from PyTorch's own NCCL process group, beside `bench_nccl`: one process, a
group of one on cuda:0 (what one GPU allows; an in-place all-reduce then moves no data, so this
is the cost of a call). Prints one JSON object (nulls and "skipped" without a GPU):
  allreduce_256MiB_us  a 256 MiB float all-reduce (SUM), until the GPU is done, median of 20
  cuda_d2d_copy_GBps   bytes per second of a 256 MiB device-to-device copy, median of 20
Usage: torch_nccl_ref.py
"""
import json, statistics, time
import torch
import torch.distributed as dist


def median_s(samples, f):
    for _ in range(3):
        f()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    if not torch.cuda.is_available():
        print(json.dumps({"allreduce_256MiB_us": None, "cuda_d2d_copy_GBps": None,
                          "skipped": "no GPU"}))
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    n = 64 * 1024 * 1024
    t = torch.ones(n, device="cuda:0")

    def reduce():  # as bench_nccl: the call, then until the GPU is done
        dist.all_reduce(t)
        torch.cuda.synchronize()

    dst = torch.empty_like(t)

    def copy():
        dst.copy_(t)
        torch.cuda.synchronize()

    res = {"allreduce_256MiB_us": median_s(20, reduce) * 1e6,
           "cuda_d2d_copy_GBps": n * 4 / median_s(20, copy) / 1e9}
    dist.destroy_process_group()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
