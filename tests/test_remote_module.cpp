// The RemoteModule suite: ../shared/spec/remote_module.md (acceptance scenarios 1-5) and the
// upstream tests it cites (remote_module_test.py), plus what the C++ design adds: interfaces with
// several arguments and tuple results, many calls in flight, remote errors keeping their type, an
// owner killed with SIGKILL, the device logic exercised on the meta device (no GPU needed).
//
// Same conventions as test_rref.cpp: fresh processes named worker{rank} per case, a file://
// rendezvous, a graceful shutdown at the end with the RRef leak check on (a leaked module RRef
// fails the case); functions and modules used remotely live in namespace rm_test.
#include <signal.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <doctest/doctest.h>
#include <torch/cuda.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>

#include <distrpc/nn/module_options.hpp>
#include <distrpc/nn/remote_module.hpp>
#include <distrpc/nn/remote_module_holder.hpp>
#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>

#include "multiprocess.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"

using namespace distrpc::testing::rpc_names;
using distrpc::nn::InterfaceModule;
using distrpc::nn::RemoteDevice;
using distrpc::nn::RemoteModule;

// ---- interfaces and modules (built on the remote worker) ---------------------------------------

namespace rm_test {

using Result = std::tuple<std::string, int, at::Tensor>;

// PyTorch's MyModuleInterface. Polymorphic, so its default word applies to RemoteModule calls.
struct MyModuleInterface {
  virtual ~MyModuleInterface() = default;
  virtual Result forward(at::Tensor tensor, int number, std::string word = "default") = 0;
};

// PyTorch's MyModule: one parameter equal to ones(1); forward returns its arguments reversed.
struct MyModule : torch::nn::Module {
  explicit MyModule(int first_arg, int first_kwarg = -1)
      : first_arg(first_arg), kwarg(first_kwarg) {
    param1 = register_parameter("param1", torch::ones({1}));
  }
  Result forward(const at::Tensor& tensor, int number, const std::string& word) {
    return {word, number, tensor};
  }
  at::Tensor param1;
  int first_arg;
  int kwarg;
};

// A plain interface (no virtual): exactly forward(at::Tensor).
struct LinearInterface {
  at::Tensor forward(at::Tensor x);
};

// Own parameter plus a child module: remote_parameters(recurse) sees 3, or 1 without recursion.
struct ScaledLinear : torch::nn::Module {
  ScaledLinear(int in, int out) : linear(register_module("linear", torch::nn::Linear(in, out))) {
    scale = register_parameter("scale", torch::full({1}, 2.0));
  }
  at::Tensor forward(const at::Tensor& x) { return linear->forward(x) * scale; }
  torch::nn::Linear linear;
  at::Tensor scale;
};

// Several arguments, a tuple result with a container inside.
using Parts = std::tuple<at::Tensor, at::Tensor, double, std::vector<at::Tensor>>;
struct PartsInterface {
  Parts forward(const at::Tensor& a, at::Tensor b, double scale, std::vector<int64_t> shape) const;
};
struct PartsModule : torch::nn::Module {
  Parts forward(at::Tensor a, at::Tensor b, double scale, std::vector<int64_t> shape) {
    return {(a * scale).reshape(shape), a + b, scale * 2, {a, b}};
  }
};

struct ThrowingModule : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    if (x.numel() == 0) throw std::invalid_argument("ThrowingModule: empty input");
    return x + 1;
  }
};

struct FailingCtorModule : torch::nn::Module {
  explicit FailingCtorModule(int code) {
    throw std::out_of_range("FailingCtorModule: bad code " + std::to_string(code));
  }
  at::Tensor forward(const at::Tensor& x) { return x; }
};

// No parameters, so it can go to the meta device (libtorch 1.13 cannot move parameters there):
// says where its arguments arrived; returns its input itself when asked.
using Probe = std::tuple<std::string, std::string, at::Tensor>;
struct ProbeInterface {
  Probe forward(at::Tensor x, std::vector<at::Tensor> more, bool return_input);
};
struct ProbeModule : torch::nn::Module {
  Probe forward(at::Tensor x, std::vector<at::Tensor> more, bool return_input) {
    return {x.device().str(), more.at(0).device().str(), return_input ? x : torch::ones({2})};
  }
};

// ---- functions run remotely --------------------------------------------------------------------

// upstream remote_forward / remote_forward_async / remote_module_attributes.
Result remote_forward(RemoteModule<MyModuleInterface> rm, at::Tensor t, int n, std::string w) {
  return rm.forward(t, n, w);
}
Result remote_forward_async(RemoteModule<MyModuleInterface> rm, at::Tensor t, int n,
                            std::string w) {
  return rm.forward_async(t, n, w).value();
}
Result remote_forward_default_word(RemoteModule<MyModuleInterface> rm, at::Tensor t, int n) {
  return rm.forward(t, n);
}
std::tuple<std::string, std::string, bool, std::string> remote_module_attributes(
    RemoteModule<MyModuleInterface> rm) {
  return {std::get<std::string>(rm.on()), rm.device(), rm.is_device_map_set(), rm.owner().name};
}
RemoteModule<MyModuleInterface> from_module_rref(std::string remote_device,
                                                 RRef<InterfaceModule<MyModuleInterface>> r) {
  return RemoteModule<MyModuleInterface>::init_from_module_rref(remote_device, r);
}
bool is_training_on_owner(RRef<InterfaceModule<MyModuleInterface>> r) {
  return r.local_value().is_training();
}
std::string first_parameter_device(RRef<InterfaceModule<LinearInterface>> r) {
  return r.local_value().module().parameters().at(0).device().str();
}
// Modules made by other means than create<M>, for init_from_module_rref.
torch::nn::Linear make_linear(int in, int out) {
  return torch::nn::Linear(in, out);
}
RRef<MyModule> make_my_module_rref(int first_arg) {
  return RRef<MyModule>::make(first_arg);
}
int first_arg_on_owner(RRef<MyModule> r) {
  return r.local_value().first_arg;
}
// The owner's side of LinearInterface calls, called directly to check the short form.
using LinearCalls = distrpc::nn::detail::OwnerCalls<LinearInterface>;

}  // namespace rm_test

using namespace rm_test;

namespace {

void check_result(const Result& r, const std::string& word, int n, const at::Tensor& t) {
  CHECK(std::get<0>(r) == word);
  CHECK(std::get<1>(r) == n);
  CHECK(at::equal(std::get<2>(r), t));
}

}  // namespace

// ---- local: parsing, device transfer, misuse without RPC ---------------------------------------

