// The transport-independent foundation of process groups (distrpc::dist): ReduceOp values and the
// local reduction, Work completion and waiting, BackendConfig parsing with the backend registry,
// and gradient bucket assignment (PyTorch's four cases from test_c10d_common.py).
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/bucket_assignment.hpp>
#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/wire.hpp>
#include "support/error_text.hpp"

using distrpc::dist::ReduceOp;

namespace {

using distrpc::testing::error_text;

// at::tensor has no bool overload on libtorch 1.13.
at::Tensor bools(std::initializer_list<bool> v) {
  std::vector<std::int64_t> ints(v.begin(), v.end());
  return at::tensor(ints).to(at::kBool);
}

std::vector<std::vector<std::size_t>> idx(std::initializer_list<std::vector<std::size_t>> l) {
  return l;
}

}  // namespace

// ---- Bucket assignment ----

TEST_CASE("dist bucket assignment: single limit, single dtype") {
  std::vector<at::Tensor> t{at::empty({100}, at::kFloat), at::empty({200}, at::kFloat),
                            at::empty({100}, at::kFloat), at::empty({50}, at::kFloat)};
  auto r = distrpc::dist::compute_bucket_assignment_by_size(t, {400});
  CHECK(r.buckets == idx({{0}, {1}, {2}, {3}}));
  CHECK(r.size_limits == std::vector<std::size_t>{400, 400, 400, 400});
}

std::vector<at::Tensor> mixed_six() {
  std::vector<at::Tensor> t;
  for (int i = 0; i < 3; ++i) {
    t.push_back(at::empty({50}, at::kFloat));
    t.push_back(at::empty({25}, at::kDouble));
  }
  return t;
}

TEST_CASE("dist bucket assignment: single limit, mixed dtypes") {
  auto r = distrpc::dist::compute_bucket_assignment_by_size(mixed_six(), {400});
  CHECK(r.buckets == idx({{0, 2}, {1, 3}, {4}, {5}}));
  CHECK(r.size_limits == std::vector<std::size_t>{400, 400, 400, 400});
}

TEST_CASE("dist bucket assignment: two limits, single dtype") {
  std::vector<at::Tensor> t(4);
  for (auto& x : t) x = at::empty({10}, at::kFloat);
  auto r = distrpc::dist::compute_bucket_assignment_by_size(t, {40, 80});
  CHECK(r.buckets == idx({{0}, {1, 2}, {3}}));
  CHECK(r.size_limits == std::vector<std::size_t>{40, 80, 80});
}

TEST_CASE("dist bucket assignment: two limits, mixed dtypes") {
  auto r = distrpc::dist::compute_bucket_assignment_by_size(mixed_six(), {200, 400});
  CHECK(r.buckets == idx({{0}, {1}, {2, 4}, {3, 5}}));
  CHECK(r.size_limits == std::vector<std::size_t>{200, 200, 400, 400});
}

TEST_CASE("dist bucket assignment: sparse gradients, tensor indices and bad input") {
  std::vector<at::Tensor> t(3);
  for (auto& x : t) x = at::empty({10}, at::kFloat);
  auto r = distrpc::dist::compute_bucket_assignment_by_size(t, {1000}, {false, true, false});
  CHECK(r.buckets == idx({{0, 2}, {1}}));
  CHECK(r.size_limits == std::vector<std::size_t>{1000, distrpc::dist::kNoSizeLimit});

  // Gradient-ready order: tensor i is reported as tensor_indices[i], buckets in closing order.
  auto g = distrpc::dist::compute_bucket_assignment_by_size(t, {40}, {}, {2, 0, 1});
  CHECK(g.buckets == idx({{2}, {0}, {1}}));

  using distrpc::dist::compute_bucket_assignment_by_size;
  CHECK(error_text<std::invalid_argument>([&] { compute_bucket_assignment_by_size(t, {}); }) ==
        "compute_bucket_assignment_by_size: expected at least one bucket size limit");
  CHECK(error_text<std::invalid_argument>(
            [&] { compute_bucket_assignment_by_size(t, {40}, {true}); }) ==
        "compute_bucket_assignment_by_size: expect_sparse_gradient has 1 entries but there "
        "are 3 tensors");
  CHECK(error_text<std::invalid_argument>([&] {
          compute_bucket_assignment_by_size(t, {40}, {}, {0, 1});
        }) ==
        "compute_bucket_assignment_by_size: tensor_indices has 2 entries but there are 3 "
        "tensors");
  CHECK(error_text<std::invalid_argument>([&] {
          compute_bucket_assignment_by_size({at::Tensor()}, {40});
        }) == "compute_bucket_assignment_by_size: tensor 0 is undefined");
}

