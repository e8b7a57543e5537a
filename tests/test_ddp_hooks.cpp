// The built-in DDP communication hooks (ddp/comm_hooks.hpp, ddp/powersgd.hpp) on hand-made
// GradBuckets, two ranks, on the "distrpc" backend and on gloo where it is built in. Each rank's
// gradients are a known function of its rank, so every result is checked against a reference
// computed here from both ranks' inputs: the mean exactly (allreduce_hook), within the format's
// precision (fp16/bf16), within 1e-5 where PowerSGD's approximation is exact (a rank-1 or full
// rank gradient), and through the error-feedback identity where it is not.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/ddp/comm_hooks.hpp"
#include "distrpc/ddp/powersgd.hpp"
#include "distrpc/dist.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#include "distrpc/transport/tcp.hpp"
#ifdef USE_C10D_GLOO
#include "distrpc/dist/gloo_backend.hpp"
#endif
#include "multiprocess.hpp"
#include "support/error_text.hpp"

namespace dist = distrpc::dist;
namespace ddp = distrpc::ddp;
using distrpc::Future;
using distrpc::testing::error_text;
using distrpc::testing::RankContext;
using namespace std::chrono_literals;

namespace {

using Shapes = std::vector<std::vector<std::int64_t>>;
using Group = std::shared_ptr<dist::ProcessGroup>;

std::vector<const char*> backends() {
  std::vector<const char*> out{"distrpc"};
#ifdef USE_C10D_GLOO
  out.push_back("gloo");
#endif
  return out;
}

void register_backends() {
  if (!dist::is_backend_available("distrpc")) {
    using distrpc::transport::Auto, distrpc::transport::Shm, distrpc::transport::Tcp;
    dist::register_distrpc_backend<Auto<Shm, Tcp>>();
  }
#ifdef USE_C10D_GLOO
  if (!dist::is_backend_available("gloo")) dist::register_gloo_backend();
#endif
}

// Runs body(backend) once per backend, inside a fresh default group of both ranks.
template <class F>
void on_each_backend(const RankContext& ctx, F&& body, std::chrono::milliseconds timeout = 30s) {
  register_backends();
  for (const std::string name : backends()) {
    INFO("backend " << name);
    dist::init_process_group({.backend = name,
                              .init_method = ctx.file_url() + "-" + name,
                              .rank = ctx.rank,
                              .world_size = ctx.world,
                              .timeout = timeout});
    body(name);
    dist::destroy_process_group();
  }
}

// A bucket holding `grads` back to back (their shapes kept), as the reducer makes one.
ddp::GradBucket bucket_of(const std::vector<at::Tensor>& grads, std::size_t index = 0,
                          std::size_t count = 1) {
  std::vector<std::size_t> offsets;
  std::vector<std::size_t> lengths;
  Shapes shapes;
  std::vector<at::Tensor> flat;
  std::size_t offset = 0;
  for (const at::Tensor& g : grads) {
    offsets.push_back(offset);
    lengths.push_back(static_cast<std::size_t>(g.numel()));
    shapes.push_back(g.sizes().vec());
    flat.push_back(g.reshape({-1}));
    offset += static_cast<std::size_t>(g.numel());
  }
  return ddp::GradBucket(index, count, at::cat(flat).contiguous(), offsets, lengths, {}, shapes);
}

at::Tensor flat_of(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> flat;
  for (const at::Tensor& g : grads) flat.push_back(g.reshape({-1}));
  return at::cat(flat);
}

at::Tensor randn_seeded(at::IntArrayRef shape, std::uint64_t seed, at::ScalarType dt = at::kFloat) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)).to(dt);
}

// The value a future completes with, waiting at most 30 s (a hang fails the test, never stalls).
at::Tensor result_of(const Future<at::Tensor>& f) {
  REQUIRE(f.wait_for(30s));
  if (f.has_error()) {
    try {
      std::rethrow_exception(f.exception_ptr());
    } catch (const std::exception& e) {
      FAIL("the hook's future failed: " << std::string(e.what()));
    }
  }
  return f.value();
}

