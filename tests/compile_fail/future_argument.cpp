// expect: a Future cannot be sent as an argument
#include "distrpc/distrpc.hpp"
int twice(int x) { return 2 * x; }
distrpc::Future<int> pending;
int take(distrpc::Future<int> f) { return f.value(); }
void call() { distrpc::rpc_sync<&take>("worker1", pending); }
