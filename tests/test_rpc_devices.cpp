// Device maps across processes, on the CPU: the group-wide check at init (every worker fails
// alike, no agent is left, a corrected init works), CPU maps routing requests and responses, and
// the fail-fast errors for tensors no map covers (a meta tensor stands in for a GPU one: the
// agent treats every non-CPU device alike) without exhausting the request pool. Device maps are
// the agent's, not the transport's: these run on tcp only.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <doctest/doctest.h>

#include <distrpc/device_future.hpp>
#include <distrpc/rpc.hpp>
#include <distrpc/torch_compat.hpp>
#ifdef DISTRPC_HAVE_CUDART
#include <distrpc/transport/cuda_ipc.hpp>
#include <distrpc/transport/tcp.hpp>
#endif
#ifdef DISTRPC_HAVE_NCCL
#include <distrpc/transport/nccl.hpp>
#endif

#include "multiprocess.hpp"
#include "support/fake_cuda.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"

using distrpc::DeviceMap;
using distrpc::DeviceName;
using distrpc::RpcBackendOptions;
using distrpc::testing::contains;
using distrpc::testing::error_text;
using distrpc::testing::wname;

namespace devmap_test {

at::Tensor devmap_echo(at::Tensor t) {
  return t;
}
// A result on a device no map can name.
at::Tensor devmap_meta_result(int n) {
  return at::empty({n}, at::device(at::kMeta));
}
std::string devmap_device_of(at::Tensor t) {
  return t.device().str();
}
// A result on the callee's first GPU.
at::Tensor devmap_cuda_result(int n) {
  return at::arange(n, at::kFloat).to(c10::Device(c10::kCUDA, 0));
}
// The devices of both tensors, and their sum on the second one's device.
std::tuple<std::string, std::string, at::Tensor> devmap_pair(at::Tensor a, at::Tensor b) {
  return {a.device().str(), b.device().str(), a.to(b.device()) + b};
}
// `t` (square) multiplied by the identity ten times over, then plus `k`: exact, and several
// milliseconds of work queued on the current stream, which a reader that does not wait for it
// would overtake.
at::Tensor devmap_slow_plus(at::Tensor t, int k) {
  const at::Tensor eye = at::eye(t.size(0), t.options());
  at::Tensor y = t;
  for (int i = 0; i < 10; ++i) y = at::matmul(y, eye);
  return y + k;
}
// The same through the caller: worker1 asks worker0 for devmap_slow_plus(t, k), then adds one.
at::Tensor devmap_nested_plus(at::Tensor t, int k) {
  return distrpc::rpc_sync<&devmap_slow_plus>("worker0", t, k) + 1;
}

// The id of the stream current on cuda:0 where this runs (0: the default stream).
std::int64_t devmap_stream_id() {
  return c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(c10::Device(c10::kCUDA, 0)).id();
}
// That id here, then called back from here on worker0, then here again after that call.
std::tuple<std::int64_t, std::int64_t, std::int64_t> devmap_nested_stream_ids() {
  const std::int64_t own = devmap_stream_id();
  const std::int64_t back = distrpc::rpc_sync<&devmap_stream_id>("worker0");
  return {own, back, devmap_stream_id()};
}

}  // namespace devmap_test

namespace {

bool on_tcp() {
  return distrpc::testing::transport_under_test() == "tcp";
}

// init_rpc with `o` on a fresh rendezvous of this run named `tag`.
void init_at(const distrpc::testing::RankContext& ctx, const std::string& tag,
             RpcBackendOptions o) {
  o.init_method = distrpc::testing::file_url(ctx, tag);
  distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, o);
}

}  // namespace

DISTRPC_MP_TEST("devices: the group checks every worker's device maps at init; all fail alike", 3,
                90) {
  if (!on_tcp()) return;
  struct Case {
    const char* tag;
    int offender;  // the rank whose map is wrong
    void (*set)(RpcBackendOptions&);
    const char* text;
  };
  const Case cases[] = {
      {"names", 1,
       [](RpcBackendOptions& o) {
         o.set_device_map("worker9", {{"cpu", "cpu"}});
       },
       "Node worker1 has invalid target node names in its device maps"},
      {"source", 2,
       [](RpcBackendOptions& o) {
         o.set_device_map("worker0", {{100, "cpu"}});
       },
       "Node worker2 has source devices with invalid indices in its device map for worker0"},
      {"target", 0,
       [](RpcBackendOptions& o) {
         o.set_device_map("worker1", {{"cpu", 100}});
       },
       "Node worker0 has target devices with invalid indices in its device map for worker1"},
      {"dup", 1,
       [](RpcBackendOptions& o) {
         o.device_maps["worker2"] = DeviceMap{{DeviceName::cpu(), DeviceName::cpu()},
                                              {DeviceName::cuda(100), DeviceName::cpu()}};
       },
       "Node worker1 has duplicated target devices in its device map for worker2"},
  };
  for (const Case& c : cases) {
    INFO("case " << c.tag);
    RpcBackendOptions o;
    if (ctx.rank == c.offender) c.set(o);
    const std::string err = error_text<std::invalid_argument>([&] { init_at(ctx, c.tag, o); });
    CHECK_MESSAGE(contains(err, c.text), err);
    // Init is all or nothing: no agent is left on any worker.
    CHECK_FALSE(distrpc::is_initialized());
  }
  // A second offender later in the table: every worker names the first one.
  {
    RpcBackendOptions o;
    if (ctx.rank == 0) o.set_device_map("worker1", {{"cpu", 100}});
    if (ctx.rank == 2) o.set_device_map("nobody", {{"cpu", "cpu"}});
    const std::string err = error_text<std::invalid_argument>([&] { init_at(ctx, "two", o); });
    CHECK_MESSAGE(contains(err, "Node worker0 has target devices with invalid indices"), err);
  }
  // Corrected, the same processes start and call each other.
  init_at(ctx, "good", RpcBackendOptions{});
  const at::Tensor x = at::ones({3}) * ctx.rank;
  CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>(wname((ctx.rank + 1) % 3), x), x));
  distrpc::shutdown();
}

