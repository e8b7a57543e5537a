// expect: DISTRPC_EXPOSE(stub, &impl): impl's parameter types differ from the declaration's
#include "distrpc/distrpc.hpp"
DISTRPC_REMOTE(add, "math.add", at::Tensor(at::Tensor, at::Tensor));
at::Tensor add_impl(at::Tensor a, std::int64_t b) { return a + b; }
DISTRPC_EXPOSE(add, &add_impl);
