// Distributed autograd: contexts, send/recv recording, the distributed backward pass, cleanup,
// errors and node failure — the acceptance scenarios of PyTorch's dist_autograd_test.py, run on
// fresh worker processes (worker{rank}, a file:// rendezvous) on the transport under test.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <doctest/doctest.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <distrpc/dist_autograd.hpp>
#include <distrpc/nn/remote_module.hpp>
#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>
#include <distrpc/torch_compat.hpp>
#include <distrpc/transport/faulty.hpp>
#include <distrpc/transport/tcp.hpp>

#include "multiprocess.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"

using namespace distrpc::testing::rpc_names;
namespace da = distrpc::dist_autograd;

namespace {

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.scalar_type() == b.scalar_type() &&
         a.sizes() == b.sizes() && at::allclose(a.to_dense(), b.to_dense());
}

// The gradient of `leaf` in context `id` on this worker (undefined when it has none).
at::Tensor grad_of(std::int64_t id, const at::Tensor& leaf) {
  auto grads = da::get_gradients(id);
  auto it = grads.find(leaf);
  return it == grads.end() ? at::Tensor() : it->value();
}

}  // namespace

// ---- functions run remotely -------------------------------------------------------------------

namespace ag_test {

at::Tensor add(at::Tensor a, at::Tensor b) {
  return a + b;
}
at::Tensor mul(at::Tensor a, at::Tensor b) {
  return a * b;
}
at::Tensor matmul(at::Tensor a, at::Tensor b) {
  return at::matmul(a, b);
}
at::Tensor ones_like_of(at::Tensor a) {
  return at::ones_like(a);
}
at::Tensor returns_new_leaf(int n) {
  return at::ones({n, n}).requires_grad_(true);
}
std::vector<at::Tensor> add_and_mul(std::vector<at::Tensor> t) {
  return {t[0] + t[1], t[0] * t[1]};
}
bool requires_grad_of(at::Tensor a) {
  return a.requires_grad();
}
std::tuple<at::Tensor, at::Tensor> mixed_dtypes(at::Tensor f, at::Tensor d) {
  return {f * 2, d * 3};
}

// Nested: worker `next` does the add, called from the callee.
at::Tensor nested_add(std::string next, at::Tensor a, at::Tensor b) {
  return distrpc::rpc_sync<&add>(next, a, b) * 2;
}

// A skip connection around a nested call: 4h from worker `next`, plus h itself. Two passes here
// reach the recv function of h (the reply's, and the nested call's when its gradients come back),
// so the caller's send function of h gets gradients twice, in two messages.
at::Tensor skip_around(std::string next, at::Tensor h) {
  return distrpc::rpc_sync<&add>(next, h * 2, h * 2) + h;
}
// The counts of context `id` on this worker: (sends, recvs, known workers).
std::tuple<int, int, std::vector<int>> counts(std::int64_t id) {
  auto c = da::retrieve_context(id);
  const std::set<int> ids = c->known_worker_ids();
  std::vector<int> known(ids.begin(), ids.end());
  return {static_cast<int>(c->send_functions().size()),
          static_cast<int>(c->recv_functions().size()), known};
}
bool has_context(std::int64_t id) {
  return da::has_context(id);
}
int num_gradients(std::int64_t id) {
  return static_cast<int>(da::get_gradients(id).size());
}
std::int64_t current_id() {
  return da::current_context()->context_id();
}

// A backward function that fails while `fail` is set (scenario 12).
std::atomic<bool> fail_backward{false};
struct FailingFn : torch::autograd::Function<FailingFn> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x * 1; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    if (fail_backward.load()) throw std::runtime_error("Simulate error on backward pass");
    return g;
  }
};
at::Tensor failing(at::Tensor x) {
  return FailingFn::apply(x);
}
void set_fail(bool f) {
  fail_backward.store(f);
}

// A hook on the tensor the request brought (its gradient doubled on the callee), then an interior
// node (x * 3) or none (x itself) between it and the reply.
at::Tensor hooked_times3(at::Tensor x) {
  x.register_hook([](at::Tensor g) { return g * 2; });
  return x * 3;
}
at::Tensor hooked_identity(at::Tensor x) {
  x.register_hook([](at::Tensor g) { return g * 2; });
  return x;
}

// The calls this worker made so far (control calls of the layers included).
std::uint64_t calls_sent() {
  return std::stoull(distrpc::get_debug_info().at("num_client_calls"));
}

}  // namespace ag_test

// ---- 1. contexts -------------------------------------------------------------------------------

DISTRPC_MP_TEST("dist autograd: context ids, retrieval, nesting and release (scenario 1)", 2, 60) {
  init(ctx);
  if (ctx.rank == 1) {
    CHECK(da::max_context_id() == 562949953421311LL);
    std::vector<std::int64_t> ids;
    for (int i = 0; i < 200; ++i) {
      da::Context c;
      CHECK((c.id() >> 48) == 1);
      CHECK(da::retrieve_context(c.id())->context_id() == c.id());
      CHECK(da::current_context()->context_id() == c.id());
      ids.push_back(c.id());
      CHECK(contains(error_of([] { da::Context nested; }),
                     "Already have an autograd context id for this thread"));
    }
    CHECK(ids.front() == (std::int64_t{1} << 48));
    for (auto id : ids) {
      CHECK(error_of([&] { da::retrieve_context(id); }) ==
            "Could not find autograd context with id: " + std::to_string(id));
    }
    CHECK(
        contains(error_of([] { da::current_context(); }), "doesn't have a valid autograd context"));
    CHECK(error_of([] { da::backward(100, {torch::ones({1}, torch::requires_grad()).sum()}); }) ==
          "Could not find autograd context with id: 100");
    // new_context / release_context without a scope.
    const auto id = da::new_context();
    CHECK(da::current_context()->context_id() == id);
    da::release_context(id);
    CHECK_FALSE(da::has_context(id));
    CHECK(
        contains(error_of([] { da::current_context(); }), "doesn't have a valid autograd context"));
    CHECK(contains(error_of([&] { da::release_context(id); }), "Could not find autograd context"));
  }
  distrpc::shutdown();
}

// ---- 2-6. simple calls: gradients, graph shapes, counts ----------------------------------------

DISTRPC_MP_TEST(
    "dist autograd: add and mul over rpc_sync, rpc_async, remote().to_here() and to self; graph "
    "shapes and counts (scenarios 2, 3) on every transport",
    2, 90) {
  init(ctx);
  if (ctx.rank == 0) {
    for (const std::string dst : {"worker1", "worker0"}) {
      for (int path = 0; path < 3; ++path) {
        INFO("dst " << dst << " path " << path);
        da::Context c;
        at::Tensor t1 = torch::ones({3, 3}, torch::requires_grad());
        at::Tensor t2 = torch::zeros({3, 3}, torch::requires_grad());
        at::Tensor ret;
        if (path == 0) ret = distrpc::rpc_sync<&ag_test::add>(dst, t1, t2);
        if (path == 1) ret = distrpc::rpc_async<&ag_test::add>(dst, t1, t2).value();
        if (path == 2) ret = distrpc::remote<&ag_test::add>(dst, t1, t2).to_here();
        REQUIRE(ret.grad_fn());
        auto cc = da::current_context();
        if (dst == "worker1") {
          CHECK(ret.grad_fn()->name() == "torch::distributed::autograd::RecvRpcBackward");
          CHECK(cc->send_functions().size() == 1);
          CHECK(cc->recv_functions().size() == 1);
          auto send = cc->send_functions().begin()->second;
          CHECK(send->name() == "torch::distributed::autograd::SendRpcBackward");
          REQUIRE(send->next_edges().size() == 2);
          CHECK(send->next_edges()[0].function->name() == "torch::autograd::AccumulateGrad");
          CHECK(send->next_edges()[0].input_nr == 0);
          CHECK(cc->known_worker_ids() == std::set<int>{1});
          auto [s, r, known] = distrpc::rpc_sync<&ag_test::counts>(dst, c.id());
          CHECK(s == 1);
          CHECK(r == 1);
          CHECK(known == std::vector<int>{0});
        } else if (path != 2) {
          // To itself: caller and callee share the context (a send and a recv each way), as in
          // PyTorch. remote() to self keeps the value local: to_here() carries nothing.
          CHECK(cc->send_functions().size() == 2);
          CHECK(cc->recv_functions().size() == 2);
          CHECK(cc->known_worker_ids() == std::set<int>{0});
        }
        da::backward(c.id(), {ret.sum()});
        CHECK(same(grad_of(c.id(), t1), at::ones({3, 3})));
        CHECK(same(grad_of(c.id(), t2), at::ones({3, 3})));
        CHECK_FALSE(t1.grad().defined());
        CHECK_FALSE(t2.grad().defined());
      }
    }
    // Mul: t1 = 2, t2 = 3 -> {t1: 3, t2: 2}.
    da::Context c;
    at::Tensor t1 = (at::ones({3, 3}) * 2).requires_grad_(true);
    at::Tensor t2 = (at::ones({3, 3}) * 3).requires_grad_(true);
    auto ret = distrpc::rpc_sync<&ag_test::mul>("worker1", t1, t2);
    da::backward(c.id(), {ret.sum()});
    CHECK(same(grad_of(c.id(), t1), at::ones({3, 3}) * 3));
    CHECK(same(grad_of(c.id(), t2), at::ones({3, 3}) * 2));
    CHECK(da::get_gradients(c.id()).size() == 2);
  }
  distrpc::shutdown();
}

