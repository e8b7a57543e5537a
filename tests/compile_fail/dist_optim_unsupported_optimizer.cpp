// expect: Opt must be a torch::optim optimizer with distrpc::optim::optimizer_traits<Opt>
#include <torch/optim/lbfgs.h>
#include "distrpc/dist_optim.hpp"
void make(std::vector<distrpc::RRef<at::Tensor>> params) {
  distrpc::optim::DistributedOptimizer<torch::optim::LBFGS> opt(params, {});
}
