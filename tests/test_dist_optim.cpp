// The distributed optimizer suite (distrpc::optim, docs/dist_optim.md): LocalOptimizer against
// the plain torch optimizer on the same gradients (every supported optimizer), the options on
// the wire, steps serialized on one worker; then, across processes, DistributedOptimizer over
// parameters on two owners and the caller with distributed autograd, against a local run of the
// same model, two trainers stepping one owner at once, and the errors (bad parameters, a failing
// owner named).
//
// Same conventions as test_rref.cpp: fresh processes named worker{rank} per case, a file://
// rendezvous, a graceful shutdown at the end with the RRef leak check on.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <doctest/doctest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim.h>

#include <distrpc/dist_autograd.hpp>
#include <distrpc/dist_optim.hpp>
#include <distrpc/nn/remote_module.hpp>
#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>

#include "multiprocess.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"

using namespace distrpc::testing::rpc_names;
using distrpc::optim::DistributedOptimizer;
using distrpc::optim::LocalOptimizer;
using distrpc::optim::OptionsOf;
using GradMap = c10::Dict<at::Tensor, at::Tensor>;

namespace {

// c10::Error's text without its backtrace, any other exception's what().
template <class E, class Fn>
void expect_c10(Fn&& fn, const std::string& text, const std::string& what) {
  INFO("case: " << what);
  try {
    fn();
    FAIL_CHECK("no exception was raised (expected \"" << text << "\")");
  } catch (const c10::Error& e) {
    CHECK_MESSAGE(contains(e.what_without_backtrace(), text),
                  "\"" << e.what_without_backtrace() << "\" lacks \"" << text << "\"");
  }
}

at::Tensor leaf(std::vector<float> values) {
  return at::tensor(values).requires_grad_(true);
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone().requires_grad_(true));
  return out;
}

// Three steps of Opt through LocalOptimizer (gradients in a map, as distributed autograd gives
// them) and through the plain optimizer (gradients in .grad): the parameters must be the same
// bit for bit. Parameter 2 never has a gradient (both leave it alone); the LocalOptimizer's
// parameters keep the .grad the program gave them.
template <class Opt>
void same_as_plain_optimizer(const OptionsOf<Opt>& options) {
  INFO("optimizer " << distrpc::optim::optimizer_traits<Opt>::name);
  std::vector<at::Tensor> params = {leaf({1.0f, -2.0f, 3.0f}), leaf({0.5f, 0.25f}), leaf({7.0f})};
  std::vector<at::Tensor> plain_params = clones(params);
  // What the program left in .grad (e.g. a local backward of its own): kept by every step.
  const at::Tensor own_grad = at::full({3}, 100.0f);
  params[0].mutable_grad() = own_grad;

  LocalOptimizer<Opt> local(params, options);
  Opt plain(plain_params, options);
  for (int step = 1; step <= 3; ++step) {
    const at::Tensor g0 = at::tensor({0.1f * step, -0.3f, 0.2f * step * step});
    const at::Tensor g1 = at::tensor({-1.0f / step, 2.0f});
    GradMap grads;
    grads.insert(params[0], g0);
    grads.insert(params[1], g1);
    local.step_with_gradients(grads);

    plain_params[0].mutable_grad() = g0.clone();
    plain_params[1].mutable_grad() = g1.clone();
    plain.step();
    for (std::size_t i = 0; i < params.size(); ++i) {
      INFO("step " << step << ", parameter " << i);
      CHECK(at::equal(params[i].detach(), plain_params[i].detach()));
    }
    CHECK(params[0].grad().is_same(own_grad));
    CHECK(at::equal(own_grad, at::full({3}, 100.0f)));
    CHECK_FALSE(params[1].grad().defined());
    CHECK_FALSE(params[2].grad().defined());
  }
  CHECK(at::equal(params[2].detach(), at::tensor({7.0f})));  // no gradient, never moved
  CHECK_FALSE(at::equal(params[0].detach(), at::tensor({1.0f, -2.0f, 3.0f})));
}

template <class O>
O round_trip(const O& options) {
  distrpc::wire::Message m;
  distrpc::wire::encode(m, distrpc::nn::WireOptions<O>(options));
  distrpc::nn::WireOptions<O> back;
  REQUIRE_FALSE(back.has_value());
  distrpc::wire::decode(m, back);
  REQUIRE(back.has_value());
  return back.get();
}

}  // namespace

