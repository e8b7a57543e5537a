// The backend conformance suite: every collective and point-to-point call of the Backend
// interface, run against each backend listed in backends_under_test() through the interface
// only (backend_creator(name)(store, rank, size, timeout)), with results checked against values
// computed locally from every rank's (deterministic) contribution.
//  - world 1: every collective with src/dst = self;
//  - 2 and 4 processes (one per rank, meeting through a TCPStore on a free port): all ReduceOps
//    over float, double, half, bfloat16, int64, int32, uint8, bool and complex64 where the op
//    allows them, empty and non-contiguous tensors, a 4 MiB all-reduce, uneven all-to-all, tagged
//    and any-source point to point, two groups with work in flight at once, sequence numbers.
// Each world size is one launch of its processes that runs every check for every backend.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/error.hpp>
#include <distrpc/store/hash_store.hpp>
#include <distrpc/store/prefix_store.hpp>
#include <distrpc/store/tcp_store.hpp>

#include <distrpc/dist/distrpc_backend.hpp>
#include <distrpc/transport/auto.hpp>
#include <distrpc/transport/shm.hpp>
#include <distrpc/transport/tcp.hpp>
#ifdef USE_C10D_GLOO
#include <distrpc/dist/gloo_backend.hpp>
#endif

#include "multiprocess.hpp"
#include "support/error_text.hpp"

using distrpc::dist::Backend;
using distrpc::dist::ReduceOp;
using distrpc::dist::Work;
namespace dist = distrpc::dist;

namespace {

// The backends this suite runs: a name and how to register it. One line per backend.
struct BackendUnderTest {
  const char* name;
  void (*register_backend)();
};

const std::vector<BackendUnderTest>& backends_under_test() {
  static const std::vector<BackendUnderTest> table{
      // On one host Auto picks shared memory; test_dist_distrpc.cpp covers each policy.
      {"distrpc",
       [] {
         using distrpc::transport::Auto, distrpc::transport::Shm, distrpc::transport::Tcp;
         if (!dist::is_backend_available("distrpc"))
           dist::register_distrpc_backend<Auto<Shm, Tcp>>();
       }},
#ifdef USE_C10D_GLOO
      {"gloo", &dist::register_gloo_backend},
#endif
  };
  return table;
}

constexpr std::chrono::milliseconds kOpTimeout{30000};

std::shared_ptr<Backend> make_backend(const BackendUnderTest& b,
                                      std::shared_ptr<distrpc::store::Store> store, int rank,
                                      int world) {
  b.register_backend();
  REQUIRE(dist::is_backend_available(b.name));
  auto backend = dist::backend_creator(b.name)(std::move(store), rank, world, kOpTimeout);
  REQUIRE(backend != nullptr);
  CHECK(backend->name() == b.name);
  CHECK(backend->rank() == rank);
  CHECK(backend->size() == world);
  return backend;
}

using distrpc::testing::error_text;

// Waits (bounded) and returns (a copy of) the work's outputs, which the work owns.
std::vector<at::Tensor> done(const std::shared_ptr<Work>& w) {
  REQUIRE(w != nullptr);
  REQUIRE(w->wait(kOpTimeout));
  CHECK(w->is_completed());
  CHECK(w->is_success());
  return w->result();
}

// Element values shared by every contribution: small integers (exact in every dtype here,
// products of four stay below half's and bfloat16's exactness limits up to rounding).
at::Tensor pattern(int rank, at::IntArrayRef shape, int salt) {
  std::int64_t numel = 1;
  for (auto s : shape) numel *= s;
  return (at::arange(numel, at::kLong) * 3 + rank * 5 + salt * 11).remainder(7).reshape(shape);
}

// Rank `rank`'s contribution of dtype dt (salt tells calls apart).
at::Tensor contribution(int rank, at::ScalarType dt, at::IntArrayRef shape, int salt = 0) {
  at::Tensor p = pattern(rank, shape, salt);
  if (dt == at::kBool) return p.remainder(3).eq(0);
  if (at::isComplexType(dt)) {
    at::Tensor re = (p + 1).to(at::kFloat) * 0.5;
    at::Tensor im = pattern(rank + 1, shape, salt + 3).to(at::kFloat) - 3;
    return at::complex(re, im).to(dt);
  }
  if (at::isFloatingType(dt)) return ((p + 1).to(at::kDouble) * 0.5).to(dt);
  return (p + 1).to(dt);
}

// The reduction of xs under op, computed here with plain ATen ops in xs' dtype.
at::Tensor fold(const std::vector<at::Tensor>& xs, const ReduceOp& op) {
  const bool is_bool = xs[0].scalar_type() == at::kBool;
  auto scaled = [&](const at::Tensor& x) {
    if (op.kind() != ReduceOp::PREMUL_SUM) return x;
    if (op.has_scalar_factor()) return x * op.scalar_factor();
    return x * op.tensor_factor().reshape({}).to(x.scalar_type());
  };
  at::Tensor acc = scaled(xs[0]).clone();
  for (std::size_t i = 1; i < xs.size(); ++i) {
    const at::Tensor x = scaled(xs[i]);
    switch (op.kind()) {
      case ReduceOp::SUM:
      case ReduceOp::AVG:
      case ReduceOp::PREMUL_SUM:
        acc = is_bool ? at::logical_or(acc, x) : acc + x;
        break;
      case ReduceOp::PRODUCT:
        acc = is_bool ? at::logical_and(acc, x) : acc * x;
        break;
      case ReduceOp::MIN:
        acc = at::minimum(acc, x);
        break;
      case ReduceOp::MAX:
        acc = at::maximum(acc, x);
        break;
      case ReduceOp::BAND:
        acc = at::bitwise_and(acc, x);
        break;
      case ReduceOp::BOR:
        acc = at::bitwise_or(acc, x);
        break;
      case ReduceOp::BXOR:
        acc = at::bitwise_xor(acc, x);
        break;
      default:
        FAIL("fold: unexpected op " << op.describe());
    }
  }
  if (op.kind() == ReduceOp::AVG) acc = acc / static_cast<double>(xs.size());
  return acc.to(xs[0].scalar_type());
}

at::Tensor expected_reduction(int world, at::ScalarType dt, at::IntArrayRef shape,
                              const ReduceOp& op, int salt = 0) {
  std::vector<at::Tensor> xs;
  for (int r = 0; r < world; ++r) xs.push_back(contribution(r, dt, shape, salt));
  return fold(xs, op);
}

// Same dtype, shape and values (floating point within rounding of the dtype).
bool same(const at::Tensor& got, const at::Tensor& want) {
  if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes()) return false;
  if (got.numel() == 0) return true;
  const at::ScalarType t = got.scalar_type();
  if (at::isFloatingType(t) || at::isComplexType(t)) {
    const double rtol = (t == at::kHalf || t == at::kBFloat16) ? 1e-2 : 1e-6;
    const at::ScalarType wide = at::isComplexType(t) ? at::kComplexDouble : at::kDouble;
    return at::allclose(got.to(wide), want.to(wide), rtol, 1e-6);
  }
  return at::equal(got, want);
}

