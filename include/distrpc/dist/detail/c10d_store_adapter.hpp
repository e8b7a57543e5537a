// C10dStoreAdapter: a c10d::Store (libtorch's store interface) that forwards to a distrpc store,
// so that libtorch's own process groups (c10d::ProcessGroupGloo first) rendezvous through any
// distrpc::store::Store: TCPStore, FileStore, HashStore, PrefixStore.
//
// Spike findings (libtorch 1.13 as Debian 12 ships it, gloo 0.0~git20220518):
//  - What worked: two processes meet through a distrpc TCPStore wrapped by this adapter, build
//    c10d::ProcessGroupGloo on a loopback device (createDeviceForHostname("127.0.0.1")), and run
//    allreduce, broadcast and barrier (tests/test_dist_gloo.cpp). A peer that never arrives makes
//    the ProcessGroupGloo constructor throw c10::Error carrying the distrpc store's timeout text
//    after Options' timeout (gloo waits for the peer's address key with that timeout).
//  - What 1.13 needed:
//    * ProcessGroupGloo.hpp compiles only with USE_C10D_GLOO defined (libtorch's build defines it;
//      its installed headers do not), and it includes <gloo/...>: Debian's libgloo-dev, the same
//      gloo that libtorch_cpu.so links (libgloo.so.0), so gloo's classes have one layout.
//    * No extra library: ProcessGroupGloo's code is in libtorch_cpu.so (nm -DC shows
//      c10d::ProcessGroupGloo::createDeviceForHostname), gloo's in libgloo.so.0 that it pulls in.
//    * c10d::Store in 1.13 has these virtuals: set, compareSet (default asserts), get, add,
//      deleteKey, check, getNumKeys, wait(keys), wait(keys, timeout), getTimeout, setTimeout,
//      watchKey (default throws: only c10d's TCPStore has it). The base keeps its own timeout_:
//      this adapter keeps it equal to the distrpc store's timeout.
//    * The store must be a c10::intrusive_ptr<c10d::Store> (c10::make_intrusive).
//    * ProcessGroupGloo wraps the store in a c10d::PrefixStore per device and hands gloo a
//      GlooStore (ProcessGroupGloo.hpp) that calls set, get and wait(keys, timeout) on it; its
//      wait(keys) without a timeout passes c10d::Store::kDefaultTimeout (300 s), not the store's
//      own timeout, so a peer that never arrives is noticed after the process group's timeout
//      (Options::create(timeout)) or those 300 s, whichever gloo hits first.
//  - What changes for libtorch 2.x:
//    * c10d::Store gains virtuals: append, multiGet, multiSet, hasExtendedApi (gloo and NCCL use
//      the batched calls when it returns true), clone() (needed by 2.x process groups that
//      reconnect per thread; pure virtual in recent releases), queuePush/queuePop/queueLen and
//      listKeys in the newest ones; c10::optional becomes std::optional in watchKey.
//    * ProcessGroupGloo derives from c10d::Backend (not ProcessGroup); a process group is built as
//      c10d::ProcessGroup + setBackend(...), and Options::create takes the timeout the same way.
//    * Errors: recent 2.x stores throw c10::DistStoreError / c10::DistNetworkError (subclasses of
//      c10::Error); 1.13 has only c10::Error, which is what this adapter throws.
//  The adapter translates distrpc's store errors into c10::Error (TORCH_CHECK) so that c10d code
//  sees the error type it catches, with distrpc's message (which names the key and the store).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "distrpc/error.hpp"
#include "distrpc/store/store.hpp"

namespace distrpc::dist::detail {

// c10d's callers (ProcessGroupGloo's rendezvous among them) catch c10::Error: distrpc's errors
// become one, keeping their message; anything else passes through untouched.
template <class F>
std::invoke_result_t<F> forward_to_c10d(F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const distrpc::DistError& e) {
    // A throw expression (not TORCH_CHECK(false)): no path falls off a non-void return.
    C10_THROW_ERROR(Error, e.what());
  }
}

class C10dStoreAdapter : public c10d::Store {
 public:
  explicit C10dStoreAdapter(std::shared_ptr<distrpc::store::Store> store)
      : c10d::Store(checked(store).timeout()), store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    forward_to_c10d([&] { store_->set(key, value); });
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& currentValue,
                                  const std::vector<uint8_t>& newValue) override {
    return forward_to_c10d([&] { return store_->compare_set(key, currentValue, newValue); });
  }

  std::vector<uint8_t> get(const std::string& key) override {
    return forward_to_c10d([&] { return store_->get(key); });
  }

  int64_t add(const std::string& key, int64_t value) override {
    return forward_to_c10d([&] { return store_->add(key, value); });
  }

  bool deleteKey(const std::string& key) override {
    return forward_to_c10d([&] { return store_->delete_key(key); });
  }

  bool check(const std::vector<std::string>& keys) override {
    return forward_to_c10d([&] { return store_->check(keys); });
  }

  int64_t getNumKeys() override {
    return forward_to_c10d([&] { return store_->num_keys(); });
  }

  void wait(const std::vector<std::string>& keys) override {
    forward_to_c10d([&] { store_->wait(keys, store_->timeout()); });
  }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    forward_to_c10d([&] { store_->wait(keys, timeout); });
  }

  // Both timeouts move together: c10d callers read getTimeout() (the base's timeout_), distrpc's
  // store applies its own to get() and wait(keys). getTimeout() stays the base's: it returns a
  // reference, so it cannot read the distrpc store's atomic; a timeout set on the distrpc store
  // directly is therefore not seen by getTimeout() (set it through the adapter).
  void setTimeout(const std::chrono::milliseconds& timeout) override {
    TORCH_CHECK(timeout.count() >= 0, "C10dStoreAdapter::setTimeout: negative timeout (",
                timeout.count(), " ms)");
    store_->set_timeout(timeout);
    c10d::Store::setTimeout(timeout);
  }

  // libtorch 2.x's Store declares clone() (a thread-safe handle to the same store) pure virtual;
  // 1.13's has none, so this overrides it there and is a plain member here (no `override`: it
  // would not compile against 1.13). The distrpc store is safe to share between threads.
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Winconsistent-missing-override"
#endif
  c10::intrusive_ptr<c10d::Store> clone() {
    return c10::make_intrusive<C10dStoreAdapter>(store_);
  }
#if defined(__clang__)
#pragma clang diagnostic pop
#endif

  const std::shared_ptr<distrpc::store::Store>& store() const noexcept {
    return store_;
  }

 private:
  static distrpc::store::Store& checked(const std::shared_ptr<distrpc::store::Store>& store) {
    TORCH_CHECK(store != nullptr, "C10dStoreAdapter: the distrpc store is null");
    return *store;
  }

  std::shared_ptr<distrpc::store::Store> store_;
};

}  // namespace distrpc::dist::detail
