// What the multi-process RPC suites (test_rpc.cpp, test_rref.cpp, test_remote_module.cpp) share:
// worker names, the per-case init, extra rendezvous files, and an exact-exception check.
// Header-only; every suite runs on the transport under test (rpc_under_test.hpp).
#pragma once

#include <chrono>
#include <string>
#include <thread>
#include <typeinfo>

#include <c10/util/Exception.h>
#include <doctest/doctest.h>

#include <distrpc/options.hpp>
#include <distrpc/rpc.hpp>
#include <distrpc/rpc_error.hpp>
#include <distrpc/rref.hpp>

#include "multiprocess.hpp"
#include "support/error_text.hpp"
#include "support/rpc_under_test.hpp"

namespace distrpc::testing {

inline std::string wname(int rank) {
  return "worker" + std::to_string(rank);
}

// init_rpc as every case does it: worker{rank}, the run's file:// rendezvous.
inline void init(const RankContext& ctx, RpcBackendOptions o = {}) {
  o.init_method = ctx.file_url();
  init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, o);
}

// The same on transport policy `T` (a case that needs one of its own, e.g. Faulty<Tcp, ...>).
template <class T>
void init_on(const RankContext& ctx, RpcBackendOptions o = {}) {
  o.init_method = ctx.file_url();
  distrpc::init_rpc<T>(wname(ctx.rank), ctx.rank, ctx.world, o);
}

// A fresh rendezvous file of this run (for a second init in the same processes).
inline std::string file_url(const RankContext& ctx, const std::string& tag) {
  return "file://" + ctx.dir + "/rendezvous-" + tag;
}

// The text of what fn throws (a c10::Error without its backtrace), empty if it throws nothing.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

inline long long ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               t0)
      .count();
}

// This worker's RRef counter `key` (one of get_debug_info()'s num_* entries).
inline int rref_counter(const char* key) {
  return std::stoi(distrpc::get_debug_info().at(key));
}

// Polls `pred` every 5 ms until it holds or `limit` passes; whether it held.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// PyTorch's wait_until_pending_futures_and_users_flushed(): no pending future or user RRef here.
inline bool rref_flushed() {
  return eventually([] {
    return rref_counter("num_pending_futures") == 0 && rref_counter("num_pending_users") == 0;
  });
}

// Runs fn, expecting an exception whose dynamic type is exactly E and whose text has `text`.
template <class E, class Fn>
void expect_exact(Fn&& fn, const std::string& text, const std::string& what) {
  INFO("case: " << what);
  try {
    fn();
    FAIL_CHECK("no exception was raised (expected " << demangle(typeid(E).name())
                                                    << " containing \"" << text << "\")");
  } catch (const std::exception& e) {
    CHECK_MESSAGE(typeid(e) == typeid(E), "expected type " << demangle(typeid(E).name()) << ", got "
                                                           << demangle(typeid(e).name()) << ": "
                                                           << e.what());
    CHECK_MESSAGE(contains(e.what(), text), "\"" << e.what() << "\" lacks \"" << text << "\"");
  }
}

}  // namespace distrpc::testing

// The names every RPC suite uses unqualified: one `using namespace distrpc::testing::rpc_names;`
// per file instead of the same list of using-declarations in each.
namespace distrpc::testing::rpc_names {
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using distrpc::Future;
using distrpc::RpcBackendOptions;
using distrpc::RRef;
using distrpc::WorkerInfo;
using distrpc::testing::contains;
using distrpc::testing::error_of;
using distrpc::testing::expect_exact;
using distrpc::testing::file_url;
using distrpc::testing::init;
using distrpc::testing::ms_since;
using distrpc::testing::RankContext;
using distrpc::testing::run_ranks;
using distrpc::testing::RunOptions;
using distrpc::testing::wname;
}  // namespace distrpc::testing::rpc_names
