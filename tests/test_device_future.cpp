// Futures with devices (distrpc/device_future.hpp) without a GPU: a stand-in CUDA implementation
// of c10's device interface, registered for the length of a test on a libtorch that has none,
// records what the future asks of streams and events (which event was recorded or waited for
// on which device and stream), and tensors that claim to live on cuda:N (never computed on)
// carry the devices. On a CUDA libtorch these cases skip: the real implementation is there, and
// the cases at the end (which skip without a GPU) run real work on real streams instead.
// libtorch's headers first: glog's CHECK, which they bring, must not replace doctest's.
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <distrpc/device_future.hpp>
#include <distrpc/torch_compat.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/error_text.hpp"
#include "support/fake_cuda.hpp"

namespace device_future_test {

using distrpc::Future;
using distrpc::future_devices;
using distrpc::make_future;

using distrpc::testing::cpu_tensor;
using distrpc::testing::FakeCuda;
using distrpc::testing::FakeCudaScope;
using distrpc::testing::gpu;
using distrpc::testing::Op;
using distrpc::testing::tensor_on;

#define SKIP_UNLESS_FAKE(scope)                                                           \
  if (!(scope).active()) {                                                                \
    MESSAGE("skipped: this libtorch has CUDA; the GPU cases cover futures with devices"); \
    return;                                                                               \
  }

TEST_CASE("device future: the devices are checked with PyTorch's texts") {
  CHECK(distrpc::testing::error_text<std::invalid_argument>([] {
          (void)make_future<at::Tensor>({c10::Device("cpu")});
        }) == "Expected devices to have indices, got cpu");
  CHECK(distrpc::testing::error_text<std::invalid_argument>([] {
          (void)make_future<at::Tensor>({gpu(0), c10::Device(c10::kCPU)});
        }) ==
        "Expected all devices to be of the same type, but got a mismatch between cuda:0 and cpu");
  // A device type no build of this libtorch has streams for.
  CHECK(distrpc::testing::error_text<std::invalid_argument>(
            [] { (void)make_future<at::Tensor>({c10::Device(c10::kXLA, 0)}); }) ==
        "distrpc::make_future: this libtorch has no streams for xla devices (a build without "
        "them), so a future on xla:0 cannot be made");
  // No devices: a plain future.
  Future<int> plain = make_future<int>(std::vector<c10::Device>{});
  CHECK(future_devices(plain).empty());
  plain.set_value(3);
  CHECK(plain.value() == 3);
  Future<int> on_cpu = make_future<int>({c10::Device(c10::kCPU, 0)});
  CHECK(future_devices(on_cpu).empty());
  on_cpu.set_value(4);
  CHECK(on_cpu.value() == 4);
}

TEST_CASE("device future: CUDA devices on a libtorch without CUDA are refused when made") {
  if (c10::impl::hasDeviceGuardImpl(c10::kCUDA)) {
    MESSAGE("skipped: this libtorch has CUDA");
    return;
  }
  CHECK(distrpc::testing::error_text<std::invalid_argument>(
            [] { (void)make_future<at::Tensor>({gpu(0)}); }) ==
        "distrpc::make_future: this libtorch has no streams for cuda devices (a build without "
        "them), so a future on cuda:0 cannot be made");
}

TEST_CASE("device future: devices sorted, repeats dropped; a value on another device fails it") {
  FakeCudaScope scope;
  SKIP_UNLESS_FAKE(scope);
  auto f = make_future<at::Tensor>({gpu(1), gpu(0), gpu(1)});
  CHECK(future_devices(f) == std::vector<c10::Device>{gpu(0), gpu(1)});

  auto g = make_future<std::vector<at::Tensor>>({gpu(0)});
  g.set_value(std::vector<at::Tensor>{cpu_tensor(), tensor_on(gpu(0)), tensor_on(gpu(1))});
  REQUIRE(g.has_error());
  CHECK(distrpc::testing::error_text<std::invalid_argument>([&] { (void)g.value(); }) ==
        "The result contained tensors residing on device(s) cuda:1 which are not among the "
        "expected device(s) cuda:0");
  CHECK(scope.fake.take().empty());  // nothing recorded for a refused value

  // Inside an IValue (a list of tensors), a c10::List and a c10::Dict too.
  auto h = make_future<c10::IValue>({gpu(0)});
  h.set_value(c10::IValue(std::vector<at::Tensor>{tensor_on(gpu(1))}));
  CHECK(distrpc::testing::contains(
      distrpc::testing::error_text<std::invalid_argument>([&] { (void)h.value(); }),
      "residing on device(s) cuda:1 which"));
  auto l = make_future<c10::List<at::Tensor>>({gpu(0)});
  l.set_value(c10::List<at::Tensor>({tensor_on(gpu(0)), tensor_on(gpu(1))}));
  CHECK(distrpc::testing::contains(
      distrpc::testing::error_text<std::invalid_argument>([&] { (void)l.value(); }),
      "residing on device(s) cuda:1 which"));
  auto d = make_future<c10::Dict<std::string, at::Tensor>>({gpu(1)});
  c10::Dict<std::string, at::Tensor> dict;
  dict.insert("w", tensor_on(gpu(0)));
  d.set_value(dict);
  CHECK(distrpc::testing::contains(
      distrpc::testing::error_text<std::invalid_argument>([&] { (void)d.value(); }),
      "residing on device(s) cuda:0 which are not among the expected device(s) cuda:1"));
  CHECK(scope.fake.take().empty());
}

TEST_CASE(
    "device future: completion records on the producer's streams, value() waits on the "
    "consumer's") {
  FakeCudaScope scope;
  SKIP_UNLESS_FAKE(scope);
  auto f = make_future<std::tuple<at::Tensor, at::Tensor>>({gpu(0), gpu(1)});
  // The producer works on stream 7 of cuda:0 (and the default stream of cuda:1).
  std::thread producer([&] {
    FakeCuda::current_streams = {7, 0};
    f.set_value(std::make_tuple(cpu_tensor(), tensor_on(gpu(0))));
  });
  producer.join();
  CHECK(scope.fake.take() == std::vector<Op>{{"record", 1, 0, 7}, {"record", 2, 1, 0}});

  // The consumer's current stream on cuda:0 is 3.
  FakeCuda::current_streams = {3, 0};
  (void)f.value();
  CHECK(scope.fake.take() ==
        std::vector<Op>{{"block", 1, 0, 3}, {"block", 2, 1, 0}, {"in_use", 0, 0, 3}});
  // Every wait synchronizes again (another stream may be current by then).
  FakeCuda::current_streams = {4, 5};
  f.wait();
  CHECK(scope.fake.take() ==
        std::vector<Op>{{"block", 1, 0, 4}, {"block", 2, 1, 5}, {"in_use", 0, 0, 4}});
}

TEST_CASE(
    "device future: callbacks run on pool streams that wait; then() children keep the devices") {
  FakeCudaScope scope;
  SKIP_UNLESS_FAKE(scope);
  auto f = make_future<at::Tensor>({gpu(0)});
  c10::StreamId seen_stream = -1;
  int seen_device = -1;
  FakeCuda::current_device = 0;
  auto child = f.then([&](Future<at::Tensor>& parent) {
    seen_stream = FakeCuda::current_streams[0];
    seen_device = FakeCuda::current_device;
    return parent.value();
  });
  CHECK(future_devices(child) == std::vector<c10::Device>{gpu(0)});
  scope.fake.take();

  // Completed on stream 9 of cuda:0 with cuda:0 current: the callback runs inline here, on a
  // pool stream (100) that waits for the completion's event, then the streams are restored.
  FakeCuda::current_streams = {9, 0};
  f.set_value(tensor_on(gpu(0)));
  CHECK(seen_stream == 100);
  CHECK(seen_device == 0);
  CHECK(FakeCuda::current_streams[0] == 9);
  const std::vector<Op> ops = scope.fake.take();
  // record on 9; the callback's stream waits for it and the tensor is in use there; value()
  // inside the callback waits again on the current (pool) stream; the child records on it.
  CHECK(ops == std::vector<Op>{{"record", 1, 0, 9},
                               {"block", 1, 0, 100},
                               {"in_use", 0, 0, 100},
                               {"block", 1, 0, 100},
                               {"in_use", 0, 0, 100},
                               {"record", 2, 0, 100}});
  REQUIRE(child.has_value());

  // via(): the child has the devices and its marks follow the parent's work.
  auto g = make_future<int>({gpu(1)});
  auto moved = g.via([](std::function<void()> fn) { fn(); });
  CHECK(future_devices(moved) == std::vector<c10::Device>{gpu(1)});
  g.set_value(1);
  const std::vector<Op> via_ops = scope.fake.take();
  REQUIRE(via_ops.size() == 3);
  CHECK(via_ops[0] == Op{"record", 3, 1, 0});    // g completes on the default stream
  CHECK(via_ops[1] == Op{"block", 3, 1, 101});   // the copy runs on a pool stream waiting for it
  CHECK(via_ops[2] == Op{"record", 4, 1, 101});  // where the child records
  CHECK(moved.value() == 1);
}

TEST_CASE("device future: only the completion that stores its value keeps its events") {
  FakeCudaScope scope;
  SKIP_UNLESS_FAKE(scope);
  auto f = make_future<at::Tensor>({gpu(0)});
  FakeCuda::current_streams = {7, 0};
  f.set_value(tensor_on(gpu(0)));
  FakeCuda::current_streams = {8, 0};
  CHECK_FALSE(f.try_set_value(tensor_on(gpu(0))));
  CHECK(distrpc::testing::contains(
      distrpc::testing::error_text<std::logic_error>([&] { f.set_value(tensor_on(gpu(0))); }),
      "Future can only be marked completed once"));
  scope.fake.take();
  FakeCuda::current_streams = {3, 0};
  (void)f.value();
  CHECK(scope.fake.take() == std::vector<Op>{{"block", 1, 0, 3}, {"in_use", 0, 0, 3}});
}

TEST_CASE(
    "device future: a callback runs with the completion's device current, then it is restored") {
  FakeCudaScope scope;
  SKIP_UNLESS_FAKE(scope);
  auto f = make_future<at::Tensor>({gpu(0), gpu(1)});
  std::thread producer([&] {
    FakeCuda::current_device = 1;
    f.set_value(tensor_on(gpu(1)));
  });
  producer.join();
  scope.fake.take();
  // Registered after completion: runs now, on this thread, whose device is 0.
  FakeCuda::current_device = 0;
  int seen_device = -1;
  std::array<c10::StreamId, 2> seen_streams{-1, -1};
  f.add_done_callback([&](Future<at::Tensor>&) {
    seen_device = FakeCuda::current_device;
    seen_streams = FakeCuda::current_streams;
  });
  CHECK(seen_device == 1);
  CHECK(seen_streams[0] >= 100);
  CHECK(seen_streams[1] >= 100);
  CHECK(FakeCuda::current_device == 0);
  CHECK(FakeCuda::current_streams == std::array<c10::StreamId, 2>{0, 0});

  // After an error: pool streams still, with nothing to wait for.
  CHECK(scope.fake.take().size() == 3);  // f's two events waited for, its tensor marked in use
  auto g = make_future<at::Tensor>({gpu(0)});
  g.set_exception(std::runtime_error("failed"));
  c10::StreamId failed_stream = -1;
  g.add_done_callback([&](Future<at::Tensor>&) { failed_stream = FakeCuda::current_streams[0]; });
  CHECK(failed_stream >= 100);
  for (const Op& op : scope.fake.take()) CHECK(op.what != "block");
}

TEST_CASE("device future: a then() callback returning a future with devices") {
  FakeCudaScope scope;
  SKIP_UNLESS_FAKE(scope);
  auto f = make_future<at::Tensor>({gpu(0)});
  auto inner = make_future<at::Tensor>({gpu(0)});
  auto child = f.then([&](Future<at::Tensor>&) { return inner; });
  f.set_value(tensor_on(gpu(0)));
  REQUIRE_FALSE(child.done());
  scope.fake.take();
  FakeCuda::current_streams = {5, 0};
  inner.set_value(tensor_on(gpu(0)));
  REQUIRE(child.has_value());
  // inner records on 5; the child's completion runs on a pool stream waiting for that event and
  // records its own there.
  const std::vector<Op> ops = scope.fake.take();
  REQUIRE(ops.size() == 4);
  CHECK(ops[0].what == "record");
  CHECK(ops[0].stream == 5);
  CHECK(ops[1].what == "block");
  CHECK(ops[1].event == ops[0].event);
  CHECK(ops[1].stream >= 100);
  CHECK(ops[2] == Op{"in_use", 0, 0, ops[1].stream});
  CHECK(ops[3].what == "record");
  CHECK(ops[3].stream == ops[1].stream);
}

TEST_CASE("device future: a void future marks every declared device; a plain future asks nothing") {
  FakeCudaScope scope;
  SKIP_UNLESS_FAKE(scope);
  auto done = make_future<void>({gpu(0), gpu(1)});
  done.set_value();
  CHECK(scope.fake.take() == std::vector<Op>{{"record", 1, 0, 0}, {"record", 2, 1, 0}});

  Future<at::Tensor> plain;
  auto after = plain.then([](Future<at::Tensor>& p) { return p.value(); });
  plain.set_value(tensor_on(gpu(0)));
  (void)after.value();
  CHECK(future_devices(after).empty());
  CHECK(scope.fake.take().empty());
}

TEST_CASE("device future: a refused value fails then() children with the same error") {
  FakeCudaScope scope;
  SKIP_UNLESS_FAKE(scope);
  auto f = make_future<at::Tensor>({gpu(0)});
  auto child = f.then([](Future<at::Tensor>& p) { return p.value(); });
  f.set_value(tensor_on(gpu(1)));
  CHECK(distrpc::testing::error_text<std::invalid_argument>([&] { (void)child.value(); }) ==
        "The result contained tensors residing on device(s) cuda:1 which are not among the "
        "expected device(s) cuda:0");
  // A then() callback returning a value on an undeclared device fails its child alike.
  auto g = make_future<at::Tensor>({gpu(0)});
  auto bad = g.then([](Future<at::Tensor>&) { return tensor_on(gpu(1)); });
  g.set_value(tensor_on(gpu(0)));
  CHECK(bad.has_error());
}

// ---- on a GPU (skipped without one) -----------------------------------------------------------

#define SKIP_UNLESS_GPU()                         \
  if (distrpc::compat::cuda_device_count() < 1) { \
    MESSAGE("skipped: no GPU on this machine");   \
    return;                                       \
  }

// The current stream of `d` on this thread, and a stream of its pool.
c10::Stream current_stream(c10::Device d) {
  return c10::impl::VirtualGuardImpl(d.type()).getStream(d);
}
c10::Stream pool_stream(c10::Device d) {
  return c10::impl::VirtualGuardImpl(d.type()).getStreamFromGlobalPool(d);
}

// Tens of milliseconds of work queued on the current stream of `d`, whose result is all 3s: ones
// multiplied by ones (4096 each), scaled back to ones, ten times over. Exact in float; a reader
// that does not wait for it sees memory the allocator just handed out.
at::Tensor slow_threes(c10::Device d) {
  constexpr std::int64_t n = 4096;
  const at::Tensor a = at::ones({n, n}, at::TensorOptions().device(d));
  at::Tensor y = a;
  for (int i = 0; i < 10; ++i) y = at::matmul(a, y).div_(static_cast<double>(n));
  return y.mul_(3);
}

TEST_CASE("device future on a GPU: a waiter on another stream and thread sees the whole result") {
  SKIP_UNLESS_GPU();
  auto f = make_future<at::Tensor>({gpu(0)});
  // The producer queues the work on a stream of its own, on its own thread, and completes the
  // future at once: the GPU is still working when the consumer asks.
  const c10::Stream producer_stream = pool_stream(gpu(0));
  std::thread producer([&] {
    c10::StreamGuard on(producer_stream);
    f.set_value(slow_threes(gpu(0)));
  });
  producer.join();
  const c10::Stream mine = current_stream(gpu(0));
  REQUIRE(mine != producer_stream);
  // value() makes this thread's stream wait for the producer's; the sum is queued behind it.
  const at::Tensor v = f.value();
  CHECK(v.device() == gpu(0));
  CHECK(at::equal(v, at::full_like(v, 3)));
  CHECK(current_stream(gpu(0)) == mine);  // nothing changed which stream is current
}

TEST_CASE("device future on a GPU: then() callbacks run on a pool stream behind the work") {
  SKIP_UNLESS_GPU();
  auto f = make_future<at::Tensor>({gpu(0)});
  const c10::Stream producer_stream = pool_stream(gpu(0));
  std::optional<c10::Stream> callback_stream;
  auto plus_one = f.then([&](Future<at::Tensor>& p) {
    callback_stream = current_stream(gpu(0));
    return p.value() + 1;  // queued on the callback's stream, behind the producer's work
  });
  auto second = plus_one.then([](Future<at::Tensor>& p) { return p.value() * 2; });
  {
    c10::StreamGuard on(producer_stream);
    f.set_value(slow_threes(gpu(0)));
  }
  REQUIRE(callback_stream.has_value());
  CHECK(*callback_stream != producer_stream);
  CHECK(*callback_stream != c10::impl::VirtualGuardImpl(c10::kCUDA).getDefaultStream(gpu(0)));
  CHECK(future_devices(plus_one) == std::vector<c10::Device>{gpu(0)});
  const at::Tensor four = plus_one.value();
  CHECK(at::equal(four, at::full_like(four, 4)));
  const at::Tensor eight = second.value();
  CHECK(at::equal(eight, at::full_like(eight, 8)));
}

TEST_CASE("device future on a GPU: a value on a device not declared fails the future") {
  SKIP_UNLESS_GPU();
  // Declared: nothing but cuda:0; a tensor on cuda:0 passes, a CPU tensor too (always allowed).
  auto f = make_future<std::vector<at::Tensor>>({gpu(0)});
  f.set_value(
      std::vector<at::Tensor>{at::ones({2}, at::TensorOptions().device(gpu(0))), at::ones({2})});
  CHECK(f.value().size() == 2);
  if (distrpc::compat::cuda_device_count() < 2) {
    MESSAGE("the cuda:1 half skipped: this machine has one GPU");
    return;
  }
  auto g = make_future<at::Tensor>({gpu(0)});
  g.set_value(at::ones({2}, at::TensorOptions().device(gpu(1))));
  CHECK(distrpc::testing::error_text<std::invalid_argument>([&] { (void)g.value(); }) ==
        "The result contained tensors residing on device(s) cuda:1 which are not among the "
        "expected device(s) cuda:0");
}

}  // namespace device_future_test