DISTRPC_MP_TEST(
    "dist autograd: no graph without grad tensors; mixed dtypes; mixed requires_grad; gradient "
    "only on the return value; 10 tensors of which 5 require grad (scenarios 4-6)",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    {
      da::Context c;
      auto ret = distrpc::rpc_sync<&ag_test::add>("worker1", at::ones({2}), at::ones({2}));
      CHECK_FALSE(ret.requires_grad());
      CHECK(da::current_context()->send_functions().empty());
      CHECK(da::current_context()->recv_functions().empty());
      // The context id still travels: the callee has the context.
      CHECK(distrpc::rpc_sync<&ag_test::has_context>("worker1", c.id()));
      CHECK(da::current_context()->known_worker_ids() == std::set<int>{1});
    }
    {
      da::Context c;
      at::Tensor f = torch::ones({2}, torch::requires_grad());
      at::Tensor d = torch::ones({2}, torch::dtype(torch::kDouble).requires_grad(true));
      auto [a, b] = distrpc::rpc_sync<&ag_test::mixed_dtypes>("worker1", f, d);
      da::backward(c.id(), {a.sum() + b.sum().to(at::kFloat)});
      CHECK((grad_of(c.id(), f).scalar_type() == at::kFloat));
      CHECK((grad_of(c.id(), d).scalar_type() == at::kDouble));
      CHECK(same(grad_of(c.id(), f), at::full({2}, 2.0)));
      CHECK(same(grad_of(c.id(), d), at::full({2}, 3.0, at::kDouble)));
    }
    {
      da::Context c;
      at::Tensor t1 = torch::ones({2}, torch::requires_grad());
      at::Tensor t2 = at::ones({2});
      CHECK_FALSE(distrpc::rpc_sync<&ag_test::requires_grad_of>("worker1", t2));
      CHECK(distrpc::rpc_sync<&ag_test::requires_grad_of>("worker1", t1));
      auto ret = distrpc::rpc_sync<&ag_test::mul>("worker1", t1, t2);
      da::backward(c.id(), {ret.sum()});
      auto g = da::get_gradients(c.id());
      CHECK(g.size() == 1);
      CHECK(same(grad_of(c.id(), t1), at::ones({2})));
    }
    {
      da::Context c;
      auto ret = distrpc::rpc_sync<&ag_test::returns_new_leaf>("worker1", 3);
      REQUIRE(ret.requires_grad());
      CHECK(da::current_context()->send_functions().empty());
      CHECK(da::current_context()->recv_functions().size() == 1);
      da::backward(c.id(), {ret.sum()});
      CHECK(distrpc::rpc_sync<&ag_test::num_gradients>("worker1", c.id()) == 1);
    }
    {
      da::Context c;
      std::vector<at::Tensor> ten;
      for (int i = 0; i < 10; ++i)
        ten.push_back(i % 2 == 0 ? torch::ones({1}, torch::requires_grad()) : at::ones({1}));
      auto out = distrpc::rpc_sync<&ag_test::add_and_mul>("worker1", ten);
      (void)out;
      auto sends = da::current_context()->send_functions();
      REQUIRE(sends.size() == 1);
      CHECK(sends.begin()->second->next_edges().size() == 5);
    }
  }
  distrpc::shutdown();
}

// ---- 9. accumulation and retain_graph; 1.12 unused send completes ------------------------------

DISTRPC_MP_TEST(
    "dist autograd: accumulation over passes, 1000 retained passes, second pass without "
    "retain_graph fails, an unused RPC result does not hang backward (scenario 9, §1.12)",
    2, 120) {
  init(ctx);
  if (ctx.rank == 0) {
    {
      da::Context c;
      at::Tensor t1 = torch::ones({3, 3}, torch::requires_grad());
      at::Tensor t2 = torch::ones({3, 3}, torch::requires_grad());
      auto loss = distrpc::rpc_sync<&ag_test::mul>("worker1", t1, t2).exp().sum();
      for (int i = 0; i < 1000; ++i) da::backward(c.id(), {loss}, /*retain_graph=*/true);
      // Local reference: 1000 passes.
      at::Tensor l1 = t1.detach().requires_grad_(true);
      at::Tensor l2 = t2.detach().requires_grad_(true);
      auto local = (l1 * l2).exp().sum();
      auto g = torch::autograd::grad({local}, {l1}, {}, true)[0] * 1000;
      CHECK(at::allclose(grad_of(c.id(), t1), g, 1e-4, 1e-4));
      da::backward(c.id(), {loss}, /*retain_graph=*/false);
      CHECK(contains(error_of([&] { da::backward(c.id(), {loss}); }),
                     "Trying to backward through the graph a second time"));
      CHECK(contains(error_of([&] { da::backward(c.id(), {loss}); }), "Error on Node "));
    }
    {
      // The result of the second RPC is never used: the pass still completes.
      da::Context c;
      at::Tensor t1 = torch::ones({3, 3}, torch::requires_grad());
      auto used = distrpc::rpc_sync<&ag_test::add>("worker1", t1, t1);
      auto unused = distrpc::rpc_sync<&ag_test::mul>("worker1", t1, t1);
      (void)unused;
      auto local = (t1 * 3).sum();
      da::backward(c.id(), {local});
      CHECK(same(grad_of(c.id(), t1), at::full({3, 3}, 3.0)));
      da::backward(c.id(), {used.sum()});
      CHECK(same(grad_of(c.id(), t1), at::full({3, 3}, 5.0)));
    }
  }
  distrpc::shutdown();
}

// ---- 10. hooks; invalid roots ------------------------------------------------------------------

DISTRPC_MP_TEST(
    "dist autograd: tensor hooks and post hooks apply; root validation texts (§1.4, §1.8)", 2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    {
      da::Context c;
      at::Tensor t1 = torch::ones({3, 3}, torch::requires_grad());
      at::Tensor t2 = torch::ones({3, 3}, torch::requires_grad());
      t1.register_hook([](at::Tensor g) { return g * 2; });
      auto ret = distrpc::rpc_sync<&ag_test::matmul>("worker1", t1, t2);
      da::backward(c.id(), {ret.sum()});
      CHECK(same(grad_of(c.id(), t1), at::full({3, 3}, 6.0)));
      CHECK(same(grad_of(c.id(), t2), at::full({3, 3}, 3.0)));
    }
    {
      da::Context c;
      CHECK(error_of([&] { da::backward(c.id(), {}); }) ==
            "No tensors provided for gradient computation.");
      CHECK(contains(error_of([&] { da::backward(c.id(), {at::ones({1})}); }),
                     "requires_grad not set on"));
      at::Tensor leaf = torch::ones({1}, torch::requires_grad());
      CHECK(contains(error_of([&] { da::backward(c.id(), {(leaf * at::ones({2}))}); }),
                     "is not a scalar, all roots need to be scalar"));
      CHECK(contains(error_of([&] { da::backward(c.id(), {leaf}); }),
                     "does not have a valid gradient function"));
      // Several roots, no RPC at all.
      at::Tensor a = torch::ones({2}, torch::requires_grad());
      da::backward(c.id(), {(a * 2).sum(), (a * 3).sum()});
      CHECK(same(grad_of(c.id(), a), at::full({2}, 5.0)));
      CHECK_FALSE(a.grad().defined());
    }
  }
  distrpc::shutdown();
}

DISTRPC_MP_TEST(
    "dist autograd: a tensor's hooks run once, whether the pass reaches it through the engine or "
    "straight from the message, on leaves and on tensors a message brought",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    auto hooked_leaf = [] {
      at::Tensor t = torch::ones({2, 2}, torch::requires_grad());
      t.register_hook([](at::Tensor g) { return g * 2; });
      return t;
    };
    {  // leaf behind an interior node (t * 1.5) on the caller: the engine runs the pass
      da::Context c;
      at::Tensor t = hooked_leaf();
      auto r = distrpc::rpc_sync<&ag_test::add>("worker1", t * 1.5, t * 1.5);
      da::backward(c.id(), {r.sum()});
      CHECK(same(grad_of(c.id(), t), at::full({2, 2}, 6.0)));  // (1 + 1) * 1.5, doubled once
    }
    {  // leaf sent as it is: the gradient comes straight from the message
      da::Context c;
      at::Tensor t = hooked_leaf();
      auto r = distrpc::rpc_sync<&ag_test::mul>("worker1", t, at::full({2, 2}, 3.0));
      da::backward(c.id(), {r.sum()});
      CHECK(same(grad_of(c.id(), t), at::full({2, 2}, 6.0)));
    }
    {  // a hook the callee put on the tensor it received, behind an interior node there
      da::Context c;
      at::Tensor t = torch::ones({2, 2}, torch::requires_grad());
      auto r = distrpc::rpc_sync<&ag_test::hooked_times3>("worker1", t);
      da::backward(c.id(), {r.sum()});
      CHECK(same(grad_of(c.id(), t), at::full({2, 2}, 6.0)));
    }
    {  // and with the received tensor sent back as it is
      da::Context c;
      at::Tensor t = torch::ones({2, 2}, torch::requires_grad());
      auto r = distrpc::rpc_sync<&ag_test::hooked_identity>("worker1", t);
      da::backward(c.id(), {(r * 5).sum()});
      CHECK(same(grad_of(c.id(), t), at::full({2, 2}, 10.0)));
    }
  }
  distrpc::shutdown();
}

// ---- nested calls over 3 workers; cleanup on every worker --------------------------------------

DISTRPC_MP_TEST(
    "dist autograd: nested calls over 3 workers give the local gradients; leaving the scope "
    "releases the context on every worker, transitively, within 10 s (scenario 13), on every "
    "transport",
    3, 90) {
  init(ctx);
  if (ctx.rank == 0) {
    std::int64_t id = -1;
    at::Tensor t1 = torch::rand({3, 3}, torch::requires_grad());
    at::Tensor t2 = torch::rand({3, 3}, torch::requires_grad());
    {
      da::Context c;
      id = c.id();
      auto ret = distrpc::rpc_sync<&ag_test::nested_add>("worker1", std::string("worker2"), t1, t2);
      da::backward(c.id(), {(ret * ret).sum()});
      at::Tensor l1 = t1.detach().requires_grad_(true);
      at::Tensor l2 = t2.detach().requires_grad_(true);
      auto r = (l1 + l2) * 2;
      (r * r).sum().backward();
      CHECK(same(grad_of(id, t1), l1.grad()));
      CHECK(same(grad_of(id, t2), l2.grad()));
      CHECK(distrpc::rpc_sync<&ag_test::has_context>("worker2", id));
    }
    const auto t0 = Clock::now();
    bool gone = false;
    while (!gone && ms_since(t0) < 10000) {
      gone = !distrpc::rpc_sync<&ag_test::has_context>("worker1", id) &&
             !distrpc::rpc_sync<&ag_test::has_context>("worker2", id);
      if (!gone) std::this_thread::sleep_for(20ms);
    }
    CHECK(gone);
    auto info = da::get_debug_info();
    CHECK(info.size() == 2);
    CHECK(info.at("num_current_backward_passes") == "0");
    CHECK(info.at("num_autograd_contexts") == "0");
  }
  distrpc::shutdown();
}