TEST_CASE("remote module: remote_device forms and every error text of spec §1 (scenario 3)") {
  RemoteDevice a("worker1/cpu");
  CHECK(a.worker_name() == std::optional<std::string>("worker1"));
  CHECK_FALSE(a.rank().has_value());
  CHECK(a.device() == c10::Device(c10::kCPU));
  CHECK(a.str() == "worker1/cpu");
  RemoteDevice b("rank:1/cuda:0");
  CHECK(b.rank() == std::optional<int>(1));
  CHECK_FALSE(b.worker_name().has_value());
  CHECK(b.device() == c10::Device(c10::kCUDA, 0));
  CHECK(b.str() == "rank:1/cuda:0");
  RemoteDevice c("worker1");
  CHECK(c.worker_name() == std::optional<std::string>("worker1"));
  CHECK(c.device().is_cpu());
  CHECK(RemoteDevice("rank:3").rank() == std::optional<int>(3));
  RemoteDevice d("cuda:1");  // a device alone: no worker
  CHECK_FALSE(d.has_worker());
  CHECK(d.device() == c10::Device(c10::kCUDA, 1));

  const std::string format = ". The valid format is '<workername>/<device>'";
  const std::pair<const char*, std::string> errors[] = {
      {"worker1/foo", "device type at start of device string"},
      {"worker1/cpu2", "Invalid device string: 'cpu2'"},
      {"worker1/", "Device string must not be empty"},
      {"worker1/cuda:0/cuda:1", "Could not parse remote_device: worker1/cuda:0/cuda:1" + format},
      {"/", "Could not parse remote_device: /" + format},
      {"/cuda:0", "Could not parse remote_device: /cuda:0" + format},
      {"", "Could not parse remote_device: " + format},
      {"rank:x/cpu", "Could not parse remote_device: rank:x/cpu" + format},
      {"rank:/cpu", "Could not parse remote_device: rank:/cpu" + format},
      {"a:b/cpu", "Could not parse remote_device: a:b/cpu" + format},
      {"rank:1:2/cpu", "Could not parse remote_device: rank:1:2/cpu" + format},
      {"rank:99999999999/cpu", "rank out of range"},
  };
  for (const auto& [text, want] : errors) {
    expect_exact<std::invalid_argument>([&] { RemoteDevice{text}; }, want, text);
  }
  CHECK(contains(error_of([] { RemoteDevice("worker1/foo"); }), "Expected one of"));
  // Through create: parse errors are raised at construction, before RPC is even needed.
  expect_exact<std::invalid_argument>(
      [] { RemoteModule<MyModuleInterface>::create<MyModule>("worker1/cpu2", 1, 2); },
      "Invalid device string: 'cpu2'", "create with a bad device");
  expect_exact<std::invalid_argument>(
      [] { RemoteModule<MyModuleInterface>::create<MyModule>("/", 1, 2); },
      "Could not parse remote_device: /", "create with a bad format");
}

TEST_CASE("remote module: without RPC, and empty handles, fail with clear errors") {
  expect_exact<distrpc::RpcError>(
      [] { RemoteModule<MyModuleInterface>::create<MyModule>("worker1/cpu", 1, 2); },
      "RemoteModule only works in RPC", "create before init_rpc");
  RemoteModule<MyModuleInterface> empty;
  CHECK_FALSE(empty.valid());
  expect_exact<std::logic_error>([&] { empty.forward(at::ones({1}), 2, "3"); },
                                 "forward() on an empty RemoteModule handle", "forward");
  expect_exact<std::logic_error>([&] { empty.forward(at::ones({1}), 2); },
                                 "forward() on an empty RemoteModule handle", "forward, default");
  expect_exact<std::logic_error>([&] { empty.remote_parameters(); },
                                 "remote_parameters() on an empty", "remote_parameters");
  expect_exact<std::logic_error>([&] { empty.train(); }, "train() on an empty", "train");
  distrpc::wire::Message m;
  expect_exact<std::logic_error>([&] { distrpc::wire::encode(m, empty); },
                                 "serialization on an empty", "encode");
}

TEST_CASE(
    "remote module: DeviceTransfer moves every tensor of nested values; a tensor stays whole") {
  using distrpc::nn::to_device;
  const c10::Device meta(c10::kMeta);
  at::Tensor bare = at::ones({3, 2});
  to_device(bare, meta);
  CHECK(bare.device() == meta);
  CHECK(bare.sizes() == at::IntArrayRef({3, 2}));  // not split into its rows

  using Nested =
      std::tuple<at::Tensor, int, std::vector<at::Tensor>, std::optional<at::Tensor>,
                 std::map<std::string, at::Tensor>, std::pair<at::Tensor, std::string>, at::Tensor>;
  Nested v{at::ones({1}),
           7,
           {at::ones({2}), at::ones({3})},
           at::ones({4}),
           {{"k", at::ones({5})}},
           {at::ones({6}), "s"},
           at::Tensor()};
  to_device(v, meta);
  CHECK(std::get<0>(v).device() == meta);
  CHECK(std::get<1>(v) == 7);
  for (const auto& t : std::get<2>(v)) CHECK(t.device() == meta);
  CHECK(std::get<3>(v)->device() == meta);
  CHECK(std::get<4>(v).at("k").device() == meta);
  CHECK(std::get<5>(v).first.device() == meta);
  CHECK_FALSE(std::get<6>(v).defined());  // an undefined tensor stays undefined

  // IValues are rebuilt: the caller's list is not changed under it.
  c10::List<at::Tensor> list({at::ones({1})});
  c10::IValue iv(c10::ivalue::Tuple::create(
      {c10::IValue(at::ones({2})), c10::IValue(list), c10::IValue(std::string("x"))}));
  to_device(iv, meta);
  const auto& elems = iv.toTupleRef().elements();
  CHECK(elems[0].toTensor().device() == meta);
  CHECK(elems[1].toList().get(0).toTensor().device() == meta);
  CHECK(elems[2].toStringRef() == "x");
  CHECK(list.get(0).device().is_cpu());
}

// ---- scenarios 1 and 4: the API on one remote module; errors keep their type -------------------