// ---- ReduceOp ----

TEST_CASE("dist ReduceOp: value semantics, equality and names") {
  const ReduceOp::Kind kinds[] = {ReduceOp::SUM, ReduceOp::AVG,  ReduceOp::PRODUCT, ReduceOp::MIN,
                                  ReduceOp::MAX, ReduceOp::BAND, ReduceOp::BOR,     ReduceOp::BXOR};
  for (ReduceOp::Kind k : kinds) {
    ReduceOp op(k);
    ReduceOp copy = op;
    CHECK(copy == op);
    CHECK(op == k);
    CHECK(copy.kind() == k);
    for (ReduceOp::Kind other : kinds) {
      if (other != k) CHECK_FALSE(op == ReduceOp(other));
    }
  }
  CHECK(ReduceOp() == ReduceOp::SUM);
  CHECK(static_cast<int>(ReduceOp::PREMUL_SUM) == 8);  // PyTorch's numbering
  CHECK(ReduceOp(ReduceOp::BXOR).describe() == "ReduceOp.BXOR");

  auto s2 = distrpc::dist::make_premul_sum(2.0);
  CHECK(s2.kind() == ReduceOp::PREMUL_SUM);
  CHECK(s2.scalar_factor() == 2.0);
  CHECK(ReduceOp(s2) == s2);
  CHECK_FALSE(s2 == distrpc::dist::make_premul_sum(3.0));
  auto t1 = distrpc::dist::make_premul_sum(at::tensor({1.0}));
  CHECK(t1 == distrpc::dist::make_premul_sum(at::tensor({1.0})));
  CHECK_FALSE(t1 == distrpc::dist::make_premul_sum(1.0));  // a tensor factor is not a scalar
  CHECK_FALSE(t1 == ReduceOp(ReduceOp::SUM));

  CHECK(error_text<std::invalid_argument>([] { ReduceOp op(ReduceOp::PREMUL_SUM); }) ==
        "ReduceOp.PREMUL_SUM needs a factor: use make_premul_sum(factor) instead");
  CHECK(error_text<std::invalid_argument>([] { ReduceOp op(static_cast<ReduceOp::Kind>(12)); }) ==
        "ReduceOp: invalid kind 12");
  CHECK(error_text<std::logic_error>([] { (void)ReduceOp(ReduceOp::SUM).tensor_factor(); }) ==
        "ReduceOp.SUM has no tensor factor");
  CHECK(error_text<std::invalid_argument>([] { distrpc::dist::make_premul_sum(at::Tensor()); }) ==
        "make_premul_sum: the factor tensor is undefined");
  CHECK(error_text<std::invalid_argument>([] {
          distrpc::dist::start_reduction(at::Tensor(), ReduceOp::SUM);
        }) == "start_reduction: the input is undefined");
  CHECK(error_text<std::invalid_argument>([] {
          distrpc::dist::start_reduction(at::ones({1}), ReduceOp::BOR);
        }) == "Cannot use ReduceOp.BOR with non-integral dtype Float");
  CHECK(error_text<std::logic_error>([] { (void)ReduceOp(ReduceOp::MAX).scalar_factor(); }) ==
        "ReduceOp.MAX has no scalar factor");
  CHECK(error_text<std::invalid_argument>([] { distrpc::dist::make_premul_sum(at::ones({2})); }) ==
        "make_premul_sum: the factor tensor must have one element, got 2");
  CHECK(error_text<std::invalid_argument>([] {
          distrpc::dist::make_premul_sum(at::ones({1}, at::kLong));
        }) == "make_premul_sum: the factor tensor must be floating point, got Long");
}