// The error text a future failed with (bounded wait); "<no error>" if it succeeded.
std::string failure_of(const Future<at::Tensor>& f) {
  REQUIRE(f.wait_for(30s));
  if (!f.has_error()) return "<no error>";
  try {
    std::rethrow_exception(f.exception_ptr());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<not a std::exception>";
}

// True where rank 0 got the same tensor, bit for bit (rank 1 checks against rank 0's).
bool same_on_both_ranks(const at::Tensor& t) {
  at::Tensor theirs = t.clone();
  dist::broadcast(theirs, 0);
  return at::equal(theirs, t);
}

bool close(const at::Tensor& got, const at::Tensor& want, double tol) {
  if (got.sizes() != want.sizes()) {
    MESSAGE("shapes differ: " << got.sizes() << " vs " << want.sizes());
    return false;
  }
  if (at::allclose(got.to(at::kDouble), want.to(at::kDouble), tol, tol)) return true;
  MESSAGE("largest difference "
          << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>()
          << " (tolerance " << tol << ")");
  return false;
}

// What DistributedDataParallel::register_comm_hook(state, hook) does with a hook: keeps the state
// and binds it into the reducer's CommHook.
template <class State, class Hook>
ddp::CommHook bind_hook(State state, Hook hook) {
  auto kept = std::make_shared<State>(std::move(state));
  return [kept, hook](ddp::GradBucket& b) { return hook(*kept, b); };
}

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want.to(at::kDouble)).norm().item<double>() /
         want.to(at::kDouble).norm().item<double>();
}

}  // namespace

// ---- allreduce_hook, fp16_compress_hook, bf16_compress_hook

DISTRPC_MP_TEST("ddp hooks: allreduce_hook averages the bucket exactly, in place", 2, 120) {
  on_each_backend(ctx, [&](const std::string&) {
    // Integral values: halves of them and their sums are exact, so the mean must be exact.
    auto input = [](int r, at::ScalarType dt) {
      return (at::arange(1000, at::kDouble).remainder(97) * (r + 1) + r).to(dt);
    };
    for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
      ddp::GradBucket b = bucket_of({input(ctx.rank, dt)});
      const at::Tensor buffer = b.buffer();
      Group none;
      at::Tensor got = result_of(ddp::allreduce_hook(none, b));
      CHECK((got.scalar_type() == dt));
      CHECK(got.data_ptr() == buffer.data_ptr());  // reduced in place, as PyTorch's hook
      CHECK(at::equal(got, (input(0, dt) + input(1, dt)) / 2));
    }
    // An explicit group; several parameters in one bucket.
    Group g = dist::new_group({0, 1});
    ddp::GradBucket b =
        bucket_of({at::full({3, 4}, ctx.rank * 4.0), at::full({5}, 10.0 + ctx.rank)});
    at::Tensor got = result_of(ddp::allreduce_hook(g, b));
    CHECK(at::equal(got.narrow(0, 0, 12), at::full({12}, 2.0)));
    CHECK(at::equal(got.narrow(0, 12, 5), at::full({5}, 10.5)));
    CHECK(at::equal(b.gradients()[0], at::full({3, 4}, 2.0)));
    // Through a CommHook, as the reducer calls it.
    ddp::CommHook hook = bind_hook(Group{}, ddp::allreduce_hook);
    ddp::GradBucket h = bucket_of({at::full({6}, 1.0 + 2 * ctx.rank)});
    CHECK(at::equal(result_of(hook(h)), at::full({6}, 2.0)));
    // Complex gradients are averaged too.
    ddp::GradBucket c =
        bucket_of({at::complex(at::full({4}, 1.0 + ctx.rank), at::full({4}, -2.0 * ctx.rank))});
    at::Tensor cgot = result_of(ddp::allreduce_hook(g, c));
    CHECK(at::equal(cgot, at::complex(at::full({4}, 1.5), at::full({4}, -1.0))));
  });
}