DISTRPC_MP_TEST(
    "remote module: forward, forward_async, defaults, parameters, train/eval; "
    "construction and forward errors keep their type (scenarios 1, 4)",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    const at::Tensor one = at::ones({1});
    for (const char* where : {"worker1/cpu", "rank:1/cpu", "worker1"}) {
      INFO("remote_device " << where);
      auto rm = RemoteModule<MyModuleInterface>::create<MyModule>(where, 1, 2);
      check_result(rm.forward(one, 2, "3"), "3", 2, one);
      check_result(rm.forward_async(one, 2, "3").value(), "3", 2, one);
      // The interface's default word, directly and through the interface itself.
      check_result(rm.forward(one, 2), "default", 2, one);
      check_result(rm.forward_async(one, 4).value(), "default", 4, one);
      MyModuleInterface& as_interface = rm;
      check_result(as_interface.forward(one, 5), "default", 5, one);
      check_result(as_interface.forward(one, 6, "w"), "w", 6, one);

      auto params = rm.remote_parameters();
      REQUIRE(params.size() == 1);
      CHECK(params[0].owner_name() == "worker1");
      CHECK(at::equal(params[0].to_here(), one));

      rm.train();
      CHECK(distrpc::rpc_sync<&is_training_on_owner>("worker1", rm.get_module_rref()));
      rm.eval();
      CHECK_FALSE(distrpc::rpc_sync<&is_training_on_owner>("worker1", rm.get_module_rref()));
      rm.train(true);
      CHECK(distrpc::rpc_sync<&is_training_on_owner>("worker1", rm.get_module_rref()));

      CHECK(rm.device() == "cpu");
      CHECK_FALSE(rm.is_device_map_set());
      CHECK(rm.owner().name == "worker1");
      CHECK(rm.get_module_rref().owner_name() == "worker1");
      if (std::string(where).rfind("rank:", 0) == 0) {
        CHECK(rm.on() == std::variant<std::string, int>(1));
      } else {
        CHECK(rm.on() == std::variant<std::string, int>(std::string("worker1")));
      }
      // Outside RPC a RemoteModule does not serialize.
      distrpc::wire::Message m;
      expect_exact<distrpc::RpcError>([&] { distrpc::wire::encode(m, rm); },
                                      "can only be serialized inside an RPC call", "encode");
    }
    // On this very worker: the module RRef is an owner RRef, calls still go through RPC.
    {
      auto self_rm = RemoteModule<MyModuleInterface>::create<MyModule>("worker0/cpu", 1, 2);
      check_result(self_rm.forward(one, 2, "3"), "3", 2, one);
      check_result(self_rm.forward(one, 2, "4"), "4", 2, one);  // by RRef id now
      CHECK(self_rm.get_module_rref().is_owner());
      CHECK(self_rm.get_module_rref().local_value().module_as<MyModule>()->kwarg == 2);
    }
    // A ModuleHolder through a plain interface; recursion of remote_parameters.
    const at::Tensor x = at::randn({5, 4});
    {
      auto lin = RemoteModule<LinearInterface>::create<torch::nn::Linear>("worker1/cpu", 4, 3);
      auto p = lin.remote_parameters();
      REQUIRE(p.size() == 2);
      CHECK(at::allclose(lin.forward(x), at::linear(x, p[0].to_here(), p[1].to_here())));
      auto scaled = RemoteModule<LinearInterface>::create<ScaledLinear>("worker1/cpu", 4, 3);
      CHECK(scaled.remote_parameters().size() == 3);
      CHECK(scaled.remote_parameters(/*recurse=*/false).size() == 1);
      CHECK(scaled.forward(x).sizes() == at::IntArrayRef({5, 3}));
    }
    // The short form (a call naming the module by RRef id) reaches only live modules.
    {
      distrpc::RRefId id;
      {
        auto lin = RemoteModule<LinearInterface>::create<torch::nn::Linear>("worker1/cpu", 4, 3);
        lin.forward(x);
        CHECK(lin.forward(x).sizes() == at::IntArrayRef({5, 3}));
        id = lin.get_module_rref().rref_id();
        const distrpc::nn::detail::DeviceArg cpu{};
        CHECK(
            distrpc::rpc_sync<&LinearCalls::forward_by_id>("worker1", id, cpu, false, x).sizes() ==
            at::IntArrayRef({5, 3}));
      }
      // Its RRef released (the delete is asynchronous), the owner's entry dies with the module.
      const std::string gone = "no module for interface 'rm_test::LinearInterface' is held";
      std::string err;
      const auto t0 = Clock::now();
      while (!contains(err, gone) && ms_since(t0) < 10000) {
        err = error_of([&] {
          distrpc::rpc_sync<&LinearCalls::forward_by_id>(
              "worker1", id, distrpc::nn::detail::DeviceArg{}, false, x);
        });
        if (!contains(err, gone)) std::this_thread::sleep_for(5ms);
      }
      CHECK_MESSAGE(contains(err, gone), err);
    }

    // A constructor that throws: create() returns; the first use raises the error, typed.
    auto bad = RemoteModule<LinearInterface>::create<FailingCtorModule>("worker1/cpu", 7);
    expect_exact<std::out_of_range>([&] { bad.forward(at::ones({1})); },
                                    "FailingCtorModule: bad code 7", "forward");
    expect_exact<std::out_of_range>([&] { bad.forward_async(at::ones({1})).value(); },
                                    "FailingCtorModule: bad code 7", "forward_async");
    expect_exact<std::out_of_range>([&] { bad.remote_parameters(); },
                                    "FailingCtorModule: bad code 7", "remote_parameters");

    // A device that does not exist on the owner (PyTorch: "worker1/cuda:100"): raised on use.
    auto nowhere =
        RemoteModule<LinearInterface>::create<torch::nn::Linear>("worker1/cuda:100", 2, 2);
    CHECK_THROWS_AS(nowhere.forward(at::ones({1, 2})), c10::Error);

    // A forward that throws: the caller gets std::invalid_argument; the module stays usable.
    auto thrower = RemoteModule<LinearInterface>::create<ThrowingModule>("worker1/cpu");
    expect_exact<std::invalid_argument>([&] { thrower.forward(at::empty({0})); },
                                        "ThrowingModule: empty input", "forward throws");
    expect_exact<std::invalid_argument>([&] { thrower.forward_async(at::empty({0})).value(); },
                                        "ThrowingModule: empty input", "forward_async throws");
    CHECK(at::equal(thrower.forward(at::ones({2})), at::full({2}, 2.0)));

    // Raised by create() at once: unknown workers, a device without a worker.
    using LinearRM = RemoteModule<LinearInterface>;
    CHECK_THROWS_WITH(LinearRM::create<torch::nn::Linear>("nobody/cpu", 2, 2),
                      doctest::Contains("could not find destination"));
    CHECK_THROWS_WITH(LinearRM::create<torch::nn::Linear>("rank:9/cpu", 2, 2),
                      doctest::Contains("could not find destination"));
    expect_exact<std::invalid_argument>([] { LinearRM::create<torch::nn::Linear>("cuda:0", 2, 2); },
                                        "names no worker", "a device alone");
    expect_exact<std::invalid_argument>(
        [] { LinearRM::init_from_module_rref("worker1", LinearRM::module_rref_type()); },
        "empty module RRef", "init_from_module_rref of an empty RRef");
  }
  distrpc::shutdown();
}

// ---- scenario 2: sent to a third worker; init_from_module_rref ----------------------------------