TEST_CASE("dist ReduceOp: wire round-trip and hostile bytes") {
  namespace wire = distrpc::wire;
  const std::vector<ReduceOp> ops{ReduceOp::SUM,
                                  ReduceOp::AVG,
                                  ReduceOp::PRODUCT,
                                  ReduceOp::MIN,
                                  ReduceOp::MAX,
                                  ReduceOp::BAND,
                                  ReduceOp::BOR,
                                  ReduceOp::BXOR,
                                  distrpc::dist::make_premul_sum(2.5),
                                  distrpc::dist::make_premul_sum(at::tensor({0.25}))};
  for (const ReduceOp& op : ops) {
    CAPTURE(op.describe());
    wire::Message m;
    wire::encode(m, op);
    const ReduceOp back = std::get<0>(wire::decode_as<ReduceOp>(m));
    CHECK(back == op);
    CHECK(back.kind() == op.kind());
  }
  auto decode_bytes = [](std::vector<std::uint8_t> bytes) {
    wire::Message m;
    wire::encode(m, bytes[0], bytes[1]);
    return error_text<wire::DecodeError>([&] { (void)wire::decode_as<ReduceOp>(m); });
  };
  CHECK(decode_bytes({12, 0}) == "ReduceOp: invalid kind 12");
  CHECK(decode_bytes({0, 1}) == "ReduceOp: SUM with factor tag 1");
  CHECK(decode_bytes({8, 0}) == "ReduceOp: PREMUL_SUM with factor tag 0");
  CHECK(decode_bytes({8, 3}) == "ReduceOp: PREMUL_SUM with factor tag 3");
}

namespace {
at::Tensor reduce_all(std::vector<at::Tensor> xs, const ReduceOp& op) {
  at::Tensor acc = distrpc::dist::start_reduction(xs[0], op);
  for (std::size_t i = 1; i < xs.size(); ++i) distrpc::dist::reduce_into(acc, xs[i], op);
  distrpc::dist::finish_reduction(acc, op, static_cast<std::int64_t>(xs.size()));
  return acc;
}
}  // namespace

TEST_CASE("dist reduce_into: every op on integers and floats") {
  const std::vector<at::Tensor> ints{at::tensor({6, 3, -2}, at::kLong),
                                     at::tensor({5, 10, 7}, at::kLong)};
  CHECK(at::equal(reduce_all(ints, ReduceOp::SUM), at::tensor({11, 13, 5}, at::kLong)));
  CHECK(at::equal(reduce_all(ints, ReduceOp::PRODUCT), at::tensor({30, 30, -14}, at::kLong)));
  CHECK(at::equal(reduce_all(ints, ReduceOp::MIN), at::tensor({5, 3, -2}, at::kLong)));
  CHECK(at::equal(reduce_all(ints, ReduceOp::MAX), at::tensor({6, 10, 7}, at::kLong)));
  CHECK(at::equal(reduce_all(ints, ReduceOp::BAND), at::tensor({4, 2, 6}, at::kLong)));
  CHECK(at::equal(reduce_all(ints, ReduceOp::BOR), at::tensor({7, 11, -1}, at::kLong)));
  CHECK(at::equal(reduce_all(ints, ReduceOp::BXOR), at::tensor({3, 9, -7}, at::kLong)));

  const std::vector<at::Tensor> fl{at::tensor({1.0f, 4.0f}), at::tensor({3.0f, -2.0f}),
                                   at::tensor({2.0f, 1.0f})};
  CHECK(at::equal(reduce_all(fl, ReduceOp::AVG), at::tensor({2.0f, 1.0f})));
  CHECK(at::equal(reduce_all(fl, ReduceOp::SUM), at::tensor({6.0f, 3.0f})));
  CHECK(at::equal(reduce_all(fl, ReduceOp::MIN), at::tensor({1.0f, -2.0f})));
  CHECK(at::equal(reduce_all(fl, ReduceOp::PRODUCT), at::tensor({6.0f, -8.0f})));
  CHECK(at::equal(reduce_all(fl, distrpc::dist::make_premul_sum(0.5)), at::tensor({3.0f, 1.5f})));
  CHECK(at::equal(reduce_all(fl, distrpc::dist::make_premul_sum(at::tensor({2.0}))),
                  at::tensor({12.0f, 6.0f})));
  // The input itself is never modified.
  CHECK(at::equal(fl[0], at::tensor({1.0f, 4.0f})));

  const std::vector<at::Tensor> cx{at::tensor({1.0, 2.0}).to(at::kComplexDouble),
                                   at::tensor({3.0, 4.0}).to(at::kComplexDouble)};
  CHECK(at::equal(reduce_all(cx, ReduceOp::SUM), at::tensor({4.0, 6.0}).to(at::kComplexDouble)));
}