DISTRPC_MP_TEST("ddp hooks: fp16 and bf16 compression average within the format's precision", 2,
                120) {
  on_each_backend(ctx, [&](const std::string&) {
    const std::int64_t n = 4099;
    const at::Tensor x0 = randn_seeded({n}, 100);
    const at::Tensor x1 = randn_seeded({n}, 101);
    const at::Tensor mean = (x0.to(at::kDouble) + x1.to(at::kDouble)) / 2;
    for (at::ScalarType wire : {at::kHalf, at::kBFloat16}) {
      const double tol = wire == at::kHalf ? 2e-3 : 2e-2;  // 11 and 8 significant bits
      auto hook = wire == at::kHalf ? &ddp::fp16_compress_hook : &ddp::bf16_compress_hook;
      INFO("wire dtype " << c10::toString(wire));
      for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
        ddp::GradBucket b = bucket_of({(ctx.rank == 0 ? x0 : x1).to(dt)});
        const at::Tensor buffer = b.buffer();
        Group none;
        at::Tensor got = result_of(hook(none, b));
        CHECK((got.scalar_type() == dt));  // decompressed into the buffer's own dtype
        CHECK(got.data_ptr() == buffer.data_ptr());
        CHECK(close(got, mean, tol));
        // What the compressed sum gives, computed here: the hook did compress.
        const at::Tensor compressed =
            (x0.to(dt).to(wire).div(2) + x1.to(dt).to(wire).div(2)).to(dt);
        CHECK(at::equal(got, compressed));
        CHECK_FALSE(at::equal(got, mean.to(dt)));
        CHECK(same_on_both_ranks(got));
      }
      // A buffer already in the wire dtype is reduced in place.
      ddp::GradBucket h = bucket_of({(ctx.rank == 0 ? x0 : x1).to(wire)});
      Group none;
      at::Tensor got = result_of(hook(none, h));
      CHECK((got.scalar_type() == wire));
      CHECK(close(got, mean, tol * 2));
    }
  });
}

DISTRPC_MP_TEST("ddp hooks: bad buckets and groups are refused, naming what is wrong", 2, 120) {
  on_each_backend(ctx, [&](const std::string& backend) {
    using E = std::invalid_argument;
    Group none;
    ddp::GradBucket two_d(0, 1, at::ones({2, 3}), {0}, {6});
    CHECK(error_text<E>([&] { (void)ddp::allreduce_hook(none, two_d); }) ==
          "allreduce_hook: bucket 0's buffer must be 1-D, got shape [2, 3]");
    ddp::GradBucket strided(3, 4, at::ones({20}).slice(0, 0, 20, 2), {0}, {10});
    CHECK(error_text<E>([&] { (void)ddp::fp16_compress_hook(none, strided); }) ==
          "fp16_compress_hook: bucket 3's buffer must be contiguous, got strides [2]");
    ddp::GradBucket ints(0, 1, at::ones({4}, at::kLong), {0}, {4});
    CHECK(error_text<E>([&] { (void)ddp::allreduce_hook(none, ints); }) ==
          "allreduce_hook: bucket 0's buffer has dtype Long; this hook reduces floating-point or "
          "complex gradients");
    CHECK(at::equal(ints.buffer(), at::ones({4}, at::kLong)));  // untouched
    ddp::GradBucket cplx(0, 1, at::ones({4}, at::kComplexFloat), {0}, {4});
    CHECK(error_text<E>([&] { (void)ddp::bf16_compress_hook(none, cplx); }) ==
          "bf16_compress_hook: bucket 0's buffer has dtype ComplexFloat; this hook reduces "
          "floating-point gradients (Float, Double, Half, BFloat16)");
    ddp::PowerSGDState ps({.start_powerSGD_iter = 2});
    CHECK(error_text<E>([&] { (void)ddp::powerSGD_hook(ps, ints); }) ==
          "powerSGD_hook: bucket 0's buffer has dtype Long; this hook reduces floating-point "
          "gradients (Float, Double, Half, BFloat16)");
    CHECK(ps.iter() == 0);  // a refused call does not count

    // A group of rank 0 alone: rank 1 is not a member.
    Group only0 = dist::new_group({0});
    ddp::GradBucket b = bucket_of({at::full({4}, 3.0)});
    if (ctx.rank == 1) {
      CHECK(error_text<E>([&] { (void)ddp::allreduce_hook(only0, b); }) ==
            "allreduce_hook: this process is not a member of the process group NON_GROUP_MEMBER");
      ddp::PowerSGDState outside({.process_group = only0, .start_powerSGD_iter = 2});
      CHECK(error_text<E>([&] { (void)ddp::powerSGD_hook(outside, b); }) ==
            "powerSGD_hook: this process is not a member of the process group NON_GROUP_MEMBER");
      CHECK(at::equal(b.buffer(), at::full({4}, 3.0)));
    } else {
      CHECK(at::equal(result_of(ddp::allreduce_hook(only0, b)), at::full({4}, 3.0)));
    }

    // A destroyed group: the hooks' futures fail (they do not hang), and PowerSGD's issue order
    // does not stall the next call on the same state.
    Group gone = dist::new_group({0, 1});
    dist::destroy_process_group(gone);
    ddp::GradBucket c = bucket_of({at::ones({8})});
    const std::string failed = failure_of(ddp::allreduce_hook(gone, c));
    INFO("allreduce_hook on a destroyed group: " << failed);
    CHECK(failed.find(backend == "gloo" ? "shut down" : "after shutdown()") != std::string::npos);
    CHECK(failure_of(ddp::fp16_compress_hook(gone, c)) == failed);
    ddp::PowerSGDState on_gone({.process_group = gone,
                                .start_powerSGD_iter = 0,
                                .use_error_feedback = false,
                                .warm_start = false});
    ddp::GradBucket m = bucket_of({at::ones({8, 8})});
    CHECK(failure_of(ddp::powerSGD_hook(on_gone, m)) == failed);
    CHECK(failure_of(ddp::powerSGD_hook(on_gone, m)) == failed);
  });
}

