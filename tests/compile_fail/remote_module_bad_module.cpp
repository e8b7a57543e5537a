// expect: M::forward cannot be called with the argument types of Interface::forward
#include <torch/nn/module.h>
#include "distrpc/nn/remote_module.hpp"
struct LinearInterface {
  at::Tensor forward(at::Tensor x);
};
struct TwoInputs : torch::nn::Module {
  at::Tensor forward(const at::Tensor& a, const at::Tensor& b) { return a + b; }
};
void make() {
  distrpc::nn::RemoteModule<LinearInterface>::create<TwoInputs>("worker1/cpu");
}