DISTRPC_MP_TEST("devices: CPU maps route requests and responses; unmapped devices fail fast", 2,
                90) {
  if (!on_tcp()) return;
  RpcBackendOptions o;
  o.num_worker_threads = 2;
  const int peer = 1 - ctx.rank;
  // worker0 maps cpu -> cpu towards worker1; worker1 has no map.
  if (ctx.rank == 0) o.set_device_map("worker1", {{"cpu", "cpu"}});
  init_at(ctx, "route", o);

  CHECK(distrpc::get_device_map(wname(peer)) ==
        (ctx.rank == 0 ? DeviceMap{{DeviceName::cpu(), DeviceName::cpu()}} : DeviceMap{}));
  CHECK(distrpc::get_devices().empty());  // the maps name no CUDA device

  // Mapped or not, CPU tensors travel both ways, views and all.
  const at::Tensor view = at::arange(12, at::kFloat).reshape({3, 4}).t();
  const at::Tensor back = distrpc::rpc_sync<&devmap_test::devmap_echo>(wname(peer), view);
  CHECK(at::equal(back, view));
  CHECK(back.strides() == view.strides());
  CHECK(distrpc::rpc_sync<&devmap_test::devmap_device_of>(wname(peer), view) == "cpu");

  if (ctx.rank == 0) {
    // A tensor no map covers: refused before anything is sent, every time, with the reason.
    const int repeats = o.num_worker_threads + 5;
    const at::Tensor meta = at::empty({4}, at::device(at::kMeta));
    const auto t0 = std::chrono::steady_clock::now();
    int request_errors = 0;
    std::string err;
    for (int i = 0; i < repeats; ++i) {
      err = error_text<distrpc::wire::EncodeError>(
          [&] { distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", meta); });
      request_errors +=
          contains(err, "RPC only supports CPU tensors by default") &&
          contains(err, "call `set_device_map` on `RpcBackendOptions`") &&
          contains(err, "Request device mapping is not available for destination worker1") &&
          contains(err, "(a tensor on meta)");
    }
    CHECK_MESSAGE(request_errors == repeats, err);

    // A result no inverse map covers: worker1 refuses to send it, the call fails at once, and
    // the handler's thread is given back (repeats > the pool's threads).
    int response_errors = 0;
    for (int i = 0; i < repeats; ++i) {
      err = distrpc::testing::error_of(
          [&] { distrpc::rpc_sync<&devmap_test::devmap_meta_result>("worker1", 2); });
      response_errors +=
          contains(err, "Response device mapping is not available for destination worker0");
    }
    CHECK_MESSAGE(response_errors == repeats, err);
    CHECK(distrpc::testing::ms_since(t0) < 10'000);
    // The next CPU call succeeds.
    CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", at::ones({2})),
                    at::ones({2})));

    // A per-call map replaces the configured one for that request; it is checked as the group
    // checked the configured maps.
    CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>(
                        "worker1", distrpc::with_device_map({{"cpu", "cpu"}}), at::ones({2})),
                    at::ones({2})));
    CHECK(contains(error_text<std::invalid_argument>([] {
                     distrpc::rpc_sync<&devmap_test::devmap_echo>(
                         "worker1", distrpc::with_device_map({{100, "cpu"}}), at::ones({2}));
                   }),
                   "Node worker0 has source devices with invalid indices in its device map for "
                   "worker1"));
    CHECK(contains(error_text<std::invalid_argument>([] {
                     distrpc::rpc_sync<&devmap_test::devmap_echo>(
                         "worker1", distrpc::with_device_map({{"cpu", 100}}), at::ones({2}));
                   }),
                   "has target devices with invalid indices"));
    CHECK(error_text<std::invalid_argument>([] {
            distrpc::with_device_map({{0, 1}, {1, 1}});
          }) ==
          "`with_device_map` only supports 1-to-1 mapping, trying to map cuda:1 and cuda:0 "
          "to cuda:1");
  } else {
    // worker1 has no map towards worker0: its own meta tensor is refused the same way.
    const std::string err = error_text<distrpc::wire::EncodeError>([] {
      distrpc::rpc_sync<&devmap_test::devmap_echo>("worker0",
                                                   at::empty({1}, at::device(at::kMeta)));
    });
    CHECK_MESSAGE(contains(err, "Request device mapping is not available for destination worker0"),
                  err);
  }
  distrpc::barrier();
  distrpc::shutdown();
}

