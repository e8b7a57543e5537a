// The other half of conflict_a.cpp: the same names, other implementations.
#include "distrpc/distrpc.hpp"

DISTRPC_REMOTE(scale, "math.scale", double(double));

namespace {

int twice(int x) {
  return x + x;
}

double scale_b(double x) {
  return x + x;
}

}  // namespace

DISTRPC_EXPOSE(scale, &scale_b);

int call_twice_b() {
  return distrpc::rpc_sync<&twice>("alone", 1);
}