// ---- one process ------------------------------------------------------------------------------

TEST_CASE("dist optim: LocalOptimizer gives the plain optimizer's parameters; .grad unchanged") {
  same_as_plain_optimizer<torch::optim::SGD>(
      torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.1).weight_decay(0.01));
  same_as_plain_optimizer<torch::optim::SGD>(
      torch::optim::SGDOptions(0.05).momentum(0.5).nesterov(true));
  same_as_plain_optimizer<torch::optim::Adam>(
      torch::optim::AdamOptions(0.01).betas({0.8, 0.95}).weight_decay(0.1).amsgrad(true));
  same_as_plain_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(0.02).eps(1e-6));
  same_as_plain_optimizer<torch::optim::Adagrad>(
      torch::optim::AdagradOptions(0.1).lr_decay(0.01).initial_accumulator_value(0.5));
  same_as_plain_optimizer<torch::optim::RMSprop>(
      torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true).alpha(0.9));
}

TEST_CASE("dist optim: a step restores .grad even when the optimizer throws") {
  at::Tensor p = leaf({1.0f, 2.0f});
  LocalOptimizer<torch::optim::SGD> local({p}, torch::optim::SGDOptions(0.1));
  GradMap grads;
  grads.insert(p, at::ones({5}));  // the wrong shape: the optimizer's own update fails
  CHECK_THROWS_AS(local.step_with_gradients(grads), c10::Error);
  CHECK_FALSE(p.grad().defined());
  CHECK(at::equal(p.detach(), at::tensor({1.0f, 2.0f})));
}

TEST_CASE("dist optim: every options field round-trips through the wire") {
  const auto sgd = round_trip(
      torch::optim::SGDOptions(0.25).momentum(0.5).dampening(0.125).weight_decay(0.0625).nesterov(
          true));
  CHECK(sgd.lr() == 0.25);
  CHECK(sgd.momentum() == 0.5);
  CHECK(sgd.dampening() == 0.125);
  CHECK(sgd.weight_decay() == 0.0625);
  CHECK(sgd.nesterov());
  CHECK_FALSE(round_trip(torch::optim::SGDOptions(0.1)).nesterov());

  const auto adam = round_trip(torch::optim::AdamOptions(0.003)
                                   .betas(std::make_tuple(0.7, 0.8))
                                   .eps(1e-5)
                                   .weight_decay(0.2)
                                   .amsgrad(true));
  CHECK(adam.lr() == 0.003);
  CHECK(std::get<0>(adam.betas()) == 0.7);
  CHECK(std::get<1>(adam.betas()) == 0.8);
  CHECK(adam.eps() == 1e-5);
  CHECK(adam.weight_decay() == 0.2);
  CHECK(adam.amsgrad());

  const auto adamw = round_trip(torch::optim::AdamWOptions(0.004)
                                    .betas(std::make_tuple(0.6, 0.9))
                                    .eps(1e-4)
                                    .weight_decay(0.3)
                                    .amsgrad(true));
  CHECK(adamw.lr() == 0.004);
  CHECK(std::get<0>(adamw.betas()) == 0.6);
  CHECK(std::get<1>(adamw.betas()) == 0.9);
  CHECK(adamw.eps() == 1e-4);
  CHECK(adamw.weight_decay() == 0.3);
  CHECK(adamw.amsgrad());
  CHECK(round_trip(torch::optim::AdamWOptions()).weight_decay() == 1e-2);  // AdamW's default

  const auto adagrad = round_trip(torch::optim::AdagradOptions(0.5)
                                      .lr_decay(0.1)
                                      .weight_decay(0.2)
                                      .initial_accumulator_value(0.3)
                                      .eps(1e-3));
  CHECK(adagrad.lr() == 0.5);
  CHECK(adagrad.lr_decay() == 0.1);
  CHECK(adagrad.weight_decay() == 0.2);
  CHECK(adagrad.initial_accumulator_value() == 0.3);
  CHECK(adagrad.eps() == 1e-3);

  const auto rms = round_trip(torch::optim::RMSpropOptions(0.6)
                                  .alpha(0.7)
                                  .eps(1e-2)
                                  .weight_decay(0.4)
                                  .momentum(0.8)
                                  .centered(true));
  CHECK(rms.lr() == 0.6);
  CHECK(rms.alpha() == 0.7);
  CHECK(rms.eps() == 1e-2);
  CHECK(rms.weight_decay() == 0.4);
  CHECK(rms.momentum() == 0.8);
  CHECK(rms.centered());
}

