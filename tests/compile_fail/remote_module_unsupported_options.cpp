// expect: for another options struct, specialize distrpc::nn::OptionsCodec<TheOptions>
#include <torch/nn/modules/linear.h>
#include "distrpc/nn/remote_module.hpp"
struct LinearInterface {
  at::Tensor forward(at::Tensor x);
};
void make() {
  // FlattenOptions has no codec in distrpc/nn/module_options.hpp.
  distrpc::nn::RemoteModule<LinearInterface>::create<torch::nn::Flatten>(
      "worker1/cpu", torch::nn::FlattenOptions().start_dim(0));
}