std::vector<ReduceOp> ops_for(at::ScalarType dt) {
  if (at::isComplexType(dt)) {
    return {ReduceOp::SUM, ReduceOp::AVG, dist::make_premul_sum(0.5)};
  }
  if (at::isFloatingType(dt)) {
    return {ReduceOp::SUM,
            ReduceOp::AVG,
            ReduceOp::PRODUCT,
            ReduceOp::MIN,
            ReduceOp::MAX,
            dist::make_premul_sum(0.5),
            dist::make_premul_sum(at::scalar_tensor(2.0, at::kDouble))};
  }
  return {ReduceOp::SUM,  ReduceOp::PRODUCT, ReduceOp::MIN, ReduceOp::MAX,
          ReduceOp::BAND, ReduceOp::BOR,     ReduceOp::BXOR};
}

const std::vector<at::ScalarType> kReduceDtypes{at::kFloat,    at::kDouble, at::kHalf,
                                                at::kBFloat16, at::kLong,   at::kInt,
                                                at::kByte,     at::kBool,   at::kComplexFloat};

const std::vector<at::ScalarType> kMoveDtypes{at::kFloat,    at::kLong,        at::kInt,
                                              at::kByte,     at::kBool,        at::kHalf,
                                              at::kBFloat16, at::kComplexFloat};

// ---- the checks; every rank runs the same calls in the same order.

void check_allreduce(Backend& b) {
  const int world = b.size();
  int salt = 0;
  for (auto dt : kReduceDtypes) {
    for (const auto& op : ops_for(dt)) {
      ++salt;
      INFO("allreduce " << op.describe() << " on " << c10::toString(dt));
      std::vector<at::Tensor> v{contribution(b.rank(), dt, {3, 5}, salt)};
      const void* data = v[0].data_ptr();
      dist::AllreduceOptions o;
      o.op = op;
      const auto& out = done(b.allreduce(v, o));
      REQUIRE(out.size() == 1);
      CHECK(out[0].data_ptr() == data);  // in place, in the caller's tensor
      CHECK(same(v[0], expected_reduction(world, dt, {3, 5}, op, salt)));
    }
  }
}