namespace ag_test {
// Slow enough that the caller's release of its context arrives while this runs.
at::Tensor slow_double(at::Tensor t) {
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  return t * 2;
}
std::string num_contexts() {
  return da::get_debug_info().at("num_autograd_contexts");
}
}  // namespace ag_test

// The caller leaves its context while its call still runs: the release reaches the callee first,
// and the reply, encoded after it, must not make the context there again (nothing would release
// it a second time).
DISTRPC_MP_TEST("dist autograd: a context released while a call in it still runs stays released", 2,
                60) {
  init(ctx);
  if (ctx.rank == 0) {
    std::int64_t id = -1;
    distrpc::Future<at::Tensor> pending;
    {
      da::Context c;
      id = c.id();
      pending = distrpc::rpc_async<&ag_test::slow_double>("worker1",
                                                          torch::ones({2}, torch::requires_grad()));
    }
    CHECK(at::equal(pending.value(), torch::full({2}, 2.0f)));
    CHECK_FALSE(da::has_context(id));
    // The release took effect on worker1 before the reply was encoded, and it was not undone.
    const auto t0 = Clock::now();
    while (distrpc::rpc_sync<&ag_test::num_contexts>("worker1") != "0" && ms_since(t0) < 5000) {
      std::this_thread::sleep_for(20ms);
    }
    CHECK_FALSE(distrpc::rpc_sync<&ag_test::has_context>("worker1", id));
    CHECK(distrpc::rpc_sync<&ag_test::num_contexts>("worker1") == "0");
    // A new context works as before.
    da::Context again;
    at::Tensor x = torch::ones({2}, torch::requires_grad());
    da::backward(again.id(), {distrpc::rpc_sync<&ag_test::slow_double>("worker1", x).sum()});
    CHECK(at::equal(da::get_gradients(again.id()).at(x), torch::full({2}, 2.0f)));
  }
  distrpc::shutdown();
}

// A release waiting for its batch (up to 5 ms) is work under way for the agent: a graceful
// shutdown's join, or a leaving member's wait, does not end before it went out (a member that
// left with a release unsent, its own or one it forwards, leaked that context on the workers that
// stay).
DISTRPC_MP_TEST("dist autograd: a release waiting for its batch counts as the agent's work", 2,
                60) {
  init(ctx);
  if (ctx.rank == 0) {
    const auto pending_steps = [] {
      return std::stoll(distrpc::get_debug_info().at("num_pending_protocol_steps"));
    };
    CHECK(pending_steps() == 0);
    // Read within 4 ms of the scope's end, before the batch goes (the release, once sent,
    // counts as a call until answered, fix or not); a read that came later (the thread was
    // preempted) does not count, so it is tried up to 20 times. The call's own reply counts
    // until its callbacks ran: that is waited out first.
    int seen = 0;
    for (int i = 0; i < 20 && seen == 0; ++i) {
      Clock::time_point released;
      {
        da::Context c;
        (void)distrpc::rpc_sync<&ag_test::slow_double>("worker1",
                                                       torch::ones({2}, torch::requires_grad()));
        const auto t0 = Clock::now();
        while (pending_steps() != 0 && ms_since(t0) < 5000) std::this_thread::yield();
        released = Clock::now();
      }
      const bool pending = pending_steps() >= 1;
      if (Clock::now() - released < 4ms && pending) ++seen;
    }
    CHECK(seen == 1);
    const auto t0 = Clock::now();
    while (pending_steps() != 0 && ms_since(t0) < 5000) std::this_thread::sleep_for(5ms);
    CHECK(pending_steps() == 0);
    while (distrpc::rpc_sync<&ag_test::num_contexts>("worker1") != "0" && ms_since(t0) < 5000) {
      std::this_thread::sleep_for(20ms);
    }
    CHECK(distrpc::rpc_sync<&ag_test::num_contexts>("worker1") == "0");
  }
  distrpc::shutdown();
}

// A worker that made contexts and is lost: the others release its contexts (it never will).
DISTRPC_MP_TEST("dist autograd: the contexts a lost worker made are released on the others", 2,
                60) {
  RpcBackendOptions o;
  o.rpc_timeout = std::chrono::seconds(5);
  init(ctx, o);
  if (ctx.rank == 1) {
    da::Context c;
    (void)distrpc::rpc_sync<&ag_test::add>("worker0", torch::ones({2}, torch::requires_grad()),
                                           torch::ones({2}));
    ctx.publish("context", std::to_string(c.id()));
    ctx.lookup("seen", std::chrono::seconds(20));
    // A call in the context that still runs on worker0 (500 ms) when this worker is gone.
    auto late = distrpc::rpc_async<&ag_test::slow_double>("worker0",
                                                          torch::ones({2}, torch::requires_grad()));
    std::this_thread::sleep_for(100ms);
    _exit(0);
  }
  const std::int64_t id = std::stoll(ctx.lookup("context", std::chrono::seconds(20)));
  CHECK((id >> 48) == 1);
  CHECK(da::has_context(id));
  ctx.publish("seen", "1");
  const auto t0 = Clock::now();
  while (da::has_context(id) && ms_since(t0) < 10000) std::this_thread::sleep_for(20ms);
  CHECK_FALSE(da::has_context(id));
  // The late call's reply, encoded once it ran, does not make the context again.
  std::this_thread::sleep_for(1s);
  CHECK_FALSE(da::has_context(id));
  CHECK(da::get_debug_info().at("num_autograd_contexts") == "0");
  distrpc::shutdown(false);
}

namespace ag_test {
// A parameter of the worker that runs these (made on first use).
const at::Tensor& own_weight() {
  static const at::Tensor w = torch::full({2}, 3.0f, torch::requires_grad());
  return w;
}
at::Tensor times_own_weight(at::Tensor x) {
  return x * own_weight();
}
// The gradient of own_weight() in context `id` here (undefined when it has none).
at::Tensor own_weight_grad(std::int64_t id) {
  return grad_of(id, own_weight());
}
std::string num_contexts_here() {
  return da::get_debug_info().at("num_autograd_contexts");
}
}  // namespace ag_test

// A member of a dynamic group leaves (graceful shutdown) with a context still open, one that
// reached another worker; a new process under its rank then makes contexts with the same ids.
// The others release the leaver's contexts at its leave: the joiner's pass must not add to the
// old pass's gradients.
DISTRPC_MP_TEST("dist autograd: the contexts a leaving worker left open are released on the others",
                2, 90) {
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "leave");
  const at::Tensor x = torch::tensor({1.0f, 2.0f});
  // One step in a context made on a thread of its own, which ends without releasing it; the
  // gradient of worker0's weight in it.
  const auto step = [&x](std::int64_t& id, at::Tensor& weight_grad) {
    std::thread([&] {
      id = da::new_context();
      const at::Tensor y =
          distrpc::rpc_sync<&ag_test::times_own_weight>("worker0", x.clone().requires_grad_(true));
      da::backward(id, {y.sum()});
      weight_grad = distrpc::rpc_sync<&ag_test::own_weight_grad>("worker0", id);
    }).join();
  };
  if (ctx.rank == 0) {
    distrpc::testing::init_rpc_dynamic_under_test("worker0", 0, o);
    ctx.publish("up0", "1");
    ctx.lookup("left1", 30s);
    const auto t0 = Clock::now();
    while (ag_test::num_contexts_here() != "0" && ms_since(t0) < 5000) {
      std::this_thread::sleep_for(20ms);
    }
    CHECK(ag_test::num_contexts_here() == "0");
    ctx.publish("checked0", "1");
    ctx.lookup("done1", 60s);
    distrpc::shutdown();
    return;
  }
  ctx.lookup("up0", 30s);
  distrpc::testing::init_rpc_dynamic_under_test("worker1", 1, o);
  std::int64_t first = -1;
  at::Tensor first_grad;
  step(first, first_grad);
  CHECK(same(first_grad, x));
  distrpc::shutdown();  // the context stays open
  ctx.publish("left1", "1");
  ctx.lookup("checked0", 30s);
  // The same process joins again under its rank: its new agent counts context ids from 0 again.
  distrpc::testing::init_rpc_dynamic_under_test("worker1", 1, o);
  std::int64_t second = -1;
  at::Tensor second_grad;
  step(second, second_grad);
  CHECK(second == first);
  CHECK_MESSAGE(same(second_grad, x), "worker0's weight gradient: " << second_grad);
  da::release_context(second);
  ctx.publish("done1", "1");
  distrpc::shutdown();
}

namespace ag_test {
at::Tensor same(at::Tensor t) {
  return t;
}
int nap(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
}  // namespace ag_test

// The root's waiting thread runs the pass of gradients that came back (x's, from the first
// call); x's hook waits on an RPC meanwhile, and the second call's gradients for x arrive during
// that wait. They must not run on that thread too, which holds the context's pass lock: they
// run once the first pass is done.
DISTRPC_MP_TEST("dist autograd: a hook that waits on an RPC while more gradients arrive", 2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    std::atomic<int> hooked{0};
    at::Tensor x = torch::ones({3}, torch::requires_grad());
    x.register_hook([&hooked](at::Tensor g) {
      if (hooked.fetch_add(1) == 0) CHECK(distrpc::rpc_sync<&ag_test::nap>("worker1", 200) == 200);
      return g;
    });
    da::Context c;
    const at::Tensor y1 = distrpc::rpc_sync<&ag_test::same>("worker1", x);
    const at::Tensor y2 = distrpc::rpc_sync<&ag_test::same>("worker1", x);
    auto done = std::async(std::launch::async, [&] { da::backward(c.id(), {(y1 + y2).sum()}); });
    if (done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      // Stuck for good (the future would wait for it when destroyed): fail the process.
      std::fprintf(stderr, "backward did not return within 20 s\n");
      std::_Exit(3);
    }
    done.get();
    CHECK(hooked.load() == 2);
    CHECK(at::equal(da::get_gradients(c.id()).at(x), torch::full({3}, 2.0f)));
  }
  distrpc::shutdown();
}

// ---- 12. errors during backward ----------------------------------------------------------------

