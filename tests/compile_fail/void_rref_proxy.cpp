// expect: holds no object to call methods on; call to_here() to wait for the function
#include "distrpc/distrpc.hpp"
struct Counter {
  int n = 0;
  int get() const { return n; }
};
void reset(int) {}
void call() {
  distrpc::RRef<void> done = distrpc::remote<&reset>("worker1", 0);
  (void)done.rpc_sync<&Counter::get>();
}