void check_refusals(Backend& b) {
  const auto seq = b.sequence_number();
  std::vector<at::Tensor> c{at::ones({2}, at::kComplexFloat)};
  dist::AllreduceOptions min;
  min.op = ReduceOp::MIN;
  CHECK(error_text<std::invalid_argument>([&] { b.allreduce(c, min); }) ==
        "all_reduce does not support ReduceOp.MIN on complex tensors");
  std::vector<at::Tensor> f{at::ones({2})};
  dist::AllreduceOptions band;
  band.op = ReduceOp::BAND;
  CHECK(error_text<std::invalid_argument>([&] { b.allreduce(f, band); }) ==
        "Cannot use ReduceOp.BAND with non-integral dtype Float");
  std::vector<at::Tensor> two{at::ones({2}), at::ones({2})};
  CHECK(error_text<std::invalid_argument>([&] {
          b.allreduce(two);
        }).find("expects exactly one input tensor, got 2") != std::string::npos);
  dist::BroadcastOptions bad_root;
  bad_root.root_rank = b.size();
  CHECK(error_text<std::invalid_argument>([&] { b.broadcast(f, bad_root); })
            .find("root rank " + std::to_string(b.size()) + " is outside the group of size " +
                  std::to_string(b.size())) != std::string::npos);
  std::vector<at::Tensor> undefined{at::Tensor()};
  CHECK(error_text<std::invalid_argument>([&] {
          b.allreduce(undefined);
        }).find("input 0 is undefined") != std::string::npos);
  std::vector<std::vector<at::Tensor>> go(1);
  for (int r = 0; r < b.size(); ++r) go[0].push_back(at::zeros({2}, at::kDouble));
  CHECK(error_text<std::invalid_argument>([&] { b.allgather(go, f); }) ==
        "Invalid usage of tensors with different dtypes Found Float and Double");
  std::vector<at::Tensor> mixed{at::ones({2}), at::ones({2}, at::kDouble)};
  CHECK(error_text<std::invalid_argument>([&] { b.allreduce_coalesced(mixed); }) ==
        "Invalid usage of tensors with different dtypes Found Float and Double");
  CHECK(error_text<std::invalid_argument>([&] { b.send(f, b.rank(), 0); }) ==
        "Invalid destination rank: destination rank should not be the same as the rank of the "
        "current process.");
  CHECK(error_text<std::invalid_argument>([&] { b.recv(f, b.rank(), 0); }) ==
        "Invalid source rank: source rank should not be the same as the rank of the current "
        "process.");
  // Every backend shares these texts (Backend's argument checks).
  const std::string n = std::to_string(b.size());
  const std::string n1 = std::to_string(b.size() + 1);
  std::vector<at::Tensor> r{at::ones({1})};
  CHECK(error_text<std::invalid_argument>([&] { b.recv(r, b.size(), 0); }) ==
        "recv: source rank " + n + " is outside the group of size " + n);
  dist::BroadcastOptions bad_tensor;
  bad_tensor.root_tensor = 1;
  CHECK(error_text<std::invalid_argument>([&] { b.broadcast(f, bad_tensor); }) ==
        "broadcast: root tensor must be 0 (one tensor per call), got 1");
  std::vector<std::vector<at::Tensor>> two_lists(2, go[0]);
  CHECK(error_text<std::invalid_argument>([&] { b.allgather(two_lists, f); }) ==
        "allgather: expects one output list, got 2");
  std::vector<at::Tensor> too_many(static_cast<std::size_t>(b.size() + 1), at::ones({1}));
  std::vector<at::Tensor> enough(static_cast<std::size_t>(b.size()), at::ones({1}));
  CHECK(error_text<std::invalid_argument>([&] { b.alltoall(enough, too_many); }) ==
        "alltoall: expects " + n + " input tensors (one per rank), got " + n1);
  at::Tensor rows = at::zeros({b.size(), 2});
  CHECK(error_text<std::invalid_argument>([&] {
          b.alltoall_base(rows, rows, std::vector<std::int64_t>(b.size() + 1, 0), {});
        }) == "alltoall_base: the output split sizes have " + n1 + " entries, expected " + n);
  dist::BarrierOptions zero;
  zero.timeout = std::chrono::milliseconds(0);
  CHECK(error_text<std::invalid_argument>([&] {
          b.barrier(zero);
        }).find("the timeout must be positive, got 0 ms") != std::string::npos);
  // A refused call is not issued: the sequence number is unchanged.
  CHECK(b.sequence_number() == seq);
}