DISTRPC_MP_TEST(
    "dist autograd: an error in a remote backward function fails backward with 'Error on Node N', "
    "the context and the retained graph survive; a failing forward RPC (scenario 12)",
    2, 90) {
  init(ctx);
  if (ctx.rank == 0) {
    da::Context c;
    at::Tensor t = torch::ones({2}, torch::requires_grad());
    auto loss = distrpc::rpc_sync<&ag_test::failing>("worker1", t).sum();
    distrpc::rpc_sync<&ag_test::set_fail>("worker1", true);
    for (int i = 0; i < 100; ++i) {
      if (i == 50) distrpc::rpc_sync<&ag_test::set_fail>("worker1", false);
      const std::string e = error_of([&] { da::backward(c.id(), {loss}, true); });
      if (i < 50) {
        CHECK(contains(e, "Error on Node 1: "));
        CHECK(contains(e, "Simulate error on backward pass"));
      } else {
        CHECK(e.empty());
      }
    }
    CHECK(same(grad_of(c.id(), t), at::full({2}, 50.0)));
    CHECK(contains(error_of([&] {
                     distrpc::rpc_sync<&ag_test::matmul>(
                         "worker1", torch::ones({3, 3}, torch::requires_grad()), at::ones({6, 6}));
                   }),
                   "mat1 and mat2 shapes cannot be multiplied"));
  }
  distrpc::shutdown();
}

DISTRPC_MP_TEST(
    "dist autograd: gradients that come back to the root from another worker cost that worker no "
    "call (they get no answer); an error in the root's pass on them fails backward with 'Error on "
    "Node 0', and the next pass in the context succeeds",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    at::Tensor t = torch::ones({2}, torch::requires_grad());
    at::Tensor u = torch::full({2}, 3.0, torch::requires_grad());
    const std::uint64_t before = distrpc::rpc_sync<&ag_test::calls_sent>("worker1");
    for (int i = 0; i < 5; ++i) {
      da::Context c;
      da::backward(c.id(), {distrpc::rpc_sync<&ag_test::mul>("worker1", t, u).sum()});
      CHECK(same(grad_of(c.id(), t), u.detach()));
      CHECK(same(grad_of(c.id(), u), t.detach()));
    }
    // Worker 1 sent five gradients messages back and made no call for them (an answer would have
    // cost each a call, so five).
    CHECK(distrpc::rpc_sync<&ag_test::calls_sent>("worker1") == before);

    // Here, FailingFn's backward runs in the root's pass on the gradients worker 1 sent back.
    da::Context c;
    auto loss = distrpc::rpc_sync<&ag_test::mul>("worker1", ag_test::failing(t), u).sum();
    ag_test::set_fail(true);
    const std::string e = error_of([&] { da::backward(c.id(), {loss}, true); });
    CHECK_MESSAGE(contains(e, "Error on Node 0: "), e);
    CHECK(contains(e, "Simulate error on backward pass"));
    ag_test::set_fail(false);
    CHECK(error_of([&] { da::backward(c.id(), {loss}); }).empty());
    CHECK(same(grad_of(c.id(), t), u.detach()));
  }
  distrpc::shutdown();
}

// ---- RemoteModule forward inside a context -----------------------------------------------------

namespace ag_test {
struct LinearIface {
  virtual ~LinearIface() = default;
  virtual at::Tensor forward(at::Tensor x) = 0;
};
}  // namespace ag_test

DISTRPC_MP_TEST(
    "dist autograd: RemoteModule forward; gradients of the module's parameters land on the owner "
    "in the same context, on every transport",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    auto rm = distrpc::nn::RemoteModule<ag_test::LinearIface>::create<torch::nn::Linear>(
        "worker1/cpu", 4, 3);
    at::Tensor x = torch::rand({2, 4}, torch::requires_grad());
    da::Context c;
    auto y = rm.forward(x);
    da::backward(c.id(), {y.sum()});
    auto params = rm.remote_parameters();
    REQUIRE(params.size() == 2);
    // x's gradient = ones(2,3) @ W.
    at::Tensor w = params[0].to_here();
    CHECK(at::allclose(grad_of(c.id(), x), at::ones({2, 3}).matmul(w)));
    CHECK(distrpc::rpc_sync<&ag_test::num_gradients>("worker1", c.id()) == 2);
  }
  distrpc::shutdown();
}

// ---- 14. node failure --------------------------------------------------------------------------

DISTRPC_MP_TEST(
    "dist autograd: a worker that dies before backward fails it on the others "
    "within the RPC timeout, naming it (scenario 14)",
    2, 60) {
  RpcBackendOptions o;
  o.rpc_timeout = std::chrono::seconds(5);
  init(ctx, o);
  da::Context c;
  at::Tensor t = torch::ones({2}, torch::requires_grad());
  auto ret = distrpc::rpc_sync<&ag_test::add>(wname(1 - ctx.rank), t, t);
  ctx.publish("forward-" + std::to_string(ctx.rank), "1");
  ctx.lookup("forward-" + std::to_string(1 - ctx.rank), std::chrono::seconds(20));
  if (ctx.rank == 1) _exit(0);
  std::this_thread::sleep_for(200ms);
  const auto t0 = Clock::now();
  const std::string e = error_of([&] { da::backward(c.id(), {ret.sum()}); });
  CHECK(ms_since(t0) < 5500);
  CHECK(contains(e, "Error on Node 0"));
  CHECK(contains(e, "worker1"));
  distrpc::shutdown(false);
}

// ---- 7. RRef-held leaves; §1.13 RRef made outside a context ------------------------------------

namespace ag_test {
at::Tensor make_leaf(int n) {
  return at::ones({n, n}).requires_grad_(true);
}
// The owner's value of `r` times 3 (a proxy-free use: the owner's local value).
at::Tensor triple_local(distrpc::RRef<at::Tensor> r) {
  return r.local_value() * 3;
}
// The gradient the owner holds for its value of `r` in context `id`.
at::Tensor owner_grad(distrpc::RRef<at::Tensor> r, std::int64_t id) {
  auto g = da::get_gradients(id);
  auto it = g.find(r.local_value());
  return it == g.end() ? at::Tensor() : it->value();
}
}  // namespace ag_test

DISTRPC_MP_TEST(
    "dist autograd: an RRef-held leaf gets its gradient on the owner, in the same context, also "
    "through a third worker; an RRef made outside a context fetched inside one (scenario 7, §1.13)",
    3, 90) {
  init(ctx);
  if (ctx.rank == 0) {
    // Made outside any context: worker1 owns a leaf.
    auto leaf = distrpc::remote<&ag_test::make_leaf>("worker1", 2);
    {
      da::Context c;
      at::Tensor v = leaf.to_here();  // the owner records the send in this context
      REQUIRE(v.grad_fn());
      CHECK(v.grad_fn()->name() == "torch::distributed::autograd::RecvRpcBackward");
      da::backward(c.id(), {(v * 2).sum()});
      CHECK(same(distrpc::rpc_sync<&ag_test::owner_grad>("worker1", leaf, c.id()),
                 at::full({2, 2}, 2.0)));
      CHECK(da::get_gradients(c.id()).size() == 0);
    }
    {
      // Forked to worker2, which uses the owner's value through worker1.
      da::Context c;
      auto t = distrpc::rpc_sync<&ag_test::triple_local>("worker1", leaf);
      auto u = distrpc::rpc_sync<&ag_test::add>("worker2", t, t);
      da::backward(c.id(), {u.sum()});
      CHECK(same(distrpc::rpc_sync<&ag_test::owner_grad>("worker1", leaf, c.id()),
                 at::full({2, 2}, 6.0)));
    }
  }
  distrpc::shutdown();
}

// ---- 8 and 16. concurrent contexts are isolated ------------------------------------------------

DISTRPC_MP_TEST(
    "dist autograd: 3 workers x 20 threads = 60 concurrent contexts against worker0, each 4 RPCs "
    "and a backward, isolated (scenarios 8, 16)",
    4, 120) {
  init(ctx);
  if (ctx.rank != 0) {
    std::vector<std::thread> threads;
    std::atomic<int> bad{0};
    for (int i = 0; i < 20; ++i) {
      threads.emplace_back([&, i] {
        try {
          da::Context c;
          at::Tensor t1 = at::full({3, 3}, static_cast<double>(i + 1)).requires_grad_(true);
          at::Tensor t2 = torch::ones({3, 3}, torch::requires_grad());
          at::Tensor acc = t1;
          for (int k = 0; k < 4; ++k) acc = distrpc::rpc_sync<&ag_test::mul>("worker0", acc, t2);
          da::backward(c.id(), {acc.sum()});
          // d(t1 * t2^4)/dt1 = 1; d/dt2 = 4 * t1 (t2 = 1).
          if (!same(grad_of(c.id(), t1), at::ones({3, 3})) ||
              !same(grad_of(c.id(), t2), at::full({3, 3}, 4.0 * (i + 1)))) {
            bad.fetch_add(1);
          }
        } catch (const std::exception& e) {
          MESSAGE("thread " << i << ": " << e.what());
          bad.fetch_add(1);
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(bad.load() == 0);
  }
  distrpc::shutdown();
  if (ctx.rank == 0) CHECK(true);
}

// ---- 11. sparse --------------------------------------------------------------------------------

DISTRPC_MP_TEST(
    "dist autograd: sparse COO tensors: remote add, sparse sum, gradients equal the "
    "local ones (scenario 11)",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    auto make = [] {
      auto i = at::tensor({0, 1, 1, 0, 2, 1}, at::kLong).view({2, 3});
      auto v = at::tensor({3.0f, 4.0f, 5.0f});
      return at::sparse_coo_tensor(i, v, {2, 3}).requires_grad_(true);
    };
    at::Tensor a = make();
    at::Tensor b = make();
    da::Context c;
    auto ret = distrpc::rpc_sync<&ag_test::add>("worker1", a, b);
    da::backward(c.id(), {at::_sparse_sum(ret)});
    at::Tensor la = make();
    at::Tensor lb = make();
    at::_sparse_sum(la + lb).backward();
    CHECK(same(grad_of(c.id(), a), la.grad()));
    CHECK(same(grad_of(c.id(), b), lb.grad()));
  }
  distrpc::shutdown();
}

// ---- §1.13 callbacks; §1.15 profiling ----------------------------------------------------------

DISTRPC_MP_TEST(
    "dist autograd: the context travels into Future callbacks; the profiler sees "
    "the send, recv and backward events (§1.13, §1.15)",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    da::Context c;
    at::Tensor t = torch::ones({2}, torch::requires_grad());
    auto f = distrpc::rpc_async<&ag_test::add>("worker1", t, t).then([](Future<at::Tensor>& r) {
      // Inside the callback: the same context, and a nested call records in it.
      return std::make_pair(da::current_context()->context_id(),
                            distrpc::rpc_sync<&ag_test::mul>("worker1", r.value(), r.value()));
    });
    auto [id, sq] = f.value();
    CHECK(id == c.id());
    CHECK(da::current_context()->send_functions().size() == 2);
    // Profiling: what RecordFunction sees on this worker during the backward.
    static std::mutex mu;
    static std::map<std::string, int> seen;
    auto handle = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          std::lock_guard<std::mutex> lk(mu);
          ++seen[fn.name()];
          return nullptr;
        }));
    da::backward(c.id(), {sq.sum()});
    at::removeCallback(handle);
    CHECK(same(grad_of(c.id(), t), at::full({2}, 8.0)));
    std::lock_guard<std::mutex> lk(mu);
    CHECK(seen["torch::distributed::autograd::backward"] == 1);
    CHECK(seen["torch::distributed::autograd::SendRpcBackward"] >= 1);
    CHECK(seen["torch::distributed::autograd::RecvRpcBackward"] >= 1);
  }
  distrpc::shutdown();
}