TEST_CASE("dist reduce_into: bool follows PyTorch") {
  const std::vector<at::Tensor> b{bools({true, true, false, false}),
                                  bools({true, false, true, false})};
  CHECK(at::equal(reduce_all(b, ReduceOp::SUM), bools({true, true, true, false})));
  CHECK(at::equal(reduce_all(b, ReduceOp::PRODUCT), bools({true, false, false, false})));
  CHECK(at::equal(reduce_all(b, ReduceOp::MIN), bools({true, false, false, false})));
  CHECK(at::equal(reduce_all(b, ReduceOp::MAX), bools({true, true, true, false})));
  CHECK(at::equal(reduce_all(b, ReduceOp::BAND), bools({true, false, false, false})));
  CHECK(at::equal(reduce_all(b, ReduceOp::BOR), bools({true, true, true, false})));
  CHECK(at::equal(reduce_all(b, ReduceOp::BXOR), bools({false, true, true, false})));
  CHECK(error_text<std::invalid_argument>([&] { reduce_all(b, ReduceOp::AVG); }) ==
        "Cannot use ReduceOp.AVG with boolean inputs");
}

TEST_CASE("dist reduce_into: invalid uses name what was wrong") {
  at::Tensor f = at::ones({2});
  at::Tensor d = at::ones({2}, at::kDouble);
  at::Tensor l = at::ones({2}, at::kLong);
  auto bad = [](at::Tensor acc, const at::Tensor& x, const ReduceOp& op) {
    return error_text<std::invalid_argument>([&] { distrpc::dist::reduce_into(acc, x, op); });
  };
  CHECK(bad(f.clone(), d, ReduceOp::SUM) ==
        "Invalid usage of tensors with different dtypes Found Float and Double");
  CHECK(bad(f.clone(), at::ones({3}), ReduceOp::SUM) ==
        "reduce_into: the accumulator has shape [2] but the input has shape [3]");
  CHECK(bad(at::Tensor(), f, ReduceOp::SUM) == "reduce_into: the accumulator is undefined");
  CHECK(bad(f.clone(), at::Tensor(), ReduceOp::SUM) == "reduce_into: the input is undefined");
  CHECK(bad(f.clone(), f, ReduceOp::BAND) ==
        "Cannot use ReduceOp.BAND with non-integral dtype Float");
  CHECK(bad(d.clone(), d, ReduceOp::BXOR) ==
        "Cannot use ReduceOp.BXOR with non-integral dtype Double");
  CHECK(bad(l.clone(), l, ReduceOp::AVG) ==
        "Cannot use ReduceOp.AVG with integral dtype Long: the mean is not representable");
  CHECK(bad(l.clone(), l, distrpc::dist::make_premul_sum(2.0)) ==
        "Cannot use ReduceOp.PREMUL_SUM with non-floating-point dtype Long");
  at::Tensor c = at::ones({2}, at::kComplexFloat);
  CHECK(bad(c.clone(), c, ReduceOp::MAX) ==
        "all_reduce does not support ReduceOp.MAX on complex tensors");
  at::Tensor acc = f.clone();
  CHECK(error_text<std::invalid_argument>([&] {
          distrpc::dist::finish_reduction(acc, ReduceOp::AVG, 0);
        }) == "finish_reduction: world_size must be at least 1, got 0");
}

// ---- Work ----