namespace {

// The fake CUDA was asked, since `ops` were taken, to make the stream `waiter` on cuda:0 wait
// for an event recorded on another stream, one of the pool: a future's value handed over.
bool waited_for_pool_stream(const std::vector<distrpc::testing::Op>& ops, c10::StreamId waiter) {
  for (const auto& b : ops) {
    if (b.what != "block" || b.device != 0 || b.stream != waiter) continue;
    for (const auto& r : ops) {
      if (r.what == "record" && r.event == b.event && r.device == 0 && r.stream >= 100 &&
          r.stream != waiter) {
        return true;
      }
    }
  }
  return false;
}

// Whether the stand-in is in place; on a CUDA libtorch it is not, and the case says it skips (the
// GPU cases cover streams there).
bool stand_in_runs(const distrpc::testing::FakeCudaScope& cuda) {
  if (!cuda.active()) MESSAGE("skipped: this libtorch has CUDA; the GPU cases cover streams there");
  return cuda.active();
}

}  // namespace

// Streams without a GPU: a stand-in CUDA implementation (tests/support/fake_cuda.hpp) gives both
// processes two devices and numbered streams (pool streams from 100), so what the agent asks of
// streams shows; the tensors sent are CPU ones. A CUDA libtorch has the real implementation: the
// GPU cases below cover it there.
DISTRPC_MP_TEST(
    "devices: a worker with devices hands out call futures that carry them; requests run on the "
    "request thread's streams (stand-in CUDA)",
    2, 90) {
  distrpc::testing::FakeCudaScope cuda;
  if (!on_tcp() || !stand_in_runs(cuda)) return;
  const c10::Device gpu0(c10::kCUDA, 0);
  RpcBackendOptions o;
  o.set_device_map(ctx.rank == 0 ? "worker1" : "worker0", {{0, 0}});
  if (ctx.rank == 0) o.set_device_map("worker0", {{0, 0}});  // calls to itself
  init_at(ctx, "fake-streams", o);
  CHECK(distrpc::get_devices() == std::vector<DeviceName>{DeviceName::cuda(0)});
  if (ctx.rank == 0) {
    (void)cuda.fake.take();
    auto f = distrpc::rpc_async<&devmap_test::devmap_stream_id>("worker1");
    CHECK(distrpc::future_devices(f) == std::vector<c10::Device>{gpu0});
    // The callee ran the function on its request thread's current stream, the default one (GPU
    // work of requests stays ordered there, as it was).
    CHECK(f.value() == 0);
    // Reading the value made this thread's current stream (the default one) wait for the event
    // recorded on the pool stream where the reply was decoded.
    CHECK(waited_for_pool_stream(cuda.fake.take(), 0));

    // A caller working on a stream of its own: that stream waits, in rpc_sync too, and stays
    // current.
    const c10::Stream side = c10::impl::VirtualGuardImpl(c10::kCUDA).getStreamFromGlobalPool(gpu0);
    {
      const c10::StreamGuard on(side);
      (void)cuda.fake.take();
      CHECK(distrpc::rpc_sync<&devmap_test::devmap_stream_id>("worker1") == 0);
      CHECK(waited_for_pool_stream(cuda.fake.take(), side.id()));
      CHECK(devmap_test::devmap_stream_id() == side.id());
    }

    // A call to itself and a nested call (worker1 calls back into worker0) go the same way.
    (void)cuda.fake.take();
    auto self = distrpc::rpc_async<&devmap_test::devmap_stream_id>("worker0");
    CHECK(distrpc::future_devices(self) == std::vector<c10::Device>{gpu0});
    CHECK(self.value() == 0);
    CHECK(waited_for_pool_stream(cuda.fake.take(), 0));
    const auto [callee, back, callee_after] =
        distrpc::rpc_sync<&devmap_test::devmap_nested_stream_ids>("worker1");
    CHECK(callee == 0);
    CHECK(back == 0);
    CHECK(callee_after == 0);  // the callee's own call left its streams as they were
    // CPU tensors travel as before, and an error reaches the future as before.
    const at::Tensor x = at::arange(6, at::kFloat);
    CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", x), x));
    CHECK(contains(distrpc::testing::error_of(
                       [] { distrpc::rpc_sync<&devmap_test::devmap_meta_result>("worker1", 2); }),
                   "Response device mapping is not available for destination worker0"));
    CHECK(devmap_test::devmap_stream_id() == 0);  // this thread's streams are as they were
  }
  distrpc::barrier();
  distrpc::shutdown();
}

