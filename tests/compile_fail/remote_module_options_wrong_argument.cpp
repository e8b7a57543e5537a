// expect: an argument does not convert to the type of Interface::forward's parameter
#include "distrpc/nn/remote_module.hpp"
struct LinearInterface {
  at::Tensor forward(at::Tensor x);
};
void call(const distrpc::nn::RemoteModule<LinearInterface>& rm) {
  // Options first, then an argument forward does not take.
  rm.forward(distrpc::with_timeout(std::chrono::milliseconds(100)), "text");
}