void check_layouts(Backend& b) {
  const int world = b.size();
  const int me = b.rank();
  {
    INFO("allreduce on a transposed view lands in the base tensor");
    at::Tensor base = at::zeros({5, 3});
    at::Tensor view = base.t();  // 3 x 5, not contiguous
    REQUIRE_FALSE(view.is_contiguous());
    view.copy_(contribution(me, at::kFloat, {3, 5}, 100));
    std::vector<at::Tensor> v{view};
    done(b.allreduce(v));
    CHECK(same(base.t(), expected_reduction(world, at::kFloat, {3, 5}, ReduceOp::SUM, 100)));
  }
  {
    INFO("allreduce on a strided slice leaves the elements between untouched");
    at::Tensor base = at::full({10}, -1, at::kLong);
    at::Tensor view = base.slice(0, 0, 10, 2);
    view.copy_(contribution(me, at::kLong, {5}, 101));
    std::vector<at::Tensor> v{view};
    dist::AllreduceOptions o;
    o.op = ReduceOp::MAX;
    done(b.allreduce(v, o));
    CHECK(same(base.slice(0, 0, 10, 2),
               expected_reduction(world, at::kLong, {5}, ReduceOp::MAX, 101)));
    CHECK(at::equal(base.slice(0, 1, 10, 2), at::full({5}, -1, at::kLong)));
  }
  {
    INFO("AVG and bool on transposed views");
    at::Tensor fb = at::zeros({4, 2}, at::kDouble);
    fb.t().copy_(contribution(me, at::kDouble, {2, 4}, 102));
    std::vector<at::Tensor> v{fb.t()};
    dist::AllreduceOptions avg;
    avg.op = ReduceOp::AVG;
    done(b.allreduce(v, avg));
    CHECK(same(fb.t(), expected_reduction(world, at::kDouble, {2, 4}, ReduceOp::AVG, 102)));
    at::Tensor bb = at::zeros({4, 2}, at::kBool);
    bb.t().copy_(contribution(me, at::kBool, {2, 4}, 103));
    std::vector<at::Tensor> w{bb.t()};
    done(b.allreduce(w));
    CHECK(same(bb.t(), expected_reduction(world, at::kBool, {2, 4}, ReduceOp::SUM, 103)));
  }
  {
    INFO("empty tensors");
    std::vector<at::Tensor> e{at::empty({0})};
    const auto& out = done(b.allreduce(e));
    CHECK(out[0].numel() == 0);
    std::vector<at::Tensor> eb{at::empty({0, 3}, at::kLong)};
    dist::BroadcastOptions bo;
    bo.root_rank = world - 1;
    CHECK(done(b.broadcast(eb, bo))[0].sizes() == at::IntArrayRef({0, 3}));
    std::vector<std::vector<at::Tensor>> go(1);
    for (int r = 0; r < world; ++r) go[0].push_back(at::empty({0}));
    std::vector<at::Tensor> gi{at::empty({0})};
    CHECK(done(b.allgather(go, gi)).size() == static_cast<std::size_t>(world));
    at::Tensor eo = at::empty({0, 2});
    at::Tensor ei = at::empty({0, 2});
    CHECK(done(b.allgather_into_tensor(eo, ei))[0].numel() == 0);
    std::vector<std::vector<at::Tensor>> gather_out;
    if (me == 0) gather_out.push_back(go[0]);
    dist::GatherOptions g0;
    done(b.gather(gather_out, gi, g0));
    std::vector<std::vector<at::Tensor>> scatter_in;
    if (me == 0) scatter_in.push_back(go[0]);
    std::vector<at::Tensor> so{at::empty({0})};
    done(b.scatter(so, scatter_in));
    std::vector<at::Tensor> rs_out{at::empty({0})};
    at::Tensor rs_in = at::empty({0});
    done(b.reduce_scatter_tensor(rs_out[0], rs_in));
    at::Tensor a_out = at::empty({0, 2}, at::kLong);
    at::Tensor a_in = at::empty({0, 2}, at::kLong);
    std::vector<std::int64_t> zeros(world, 0);
    done(b.alltoall_base(a_out, a_in, zeros, zeros));
  }
  {
    INFO("a 4 MiB all-reduce");
    const std::int64_t n = std::int64_t{1} << 20;
    std::vector<at::Tensor> big{at::full({n}, static_cast<float>(me + 1))};
    done(b.allreduce(big));
    CHECK(at::equal(big[0], at::full({n}, static_cast<float>(world * (world + 1) / 2))));
  }
}

void check_coalesced(Backend& b) {
  const int world = b.size();
  const int me = b.rank();
  {
    INFO("all_reduce_coalesced of ones(10, 10) gives the world size");
    std::vector<at::Tensor> ts{at::ones({10, 10}), at::ones({10, 10})};
    const auto& out = done(b.allreduce_coalesced(ts));
    REQUIRE(out.size() == 2);
    for (const auto& t : ts) CHECK(at::equal(t, at::full({10, 10}, static_cast<float>(world))));
  }
  for (const ReduceOp& op : {ReduceOp(ReduceOp::AVG), ReduceOp(ReduceOp::MAX)}) {
    INFO("all_reduce_coalesced " << op.describe());
    std::vector<at::Tensor> ts{contribution(me, at::kDouble, {4}, 200),
                               contribution(me, at::kDouble, {2, 3}, 201)};
    dist::AllreduceCoalescedOptions o;
    o.op = op;
    done(b.allreduce_coalesced(ts, o));
    CHECK(same(ts[0], expected_reduction(world, at::kDouble, {4}, op, 200)));
    CHECK(same(ts[1], expected_reduction(world, at::kDouble, {2, 3}, op, 201)));
  }
}