DISTRPC_MP_TEST(
    "devices: a worker without devices hands out plain futures and asks nothing of streams "
    "(stand-in CUDA)",
    2, 90) {
  distrpc::testing::FakeCudaScope cuda;
  if (!on_tcp() || !stand_in_runs(cuda)) return;
  init_at(ctx, "fake-no-devices", RpcBackendOptions{});
  CHECK(distrpc::get_devices().empty());
  if (ctx.rank == 0) {
    (void)cuda.fake.take();
    const int taken = cuda.fake.pool_streams_taken();
    auto f = distrpc::rpc_async<&devmap_test::devmap_stream_id>("worker1");
    CHECK(distrpc::future_devices(f).empty());
    CHECK(f.value() == 0);
    // Nothing was asked of streams or events here for the call.
    CHECK(cuda.fake.take().empty());
    CHECK(cuda.fake.pool_streams_taken() == taken);
  }
  distrpc::barrier();
  distrpc::shutdown();
}

TEST_CASE("devices: a dynamic group refuses device maps before it joins") {
  RpcBackendOptions o;
  o.init_method = "file:///nonexistent-dir/never-used";
  o.set_device_map("worker1", {{"cpu", "cpu"}});
  CHECK(error_text<std::invalid_argument>(
            [&] { distrpc::testing::init_rpc_dynamic_under_test("worker0", 0, o); }) ==
        "device maps and devices are not supported in a dynamic group (init_rpc without a "
        "world size): only CPU tensors can be sent there");
  CHECK_FALSE(distrpc::is_initialized());
}

// ---- on GPUs (skipped on a machine without them) ----------------------------------------------

DISTRPC_MP_TARGET("devices target: CUDA tensors follow the map, responses its inverse (1 GPU)") {
  // Both processes share the one GPU: worker0 maps its cuda:0 to worker1's cuda:0.
  RpcBackendOptions o;
  if (ctx.rank == 0) o.set_device_map("worker1", {{0, 0}});
  init_at(ctx, "gpu1", o);
  const c10::Device gpu(c10::kCUDA, 0);
  CHECK(distrpc::get_devices() == std::vector<DeviceName>{DeviceName::cuda(0)});
  if (ctx.rank == 0) {
    const at::Tensor x = at::arange(1 << 20, at::kFloat).to(gpu);
    CHECK(distrpc::rpc_sync<&devmap_test::devmap_device_of>("worker1", x) == "cuda:0");
    const at::Tensor back = distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", x);
    CHECK(back.device() == gpu);
    CHECK(at::equal(back.cpu(), x.cpu()));
    // CPU tensors stay on the CPU both ways; a GPU result comes back on the GPU.
    CHECK(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", at::ones({2})).is_cpu());
    const at::Tensor made = distrpc::rpc_sync<&devmap_test::devmap_cuda_result>("worker1", 5);
    CHECK(made.device() == gpu);
    CHECK(at::equal(made.cpu(), at::arange(5, at::kFloat)));
  } else {
    // worker1 has no map towards worker0: its GPU tensor is refused, and worker0 cannot send
    // a GPU result back to it.
    CHECK(contains(error_text<distrpc::wire::EncodeError>([&] {
                     distrpc::rpc_sync<&devmap_test::devmap_echo>("worker0", at::ones({2}, gpu));
                   }),
                   "Request device mapping is not available for destination worker0 (a tensor on "
                   "cuda:0)"));
    CHECK(contains(distrpc::testing::error_of(
                       [] { distrpc::rpc_sync<&devmap_test::devmap_cuda_result>("worker0", 3); }),
                   "Response device mapping is not available for destination worker1 (a tensor "
                   "on cuda:0)"));
    CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker0", at::ones({2})),
                    at::ones({2})));
  }
  distrpc::barrier();
  distrpc::shutdown();
}

DISTRPC_MP_TARGET("devices target: the map {0: 1, 1: 0} swaps GPUs (2 GPUs)") {
  RpcBackendOptions o;
  if (ctx.rank == 0) o.set_device_map("worker1", {{0, 1}, {1, 0}});
  init_at(ctx, "gpu2", o);
  if (ctx.rank == 0) {
    const at::Tensor a = at::ones({4}, c10::Device(c10::kCUDA, 0));
    const at::Tensor b = at::ones({4}, c10::Device(c10::kCUDA, 1)) * 2;
    const auto [da, db, sum] = distrpc::rpc_sync<&devmap_test::devmap_pair>("worker1", a, b);
    CHECK(da == "cuda:1");
    CHECK(db == "cuda:0");
    // The sum is on worker1's cuda:0 and comes back on the inverse: worker0's cuda:1.
    CHECK(sum.device() == c10::Device(c10::kCUDA, 1));
    CHECK(at::equal(sum.cpu(), at::full({4}, 3.0f)));
  }
  distrpc::barrier();
  distrpc::shutdown();
}