TEST_CASE("dist Work: completion, result, future and sequence number") {
  distrpc::dist::Work w("allreduce", 7);
  CHECK_FALSE(w.is_completed());
  CHECK_FALSE(w.is_success());
  CHECK(w.exception() == nullptr);
  CHECK(w.sequence_number() == 7);
  CHECK(w.op_name() == "allreduce");
  auto fut = w.get_future();
  std::atomic<int> callbacks{0};
  std::atomic<bool> success_seen_in_callback{false};
  // The callback re-enters the Work: nothing may be locked while it runs.
  fut.add_done_callback([&](const auto&) {
    success_seen_in_callback = w.is_success() && w.result().size() == 1;
    callbacks.fetch_add(1);
  });

  std::thread backend([&] { CHECK(w.finish({at::full({2}, 3.0f)})); });
  CHECK(w.wait(std::chrono::milliseconds(5000)));
  backend.join();
  CHECK(w.is_completed());
  CHECK(w.is_success());
  CHECK(callbacks.load() == 1);
  CHECK(success_seen_in_callback.load());
  REQUIRE(w.result().size() == 1);
  CHECK(at::equal(w.result()[0], at::full({2}, 3.0f)));
  CHECK(at::equal(fut.value()[0], at::full({2}, 3.0f)));
  CHECK_FALSE(w.finish({}));  // the first completion stands
  CHECK_FALSE(w.finish_error(std::make_exception_ptr(std::runtime_error("late"))));
  CHECK(w.is_success());
  CHECK(error_text<std::logic_error>([&] { (void)w.source_rank(); }) ==
        "sourceRank() may only be called on recv or recvAnysource work objects.");
}

TEST_CASE("dist Work: failure, timeout and recv from any source") {
  distrpc::dist::Work failing("broadcast");
  CHECK(failing.sequence_number() == -1);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(error_text<distrpc::DistBackendError>(
            [&] { failing.wait(std::chrono::milliseconds(50)); }) == "Operation timed out!");
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(50));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK_FALSE(failing.is_completed());  // a timed-out wait leaves the work running

  CHECK(failing.finish_error(std::make_exception_ptr(distrpc::DistBackendError("peer 2 lost"))));
  CHECK(failing.is_completed());
  CHECK_FALSE(failing.is_success());
  REQUIRE(failing.exception() != nullptr);
  CHECK(error_text<distrpc::DistBackendError>([&] { failing.wait(); }) == "peer 2 lost");
  CHECK(error_text<distrpc::DistBackendError>([&] { (void)failing.result(); }) == "peer 2 lost");
  CHECK(error_text<std::invalid_argument>([&] { failing.wait(std::chrono::milliseconds(-1)); }) ==
        "Work::wait: the timeout must not be negative, got -1 ms");
  CHECK(error_text<std::invalid_argument>([&] { failing.finish_error(nullptr); }) ==
        "Work::finish_error: the exception is null");

  distrpc::dist::Work recv("recv");
  CHECK(error_text<std::invalid_argument>([&] { recv.finish_recv({}, -1); }) ==
        "Work::finish_recv: the source rank must not be negative, got -1");
  CHECK(recv.finish_recv({at::ones({1})}, 3));
  CHECK(recv.wait());
  CHECK(recv.source_rank() == 3);
  CHECK_FALSE(recv.finish_recv({at::ones({1})}, 5));  // the first sender stands
  CHECK(recv.source_rank() == 3);
}