TEST_CASE("ddp hooks: without a default process group the hooks say so") {
  REQUIRE_FALSE(dist::is_initialized());
  const std::string text =
      "Default process group has not been initialized, please make sure to call "
      "init_process_group.";
  Group none;
  ddp::GradBucket b = bucket_of({at::ones({4})});
  CHECK(error_text<std::logic_error>([&] { (void)ddp::allreduce_hook(none, b); }) == text);
  CHECK(error_text<std::logic_error>([&] { (void)ddp::fp16_compress_hook(none, b); }) == text);
  ddp::PowerSGDState state({.start_powerSGD_iter = 2});
  CHECK(error_text<std::logic_error>([&] { (void)ddp::powerSGD_hook(state, b); }) == text);
  CHECK(at::equal(b.buffer(), at::ones({4})));
}

// ---- PowerSGD

TEST_CASE("ddp hooks: PowerSGDState validates its settings with PyTorch's text") {
  using E = std::invalid_argument;
  const std::string pytorch_text =
      "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
      "because PowerSGD can only be applied after the first two iterations in DDP.";
  CHECK(error_text<E>([] { ddp::PowerSGDState s({.start_powerSGD_iter = 1}); }) == pytorch_text);
  CHECK(error_text<E>([] {
          ddp::PowerSGDState s({.start_powerSGD_iter = 0, .use_error_feedback = false});
        }) == pytorch_text);
  CHECK(error_text<E>([] {
          ddp::PowerSGDState s({.start_powerSGD_iter = 1, .warm_start = false});
        }) == pytorch_text);
  CHECK(error_text<E>([] { ddp::PowerSGDState s(nullptr, 1, 1); }) == pytorch_text);
  CHECK(error_text<E>([] { ddp::PowerSGDState s({.matrix_approximation_rank = 0}); }) ==
        "PowerSGDState: matrix_approximation_rank must be at least 1, got 0");
  CHECK(error_text<E>([] { ddp::PowerSGDState s({.min_compression_rate = -1}); }) ==
        "PowerSGDState: min_compression_rate must not be negative, got -1.000000");
  CHECK(error_text<E>([] {
          ddp::PowerSGDState s({.orthogonalization_epsilon = -1e-8});
        }).rfind("PowerSGDState: orthogonalization_epsilon must not be negative", 0) == 0);

  // Neither error feedback nor warm start: compression may start at once.
  ddp::PowerSGDState now(
      {.start_powerSGD_iter = 0, .use_error_feedback = false, .warm_start = false});
  CHECK(now.start_powerSGD_iter() == 0);
  // PyTorch's defaults, and the state moves (into register_comm_hook).
  ddp::PowerSGDState d;
  CHECK((d.process_group() == nullptr));
  CHECK(d.matrix_approximation_rank() == 1);
  CHECK(d.start_powerSGD_iter() == 1000);
  CHECK(d.min_compression_rate() == 2);
  CHECK(d.use_error_feedback());
  CHECK(d.warm_start());
  CHECK(d.orthogonalization_epsilon() == 0);
  CHECK(d.random_seed() == 0);
  CHECK_FALSE(d.batch_tensors_with_same_shape());
  CHECK(d.iter() == 0);
  CHECK(d.compression_stats().compress_rate == 0);
  ddp::PowerSGDState moved(std::move(d));
  CHECK(moved.iter() == 0);
  CHECK(error_text<std::logic_error>([&] { (void)d.iter(); }) ==
        "PowerSGDState::iter: this PowerSGDState was moved from");
}