DISTRPC_MP_TEST(
    "remote module: sent over RPC to a third worker; init_from_module_rref "
    "(scenario 2)",
    3, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    const at::Tensor one = at::ones({1});
    auto rm = RemoteModule<MyModuleInterface>::create<MyModule>("worker1/cpu", 1, 2);
    const auto [on, device, map_set, owner] =
        distrpc::rpc_sync<&remote_module_attributes>("worker2", rm);
    CHECK(on == "worker1");
    CHECK(device == "cpu");
    CHECK_FALSE(map_set);
    CHECK(owner == "worker1");
    check_result(distrpc::rpc_sync<&remote_forward>("worker2", rm, one, 2, "3"), "3", 2, one);
    check_result(distrpc::rpc_sync<&remote_forward_async>("worker2", rm, one, 2, "3"), "3", 2, one);
    check_result(distrpc::rpc_sync<&remote_forward_default_word>("worker2", rm, one, 8), "default",
                 8, one);
    // Received by the owner itself: its forward calls itself.
    check_result(distrpc::rpc_sync<&remote_forward>("worker1", rm, one, 2, "3"), "3", 2, one);

    // init_from_module_rref on worker2, naming worker2 as `on`: calls still go to the owner.
    auto rm2 = distrpc::rpc_sync<&from_module_rref>("worker2", "worker2", rm.get_module_rref());
    CHECK(rm2.on() == std::variant<std::string, int>(std::string("worker2")));
    CHECK(rm2.owner().name == "worker1");
    const Result ret1 = distrpc::rpc_sync<&remote_forward>("worker1", rm, one, 2, "3");
    const Result ret2 = distrpc::rpc_sync<&remote_forward>("worker2", rm2, one, 2, "3");
    check_result(ret2, std::get<0>(ret1), std::get<1>(ret1), std::get<2>(ret1));
    check_result(rm2.forward(one, 2, "3"), "3", 2, one);  // the copy that came back here

    // Around an RRef<M> made without create: a ModuleHolder and a module held by value.
    auto linear_rref = distrpc::remote<&make_linear>("worker2", 3, 2);
    auto lin = RemoteModule<LinearInterface>::init_from_module_rref("worker2/cpu", linear_rref);
    CHECK(lin.owner().name == "worker2");
    CHECK(lin.forward(at::ones({4, 3})).sizes() == at::IntArrayRef({4, 2}));
    auto raw = distrpc::rpc_sync<&make_my_module_rref>("worker2", 9);
    auto wrapped = RemoteModule<MyModuleInterface>::init_from_module_rref("worker2", raw);
    check_result(wrapped.forward(one, 2, "3"), "3", 2, one);
    CHECK(distrpc::rpc_sync<&first_arg_on_owner>("worker2", raw) == 9);
  }
  distrpc::shutdown();
}

// ---- several arguments, tuple results, many calls in flight; a non-CPU device (meta) ----------
// The device part: worker0 has a device map towards worker1, worker1 none towards worker0; each
// puts a probe module on the other's meta device. Arguments must arrive on meta; a result holding
// a meta tensor is moved to the CPU without a device map (which meta refuses: "Cannot copy out of
// meta tensor") and returned as it is with one (which the owner refuses to send: its response
// route, the inverse of worker0's map, has no entry for meta).

DISTRPC_MP_TEST(
    "remote module: several arguments, tuple results, 100 forward_async in flight, "
    "handles dropped mid-call; non-CPU device (meta) with and without a device map",
    2, 60) {
  RpcBackendOptions o;
  if (ctx.rank == 0) o.set_device_map("worker1", {{"cpu", "cpu"}});
  init(ctx, o);
  const int peer = 1 - ctx.rank;
  auto rm = RemoteModule<PartsInterface>::create<PartsModule>(wname(peer) + "/cpu");
  const at::Tensor a = at::arange(6, at::kFloat);
  const at::Tensor b = at::ones({6});
  const auto [scaled, sum, doubled, both] = rm.forward(a, b, 3.0, {2, 3});
  CHECK(at::equal(scaled, (a * 3).reshape({2, 3})));
  CHECK(at::equal(sum, a + b));
  CHECK(doubled == 6.0);
  REQUIRE(both.size() == 2);
  CHECK(at::equal(both[1], b));

  std::vector<Future<Parts>> inflight;
  for (int i = 0; i < 100; ++i) {
    inflight.push_back(rm.forward_async(a * i, b, 1.0 * i, {3, 2}));
  }
  const auto results = distrpc::wait_all(inflight);
  int good = 0;
  for (int i = 0; i < 100; ++i) {
    const auto& [s, t, d, v] = results[static_cast<std::size_t>(i)];
    good += at::equal(s, (a * i * i).reshape({3, 2})) && at::equal(t, a * i + b) && d == 2.0 * i &&
            v.size() == 2;
  }
  CHECK(good == 100);

  // The last handle dropped while its call is in flight: the call still completes (the fork
  // and with it the module live until the reply).
  std::vector<Future<at::Tensor>> orphans;
  for (int i = 0; i < 10; ++i) {
    auto lin = RemoteModule<LinearInterface>::create<torch::nn::Linear>(wname(peer), 8, 8);
    CHECK(lin.forward(at::ones({3, 8})).sizes() == at::IntArrayRef({3, 8}));  // a bare tensor
    orphans.push_back(lin.forward_async(at::ones({3, 8})));
  }
  for (auto& f : orphans) CHECK(f.value().sizes() == at::IntArrayRef({3, 8}));

  auto probe = RemoteModule<ProbeInterface>::create<ProbeModule>(wname(peer) + "/meta");
  CHECK(probe.device() == "meta");
  CHECK(probe.is_device_map_set() == (ctx.rank == 0));
  const auto [x_device, nested_device, out] = probe.forward(at::ones({2}), {at::ones({1})}, false);
  CHECK(x_device == "meta");
  CHECK(nested_device == "meta");
  CHECK(out.device().is_cpu());
  CHECK(at::equal(out, at::ones({2})));
  const std::string err = error_of([&] { probe.forward(at::ones({2}), {at::ones({1})}, true); });
  if (ctx.rank == 0) {
    CHECK_MESSAGE(contains(err, "Response device mapping is not available for destination worker0"),
                  err);
  } else {
    CHECK_MESSAGE(contains(err, "Cannot copy out of meta tensor"), err);
  }
  distrpc::shutdown();
}

// ---- scenario 5: CUDA placement (needs a GPU) --------------------------------------------------

namespace rm_test {
using CudaResult = std::tuple<at::Tensor, int, at::Tensor>;
struct CudaInterface {
  CudaResult forward(at::Tensor tensor, int number, at::Tensor word);
};
struct CudaModule : torch::nn::Module {
  CudaModule() { param = register_parameter("param", torch::ones({1})); }
  CudaResult forward(at::Tensor tensor, int number, at::Tensor word) {
    if (!tensor.is_cuda() || !word.is_cuda()) {
      throw std::invalid_argument("CudaModule: arguments did not arrive on the GPU");
    }
    return {word, number, tensor};
  }
  at::Tensor param;
};
std::string cuda_param_device(RRef<InterfaceModule<CudaInterface>> r) {
  return r.local_value().module().parameters().at(0).device().str();
}
}  // namespace rm_test