void check_broadcast(Backend& b) {
  const int world = b.size();
  const int me = b.rank();
  for (int root = 0; root < world; ++root) {
    for (auto dt : kMoveDtypes) {
      INFO("broadcast " << c10::toString(dt) << " from " << root);
      const at::Tensor want = contribution(root, dt, {3, 4}, 300);
      std::vector<at::Tensor> v{me == root ? want.clone() : at::zeros({3, 4}, dt)};
      dist::BroadcastOptions o;
      o.root_rank = root;
      done(b.broadcast(v, o));
      CHECK(same(v[0], want));
    }
    {
      INFO("broadcast bool [1, 0, 0, 1] from " << root);
      const at::Tensor want = at::tensor(std::vector<std::int64_t>{1, 0, 0, 1}).to(at::kBool);
      std::vector<at::Tensor> v{me == root ? want.clone() : at::zeros({4}, at::kBool)};
      dist::BroadcastOptions o;
      o.root_rank = root;
      done(b.broadcast(v, o));
      CHECK(at::equal(v[0], want));
    }
    {
      INFO("broadcast into a transposed view from " << root);
      const at::Tensor want = contribution(root, at::kFloat, {2, 3}, 301);
      at::Tensor base = at::zeros({3, 2});
      if (me == root) base.t().copy_(want);
      std::vector<at::Tensor> v{base.t()};
      dist::BroadcastOptions o;
      o.root_rank = root;
      done(b.broadcast(v, o));
      CHECK(same(base.t(), want));
    }
  }
}

void check_reduce(Backend& b) {
  const int world = b.size();
  const int me = b.rank();
  const std::vector<std::pair<at::ScalarType, ReduceOp>> cases{
      {at::kFloat, ReduceOp::SUM},        {at::kLong, ReduceOp::MAX},
      {at::kDouble, ReduceOp::AVG},       {at::kInt, ReduceOp::BXOR},
      {at::kBool, ReduceOp::PRODUCT},     {at::kFloat, dist::make_premul_sum(2.0)},
      {at::kComplexFloat, ReduceOp::SUM}, {at::kBFloat16, ReduceOp::MIN}};
  for (int root = 0; root < world; ++root) {
    int salt = 400;
    for (const auto& [dt, op] : cases) {
      ++salt;
      INFO("reduce " << op.describe() << " on " << c10::toString(dt) << " to " << root);
      std::vector<at::Tensor> v{contribution(me, dt, {2, 3}, salt)};
      dist::ReduceOptions o;
      o.op = op;
      o.root_rank = root;
      done(b.reduce(v, o));
      if (me == root) CHECK(same(v[0], expected_reduction(world, dt, {2, 3}, op, salt)));
    }
  }
}

void check_gathers(Backend& b) {
  const int world = b.size();
  const int me = b.rank();
  for (auto dt : {at::kFloat, at::kInt, at::kBool, at::kComplexFloat, at::kBFloat16}) {
    INFO("allgather " << c10::toString(dt));
    std::vector<std::vector<at::Tensor>> out(1);
    at::Tensor t_base = at::zeros({3, 2}, dt);  // output 0 is a transposed view into it
    for (int r = 0; r < world; ++r) out[0].push_back(r == 0 ? t_base.t() : at::zeros({2, 3}, dt));
    std::vector<at::Tensor> in{contribution(me, dt, {2, 3}, 500)};
    const auto& res = done(b.allgather(out, in));
    CHECK(res.size() == static_cast<std::size_t>(world));
    CHECK(same(t_base.t(), contribution(0, dt, {2, 3}, 500)));
    for (int r = 0; r < world; ++r) CHECK(same(out[0][r], contribution(r, dt, {2, 3}, 500)));
  }
  for (bool transposed : {false, true}) {
    INFO("allgather_into_tensor, transposed output: " << transposed);
    at::Tensor base = transposed ? at::zeros({3, 2 * world}) : at::zeros({2 * world, 3});
    at::Tensor output = transposed ? base.t() : base;
    at::Tensor input = contribution(me, at::kFloat, {2, 3}, 501);
    done(b.allgather_into_tensor(output, input));
    for (int r = 0; r < world; ++r) {
      CHECK(same(output.narrow(0, 2 * r, 2), contribution(r, at::kFloat, {2, 3}, 501)));
    }
  }
  for (int root = 0; root < world; ++root) {
    INFO("gather to " << root);
    std::vector<std::vector<at::Tensor>> out;
    if (me == root) {
      out.emplace_back();
      for (int r = 0; r < world; ++r) out[0].push_back(at::zeros({4}, at::kLong));
    }
    std::vector<at::Tensor> in{contribution(me, at::kLong, {4}, 502 + root)};
    dist::GatherOptions o;
    o.root_rank = root;
    done(b.gather(out, in, o));
    if (me == root) {
      for (int r = 0; r < world; ++r) {
        CHECK(same(out[0][r], contribution(r, at::kLong, {4}, 502 + root)));
      }
    }
  }
  for (int root = 0; root < world; ++root) {
    INFO("scatter from " << root);
    std::vector<std::vector<at::Tensor>> in;
    if (me == root) {
      in.emplace_back();
      for (int r = 0; r < world; ++r) in[0].push_back(contribution(r, at::kDouble, {3}, 600));
    }
    at::Tensor base = at::zeros({6}, at::kDouble);
    std::vector<at::Tensor> out{base.slice(0, 0, 6, 2)};  // strided output
    dist::ScatterOptions o;
    o.root_rank = root;
    done(b.scatter(out, in, o));
    CHECK(same(base.slice(0, 0, 6, 2), contribution(me, at::kDouble, {3}, 600)));
  }
}