namespace {

// On worker0, everything queued on a stream of the pool, not the default one: the tensor sent is
// still being made when 20 calls go out, the results are read on that stream, and a nested call
// (worker1 calls back into worker0) sees finished values too. Returns the tensor sent.
at::Tensor side_stream_calls(const c10::Device& gpu) {
  const c10::impl::VirtualGuardImpl cuda(c10::kCUDA);
  const c10::StreamGuard on(cuda.getStreamFromGlobalPool(gpu));
  constexpr std::int64_t n = 2048;
  const at::Tensor x = devmap_test::devmap_slow_plus(
      at::remainder(at::arange(n * n, at::kFloat), 7).view({n, n}).to(gpu), 0);
  std::vector<distrpc::Future<at::Tensor>> calls;
  for (int k = 0; k < 20; ++k) {
    calls.push_back(distrpc::rpc_async<&devmap_test::devmap_slow_plus>("worker1", x, k));
  }
  for (int k = 0; k < 20; ++k) {
    const at::Tensor r = calls[static_cast<std::size_t>(k)].value();
    CHECK(r.device() == gpu);
    CHECK(at::equal(r, x + k));
  }
  const at::Tensor nested = distrpc::rpc_sync<&devmap_test::devmap_nested_plus>("worker1", x, 5);
  CHECK(nested.device() == gpu);
  CHECK(at::equal(nested, x + 6));
  return x;
}

}  // namespace

DISTRPC_MP_TARGET(
    "devices target: a caller's side stream, 20 calls in flight and a nested call see finished "
    "results (1 GPU)") {
  // Both workers map cuda:0 to the other's cuda:0 (nested calls come back to worker0).
  RpcBackendOptions o;
  o.set_device_map(ctx.rank == 0 ? "worker1" : "worker0", {{0, 0}});
  init_at(ctx, "gpu-streams", o);
  if (ctx.rank == 0) side_stream_calls(c10::Device(c10::kCUDA, 0));
  distrpc::barrier();
  distrpc::shutdown();
}

#ifdef DISTRPC_HAVE_CUDART
// Starts worker ctx.rank on a policy that moves device memory itself, the map {0: 0} towards the
// other worker (and, with `to_itself`, towards itself on worker 0), and returns its agent, which
// reaches the other worker through the policy's channel.
template <class Policy>
std::shared_ptr<distrpc::Agent<Policy>> init_direct(const distrpc::testing::RankContext& ctx,
                                                    const char* store, bool to_itself = false) {
  RpcBackendOptions o;
  o.init_method = distrpc::testing::file_url(ctx, store);
  o.set_device_map(ctx.rank == 0 ? "worker1" : "worker0", {{0, 0}});
  if (to_itself && ctx.rank == 0) o.set_device_map("worker0", {{0, 0}});
  distrpc::init_rpc<Policy>(wname(ctx.rank), ctx.rank, ctx.world, o);
  auto agent = std::dynamic_pointer_cast<distrpc::Agent<Policy>>(distrpc::detail::current_agent());
  REQUIRE(agent);
  CHECK(agent->context().reaches(1 - ctx.rank));
  return agent;
}

