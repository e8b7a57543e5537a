// expect: an argument does not convert to the type of Interface::forward's parameter
#include "distrpc/nn/remote_module.hpp"
struct LinearInterface {
  at::Tensor forward(at::Tensor x);
};
at::Tensor call(const distrpc::nn::RemoteModule<LinearInterface>& rm) {
  return rm.forward(std::string("not a tensor"));
}
