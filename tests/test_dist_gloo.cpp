// The gloo part of test_dist: the c10d store adapter under libtorch's own c10d::ProcessGroupGloo,
// and what is particular to GlooBackend (registration, construction, shutdown). Its collectives
// are checked by the backend conformance suite (test_dist_conformance.cpp).
// Built only when meson finds gloo (gloo_found): libtorch with ProcessGroupGloo and gloo's headers.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <doctest/doctest.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "distrpc/dist/backend_config.hpp"
#include "distrpc/dist/detail/c10d_store_adapter.hpp"
#include "distrpc/dist/gloo_backend.hpp"
#include "distrpc/error.hpp"
#include "distrpc/store/file_store.hpp"
#include "distrpc/store/hash_store.hpp"
#include "distrpc/store/tcp_store.hpp"
#include "multiprocess.hpp"
#include "support/error_text.hpp"

using distrpc::dist::detail::C10dStoreAdapter;
using distrpc::store::Bytes;
using distrpc::store::to_bytes;

namespace {

std::vector<uint8_t> v(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string message_of(const c10::Error& e) {
  return e.msg();
}

using distrpc::testing::error_text;

}  // namespace

TEST_CASE("C10dStoreAdapter forwards every c10d::Store call to the distrpc store") {
  auto inner = std::make_shared<distrpc::store::HashStore>(std::chrono::milliseconds(2000));
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<C10dStoreAdapter>(inner);

  CHECK(store->getTimeout() == std::chrono::milliseconds(2000));

  store->set("a", v("alpha"));
  CHECK(inner->get_string("a") == "alpha");  // written through to the distrpc store
  inner->set("b", std::string_view("beta"));
  CHECK(store->get("b") == v("beta"));  // and read back from it

  CHECK(store->add("n", 5) == 5);
  CHECK(store->add("n", -2) == 3);
  CHECK(inner->get_string("n") == "3");

  CHECK(store->check({"a", "b"}));
  CHECK_FALSE(store->check({"a", "missing"}));
  CHECK(store->getNumKeys() == inner->num_keys());
  CHECK(store->getNumKeys() == 3);

  // compareSet: a mismatch leaves the value and returns the current one; a match replaces it.
  CHECK(store->compareSet("a", v("nope"), v("x")) == v("alpha"));
  CHECK(store->compareSet("a", v("alpha"), v("omega")) == v("omega"));
  CHECK(inner->get_string("a") == "omega");

  CHECK(store->deleteKey("a"));
  CHECK_FALSE(store->deleteKey("a"));
  CHECK_FALSE(inner->check({"a"}));
  CHECK(store->getNumKeys() == 2);

  store->wait({"b", "n"});  // present: returns at once
  store->wait({"b"}, std::chrono::milliseconds(10));

  // clone() (libtorch 2.x's Store asks for it): another handle on the same distrpc store.
  c10::intrusive_ptr<c10d::Store> copy = static_cast<C10dStoreAdapter&>(*store).clone();
  CHECK(copy.get() != store.get());
  copy->set("c", v("gamma"));
  CHECK(store->get("c") == v("gamma"));
  CHECK(inner->get_string("c") == "gamma");
}

TEST_CASE("C10dStoreAdapter turns distrpc store errors into c10::Error with the same text") {
  auto inner = std::make_shared<distrpc::store::HashStore>(std::chrono::milliseconds(2000));
  auto store = c10::make_intrusive<C10dStoreAdapter>(inner);

  std::string distrpc_text;
  try {
    inner->wait({"never"}, std::chrono::milliseconds(30));
  } catch (const distrpc::DistError& e) {
    distrpc_text = e.what();
  }
  REQUIRE(distrpc_text.find("Timeout after 30 ms") != std::string::npos);

  bool thrown = false;
  try {
    store->wait({"never"}, std::chrono::milliseconds(30));
  } catch (const c10::Error& e) {
    thrown = true;
    CHECK(message_of(e) == distrpc_text);
  }
  CHECK(thrown);

  // get() waits up to the store's timeout: setTimeout on the adapter reaches the distrpc store.
  store->setTimeout(std::chrono::milliseconds(40));
  CHECK(inner->timeout() == std::chrono::milliseconds(40));
  CHECK(store->getTimeout() == std::chrono::milliseconds(40));
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(store->get("never"), c10::Error);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(1));
}

