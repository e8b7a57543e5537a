// Distributed optimizer (PyTorch's torch.distributed.optim): DistributedOptimizer<Opt> over
// parameters held by several workers, stepped with distributed autograd's gradients.
// docs/dist_optim.md.
#pragma once

#include "distrpc/optim/distributed_optimizer.hpp"
#include "distrpc/optim/optimizer_options.hpp"
