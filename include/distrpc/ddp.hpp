// Data-parallel training on a process group (PyTorch's torch.nn.parallel and
// torch.distributed.algorithms.ddp_comm_hooks): distrpc::nn::DistributedDataParallel
// (ddp/distributed_data_parallel.hpp), its reducer (ddp/reducer.hpp), the bucket a communication
// hook receives (ddp/grad_bucket.hpp), the built-in hooks (ddp/comm_hooks.hpp, ddp/powersgd.hpp)
// and distrpc::nn::SyncBatchNorm (ddp/sync_batch_norm.hpp).
#pragma once

#include <distrpc/ddp/comm_hooks.hpp>
#include <distrpc/ddp/distributed_data_parallel.hpp>
#include <distrpc/ddp/grad_bucket.hpp>
#include <distrpc/ddp/powersgd.hpp>
#include <distrpc/ddp/reducer.hpp>
#include <distrpc/ddp/sync_batch_norm.hpp>