TEST_CASE("C10dStoreAdapter rejects a null store and a negative timeout") {
  bool thrown = false;
  try {
    C10dStoreAdapter adapter(nullptr);
  } catch (const c10::Error& e) {
    thrown = true;
    CHECK(message_of(e) == "C10dStoreAdapter: the distrpc store is null");
  }
  CHECK(thrown);

  auto inner = std::make_shared<distrpc::store::HashStore>(std::chrono::milliseconds(2000));
  C10dStoreAdapter adapter(inner);
  thrown = false;
  try {
    adapter.setTimeout(std::chrono::milliseconds(-5));
  } catch (const c10::Error& e) {
    thrown = true;
    CHECK(message_of(e) == "C10dStoreAdapter::setTimeout: negative timeout (-5 ms)");
  }
  CHECK(thrown);
  CHECK(inner->timeout() == std::chrono::milliseconds(2000));  // unchanged
}

// Two ranks meet through a distrpc TCPStore (rank 0 serves it on a free loopback port it
// publishes), wrap it for c10d and run ProcessGroupGloo's collectives over a loopback device.
DISTRPC_MP_TEST("ProcessGroupGloo over a distrpc TCPStore: allreduce, broadcast, barrier", 2, 60) {
  const bool master = ctx.rank == 0;
  std::shared_ptr<distrpc::store::TCPStore> tcp;
  if (master) {
    tcp = std::make_shared<distrpc::store::TCPStore>("127.0.0.1", 0, ctx.world, true,
                                                     std::chrono::seconds(30));
    ctx.publish("port", std::to_string(tcp->port()));
  } else {
    const int port = std::stoi(ctx.lookup("port"));
    tcp = std::make_shared<distrpc::store::TCPStore>("127.0.0.1", port, ctx.world, false,
                                                     std::chrono::seconds(30));
  }
  auto store = c10::make_intrusive<C10dStoreAdapter>(tcp);
  const std::int64_t keys_before = tcp->num_keys();

  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, ctx.rank, ctx.world, options);
  REQUIRE(pg->getRank() == ctx.rank);
  REQUIRE(pg->getSize() == ctx.world);

  // allreduce (sum): rank r contributes (r + 1) * [1, 2, 3] -> 3 * [1, 2, 3] on both.
  std::vector<at::Tensor> t{at::tensor({1.0f, 2.0f, 3.0f}) * static_cast<float>(ctx.rank + 1)};
  pg->allreduce(t)->wait();
  CHECK(at::equal(t[0], at::tensor({3.0f, 6.0f, 9.0f})));

  // allreduce (max) on int64.
  std::vector<at::Tensor> m{at::full({4}, 10 * (ctx.rank + 1), at::kLong)};
  c10d::AllreduceOptions max_opts;
  max_opts.reduceOp = c10d::ReduceOp::MAX;
  pg->allreduce(m, max_opts)->wait();
  CHECK(at::equal(m[0], at::full({4}, 20, at::kLong)));

  // broadcast from rank 1: rank 0's tensor is overwritten with rank 1's values.
  std::vector<at::Tensor> b{master ? at::zeros({2, 2}) : at::arange(4, at::kFloat).reshape({2, 2})};
  c10d::BroadcastOptions bopts;
  bopts.rootRank = 1;
  pg->broadcast(b, bopts)->wait();
  CHECK(at::equal(b[0], at::arange(4, at::kFloat).reshape({2, 2})));

  // barrier: rank 1 sets a key only after it; rank 0 sets one before it and checks that rank 1
  // saw it, so the barrier really ordered the two ranks.
  if (master) tcp->set("before_barrier", std::string_view("1"));
  pg->barrier()->wait();
  if (!master) CHECK(tcp->check({"before_barrier"}));

  // ProcessGroupGloo's rendezvous went through the adapter: this rank's own address key (at least)
  // was added to the distrpc store after keys_before was read.
  CHECK(tcp->num_keys() > keys_before);
  // Both ranks leave together, so neither tears its gloo pairs down under the other.
  pg->barrier()->wait();
}

// No hang: a peer that never comes makes ProcessGroupGloo's construction fail after the process
// group's timeout, with the distrpc store's timeout text, instead of blocking.
TEST_CASE("ProcessGroupGloo whose peer never arrives fails after its timeout") {
  auto inner = std::make_shared<distrpc::store::HashStore>(std::chrono::seconds(30));
  auto store = c10::make_intrusive<C10dStoreAdapter>(inner);
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(500));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  const auto start = std::chrono::steady_clock::now();
  std::string text;
  try {
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 2, options);
  } catch (const c10::Error& e) {
    text = message_of(e);
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  INFO("error: " << text);
  CHECK(text.find("Timeout after 500 ms") != std::string::npos);
  CHECK(elapsed >= std::chrono::milliseconds(500));
  CHECK(elapsed < std::chrono::seconds(10));
}

