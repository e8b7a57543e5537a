// Agents a program holds (RpcGroup), tested in one process: two workers of one group live side by
// side, each runs only what its own registry holds (and the library's own functions), a handler
// calls back through the agent that runs it, use() picks the agent of the free functions and of
// RRefs, a held agent works beside the process's init_rpc agent, and diagnostics reach the log
// sink naming the worker, and an agent stopped and destroyed while user threads are inside sends
// and hold RRefs fails their calls with its documented texts and is never touched after it is
// freed (this binary runs under AddressSanitizer in tests/run.sh). Everything runs on loopback
// TCP; every wait is bounded.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>
#include <distrpc/transport/tcp.hpp>

#include "support/error_text.hpp"
#include "support/fresh_url.hpp"

using distrpc::testing::error_text;
using distrpc::testing::fresh_file_url;

using namespace std::chrono_literals;
using distrpc::RpcGroup;
using distrpc::transport::Tcp;

namespace group_test {

std::string whoami() {
  return distrpc::get_worker_info().name;
}
// Runs on one worker and calls `to` back with the free function: through the agent running it.
std::string relay(std::string to) {
  return distrpc::get_worker_info().name + "->" + distrpc::rpc_sync<&whoami>(to);
}
at::Tensor mul(at::Tensor a, at::Tensor b) {
  return a * b;
}
int negate(int x) {
  return -x;
}
int fail_loudly(int x) {
  throw std::runtime_error("fail_loudly got " + std::to_string(x));
}

}  // namespace group_test

namespace {

distrpc::RpcBackendOptions options(const std::string& url) {
  distrpc::RpcBackendOptions o;
  o.init_method = url;
  o.builtin_operators = {"aten::add"};  // every overload of add, nothing else
  o.rpc_timeout = 20s;
  o.init_timeout = 20s;
  return o;
}

// Joins two workers of one group from this process (the joins meet each other, so they run at
// once). `ps` serves `ps_registry`, `trainer` serves `trainer_registry`.
std::pair<RpcGroup, RpcGroup> join_pair(std::shared_ptr<const distrpc::Registry> ps_registry,
                                        std::shared_ptr<const distrpc::Registry> trainer_registry) {
  const auto url = fresh_file_url("group");
  auto ps = std::async(std::launch::async,
                       [&] { return RpcGroup::join<Tcp>("ps", 0, 2, options(url), ps_registry); });
  RpcGroup trainer = RpcGroup::join<Tcp>("trainer", 1, 2, options(url), trainer_registry);
  REQUIRE(ps.wait_for(30s) == std::future_status::ready);
  return {ps.get(), trainer};
}

// Both shut down gracefully, at once (each waits for the other).
void shutdown_pair(RpcGroup& a, RpcGroup& b) {
  auto first = std::async(std::launch::async, [&] { a.shutdown(); });
  b.shutdown();
  REQUIRE(first.wait_for(30s) == std::future_status::ready);
  first.get();
}

}  // namespace