void check_reduce_scatter(Backend& b) {
  const int world = b.size();
  const int me = b.rank();
  const std::vector<std::pair<at::ScalarType, ReduceOp>> cases{
      {at::kFloat, ReduceOp::SUM}, {at::kLong, ReduceOp::MAX},
      {at::kFloat, ReduceOp::AVG}, {at::kDouble, dist::make_premul_sum(0.5)},
      {at::kBool, ReduceOp::SUM},  {at::kComplexFloat, ReduceOp::SUM}};
  for (const auto& [dt, op] : cases) {
    INFO("reduce_scatter " << op.describe() << " on " << c10::toString(dt));
    std::vector<std::vector<at::Tensor>> in(1);
    for (int j = 0; j < world; ++j) in[0].push_back(contribution(me, dt, {2, 2}, 700 + j));
    const at::Tensor my_input_copy = in[0][me].clone();
    std::vector<at::Tensor> out{at::zeros({2, 2}, dt)};
    dist::ReduceScatterOptions o;
    o.op = op;
    done(b.reduce_scatter(out, in, o));
    CHECK(same(out[0], expected_reduction(world, dt, {2, 2}, op, 700 + me)));
    CHECK(at::equal(in[0][me], my_input_copy));  // inputs are not written
  }
  for (const ReduceOp& op : {ReduceOp(ReduceOp::SUM), ReduceOp(ReduceOp::PRODUCT)}) {
    INFO("reduce_scatter_tensor " << op.describe());
    at::Tensor input = contribution(me, at::kInt, {2 * world, 3}, 710);
    at::Tensor base = at::zeros({3, 2}, at::kInt);
    at::Tensor output = base.t();  // non-contiguous output
    dist::ReduceScatterOptions o;
    o.op = op;
    done(b.reduce_scatter_tensor(output, input, o));
    std::vector<at::Tensor> slices;
    for (int r = 0; r < world; ++r) {
      slices.push_back(contribution(r, at::kInt, {2 * world, 3}, 710).narrow(0, 2 * me, 2));
    }
    CHECK(same(base.t(), fold(slices, op)));
  }
}

void check_alltoall(Backend& b) {
  const int world = b.size();
  const int me = b.rank();
  {
    INFO("alltoall_base, equal splits");
    // Row k of sender s's input holds s * 100 + k; receiver me gets rows 2me, 2me + 1 of each.
    at::Tensor input = (at::arange(2 * world, at::kLong) + me * 100).unsqueeze(1).repeat({1, 3});
    at::Tensor output = at::zeros({2 * world, 3}, at::kLong);
    done(b.alltoall_base(output, input, {}, {}));
    for (int s = 0; s < world; ++s) {
      for (int k = 0; k < 2; ++k) {
        CHECK(at::equal(output[2 * s + k], at::full({3}, s * 100 + 2 * me + k, at::kLong)));
      }
    }
  }
  for (auto dt : {at::kLong, at::kFloat, at::kBool}) {
    INFO("alltoall_base, uneven splits, " << c10::toString(dt));
    // Sender s sends s + j + 1 rows to j, valued s * 100 + j * 10 + row (bool: its parity).
    std::vector<std::int64_t> in_splits;
    std::vector<std::int64_t> out_splits;
    std::vector<at::Tensor> rows;
    for (int j = 0; j < world; ++j) {
      in_splits.push_back(me + j + 1);
      out_splits.push_back(j + me + 1);
      rows.push_back(at::arange(me + j + 1, at::kLong) + me * 100 + j * 10);
    }
    auto as = [&](const at::Tensor& x) {
      return dt == at::kBool ? x.remainder(2).eq(1) : x.to(dt);
    };
    at::Tensor input = as(at::cat(rows).unsqueeze(1).repeat({1, 2}));
    std::int64_t total = 0;
    for (auto s : out_splits) total += s;
    at::Tensor output = at::zeros({total, 2}, dt);
    done(b.alltoall_base(output, input, out_splits, in_splits));
    std::int64_t offset = 0;
    for (int s = 0; s < world; ++s) {
      const at::Tensor want =
          as((at::arange(s + me + 1, at::kLong) + s * 100 + me * 10).unsqueeze(1).repeat({1, 2}));
      CHECK(at::equal(output.narrow(0, offset, s + me + 1), want));
      offset += s + me + 1;
    }
  }
  {
    INFO("alltoall of tensor lists with different sizes");
    std::vector<at::Tensor> in;
    std::vector<at::Tensor> out;
    for (int j = 0; j < world; ++j) {
      in.push_back(at::full({me + j + 1}, me * 10 + j, at::kLong));
      out.push_back(at::zeros({j + me + 1}, at::kLong));
    }
    done(b.alltoall(out, in));
    for (int s = 0; s < world; ++s) {
      CHECK(at::equal(out[s], at::full({s + me + 1}, s * 10 + me, at::kLong)));
    }
  }
}