// ---- §1.5 the verification rule over the reference tests' op mixes ------------------------------

namespace ag_test {
std::vector<at::Tensor> three_unused_one(at::Tensor a, at::Tensor b, at::Tensor c) {
  (void)c;
  return {a * b, a.sum() * 0};
}
at::Tensor zeroed(at::Tensor a) {
  return a * 0;
}
}  // namespace ag_test

namespace {
// The same computation run locally (fills .grad) and across workers: for each leaf, present in
// get_gradients exactly when its local .grad is defined, with an equal value and dtype.
template <class Compute>
void verify_against_local(const std::vector<at::Tensor>& leaves, Compute&& compute) {
  std::vector<at::Tensor> local;
  for (const auto& l : leaves)
    local.push_back(l.detach().clone().requires_grad_(l.requires_grad()));
  {
    auto roots = compute(local, /*remote=*/false);
    at::Tensor sum = roots[0];
    for (std::size_t i = 1; i < roots.size(); ++i) sum = sum + roots[i];
    sum.backward();
  }
  da::Context c;
  auto roots = compute(leaves, /*remote=*/true);
  da::backward(c.id(), roots);
  auto grads = da::get_gradients(c.id());
  std::size_t expected = 0;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    INFO("leaf " << i);
    auto it = grads.find(leaves[i]);
    if (local[i].grad().defined()) {
      ++expected;
      REQUIRE(it != grads.end());
      CHECK((it->value().scalar_type() == local[i].scalar_type()));
      CHECK(at::allclose(it->value().to_dense(), local[i].grad().to_dense(), 1e-5, 1e-6));
    } else {
      CHECK(it == grads.end());
    }
    CHECK_FALSE(leaves[i].grad().defined());
  }
  CHECK(grads.size() == expected);
}
}  // namespace

DISTRPC_MP_TEST(
    "dist autograd: the verification rule: multiple roots, round trips over 3 workers, different "
    "dims, unused tensors, multiple outputs, zero gradients, non-grad leaves (§1.5)",
    3, 90) {
  init(ctx);
  if (ctx.rank == 0) {
    auto maybe = [](bool remote, const char* w, auto local_fn, auto remote_fn) {
      return remote ? remote_fn(w) : local_fn();
    };
    {
      INFO("multiple roots");
      at::Tensor a = torch::rand({3, 3}, torch::requires_grad());
      at::Tensor b = torch::rand({3, 3}, torch::requires_grad());
      verify_against_local({a, b}, [&](const std::vector<at::Tensor>& t, bool remote) {
        auto r = maybe(
            remote, "worker1", [&] { return t[0] * t[1]; },
            [&](const char* w) { return distrpc::rpc_sync<&ag_test::mul>(w, t[0], t[1]); });
        return std::vector<at::Tensor>{r.sum(), (r * 2).sum(), (t[0] + 1).sum()};
      });
    }
    {
      INFO("round trips over 3 workers");
      at::Tensor a = torch::rand({3, 3}, torch::requires_grad());
      at::Tensor b = torch::rand({3, 3}, torch::requires_grad());
      verify_against_local({a, b}, [&](const std::vector<at::Tensor>& t, bool remote) {
        at::Tensor x = t[0];
        for (int i = 0; i < 4; ++i) {
          const char* w = i % 2 == 0 ? "worker1" : "worker2";
          x = maybe(
              remote, w, [&] { return x * t[1]; },
              [&](const char* d) { return distrpc::rpc_sync<&ag_test::mul>(d, x, t[1]); });
          x = x + t[0];  // and back here each time
        }
        return std::vector<at::Tensor>{x.sum()};
      });
    }
    {
      INFO("different dims (broadcast), a non-grad leaf, an unused tensor, multiple outputs");
      at::Tensor a = torch::rand({5, 1}, torch::requires_grad());
      at::Tensor b = torch::rand({1, 4}, torch::requires_grad());
      at::Tensor c = torch::rand({2}, torch::requires_grad());
      at::Tensor n = torch::rand({5, 4});
      verify_against_local({a, b, c, n}, [&](const std::vector<at::Tensor>& t, bool remote) {
        std::vector<at::Tensor> outs =
            remote ? distrpc::rpc_sync<&ag_test::three_unused_one>("worker2", t[0], t[1], t[2])
                   : ag_test::three_unused_one(t[0], t[1], t[2]);
        return std::vector<at::Tensor>{(outs[0] * t[3]).sum(), outs[1]};
      });
    }
    {
      INFO("zero gradients are present");
      at::Tensor a = torch::rand({3}, torch::requires_grad());
      verify_against_local({a}, [&](const std::vector<at::Tensor>& t, bool remote) {
        auto r =
            remote ? distrpc::rpc_sync<&ag_test::zeroed>("worker1", t[0]) : ag_test::zeroed(t[0]);
        return std::vector<at::Tensor>{r.sum()};
      });
    }
    {
      INFO("mixed dtypes");
      at::Tensor f = torch::rand({3}, torch::requires_grad());
      at::Tensor d = torch::rand({3}, torch::dtype(torch::kDouble).requires_grad(true));
      verify_against_local({f, d}, [&](const std::vector<at::Tensor>& t, bool remote) {
        auto [x, y] = remote ? distrpc::rpc_sync<&ag_test::mixed_dtypes>("worker1", t[0], t[1])
                             : ag_test::mixed_dtypes(t[0], t[1]);
        return std::vector<at::Tensor>{x.sum(), y.sum().to(at::kFloat)};
      });
    }
  }
  distrpc::shutdown();
}

// ---- §1.9 sparse EmbeddingBag built remotely ---------------------------------------------------

namespace ag_test {
struct BagIface {
  virtual ~BagIface() = default;
  virtual at::Tensor forward(at::Tensor input, at::Tensor offsets) = 0;
};
struct SparseBag : torch::nn::Module {
  SparseBag() {
    bag = register_module(
        "bag", torch::nn::EmbeddingBag(
                   torch::nn::EmbeddingBagOptions(16, 16).mode(torch::kSum).sparse(true)));
  }
  at::Tensor forward(at::Tensor input, at::Tensor offsets) { return bag(input, offsets); }
  torch::nn::EmbeddingBag bag{nullptr};
};
}  // namespace ag_test

DISTRPC_MP_TEST(
    "dist autograd: a sparse EmbeddingBag built remotely: two backward passes equal "
    "two local ones, the sparse gradient on the owner (§1.9)",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    auto rm =
        distrpc::nn::RemoteModule<ag_test::BagIface>::create<ag_test::SparseBag>("worker1/cpu");
    auto params = rm.remote_parameters();
    REQUIRE(params.size() == 1);
    ag_test::SparseBag local;
    {
      torch::NoGradGuard ng;
      local.bag->weight.copy_(params[0].to_here());
    }
    const at::Tensor input = torch::tensor({1, 2, 4, 5, 4, 3, 2, 9}, torch::kLong);
    const at::Tensor offsets = torch::tensor({0, 4}, torch::kLong);
    da::Context c;
    for (int pass = 0; pass < 2; ++pass) {
      da::backward(c.id(), {rm.forward(input, offsets).sum()});
      local.forward(input, offsets).sum().backward();
    }
    at::Tensor remote_grad = distrpc::rpc_sync<&ag_test::owner_grad>("worker1", params[0], c.id());
    REQUIRE(remote_grad.defined());
    CHECK(remote_grad.is_sparse());
    CHECK(at::allclose(remote_grad.to_dense(), local.bag->weight.grad().to_dense()));
  }
  distrpc::shutdown();
}

// ---- async (Future-returning) handlers; retain_graph through a 2-hop chain; 4-hop node failure --

namespace ag_test {
distrpc::Future<at::Tensor> async_add(std::string next, at::Tensor a, at::Tensor b) {
  // The continuation runs on another thread, in the caller's context: its result is recorded.
  return distrpc::rpc_async<&add>(next, a, b).then([](distrpc::Future<at::Tensor>& f) {
    return f.value() * 2;
  });
}
at::Tensor chain(std::vector<std::string> hops, at::Tensor a) {
  if (hops.empty()) return a.exp();
  const std::string next = hops.front();
  hops.erase(hops.begin());
  return distrpc::rpc_sync<&chain>(next, hops, a * 1);
}
}  // namespace ag_test

DISTRPC_MP_TEST(
    "dist autograd: a Future-returning handler records its later result; retain_graph then "
    "without through a 2-hop chain equals local passes, a third pass fails",
    3, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    {
      da::Context c;
      at::Tensor a = torch::ones({2}, torch::requires_grad());
      at::Tensor b = torch::ones({2}, torch::requires_grad());
      auto r = distrpc::rpc_sync<&ag_test::async_add>("worker1", std::string("worker2"), a, b);
      REQUIRE(r.grad_fn());
      da::backward(c.id(), {r.sum()});
      CHECK(same(grad_of(c.id(), a), at::full({2}, 2.0)));
      CHECK(same(grad_of(c.id(), b), at::full({2}, 2.0)));
    }
    {
      da::Context c;
      at::Tensor a = torch::rand({3}, torch::requires_grad());
      auto r =
          distrpc::rpc_sync<&ag_test::chain>("worker1", std::vector<std::string>{"worker2"}, a);
      da::backward(c.id(), {r.sum()}, /*retain_graph=*/true);
      da::backward(c.id(), {r.sum()}, /*retain_graph=*/false);
      CHECK(at::allclose(grad_of(c.id(), a), a.detach().exp() * 2));
      const std::string e = error_of([&] { da::backward(c.id(), {r.sum()}); });
      CHECK(contains(e, "Error on Node "));
      CHECK(contains(e, "Trying to backward through the graph a second time"));
    }
  }
  distrpc::shutdown();
}