TEST_CASE("RpcGroup: two agents in one process, each serving its own registry") {
  auto ps_registry = std::make_shared<distrpc::Registry>();
  ps_registry->add<&group_test::whoami>();
  ps_registry->add<&group_test::relay>();
  ps_registry->add<&group_test::mul>();
  auto trainer_registry = std::make_shared<distrpc::Registry>();
  trainer_registry->add<&group_test::whoami>();
  auto pair = join_pair(ps_registry, trainer_registry);
  RpcGroup& ps = pair.first;
  RpcGroup& trainer = pair.second;

  CHECK_FALSE(distrpc::is_initialized());  // no process agent: only the held ones
  CHECK(ps.get_worker_info().name == "ps");
  CHECK(trainer.get_worker_info().name == "trainer");
  CHECK(trainer.get_worker_info("ps").id == 0);
  CHECK(ps.get_worker_infos().size() == 2);

  // Typed calls, sync and async, and a handler that calls back with the free function: it goes
  // through the agent running it (ps), to the trainer, whose handler names itself.
  auto x = at::arange(4, at::kFloat);
  CHECK(at::equal(trainer.rpc_sync<&group_test::mul>("ps", x, x), x * x));
  auto f = trainer.rpc_async<&group_test::whoami>(0);
  CHECK(f.value() == "ps");
  CHECK(trainer.rpc_sync<&group_test::relay>("ps", std::string("trainer")) == "ps->trainer");

  // What the callee's registry does not hold is refused there, even though this process
  // registered it elsewhere (the call site registers into the process's registry).
  const std::string refused =
      error_text<std::exception>([&] { (void)trainer.rpc_sync<&group_test::negate>("ps", 3); });
  CHECK(refused.find("function 'group_test::negate' is not registered on WorkerInfo(id=0, "
                     "name=ps)") != std::string::npos);
  const std::string refused_back =
      error_text<std::exception>([&] { (void)ps.rpc_sync<&group_test::mul>("trainer", x, x); });
  CHECK(refused_back.find("function 'group_test::mul' is not registered on WorkerInfo(id=1, "
                          "name=trainer)") != std::string::npos);

  // The library's own functions are served whatever the registry: builtin operators, those the
  // callee allows.
  auto sum = trainer.rpc_sync("ps", "aten::add.Tensor", {at::ones({2}), at::ones({2})});
  CHECK(at::equal(sum.toTensor(), at::full({2}, 2.0f)));
  CHECK(error_text<std::exception>([&] {
          (void)trainer.rpc_sync("ps", "aten::mul.Tensor", {x, x});
        }) ==
        "builtin operator 'aten::mul.Tensor' is not allowed on WorkerInfo(id=0, name=ps): a "
        "worker runs only the operators listed in its RpcBackendOptions::builtin_operators (e.g. "
        "{\"aten::mul\"}, or \"*\" for any)");

  // The group protocol runs per agent.
  auto gathered = std::async(std::launch::async, [&] { return ps.all_gather(10); });
  auto mine = trainer.all_gather(11);
  REQUIRE(gathered.wait_for(30s) == std::future_status::ready);
  CHECK(gathered.get() == std::map<std::string, int>{{"ps", 10}, {"trainer", 11}});
  CHECK(mine == std::map<std::string, int>{{"ps", 10}, {"trainer", 11}});

  // The free functions on this thread have no agent until use() names one.
  CHECK(error_text<std::exception>([] {
          (void)distrpc::get_worker_info();
        }).find("Current RPC agent is not set") != std::string::npos);
  {
    const auto current = trainer.use();
    CHECK(distrpc::get_worker_info().name == "trainer");
    CHECK(distrpc::rpc_sync<&group_test::whoami>("ps") == "ps");
    // RRefs follow the current agent: the trainer makes one owned by ps and fetches it.
    auto r = distrpc::remote<&group_test::mul>("ps", x, x);
    CHECK(r.owner_name() == "ps");
    CHECK(at::equal(r.to_here(), x * x));
  }
  CHECK(error_text<std::exception>([] {
          (void)distrpc::get_worker_info();
        }).find("Current RPC agent is not set") != std::string::npos);

  shutdown_pair(ps, trainer);
  CHECK(ps.is_shut_down());
  const std::string after =
      error_text<std::exception>([&] { (void)trainer.rpc_sync<&group_test::whoami>("ps"); });
  CHECK(after ==
        "RPC has not been initialized: the agent was shut down (RpcGroup::shutdown() was called)");
  CHECK(error_text<std::exception>([&] { trainer.shutdown(); }) == after);
}