DISTRPC_MP_TARGET("remote module target: CUDA placement") {
  init(ctx);
  if (ctx.rank == 0) {
    const at::Tensor t1 = at::ones({1});
    const at::Tensor t2 = t1 * 2;
    for (const char* where : {"worker1/cuda:0", "rank:1/cuda:0"}) {
      INFO("remote_device " << where);
      auto rm = RemoteModule<CudaInterface>::create<CudaModule>(where);
      CHECK(distrpc::rpc_sync<&cuda_param_device>("worker1", rm.get_module_rref()) == "cuda:0");
      for (const auto& [w, n, t] : {rm.forward(t1, 2, t2), rm.forward_async(t1, 2, t2).value()}) {
        CHECK(at::equal(w, t2));
        CHECK(n == 2);
        CHECK(at::equal(t, t1));
        CHECK(w.device().is_cpu());
        CHECK(t.device().is_cpu());
      }
    }
    auto bad = RemoteModule<CudaInterface>::create<CudaModule>("worker1/cuda:100");
    CHECK_THROWS_WITH(bad.forward(t1, 2, t2), doctest::Contains("invalid device ordinal"));
  }
  distrpc::shutdown();

  // With a device map set the results come back as they are: on the GPU, through the inverse map.
  RpcBackendOptions mapped;
  if (ctx.rank == 0) mapped.set_device_map("worker1", {{0, 0}});
  mapped.init_method = file_url(ctx, "mapped");
  distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, mapped);
  if (ctx.rank == 0) {
    auto rm = RemoteModule<CudaInterface>::create<CudaModule>("worker1/cuda:0");
    CHECK(rm.is_device_map_set());
    const at::Tensor t1 = at::ones({1});
    const auto [w, n, t] = rm.forward(t1, 2, t1 * 2);
    CHECK(n == 2);
    CHECK(w.device() == c10::Device(c10::kCUDA, 0));
    CHECK(t.device() == c10::Device(c10::kCUDA, 0));
    CHECK(at::equal(w.cpu(), t1 * 2));
    CHECK(at::equal(t.cpu(), t1));
  }
  distrpc::shutdown();
}

TEST_CASE("remote module: CUDA placement without and with a device map (scenario 5, needs a GPU)") {
  if (!torch::cuda::is_available()) {
    MESSAGE(
        "skipped: no CUDA device on this machine (torch::cuda::is_available() is false); "
        "the CUDA path is exercised on the meta device by the non-CPU device case");
    return;
  }
  RunOptions o;
  o.world = 2;
  o.limit = 60s;
  auto r = run_ranks("remote module target: CUDA placement", o);
  CHECK_MESSAGE(r.ok, r.report());
}

// ---- the owner killed ------------------------------------------------------------------------

DISTRPC_MP_TARGET("remote module target: the owner is killed") {
  init(ctx);
  if (ctx.rank == 1) {
    (void)ctx.lookup("created");
    ctx.publish("killed", "now");
    ::kill(::getpid(), SIGKILL);
    std::this_thread::sleep_for(60s);
  }
  auto rm = RemoteModule<LinearInterface>::create<torch::nn::Linear>("worker1/cpu", 4, 4);
  CHECK(rm.forward(at::ones({2, 4})).sizes() == at::IntArrayRef({2, 4}));
  ctx.publish("created", "yes");
  (void)ctx.lookup("killed");
  const auto t0 = Clock::now();
  const std::string sync_error = error_of([&] { rm.forward(at::ones({2, 4})); });
  const std::string async_error = error_of([&] { rm.forward_async(at::ones({2, 4})).value(); });
  CHECK_MESSAGE(contains(sync_error, "worker1"), sync_error);
  CHECK_MESSAGE(contains(async_error, "worker1"), async_error);
  CHECK(ms_since(t0) < 2000);
  distrpc::shutdown(/*graceful=*/false);
}

TEST_CASE("remote module: the owner killed with SIGKILL: forward fails within 2 s naming it") {
  RunOptions o;
  o.world = 2;
  o.limit = 30s;
  o.may_die = {1};
  auto r = run_ranks("remote module target: the owner is killed", o);
  CHECK_MESSAGE(r.ok, r.report());
  REQUIRE(r.ranks.size() == 2);
  CHECK_MESSAGE(r.ranks[1].signal == SIGKILL, r.report());
  CHECK_MESSAGE(r.ranks[0].exit_code == 0, r.report());
}

// ---- per-call options: forward(opts, ...), forward_async(opts, ...), and the other calls ------

namespace rm_test {

// Sleeps as many milliseconds as its input says, then returns the input: a forward slower than a
// per-call timeout, or well within one. train() (virtual in torch::nn::Module, and what
// RemoteModule::train runs on the owner) takes train_delay_ms.
struct SleepyModule : torch::nn::Module {
  explicit SleepyModule(int64_t train_delay_ms = 0) : train_delay_ms(train_delay_ms) {
    weight = register_parameter("weight", torch::ones({1}));
  }
  at::Tensor forward(const at::Tensor& ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms.item<int64_t>()));
    return ms.clone();
  }
  void train(bool on) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(train_delay_ms));
    torch::nn::Module::train(on);
  }
  at::Tensor weight;
  int64_t train_delay_ms;
};

bool linear_is_training_on_owner(RRef<InterfaceModule<LinearInterface>> r) {
  return r.local_value().is_training();
}

}  // namespace rm_test

namespace {

at::Tensor ms_tensor(int64_t ms) {
  return at::full({1}, ms, at::kLong);
}

}  // namespace