namespace {

// Rank r's gradients of a small model (double: the checks are at 1e-5 of values up to ~10, which
// float's rounding in the products and the error feedback's cancellations exceed), rank-1 as
// matrices: weight c_r * u v^T (16 x 8), a conv
// weight d_r * a b^T viewed as 4 x 18, and a bias (never compressed). Same u, v, a, b everywhere.
std::vector<at::Tensor> rank_one_grads(int r, int step = 0) {
  const at::Tensor u = randn_seeded({16, 1}, 7 + 10 * step, at::kDouble);
  const at::Tensor v = randn_seeded({1, 8}, 8 + 10 * step, at::kDouble);
  const at::Tensor a = randn_seeded({4, 1}, 9 + 10 * step, at::kDouble);
  const at::Tensor b = randn_seeded({1, 18}, 10 + 10 * step, at::kDouble);
  return {u.mm(v) * (r + 1.0), (a.mm(b) * (2.0 - 3.0 * r)).view({4, 2, 3, 3}),
          at::arange(8, at::kDouble) * (r + 1)};
}

at::Tensor mean_of(const std::vector<at::Tensor>& g0, const std::vector<at::Tensor>& g1) {
  return (flat_of(g0) + flat_of(g1)) / 2;
}

}  // namespace

DISTRPC_MP_TEST(
    "ddp hooks: powerSGD_hook all-reduces plainly before start_powerSGD_iter, then "
    "compresses exactly where the gradients are low-rank",
    2, 120) {
  on_each_backend(ctx, [&](const std::string&) {
    ddp::PowerSGDState state({.start_powerSGD_iter = 2});
    // Iterations 0 and 1: two buckets each (the last advances the iteration), plain mean.
    for (int it = 0; it < 2; ++it) {
      for (std::size_t k = 0; k < 2; ++k) {
        auto g = rank_one_grads(ctx.rank, it);
        ddp::GradBucket b = bucket_of(g, k, 2);
        at::Tensor got = result_of(ddp::powerSGD_hook(state, b));
        CHECK(at::equal(got, mean_of(rank_one_grads(0, it), rank_one_grads(1, it))));
        CHECK(state.iter() == (k == 1 ? it + 1 : it));
      }
    }
    CHECK(state.compression_stats().numel_before_compression == 0);
    CHECK_FALSE(state.error(0).defined());

    // Iterations 2 and 3: compressed; rank-1 matrices are recovered (up to rounding).
    for (int it = 2; it < 4; ++it) {
      for (std::size_t k = 0; k < 2; ++k) {
        auto g = rank_one_grads(ctx.rank, it);
        ddp::GradBucket b = bucket_of(g, k, 2);
        const at::Tensor buffer = b.buffer();
        const at::Tensor want = mean_of(rank_one_grads(0, it), rank_one_grads(1, it));
        const at::Tensor fed =
            flat_of(g) + (state.error(k).defined() ? state.error(k) : at::zeros({208}));
        at::Tensor got = result_of(ddp::powerSGD_hook(state, b));
        CHECK(close(got, want, 1e-5));
        CHECK(at::equal(got.narrow(0, 200, 8), want.narrow(0, 200, 8)));  // the bias: exact
        CHECK(got.data_ptr() == buffer.data_ptr());
        CHECK(same_on_both_ranks(got));
        // Error feedback keeps this rank's error: what it fed in (its gradients and last error)
        // less the result. The ranks' errors cancel where the approximation is exact.
        const at::Tensor err = state.error(k);
        REQUIRE(err.defined());
        CHECK(close(err, fed - got, 1e-6));
        at::Tensor total = err.clone();
        dist::all_reduce(total);
        CHECK(total.abs().max().item<double>() < 1e-4);
        // Warm start keeps P (16 + 4 rows) and Q (8 + 18 rows) per bucket, alike on both ranks.
        CHECK(state.p_memory(k).numel() == 20);
        CHECK(state.q_memory(k).numel() == 26);
        CHECK(same_on_both_ranks(state.q_memory(k)));
      }
    }
    CHECK(state.iter() == 4);
    // Per bucket and iteration: 16x8 -> (16+8)*1, 4x18 -> (4+18)*1, the bias as it is.
    const ddp::CompressionStats s = state.compression_stats();
    CHECK(s.numel_before_compression == 4 * 208);
    CHECK(s.numel_after_compression == 4 * (24 + 22 + 8));
    CHECK(s.compress_rate == doctest::Approx(208.0 / 54.0));
  });
}