TEST_CASE("RpcGroup: a held agent beside the process's init_rpc agent") {
  const auto url = fresh_file_url("group");
  // The process's agent (worker "main") and a held one ("side") form one group of two.
  auto side = std::async(std::launch::async,
                         [&] { return RpcGroup::join<Tcp>("side", 1, 2, options(url)); });
  distrpc::init_rpc<Tcp>("main", 0, 2, options(url));
  REQUIRE(side.wait_for(30s) == std::future_status::ready);
  RpcGroup g = side.get();

  CHECK(distrpc::get_worker_info().name == "main");
  CHECK(g.get_worker_info().name == "side");
  CHECK(distrpc::rpc_sync<&group_test::whoami>("side") == "side");
  CHECK(g.rpc_sync<&group_test::whoami>("main") == "main");
  CHECK(distrpc::rpc_sync<&group_test::relay>("side", std::string("main")) == "side->main");
  {
    const auto current = g.use();  // this thread's free functions go to "side" meanwhile
    CHECK(distrpc::get_worker_info().name == "side");
  }
  CHECK(distrpc::get_worker_info().name == "main");

  auto held = std::async(std::launch::async, [&] { g.shutdown(); });
  distrpc::shutdown();
  REQUIRE(held.wait_for(30s) == std::future_status::ready);
  held.get();
  CHECK_FALSE(distrpc::is_initialized());
}

TEST_CASE("Diagnostics go to the log sink, naming the worker; an empty sink restores the default") {
  struct Line {
    distrpc::LogLevel level;
    std::string who, text;
  };
  std::mutex mu;
  std::vector<Line> lines;
  distrpc::set_log_sink([&](distrpc::LogLevel level, std::string_view who, std::string_view text) {
    std::lock_guard<std::mutex> lk(mu);
    lines.push_back({level, std::string(who), std::string(text)});
  });
  auto registry = std::make_shared<distrpc::Registry>();
  registry->add<&group_test::fail_loudly>();
  auto pair = join_pair(registry, registry);
  RpcGroup& ps = pair.first;
  RpcGroup& trainer = pair.second;
  const std::string error = error_text<std::exception>(
      [&] { (void)trainer.rpc_sync<&group_test::fail_loudly>("ps", 7); });
  CHECK(error.find("fail_loudly got 7") != std::string::npos);
  shutdown_pair(ps, trainer);
  distrpc::set_log_sink(nullptr);

  // The callee logged the handler's error, once, naming itself.
  std::lock_guard<std::mutex> lk(mu);
  int found = 0;
  for (const auto& l : lines) {
    if (l.who == "ps" && l.text.find("'group_test::fail_loudly' called by worker 1 raised") == 0 &&
        l.text.find("fail_loudly got 7") != std::string::npos) {
      CHECK(l.level == distrpc::LogLevel::warning);
      ++found;
    }
  }
  CHECK(found == 1);
}

namespace group_test {
int exposed_triple(int x) {
  return 3 * x;
}
int called_only(int x) {
  return x + 1;
}
}  // namespace group_test
DISTRPC_REGISTER(group_test::exposed_triple);

TEST_CASE("Who can call what: serve_exposed_only, and no builtin operators by default") {
  const auto url = fresh_file_url("group");
  auto strict = [&] {
    auto o = options(url);
    o.serve_exposed_only = true;
    o.builtin_operators.clear();  // the default: none
    return o;
  };
  auto server =
      std::async(std::launch::async, [&] { return RpcGroup::join<Tcp>("server", 0, 2, strict()); });
  RpcGroup client = RpcGroup::join<Tcp>("client", 1, 2, options(url));
  REQUIRE(server.wait_for(30s) == std::future_status::ready);
  RpcGroup s = server.get();

  // Exposed with DISTRPC_REGISTER: served. Registered only because this binary calls it: refused.
  CHECK(client.rpc_sync<&group_test::exposed_triple>("server", 5) == 15);
  CHECK(error_text<std::exception>(
            [&] { (void)client.rpc_sync<&group_test::called_only>("server", 5); }) ==
        "function 'group_test::called_only' is not exposed on WorkerInfo(id=0, name=server): this "
        "worker serves only the functions it exposes (RpcBackendOptions::serve_exposed_only); "
        "expose it there with DISTRPC_REGISTER(group_test::called_only)");
  // The default worker (the client) serves both.
  CHECK(s.rpc_sync<&group_test::called_only>("client", 5) == 6);
  // No operator by name on a worker that lists none; the library's own functions still work.
  CHECK(error_text<std::exception>([&] {
          (void)client.rpc_sync("server", "aten::add.Tensor", {1, 2});
        })
            .find("builtin operator 'aten::add.Tensor' is not allowed on WorkerInfo(id=0, "
                  "name=server)") == 0);
  auto both = std::async(std::launch::async, [&] { return s.all_gather(std::string("s")); });
  CHECK(client.all_gather(std::string("c")).size() == 2);
  REQUIRE(both.wait_for(30s) == std::future_status::ready);
  CHECK(both.get().at("client") == "c");
  shutdown_pair(s, client);
}