// The adapter is not tied to one store: the same collectives meet through a distrpc FileStore
// (a file in the run's shared directory).
DISTRPC_MP_TEST("ProcessGroupGloo over a distrpc FileStore: allreduce", 2, 60) {
  auto file = std::make_shared<distrpc::store::FileStore>(ctx.dir + "/gloo_store", ctx.world,
                                                          std::chrono::seconds(30));
  auto store = c10::make_intrusive<C10dStoreAdapter>(file);
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, ctx.rank, ctx.world, options);

  // rank r contributes [r, r + 10] -> [0 + 1, 10 + 11] = [1, 21].
  std::vector<at::Tensor> t{at::tensor({static_cast<double>(ctx.rank), ctx.rank + 10.0})};
  pg->allreduce(t)->wait();
  CHECK(at::equal(t[0], at::tensor({1.0, 21.0})));
  pg->barrier()->wait();
}

TEST_CASE("register_gloo_backend registers gloo for cpu, once") {
  distrpc::dist::register_gloo_backend();
  distrpc::dist::register_gloo_backend();  // a second call is harmless
  CHECK(distrpc::dist::is_backend_available("gloo"));
  CHECK(distrpc::dist::is_backend_available("GLOO"));
  auto store = std::make_shared<distrpc::store::HashStore>(std::chrono::seconds(10));
  auto backend = distrpc::dist::backend_creator("gloo")(store, 0, 1, std::chrono::seconds(10));
  REQUIRE(backend != nullptr);
  CHECK(backend->name() == "gloo");
  CHECK(dynamic_cast<distrpc::dist::GlooBackend*>(backend.get()) != nullptr);
  CHECK(backend->timeout() == std::chrono::seconds(10));
  CHECK(backend->sequence_number() == 0);
}

TEST_CASE("GlooBackend refuses bad construction arguments, naming them") {
  using distrpc::dist::GlooBackend;
  auto store = std::make_shared<distrpc::store::HashStore>(std::chrono::seconds(10));
  CHECK(error_text<std::invalid_argument>([] {
          GlooBackend b(nullptr, 0, 1, std::chrono::seconds(1));
        }) == "GlooBackend: the store is null");
  CHECK(error_text<std::invalid_argument>([&] {
          GlooBackend b(store, 2, 2, std::chrono::seconds(1));
        }) == "Backend: rank 2 is outside the group of size 2");
  CHECK(error_text<std::invalid_argument>([&] {
          GlooBackend b(store, 0, 1, std::chrono::milliseconds(0));
        }) == "Backend: the timeout must be positive, got 0 ms");
  distrpc::dist::GlooBackendOptions opts;
  opts.threads = 0;
  CHECK(error_text<std::invalid_argument>([&] {
          GlooBackend b(store, 0, 1, std::chrono::seconds(1), opts);
        }) == "GlooBackend: threads must be at least 1, got 0");
}

// No hang: a peer that never comes fails the construction after the timeout, as DistBackendError
// with the store's timeout text.
TEST_CASE("GlooBackend whose peer never arrives fails with DistBackendError after its timeout") {
  auto store = std::make_shared<distrpc::store::HashStore>(std::chrono::seconds(30));
  distrpc::dist::GlooBackendOptions opts;
  opts.hostname = "127.0.0.1";
  const auto start = std::chrono::steady_clock::now();
  const std::string text = error_text<distrpc::DistBackendError>(
      [&] { distrpc::dist::GlooBackend b(store, 0, 2, std::chrono::milliseconds(500), opts); });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  INFO("error: " << text);
  CHECK(text.find("Timeout after 500 ms") != std::string::npos);
  CHECK(elapsed >= std::chrono::milliseconds(500));
  CHECK(elapsed < std::chrono::seconds(10));
}