void check_point_to_point(Backend& b) {
  const int world = b.size();
  const int me = b.rank();
  const int next = (me + 1) % world;
  const int prev = (me + world - 1) % world;
  {
    INFO("send and recv matched by tag, received out of order");
    std::vector<at::Tensor> s1{at::full({4}, me * 10 + 1, at::kLong)};
    std::vector<at::Tensor> s2{at::full({4}, me * 10 + 2, at::kLong)};
    std::vector<at::Tensor> s3{contribution(me, at::kBool, {2, 3}, 800)};
    auto w1 = b.send(s1, next, 1);
    auto w2 = b.send(s2, next, 2);
    auto w3 = b.send(s3, next, 3);
    std::vector<at::Tensor> r2{at::zeros({4}, at::kLong)};
    std::vector<at::Tensor> r1{at::zeros({4}, at::kLong)};
    at::Tensor base = at::zeros({3, 2}, at::kBool);
    std::vector<at::Tensor> r3{base.t()};  // non-contiguous receive buffer
    auto v2 = b.recv(r2, prev, 2);
    auto v1 = b.recv(r1, prev, 1);
    auto v3 = b.recv(r3, prev, 3);
    done(v2);
    done(v1);
    done(v3);
    CHECK(at::equal(r1[0], at::full({4}, prev * 10 + 1, at::kLong)));
    CHECK(at::equal(r2[0], at::full({4}, prev * 10 + 2, at::kLong)));
    CHECK(same(base.t(), contribution(prev, at::kBool, {2, 3}, 800)));
    CHECK(v1->source_rank() == prev);
    CHECK(v1->sequence_number() == -1);
    CHECK(w1->sequence_number() == -1);
    done(w1);
    done(w2);
    done(w3);
  }
  {
    INFO("recv_anysource reports each sender");
    if (me == 0) {
      std::vector<std::shared_ptr<Work>> works;
      std::vector<std::vector<at::Tensor>> bufs(world - 1);
      for (int i = 0; i < world - 1; ++i) {
        bufs[i] = {at::full({3}, -1, at::kInt)};
        works.push_back(b.recv_anysource(bufs[i], 5));
      }
      std::set<int> sources;
      for (int i = 0; i < world - 1; ++i) {
        done(works[i]);
        const int src = works[i]->source_rank();
        sources.insert(src);
        CHECK(at::equal(bufs[i][0], at::full({3}, src, at::kInt)));
      }
      std::set<int> want;
      for (int r = 1; r < world; ++r) want.insert(r);
      CHECK(sources == want);
    } else {
      std::vector<at::Tensor> t{at::full({3}, me, at::kInt)};
      done(b.send(t, 0, 5));
    }
  }
  std::vector<at::Tensor> bad{at::ones({1})};
  CHECK(error_text<std::invalid_argument>([&] {
          b.send(bad, world, 0);
        }).find("destination rank " + std::to_string(world) + " is outside the group") !=
        std::string::npos);
}

// Two groups (two backends) with work in flight on both at once, waited at the end.
void check_in_flight(Backend& b, Backend& b2) {
  const int world = b.size();
  const int me = b.rank();
  std::vector<at::Tensor> x1{contribution(me, at::kFloat, {64}, 900)};
  std::vector<at::Tensor> x2{contribution(me, at::kLong, {64}, 901)};
  std::vector<at::Tensor> y{me == 0 ? contribution(0, at::kDouble, {8}, 902)
                                    : at::zeros({8}, at::kDouble)};
  std::vector<std::vector<at::Tensor>> g(1);
  for (int r = 0; r < world; ++r) g[0].push_back(at::zeros({5}, at::kInt));
  std::vector<at::Tensor> gi{contribution(me, at::kInt, {5}, 903)};
  std::vector<at::Tensor> x3{contribution(me, at::kFloat, {16}, 904)};
  dist::AllreduceOptions max;
  max.op = ReduceOp::MAX;
  std::vector<std::shared_ptr<Work>> works;
  works.push_back(b.allreduce(x1));
  works.push_back(b2.allreduce(x2, max));
  works.push_back(b.broadcast(y));
  works.push_back(b2.allgather(g, gi));
  works.push_back(b.allreduce(x3));
  works.push_back(b2.barrier());
  works.push_back(b.barrier());
  for (auto& w : works) done(w);
  CHECK(same(x1[0], expected_reduction(world, at::kFloat, {64}, ReduceOp::SUM, 900)));
  CHECK(same(x2[0], expected_reduction(world, at::kLong, {64}, ReduceOp::MAX, 901)));
  CHECK(same(y[0], contribution(0, at::kDouble, {8}, 902)));
  for (int r = 0; r < world; ++r) CHECK(same(g[0][r], contribution(r, at::kInt, {5}, 903)));
  CHECK(same(x3[0], expected_reduction(world, at::kFloat, {16}, ReduceOp::SUM, 904)));
}