DISTRPC_MP_TEST("ddp hooks: powerSGD_hook at full rank, batched shapes, no warm start", 2, 120) {
  on_each_backend(ctx, [&](const std::string&) {
    // 12 x 3 matrices of full column rank, approximated at rank 3: exact. A rate of 0.5 makes
    // them worth compressing ((12 + 3) * 3 * 0.5 < 36). Three of one shape, one of another.
    auto grads = [](int r) {
      return std::vector<at::Tensor>{randn_seeded({12, 3}, 20 + r), randn_seeded({12, 3}, 30 + r),
                                     randn_seeded({7}, 40 + r), randn_seeded({12, 3}, 50 + r),
                                     randn_seeded({10, 4}, 60 + r)};
    };
    const at::Tensor want = mean_of(grads(0), grads(1));
    for (bool batch : {false, true}) {
      INFO("batch_tensors_with_same_shape " << batch);
      ddp::PowerSGDState state({.matrix_approximation_rank = 4,
                                .start_powerSGD_iter = 0,
                                .min_compression_rate = 0.5,
                                .use_error_feedback = false,
                                .warm_start = false,
                                .batch_tensors_with_same_shape = batch});
      for (int it = 0; it < 2; ++it) {
        ddp::GradBucket b = bucket_of(grads(ctx.rank));
        at::Tensor got = result_of(ddp::powerSGD_hook(state, b));
        CHECK(close(got, want, 1e-5));
        CHECK(same_on_both_ranks(got));
      }
      CHECK_FALSE(state.p_memory(0).defined());  // nothing kept without warm start
      CHECK_FALSE(state.error(0).defined());
      CHECK(state.compression_stats().numel_after_compression ==
            2 * (3 * (12 + 3) * 3 + 7 + (10 + 4) * 4));
    }
    // A double bucket, a 3-D gradient viewed as 6 x 10 of rank 1, random_seed changing nothing
    // in the exact result.
    ddp::PowerSGDState state({.start_powerSGD_iter = 0,
                              .use_error_feedback = false,
                              .warm_start = false,
                              .random_seed = 12345});
    auto g3 = [](int r) {
      return std::vector<at::Tensor>{
          (randn_seeded({6, 1}, 70, at::kDouble).mm(randn_seeded({1, 10}, 71, at::kDouble)) *
           (r - 0.25))
              .view({6, 2, 5})};
    };
    ddp::GradBucket b = bucket_of(g3(ctx.rank));
    at::Tensor got = result_of(ddp::powerSGD_hook(state, b));
    CHECK((got.scalar_type() == at::kDouble));
    // float16 and bfloat16 buckets (mixed-precision gradients), within their precision.
    for (at::ScalarType dt : {at::kHalf, at::kBFloat16}) {
      INFO("dtype " << c10::toString(dt));
      ddp::PowerSGDState low(
          {.start_powerSGD_iter = 0, .use_error_feedback = false, .warm_start = false});
      auto g16 = [&](int r) {
        return std::vector<at::Tensor>{
            (randn_seeded({8, 1}, 72).mm(randn_seeded({1, 6}, 73)) * (r + 1.0)).to(dt)};
      };
      ddp::GradBucket b16 = bucket_of(g16(ctx.rank));
      at::Tensor got16 = result_of(ddp::powerSGD_hook(low, b16));
      CHECK((got16.scalar_type() == dt));
      CHECK(close(got16, mean_of(g16(0), g16(1)), dt == at::kHalf ? 1e-2 : 5e-2));
    }
    CHECK(close(got, mean_of(g3(0), g3(1)), 1e-10));
  });
}