// Two members in one process (threads), so that rank 0 can hold a receive rank 1 never answers.
TEST_CASE("GlooBackend shutdown fails pending work at once and refuses later calls") {
  using distrpc::dist::GlooBackend;
  auto store = std::make_shared<distrpc::store::HashStore>(std::chrono::seconds(30));
  distrpc::dist::GlooBackendOptions opts;
  opts.hostname = "127.0.0.1";
  std::shared_ptr<GlooBackend> b0;
  std::shared_ptr<GlooBackend> b1;
  std::thread peer(
      [&] { b1 = std::make_shared<GlooBackend>(store, 1, 2, std::chrono::seconds(20), opts); });
  b0 = std::make_shared<GlooBackend>(store, 0, 2, std::chrono::seconds(20), opts);
  peer.join();
  REQUIRE(b1 != nullptr);

  std::vector<at::Tensor> buf{at::zeros({3})};
  auto pending = b0->recv(buf, 1, 42);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK_FALSE(pending->is_completed());
  const auto start = std::chrono::steady_clock::now();
  b0->shutdown();
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(pending->is_completed());
  CHECK(error_text<distrpc::DistBackendError>([&] { pending->wait(); }) ==
        "Backend gloo was shut down");
  CHECK(at::equal(buf[0], at::zeros({3})));  // nothing landed
  std::vector<at::Tensor> t{at::ones({2})};
  CHECK(error_text<distrpc::DistBackendError>([&] { b0->allreduce(t); }) ==
        "GlooBackend allreduce: the backend was shut down");
  b0->shutdown();  // idempotent
  b1->shutdown();
}

namespace {
// Ranks 0 and 1 of a gloo group in this process: rank 0's backend in a holder a Work callback
// can empty (dropping the last reference), rank 1's as it is.
struct GlooPair {
  std::shared_ptr<std::shared_ptr<distrpc::dist::GlooBackend>> holder;
  std::shared_ptr<distrpc::dist::GlooBackend> b1;
};
GlooPair gloo_pair() {
  using distrpc::dist::GlooBackend;
  auto store = std::make_shared<distrpc::store::HashStore>(std::chrono::seconds(30));
  distrpc::dist::GlooBackendOptions opts;
  opts.hostname = "127.0.0.1";
  GlooPair p;
  std::thread peer(
      [&] { p.b1 = std::make_shared<GlooBackend>(store, 1, 2, std::chrono::seconds(20), opts); });
  p.holder = std::make_shared<std::shared_ptr<GlooBackend>>(
      std::make_shared<GlooBackend>(store, 0, 2, std::chrono::seconds(20), opts));
  peer.join();
  REQUIRE(p.b1 != nullptr);
  return p;
}
}  // namespace

// A Work callback runs on the backend's waiter thread; one that drops the backend's last reference
// runs shutdown() there, which must not try to join the thread it runs on.
TEST_CASE("GlooBackend: a Work callback may drop the last reference to its backend") {
  const GlooPair pair = gloo_pair();
  const auto holder = pair.holder;
  const auto& b1 = pair.b1;

  std::vector<at::Tensor> buf{at::zeros({3})};
  auto w = (*holder)->recv(buf, 1, 5);
  std::promise<std::thread::id> ran_on;
  w->get_future().add_done_callback([holder, &ran_on](const auto&) {
    holder->reset();  // the last reference: ~GlooBackend runs here
    ran_on.set_value(std::this_thread::get_id());
  });
  std::vector<at::Tensor> out{at::full({3}, 4.0)};
  CHECK(b1->send(out, 0, 5)->wait());
  auto ran = ran_on.get_future();
  REQUIRE(ran.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(ran.get() != std::this_thread::get_id());
  CHECK(*holder == nullptr);
  CHECK(w->is_success());
  CHECK(at::equal(buf[0], at::full({3}, 4.0)));
  b1->shutdown();
}

// A collective's Work completes on one of gloo's own threads, which the group's destruction
// joins: a callback there that drops the last reference must not have the group join the thread
// it runs on (std::terminate), and the reference drop returns at once.
TEST_CASE("GlooBackend: a collective's Work callback may drop the last reference to its backend") {
  const GlooPair pair = gloo_pair();
  const auto holder = pair.holder;
  const auto& b1 = pair.b1;

  std::vector<at::Tensor> t0{at::ones({3})};
  auto w = (*holder)->allreduce(t0);
  std::promise<std::thread::id> ran_on;
  w->get_future().add_done_callback([holder, &ran_on](const auto&) {
    holder->reset();  // the last reference: ~GlooBackend runs here, on a gloo thread
    ran_on.set_value(std::this_thread::get_id());
  });
  std::vector<at::Tensor> t1{at::ones({3})};
  CHECK(b1->allreduce(t1)->wait());
  auto ran = ran_on.get_future();
  REQUIRE(ran.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(ran.get() != std::this_thread::get_id());
  CHECK(*holder == nullptr);
  CHECK(w->is_success());
  CHECK(at::equal(t0[0], at::full({3}, 2.0)));
  CHECK(at::equal(t1[0], at::full({3}, 2.0)));
  b1->shutdown();
}
