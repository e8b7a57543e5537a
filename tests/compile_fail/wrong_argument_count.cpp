// expect: wrong number of arguments for f
#include "distrpc/distrpc.hpp"
at::Tensor add(at::Tensor a, at::Tensor b) { return a + b; }
void call() { distrpc::rpc_async<&add>("worker1", at::Tensor()); }