namespace {

// The documented failures of a call made while (or after) its agent stops and is destroyed:
// RpcGroup's own refusal once shut down, the stopped agent's refusals ("RPC agent of W is shut
// down: ...", "... shut down before the reply", "... is shutting down: ..."), call()'s refusal on
// a stopped agent, and to_here() on a user RRef the stop released; to_here() of an RRef whose
// creation failed so names the creation around it.
bool shut_down_text(const std::string& e) {
  const std::string creation = "Error occurred during RRef creation of ";
  const std::string via = " via distrpc::remote() on WorkerInfo(id=0, name=ps): ";
  if (e.rfind(creation, 0) == 0 && e.find(via) != std::string::npos) {
    return shut_down_text(e.substr(e.find(via) + via.size()));
  }
  const std::string agent = "RPC agent of WorkerInfo(id=1, name=trainer) ";
  const std::string deleted = "has been deleted. Cannot call to_here() on it after deletion.";
  return e == "RPC has not been initialized: the agent was shut down (RpcGroup::shutdown() was "
              "called)" ||
         (e.rfind(agent, 0) == 0 && (e.find(" is shut down: ") == agent.size() - 1 ||
                                     e == agent + "shut down before the reply" ||
                                     e.find(" is shutting down: ") == agent.size() - 1)) ||
         e.rfind("RPC has not been initialized or has been shut down: cannot call ", 0) == 0 ||
         (e.rfind("User RRef with RRefId=", 0) == 0 && e.size() > deleted.size() &&
          e.compare(e.size() - deleted.size(), deleted.size(), deleted) == 0);
}

// What one user thread did while the agent went: every call it issued either completed with the
// right value or failed with a documented text.
struct SendLoad {
  int issued = 0;
  int completed = 0;
  int failed = 0;
  std::vector<std::string> unexpected;  // failures with any other text