DISTRPC_MP_TEST(
    "dist autograd: a 4-hop chain where worker2 dies before backward: backward fails "
    "within the RPC timeout, no hang, no crash (scenario 14)",
    4, 60) {
  RpcBackendOptions o;
  o.rpc_timeout = std::chrono::seconds(5);
  init(ctx, o);
  if (ctx.rank == 0) {
    da::Context c;
    at::Tensor a = torch::rand({3}, torch::requires_grad());
    auto r = distrpc::rpc_sync<&ag_test::chain>("worker1",
                                                std::vector<std::string>{"worker2", "worker3"}, a);
    ctx.publish("forward-done", "1");
    ctx.lookup("worker2-gone", std::chrono::seconds(20));
    std::this_thread::sleep_for(300ms);
    const auto t0 = Clock::now();
    const std::string e = error_of([&] { da::backward(c.id(), {r.sum()}); });
    CHECK(ms_since(t0) < 5500);
    CHECK(contains(e, "Error on Node "));
    CHECK_MESSAGE(contains(e, "worker2"), e);
    ctx.publish("backward-done", "1");
  } else if (ctx.rank == 2) {
    ctx.lookup("forward-done", std::chrono::seconds(20));
    ctx.publish("worker2-gone", "1");
    _exit(0);
  } else {
    ctx.lookup("backward-done", std::chrono::seconds(30));
  }
  distrpc::shutdown(false);
}

namespace ag_test {
// A backward function that ends its process: the worker is lost in the middle of its pass.
struct DyingFn : torch::autograd::Function<DyingFn> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x * 1; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    _exit(0);
    return g;
  }
};
at::Tensor dying(at::Tensor x) {
  return DyingFn::apply(x);
}
// worker `next` runs FailingFn on a * 2.
at::Tensor nested_failing(std::string next, at::Tensor a) {
  return distrpc::rpc_sync<&failing>(next, a * 2);
}
}  // namespace ag_test

DISTRPC_MP_TEST(
    "dist autograd: a worker that dies in the middle of its pass fails backward at once, "
    "naming it (scenario 14)",
    2, 60) {
  RpcBackendOptions o;
  o.rpc_timeout = std::chrono::seconds(5);
  init(ctx, o);
  if (ctx.rank == 0) {
    da::Context c;
    at::Tensor t = torch::ones({2}, torch::requires_grad());
    auto r = distrpc::rpc_sync<&ag_test::dying>("worker1", t);
    const auto t0 = Clock::now();
    const std::string e = error_of([&] { da::backward(c.id(), {r.sum()}); });
    CHECK(ms_since(t0) < 5500);
    CHECK_MESSAGE(contains(e, "Error on Node "), e);
    CHECK_MESSAGE(contains(e, "worker1"), e);
    CHECK(da::get_debug_info().at("num_current_backward_passes") == "0");
  } else {
    ctx.lookup("never", std::chrono::seconds(30));  // ends inside its backward function
  }
  distrpc::shutdown(false);
}

DISTRPC_MP_TEST(
    "dist autograd: an error in the pass of a worker reached through another reaches the root "
    "with its node; the next pass in the context succeeds",
    3, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    da::Context c;
    at::Tensor t = torch::ones({2}, torch::requires_grad());
    auto loss =
        distrpc::rpc_sync<&ag_test::nested_failing>("worker1", std::string("worker2"), t).sum();
    distrpc::rpc_sync<&ag_test::set_fail>("worker2", true);
    const std::string e = error_of([&] { da::backward(c.id(), {loss}, true); });
    CHECK_MESSAGE(contains(e, "Error on Node 2: "), e);
    CHECK(contains(e, "Simulate error on backward pass"));
    distrpc::rpc_sync<&ag_test::set_fail>("worker2", false);
    CHECK(error_of([&] { da::backward(c.id(), {loss}); }).empty());
    CHECK(same(grad_of(c.id(), t), at::full({2}, 2.0)));
  }
  distrpc::shutdown();
}

// Ids are (worker_id << 48) | counter in a signed 64-bit integer: from worker id 32768 on they
// would be negative, which reads as "no context" (and hung a backward), so such ids are refused.
TEST_CASE("dist autograd: worker ids have 15 bits, so every context id is positive") {
  using distrpc::dist_autograd::ContextContainer;
  ContextContainer last(32767);
  const auto first = last.make();
  CHECK(first->context_id() == std::int64_t{32767} << 48);
  CHECK(first->context_id() > 0);
  CHECK((first->context_id() >> 48) == 32767);
  CHECK(last.max_id() == std::numeric_limits<std::int64_t>::max());
  for (int bad : {32768, 65535, -1}) {
    CAPTURE(bad);
    CHECK(error_of([bad] { ContextContainer c(bad); }) ==
          "distributed autograd: worker id " + std::to_string(bad) +
              " is outside 0..32767 (context ids are (worker_id << 48) | counter, and positive)");
  }
}

TEST_CASE(
    "dist autograd: the root's count ends a backward only when every message ran, whatever the "
    "order of the reports") {
  using distrpc::dist_autograd::detail::BackwardTracker;
  BackwardTracker t(0);
  t.created(1, 0);  // the root's own first pass
  t.created(2, 1);  // which sends #2 to worker1
  t.report(0, 1, {}, {});
  CHECK_FALSE(t.done().done());
  t.report(2, 3, {}, {});  // #3, sent by #2's pass, ran on worker2 before #2's report came
  CHECK_FALSE(t.done().done());
  CHECK(t.waits_for(1));
  CHECK_FALSE(t.waits_for(2));
  t.report(1, 2, {3, 4}, {2, 2});  // #2 ran on worker1 and sent #3 and #4 to worker2
  CHECK_FALSE(t.done().done());
  CHECK(t.waits_for(2));
  CHECK(t.waits_for(1));  // as the sender of #4, not processed yet
  t.report(2, 4, {}, {});
  CHECK(t.done().has_value());

  BackwardTracker f(0);
  f.created(1, 0);
  f.fail(std::make_exception_ptr(std::runtime_error("Error on Node 3: boom")));
  f.report(0, 1, {}, {});  // later reports change nothing
  CHECK(f.done().has_error());
  CHECK(error_of([&] { f.done().value(); }) == "Error on Node 3: boom");
}

namespace {
// A backward whose root, worker 0, ran its first pass (#1), which sent #2 to worker1.
std::unique_ptr<distrpc::dist_autograd::detail::BackwardTracker> started() {
  auto t = std::make_unique<distrpc::dist_autograd::detail::BackwardTracker>(0);
  t->created(1, 0);
  t->created(2, 1);
  t->report(0, 1, {}, {});
  return t;
}
}  // namespace

TEST_CASE(
    "dist autograd: the root's count needs a worker until what it sent ran (or reached the "
    "root), and fails on its loss even when the report naming it is read after the loss") {
  const auto lost1 = std::make_exception_ptr(std::runtime_error("worker1 was lost"));
  // In order: #2's answer lists #3 (worker1 to the root); #3 arrives; worker1 is lost meanwhile.
  auto t = started();
  t->report(1, 2, {3}, {0});
  CHECK(t->waits_for(1));
  t->arrived(3);
  CHECK_FALSE(t->waits_for(1));
  t->lost(1, lost1);
  CHECK_FALSE(t->done().done());
  t->report(0, 3, {}, {});  // its pass ran here
  CHECK(t->done().has_value());

  // #3 arrived before the answer that lists it: nothing waits on worker1 at any point.
  auto a = started();
  a->arrived(3);
  CHECK(a->waits_for(1));  // #2 has not reported yet
  a->report(1, 2, {3}, {0});
  CHECK_FALSE(a->waits_for(1));
  CHECK_FALSE(a->done().done());  // #3's pass has not reported
  a->report(0, 3, {}, {});
  CHECK(a->done().has_value());

  // Three workers: the root sends #2 to worker1, whose pass sends #3 to worker2, whose pass sends
  // #4 to the root. Worker2 is lost before its report is read (reports and losses are handled
  // on different threads): nothing known needs it then, but the report names #4, which will
  // never come.
  const auto lost2 = std::make_exception_ptr(std::runtime_error("worker2 was lost"));
  auto l = started();
  l->lost(2, lost2);
  CHECK_FALSE(l->done().done());
  l->report(2, 3, {4}, {0});
  CHECK(l->done().has_error());
  CHECK(error_of([&] { l->done().value(); }) == "worker2 was lost");
  // The same, with #4 read before the loss: the backward completes.
  auto m = started();
  m->arrived(4);
  m->lost(2, lost2);
  m->report(2, 3, {4}, {0});
  m->report(1, 2, {3}, {2});
  CHECK_FALSE(m->done().done());
  m->report(0, 4, {}, {});
  CHECK(m->done().has_value());
  // Worker1's answer lists #3 for worker2; worker1 is lost before #3 ran there (it may never
  // have left: the call's timeout that would report it ran on worker1).
  auto chain = started();
  chain->report(1, 2, {3}, {2});
  chain->lost(1, lost1);
  CHECK(chain->done().has_error());
  // The same with worker2's report read first: nothing needs worker1 any more.
  auto ran = started();
  ran->report(2, 3, {}, {});
  ran->report(1, 2, {3}, {2});
  ran->lost(1, lost1);
  CHECK(ran->done().has_value());
  // A pass still to run on the lost worker fails at once.
  auto pending = started();
  pending->lost(1, lost1);
  CHECK(pending->done().has_error());
  CHECK(error_of([&] { pending->done().value(); }) == "worker1 was lost");
}

// ---- gradients that come back as they were sent ------------------------------------------------