DISTRPC_MP_TEST(
    "remote module: per-call options on forward, forward_async, remote_parameters, train/eval; "
    "the timeout is honoured with the text of the other call forms",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    const std::string text100 =
        "RPC ran for more than set timeout (100 ms) and will now be marked with an error";
    auto rm = RemoteModule<LinearInterface>::create<SleepyModule>("worker1/cpu", 0);

    // The first calls carry the module RRef, later ones its id: the timeout applies to both.
    auto t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { rm.forward(distrpc::with_timeout(100ms), ms_tensor(1000)); }, text100,
        "forward, by RRef");
    CHECK(ms_since(t0) < 900);
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { rm.forward_async(distrpc::with_timeout(100ms), ms_tensor(1000)).value(); }, text100,
        "forward_async, by RRef");
    CHECK(ms_since(t0) < 900);
    // Within its timeout a call works (it waits for a free thread on worker1 first).
    CHECK(at::equal(rm.forward(distrpc::with_timeout(20s), ms_tensor(10)), ms_tensor(10)));
    CHECK(at::equal(rm.forward_async(distrpc::with_timeout(20s), ms_tensor(20)).value(),
                    ms_tensor(20)));
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { rm.forward(distrpc::with_timeout(100ms), ms_tensor(1000)); }, text100,
        "forward, by id");
    CHECK(ms_since(t0) < 900);
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { rm.forward_async(distrpc::with_timeout(100ms), ms_tensor(1000)).value(); }, text100,
        "forward_async, by id");
    CHECK(ms_since(t0) < 900);
    // Without options the agent's default (60 s) applies: the same slow call completes.
    CHECK(at::equal(rm.forward(ms_tensor(300)), ms_tensor(300)));

    CHECK(rm.remote_parameters(distrpc::with_timeout(20s)).size() == 1);
    CHECK(rm.remote_parameters(distrpc::with_timeout(20s), /*recurse=*/false).size() == 1);
    rm.eval(distrpc::with_timeout(20s));
    CHECK_FALSE(distrpc::rpc_sync<&linear_is_training_on_owner>("worker1", rm.get_module_rref()));
    rm.train(distrpc::with_timeout(20s));
    CHECK(distrpc::rpc_sync<&linear_is_training_on_owner>("worker1", rm.get_module_rref()));
    rm.train(distrpc::with_timeout(20s), false);
    CHECK_FALSE(distrpc::rpc_sync<&linear_is_training_on_owner>("worker1", rm.get_module_rref()));
    rm.train(true);

    // A remote train() slower than its timeout: raised here at the timeout.
    auto slow_train = RemoteModule<LinearInterface>::create<SleepyModule>("worker1/cpu", 1000);
    CHECK(at::equal(slow_train.forward(ms_tensor(0)), ms_tensor(0)));  // built
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { slow_train.train(distrpc::with_timeout(100ms), false); }, text100, "train");
    CHECK(ms_since(t0) < 900);
    // A timed-out call may still run on the owner (as for rpc_sync): the flag goes to false.
    auto remote_training = [&] {
      return distrpc::rpc_sync<&linear_is_training_on_owner>("worker1",
                                                             slow_train.get_module_rref());
    };
    bool training = true;
    t0 = Clock::now();
    while (training && ms_since(t0) < 10000) {
      training = remote_training();
      if (training) std::this_thread::sleep_for(10ms);
    }
    CHECK_FALSE(training);
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>([&] { slow_train.train(distrpc::with_timeout(100ms)); },
                                           text100, "train(opts)");
    CHECK(ms_since(t0) < 900);
    slow_train.train(distrpc::with_timeout(20s), true);  // within its timeout
    CHECK(remote_training());

    // In a module tree, a train() whose RPC fails leaves the local flag as it was.
    auto in_tree = std::make_shared<distrpc::nn::RemoteModuleImpl<LinearInterface>>(slow_train);
    CHECK(in_tree->is_training());
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { in_tree->train(distrpc::with_timeout(100ms), false); }, text100, "tree train");
    CHECK(in_tree->is_training());
    in_tree->eval(distrpc::with_timeout(20s));
    CHECK_FALSE(in_tree->is_training());
    CHECK_FALSE(remote_training());

    // Options first with the interface's default arguments.
    const at::Tensor one = at::ones({1});
    auto my = RemoteModule<MyModuleInterface>::create<MyModule>("worker1/cpu", 1, 2);
    check_result(my.forward(distrpc::with_timeout(20s), one, 2), "default", 2, one);
    check_result(my.forward(distrpc::with_timeout(20s), one, 3, "w"), "w", 3, one);
    check_result(my.forward_async(distrpc::with_timeout(20s), one, 4).value(), "default", 4, one);
    check_result(my.forward_async(distrpc::with_timeout(20s), one, 5, "v").value(), "v", 5, one);
    const distrpc::CallOptions opts = distrpc::with_timeout(20s);  // an lvalue works the same
    check_result(my.forward(opts, one, 6), "default", 6, one);
  }
  distrpc::shutdown();
}

// ---- options structs as constructor arguments -------------------------------------------------

namespace {

template <class O>
O round_trip(const O& options) {
  distrpc::wire::Message m;
  distrpc::wire::encode(m, distrpc::nn::WireOptions<O>(options));
  distrpc::nn::WireOptions<O> back;
  CHECK_FALSE(back.has_value());
  distrpc::wire::decode(m, back);
  REQUIRE(back.has_value());
  return back.get();
}

template <std::size_t D>
std::array<int64_t, D> values(const torch::ExpandingArray<D>& a) {
  return *a;
}

}  // namespace