  void fail(const std::string& e) {
    ++failed;
    if (!shut_down_text(e)) unexpected.push_back(e);
  }
  // A call's future: bounded wait (none may hang), then its value or its documented error.
  void settle(distrpc::Future<int>& f, int expected) {
    if (!f.wait_for(30s)) {
      unexpected.push_back("a call's future did not complete within 30 s");
      return;
    }
    try {
      const int v = f.value();
      if (v == expected) {
        ++completed;
      } else {
        unexpected.push_back("wrong value " + std::to_string(v));
      }
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }
};

}  // namespace

TEST_CASE("An agent stopped and destroyed while user threads are inside sends") {
  auto registry = std::make_shared<distrpc::Registry>();
  registry->add<&group_test::negate>();
  auto pair = join_pair(registry, registry);
  RpcGroup& ps = pair.first;
  RpcGroup& trainer = pair.second;
  std::weak_ptr<distrpc::RpcAgent> agent = trainer.agent();

  // Held across the agent's destruction, as a user thread inside an RRef operation holds it: the
  // RRef bookkeeping then outlives the agent, and must not reach it any more.
  auto rrefs = distrpc::detail::rref_context_of(*trainer.agent());
  distrpc::RRef<int> user_ref;
  distrpc::RRef<int> owned_ref;
  {
    const auto current = trainer.use();
    user_ref = distrpc::remote<&group_test::negate>("ps", 5);
    CHECK(user_ref.to_here() == -5);
    owned_ref = distrpc::RRef<int>(7);
  }

  constexpr int kThreads = 4;
  std::atomic<bool> stop{false};
  std::vector<SendLoad> loads(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      SendLoad& load = loads[t];
      // Calls and RRefs still in flight, settled and dropped after the agent is gone (RRef
      // destructors then run late, on this user thread).
      std::vector<std::pair<distrpc::Future<int>, int>> calls;
      std::vector<std::pair<distrpc::RRef<int>, int>> refs;
      for (int i = 1; !stop.load(); ++i) {
        const int x = t * 1000000 + i;
        ++load.issued;
        try {
          calls.emplace_back(trainer.rpc_async<&group_test::negate>("ps", x), -x);
        } catch (const std::exception& e) {
          load.fail(e.what());
        }
        ++load.issued;
        try {
          const auto current = trainer.use();
          refs.emplace_back(distrpc::remote<&group_test::negate>("ps", x), -x);
        } catch (const std::exception& e) {
          load.fail(e.what());
        }
        // A remote() is settled by its to_here(): some at once, then dropped (a delete sent from
        // this thread), the others at the end.
        if (i % 3 == 0 && !refs.empty()) {
          auto [r, expected] = std::move(refs.back());
          refs.pop_back();
          try {
            const int v = r.to_here(30s);
            if (v == expected) {
              ++load.completed;
            } else {
              load.unexpected.push_back("wrong to_here() value " + std::to_string(v));
            }
          } catch (const std::exception& e) {
            load.fail(e.what());
          }
        }
        if (calls.size() > 64) {
          load.settle(calls.front().first, calls.front().second);
          calls.erase(calls.begin());
        }
      }
      for (auto& [f, expected] : calls) load.settle(f, expected);
      for (auto& [r, expected] : refs) {
        try {
          const int v = r.to_here(30s);
          if (v == expected) {
            ++load.completed;
          } else {
            load.unexpected.push_back("wrong to_here() value " + std::to_string(v));
          }
        } catch (const std::exception& e) {
          load.fail(e.what());
        }
      }
      refs.clear();  // the last destructors, after the agent is gone
    });
  }

  std::this_thread::sleep_for(300ms);  // calls flowing
  trainer.shutdown(/*graceful=*/false);
  // The agent goes with the last user thread that held it inside a call.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (!agent.expired() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  REQUIRE(agent.expired());
  std::this_thread::sleep_for(100ms);  // user threads keep calling into the destroyed agent
  stop = true;
  for (auto& th : threads) th.join();

  int issued = 0;
  int completed = 0;
  int failed = 0;
  for (const auto& load : loads) {
    issued += load.issued;
    completed += load.completed;
    failed += load.failed;
    for (const auto& e : load.unexpected) FAIL_CHECK("unexpected: " << e);
  }
  MESSAGE(issued << " calls issued: " << completed << " completed, " << failed << " failed");
  CHECK(issued == completed + failed);
  CHECK(completed > 0);  // calls went through before the stop
  CHECK(failed > 0);     // and were refused after it

  // The bookkeeping held past the agent: every operation fails with the agent's own text or
  // works locally, none reaches the freed agent.
  REQUIRE(rrefs != nullptr);
  CHECK(error_text<std::exception>([&] { (void)user_ref.type_name(); }) ==
        "RPC agent of WorkerInfo(id=1, name=trainer) is shut down: type query of " +
            user_ref.str() + " not sent");
  CHECK(shut_down_text(error_text<std::exception>([&] { (void)user_ref.to_here(); })));
  CHECK(owned_ref.local_value() == 7);
  CHECK(owned_ref.to_here() == 7);
  user_ref = {};  // the user RRef's destructor: nothing is sent, nothing is touched
  owned_ref = {};
  rrefs.reset();
  ps.shutdown(/*graceful=*/false);
}
