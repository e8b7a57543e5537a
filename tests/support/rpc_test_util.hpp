// What the multi-process RPC suites (test_rpc.cpp, test_rref.cpp, test_remote_module.cpp) share:
// worker names, the per-case init, extra rendezvous files, and an exact-exception check.
// Header-only; every suite runs on the transport under test (rpc_under_test.hpp).
#pragma once

#include <chrono>
#include <string>
#include <typeinfo>

#include <doctest/doctest.h>

#include <distrpc/rpc_error.hpp>
#include <distrpc/options.hpp>

#include "multiprocess.hpp"
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

// A fresh rendezvous file of this run (for a second init in the same processes).
inline std::string file_url(const RankContext& ctx, const std::string& tag) {
  return "file://" + ctx.dir + "/rendezvous-" + tag;
}

inline bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

inline long long ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               t0)
      .count();
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