TEST_CASE(
    "remote module: every supported options struct round-trips through the wire, field by field") {
  using A1 = std::array<int64_t, 1>;
  using A2 = std::array<int64_t, 2>;
  using A3 = std::array<int64_t, 3>;

  const auto lin = round_trip(torch::nn::LinearOptions(3, 7).bias(false));
  CHECK(lin.in_features() == 3);
  CHECK(lin.out_features() == 7);
  CHECK_FALSE(lin.bias());
  CHECK(round_trip(torch::nn::LinearOptions(1, 2)).bias());

  const auto c1 = round_trip(torch::nn::Conv1dOptions(2, 4, 5)
                                 .stride(2)
                                 .padding(3)
                                 .dilation(2)
                                 .groups(2)
                                 .bias(false)
                                 .padding_mode(torch::kReflect));
  CHECK(c1.in_channels() == 2);
  CHECK(c1.out_channels() == 4);
  CHECK(values(c1.kernel_size()) == A1{5});
  CHECK(values(c1.stride()) == A1{2});
  REQUIRE(get_if<torch::ExpandingArray<1>>(&c1.padding()) != nullptr);
  CHECK(values(*get_if<torch::ExpandingArray<1>>(&c1.padding())) == A1{3});
  CHECK(values(c1.dilation()) == A1{2});
  CHECK(c1.groups() == 2);
  CHECK_FALSE(c1.bias());
  CHECK(holds_alternative<torch::enumtype::kReflect>(c1.padding_mode()));

  const auto c2 = round_trip(torch::nn::Conv2dOptions(3, 6, {3, 5})
                                 .padding(torch::kSame)
                                 .dilation({2, 1})
                                 .padding_mode(torch::kCircular));
  CHECK(values(c2.kernel_size()) == A2{3, 5});
  CHECK(values(c2.stride()) == A2{1, 1});
  CHECK(holds_alternative<torch::enumtype::kSame>(c2.padding()));
  CHECK(values(c2.dilation()) == A2{2, 1});
  CHECK(c2.bias());
  CHECK(holds_alternative<torch::enumtype::kCircular>(c2.padding_mode()));
  CHECK(holds_alternative<torch::enumtype::kValid>(
      round_trip(torch::nn::Conv2dOptions(1, 1, 1).padding(torch::kValid)).padding()));
  CHECK(holds_alternative<torch::enumtype::kZeros>(
      round_trip(torch::nn::Conv2dOptions(1, 1, 1)).padding_mode()));

  const auto c3 = round_trip(torch::nn::Conv3dOptions(1, 2, {1, 2, 3})
                                 .stride({3, 2, 1})
                                 .padding({1, 0, 2})
                                 .groups(1)
                                 .bias(false)
                                 .padding_mode(torch::kReplicate));
  CHECK(c3.in_channels() == 1);
  CHECK(c3.out_channels() == 2);
  CHECK(values(c3.kernel_size()) == A3{1, 2, 3});
  CHECK(values(c3.stride()) == A3{3, 2, 1});
  REQUIRE(get_if<torch::ExpandingArray<3>>(&c3.padding()) != nullptr);
  CHECK(values(*get_if<torch::ExpandingArray<3>>(&c3.padding())) == A3{1, 0, 2});
  CHECK_FALSE(c3.bias());
  CHECK(holds_alternative<torch::enumtype::kReplicate>(c3.padding_mode()));

  const at::Tensor weight = at::randn({10, 4});
  const auto emb = round_trip(torch::nn::EmbeddingOptions(10, 4)
                                  .padding_idx(2)
                                  .max_norm(1.5)
                                  .norm_type(3.0)
                                  .scale_grad_by_freq(true)
                                  .sparse(true)
                                  ._weight(weight));
  CHECK(emb.num_embeddings() == 10);
  CHECK(emb.embedding_dim() == 4);
  REQUIRE(emb.padding_idx().has_value());
  CHECK(*emb.padding_idx() == 2);
  REQUIRE(emb.max_norm().has_value());
  CHECK(*emb.max_norm() == 1.5);
  CHECK(emb.norm_type() == 3.0);
  CHECK(emb.scale_grad_by_freq());
  CHECK(emb.sparse());
  CHECK(at::equal(emb._weight(), weight));
  const auto emb_default = round_trip(torch::nn::EmbeddingOptions(3, 2));
  CHECK_FALSE(emb_default.padding_idx().has_value());
  CHECK_FALSE(emb_default.max_norm().has_value());
  CHECK_FALSE(emb_default._weight().defined());

  const auto ln =
      round_trip(torch::nn::LayerNormOptions({2, 3}).eps(1e-3).elementwise_affine(false));
  CHECK(ln.normalized_shape() == std::vector<int64_t>{2, 3});
  CHECK(ln.eps() == 1e-3);
  CHECK_FALSE(ln.elementwise_affine());

  const auto bn = round_trip(
      torch::nn::BatchNorm1dOptions(5).eps(1e-3).momentum(0.25).affine(false).track_running_stats(
          false));
  CHECK(bn.num_features() == 5);
  CHECK(bn.eps() == 1e-3);
  REQUIRE(bn.momentum().has_value());
  CHECK(*bn.momentum() == 0.25);
  CHECK_FALSE(bn.affine());
  CHECK_FALSE(bn.track_running_stats());
  torch::nn::BatchNorm3dOptions no_momentum(2);
  no_momentum.momentum(std::decay_t<decltype(no_momentum.momentum())>());
  CHECK_FALSE(round_trip(no_momentum).momentum().has_value());

  const auto drop = round_trip(torch::nn::DropoutOptions(0.25).inplace(true));
  CHECK(drop.p() == 0.25);
  CHECK(drop.inplace());

  const auto lstm = round_trip(torch::nn::LSTMOptions(4, 6)
                                   .num_layers(3)
                                   .bias(false)
                                   .batch_first(true)
                                   .dropout(0.5)
                                   .bidirectional(true)
                                   .proj_size(2));
  CHECK(lstm.input_size() == 4);
  CHECK(lstm.hidden_size() == 6);
  CHECK(lstm.num_layers() == 3);
  CHECK_FALSE(lstm.bias());
  CHECK(lstm.batch_first());
  CHECK(lstm.dropout() == 0.5);
  CHECK(lstm.bidirectional());
  CHECK(lstm.proj_size() == 2);

  const auto gru = round_trip(torch::nn::GRUOptions(5, 7)
                                  .num_layers(2)
                                  .bias(false)
                                  .batch_first(true)
                                  .dropout(0.25)
                                  .bidirectional(true));
  CHECK(gru.input_size() == 5);
  CHECK(gru.hidden_size() == 7);
  CHECK(gru.num_layers() == 2);
  CHECK_FALSE(gru.bias());
  CHECK(gru.batch_first());
  CHECK(gru.dropout() == 0.25);
  CHECK(gru.bidirectional());

  const auto rnn = round_trip(torch::nn::RNNOptions(3, 8)
                                  .num_layers(4)
                                  .nonlinearity(torch::kReLU)
                                  .bias(false)
                                  .batch_first(true)
                                  .dropout(0.125)
                                  .bidirectional(true));
  CHECK(rnn.input_size() == 3);
  CHECK(rnn.hidden_size() == 8);
  CHECK(rnn.num_layers() == 4);
  CHECK(holds_alternative<torch::enumtype::kReLU>(rnn.nonlinearity()));
  CHECK_FALSE(rnn.bias());
  CHECK(rnn.batch_first());
  CHECK(rnn.dropout() == 0.125);
  CHECK(rnn.bidirectional());
  CHECK(holds_alternative<torch::enumtype::kTanh>(
      round_trip(torch::nn::RNNOptions(1, 1)).nonlinearity()));

  // Bad input: an unknown tag is a DecodeError naming the field; an empty value has no options.
  distrpc::wire::Message bad;
  distrpc::wire::encode(bad, int64_t{3}, int64_t{8}, int64_t{1}, true, false, 0.0, false,
                        std::uint8_t{9});
  distrpc::nn::WireOptions<torch::nn::RNNOptions> rnn_back;
  expect_exact<distrpc::wire::DecodeError>([&] { distrpc::wire::decode(bad, rnn_back); },
                                           "torch::nn::RNNOptions: unknown nonlinearity tag 9",
                                           "bad nonlinearity tag");
  expect_exact<std::logic_error>([] { distrpc::nn::WireOptions<torch::nn::LinearOptions>().get(); },
                                 "no options held", "get() of an empty WireOptions");
}

namespace rm_test {

using LSTMOut = std::tuple<at::Tensor, std::tuple<at::Tensor, at::Tensor>>;
struct LSTMInterface {
  LSTMOut forward(at::Tensor input);
};

}  // namespace rm_test