// A backend's wait driver that sees the end of its work from the waiting thread (as the nccl
// backend's works do with a GPU event) once `ready` is set, and completes the work there.
struct FinishingDriver final : distrpc::detail::WaitDriver {
  explicit FinishingDriver(distrpc::dist::Work& w) : work(w) {}
  distrpc::dist::Work& work;
  std::atomic<bool> ready{false};
  std::atomic<int> calls{0};
  std::atomic<bool> gave_up{false};  // returned at its deadline
  void drive_wait(const std::function<bool()>& done,
                  std::chrono::steady_clock::time_point until) override {
    ++calls;
    while (!ready.load() && !done()) {
      if (std::chrono::steady_clock::now() >= until) {
        gave_up = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (ready.load()) work.finish({at::full({1}, 5.0f)});
  }
};

TEST_CASE("dist Work: a backend's wait driver completes the work on the waiting thread") {
  SUBCASE("wait() asks it, callbacks run there, and a complete work does not ask again") {
    distrpc::dist::Work w("allreduce", 1);
    auto driver = std::make_shared<FinishingDriver>(w);
    w.set_wait_driver(driver);
    std::atomic<bool> callback_on_waiter{false};
    const auto waiter = std::this_thread::get_id();
    w.get_future().add_done_callback(
        [&](const auto&) { callback_on_waiter = std::this_thread::get_id() == waiter; });
    driver->ready = true;
    // Nobody else completes it: without the driver this times out.
    REQUIRE(w.wait(std::chrono::milliseconds(5000)));
    CHECK(driver->calls.load() == 1);
    CHECK(callback_on_waiter.load());
    CHECK(at::equal(w.result()[0], at::full({1}, 5.0f)));
    CHECK(w.wait());
    CHECK(driver->calls.load() == 1);
  }
  SUBCASE("result() and waits on get_future() ask it too") {
    for (const bool through_future : {false, true}) {
      CAPTURE(through_future);
      distrpc::dist::Work w("broadcast");
      auto driver = std::make_shared<FinishingDriver>(w);
      w.set_wait_driver(driver);
      driver->ready = true;
      // Without the driver, the wait would end with this late completion's other value.
      std::thread late([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        w.finish({at::full({1}, 9.0f)});
      });
      const at::Tensor got = through_future ? w.get_future().value()[0] : w.result()[0];
      CHECK(at::equal(got, at::full({1}, 5.0f)));
      CHECK(driver->calls.load() == 1);
      late.join();
    }
  }
  SUBCASE("a timed wait gives the driver its deadline, then times out") {
    distrpc::dist::Work w("allreduce", 2);
    auto driver = std::make_shared<FinishingDriver>(w);
    w.set_wait_driver(driver);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(error_text<distrpc::DistBackendError>([&] { w.wait(std::chrono::milliseconds(100)); }) ==
          "Operation timed out!");
    CHECK(driver->gave_up.load());
    CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(100));
    CHECK_FALSE(w.is_completed());
    // The longest timeout still means "wait", not an overflowed deadline already past.
    std::thread backend([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      w.finish({at::full({1}, 7.0f)});
    });
    CHECK(w.wait(std::chrono::milliseconds::max()));
    backend.join();
    CHECK(at::equal(w.result()[0], at::full({1}, 7.0f)));
  }
  SUBCASE("the driver is held weakly: once gone, waits go on without it") {
    distrpc::dist::Work w("allreduce", 3);
    auto driver = std::make_shared<FinishingDriver>(w);
    w.set_wait_driver(driver);
    driver.reset();
    CHECK_THROWS_AS(w.wait(std::chrono::milliseconds(20)), distrpc::DistBackendError);
    CHECK(w.finish({at::full({1}, 1.0f)}));
    CHECK(w.wait());
  }
}

// ---- BackendConfig and the registry ----

TEST_CASE("dist BackendConfig: PyTorch's table and its errors") {
  if (!distrpc::dist::is_backend_available("dummy")) {
    distrpc::dist::register_backend(
        "dummy", [](auto, int, int, auto) { return std::shared_ptr<distrpc::dist::Backend>(); });
  }
  CHECK(distrpc::dist::is_backend_available("dummy"));
  CHECK(distrpc::dist::is_backend_available("DuMmY"));
  CHECK_FALSE(distrpc::dist::is_backend_available("nosuchbackend"));

  const std::pair<const char*, const char*> table[] = {
      {"gloo", "cpu:gloo,cuda:gloo"},
      {"GLOO", "cpu:gloo,cuda:gloo"},
      {"nccl", "cuda:nccl"},
      {"mpi", "cpu:mpi,cuda:mpi"},
      {"ucc", "cpu:ucc,cuda:ucc"},
      {"dummy", "cpu:dummy,cuda:dummy"},
      {"DUMMY", "cpu:dummy,cuda:dummy"},
      {"cpu:dummy,cuda:dummy", "cpu:dummy,cuda:dummy"},
      {"cpu:dummy,cuda:nccl", "cpu:dummy,cuda:nccl"},
      {"cpu:gloo,cuda:dummy", "cpu:gloo,cuda:dummy"},
      {"cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"},
      {"CPU:Gloo,CUDA:NCCL", "cpu:gloo,cuda:nccl"},
  };
  for (const auto& [in, expected] : table) {
    CAPTURE(in);
    CHECK(distrpc::dist::BackendConfig(in).to_string() == expected);
  }
  // "undefined": PyTorch's default per device, where that backend is registered (no NCCL here).
  if (!distrpc::dist::is_backend_available("gloo")) {
    distrpc::dist::register_backend(
        "gloo", [](auto, int, int, auto) { return std::shared_ptr<distrpc::dist::Backend>(); });
  }
  CHECK(distrpc::dist::BackendConfig("UNDEFINED").to_string() ==
        (distrpc::dist::is_backend_available("nccl") ? "cpu:gloo,cuda:nccl" : "cpu:gloo"));
  const distrpc::dist::BackendConfig cfg("cpu:gloo,cuda:nccl");
  CHECK(cfg.backend_for("CUDA") == "nccl");
  CHECK(error_text<std::invalid_argument>([&] { (void)cfg.backend_for("xpu"); }) ==
        "No backend type associated with device type xpu in backend config "
        "'cpu:gloo,cuda:nccl'");

  const std::string help =
      ".\nCustom backend string is an experimental feature where the backend string must be in "
      "the format:\n\"<device_type1>:<backend1>,<device_type2>:<backend2>...\". e.g. "
      "'cpu:gloo,cuda:nccl'";
  CHECK(error_text<std::invalid_argument>(
            [] { distrpc::dist::BackendConfig("cpu:gloo,cuda:nccl,"); }) ==
        "Invalid device:backend pairing: . The custom backend string argument is invalid: "
        "cpu:gloo,cuda:nccl," +
            help);
  CHECK(error_text<std::invalid_argument>(
            [] { distrpc::dist::BackendConfig("cpu:gloo,cuda:nccl,cpu:dummy"); }) ==
        "Duplicate device type cpu in backend string: dummy. The custom backend string argument "
        "is invalid: cpu:gloo,cuda:nccl,cpu:dummy" +
            help);
  CHECK(error_text<std::invalid_argument>([] { distrpc::dist::BackendConfig("nosuch"); }) ==
        "Invalid device:backend pairing: nosuch. The custom backend string argument is invalid: "
        "nosuch" +
            help);
}

TEST_CASE("dist backend registry: registration rules") {
  using distrpc::dist::register_backend;
  auto creator = [](auto, int, int, auto) { return std::shared_ptr<distrpc::dist::Backend>(); };
  register_backend("CpuOnlyTest", creator, {"CPU"});
  CHECK(distrpc::dist::is_backend_available("cpuonlytest"));
  CHECK(distrpc::dist::BackendConfig("cpuonlytest").to_string() == "cpu:cpuonlytest");
  CHECK(error_text<std::invalid_argument>([&] { register_backend("cpuONLYtest", creator); }) ==
        "CPUONLYTEST c10d backend already exist");
  CHECK(error_text<std::invalid_argument>([&] { register_backend("", creator); }) ==
        "register_backend: the backend name is empty");
  CHECK(error_text<std::invalid_argument>([&] { register_backend("a:b", creator); }) ==
        "register_backend: the backend name 'a:b' must not contain ':' or ','");
  CHECK(error_text<std::invalid_argument>([&] { register_backend("nocreator", nullptr); }) ==
        "register_backend: the creator of backend 'nocreator' is empty");
  CHECK(error_text<std::invalid_argument>([&] { register_backend("nodev", creator, {}); }) ==
        "register_backend: backend 'nodev' names no device type");
  CHECK(error_text<std::invalid_argument>([&] {
          register_backend("baddev", creator, {"cpu:x"});
        }) == "register_backend: backend 'baddev' has an invalid device type 'cpu:x'");
  CHECK_FALSE(distrpc::dist::is_backend_available("nocreator"));

  int calls = 0;
  register_backend("countingtest", [&](auto, int rank, int size, auto) {
    calls += rank * 10 + size;
    return std::shared_ptr<distrpc::dist::Backend>();
  });
  auto make = distrpc::dist::backend_creator("COUNTINGTEST");
  make(nullptr, 1, 4, std::chrono::milliseconds(100));
  CHECK(calls == 14);
  CHECK(error_text<std::invalid_argument>([] { distrpc::dist::backend_creator("nosuch"); }) ==
        "Backend 'nosuch' is not registered");
}