namespace {

struct FeedbackRun {
  double first = 0;  // relative error of the first compressed iteration's result
  double last = 0;   // relative error of the running mean of the results after all iterations
};

// The same gradients every iteration (one 8 x 4 matrix per rank, not low-rank), rank 1: the sum
// of the results must track the sum of the true means, the difference being this rank's error.
template <class Hook>
FeedbackRun run_feedback(const RankContext& ctx, Hook hook, bool error_feedback, int iterations) {
  const at::Tensor g0 = randn_seeded({8, 4}, 80, at::kDouble);
  const at::Tensor g1 = randn_seeded({8, 4}, 81, at::kDouble);
  const at::Tensor mine = ctx.rank == 0 ? g0 : g1;
  const at::Tensor mean = ((g0 + g1) / 2).reshape({-1});
  ddp::PowerSGDState state(
      {.start_powerSGD_iter = 2, .use_error_feedback = error_feedback, .random_seed = 3});
  at::Tensor sum = at::zeros({32}, at::kDouble);
  FeedbackRun out;
  for (int it = 0; it < 2 + iterations; ++it) {
    ddp::GradBucket b = bucket_of({mine});
    at::Tensor got = result_of(hook(state, b));
    if (it < 2) {
      CHECK(close(got, mean, 1e-12));  // plain all-reduce
      continue;
    }
    CHECK(same_on_both_ranks(got));
    sum += got;
    const int done = it - 1;
    if (done == 1) out.first = relative_error(got, mean);
    if (error_feedback) {
      // sum of results = sum of this rank's gradients - this rank's current error.
      CHECK(close(sum + state.error(0).narrow(0, 0, 32), mine.reshape({-1}) * done, 1e-9));
    } else {
      CHECK_FALSE(state.error(0).defined());
    }
  }
  out.last = relative_error(sum / iterations, mean);
  return out;
}

}  // namespace

DISTRPC_MP_TEST(
    "ddp hooks: PowerSGD's error feedback makes the results add up to the true "
    "means",
    2, 180) {
  on_each_backend(ctx, [&](const std::string&) {
    for (auto hook : {&ddp::powerSGD_hook, &ddp::batched_powerSGD_hook}) {
      INFO((hook == &ddp::powerSGD_hook ? "powerSGD_hook" : "batched_powerSGD_hook"));
      const FeedbackRun with = run_feedback(ctx, hook, true, 200);
      const FeedbackRun without = run_feedback(ctx, hook, false, 200);
      MESSAGE("relative error: first " << with.first << ", running mean " << with.last
                                       << " (without error feedback " << without.last << ")");
      CHECK(with.first > 0.1);             // one rank-1 approximation is far from the mean
      CHECK(with.last < with.first / 10);  // the accumulated results approach the true means
      CHECK(with.last < without.last / 5);
    }
  });
}