TEST_CASE("dist optim: LocalOptimizer refuses what it cannot optimize, naming the parameter") {
  using SGD = LocalOptimizer<torch::optim::SGD>;
  const auto opts = torch::optim::SGDOptions(0.1);
  expect_exact<std::invalid_argument>(
      [&] {
        SGD({leaf({1.0f}), at::Tensor()}, opts);
      },
      "parameter 1 is an undefined tensor", "undefined");
  expect_exact<std::invalid_argument>([&] { SGD({at::ones({2})}, opts); },
                                      "parameter 0 does not require grad", "no grad");
  const at::Tensor base = leaf({1.0f, 2.0f});
  expect_exact<std::invalid_argument>(
      [&] {
        SGD({leaf({3.0f}), leaf({4.0f}), base * 2}, opts);
      },
      "parameter 2 is not a leaf tensor", "non-leaf");
  const at::Tensor twice = leaf({5.0f});
  expect_exact<std::invalid_argument>(
      [&] {
        SGD({twice, leaf({6.0f}), twice}, opts);
      },
      "parameter 2 is the same tensor as parameter 0", "twice");
  expect_c10<c10::Error>([&] { SGD({leaf({1.0f})}, torch::optim::SGDOptions(-1)); },
                         "Invalid learning rate: -1", "lr < 0");
}

TEST_CASE("dist optim: DistributedOptimizer's argument checks that need no RPC") {
  using DO = DistributedOptimizer<torch::optim::SGD>;
  expect_exact<std::invalid_argument>([] { DO({}, torch::optim::SGDOptions(0.1)); },
                                      "DistributedOptimizer: empty parameter list", "empty");
  expect_exact<std::invalid_argument>(
      [] { DO({RRef<at::Tensor>()}, torch::optim::SGDOptions(0.1)); },
      "DistributedOptimizer: parameter 0 is an empty RRef handle", "empty handle");
}