// The caller's h = x.mm(W) is sent to worker1, which sends 2h on to worker2 and adds h to the
// result: worker0's send function of h gets its gradient in two messages (1, then 4). The pass
// of the first must keep mm's saved tensors for the second (it failed with "Trying to backward
// through the graph a second time"); the gradients equal a local run's.
DISTRPC_MP_TEST(
    "dist autograd: a send function that gets gradients twice (a skip connection around a nested "
    "call) keeps the graph behind it; the gradients equal a local run's",
    3, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    torch::manual_seed(3);
    const at::Tensor x0 = torch::rand({3, 4});
    const at::Tensor w0 = torch::rand({4, 2});
    at::Tensor x = x0.clone().requires_grad_(true);
    at::Tensor w = w0.clone().requires_grad_(true);
    for (int step = 0; step < 3; ++step) {
      da::Context c;
      at::Tensor h = x.mm(w);
      at::Tensor y = distrpc::rpc_sync<&ag_test::skip_around>("worker1", std::string("worker2"), h);
      std::string err;
      try {
        da::backward(c.id(), {y.sum()});
      } catch (const std::exception& e) {
        err = e.what();
      }
      CHECK(err == "");
      at::Tensor lx = x0.clone().requires_grad_(true);
      at::Tensor lw = w0.clone().requires_grad_(true);
      (5 * lx.mm(lw)).sum().backward();
      CHECK(same(grad_of(c.id(), x), lx.grad()));
      CHECK(same(grad_of(c.id(), w), lw.grad()));
    }
  }
  distrpc::shutdown();
}

// A call made in a context while another thread releases it: the worker it would reach is either
// among those the release goes to, or the call goes without the context. Never both missed.
TEST_CASE("dist autograd: a released context takes no further worker to release it on") {
  da::DistAutogradContext ctx(11);
  CHECK(ctx.add_known_worker(2));
  CHECK(ctx.add_known_worker(3));
  CHECK(ctx.close() == std::set<int>{2, 3});
  CHECK_FALSE(ctx.add_known_worker(4));  // refused: the release is already under way
  CHECK(ctx.known_worker_ids() == std::set<int>{2, 3});
}

TEST_CASE("dist autograd: a dense gradient added to a sparse one in a context is summed") {
  auto ctx = std::make_shared<da::DistAutogradContext>(9);
  at::Tensor emb = torch::zeros({4, 2}, torch::requires_grad());
  const at::Tensor sparse =
      at::sparse_coo_tensor(torch::tensor({{1, 3}}, torch::kLong), at::ones({2, 2}), {4, 2});
  ctx->accumulate(emb, sparse);
  ctx->accumulate(emb, at::full({4, 2}, 2.0f));  // refused by ATen as sparse + dense
  at::Tensor expect = at::full({4, 2}, 2.0f);
  expect[1] += 1;
  expect[3] += 1;
  CHECK(same(ctx->get_gradients().at(emb), expect));
  ctx->accumulate(emb, sparse);  // dense + sparse
  expect[1] += 1;
  expect[3] += 1;
  CHECK(same(ctx->get_gradients().at(emb), expect));
}

TEST_CASE(
    "dist autograd: a pass from send functions straight to leaves sums each leaf's gradients "
    "without the engine, converts the dtype, and names a gradient of the wrong shape") {
  namespace dd = distrpc::dist_autograd::detail;
  auto ctx = std::make_shared<da::DistAutogradContext>(7);
  at::Tensor x = torch::ones({2, 2}, torch::requires_grad());
  at::Tensor y = torch::ones({3}, torch::dtype(torch::kDouble).requires_grad(true));
  // As an RPC that carried (x, x, y) records it: one send function, three inputs.
  torch::autograd::edge_list edges{torch::autograd::impl::gradient_edge(x),
                                   torch::autograd::impl::gradient_edge(x),
                                   torch::autograd::impl::gradient_edge(y)};
  auto send = std::make_shared<da::SendRpcBackward>(std::move(edges));
  send->add_input_metadata(x);
  send->add_input_metadata(x);
  send->add_input_metadata(y);
  const torch::autograd::edge_list roots{{send, 0}, {send, 1}, {send, 2}};
  int sent = 0;
  const auto no_send = [&](const da::RecvRpcBackward&, torch::autograd::variable_list, bool) {
    ++sent;
  };
  dd::run_pass(ctx, 0, roots, {at::full({2, 2}, 2.0), at::full({2, 2}, 3.0), at::full({3}, 1.5f)},
               false, no_send);
  auto grads = ctx->get_gradients();
  CHECK(grads.size() == 2);
  CHECK(same(grads.at(x), at::full({2, 2}, 5.0)));
  CHECK((grads.at(y).scalar_type() == at::kDouble));  // float gradients for a double tensor
  CHECK(same(grads.at(y), at::full({3}, 1.5, at::kDouble)));
  CHECK(sent == 0);
  // A peer sending a gradient of another shape is refused with the shapes named.
  CHECK(error_of([&] {
          dd::run_pass(ctx, 0, roots, {at::ones({2, 2}), at::ones({4}), at::ones({3})}, false,
                       no_send);
        }) ==
        "Error on Node 0: Function torch::distributed::autograd::SendRpcBackward returned "
        "an invalid gradient at index 1 "
        "- got [4] but expected shape compatible with [2, 2]");
  CHECK(same(ctx->get_gradients().at(x), at::full({2, 2}, 5.0)));  // nothing accumulated
}

DISTRPC_MP_TEST(
    "dist autograd: gradients coming back to the caller run on the thread waiting in backward() "
    "(its hooks see that thread), with the values of a local pass, on every transport",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    const auto caller = std::this_thread::get_id();
    int on_caller = 0;
    int hook_calls = 0;
    for (int i = 0; i < 50; ++i) {
      da::Context c;
      at::Tensor x = torch::ones({2, 2}, torch::requires_grad());
      std::thread::id ran;
      x.register_hook([&](at::Tensor g) {
        ran = std::this_thread::get_id();
        ++hook_calls;
        return g;
      });
      // x twice in one call and once in another: d/dx of (x + x) * x = 4x.
      auto a = distrpc::rpc_sync<&ag_test::add>("worker1", x, x);
      auto b = distrpc::rpc_sync<&ag_test::mul>("worker1", a, x);
      da::backward(c.id(), {b.sum()});
      CHECK(same(grad_of(c.id(), x), at::full({2, 2}, 4.0)));
      if (ran == caller) ++on_caller;
    }
    // Two passes reach x per step (one per call). Reading its own replies, the caller runs
    // them itself; one that arrives after it stopped reading goes to a pool thread, and on tcp
    // one that a reading thread (woken by the kernel) reads first too.
    CHECK(hook_calls == 100);
    MESSAGE("passes run on the caller's thread in " << on_caller << " of 50 steps");
    const char* transport = std::getenv("DISTRPC_TEST_TRANSPORT");
    if (transport != nullptr && std::string(transport) != "tcp") CHECK(on_caller >= 1);
  }
  distrpc::shutdown();
}

// ---- §1.3 cleanup on a faulty network ----------------------------------------------------------

namespace {
// PyTorch's faulty agent for these tests: the first 3 sends of the RRef protocol's messages and
// of context releases fail; worker0's calls arrive 1.5 s late.
struct AutogradFaults {
  static distrpc::transport::FaultyOptions options(const distrpc::transport::TransportOptions& t) {
    using distrpc::rref_message_type;
    using distrpc::RRefControl;
    distrpc::transport::FaultyOptions o{
        .fail_sends = {.kinds = {rref_message_type(RRefControl::ForkRequest),
                                 rref_message_type(RRefControl::ChildAccept),
                                 rref_message_type(RRefControl::UserDelete),
                                 da::AutogradLayer::message_type(da::AutogradLayer::kCleanup)},
                       .count = 3}};
    if (t.self_id == 0) {
      o.delay = {.kinds = {distrpc::wire::MessageType::Request}, .by = 1500ms};
    }
    return o;
  }
};
using FaultyTcp = distrpc::transport::Faulty<distrpc::transport::Tcp, AutogradFaults>;
}  // namespace

DISTRPC_MP_TEST(
    "dist autograd: on a faulty network (releases and RRef messages fail 3 times, calls 1.5 s "
    "late, 8 worker threads) nested contexts are released on every worker within 10 s",
    3, 90) {
  RpcBackendOptions o;
  o.num_worker_threads = 8;
  init_on<FaultyTcp>(ctx, o);
  if (ctx.rank == 0) {
    std::int64_t id = -1;
    at::Tensor t1 = torch::rand({3, 3}, torch::requires_grad());
    {
      da::Context c;
      id = c.id();
      auto ret = distrpc::rpc_sync<&ag_test::nested_add>("worker1", std::string("worker2"), t1, t1);
      da::backward(c.id(), {ret.sum()});
      CHECK(same(grad_of(id, t1), at::full({3, 3}, 4.0)));
      // An RRef made, used and released in the context too.
      auto r = distrpc::remote<&ag_test::add>("worker2", t1, t1);
      CHECK(same(r.to_here(), t1 * 2));
    }
    const auto t0 = Clock::now();
    bool gone = false;
    while (!gone && ms_since(t0) < 10000) {
      gone = !distrpc::rpc_sync<&ag_test::has_context>("worker1", id) &&
             !distrpc::rpc_sync<&ag_test::has_context>("worker2", id);
    }
    CHECK(gone);
    auto agent =
        std::dynamic_pointer_cast<distrpc::Agent<FaultyTcp>>(distrpc::detail::current_agent());
    REQUIRE(agent);
    CHECK(agent->context().stats().failed.at(
              da::AutogradLayer::message_type(da::AutogradLayer::kCleanup)) == 3);
  }
  distrpc::shutdown();
}

namespace {
// Faults on worker 1's gradients messages only, as `Set::set` makes them.
template <class Set>
struct Worker1Gradients {
  static distrpc::transport::FaultyOptions options(const distrpc::transport::TransportOptions& t) {
    distrpc::transport::FaultyOptions o;
    if (t.self_id == 1)
      Set::set(o, {da::AutogradLayer::message_type(da::AutogradLayer::kGradients)});
    return o;
  }
};
// Its first gradients message fails to send: gradients it sends back to the root, which get no
// answer, so the failure must reach the root another way.
struct FailFirst {
  static void set(distrpc::transport::FaultyOptions& o, std::set<distrpc::wire::MessageType> k) {
    o.fail_sends = {.kinds = std::move(k), .count = 1};
  }
};
// They leave 1.5 s late, so its answer to the root overtakes them.
struct Late {
  static void set(distrpc::transport::FaultyOptions& o, std::set<distrpc::wire::MessageType> k) {
    o.delay = {.kinds = std::move(k), .by = 1500ms};
  }
};
using GradientFaultyTcp =
    distrpc::transport::Faulty<distrpc::transport::Tcp, Worker1Gradients<FailFirst>>;
using LateGradientsTcp =
    distrpc::transport::Faulty<distrpc::transport::Tcp, Worker1Gradients<Late>>;
}  // namespace