DISTRPC_MP_TEST("ddp hooks: batched_powerSGD_hook at full rank recovers the mean", 2, 120) {
  on_each_backend(ctx, [&](const std::string&) {
    // 16 elements: a 4 x 4 square of rank 4; 12: a 4 x 4 square with a zero row (rank 3). At
    // those ranks the approximation is exact.
    for (std::int64_t n : {16, 12}) {
      const int rank = n == 16 ? 4 : 3;
      ddp::PowerSGDState state({.matrix_approximation_rank = rank, .start_powerSGD_iter = 2});
      for (int it = 0; it < 4; ++it) {
        ddp::GradBucket b = bucket_of({randn_seeded({n}, 90 + ctx.rank + 2 * it)});
        const at::Tensor buffer = b.buffer();
        at::Tensor got = result_of(ddp::batched_powerSGD_hook(state, b));
        CHECK(got.data_ptr() == buffer.data_ptr());
        CHECK(got.numel() == n);
        CHECK(close(got, (randn_seeded({n}, 90 + 2 * it) + randn_seeded({n}, 91 + 2 * it)) / 2,
                    1e-5));
        CHECK(same_on_both_ranks(got));
      }
      CHECK(state.error(0).numel() == 16);  // kept for the padded square
      CHECK(state.compression_stats().numel_before_compression == 2 * n);
      CHECK(state.compression_stats().numel_after_compression == 2 * 4 * rank * 2);
    }
  });
}

// Several buckets in flight at once on one state: their collectives are issued in call order on
// every rank although each bucket's Q all-reduce is issued from a completion callback.
DISTRPC_MP_TEST("ddp hooks: PowerSGD buckets in flight together stay in step across ranks", 2,
                120) {
  on_each_backend(ctx, [&](const std::string&) {
    // Bound as the reducer binds it: the state moved into the hook.
    ddp::CommHook hook =
        bind_hook(ddp::PowerSGDState({.start_powerSGD_iter = 2}), ddp::powerSGD_hook);
    for (int it = 0; it < 5; ++it) {
      std::vector<ddp::GradBucket> buckets;
      std::vector<at::Tensor> want;
      for (std::size_t k = 0; k < 6; ++k) {
        // Buckets of different sizes: a pairing of the wrong collectives would fail loudly.
        auto g = [&](int r) {
          return std::vector<at::Tensor>{
              randn_seeded({static_cast<std::int64_t>(8 + 4 * k), 1}, 100 + k)
                  .mm(randn_seeded({1, 6}, 110 + k)) *
              (r + 1.0 + static_cast<double>(it))};
        };
        buckets.push_back(bucket_of(g(ctx.rank), k, 6));
        want.push_back(mean_of(g(0), g(1)));
      }
      std::vector<Future<at::Tensor>> futures;
      for (auto& b : buckets) futures.push_back(hook(b));
      for (std::size_t k = 0; k < futures.size(); ++k) {
        CHECK(close(result_of(futures[k]), want[k], 1e-5));
      }
    }
  });
}

// A peer that leaves: the hooks' futures fail within the group's timeout, naming a failure.
DISTRPC_MP_TEST("ddp hooks: a lost peer fails the hooks' futures instead of hanging", 2, 120) {
  on_each_backend(
      ctx,
      [&](const std::string& backend) {
        Group g = dist::new_group({0, 1});
        dist::barrier({.group = g});
        if (ctx.rank == 1) {
          dist::destroy_process_group(g);
          ctx.publish("left-" + backend, "1");
          // Stays until rank 0 is done, so that the next backend's rendezvous waits for nobody.
          (void)ctx.lookup("checked-" + backend, 60s);
          return;
        }
        (void)ctx.lookup("left-" + backend);
        ddp::GradBucket b = bucket_of({at::ones({64})});
        const std::string a = failure_of(ddp::allreduce_hook(g, b));
        MESSAGE("allreduce_hook with the peer gone (" << backend << "): " << a);
        CHECK(a != "<no error>");
        ddp::PowerSGDState state({.process_group = g,
                                  .start_powerSGD_iter = 0,
                                  .use_error_feedback = false,
                                  .warm_start = false});
        ddp::GradBucket m = bucket_of({at::ones({16, 16})});
        CHECK(failure_of(ddp::powerSGD_hook(state, m)) != "<no error>");
        ctx.publish("checked-" + backend, "1");
      },
      10s);
}
