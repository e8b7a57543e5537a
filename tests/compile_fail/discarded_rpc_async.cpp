// expect: ignoring returned value of type 'distrpc::Future<int>'
#include "distrpc/distrpc.hpp"
int twice(int x) { return 2 * x; }
// The future holds the call's only error report: dropping it unread is refused at compile time.
void call() { distrpc::rpc_async<&twice>("worker1", 3); }