DISTRPC_MP_TEST(
    "dist autograd: gradients another worker cannot send back to the root fail backward there, "
    "naming that worker and the send's error; the next pass in the context succeeds",
    2, 60) {
  init_on<GradientFaultyTcp>(ctx);
  if (ctx.rank == 0) {
    at::Tensor t = torch::ones({2}, torch::requires_grad());
    at::Tensor u = torch::full({2}, 3.0, torch::requires_grad());
    da::Context c;
    auto loss = distrpc::rpc_sync<&ag_test::mul>("worker1", t, u).sum();
    const std::string e = error_of([&] { da::backward(c.id(), {loss}, true); });
    CHECK_MESSAGE(contains(e, "Error on Node 1: "), e);
    CHECK_MESSAGE(contains(e, "injected failure 1 of 1"), e);
    CHECK(da::get_debug_info().at("num_current_backward_passes") == "0");
    CHECK(error_of([&] { da::backward(c.id(), {loss}); }).empty());
    CHECK(same(grad_of(c.id(), t), u.detach()));
    CHECK(same(grad_of(c.id(), u), t.detach()));
  }
  distrpc::shutdown();
}

DISTRPC_MP_TEST(
    "dist autograd: the root waits for gradients its report overtook; when their sender is lost "
    "before they leave, backward fails within 2 s of the loss, naming it",
    2, 60) {
  init_on<LateGradientsTcp>(ctx);
  const auto kind = da::AutogradLayer::message_type(da::AutogradLayer::kGradients);
  if (ctx.rank == 0) {
    at::Tensor t = torch::ones({2}, torch::requires_grad());
    at::Tensor u = torch::full({2}, 3.0, torch::requires_grad());
    {
      da::Context c;
      auto loss = distrpc::rpc_sync<&ag_test::mul>("worker1", t, u).sum();
      const auto t0 = Clock::now();
      CHECK(error_of([&] { da::backward(c.id(), {loss}); }).empty());
      CHECK(ms_since(t0) >= 1400);
      CHECK(same(grad_of(c.id(), t), u.detach()));
      CHECK(same(grad_of(c.id(), u), t.detach()));
    }
    da::Context c;
    auto loss = distrpc::rpc_sync<&ag_test::mul>("worker1", t, u).sum();
    ctx.publish("second-forward", "1");
    const auto t0 = Clock::now();
    const std::string e = error_of([&] { da::backward(c.id(), {loss}); });
    // worker1 exits about 100 ms after its pass; its loss is noticed within 2 s.
    CHECK(ms_since(t0) < 4000);
    CHECK_MESSAGE(contains(e,
                           "Error on Node 0: worker worker1 (id 1) was lost during the "
                           "backward pass"),
                  e);
    CHECK(da::get_debug_info().at("num_current_backward_passes") == "0");
    distrpc::shutdown(false);
  } else {
    ctx.lookup("second-forward", std::chrono::seconds(20));
    auto agent = std::dynamic_pointer_cast<distrpc::Agent<LateGradientsTcp>>(
        distrpc::detail::current_agent());
    REQUIRE(agent);
    const auto delayed = [&] {
      const auto s = agent->context().stats();
      return s.delayed.count(kind) != 0 ? s.delayed.at(kind) : 0;
    };
    const auto t0 = Clock::now();
    while (delayed() < 2 && ms_since(t0) < 10000) std::this_thread::sleep_for(1ms);
    CHECK(delayed() == 2);
    std::this_thread::sleep_for(100ms);  // the answer to the root leaves meanwhile
    _exit(0);
  }
}

// ---- §1.8 post hooks of AccumulateGrad ---------------------------------------------------------

namespace {
struct CountingPostHook : torch::autograd::FunctionPostHook {
  CountingPostHook(int* calls, int by) : calls_(calls), by_(by) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    *calls_ += by_;
    return outputs;
  }
  int* calls_;
  int by_;
};
}  // namespace

DISTRPC_MP_TEST(
    "dist autograd: AccumulateGrad post hooks run once per pass, as in PyTorch's "
    "test_post_hooks (§1.8)",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    int calls = 0;
    at::Tensor t = torch::rand({10, 10}, torch::requires_grad());
    at::Tensor a = t + t;
    auto acc0 = a.grad_fn()->next_edges()[0].function;
    auto acc1 = a.grad_fn()->next_edges()[1].function;
    REQUIRE(acc0 == acc1);  // both edges lead to t's AccumulateGrad
    acc0->add_post_hook(std::make_unique<CountingPostHook>(&calls, 1));
    acc0->add_post_hook(std::make_unique<CountingPostHook>(&calls, 2));
    acc1->add_post_hook(std::make_unique<CountingPostHook>(&calls, 2));
    da::Context c;
    da::backward(c.id(), {a.sum()});
    CHECK(calls == 5);
    auto grads = da::get_gradients(c.id());
    CHECK(grads.size() == 1);
    CHECK(same(grad_of(c.id(), t), at::full({10, 10}, 2.0)));
    CHECK_FALSE(t.grad().defined());
  }
  distrpc::shutdown();
}

// ---- RRef proxies, forward_async and user types inside a context --------------------------------

namespace ag_test {
struct Scaler {
  explicit Scaler(double s = 1) : scale(s) {}
  double scale;
  at::Tensor apply(at::Tensor x) const { return x * scale; }
};
Scaler make_scaler(double s) {
  return Scaler(s);
}
struct Pair {
  at::Tensor first;
  std::string tag;
  at::Tensor second;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(first, tag, second);
  }
};
Pair swap_pair(Pair p) {
  return Pair{p.second * 3, p.tag, p.first * 5};
}
}  // namespace ag_test

DISTRPC_MP_TEST(
    "dist autograd: RRef proxies, RemoteModule::forward_async and tensors inside user "
    "types record their send and recv functions",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    auto scaler = distrpc::remote<&ag_test::make_scaler>("worker1", 4.0);
    auto rm = distrpc::nn::RemoteModule<ag_test::LinearIface>::create<torch::nn::Linear>(
        "worker1/cpu", 3, 2);
    da::Context c;
    at::Tensor x = torch::ones({2, 3}, torch::requires_grad());
    at::Tensor viaproxy = scaler.rpc_sync<&ag_test::Scaler::apply>(x);
    at::Tensor viaasync = rm.forward_async(x).value();
    at::Tensor a = torch::ones({2}, torch::requires_grad());
    at::Tensor b = torch::ones({2}, torch::requires_grad());
    auto p = distrpc::rpc_sync<&ag_test::swap_pair>("worker1", ag_test::Pair{a, "t", b});
    CHECK(p.tag == "t");
    da::backward(c.id(), {viaproxy.sum(), viaasync.sum(), p.first.sum(), p.second.sum()});
    at::Tensor w = rm.remote_parameters()[0].to_here();
    CHECK(at::allclose(grad_of(c.id(), x), at::full({2, 3}, 4.0) + at::ones({2, 2}).matmul(w)));
    CHECK(same(grad_of(c.id(), a), at::full({2}, 5.0)));
    CHECK(same(grad_of(c.id(), b), at::full({2}, 3.0)));
  }
  distrpc::shutdown();
}

// ---- CUDA and device maps (needs a GPU) --------------------------------------------------------
// worker0 maps its cuda:0 to worker1's cuda:0 (both processes share the machine's first GPU) and
// sends CUDA leaves; the gradients come back through the inverse map, on the leaves' device. A
// CPU leaf sent alongside stays on the CPU both ways.

namespace ag_test {
std::string device_of(at::Tensor a) {
  return a.device().str();
}
}  // namespace ag_test

DISTRPC_MP_TARGET("dist autograd target: CUDA leaves through a device map") {
  RpcBackendOptions o;
  if (ctx.rank == 0) o.set_device_map("worker1", {{0, 0}});
  init(ctx, o);
  if (ctx.rank == 0) {
    const c10::Device gpu(c10::kCUDA, 0);
    {
      da::Context c;
      at::Tensor a = (at::ones({3, 3}, gpu) * 2).requires_grad_(true);
      at::Tensor b = (at::ones({3, 3}, gpu) * 3).requires_grad_(true);
      CHECK(distrpc::rpc_sync<&ag_test::device_of>("worker1", a) == "cuda:0");
      at::Tensor ret = distrpc::rpc_sync<&ag_test::mul>("worker1", a, b);
      CHECK(ret.device() == gpu);
      da::backward(c.id(), {ret.sum()});
      const at::Tensor ga = grad_of(c.id(), a);
      const at::Tensor gb = grad_of(c.id(), b);
      REQUIRE(ga.defined());
      REQUIRE(gb.defined());
      CHECK(ga.device() == gpu);
      CHECK(gb.device() == gpu);
      CHECK(same(ga.cpu(), at::ones({3, 3}) * 3));
      CHECK(same(gb.cpu(), at::ones({3, 3}) * 2));
    }
    // A local-only backward on CUDA equals autograd's own .grad (a context of its own: one
    // context per thread at a time).
    da::Context local;
    at::Tensor x =
        at::arange(4, at::TensorOptions().dtype(at::kFloat).device(gpu)).requires_grad_(true);
    da::backward(local.id(), {(x * x).sum()});
    CHECK(same(grad_of(local.id(), x).cpu(), at::arange(4, at::kFloat) * 2));
  }
  distrpc::shutdown();
}

TEST_CASE(
    "dist autograd: CUDA leaves through a device map get their gradients on their device "
    "(needs a GPU)") {
  const int gpus = distrpc::compat::cuda_device_count();
  if (gpus < 1) {
    MESSAGE("skipped: needs 1 GPU(s), this machine has " << gpus);
    return;
  }
  distrpc::testing::RunOptions o;
  o.world = 2;
  o.limit = 120s;
  auto r = distrpc::testing::run_ranks("dist autograd target: CUDA leaves through a device map", o);
  CHECK_MESSAGE(r.ok, r.report());
}
