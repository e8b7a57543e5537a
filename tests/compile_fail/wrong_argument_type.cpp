// expect: an argument does not convert to the type of f's parameter at the same position
#include "distrpc/distrpc.hpp"
at::Tensor add(at::Tensor a, at::Tensor b) { return a + b; }
void call() { distrpc::rpc_sync<&add>("worker1", at::Tensor(), std::string("not a tensor")); }
