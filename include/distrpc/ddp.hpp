// Data-parallel training on a process group (PyTorch's torch.nn.parallel):
// distrpc::nn::DistributedDataParallel (ddp/distributed_data_parallel.hpp), its reducer
// (ddp/reducer.hpp) and the bucket a communication hook receives (ddp/grad_bucket.hpp).
#pragma once

#include <distrpc/ddp/distributed_data_parallel.hpp>
#include <distrpc/ddp/grad_bucket.hpp>
#include <distrpc/ddp/reducer.hpp>
