// expect: the template argument must be a pointer to a function or static member function
#include "distrpc/distrpc.hpp"
struct S {
  int m(int x) { return x; }
};
void call() { distrpc::rpc_sync<&S::m>("worker1", 1); }
