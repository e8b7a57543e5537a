// The "distrpc" collective backend (dist/distrpc_backend.hpp): every collective against values
// computed locally, on Tcp, Shm and Auto<Shm, Tcp> at world 2 and 4 with both algorithms (direct
// exchange and the chunked ring), point to point, a member killed with SIGKILL, a member that skips
// a collective (timeout), TORCH_DISTRIBUTED_DEBUG=DETAIL mismatches, size mismatches without it,
// and the bad-input paths.
#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/store/file_store.hpp"
#include "distrpc/store/hash_store.hpp"
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#include "distrpc/transport/tcp.hpp"
#include "multiprocess.hpp"
#include "support/error_text.hpp"

using namespace std::chrono_literals;
using distrpc::DistBackendError;
using distrpc::dist::AllreduceOptions;
using distrpc::dist::Backend;
using distrpc::dist::DistrpcBackend;
using distrpc::dist::DistrpcBackendOptions;
using distrpc::dist::ReduceOp;
using distrpc::dist::Work;
using distrpc::testing::RankContext;
using distrpc::testing::RunOptions;
using distrpc::transport::Auto;
using distrpc::transport::Shm;
using distrpc::transport::Tcp;
using Clock = std::chrono::steady_clock;

namespace distrpc_backend_test {

template <class T>
std::shared_ptr<DistrpcBackend<T>> make_backend(const RankContext& ctx,
                                                std::chrono::milliseconds timeout = 60s,
                                                DistrpcBackendOptions o = {},
                                                const std::string& store_name = "store") {
  auto store = std::make_shared<distrpc::store::FileStore>(ctx.dir + "/" + store_name, ctx.world);
  return std::make_shared<DistrpcBackend<T>>(store, ctx.rank, ctx.world, timeout, o);
}

// Rank q's contribution: integral values, so float sums are exact and comparable with equal().
at::Tensor input_of(int q, std::int64_t n, at::ScalarType dtype = at::kFloat) {
  return (at::arange(n, at::kDouble).remainder(1000) * (q + 1) + q).to(dtype);
}

std::string error_of(const std::shared_ptr<Work>& w) {
  try {
    w->wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

using distrpc::testing::contains;

long long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

void check_allreduce(Backend& b, std::int64_t n, const ReduceOp& op, at::ScalarType dtype) {
  const int w = b.size();
  std::vector<at::Tensor> t{input_of(b.rank(), n, dtype)};
  AllreduceOptions o;
  o.op = op;
  REQUIRE(b.allreduce(t, o)->wait());
  at::Tensor expect = input_of(0, n, at::kDouble);
  for (int q = 1; q < w; ++q) {
    const at::Tensor x = input_of(q, n, at::kDouble);
    switch (op.kind()) {
      case ReduceOp::MAX:
        expect = at::maximum(expect, x);
        break;
      case ReduceOp::MIN:
        expect = at::minimum(expect, x);
        break;
      default:
        expect = expect + x;
    }
  }
  if (op.kind() == ReduceOp::AVG) expect = expect / w;
  if (op.kind() == ReduceOp::PREMUL_SUM) expect = expect * op.scalar_factor();
  CHECK_MESSAGE(at::allclose(t[0].to(at::kDouble), expect),
                "allreduce of " << n << " elements, " << op.describe());
}

// Every collective once, against values computed here.
template <class T>
void run_suite(const RankContext& ctx, DistrpcBackendOptions opts) {
  auto b = make_backend<T>(ctx, 60s, opts);
  const int r = ctx.rank;
  const int w = ctx.world;
  CHECK(b->name() == "distrpc");
  CHECK(b->sequence_number() == 0);

  // allreduce: small (direct exchange) and large (ring), odd counts not divisible by the world.
  check_allreduce(*b, 4, ReduceOp::SUM, at::kFloat);
  check_allreduce(*b, 1, ReduceOp::MAX, at::kFloat);
  check_allreduce(*b, 3, ReduceOp::SUM, at::kLong);  // fewer elements than members at world 4
  check_allreduce(*b, 3 * 1024 * 1024 / 4, ReduceOp::SUM, at::kFloat);  // 3 MiB
  check_allreduce(*b, 786433, ReduceOp::SUM, at::kFloat);
  check_allreduce(*b, 786433, ReduceOp::MIN, at::kDouble);
  check_allreduce(*b, 100003, ReduceOp::AVG, at::kDouble);
  check_allreduce(*b, 100003, distrpc::dist::make_premul_sum(0.5), at::kDouble);
  check_allreduce(*b, 7, distrpc::dist::make_premul_sum(2.0), at::kDouble);

  // A non-contiguous tensor is reduced in place through a copy.
  {
    at::Tensor base = input_of(r, 2 * 50000).view({50000, 2});
    std::vector<at::Tensor> t{base.t()};  // shape [2, 50000], not contiguous
    REQUIRE_FALSE(t[0].is_contiguous());
    REQUIRE(b->allreduce(t)->wait());
    at::Tensor expect = at::zeros({50000, 2});
    for (int q = 0; q < w; ++q) expect += input_of(q, 2 * 50000).view({50000, 2});
    CHECK(at::equal(base, expect));
  }

  // A 0-element tensor completes.
  {
    std::vector<at::Tensor> t{at::empty({0})};
    CHECK(b->allreduce(t)->wait());
    CHECK(t[0].numel() == 0);
  }

  // allreduce_coalesced: two tensors, one exchange.
  {
    std::vector<at::Tensor> ts{at::ones({10, 10}), at::full({3}, double(r))};
    REQUIRE(b->allreduce_coalesced(ts)->wait());
    CHECK(at::equal(ts[0], at::full({10, 10}, double(w))));
    CHECK(at::equal(ts[1], at::full({3}, double(w * (w - 1) / 2))));
  }

  // broadcast from the last rank: small, bool, and large (a chain beyond two members).
  for (std::int64_t n : {std::int64_t{5}, std::int64_t{1000003}}) {
    const int root = w - 1;
    std::vector<at::Tensor> t{r == root ? input_of(root, n) : at::zeros({n})};
    distrpc::dist::BroadcastOptions o;
    o.root_rank = root;
    REQUIRE(b->broadcast(t, o)->wait());
    CHECK_MESSAGE(at::equal(t[0], input_of(root, n)), "broadcast of " << n);
  }
  {
    const at::Tensor pattern = at::tensor({1, 0, 0, 1}, at::kInt).to(at::kBool);
    std::vector<at::Tensor> t{r == 0 ? pattern.clone() : at::zeros({4}, at::kBool)};
    REQUIRE(b->broadcast(t)->wait());
    CHECK(at::equal(t[0], pattern));
  }

  // allgather and allgather_into_tensor.
  {
    std::vector<at::Tensor> in{input_of(r, 1001)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int q = 0; q < w; ++q) out[0].push_back(at::zeros({1001}));
    REQUIRE(b->allgather(out, in)->wait());
    for (int q = 0; q < w; ++q)
      CHECK(at::equal(out[0][static_cast<std::size_t>(q)], input_of(q, 1001)));

    at::Tensor single = input_of(r, 300000).view({3, 100000});
    at::Tensor all = at::zeros({3 * w, 100000});
    REQUIRE(b->allgather_into_tensor(all, single)->wait());
    for (int q = 0; q < w; ++q) {
      CHECK(at::equal(all.narrow(0, 3 * q, 3), input_of(q, 300000).view({3, 100000})));
    }
  }

  // reduce_scatter (list) and reduce_scatter_tensor.
  {
    std::vector<std::vector<at::Tensor>> in(1);
    for (int q = 0; q < w; ++q) in[0].push_back(input_of(r, 17) * (q + 1));
    std::vector<at::Tensor> out{at::zeros({17})};
    REQUIRE(b->reduce_scatter(out, in)->wait());
    at::Tensor expect = at::zeros({17});
    for (int q = 0; q < w; ++q) expect += input_of(q, 17) * (r + 1);
    CHECK(at::equal(out[0], expect));

    at::Tensor big = input_of(r, 65537 * w);
    at::Tensor mine = at::zeros({65537});
    distrpc::dist::ReduceScatterOptions o;
    o.op = ReduceOp::MAX;
    REQUIRE(b->reduce_scatter_tensor(mine, big, o)->wait());
    at::Tensor e = input_of(0, 65537 * w);
    for (int q = 1; q < w; ++q) e = at::maximum(e, input_of(q, 65537 * w));
    CHECK(at::equal(mine, e.narrow(0, 65537 * r, 65537)));
  }

  // alltoall_base with uneven splits: rank i sends (i + j + 1) rows of 3 to rank j, filled with
  // 100 * i + j.
  {
    std::vector<std::int64_t> in_split;
    std::vector<std::int64_t> out_split;
    std::vector<at::Tensor> in_parts;
    std::vector<at::Tensor> expect_parts;
    for (int j = 0; j < w; ++j) {
      in_split.push_back(r + j + 1);
      out_split.push_back(j + r + 1);
      in_parts.push_back(at::full({r + j + 1, 3}, double(100 * r + j)));
      expect_parts.push_back(at::full({j + r + 1, 3}, double(100 * j + r)));
    }
    at::Tensor in = at::cat(in_parts);
    at::Tensor expect = at::cat(expect_parts);
    at::Tensor out = at::zeros_like(expect);
    REQUIRE(b->alltoall_base(out, in, out_split, in_split)->wait());
    CHECK(at::equal(out, expect));

    // In place (one tensor in and out), with splits that differ: rank i sends 1 + (j - i mod w)
    // rows to rank j, so what it receives from j (1 + (i - j mod w) rows) lies elsewhere in the
    // tensor than what it sends there.
    {
      std::vector<std::int64_t> sends_rows;
      std::vector<std::int64_t> recvs_rows;
      std::vector<at::Tensor> sent;
      std::vector<at::Tensor> wanted;
      for (int j = 0; j < w; ++j) {
        sends_rows.push_back(1 + (j - r + w) % w);
        recvs_rows.push_back(1 + (r - j + w) % w);
        sent.push_back(at::full({sends_rows.back(), 3}, double(100 * r + j)));
        wanted.push_back(at::full({recvs_rows.back(), 3}, double(100 * j + r)));
      }
      at::Tensor buf = at::cat(sent);
      const at::Tensor want = at::cat(wanted);
      REQUIRE(buf.sizes() == want.sizes());
      REQUIRE(b->alltoall_base(buf, buf, recvs_rows, sends_rows)->wait());
      CHECK(at::equal(buf, want));
    }

    std::vector<at::Tensor> ins;
    std::vector<at::Tensor> outs;
    for (int j = 0; j < w; ++j) {
      ins.push_back(at::full({2}, double(10 * r + j)));
      outs.push_back(at::zeros({2}));
    }
    REQUIRE(b->alltoall(outs, ins)->wait());
    for (int j = 0; j < w; ++j)
      CHECK(at::equal(outs[static_cast<std::size_t>(j)], at::full({2}, double(10 * j + r))));
  }

  // reduce, gather and scatter with root 1.
  {
    std::vector<at::Tensor> t{input_of(r, 20000)};
    distrpc::dist::ReduceOptions ro;
    ro.root_rank = 1;
    REQUIRE(b->reduce(t, ro)->wait());
    if (r == 1) {
      at::Tensor e = at::zeros({20000});
      for (int q = 0; q < w; ++q) e += input_of(q, 20000);
      CHECK(at::equal(t[0], e));
    }

    std::vector<at::Tensor> in{input_of(r, 9)};
    std::vector<std::vector<at::Tensor>> out;
    if (r == 1) {
      out.resize(1);
      for (int q = 0; q < w; ++q) out[0].push_back(at::zeros({9}));
    }
    distrpc::dist::GatherOptions go;
    go.root_rank = 1;
    REQUIRE(b->gather(out, in, go)->wait());
    if (r == 1) {
      for (int q = 0; q < w; ++q)
        CHECK(at::equal(out[0][static_cast<std::size_t>(q)], input_of(q, 9)));
    }

    std::vector<at::Tensor> mine{at::zeros({9})};
    std::vector<std::vector<at::Tensor>> parts;
    if (r == 1) {
      parts.resize(1);
      for (int q = 0; q < w; ++q) parts[0].push_back(input_of(q, 9) * 3);
    }
    distrpc::dist::ScatterOptions so;
    so.root_rank = 1;
    REQUIRE(b->scatter(mine, parts, so)->wait());
    CHECK(at::equal(mine[0], input_of(r, 9) * 3));
  }

  // Point to point: a ring of sends with two tags in flight, received in the order sent, and
  // recv_anysource naming the sender.
  {
    const int next = (r + 1) % w;
    const int prev = (r - 1 + w) % w;
    std::vector<at::Tensor> a{at::full({4}, double(r))};
    std::vector<at::Tensor> a2{at::full({4}, double(r + 50))};
    std::vector<at::Tensor> c{at::full({2}, double(r + 100))};
    auto s1 = b->send(a, next, 7);
    auto s2 = b->send(a2, next, 7);
    auto s3 = b->send(c, next, 8);
    std::vector<at::Tensor> ra{at::zeros({4})};
    std::vector<at::Tensor> ra2{at::zeros({4})};
    std::vector<at::Tensor> rc{at::zeros({2})};
    auto w3 = b->recv(rc, prev, 8);  // posted first, matched by tag
    auto w1 = b->recv(ra, prev, 7);
    auto w2 = b->recv(ra2, prev, 7);
    CHECK(s1->wait());
    CHECK(s2->wait());
    CHECK(s3->wait());
    CHECK(w1->wait());
    CHECK(w2->wait());
    CHECK(w3->wait());
    CHECK(at::equal(ra[0], at::full({4}, double(prev))));
    CHECK(at::equal(ra2[0], at::full({4}, double(prev + 50))));
    CHECK(at::equal(rc[0], at::full({2}, double(prev + 100))));
    CHECK(w1->source_rank() == prev);

    // Everyone but rank 0 sends to rank 0, which receives from any source.
    if (r == 0) {
      std::set<int> from;
      for (int k = 1; k < w; ++k) {
        std::vector<at::Tensor> x{at::zeros({1})};
        auto rw = b->recv_anysource(x, 3);
        REQUIRE(rw->wait());
        from.insert(rw->source_rank());
        CHECK(x[0].item<float>() == float(rw->source_rank() * 11));
      }
      CHECK(from.size() == static_cast<std::size_t>(w - 1));
    } else {
      std::vector<at::Tensor> x{at::full({1}, double(r * 11))};
      CHECK(b->send(x, 0, 3)->wait());
    }
  }

  REQUIRE(b->barrier()->wait());
  CHECK(b->sequence_number() > 20);
  b->shutdown();
}

}  // namespace distrpc_backend_test

using namespace distrpc_backend_test;

namespace {
// Small chunks and no direct path: the ring and the chain run with many chunks per segment.
DistrpcBackendOptions many_chunks() {
  DistrpcBackendOptions o;
  o.small_bytes = 0;
  o.chunk_bytes = 64 * 1024;
  o.wait_spin = std::chrono::microseconds(50);  // the spinning paths (drive(), the Work's poll)
  return o;
}
}  // namespace

DISTRPC_MP_TEST("distrpc backend: every collective on tcp at world 2", 2, 120) {
  run_suite<Tcp>(ctx, {});
}
DISTRPC_MP_TEST("distrpc backend: every collective on tcp at world 4", 4, 180) {
  run_suite<Tcp>(ctx, {});
}
DISTRPC_MP_TEST("distrpc backend: every collective on shm at world 2", 2, 120) {
  run_suite<Shm>(ctx, {});
}
DISTRPC_MP_TEST("distrpc backend: every collective on shm at world 4 in small chunks", 4, 180) {
  run_suite<Shm>(ctx, many_chunks());
}
DISTRPC_MP_TEST("distrpc backend: every collective on auto<shm tcp> at world 4", 4, 180) {
  run_suite<Auto<Shm, Tcp>>(ctx, {});
}
DISTRPC_MP_TEST("distrpc backend: every collective on tcp at world 3 in small chunks", 3, 180) {
  run_suite<Tcp>(ctx, many_chunks());
}

// 64 MiB at world 2 on shared memory: the ring with its default chunks.
DISTRPC_MP_TEST("distrpc backend: 64 MiB allreduce on shm at world 2", 2, 120) {
  auto b = make_backend<Shm>(ctx);
  const std::int64_t n = 16 * 1024 * 1024;
  std::vector<at::Tensor> t{at::full({n}, double(ctx.rank + 1))};
  t[0][n - 1] = 10.0 * ctx.rank;
  REQUIRE(b->allreduce(t)->wait());
  CHECK(t[0][0].item<float>() == 3.0f);
  CHECK(t[0][n / 2].item<float>() == 3.0f);
  CHECK(t[0][n - 1].item<float>() == 10.0f);
  at::Tensor expect = at::full({n}, 3.0);
  expect[n - 1] = 10.0;
  CHECK(at::equal(t[0], expect));
}

// A member that skips a collective. The call's own timeout (shorter than the group's) fails the
// caller's Work with "Timeout", the operation, its sequence number and the silent rank, while the
// collective goes on; when the group's timeout passes too, the group is unusable: later
// collectives fail at once, saying why.
DISTRPC_MP_TEST(
    "distrpc backend: a timeout names the op and its sequence number and the silent rank", 2, 60) {
  constexpr auto kGroupTimeout = 5s;
  auto b = make_backend<Tcp>(ctx, kGroupTimeout);
  std::vector<at::Tensor> t{at::ones({4})};
  REQUIRE(b->allreduce(t)->wait());  // sequence number 1
  if (ctx.rank == 0) {
    AllreduceOptions o;
    o.timeout = 500ms;
    const auto t0 = Clock::now();
    const std::string err = error_of(b->allreduce(t, o));  // sequence number 2
    const long long took = ms_since(t0);
    MESSAGE("rank 0: " << err << " after " << took << " ms");
    CHECK(contains(err, "Timeout: allreduce (sequence number 2) on rank 0 timed out after 500 ms"));
    CHECK(contains(err, "nothing heard for it from rank(s) 1"));
    CHECK(took >= 450);
    CHECK(took < 3000);
    // The allreduce still runs, until the group's timeout: the next collective waits behind it,
    // then is refused because the group's timeout broke the group.
    const std::string later = error_of(b->barrier());
    const long long later_took = ms_since(t0);
    MESSAGE("rank 0: " << later << " after " << later_took << " ms");
    CHECK(contains(later, "barrier (sequence number 3) was not run: the group is unusable"));
    CHECK(contains(later,
                   "Timeout: allreduce (sequence number 2) on rank 0 did not complete "
                   "within 5000 ms; nothing heard for it from rank(s) 1"));
    CHECK(later_took >= 4900);
    CHECK(later_took < 15000);
    ctx.publish("done", "1");
  } else {
    (void)ctx.lookup("done", 30s);  // skips the collective; leaves once rank 0 has checked
  }
}

// A mismatch of sizes without DETAIL never writes past a tensor: both sides fail with a size
// mismatch (direct exchange and ring).
DISTRPC_MP_TEST("distrpc backend: mismatched sizes fail with a size mismatch", 2, 60) {
  for (int round = 0; round < 2; ++round) {
    auto b = make_backend<Shm>(ctx, 20s, {}, "store" + std::to_string(round));
    const std::int64_t n = round == 0 ? 4 + ctx.rank : 400000 + 1000 * ctx.rank;
    std::vector<at::Tensor> t{at::ones({n})};
    const std::string err = error_of(b->allreduce(t));
    MESSAGE("rank " << ctx.rank << ": " << err);
    CHECK(contains(
        err, "allreduce (sequence number 1): size mismatch: rank " + std::to_string(1 - ctx.rank) +
                 " sent " +
                 std::to_string((round == 0 ? 4 + (1 - ctx.rank) : 400000 + 1000 * (1 - ctx.rank)) *
                                4)));
    CHECK(contains(err, "expects " + std::to_string(n * 4)));
    b->shutdown();
  }
}

// SIGKILL during a collective: the others' wait fails within 2 s, naming the dead member.
// The survivors leave together, after each saw its error: one that left at once would close its
// connections under the other, which could then name it, the second member lost, instead of the
// killed one (both are gone, but the test is about the killed one).
void survivors_meet(const distrpc::testing::RankContext& ctx, int killed) {
  ctx.publish("survived" + std::to_string(ctx.rank), "1");
  for (int r = 0; r < ctx.world; ++r) {
    if (r != killed) (void)ctx.lookup("survived" + std::to_string(r));
  }
}

DISTRPC_MP_TARGET("distrpc backend target: killed mid-collective") {
  auto b = make_backend<Tcp>(ctx, 60s);
  REQUIRE(b->barrier()->wait());
  if (ctx.rank == 2) {
    std::this_thread::sleep_for(300ms);
    ::kill(::getpid(), SIGKILL);
  }
  std::vector<at::Tensor> t{at::ones({1000000})};
  const auto t0 = Clock::now();
  const std::string err = error_of(b->allreduce(t));  // rank 2 never joins: it dies first
  const long long took = ms_since(t0);
  MESSAGE("rank " << ctx.rank << ": " << err << " after " << took << " ms");
  CHECK(contains(err, "allreduce (sequence number 2) failed on rank " + std::to_string(ctx.rank) +
                          ": connection to rank 2 lost"));
  CHECK(took < 2300);  // 300 ms until the kill, then at most 2 s
  survivors_meet(ctx, 2);
  const auto t1 = Clock::now();
  b->shutdown();
  CHECK(ms_since(t1) < 2000);
}
DISTRPC_MP_TARGET("distrpc backend target: killed mid-collective on shm") {
  auto b = make_backend<Shm>(ctx, 60s);
  REQUIRE(b->barrier()->wait());
  if (ctx.rank == 1) {
    std::thread([] {
      std::this_thread::sleep_for(200ms);
      ::kill(::getpid(), SIGKILL);
    }).detach();
  }
  // Rank 1 dies in the middle of a stream of large allreduces.
  std::string err;
  const auto start = Clock::now();
  for (int i = 0; i < 100000 && err.empty(); ++i) {
    std::vector<at::Tensor> t{at::ones({1 << 20})};
    err = error_of(b->allreduce(t));
  }
  const long long took = ms_since(start);
  MESSAGE("rank " << ctx.rank << ": " << err << " after " << took << " ms");
  CHECK(contains(err, "connection to rank 1 lost"));
  CHECK(took < 2200);
  survivors_meet(ctx, 1);
}

// The loss comes while the waiting thread reads the connections itself (wait_spin: 1.5 s here,
// so the loss falls inside it): its wait must see the loss when the reading ends, not sleep on
// until the group's timeout.
DISTRPC_MP_TARGET("distrpc backend target: killed while the others read on shm") {
  DistrpcBackendOptions spin;
  spin.wait_spin = std::chrono::milliseconds(1500);
  auto b = make_backend<Shm>(ctx, 30s, spin);
  REQUIRE(b->barrier()->wait());
  if (ctx.rank == 1) {
    std::this_thread::sleep_for(300ms);
    ::kill(::getpid(), SIGKILL);
  }
  std::vector<at::Tensor> t{at::ones({1000})};
  const auto t0 = Clock::now();
  const std::string err = error_of(b->allreduce(t));  // rank 1 never joins: it dies first
  const long long took = ms_since(t0);
  MESSAGE("rank " << ctx.rank << ": " << err << " after " << took << " ms");
  CHECK(contains(err, "connection to rank 1 lost"));
  CHECK(took < 5000);
  survivors_meet(ctx, 1);
}

TEST_CASE("distrpc backend: a member killed with SIGKILL fails the others within 2 s") {
  for (const char* name : {"distrpc backend target: killed mid-collective",
                           "distrpc backend target: killed mid-collective on shm",
                           "distrpc backend target: killed while the others read on shm"}) {
    RunOptions o;
    const bool shm = std::string(name).find("shm") != std::string::npos;
    o.world = 3;
    o.limit = 60s;
    o.may_die = {shm ? 1 : 2};
    const auto r = distrpc::testing::run_ranks(name, o);
    CHECK_MESSAGE(r.ok, r.report());
    for (const auto& rk : r.ranks) {
      if (o.may_die.count(rk.rank) != 0) {
        CHECK_MESSAGE(rk.signal == SIGKILL, r.report());
      } else {
        CHECK_MESSAGE(rk.exit_code == 0, r.report());
      }
    }
  }
}

// A member that shut its backend down after doing its part of a collective (a reduce's sender)
// does not fail the members still finishing it: the root still waiting for a slow member
// completes. The next collective, which it will never join, fails at once, naming it.
DISTRPC_MP_TARGET("distrpc backend target: a member shut down after its part") {
  auto b = make_backend<Tcp>(ctx, 30s);
  REQUIRE(b->barrier()->wait());
  if (ctx.rank == 2) std::this_thread::sleep_for(700ms);  // longer than the grace after a loss
  std::vector<at::Tensor> t{at::full({4}, static_cast<float>(ctx.rank + 1))};
  distrpc::dist::ReduceOptions ro;
  ro.root_rank = 0;
  CHECK(error_of(b->reduce(t, ro)) == "");
  if (ctx.rank == 0) CHECK(at::equal(t[0], at::full({4}, 6.0f)));
  if (ctx.rank == 1) {
    b->shutdown();
    ctx.publish("left", "1");
    return;
  }
  (void)ctx.lookup("left");
  std::vector<at::Tensor> x{at::ones({4})};
  const auto t0 = Clock::now();
  const std::string err = error_of(b->allreduce(x));
  MESSAGE("rank " << ctx.rank << ": " << err << " after " << ms_since(t0) << " ms");
  CHECK(err == "DistrpcBackend: allreduce (sequence number 3) failed on rank " +
                   std::to_string(ctx.rank) + ": rank 1 left the group (it shut its backend down)");
  CHECK(ms_since(t0) < 200);  // less than the grace a loss without a goodbye waits
  survivors_meet(ctx, 1);
}

TEST_CASE("distrpc backend: a member that shut down fails only the collectives after its last") {
  RunOptions o;
  o.world = 3;
  o.limit = 60s;
  const auto r =
      distrpc::testing::run_ranks("distrpc backend target: a member shut down after its part", o);
  CHECK_MESSAGE(r.ok, r.report());
}

// TORCH_DISTRIBUTED_DEBUG=DETAIL: a fingerprint mismatch names both sides.
DISTRPC_MP_TARGET("distrpc backend target: detail mismatch") {
  auto b = make_backend<Tcp>(ctx, 20s);
  std::vector<at::Tensor> ok{at::ones({2})};
  REQUIRE(b->allreduce(ok)->wait());
  std::vector<at::Tensor> t{at::ones({4 + ctx.rank})};
  const std::string err = error_of(b->allreduce(t));
  MESSAGE("rank " << ctx.rank << ": " << err);
  const std::string me =
      "CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[[" +
      std::to_string(4 + ctx.rank) + "]], TensorDtypes=[Float], ReduceOp.SUM)";
  const std::string other =
      "CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[[" +
      std::to_string(5 - ctx.rank) + "]], TensorDtypes=[Float], ReduceOp.SUM)";
  CHECK(err == "Detected mismatch between collectives on ranks. Rank " + std::to_string(ctx.rank) +
                   " is running collective: " + me + ", but Rank " + std::to_string(1 - ctx.rank) +
                   " is running collective: " + other + ".");
  // Different operations are caught as well, on a fresh group.
  auto b2 = make_backend<Tcp>(ctx, 20s, {}, "store2");
  std::vector<at::Tensor> x{at::ones({3})};
  const std::string err2 = ctx.rank == 0 ? error_of(b2->allreduce(x)) : error_of(b2->broadcast(x));
  CHECK(contains(err2, "OpType=ALLREDUCE"));
  CHECK(contains(err2, "OpType=BROADCAST"));
}

TEST_CASE("distrpc backend: TORCH_DISTRIBUTED_DEBUG=DETAIL names both sides of a mismatch") {
  RunOptions o;
  o.world = 2;
  o.limit = 60s;
  o.env = {"TORCH_DISTRIBUTED_DEBUG=detail"};
  const auto r = distrpc::testing::run_ranks("distrpc backend target: detail mismatch", o);
  CHECK_MESSAGE(r.ok, r.report());
}

TEST_CASE("distrpc backend: at world 1 every collective completes and bad inputs are named") {
  auto store = std::make_shared<distrpc::store::HashStore>();
  auto b = std::make_shared<DistrpcBackend<Tcp>>(store, 0, 1, std::chrono::milliseconds(5000));
  CHECK(b->rank() == 0);
  CHECK(b->size() == 1);
  CHECK(b->name() == "distrpc");

  std::vector<at::Tensor> t{at::full({3}, 2.0)};
  AllreduceOptions avg;
  avg.op = ReduceOp::AVG;
  CHECK(b->allreduce(t, avg)->wait());
  CHECK(at::equal(t[0], at::full({3}, 2.0)));
  AllreduceOptions pre;
  pre.op = distrpc::dist::make_premul_sum(3.0);
  CHECK(b->allreduce(t, pre)->wait());
  CHECK(at::equal(t[0], at::full({3}, 6.0)));
  CHECK(b->broadcast(t)->wait());
  CHECK(b->barrier()->wait());
  std::vector<std::vector<at::Tensor>> out{{at::zeros({3})}};
  CHECK(b->allgather(out, t)->wait());
  CHECK(at::equal(out[0][0], t[0]));
  at::Tensor o1 = at::zeros({3});
  CHECK(b->alltoall_base(o1, t[0], {}, {})->wait());
  CHECK(at::equal(o1, t[0]));
  CHECK(b->sequence_number() == 6);

  // Bad inputs: each names what was wrong, before anything is queued.
  const auto text = [](auto&& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::vector<at::Tensor> two{at::ones({1}), at::ones({1})};
  CHECK(text([&] { b->allreduce(two); }) == "allreduce: expects exactly one input tensor, got 2");
  std::vector<at::Tensor> undef{at::Tensor()};
  CHECK(text([&] { b->broadcast(undef); }) == "broadcast: input 0 is undefined");
  distrpc::dist::BroadcastOptions bo;
  bo.root_rank = 3;
  CHECK(text([&] { b->broadcast(t, bo); }) ==
        "broadcast: root rank 3 is outside the group of size 1");
  CHECK(text([&] { b->send(t, 0, 0); }) ==
        "Invalid destination rank: destination rank should not be the same as the rank of the "
        "current process.");
  CHECK(text([&] { b->recv(t, 5, 0); }) == "recv: source rank 5 is outside the group of size 1");
  CHECK(text([&] { b->recv_anysource(t, -1); }) ==
        "recv_anysource: the tag must not be negative, got -1");
  std::vector<std::vector<at::Tensor>> mixed{{at::zeros({3}, at::kInt)}};
  CHECK(text([&] { b->allgather(mixed, t); }) ==
        "Invalid usage of tensors with different dtypes Found Float and Int");
  std::vector<at::Tensor> ints{at::ones({2}, at::kInt)};
  CHECK(text([&] { b->allreduce(ints, avg); }) ==
        "Cannot use ReduceOp.AVG with integral dtype Int: the mean is not representable");
  at::Tensor six = at::zeros({6});
  CHECK(text([&] {
          b->alltoall_base(six, six, {1, 2}, {});
        }) == "alltoall_base: the output split sizes have 2 entries, expected 1");
  CHECK(text([&] { b->alltoall_base(six, six, {5}, {}); }) ==
        "alltoall_base: the output split sizes add up to 5 but the tensor has 6 rows");
  AllreduceOptions neg;
  neg.timeout = std::chrono::milliseconds(-3);
  CHECK(text([&] { b->allreduce(t, neg); }) ==
        "allreduce: the timeout must be positive, got -3 ms");
  CHECK(text([&] { DistrpcBackend<Tcp>(nullptr, 0, 1, std::chrono::milliseconds(100)); }) ==
        "DistrpcBackend: the store is null");
  DistrpcBackendOptions spin;
  spin.wait_spin = std::chrono::microseconds(-1);
  CHECK(text([&] { DistrpcBackend<Tcp>(store, 0, 1, std::chrono::milliseconds(100), spin); }) ==
        "DistrpcBackend: wait_spin must not be negative, got -1 us");
  DistrpcBackendOptions bad;
  bad.chunk_bytes = 0;
  CHECK(text([&] { DistrpcBackend<Tcp>(store, 0, 1, std::chrono::milliseconds(100), bad); }) ==
        "DistrpcBackend: chunk_bytes must be positive, got 0");

  b->shutdown();
  b->shutdown();  // idempotent
  bool thrown = false;
  try {
    b->barrier();
  } catch (const DistBackendError& e) {
    thrown = true;
    CHECK(std::string(e.what()) == "DistrpcBackend: barrier after shutdown()");
  }
  CHECK(thrown);
}

DISTRPC_MP_TEST("distrpc backend: shutdown fails a pending recv and returns promptly", 2, 60) {
  auto b = make_backend<Tcp>(ctx, 60s);
  if (ctx.rank == 1) {
    // Stays until rank 0 has checked, so rank 0's recv fails by its own shutdown, not by a loss.
    (void)ctx.lookup("done", 30s);
    return;
  }
  std::vector<at::Tensor> t{at::zeros({2})};
  auto w = b->recv(t, 1, 99);  // nobody sends
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(w->is_completed());
  const auto t0 = Clock::now();
  b->shutdown();
  CHECK(ms_since(t0) < 2000);
  CHECK(error_of(w) ==
        "DistrpcBackend: recv from rank 1 (tag 99) failed: the backend was shut down");
  ctx.publish("done", "1");
}

// A receive nobody answers ends at the backend's timeout, and one whose sender dies ends soon
// after the loss; each also when it was posted while the point-to-point thread slept with nothing
// else pending (which once let it sleep through both).
DISTRPC_MP_TEST("distrpc backend: a recv nobody answers times out; one whose sender died fails", 2,
                60) {
  {
    auto b = make_backend<Tcp>(ctx, 500ms, {}, "store-timeout");
    if (ctx.rank == 1) {
      (void)ctx.lookup("timed-out", 30s);
    } else {
      std::vector<at::Tensor> t{at::zeros({2})};
      std::this_thread::sleep_for(100ms);  // the thread is asleep with nothing pending
      const auto t0 = Clock::now();
      auto w = b->recv(t, 1, 5);
      CHECK(error_of(w) ==
            "DistrpcBackend: Timeout: recv from rank 1 (tag 5) on rank 0 got no message within "
            "500 ms");
      CHECK(ms_since(t0) >= 450);
      CHECK(ms_since(t0) < 3000);
      ctx.publish("timed-out", "1");
    }
  }
  auto b = make_backend<Tcp>(ctx, 60s, {}, "store-loss");
  if (ctx.rank == 1) {
    (void)ctx.lookup("posted", 30s);
    std::this_thread::sleep_for(200ms);
    _exit(0);
  }
  std::vector<at::Tensor> t{at::zeros({2})};
  const auto t0 = Clock::now();
  auto w = b->recv(t, 1, 6);
  ctx.publish("posted", "1");
  const std::string e = error_of(w);
  CHECK(e.rfind("DistrpcBackend: recv from rank 1 (tag 6) failed: connection to rank 1 lost", 0) ==
        0);
  CHECK(ms_since(t0) < 10000);
}

// The n-th send pairs with the n-th receive: the message sent for a receive that timed out is
// dropped when it arrives, and the next receive gets the next message (it once got the late one).
DISTRPC_MP_TEST("distrpc backend: a message for a recv that timed out does not go to the next one",
                2, 60) {
  auto b = make_backend<Tcp>(ctx, 500ms);
  if (ctx.rank == 1) {
    (void)ctx.lookup("timed-out", 30s);
    std::vector<at::Tensor> late{at::ones({2})};
    CHECK(b->send(late, 0, 3)->wait());
    std::vector<at::Tensor> next{at::full({2}, 2.0)};
    CHECK(b->send(next, 0, 3)->wait());
    (void)ctx.lookup("checked", 30s);
    return;
  }
  std::vector<at::Tensor> t{at::zeros({2})};
  CHECK(error_of(b->recv(t, 1, 3)) ==
        "DistrpcBackend: Timeout: recv from rank 1 (tag 3) on rank 0 got no message within 500 ms");
  ctx.publish("timed-out", "1");
  std::this_thread::sleep_for(200ms);  // the late message lands before the next receive is posted
  std::vector<at::Tensor> u{at::zeros({2})};
  CHECK(b->recv(u, 1, 3)->wait());
  CHECK(at::equal(u[0], at::full({2}, 2.0)));
  CHECK(at::equal(t[0], at::zeros({2})));  // the timed-out receive's tensor stays as it was
  CHECK(b->held_messages() == 0);
  ctx.publish("checked", "1");
}

// After a failed collective no collective runs again: what arrives for one later is not kept
// (it once stayed in the mailbox for good, one message per later collective of each peer).
DISTRPC_MP_TEST("distrpc backend: after a failed collective, later messages are not kept", 2, 60) {
  auto b = make_backend<Tcp>(ctx, 500ms);
  std::vector<at::Tensor> t{at::ones({4})};
  if (ctx.rank == 1) {
    (void)ctx.lookup("failed", 30s);
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 3; ++i) works.push_back(b->allreduce(t, AllreduceOptions{}));
    for (auto& w : works) (void)error_of(w);  // the first may complete; the others fail
    ctx.publish("sent", "1");
    (void)ctx.lookup("checked", 30s);
    return;
  }
  const std::string e = error_of(b->allreduce(t, AllreduceOptions{}));
  CHECK(e.find("Timeout: allreduce (sequence number 1) on rank 0") != std::string::npos);
  ctx.publish("failed", "1");
  (void)ctx.lookup("sent", 30s);
  std::this_thread::sleep_for(300ms);  // rank 1's messages land
  CHECK(b->held_messages() == 0);
  CHECK(error_of(b->allreduce(t, AllreduceOptions{})).find("was not run: the group is unusable") !=
        std::string::npos);
  ctx.publish("checked", "1");
}

// The group's timeout counts from when a collective starts here, not from its call: collectives
// queued behind one that waits for a slow member do not time out while they wait their turn.
DISTRPC_MP_TEST("distrpc backend: the group timeout counts from a collective's start", 2, 60) {
  auto b = make_backend<Tcp>(ctx, 3000ms);
  std::vector<std::vector<at::Tensor>> ts(3, std::vector<at::Tensor>{});
  for (auto& t : ts) t.push_back(at::ones({4}));
  if (ctx.rank == 1) {
    for (auto& t : ts) {
      std::this_thread::sleep_for(1500ms);  // the last starts 4.5 s after rank 0 called it
      CHECK(b->allreduce(t, AllreduceOptions{})->wait());
    }
    return;
  }
  std::vector<std::shared_ptr<Work>> works;
  for (auto& t : ts) works.push_back(b->allreduce(t, AllreduceOptions{}));
  for (std::size_t i = 0; i < works.size(); ++i) {
    CHECK_MESSAGE(error_of(works[i]).empty(), "allreduce ", i);
    CHECK(at::equal(ts[i][0], at::full({4}, 2.0)));
  }
}

// A Work callback that shuts the backend down runs on the collectives' thread, which then leaves
// its loop: what is queued behind fails at once, by shutdown() itself.
DISTRPC_MP_TEST("distrpc backend: shutdown from a Work callback fails the work queued behind it", 2,
                60) {
  auto b = make_backend<Tcp>(ctx, 20s);
  std::vector<at::Tensor> t{at::ones({4})};
  if (ctx.rank == 1) {
    (void)ctx.lookup("queued", 30s);
    CHECK(b->allreduce(t, AllreduceOptions{})->wait());
    (void)ctx.lookup("checked", 30s);
    return;
  }
  auto first = b->allreduce(t, AllreduceOptions{});
  Backend* raw = b.get();
  first->get_future().add_done_callback([raw](const auto&) { raw->shutdown(); });
  std::vector<at::Tensor> u{at::ones({4})};
  auto behind = b->allreduce(u, AllreduceOptions{});
  ctx.publish("queued", "1");
  CHECK(first->wait());
  const auto t0 = Clock::now();
  const std::string e = error_of(behind);
  CHECK(e.rfind("DistrpcBackend: allreduce", 0) == 0);
  CHECK(e.find("was not run: the backend was shut down") != std::string::npos);
  CHECK(ms_since(t0) < 5000);
  ctx.publish("checked", "1");
}

// A Work callback runs on one of the backend's threads (the collectives' executor, the
// point-to-point thread); one that drops the last reference destroys the backend there, and that
// thread must leave its loop without touching the freed backend (AddressSanitizer builds catch a
// slip).
DISTRPC_MP_TEST("distrpc backend: a Work callback may drop the last reference to its backend", 2,
                60) {
  for (const std::string kind : {"allreduce", "recv"}) {
    auto b = make_backend<Tcp>(ctx, 20s, {}, "store-" + kind);
    std::vector<at::Tensor> t{at::ones({4})};
    if (ctx.rank == 1) {
      (void)ctx.lookup("attached-" + kind, 30s);
      if (kind == "allreduce") {
        CHECK(b->allreduce(t, AllreduceOptions{})->wait());
      } else {
        CHECK(b->send(t, 0, 7)->wait());
      }
      (void)ctx.lookup("dropped-" + kind, 30s);
      continue;
    }
    auto holder = std::make_shared<std::shared_ptr<Backend>>(std::move(b));
    std::promise<std::thread::id> ran_on;
    auto w = kind == "allreduce" ? (*holder)->allreduce(t, AllreduceOptions{})
                                 : (*holder)->recv(t, 1, 7);
    w->get_future().add_done_callback([holder, &ran_on](const auto&) {
      holder->reset();  // the last reference: ~DistrpcBackend runs here
      ran_on.set_value(std::this_thread::get_id());
    });
    ctx.publish("attached-" + kind, "1");
    auto ran = ran_on.get_future();
    REQUIRE(ran.wait_for(10s) == std::future_status::ready);
    CHECK(ran.get() != std::this_thread::get_id());  // on the backend's own thread
    CHECK(*holder == nullptr);
    CHECK(w->is_success());
    CHECK(at::equal(t[0], at::ones({4}) * (kind == "allreduce" ? 2 : 1)));
    ctx.publish("dropped-" + kind, "1");
  }
  // The process goes on: a new backend works.
  auto again = make_backend<Tcp>(ctx, 20s, {}, "store-again");
  std::vector<at::Tensor> t{at::ones({2})};
  CHECK(again->allreduce(t, AllreduceOptions{})->wait());
  CHECK(at::equal(t[0], at::full({2}, 2.0)));
}

// A Work callback runs on the backend's thread that completes the work (the collectives'
// executor, the point-to-point thread). Waiting there for another work of the group, which that
// thread would have to run next, throws instead of hanging; the group goes on afterwards.
DISTRPC_MP_TEST("distrpc backend: waiting for a work inside another's callback throws, no hang", 2,
                60) {
  auto b = make_backend<Tcp>(ctx, 20s);
  std::vector<at::Tensor> t{at::ones({4})};
  if (ctx.rank == 1) {
    (void)ctx.lookup("attached", 30s);
    CHECK(b->allreduce(t, AllreduceOptions{})->wait());
    std::vector<at::Tensor> inner{at::ones({4})};
    CHECK(b->allreduce(inner, AllreduceOptions{})->wait());  // the one rank 0 queued inside
    CHECK(b->send(t, 0, 7)->wait());
    CHECK(b->send(t, 0, 8)->wait());
    (void)ctx.lookup("checked", 30s);
    return;
  }
  const auto nested_wait = [](const std::shared_ptr<Work>& w) {
    try {
      w->wait();
      return std::string("(no error)");
    } catch (const std::logic_error& e) {
      return std::string(e.what());
    }
  };
  std::promise<std::string> collective_text, recv_text;
  std::vector<at::Tensor> inner{at::ones({4})};
  std::vector<at::Tensor> got{at::zeros({4})}, got_inner{at::zeros({4})};
  std::shared_ptr<Work> inner_collective, inner_recv;  // set in the callbacks
  auto w = b->allreduce(t, AllreduceOptions{});
  w->get_future().add_done_callback([&](const auto&) {
    inner_collective = b->allreduce(inner, AllreduceOptions{});
    collective_text.set_value(nested_wait(inner_collective));
  });
  auto r = b->recv(got, 1, 7);
  r->get_future().add_done_callback([&](const auto&) {
    inner_recv = b->recv(got_inner, 1, 8);
    recv_text.set_value(nested_wait(inner_recv));
  });
  ctx.publish("attached", "1");
  auto collective = collective_text.get_future();
  auto recv = recv_text.get_future();
  REQUIRE(collective.wait_for(20s) == std::future_status::ready);
  REQUIRE(recv.wait_for(20s) == std::future_status::ready);
  const std::string c = collective.get();
  CHECK_MESSAGE(contains(c, "Work::wait: allreduce (sequence number "), c);
  CHECK_MESSAGE(contains(c,
                         ") was waited for on the thread that runs it (in a callback of another "
                         "work of its group): it could never complete"),
                c);
  const std::string rv = recv.get();
  CHECK_MESSAGE(contains(rv, "Work::wait: recv was waited for on the thread that runs it"), rv);
  // The works waited for in the callbacks run once the callbacks returned (and this thread may
  // wait for them).
  CHECK(inner_collective->wait());
  CHECK(inner_recv->wait());
  CHECK(at::equal(inner[0], at::full({4}, 2.0)));
  CHECK(at::equal(got_inner[0], at::full({4}, 2.0)));  // rank 1's tensor after the first sum
  ctx.publish("checked", "1");
}

TEST_CASE("distrpc backend: a member that never arrives fails the meeting, naming its key") {
  auto store = std::make_shared<distrpc::store::HashStore>();
  const auto t0 = Clock::now();
  std::string err;
  try {
    DistrpcBackend<Tcp> b(store, 0, 2, std::chrono::milliseconds(300));
  } catch (const DistBackendError& e) {
    err = e.what();
  }
  CHECK(contains(err,
                 "DistrpcBackend: rank 0: not every member published its address within "
                 "300 ms: "));
  CHECK(contains(err, "distrpc_backend/addr/1"));
  CHECK(ms_since(t0) < 3000);
}

// Other tests in this process may have registered "distrpc" first (the conformance suite does, on
// Auto): registered once, it stays, and a second registration is refused with the registry's text.
TEST_CASE("distrpc backend: registered as \"distrpc\" for CPU") {
  if (!distrpc::dist::is_backend_available("distrpc")) {
    distrpc::dist::register_distrpc_backend<Tcp>();
  }
  CHECK(distrpc::dist::is_backend_available("distrpc"));
  CHECK(distrpc::dist::BackendConfig("distrpc").to_string() == "cpu:distrpc");  // CPU only
  try {
    distrpc::dist::register_distrpc_backend<Tcp>();
    FAIL("a second registration of \"distrpc\" was accepted");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()) == "DISTRPC c10d backend already exist");
  }
  auto creator = distrpc::dist::backend_creator("distrpc");
  auto b =
      creator(std::make_shared<distrpc::store::HashStore>(), 0, 1, std::chrono::milliseconds(1000));
  CHECK(b->name() == "distrpc");
  std::vector<at::Tensor> t{at::ones({2})};
  CHECK(b->allreduce(t)->wait());
  CHECK(at::equal(t[0], at::ones({2})));
}