TEST_CASE("dist optim: steps of two optimizers sharing a tensor never interleave") {
  // SGD with lr 1: each step subtracts its own gradient. Two optimizers over one tensor (two
  // trainers' parts on one owner) stepped from four threads at once: a step that ran with the
  // other optimizer's gradient, or restored .grad under it, would change the sum.
  // Large enough that a step takes a while, so overlapping steps would be caught.
  constexpr int64_t kSize = 1 << 16;
  at::Tensor p = at::zeros({kSize}).requires_grad_(true);
  LocalOptimizer<torch::optim::SGD> a({p}, torch::optim::SGDOptions(1.0));
  LocalOptimizer<torch::optim::SGD> b({p}, torch::optim::SGDOptions(1.0));
  GradMap ga, gb;
  ga.insert(p, at::full({kSize}, 1.0f));
  gb.insert(p, at::full({kSize}, 1000.0f));
  constexpr int kSteps = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kSteps; ++i) {
        if (t % 2 == 0) {
          a.step_with_gradients(ga);
        } else {
          b.step_with_gradients(gb);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(at::equal(p.detach(), at::full({kSize}, -2.0f * kSteps * 1001.0f)));
  CHECK_FALSE(p.grad().defined());
}

// ---- across processes -------------------------------------------------------------------------

namespace optim_test {

struct LinearIface {
  at::Tensor forward(at::Tensor x);
};

// A tensor kept on its owner through remote().
at::Tensor make_tensor(std::vector<float> values, bool requires_grad) {
  return at::tensor(values).requires_grad_(requires_grad);
}
at::Tensor make_non_leaf() {
  return at::tensor({1.0f, 2.0f}).requires_grad_(true) * 3;
}
at::Tensor make_nothing() {
  throw std::out_of_range("make_nothing: no tensor here");
}

// The one parameter several trainers share (the concurrency case): an owner RRef to it.
at::Tensor& shared_tensor() {
  static at::Tensor t = at::zeros({4}).requires_grad_(true);
  return t;
}
RRef<at::Tensor> shared_param() {
  return RRef<at::Tensor>(shared_tensor());
}
at::Tensor scaled_sum(RRef<at::Tensor> p, double scale) {
  return (p.local_value() * scale).sum();
}

}  // namespace optim_test

using distrpc::nn::RemoteModule;
using optim_test::LinearIface;

DISTRPC_MP_TEST("dist optim: constructor errors name the parameter and its owner", 2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    using DO = DistributedOptimizer<torch::optim::SGD>;
    const auto opts = torch::optim::SGDOptions(0.1);
    auto good =
        distrpc::remote<&optim_test::make_tensor>("worker1", std::vector<float>{1, 2}, true);
    RRef<at::Tensor> local(at::tensor({5.0f}).requires_grad_(true));
    {
      auto no_grad =
          distrpc::remote<&optim_test::make_tensor>("worker1", std::vector<float>{3}, false);
      expect_exact<std::invalid_argument>(
          [&] {
            DO({local, good, no_grad}, opts);
          },
          "DistributedOptimizer: parameter 2 (on worker1) does not require grad", "no grad");
      auto non_leaf = distrpc::remote<&optim_test::make_non_leaf>("worker1");
      expect_exact<std::invalid_argument>(
          [&] {
            DO({non_leaf, good}, opts);
          },
          "DistributedOptimizer: parameter 0 (on worker1) is not a leaf tensor", "non-leaf");
      auto nothing = distrpc::remote<&optim_test::make_nothing>("worker1");
      expect_exact<std::invalid_argument>(
          [&] {
            DO({good, nothing}, opts);
          },
          "parameter 1 (on worker1) (OwnerRRef(", "no tensor");
      expect_exact<std::invalid_argument>(
          [&] {
            DO({good, nothing}, opts);
          },
          "holds no tensor: make_nothing: no tensor here", "no tensor, reason");
      // The caller's own parameters are checked the same way.
      RRef<at::Tensor> local_no_grad(at::ones({1}));
      expect_exact<std::invalid_argument>(
          [&] {
            DO({good, local_no_grad}, opts);
          },
          "DistributedOptimizer: parameter 1 (on worker0) does not require grad", "local");
      // torch's own check of the options, before anything is sent.
      expect_c10<c10::Error>([&] { DO({good}, torch::optim::SGDOptions(-0.5)); },
                             "Invalid learning rate: -0.5", "lr < 0");
    }
    // The same parameter twice (two RRefs to one tensor count too: remote_parameters() twice).
    expect_exact<std::invalid_argument>(
        [&] {
          DO({good, local, good}, opts);
        },
        "DistributedOptimizer: parameter 2 (on worker1) is the same tensor as parameter 0",
        "twice");
    {
      DO opt({good, local}, opts);
      const auto owners = opt.owners();
      REQUIRE(owners.size() == 2);
      CHECK(owners[0].name == "worker0");  // this worker's part first
      CHECK(owners[1].name == "worker1");
    }
  }
  distrpc::shutdown();
}

DISTRPC_MP_TEST("dist optim: a step failing on owners names each, after all finished", 3, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    auto p1 = distrpc::remote<&optim_test::make_tensor>("worker1", std::vector<float>{1, 2}, true);
    auto p2 = distrpc::remote<&optim_test::make_tensor>("worker2", std::vector<float>{3}, true);
    RRef<at::Tensor> p0(at::tensor({4.0f}).requires_grad_(true));
    {
      DistributedOptimizer<torch::optim::SGD> opt({p1, p0, p2}, torch::optim::SGDOptions(0.1));
      // No such context anywhere: every owner fails with get_gradients' own text, this one too.
      const std::string reason = "Could not find autograd context with id: 987654321";
      expect_exact<distrpc::RpcError>([&] { opt.step(987654321); },
                                      "DistributedOptimizer step on worker0 failed: " + reason +
                                          "; also on worker1: " + reason +
                                          "; also on worker2: " + reason,
                                      "every owner fails");
      CHECK(at::equal(p0.local_value().detach(), at::tensor({4.0f})));
    }
    DistributedOptimizer<torch::optim::SGD> opt({p1, p2}, torch::optim::SGDOptions(0.5));
    distrpc::dist_autograd::Context c;
    // The forward reaches worker1 only: worker2 never heard of the context.
    at::Tensor loss = distrpc::rpc_sync<&optim_test::scaled_sum>("worker1", p1, 2.0);
    distrpc::dist_autograd::backward(c.id(), {loss});
    // Stepped from a thread without a current context, so that the step's own messages carry
    // none to worker2 either.
    const std::int64_t id = c.id();
    expect_exact<distrpc::RpcError>(
        [&] {
          std::exception_ptr error;
          std::thread([&] {
            try {
              opt.step(id);
            } catch (...) {
              error = std::current_exception();
            }
          }).join();
          if (error) std::rethrow_exception(error);
        },
        "DistributedOptimizer step on worker2 failed: Could not find autograd context with id: " +
            std::to_string(id),
        "only worker2 fails");
    // worker1 stepped all the same: 1 - 0.5 * 2, 2 - 0.5 * 2.
    CHECK(at::equal(p1.to_here().detach(), at::tensor({0.0f, 1.0f})));
    CHECK(at::equal(p2.to_here().detach(), at::tensor({3.0f})));
    // Inside the context's scope the step's own message makes the context known on worker2, which
    // has no gradient in it: its parameter stays, worker1 steps again.
    opt.step(id);
    CHECK(at::equal(p1.to_here().detach(), at::tensor({-1.0f, 0.0f})));
    CHECK(at::equal(p2.to_here().detach(), at::tensor({3.0f})));
  }
  distrpc::shutdown();
}

