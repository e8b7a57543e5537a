// The nccl backend (distrpc/dist/nccl_backend.hpp). Built where Meson finds NCCL and the CUDA
// runtime. Without a GPU: registration and the refusal to start, naming why. On one GPU: every
// operation at world 1 (what one GPU allows: NCCL refuses two processes on one device) through
// the backend and through the front end, the streams, the argument checks. On two GPUs: two ranks,
// and a collective one rank never joins failing the other with the watchdog's timeout.
// Registration is process-wide, so the cases that register run in processes of their own.
#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distrpc/ddp.hpp"
#include "distrpc/dist.hpp"
#include "distrpc/dist/backend_config.hpp"
#include "distrpc/dist/nccl_backend.hpp"
#include "distrpc/dist/work.hpp"
#include "distrpc/error.hpp"
#include "distrpc/store/file_store.hpp"
#include "distrpc/store/hash_store.hpp"
#include "distrpc/torch_compat.hpp"
#include "multiprocess.hpp"
#include "support/error_text.hpp"

namespace nccl_test {

using distrpc::dist::NcclBackend;
using distrpc::dist::ReduceOp;
using distrpc::testing::contains;
using distrpc::testing::error_text;
using std::chrono::milliseconds;

int gpus() {
  return distrpc::compat::cuda_device_count();
}

#define SKIP_UNLESS_GPUS(n)                                                      \
  if (gpus() < (n)) {                                                            \
    MESSAGE("skipped: needs " << (n) << " GPU(s), this machine has " << gpus()); \
    return;                                                                      \
  }

c10::Device gpu(int i) {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
}

at::TensorOptions on(int i, at::ScalarType t = at::kFloat) {
  return at::TensorOptions().dtype(t).device(gpu(i));
}

std::shared_ptr<NcclBackend> world_of_one(milliseconds timeout = milliseconds(10000)) {
  return std::make_shared<NcclBackend>(
      std::make_shared<distrpc::store::HashStore>(milliseconds(5000)), 0, 1, timeout);
}

// Tens of milliseconds of work on the current stream whose result is `t` (multiplied by the
// identity ten times): a reader that does not wait for the stream sees unfinished memory.
at::Tensor slowly(const at::Tensor& t) {
  const at::Tensor eye = at::eye(t.size(0), t.options());
  at::Tensor y = t;
  for (int i = 0; i < 10; ++i) y = at::matmul(y, eye);
  return y;
}

DISTRPC_MP_TEST("nccl backend: registered for cuda, once; without a GPU it refuses to start", 1,
                60) {
  distrpc::dist::register_nccl_backend();
  distrpc::dist::register_nccl_backend();  // a second call is harmless
  CHECK(distrpc::dist::is_backend_available("nccl"));
  CHECK(distrpc::dist::BackendConfig("nccl").to_string() == "cuda:nccl");
  CHECK(distrpc::dist::BackendConfig("undefined").to_string().find("cuda:nccl") !=
        std::string::npos);
  if (gpus() > 0) return;  // starting is the GPU cases' business
  auto store = std::make_shared<distrpc::store::HashStore>(milliseconds(1000));
  CHECK(error_text<distrpc::DistBackendError>([&] {
          (void)distrpc::dist::backend_creator("nccl")(store, 0, 1, milliseconds(1000));
        }) ==
        "NcclBackend: no CUDA device is visible to this process (a CPU-only libtorch, no GPU, or "
        "CUDA_VISIBLE_DEVICES empty)");
  CHECK(error_text<std::invalid_argument>([] {
          NcclBackend b(nullptr, 0, 1, milliseconds(1000));
        }) == "NcclBackend: the store is null");
}

TEST_CASE("nccl backend: every operation at world 1 on cuda:0") {
  SKIP_UNLESS_GPUS(1);
  auto b = world_of_one();
  CHECK(b->name() == "nccl");
  CHECK(b->device() == gpu(0));
  const at::Tensor base = at::arange(12, on(0)).view({3, 4});

  std::vector<at::Tensor> one{base.clone()};
  auto w = b->allreduce(one);
  CHECK(w->wait());
  CHECK(w->sequence_number() == 1);
  CHECK(at::equal(w->result()[0], base));
  CHECK(b->allreduce(one, {ReduceOp::AVG})->wait());
  CHECK(at::equal(one[0], base));
  CHECK(b->allreduce(one, {distrpc::dist::make_premul_sum(2.0)})->wait());
  CHECK(at::equal(one[0], base * 2));

  // (Made from integers: libtorch 2.11's at::tensor() cannot make a bool tensor on a GPU.)
  const at::Tensor bools = at::tensor({1, 0}, at::kInt).to(on(0, at::kBool));
  std::vector<at::Tensor> flags{bools.clone()};
  CHECK(b->allreduce(flags)->wait());  // SUM on bool: logical or
  CHECK(at::equal(flags[0], bools));

  std::vector<at::Tensor> several{base.clone(), base.clone() + 1};
  CHECK(b->allreduce_coalesced(several)->wait());
  CHECK(at::equal(several[1], base + 1));

  std::vector<at::Tensor> root{base.clone()};
  CHECK(b->broadcast(root)->wait());
  CHECK(b->reduce(root)->wait());
  CHECK(at::equal(root[0], base));

  at::Tensor in = base.clone();
  std::vector<at::Tensor> in_list{in};
  std::vector<std::vector<at::Tensor>> gathered{{at::zeros({3, 4}, on(0))}};
  CHECK(b->allgather(gathered, in_list)->wait());
  CHECK(at::equal(gathered[0][0], base));
  at::Tensor flat_out = at::zeros({12}, on(0));
  CHECK(b->allgather_into_tensor(flat_out, in)->wait());
  CHECK(at::equal(flat_out, base.reshape({-1})));

  std::vector<std::vector<at::Tensor>> g{{at::zeros({3, 4}, on(0))}};
  CHECK(b->gather(g, in_list)->wait());
  CHECK(at::equal(g[0][0], base));
  std::vector<at::Tensor> scattered{at::zeros({3, 4}, on(0))};
  std::vector<std::vector<at::Tensor>> pieces{{base.clone()}};
  CHECK(b->scatter(scattered, pieces)->wait());
  CHECK(at::equal(scattered[0], base));

  std::vector<at::Tensor> rs_out{at::zeros({3, 4}, on(0))};
  CHECK(b->reduce_scatter(rs_out, pieces)->wait());
  CHECK(at::equal(rs_out[0], base));
  at::Tensor rst_out = at::zeros({3, 4}, on(0));
  CHECK(b->reduce_scatter_tensor(rst_out, in)->wait());
  CHECK(at::equal(rst_out, base));

  at::Tensor a2a_out = at::zeros({3, 4}, on(0));
  CHECK(b->alltoall_base(a2a_out, in, {}, {})->wait());
  CHECK(at::equal(a2a_out, base));
  std::vector<at::Tensor> a2a_outs{at::zeros({3, 4}, on(0))};
  CHECK(b->alltoall(a2a_outs, in_list)->wait());
  CHECK(at::equal(a2a_outs[0], base));

  auto bar = b->barrier();
  CHECK(bar->wait());
  CHECK(bar->result().empty());
  // Every collective above took one sequence number; point-to-point has no peer at world 1.
  CHECK(b->sequence_number() == 16);
  b->shutdown();
  CHECK(error_text<distrpc::DistBackendError>([&] { (void)b->allreduce(one); }) ==
        "NcclBackend: shut down");
}

TEST_CASE("nccl backend: bad arguments are named before anything is queued") {
  SKIP_UNLESS_GPUS(1);
  auto b = world_of_one();
  std::vector<at::Tensor> cpu{at::ones({2})};
  CHECK(error_text<std::invalid_argument>([&] { (void)b->allreduce(cpu); }) ==
        "allreduce: input 0 is on cpu; the nccl backend serves CUDA tensors on cuda:0");
  std::vector<at::Tensor> strided{at::ones({4, 4}, on(0)).t()};
  CHECK(error_text<std::invalid_argument>([&] { (void)b->allreduce(strided); }) ==
        "allreduce: input 0 is not contiguous (NCCL reads and writes it in place)");
  std::vector<at::Tensor> t{at::ones({2}, on(0))};
  CHECK(error_text<std::invalid_argument>([&] { (void)b->allreduce(t, {ReduceOp::BAND}); }) ==
        "Cannot use ReduceOp.BAND with NCCL");
  std::vector<at::Tensor> flags{at::ones({2}, on(0, at::kBool))};
  CHECK(error_text<std::invalid_argument>([&] { (void)b->allreduce(flags, {ReduceOp::AVG}); }) ==
        "Cannot use ReduceOp.AVG with boolean inputs");
  std::vector<at::Tensor> complex{at::ones({2}, on(0, at::kComplexFloat))};
  CHECK(error_text<std::invalid_argument>([&] { (void)b->allreduce(complex); }) ==
        "allreduce: dtype ComplexFloat is not supported by NCCL");
  std::vector<at::Tensor> two{at::ones({2}, on(0)), at::ones({2}, on(0))};
  CHECK(error_text<std::invalid_argument>([&] { (void)b->broadcast(two); }) ==
        "broadcast: expects exactly one input tensor, got 2");
  at::Tensor out = at::zeros({3}, on(0));
  at::Tensor in = at::ones({2}, on(0));
  CHECK(error_text<std::invalid_argument>([&] { (void)b->allgather_into_tensor(out, in); }) ==
        "allgather_into_tensor: the output has 3 elements, expected the input's 2 times the "
        "group size 1");
  // None of the refused calls took a sequence number.
  CHECK(b->sequence_number() == 0);
  CHECK(b->allreduce(t)->wait());
  CHECK(b->sequence_number() == 1);
}

TEST_CASE("nccl backend: an operation waits for the caller's stream; its Work completes after it") {
  SKIP_UNLESS_GPUS(1);
  auto b = world_of_one();
  const c10::impl::VirtualGuardImpl cuda(c10::kCUDA);
  const at::Tensor expected = at::remainder(at::arange(2048 * 2048, on(0)), 7).view({2048, 2048});
  at::Tensor out = at::zeros({2048 * 2048}, on(0));
  std::shared_ptr<distrpc::dist::Work> w;
  {
    // The input is still being made on a stream of the pool when the all-gather is queued: NCCL
    // copies it into `out` only once that stream's work is done.
    const c10::StreamGuard side(cuda.getStreamFromGlobalPool(gpu(0)));
    at::Tensor in = slowly(expected);
    w = b->allgather_into_tensor(out, in);
  }
  // Read on the default stream, which never waited for anything: the Work completes only once
  // the GPU has finished the copy.
  CHECK(w->wait());
  CHECK(at::equal(out.view({2048, 2048}), expected));
}

// The default group as a group of one over the nccl backend alone; false (the case says it
// skips) without a GPU.
bool nccl_group_of_one() {
  if (gpus() < 1) {
    MESSAGE("skipped: needs 1 GPU(s), this machine has 0");
    return false;
  }
  distrpc::dist::register_nccl_backend();
  distrpc::dist::init_process_group("nccl",
                                    std::make_shared<distrpc::store::HashStore>(milliseconds(5000)),
                                    0, 1, milliseconds(20000));
  return true;
}

DISTRPC_MP_TEST("nccl backend: the front end routes CUDA tensors of a cuda:nccl group to it", 1,
                120) {
  if (!nccl_group_of_one()) return;
  namespace dist = distrpc::dist;
  CHECK(dist::get_backend() == "nccl");
  at::Tensor t = at::arange(8, on(0));
  dist::all_reduce(t);
  CHECK(at::equal(t, at::arange(8, on(0))));
  std::vector<at::Tensor> list{at::zeros({8}, on(0))};
  dist::all_gather(list, t);
  CHECK(at::equal(list[0], t));
  dist::barrier();
  dist::destroy_process_group();
}

DISTRPC_MP_TEST("nccl backend: new_group splits the default group's communicator (world 1)", 1,
                120) {
  if (!nccl_group_of_one()) return;
  namespace dist = distrpc::dist;
  auto parent = std::dynamic_pointer_cast<NcclBackend>(dist::get_default_group()->backend("cuda"));
  REQUIRE(parent);
  if (!parent->can_split()) {
    MESSAGE("skipped: NCCL " << NCCL_VERSION_CODE << " has no ncclCommSplit (2.18 and later)");
    dist::destroy_process_group();
    return;
  }
  CHECK(parent->splits() == 0);
  auto sub = dist::new_group({0});
  REQUIRE(sub);
  CHECK(parent->splits() == 1);
  auto mine = std::dynamic_pointer_cast<NcclBackend>(sub->backend("cuda"));
  REQUIRE(mine);
  CHECK(mine->made_by_split());
  CHECK_FALSE(parent->made_by_split());
  CHECK(mine->device() == parent->device());
  at::Tensor t = at::arange(8, on(0));
  dist::all_reduce(t, {.group = sub});
  CHECK(at::equal(t, at::arange(8, on(0))));
  CHECK(sub->sequence_number() == 1);
  CHECK(dist::get_default_group()->sequence_number() == 0);
  // A group of its members only (use_local_synchronization) is made on its own.
  auto local = dist::new_group({0}, {.use_local_synchronization = true});
  REQUIRE(local);
  CHECK(parent->splits() == 1);
  CHECK_FALSE(std::dynamic_pointer_cast<NcclBackend>(local->backend("cuda"))->made_by_split());
  CHECK(mine->can_split());  // and can be split in turn
  dist::barrier({.group = sub});
  dist::destroy_process_group();
}

// DistributedDataParallel on cuda:0 over the nccl backend alone (a group of one: what one GPU
// allows; the group has no CPU backend). It trains exactly as the module alone; the reducer's own
// collectives run on the GPU too: the bucket plan broadcast before the second forward, and the
// used map all-reduced when unused parameters are searched for.
struct DdpNet : torch::nn::Module {
  explicit DdpNet(bool with_spare) {
    a = register_module("a", torch::nn::Linear(4, 8));
    b = register_module("b", torch::nn::Linear(8, 2));
    if (with_spare) spare = register_module("spare", torch::nn::Linear(2, 2));  // never used
  }
  at::Tensor forward(at::Tensor x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, spare{nullptr};
};

void train_alike(distrpc::nn::DDPOptions options, bool with_spare, bool expect_rebuilt,
                 const std::vector<std::size_t>& expected_unused) {
  torch::manual_seed(7);
  auto model = std::make_shared<DdpNet>(with_spare);
  torch::manual_seed(7);
  auto alone = std::make_shared<DdpNet>(with_spare);
  model->to(gpu(0));
  alone->to(gpu(0));
  distrpc::nn::DistributedDataParallel ddp(model, options);
  torch::optim::SGD opt(model->parameters(), 0.1);
  torch::optim::SGD alone_opt(alone->parameters(), 0.1);
  for (int it = 0; it < 3; ++it) {
    const at::Tensor x = at::randn({16, 4}, on(0));
    const at::Tensor y = at::randn({16, 2}, on(0));
    opt.zero_grad();
    torch::mse_loss(ddp(x), y).backward();
    opt.step();
    alone_opt.zero_grad();
    torch::mse_loss(alone->forward(x), y).backward();
    alone_opt.step();
    for (std::size_t i = 0; i < model->parameters().size(); ++i) {
      CHECK(model->parameters()[i].device() == gpu(0));
      CHECK_MESSAGE(at::allclose(model->parameters()[i], alone->parameters()[i], 1e-5, 1e-6),
                    "iteration " << it << ", parameter " << i);
    }
  }
  const auto st = ddp.stats();
  CHECK(st.iterations == 3);
  CHECK(st.buckets_rebuilt == expect_rebuilt);
  CHECK(st.unused_parameters == expected_unused);
}

DISTRPC_MP_TEST("nccl backend: DistributedDataParallel on cuda:0 trains as the module alone", 1,
                120) {
  if (!nccl_group_of_one()) return;
  train_alike({}, false, true, {});  // buckets rebuilt before the second forward
  // spare's weight and bias (parameters 4 and 5) are found unused in every pass.
  train_alike({.find_unused_parameters = true}, true, false, {4, 5});
  distrpc::dist::destroy_process_group();
}

// ---- two GPUs ------------------------------------------------------------------------------

DISTRPC_MP_TARGET("nccl target: two ranks, one GPU each") {
  auto store = std::make_shared<distrpc::store::FileStore>(ctx.dir + "/store", 2);
  NcclBackend b(store, ctx.rank, 2, milliseconds(20000), {ctx.rank});
  std::vector<at::Tensor> t{at::full({4}, static_cast<double>(ctx.rank + 1), on(ctx.rank))};
  CHECK(b.allreduce(t)->wait());
  CHECK(at::equal(t[0], at::full({4}, 3.0, on(ctx.rank))));
  std::vector<at::Tensor> msg{at::full({2}, 7.0, on(ctx.rank))};
  if (ctx.rank == 0) {
    CHECK(b.send(msg, 1, 0)->wait());
  } else {
    std::vector<at::Tensor> got{at::zeros({2}, on(1))};
    CHECK(b.recv(got, 0, 0)->wait());
    CHECK(at::equal(got[0], msg[0]));
  }
  // Rank 1 never joins this one: rank 0's fails after its 2 s timeout with the watchdog's text,
  // and the communicator is aborted.
  std::vector<at::Tensor> lonely{at::ones({4}, on(ctx.rank))};
  if (ctx.rank == 0) {
    auto w = b.allreduce(lonely, {ReduceOp::SUM, milliseconds(2000)});
    const std::string text = error_text<distrpc::DistBackendError>([&] { w->wait(); });
    CHECK(contains(text,
                   "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, "
                   "OpType=ALLREDUCE, Timeout(ms)=2000) ran for "));
    CHECK(contains(error_text<distrpc::DistBackendError>([&] { (void)b.allreduce(lonely); }),
                   "The communicator was aborted"));
  }
  ctx.publish("done" + std::to_string(ctx.rank), "1");
  (void)ctx.lookup("done" + std::to_string(1 - ctx.rank));
}

TEST_CASE("nccl backend: two ranks on two GPUs; a collective one rank skips times out") {
  SKIP_UNLESS_GPUS(2);
  distrpc::testing::RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(120);
  auto r = distrpc::testing::run_ranks("nccl target: two ranks, one GPU each", o);
  CHECK_MESSAGE(r.ok, r.report());
}

}  // namespace nccl_test