// Sequence numbers: each collective takes the next one, and every rank has the same count, even
// after point-to-point calls that differ between ranks (recv_anysource above: rank 0 receives
// world - 1 times, the others send once), which take none.
void check_sequence_numbers(Backend& b) {
  const auto before = b.sequence_number();
  auto w = b.barrier();
  done(w);
  CHECK(w->sequence_number() == static_cast<std::int64_t>(before + 1));
  CHECK(b.sequence_number() == before + 1);
  const auto mine = b.sequence_number();
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < b.size(); ++r) out[0].push_back(at::zeros({1}, at::kLong));
  std::vector<at::Tensor> in{at::full({1}, static_cast<std::int64_t>(mine), at::kLong)};
  done(b.allgather(out, in));
  for (int r = 0; r < b.size(); ++r) {
    CHECK(out[0][r].item<std::int64_t>() == static_cast<std::int64_t>(mine));
  }
}

// A per-call timeout fails the Work when the peers are late, without upsetting later calls.
void check_call_timeout(Backend& b) {
  if (b.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  dist::BarrierOptions o;
  if (b.rank() == 0) o.timeout = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  auto w = b.barrier(o);
  if (b.rank() == 0) {
    const std::string text = error_text<distrpc::DistBackendError>([&] { w->wait(kOpTimeout); });
    CHECK(text.find("Timeout") != std::string::npos);
    CHECK(text.find("barrier (sequence number " + std::to_string(w->sequence_number()) + ")") !=
          std::string::npos);
    CHECK(text.find("timed out after 300 ms") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(1400));
    CHECK_FALSE(w->is_success());
  } else {
    done(w);
  }
  std::vector<at::Tensor> t{at::ones({2})};
  done(b.allreduce(t));
  CHECK(at::equal(t[0], at::full({2}, static_cast<float>(b.size()))));
}

void run_all_checks(Backend& b, Backend& b2) {
  check_refusals(b);
  check_allreduce(b);
  check_layouts(b);
  check_coalesced(b);
  check_broadcast(b);
  check_reduce(b);
  check_gathers(b);
  check_reduce_scatter(b);
  check_alltoall(b);
  if (b.size() > 1) check_point_to_point(b);
  check_in_flight(b, b2);
  check_sequence_numbers(b);
  if (b.size() > 1) check_call_timeout(b);
  // Leave together, so no member tears its connections down under another.
  done(b2.barrier());
  done(b.barrier());
}

void run_ranks_for_every_backend(const distrpc::testing::RankContext& ctx) {
  std::shared_ptr<distrpc::store::TCPStore> tcp;
  if (ctx.rank == 0) {
    tcp = std::make_shared<distrpc::store::TCPStore>("127.0.0.1", 0, ctx.world, true,
                                                     std::chrono::seconds(30));
    ctx.publish("port", std::to_string(tcp->port()));
  } else {
    tcp = std::make_shared<distrpc::store::TCPStore>("127.0.0.1", std::stoi(ctx.lookup("port")),
                                                     ctx.world, false, std::chrono::seconds(30));
  }
  for (const auto& under_test : backends_under_test()) {
    INFO("backend " << under_test.name << ", rank " << ctx.rank << " of " << ctx.world);
    const std::string prefix = std::string(under_test.name) + "/";
    auto b =
        make_backend(under_test, std::make_shared<distrpc::store::PrefixStore>(prefix + "a", tcp),
                     ctx.rank, ctx.world);
    auto b2 =
        make_backend(under_test, std::make_shared<distrpc::store::PrefixStore>(prefix + "b", tcp),
                     ctx.rank, ctx.world);
    run_all_checks(*b, *b2);
    b2->shutdown();
    b->shutdown();
  }
}

}  // namespace

TEST_CASE("backend conformance: each listed backend registers under its name") {
  for (const auto& b : backends_under_test()) {
    INFO("backend " << b.name);
    b.register_backend();
    CHECK(dist::is_backend_available(b.name));
    CHECK(dist::backend_creator(b.name) != nullptr);
  }
}

TEST_CASE("backend conformance: world of one, every collective with src/dst = self") {
  for (const auto& under_test : backends_under_test()) {
    INFO("backend " << under_test.name);
    auto store = std::make_shared<distrpc::store::HashStore>(std::chrono::seconds(30));
    auto b =
        make_backend(under_test, std::make_shared<distrpc::store::PrefixStore>("a", store), 0, 1);
    auto b2 =
        make_backend(under_test, std::make_shared<distrpc::store::PrefixStore>("b", store), 0, 1);
    run_all_checks(*b, *b2);
  }
}

DISTRPC_MP_TEST("backend conformance: 2 processes", 2, 120) {
  run_ranks_for_every_backend(ctx);
}

DISTRPC_MP_TEST("backend conformance: 4 processes", 4, 180) {
  run_ranks_for_every_backend(ctx);
}