// In a dynamic group, an owner that left cannot be called at all (the call is refused before it is
// sent): its part fails, named, and every other owner, this worker included, still steps.
DISTRPC_MP_TEST("dist optim: an owner that left the group fails its part; the others step", 3, 90) {
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "dynamic");
  if (ctx.rank > 0) (void)ctx.lookup("joined" + std::to_string(ctx.rank - 1), 60s);
  distrpc::testing::init_rpc_dynamic_under_test("worker" + std::to_string(ctx.rank), ctx.rank, o);
  ctx.publish("joined" + std::to_string(ctx.rank), "1");
  (void)ctx.lookup("joined2", 60s);
  if (ctx.rank == 1) {
    (void)ctx.lookup("built", 60s);
    // Its parameter and optimizer part are still held by worker0: reported at the leave.
    try {
      distrpc::shutdown();
    } catch (const std::exception& e) {
      MESSAGE("worker1 left: " << e.what());
    }
    ctx.publish("left1", "1");
    return;
  }
  if (ctx.rank == 0) {
    auto p1 = distrpc::remote<&optim_test::make_tensor>("worker1", std::vector<float>{1, 2}, true);
    auto p2 = distrpc::remote<&optim_test::make_tensor>("worker2", std::vector<float>{3}, true);
    RRef<at::Tensor> p0(at::tensor({4.0f}).requires_grad_(true));
    DistributedOptimizer<torch::optim::SGD> opt({p1, p0, p2}, torch::optim::SGDOptions(0.5));
    ctx.publish("built", "1");
    (void)ctx.lookup("left1", 60s);
    distrpc::dist_autograd::Context c;
    const at::Tensor loss = distrpc::rpc_sync<&optim_test::scaled_sum>("worker2", p2, 2.0) +
                            (p0.local_value() * 3).sum();
    distrpc::dist_autograd::backward(c.id(), {loss});
    const std::string text = error_of([&] { opt.step(c.id()); });
    CHECK_MESSAGE(contains(text, "DistributedOptimizer step on worker1 failed: "), text);
    CHECK_MESSAGE(contains(text, "worker1"), text);
    // The others stepped: 3 - 0.5 * 2 on worker2, 4 - 0.5 * 3 here.
    CHECK(at::equal(p2.to_here().detach(), at::tensor({2.0f})));
    CHECK(at::equal(p0.local_value().detach(), at::tensor({2.5f})));
  }
  ctx.publish("done" + std::to_string(ctx.rank), "1");
  (void)ctx.lookup("done" + std::to_string(2 - ctx.rank), 60s);
  distrpc::shutdown();
}