DISTRPC_MP_TEST(
    "remote module: options structs as constructor arguments build the module they describe", 2,
    60) {
  init(ctx);
  if (ctx.rank == 0) {
    using LinearRM = RemoteModule<LinearInterface>;
    const at::Tensor x = at::randn({5, 4});
    // Linear without bias: one parameter, and forward is x W^T.
    auto lin = LinearRM::create<torch::nn::Linear>("worker1/cpu",
                                                   torch::nn::LinearOptions(4, 3).bias(false));
    auto params = lin.remote_parameters();
    REQUIRE(params.size() == 1);
    const at::Tensor w = params[0].to_here();
    CHECK(w.sizes() == at::IntArrayRef({3, 4}));
    CHECK(at::allclose(lin.forward(x), at::matmul(x, w.t())));

    // Conv2d with stride and padding: (32 + 2*1 - 3) / 2 + 1 = 16.
    auto conv = LinearRM::create<torch::nn::Conv2d>(
        "worker1/cpu", torch::nn::Conv2dOptions(3, 8, 3).stride(2).padding(1));
    CHECK(conv.forward(at::randn({2, 3, 32, 32})).sizes() == at::IntArrayRef({2, 8, 16, 16}));
    auto same = LinearRM::create<torch::nn::Conv2d>(
        "worker1/cpu", torch::nn::Conv2dOptions(3, 4, {3, 5}).padding(torch::kSame).bias(false));
    CHECK(same.forward(at::randn({1, 3, 9, 11})).sizes() == at::IntArrayRef({1, 4, 9, 11}));
    CHECK(same.remote_parameters().size() == 1);

    // Embedding with padding_idx: that row is zero.
    auto emb = LinearRM::create<torch::nn::Embedding>(
        "worker1/cpu", torch::nn::EmbeddingOptions(10, 3).padding_idx(0));
    const at::Tensor rows = emb.forward(at::tensor({0, 4}, at::kLong));
    CHECK(rows.sizes() == at::IntArrayRef({2, 3}));
    CHECK(at::equal(rows[0], at::zeros({3})));

    // BatchNorm2d without affine parameters; LayerNorm without them either.
    auto bn = LinearRM::create<torch::nn::BatchNorm2d>(
        "worker1/cpu", torch::nn::BatchNorm2dOptions(3).affine(false));
    CHECK(bn.remote_parameters().empty());
    CHECK(bn.forward(at::randn({4, 3, 2, 2})).sizes() == at::IntArrayRef({4, 3, 2, 2}));
    auto ln = LinearRM::create<torch::nn::LayerNorm>(
        "worker1/cpu", torch::nn::LayerNormOptions({4}).elementwise_affine(false));
    CHECK(ln.remote_parameters().empty());
    const at::Tensor normed = ln.forward(x);
    CHECK(at::allclose(normed.mean(1), at::zeros({5}), 1e-5, 1e-5));

    // A two-layer batch-first LSTM: 4 parameters per layer, output (batch, seq, hidden).
    auto lstm = RemoteModule<LSTMInterface>::create<torch::nn::LSTM>(
        "worker1/cpu", torch::nn::LSTMOptions(4, 6).num_layers(2).batch_first(true));
    CHECK(lstm.remote_parameters().size() == 8);
    const auto [out, state] = lstm.forward(at::randn({2, 5, 4}));
    CHECK(out.sizes() == at::IntArrayRef({2, 5, 6}));
    CHECK(std::get<0>(state).sizes() == at::IntArrayRef({2, 2, 6}));
  }
  distrpc::shutdown();
}

// ---- a RemoteModule inside a local module tree -------------------------------------------------

namespace rm_test {

// A local Linear, then a remote one, registered like any submodule.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(RemoteModule<LinearInterface> remote)
      : local(register_module("local", torch::nn::Linear(4, 8))),
        encoder(register_module(
            "encoder", distrpc::nn::RemoteModuleHolder<LinearInterface>(std::move(remote)))) {}
  at::Tensor forward(const at::Tensor& x) { return encoder->forward(at::relu(local->forward(x))); }
  torch::nn::Linear local;
  distrpc::nn::RemoteModuleHolder<LinearInterface> encoder;
};
TORCH_MODULE(Net);

at::Tensor forward_through(RemoteModule<LinearInterface> rm, at::Tensor x) {
  return rm.forward(x);
}

}  // namespace rm_test

DISTRPC_MP_TEST(
    "remote module: inside a local module tree: forward, train/eval, parameters, printing, "
    "copies, sending its handle",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    using distrpc::nn::RemoteModuleImpl;
    Net net(RemoteModule<LinearInterface>::create<torch::nn::Linear>("worker1/cpu", 8, 3));
    const at::Tensor x = at::randn({5, 4});

    // Numerically the local computation with the remote weights.
    auto remote_params = net->encoder->remote_parameters();
    REQUIRE(remote_params.size() == 2);
    const at::Tensor w = remote_params[0].to_here();
    const at::Tensor b = remote_params[1].to_here();
    const at::Tensor expected = at::linear(at::relu(net->local->forward(x)), w, b);
    const at::Tensor y = net->forward(x);
    CHECK(y.sizes() == at::IntArrayRef({5, 3}));
    CHECK(at::allclose(y, expected));
    CHECK(at::allclose(net->encoder->forward(distrpc::with_timeout(20s), at::ones({1, 8})),
                       at::linear(at::ones({1, 8}), w, b)));

    // parameters() lists the local ones only; the remote ones come from remote_parameters().
    std::vector<std::string> names;
    for (const auto& p : net->named_parameters()) names.push_back(p.key());
    CHECK(names == std::vector<std::string>{"local.weight", "local.bias"});
    CHECK(net->encoder->parameters().empty());
    std::vector<std::string> children;
    for (const auto& c : net->named_children()) children.push_back(c.key());
    CHECK(children == std::vector<std::string>{"local", "encoder"});

    // Name and printing.
    CHECK(net->encoder->name() == "distrpc::nn::RemoteModule<rm_test::LinearInterface>");
    std::ostringstream printed;
    printed << *net;
    CHECK_MESSAGE(contains(printed.str(),
                           "\n  (encoder): distrpc::nn::RemoteModule<rm_test::LinearInterface>("
                           "worker1/cpu)\n"),
                  printed.str());

    // train/eval of the parent reach the remote module.
    auto remote_training = [&] {
      return distrpc::rpc_sync<&linear_is_training_on_owner>("worker1",
                                                             net->encoder->get_module_rref());
    };
    CHECK(remote_training());
    net->eval();
    CHECK_FALSE(net->is_training());
    CHECK_FALSE(net->local->is_training());
    CHECK_FALSE(net->encoder->is_training());
    CHECK_FALSE(remote_training());
    net->train();
    CHECK(net->encoder->is_training());
    CHECK(remote_training());
    net->encoder->eval(distrpc::with_timeout(20s));
    CHECK_FALSE(net->encoder->is_training());
    CHECK_FALSE(remote_training());
    net->train(true);
    CHECK(remote_training());

    // Copies of the parent's holder share the modules; the copy outlives the original.
    Net copy = net;
    CHECK(copy.ptr() == net.ptr());
    net = nullptr;
    CHECK(at::allclose(copy->forward(x), expected));
    copy->eval();
    CHECK_FALSE(distrpc::rpc_sync<&linear_is_training_on_owner>("worker1",
                                                                copy->encoder->get_module_rref()));

    // The handle inside is the by-value RemoteModule: it still travels over RPC.
    const RemoteModule<LinearInterface> handle = copy->encoder->handle();
    CHECK(at::allclose(distrpc::rpc_sync<&forward_through>("worker1", handle, at::ones({2, 8})),
                       at::linear(at::ones({2, 8}), w, b)));

    // Bad input: an empty handle; cloning, which would need a second remote module.
    expect_exact<std::invalid_argument>(
        [] { RemoteModuleImpl<LinearInterface>{RemoteModule<LinearInterface>()}; },
        "distrpc::nn::RemoteModule<rm_test::LinearInterface>: cannot wrap an empty RemoteModule "
        "handle",
        "empty handle");
    expect_exact<std::logic_error>([&] { copy->encoder->clone(); },
                                   "distrpc::nn::RemoteModule<rm_test::LinearInterface> cannot be "
                                   "cloned: its module lives on WorkerInfo(",
                                   "clone");
  }
  distrpc::shutdown();
}
