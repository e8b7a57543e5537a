// expect: an argument does not convert to the type of the declaration's parameter at the same position
#include "distrpc/distrpc.hpp"
DISTRPC_REMOTE(add, "math.add", at::Tensor(at::Tensor, at::Tensor));
void call() { distrpc::rpc_sync<add>("worker1", at::Tensor(), std::string("not a tensor")); }