namespace {

// The model of the training case: x -> lin1 (worker1) -> relu -> lin2 (worker2) -> * w (the
// trainer's own parameter) -> sum of squares. `remote` runs it with RemoteModules under
// distributed autograd; `local` with local copies of the same parameters and plain autograd.
template <class Opt>
void train_and_compare(const OptionsOf<Opt>& options) {
  INFO("optimizer " << distrpc::optim::optimizer_traits<Opt>::name);
  auto lin1 = RemoteModule<LinearIface>::create<torch::nn::Linear>("worker1/cpu", 4, 5);
  auto lin2 = RemoteModule<LinearIface>::create<torch::nn::Linear>("worker2/cpu", 5, 3);
  const at::Tensor w = at::tensor({0.5f, -1.0f, 2.0f}).requires_grad_(true);

  std::vector<RRef<at::Tensor>> params = lin1.remote_parameters();
  for (auto& p : lin2.remote_parameters()) params.push_back(p);
  params.push_back(RRef<at::Tensor>(w));
  REQUIRE(params.size() == 5);

  // The local twin: the same starting values, fetched.
  std::vector<at::Tensor> start, twin;
  for (auto& p : params) start.push_back(p.to_here().detach().clone());
  for (auto& s : start) twin.push_back(s.clone().requires_grad_(true));
  Opt local_opt(twin, options);

  DistributedOptimizer<Opt> opt(params, options);
  for (int step = 0; step < 10; ++step) {
    const at::Tensor x = at::linspace(-1, 1, 8).reshape({2, 4}) * (1 + 0.1 * step);
    {
      distrpc::dist_autograd::Context c;
      const at::Tensor out = lin2.forward(at::relu(lin1.forward(x))) * w;
      const at::Tensor loss = (out * out).mean();
      distrpc::dist_autograd::backward(c.id(), {loss});
      opt.step(c.id());
    }
    local_opt.zero_grad();
    const at::Tensor h = at::relu(at::linear(x, twin[0], twin[1]));
    const at::Tensor out = at::linear(h, twin[2], twin[3]) * twin[4];
    (out * out).mean().backward();
    local_opt.step();
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i);
    const at::Tensor got = params[i].to_here().detach();
    CHECK_MESSAGE(at::allclose(got, twin[i].detach(), /*rtol=*/0, /*atol=*/1e-6),
                  "max difference " << (got - twin[i].detach()).abs().max().item<double>());
    CHECK_FALSE(at::equal(got, start[i]));  // it did train
  }
  // Distributed autograd never writes .grad, and a step puts back what was there.
  CHECK_FALSE(w.grad().defined());
}

}  // namespace

DISTRPC_MP_TEST(
    "dist optim: 10 steps with distributed autograd equal a local run (SGD, Adam), parameters on "
    "two owners and the trainer",
    3, 120) {
  init(ctx);
  if (ctx.rank == 0) {
    train_and_compare<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9));
    train_and_compare<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
  }
  distrpc::shutdown();
}

DISTRPC_MP_TEST("dist optim: two trainers stepping one owner's parameter at once", 3, 120) {
  // worker0 owns the parameter; worker1 and worker2 each build their own DistributedOptimizer
  // over it (two LocalOptimizers on worker0 sharing the tensor) and step 20 times concurrently,
  // each with its own gradient (its scale). SGD with lr 1: the parameter ends at -(20 * 1 + 20 *
  // 1000) exactly when every step was whole.
  init(ctx);
  constexpr int kSteps = 20;
  if (ctx.rank == 0) {
    const at::Tensor own = at::full({4}, 9.0f);
    optim_test::shared_tensor().mutable_grad() = own;
    ctx.publish("ready", "1");
    ctx.lookup("done1", 60s);
    ctx.lookup("done2", 60s);
    CHECK(at::equal(optim_test::shared_tensor().detach(), at::full({4}, -kSteps * 1001.0f)));
    CHECK(optim_test::shared_tensor().grad().is_same(own));
  } else {
    ctx.lookup("ready", 60s);
    const double scale = ctx.rank == 1 ? 1.0 : 1000.0;
    {
      RRef<at::Tensor> p = distrpc::rpc_sync<&optim_test::shared_param>("worker0");
      DistributedOptimizer<torch::optim::SGD> opt({p}, torch::optim::SGDOptions(1.0));
      for (int i = 0; i < kSteps; ++i) {
        distrpc::dist_autograd::Context c;
        at::Tensor loss = distrpc::rpc_sync<&optim_test::scaled_sum>("worker0", p, scale);
        distrpc::dist_autograd::backward(c.id(), {loss});
        opt.step(c.id());
      }
    }
    ctx.publish("done" + std::to_string(ctx.rank), "1");
  }
  distrpc::shutdown();
}