DISTRPC_MP_TARGET("devices target: CudaIpc<Tcp> moves CUDA tensors GPU to GPU (1 GPU)") {
  using Policy = distrpc::transport::CudaIpc<distrpc::transport::Tcp>;
  const auto agent = init_direct<Policy>(ctx, "cuda-ipc", /*to_itself=*/true);
  if (ctx.rank == 0) {
    const c10::Device gpu(c10::kCUDA, 0);
    // Each callee's copy waits for the event recorded on the caller's side stream.
    const at::Tensor x = side_stream_calls(gpu);
    // 64 MiB, a transposed view (its span travels), bools, and a CPU tensor beside them.
    const at::Tensor big = at::arange(16 << 20, at::TensorOptions().dtype(at::kFloat).device(gpu));
    CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", big), big));
    const at::Tensor t = x.t();
    const at::Tensor back = distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", t);
    CHECK(back.strides() == t.strides());
    CHECK(at::equal(back, t));
    const at::Tensor flags = x.gt(3);
    CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", flags), flags));
    CHECK(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", at::ones({3})).is_cpu());
    // A call to itself: the callee gets a copy made on the GPU, finished before it reads it.
    const at::Tensor mine = distrpc::rpc_sync<&devmap_test::devmap_slow_plus>("worker0", x, 2);
    CHECK(mine.device() == gpu);
    CHECK(at::equal(mine, x + 2));
    const auto s = agent->context().stats();
    CHECK(s.exported >= 24);  // every CUDA argument went through the channel
    CHECK(s.imported >= 24);  // and every CUDA result came back through it
    CHECK(s.staged == 0);
    CHECK(s.failed == 0);
    const auto c = agent->context().channel().stats();
    MESSAGE("slabs " << c.slabs << " (" << c.slab_bytes << " bytes), mappings opened "
                     << c.mappings_opened << ", reused " << c.mappings_reused);
    CHECK(c.mappings_opened + c.mappings_reused == s.imported);
    // Ten calls one after the other with a tensor of 1.5 MiB (a 2 MiB slab, or a free one up to
    // four times that): the caller's snapshots take slabs whose loans are back (at most two
    // new ones: a loan's Release and the reply race), and the callee's results come from slabs
    // this worker keeps mapped.
    // The replies land in memory of libtorch's caching allocator, allocated on one copy stream
    // of the device: each reply, dropped before the next call, leaves its block for the next
    // one (a stream per import would make each a new block: the allocator reuses a block only
    // on the stream it was made on).
    const at::Tensor mid = at::arange(3 << 17, at::TensorOptions().dtype(at::kFloat).device(gpu));
    std::set<const void*> reply_blocks;
    for (int k = 0; k < 10; ++k) {
      const at::Tensor r = distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", mid);
      CHECK(at::equal(r, mid));
      reply_blocks.insert(r.storage().data());
    }
    MESSAGE("10 replies of 1.5 MiB landed in " << reply_blocks.size() << " distinct blocks");
    CHECK(reply_blocks.size() <= 3);
    const auto after = agent->context().channel().stats();
    MESSAGE("after 10 echoes of 1.5 MiB: slabs " << after.slabs << ", mappings opened "
                                                 << after.mappings_opened << ", reused "
                                                 << after.mappings_reused);
    CHECK(after.slabs_retired == 0);  // every loan came back with its Release
    const std::size_t limit = distrpc::transport::detail::slab_limit_from_env();
    if (limit == 0) {
      // Every snapshot an allocation of libtorch's, mapped for one copy.
      CHECK(after.slabs == 0);
      CHECK(after.mappings_reused == 0);
    } else {
      CHECK(after.slabs >= 1);
      CHECK(after.slab_bytes <= limit);
      CHECK(after.slabs - c.slabs <= 2);
      CHECK(after.mappings_reused - c.mappings_reused >= 8);
      if (limit >= (std::size_t{1} << 30)) {
        // Room for every size above: the concurrent calls' slabs were reused by later calls.
        CHECK(c.mappings_reused >= 1);
        CHECK(c.mappings_opened < s.imported);
      }
    }
  }
  distrpc::barrier();
  CHECK(distrpc::testing::eventually([&] { return agent->context().stats().lent == 0; }));
  distrpc::shutdown();
}
#endif

#ifdef DISTRPC_HAVE_NCCL
// Nccl<Tcp>. On one GPU both processes see it, so every CUDA buffer goes through the policy's
// CUDA IPC side (NCCL refuses one device twice in a communicator). With DISTRPC_TEST_SPLIT_GPUS
// each process sees one GPU of its own (CUDA_VISIBLE_DEVICES), neither sees the other's, and
// every buffer goes over NCCL point-to-point.
DISTRPC_MP_TARGET("devices target: Nccl<Tcp> moves CUDA tensors GPU to GPU") {
  using Policy = distrpc::transport::Nccl<distrpc::transport::Tcp>;
  const auto agent = init_direct<Policy>(ctx, "nccl-policy");
  const bool split = std::getenv("DISTRPC_TEST_SPLIT_GPUS") != nullptr;
  if (ctx.rank == 0) {
    const c10::Device gpu(c10::kCUDA, 0);
    // 20 calls in flight from a side stream, and a nested call back to this worker.
    const at::Tensor x = side_stream_calls(gpu);
    const at::Tensor big = at::arange(16 << 20, at::TensorOptions().dtype(at::kFloat).device(gpu));
    CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", big), big));
    const at::Tensor t = x.t();
    const at::Tensor back = distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", t);
    CHECK(back.strides() == t.strides());
    CHECK(at::equal(back, t));
    // Sizes that change from call to call: each receive pairs with its own send.
    for (int k = 0; k < 20; ++k) {
      const at::Tensor v =
          at::full({1 + 997 * k}, static_cast<float>(k), at::TensorOptions().device(gpu));
      CHECK(at::equal(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", v), v));
    }
    CHECK(distrpc::rpc_sync<&devmap_test::devmap_echo>("worker1", at::ones({3})).is_cpu());
    const auto s = agent->context().stats();
    CHECK(s.staged == 0);
    CHECK(s.failed == 0);
    CHECK(s.exported >= 42);
    const auto c = agent->context().channel().stats();
    MESSAGE("split GPUs " << split << ": through CUDA IPC " << c.ipc_sent << " sent, "
                          << c.ipc_received << " received; through NCCL " << c.nccl_sent
                          << " sent, " << c.nccl_received << " received, " << c.communicators
                          << " communicators");
    if (split) {
      CHECK(c.ipc_sent == 0);
      CHECK(c.nccl_sent == s.exported);
      CHECK(c.nccl_received == s.imported);
      CHECK(c.communicators == 2);  // one per direction
      CHECK(c.aborted == 0);
    } else {
      CHECK(c.nccl_sent == 0);
      CHECK(c.ipc_sent == s.exported);
      CHECK(c.ipc_received == s.imported);
      CHECK(c.communicators == 0);
    }
  }
  distrpc::barrier();
  CHECK(distrpc::testing::eventually([&] { return agent->context().stats().lent == 0; }));
  distrpc::shutdown();
}
#endif

namespace {
void run_on_gpus(const char* target, int gpus, std::vector<std::string> env = {}) {
  const int have = distrpc::compat::cuda_device_count();
  if (have < gpus) {
    MESSAGE("skipped: needs " << gpus << " GPU(s), this machine has " << have);
    return;
  }
  distrpc::testing::RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(120);
  o.env = std::move(env);
  auto r = distrpc::testing::run_ranks(target, o);
  CHECK_MESSAGE(r.ok, r.report());
}
}  // namespace

TEST_CASE("devices: CUDA tensors follow the map, responses its inverse (needs a GPU)") {
  if (!on_tcp()) return;
  run_on_gpus("devices target: CUDA tensors follow the map, responses its inverse (1 GPU)", 1);
}

TEST_CASE(
    "devices: a caller's side stream, 20 calls in flight and a nested call see finished results "
    "(needs a GPU)") {
  if (!on_tcp()) return;
  run_on_gpus(
      "devices target: a caller's side stream, 20 calls in flight and a nested call see finished "
      "results (1 GPU)",
      1);
}

#ifdef DISTRPC_HAVE_CUDART
TEST_CASE("devices: CudaIpc<Tcp> moves CUDA tensors GPU to GPU (needs a GPU)") {
  if (!on_tcp()) return;
  run_on_gpus("devices target: CudaIpc<Tcp> moves CUDA tensors GPU to GPU (1 GPU)", 1,
              {"DISTRPC_CUDA_IPC_POOL_MB=1024"});
}

TEST_CASE(
    "devices: CudaIpc<Tcp> with slabs up to 8 MiB (DISTRPC_CUDA_IPC_POOL_MB=8): larger snapshots "
    "go the ordinary way (needs a GPU)") {
  if (!on_tcp()) return;
  run_on_gpus("devices target: CudaIpc<Tcp> moves CUDA tensors GPU to GPU (1 GPU)", 1,
              {"DISTRPC_CUDA_IPC_POOL_MB=8"});
}

TEST_CASE(
    "devices: CudaIpc<Tcp> without slabs (DISTRPC_CUDA_IPC_POOL_MB=0) maps each snapshot for one "
    "copy (needs a GPU)") {
  if (!on_tcp()) return;
  run_on_gpus("devices target: CudaIpc<Tcp> moves CUDA tensors GPU to GPU (1 GPU)", 1,
              {"DISTRPC_CUDA_IPC_POOL_MB=0"});
}

TEST_CASE("devices: DISTRPC_CUDA_IPC_POOL_MB is a number of MiB; a bad value is named") {
  using distrpc::transport::CudaIpcChannel;
  const char* saved = std::getenv("DISTRPC_CUDA_IPC_POOL_MB");
  const std::string keep = saved ? saved : "";
  for (const char* bad : {"lots", "-1", " 5", "5MB", "2000000"}) {
    ::setenv("DISTRPC_CUDA_IPC_POOL_MB", bad, 1);
    CHECK(error_text<std::invalid_argument>([] { CudaIpcChannel c(0); }) ==
          std::string("DISTRPC_CUDA_IPC_POOL_MB='") + bad +
              "' is not a number of MiB in 0..1048576");
  }
  for (const char* good : {"0", "1048576", ""}) {
    ::setenv("DISTRPC_CUDA_IPC_POOL_MB", good, 1);
    CudaIpcChannel c(0);
    const auto st = c.stats();
    CHECK(st.slabs == 0);
    CHECK(st.mappings_opened == 0);
  }
  if (saved) {
    ::setenv("DISTRPC_CUDA_IPC_POOL_MB", keep.c_str(), 1);
  } else {
    ::unsetenv("DISTRPC_CUDA_IPC_POOL_MB");
  }
}
#endif

TEST_CASE("devices: the map {0: 1, 1: 0} swaps GPUs (needs 2 GPUs)") {
  if (!on_tcp()) return;
  run_on_gpus("devices target: the map {0: 1, 1: 0} swaps GPUs (2 GPUs)", 2);
}

#ifdef DISTRPC_HAVE_NCCL
TEST_CASE("devices: Nccl<Tcp> on one GPU goes through CUDA IPC (needs a GPU)") {
  if (!on_tcp()) return;
  run_on_gpus("devices target: Nccl<Tcp> moves CUDA tensors GPU to GPU", 1);
}

TEST_CASE("devices: Nccl<Tcp> with a GPU per process goes over NCCL (needs 2 GPUs)") {
  if (!on_tcp()) return;
  const int have = distrpc::compat::cuda_device_count();
  if (have < 2) {
    MESSAGE("skipped: needs 2 GPUs, this machine has " << have);
    return;
  }
  distrpc::testing::RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(120);
  o.env = {"DISTRPC_TEST_SPLIT_GPUS=1"};
  // The first two GPUs of this job's own list, when it has one.
  std::vector<std::string> visible{"0", "1"};
  if (const char* list = std::getenv("CUDA_VISIBLE_DEVICES"); list != nullptr && *list != '\0') {
    std::vector<std::string> mine;
    std::string item;
    for (const char* c = list;; ++c) {
      if (*c == ',' || *c == '\0') {
        if (!item.empty()) mine.push_back(item);
        item.clear();
        if (*c == '\0') break;
      } else {
        item += *c;
      }
    }
    if (mine.size() >= 2) visible = {mine[0], mine[1]};
  }
  o.rank_env[0] = {"CUDA_VISIBLE_DEVICES=" + visible[0]};
  o.rank_env[1] = {"CUDA_VISIBLE_DEVICES=" + visible[1]};
  auto r =
      distrpc::testing::run_ranks("devices target: Nccl<Tcp> moves CUDA tensors GPU to GPU", o);
  CHECK_MESSAGE(r.ok, r.report());
}

TEST_CASE("devices: the nccl channel's descriptors and addresses are checked, on any machine") {
  namespace td = distrpc::transport::detail;
  using distrpc::transport::NcclChannel;
  td::NcclDescriptor d;
  d.generation = 7;
  d.seq = 3;
  d.device = 1;
  d.id.internal[0] = 'x';
  const std::string wire = td::encode_nccl_descriptor(d);
  REQUIRE(wire.size() == 1 + sizeof d);
  CHECK(wire.front() == 'N');
  const auto back = td::decode_nccl_descriptor(std::string_view(wire).substr(1));
  CHECK(back.generation == 7);
  CHECK(back.seq == 3);
  CHECK(back.device == 1);
  CHECK(back.id.internal[0] == 'x');
  CHECK(error_text<distrpc::DistNetworkError>([&] {
          td::decode_nccl_descriptor(std::string_view(wire).substr(1, 10));
        }) == "nccl: descriptor of 10 bytes (expected " + std::to_string(sizeof d) + ")");
  td::NcclDescriptor zero = d;
  zero.seq = 0;
  CHECK(error_text<distrpc::DistNetworkError>([&] {
          td::decode_nccl_descriptor(td::encode_nccl_descriptor(zero).substr(1));
        }) == "nccl: descriptor with sequence number 0 and device 1");
  td::NcclDescriptor negative = d;
  negative.device = -2;
  CHECK(error_text<distrpc::DistNetworkError>([&] {
          td::decode_nccl_descriptor(td::encode_nccl_descriptor(negative).substr(1));
        }) == "nccl: descriptor with sequence number 3 and device -2");

  CHECK(td::address_has_gpus("host=b;pid=1;gpus=0000:01:00.0"));
  CHECK(td::address_has_gpus("host=b;gpus=0000:01:00.0,0000:02:00.0;pid=1"));
  CHECK_FALSE(td::address_has_gpus("host=b;pid=1;gpus="));
  CHECK_FALSE(td::address_has_gpus("host=b;pid=1;gpus=;x=1"));
  CHECK_FALSE(td::address_has_gpus(""));

  NcclChannel c(0);
  CHECK(c.carries(at::ones({2})) == false);
  CHECK(error_text<distrpc::DistNetworkError>([&] { c.import_buffer(1, "", 8); }) ==
        "nccl: empty descriptor");
  CHECK(error_text<distrpc::DistNetworkError>([&] { c.import_buffer(1, "Z123", 8); }) ==
        "nccl: descriptor of unknown kind 90");
  CHECK(error_text<distrpc::DistNetworkError>([&] { c.import_buffer(1, "N12", 8); }) ==
        "nccl: descriptor of 2 bytes (expected " + std::to_string(sizeof d) + ")");
  // The same process is never reached (NCCL would see its GPU twice); a process without GPUs
  // neither.
  CHECK_FALSE(c.connect(1, c.address()));
  CHECK_FALSE(c.connect(2, "host=elsewhere;pid=1;gpus="));
  if (distrpc::compat::cuda_device_count() == 0) {
    CHECK(c.address().empty());
    CHECK_FALSE(c.connect(3, "host=elsewhere;pid=1;gpus=0000:01:00.0"));
  } else {
    CHECK(c.connect(3, "host=elsewhere;pid=1;gpus=0000:01:00.0"));  // another host: NCCL
  }
  const auto st = c.stats();
  CHECK(st.nccl_sent + st.ipc_sent + st.communicators + st.aborted == 0);
}
#endif
