// The store layer: every Store operation on every store kind (one shared checker), the c10d
// acceptance scenarios 1-3, races between clients (threads and processes), hostile input to the
// TCPStore server, size limits, FileStore paths and cleanup, rendezvous URLs and environment.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/log.hpp"
#include "distrpc/net/tls.hpp"
#include "distrpc/store.hpp"
#include "distrpc/wire/auth.hpp"
#include "multiprocess.hpp"
#include "support/error_text.hpp"
#include "support/scoped_env.hpp"
#include "support/tls_certs.hpp"

namespace ds = distrpc::store;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

namespace fs = std::filesystem;

using distrpc::testing::contains;
using distrpc::testing::ScopedEnv;

milliseconds since(Clock::time_point t0) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
}

// Runs `f`, which must throw E; returns the message (fails the test otherwise).
template <class E, class F>
std::string thrown_text(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected " << typeid(E).name() << ", got another exception: " << e.what());
  }
  FAIL("expected " << typeid(E).name() << ", nothing was thrown");
  return {};
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "distrpc-store-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

int free_port() {
  return distrpc::testing::free_loopback_port();
}

// ---- the store kinds under test ----------------------------------------------------------------

// One shared store and a way to open more handles ("clients") onto it.
struct Kind {
  virtual ~Kind() = default;
  virtual std::shared_ptr<ds::Store> client() = 0;
  // Bytes the kind adds to every key (PrefixStore's "pfx/"), for tests at the key size limit.
  virtual std::size_t key_overhead() const { return 0; }
};

struct HashKind : Kind {
  std::shared_ptr<ds::HashStore> store = std::make_shared<ds::HashStore>(30s);
  std::shared_ptr<ds::Store> client() override { return store; }
};

struct FileKind : Kind {
  TempDir dir;
  std::string path = dir.file("store");
  std::shared_ptr<ds::Store> client() override {
    return std::make_shared<ds::FileStore>(path, -1, 30s);
  }
};

struct TcpKind : Kind {
  std::shared_ptr<ds::TCPStore> master =
      std::make_shared<ds::TCPStore>("127.0.0.1", 0, -1, true, 30s);
  std::shared_ptr<ds::Store> client() override {
    return std::make_shared<ds::TCPStore>("127.0.0.1", master->port(), -1, false, 30s);
  }
};

struct PrefixKind : Kind {
  explicit PrefixKind(std::unique_ptr<Kind> k) : inner(std::move(k)) {}
  std::unique_ptr<Kind> inner;
  std::shared_ptr<ds::Store> client() override {
    return std::make_shared<ds::PrefixStore>("pfx", inner->client());
  }
  std::size_t key_overhead() const override { return 4 + inner->key_overhead(); }
};

const std::vector<std::string> kKinds = {"HashStore",
                                         "FileStore",
                                         "TCPStore",
                                         "PrefixStore(HashStore)",
                                         "PrefixStore(FileStore)",
                                         "PrefixStore(TCPStore)"};

std::unique_ptr<Kind> make_kind(const std::string& name) {
  if (name == "HashStore") return std::make_unique<HashKind>();
  if (name == "FileStore") return std::make_unique<FileKind>();
  if (name == "TCPStore") return std::make_unique<TcpKind>();
  const auto open = name.find('(');
  return std::make_unique<PrefixKind>(make_kind(name.substr(open + 1, name.size() - open - 2)));
}

// The shared checker: runs `body` once for every store kind.
void for_each_kind(const std::function<void(Kind&)>& body) {
  for (const auto& name : kKinds) {
    INFO("store kind: " << name);
    auto kind = make_kind(name);
    body(*kind);
  }
}

// Increments the decimal count at the front of `key`'s value ("<count>/<tag>") with compare_set,
// retrying until this caller's swap wins. The tag makes every desired value unique, so "the reply
// equals what I asked for" can only mean that this very swap happened.
void cas_increment(ds::Store& s, const std::string& key, const std::string& tag) {
  for (int attempt = 0;; ++attempt) {
    const std::string cur = s.check({key}) ? s.get_string(key) : std::string();
    const long count = cur.empty() ? 0 : std::stol(cur.substr(0, cur.find('/')));
    const std::string next = std::to_string(count + 1) + "/" + tag + "." + std::to_string(attempt);
    if (s.compare_set(key, ds::to_bytes(cur), ds::to_bytes(next)) == ds::to_bytes(next)) return;
  }
}

std::string cas_count(ds::Store& s, const std::string& key) {
  const std::string v = s.get_string(key);
  return v.substr(0, v.find('/'));
}

// Runs `f` on a thread and hands back what it threw (assertions stay on the test's thread).
class Async {
 public:
  template <class F>
  explicit Async(F f)
      : thread_([this, f = std::move(f)]() mutable {
          try {
            f();
          } catch (const std::exception& e) {
            error_ = e.what();
            threw_ = true;
          }
        }) {}
  ~Async() {
    if (thread_.joinable()) thread_.join();
  }
  // Joins; the exception text, if any.
  std::optional<std::string> join() {
    thread_.join();
    return threw_ ? std::optional<std::string>(error_) : std::nullopt;
  }

 private:
  std::string error_;
  bool threw_ = false;
  std::thread thread_;
};

}  // namespace

// ---- conformance: every operation on every kind -------------------------------------------------

TEST_CASE("store conformance: set and get, overwrite, empty and binary values, big values") {
  for_each_kind([](Kind& kind) {
    auto a = kind.client();
    auto b = kind.client();
    a->set("k", "v1");
    CHECK(a->get_string("k") == "v1");
    CHECK(b->get_string("k") == "v1");
    b->set("k", std::string_view("v2"));
    CHECK(a->get_string("k") == "v2");
    a->set("empty", "");
    CHECK(b->get("empty").empty());
    const ds::Bytes binary = {0, 1, 0xff, 0, 0x80, '\n'};
    a->set(std::string("bin\0key", 7), binary);
    CHECK(b->get(std::string("bin\0key", 7)) == binary);
    ds::Bytes big(1 << 20);
    for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::uint8_t>(i * 7);
    a->set("big", big);
    CHECK(b->get("big") == big);
    const std::string longest_key(ds::Store::kMaxKeyBytes - kind.key_overhead(), 'k');
    a->set(longest_key, "at the limit");
    CHECK(b->get_string(longest_key) == "at the limit");
  });
}

TEST_CASE("store conformance: get of a missing key times out with a text naming key and ms") {
  for_each_kind([](Kind& kind) {
    auto a = kind.client();
    CHECK(a->timeout() == 30s);
    a->set_timeout(150ms);
    CHECK(a->timeout() == 150ms);
    const auto t0 = Clock::now();
    const auto text = thrown_text<ds::StoreTimeoutError>([&] { a->get("missing key"); });
    const auto took = since(t0);
    CHECK(contains(text, "Timeout"));
    CHECK(contains(text, "missing key"));
    CHECK(contains(text, "150 ms"));
    CHECK(took >= 140ms);
    CHECK(took < 2500ms);
  });
}

TEST_CASE("store conformance: get and wait block until another client sets the keys") {
  for_each_kind([](Kind& kind) {
    auto a = kind.client();
    auto b = kind.client();
    {
      Async setter([&] {
        std::this_thread::sleep_for(100ms);
        b->set("late", "arrived");
      });
      const auto t0 = Clock::now();
      CHECK(a->get_string("late") == "arrived");
      CHECK(since(t0) >= 80ms);
      CHECK_FALSE(setter.join());
    }
    {
      Async setter([&] {
        std::this_thread::sleep_for(50ms);
        b->set("w1", "1");
        std::this_thread::sleep_for(50ms);
        b->set("w2", "2");
      });
      const auto t0 = Clock::now();
      a->wait({"w1", "w2"}, 5s);
      CHECK(since(t0) >= 80ms);
      CHECK(a->check({"w1", "w2"}));
      CHECK_FALSE(setter.join());
    }
  });
}

TEST_CASE("store conformance: add counts in decimal text, add(key, 0) reads, bad values refused") {
  for_each_kind([](Kind& kind) {
    auto a = kind.client();
    auto b = kind.client();
    CHECK(a->add("c", 5) == 5);
    CHECK(b->add("c", -2) == 3);
    CHECK(a->add("c", 0) == 3);
    CHECK(b->get_string("c") == "3");
    b->set("c", "-40");
    CHECK(a->add("c", 2) == -38);

    a->set("text", "abc");
    auto text = thrown_text<distrpc::DistStoreError>([&] { b->add("text", 1); });
    CHECK(contains(text, "not a 64-bit decimal integer"));
    CHECK(contains(text, "text"));
    CHECK(a->get_string("text") == "abc");

    a->set("max", std::to_string(std::numeric_limits<std::int64_t>::max()));
    text = thrown_text<distrpc::DistStoreError>([&] { b->add("max", 1); });
    CHECK(contains(text, "overflows"));
    a->set("min", std::to_string(std::numeric_limits<std::int64_t>::min()));
    CHECK(b->add("min", 0) == std::numeric_limits<std::int64_t>::min());
  });
}

TEST_CASE("store conformance: compare_set in all its cases") {
  for_each_kind([](Kind& kind) {
    auto a = kind.client();
    auto b = kind.client();
    const auto B = [](std::string_view s) { return ds::to_bytes(s); };
    // Missing key and empty expected value: set.
    CHECK(a->compare_set("cs", {}, B("first")) == B("first"));
    CHECK(b->get_string("cs") == "first");
    // Missing key, non-empty expected: nothing set, the expected value comes back.
    CHECK(a->compare_set("absent", B("x"), B("y")) == B("x"));
    CHECK_FALSE(b->check({"absent"}));
    // Present and equal: swapped.
    CHECK(b->compare_set("cs", B("first"), B("second")) == B("second"));
    CHECK(a->get_string("cs") == "second");
    // Present and different: unchanged, the current value comes back.
    CHECK(a->compare_set("cs", B("first"), B("third")) == B("second"));
    CHECK(b->get_string("cs") == "second");
  });
}

TEST_CASE("store conformance: check and wait, with timeouts naming the missing keys") {
  for_each_kind([](Kind& kind) {
    auto a = kind.client();
    auto b = kind.client();
    CHECK(a->check({}));
    CHECK_FALSE(a->check({"x"}));
    b->set("x", "1");
    CHECK(a->check({"x"}));
    CHECK_FALSE(a->check({"x", "y"}));
    a->wait({});
    a->wait({"x"}, 1s);

    const auto t0 = Clock::now();
    const auto text = thrown_text<ds::StoreTimeoutError>([&] { a->wait({"x", "y"}, 150ms); });
    CHECK(since(t0) >= 140ms);
    CHECK(contains(text, "Timeout"));
    CHECK(contains(text, "150 ms"));
    CHECK(contains(text, "missing ["));
    CHECK(contains(text.substr(text.find("missing [")), "y'"));
    CHECK_FALSE(contains(text.substr(text.find("missing [")), "x'"));

    // wait(keys) without a duration uses timeout().
    a->set_timeout(100ms);
    const auto t1 = Clock::now();
    CHECK_THROWS_AS(a->wait({"never"}), ds::StoreTimeoutError);
    CHECK(since(t1) >= 90ms);
  });
}

TEST_CASE("store conformance: delete_key and num_keys") {
  for_each_kind([](Kind& kind) {
    auto a = kind.client();
    auto b = kind.client();
    const auto n0 = a->num_keys();
    a->set("d1", "1");
    a->set("d2", "2");
    b->add("d3", 1);
    CHECK(b->num_keys() == n0 + 3);
    a->set("d1", "overwritten");
    CHECK(a->num_keys() == n0 + 3);
    CHECK(b->delete_key("d1"));
    CHECK_FALSE(a->delete_key("d1"));
    CHECK_FALSE(a->check({"d1"}));
    CHECK(a->num_keys() == n0 + 2);
    a->set_timeout(100ms);
    CHECK_THROWS_AS(a->get("d1"), ds::StoreTimeoutError);
    // A deleted key can come back.
    b->set("d1", "again");
    CHECK(a->get_string("d1") == "again");
  });
}

TEST_CASE("store conformance: oversized keys and values are refused with size and limit") {
  const std::string long_key(ds::Store::kMaxKeyBytes + 1, 'k');
  const ds::Bytes long_value(ds::Store::kMaxValueBytes + 1, 1);
  for_each_kind([&](Kind& kind) {
    auto a = kind.client();
    auto text = thrown_text<distrpc::DistStoreError>([&] { a->set(long_key, "v"); });
    // PrefixStore adds "pfx/" to the key before the underlying store measures it.
    CHECK((contains(text, std::to_string(long_key.size()) + " bytes") ||
           contains(text, std::to_string(long_key.size() + 4) + " bytes")));
    CHECK(contains(text, "limit of " + std::to_string(ds::Store::kMaxKeyBytes) + " bytes"));
    text = thrown_text<distrpc::DistStoreError>([&] { a->set("v", long_value); });
    CHECK(contains(text, std::to_string(long_value.size()) + " bytes"));
    CHECK(contains(text, "limit of " + std::to_string(ds::Store::kMaxValueBytes) + " bytes"));
    CHECK_THROWS_AS(a->get(long_key), distrpc::DistStoreError);
    CHECK_THROWS_AS(a->add(long_key, 1), distrpc::DistStoreError);
    CHECK_THROWS_AS(a->check({"ok", long_key}), distrpc::DistStoreError);
    CHECK_THROWS_AS(a->wait({long_key}, 10ms), distrpc::DistStoreError);
    CHECK_THROWS_AS(a->compare_set("k", {}, long_value), distrpc::DistStoreError);
    CHECK_THROWS_AS(a->delete_key(long_key), distrpc::DistStoreError);
    // Still usable afterwards.
    a->set("after", "ok");
    CHECK(a->get_string("after") == "ok");
  });
}

TEST_CASE("store conformance: racing clients lose no add and no compare_set update") {
  constexpr int kThreads = 4;
  constexpr int kAdds = 150;
  constexpr int kSwaps = 30;
  for_each_kind([&](Kind& kind) {
    std::vector<std::shared_ptr<ds::Store>> clients;
    for (int i = 0; i < kThreads; ++i) clients.push_back(kind.client());
    std::vector<std::vector<std::int64_t>> seen(kThreads);
    std::vector<std::unique_ptr<Async>> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.push_back(std::make_unique<Async>([&, t] {
        for (int i = 0; i < kAdds; ++i) seen[t].push_back(clients[t]->add("race", 1));
        for (int i = 0; i < kSwaps; ++i) {
          cas_increment(*clients[t], "cas", std::to_string(t) + "." + std::to_string(i));
        }
      }));
    }
    for (auto& t : threads) CHECK_FALSE(t->join());
    CHECK(clients[0]->add("race", 0) == kThreads * kAdds);
    // Every add returned a distinct count: each saw the result of exactly its own increment.
    std::set<std::int64_t> all;
    for (const auto& s : seen) all.insert(s.begin(), s.end());
    CHECK(all.size() == std::size_t(kThreads * kAdds));
    CHECK(*all.begin() == 1);
    CHECK(*all.rbegin() == kThreads * kAdds);
    CHECK(cas_count(*clients[0], "cas") == std::to_string(kThreads * kSwaps));
  });
}

// ---- c10d acceptance scenarios ------------------------------------------------------------------

TEST_CASE(
    "store: c10d scenario 1 - get of a missing key fails with Timeout via tcp:// and file://") {
  TempDir dir;
  for (const std::string& url : {std::string("tcp://127.0.0.1:0"), "file://" + dir.file("s1")}) {
    INFO("url: " << url);
    const auto t0 = Clock::now();
    {
      auto r = ds::rendezvous(url, 0, 1, 1s);
      CHECK(r.rank == 0);
      CHECK(r.world_size == 1);
      REQUIRE(r.store);
      const auto t1 = Clock::now();
      const auto text =
          thrown_text<distrpc::DistStoreError>([&] { r.store->get("nonexistent key"); });
      CHECK(contains(text, "Timeout"));
      CHECK(contains(text, "nonexistent key"));
      CHECK(since(t1) >= 1000ms);
      CHECK(since(t1) <= 3000ms);
    }
    CHECK(since(t0) < 5000ms);  // init + get + destroy
  }
}

namespace {

// Scenario 2: ranks 0..2 enter the barrier, rank 3 never does; returns the three error texts.
std::vector<std::string> barrier_with_missing_rank(
    const std::function<std::shared_ptr<ds::Store>(int rank)>& make_store) {
  constexpr int kWorld = 4;
  std::vector<std::shared_ptr<ds::Store>> stores(kWorld);
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        stores[rank] = make_store(rank);
        if (rank == kWorld - 1) return;
        ds::store_based_barrier(*stores[rank], rank, kWorld, "_", 1s, 500ms);
        errors[rank] = "no error";
      } catch (const distrpc::DistStoreError& e) {
        errors[rank] = e.what();
      } catch (const std::exception& e) {
        errors[rank] = std::string("wrong exception type: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  // The TCP clients go before the server they talk to.
  for (int rank = kWorld - 1; rank >= 0; --rank) stores[rank].reset();
  return {errors.begin(), errors.begin() + kWorld - 1};
}

void check_barrier_errors(const std::vector<std::string>& errors, int joined) {
  REQUIRE(errors.size() == 3);
  for (int rank = 0; rank < 3; ++rank) {
    INFO("rank " << rank << ": " << errors[rank]);
    CHECK(contains(errors[rank], "Timed out initializing process group in store based barrier"));
    CHECK(contains(errors[rank], "on rank " + std::to_string(rank)));
    CHECK(contains(errors[rank], "store_based_barrier_key:_"));
    CHECK(contains(errors[rank], "world_size=4"));
    CHECK(contains(errors[rank], "num_workers_joined=" + std::to_string(joined)));
    CHECK(contains(errors[rank], "timeout=1000 ms"));
  }
}

}  // namespace

TEST_CASE("store: c10d scenario 2 - barrier times out with the c10d text when a rank is missing") {
  SUBCASE("HashStore, a store per thread") {
    const auto t0 = Clock::now();
    check_barrier_errors(
        barrier_with_missing_rank([](int) { return std::make_shared<ds::HashStore>(); }), 1);
    CHECK(since(t0) < 3s);
  }
  SUBCASE("FileStore, four objects in one process sharing a file") {
    TempDir dir;
    const auto path = dir.file("barrier");
    check_barrier_errors(
        barrier_with_missing_rank([&](int) { return std::make_shared<ds::FileStore>(path); }), 3);
  }
  SUBCASE("TCPStore, one server and four clients, wait_for_workers=false") {
    const int port = free_port();
    check_barrier_errors(barrier_with_missing_rank([&](int rank) {
                           // "localhost", as upstream: it may resolve to ::1 and 127.0.0.1.
                           return std::make_shared<ds::TCPStore>("localhost", port, 4, rank == 0,
                                                                 10s, false);
                         }),
                         3);
  }
}

TEST_CASE("store: store_based_barrier passes when every rank enters, on every kind") {
  for_each_kind([](Kind& kind) {
    std::vector<std::shared_ptr<ds::Store>> stores;
    for (int r = 0; r < 4; ++r) stores.push_back(kind.client());
    std::vector<std::unique_ptr<Async>> ranks;
    for (int r = 0; r < 4; ++r) {
      ranks.push_back(std::make_unique<Async>([&, r] {
        std::this_thread::sleep_for(milliseconds(20 * r));
        ds::store_based_barrier(*stores[r], r, 4, "all_here", 10s);
      }));
    }
    for (auto& r : ranks) CHECK_FALSE(r->join());
    CHECK(stores[0]->add("store_based_barrier_key:all_here", 0) == 4);
  });
}

DISTRPC_MP_TEST("store: c10d scenario 3 - 4-process barrier over tcp://, server rank exits last", 4,
                60) {
  std::string url = "tcp://127.0.0.1:0";
  if (ctx.rank != 0) url = "tcp://127.0.0.1:" + ctx.lookup("port");
  auto r = ds::rendezvous(url, ctx.rank, ctx.world, 30s);
  REQUIRE(r.rank == ctx.rank);
  REQUIRE(r.world_size == 4);
  if (ctx.rank == 0) {
    auto tcp = std::dynamic_pointer_cast<ds::TCPStore>(r.store);
    REQUIRE(tcp);
    CHECK(tcp->is_master());
    ctx.publish("port", std::to_string(tcp->port()));
  }
  r.store->set("name/" + std::to_string(ctx.rank), std::to_string(::getpid()));
  ds::store_based_barrier(*r.store, ctx.rank, ctx.world, "scenario3", 30s);
  // After the barrier every rank's name is there without waiting.
  std::vector<std::string> names;
  for (int i = 0; i < ctx.world; ++i) names.push_back("name/" + std::to_string(i));
  CHECK(r.store->check(names));
  r.store->add("counter", ctx.rank + 1);
  if (ctx.rank != 0) ctx.publish("finalizing_" + std::to_string(ctx.rank), "1");
  ds::finalize_rendezvous(*r.store, ctx.rank, ctx.world, 30s);
  if (ctx.rank == 0) {
    // Everyone checked out before the server's host goes: its store (and server) may now close.
    CHECK(r.store->add("distrpc_finalize:default", 0) == 4);
    CHECK(r.store->add("counter", 0) == 1 + 2 + 3 + 4);
    for (int i = 1; i < ctx.world; ++i)
      CHECK(ctx.lookup("finalizing_" + std::to_string(i), 1s) == "1");
  }
}

DISTRPC_MP_TEST("store: 4 processes race on add and compare_set through TCPStore and FileStore", 4,
                60) {
  constexpr int kAdds = 200;
  constexpr int kSwaps = 25;
  std::string url = "tcp://127.0.0.1:0";
  if (ctx.rank != 0) url = "tcp://127.0.0.1:" + ctx.lookup("port");
  auto tcp = ds::rendezvous(url, ctx.rank, ctx.world, 30s);
  if (ctx.rank == 0) {
    ctx.publish("port", std::to_string(std::dynamic_pointer_cast<ds::TCPStore>(tcp.store)->port()));
  }
  auto file = ds::rendezvous(ctx.file_url(), ctx.rank, ctx.world, 30s);
  for (auto* s : {tcp.store.get(), file.store.get()}) {
    ds::store_based_barrier(*s, ctx.rank, ctx.world, "start", 30s);
    for (int i = 0; i < kAdds; ++i) s->add("adds", 1);
    for (int i = 0; i < kSwaps; ++i) {
      cas_increment(*s, "cas", std::to_string(ctx.rank) + "." + std::to_string(i));
    }
    ds::store_based_barrier(*s, ctx.rank, ctx.world, "done", 30s);
    CHECK(s->add("adds", 0) == ctx.world * kAdds);
    CHECK(cas_count(*s, "cas") == std::to_string(ctx.world * kSwaps));
  }
  ds::finalize_rendezvous(*file.store, ctx.rank, ctx.world, 30s);
  ds::finalize_rendezvous(*tcp.store, ctx.rank, ctx.world, 30s);
}

// ---- TCPStore --------------------------------------------------------------------------------

namespace {

// Requests written by hand from the protocol description in tcp_store.hpp (c10d's), independent
// of its code.
std::vector<std::uint8_t> le64(std::uint64_t v) {
  std::vector<std::uint8_t> out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(v >> (8 * i));
  return out;
}
void append(std::vector<std::uint8_t>& out, const std::vector<std::uint8_t>& more) {
  out.insert(out.end(), more.begin(), more.end());
}
std::vector<std::uint8_t> str_field(const std::string& s) {
  auto out = le64(s.size());
  out.insert(out.end(), s.begin(), s.end());
  return out;
}
// Legacy (PyTorch 1.13) query type bytes.
constexpr std::uint8_t kQSet = 0, kQGet = 2, kQAdd = 3, kQCheck = 4, kQWait = 5, kQNumKeys = 6;

class RawSocket {
 public:
  explicit RawSocket(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    REQUIRE(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  ~RawSocket() { close(); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  void send(const std::vector<std::uint8_t>& bytes) {
    // Throws (rather than REQUIRE) so it can run on a helper thread.
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw std::runtime_error(std::string("send: ") + std::strerror(errno));
      done += static_cast<std::size_t>(n);
    }
  }
  void send(const std::string& bytes) {
    send(std::vector<std::uint8_t>(bytes.begin(), bytes.end()));
  }
  // Reads until the peer closes (true) or `limit` passes with the connection open (false).
  bool closed_by_peer(milliseconds limit = 2s) {
    const auto t0 = Clock::now();
    char buf[256];
    while (since(t0) < limit) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return true;
    }
    return false;
  }
  // Exactly `n` reply bytes; nullopt if the connection closed or they did not come in time.
  std::optional<std::vector<std::uint8_t>> reply(std::size_t n, milliseconds limit = 2s) {
    auto& in = in_;
    const auto t0 = Clock::now();
    while (since(t0) < limit) {
      if (in.size() >= n) {
        std::vector<std::uint8_t> out(in.begin(), in.begin() + static_cast<long>(n));
        in.erase(in.begin(), in.begin() + static_cast<long>(n));
        return out;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      const ssize_t got = ::recv(fd_, buf, sizeof buf, 0);
      if (got <= 0) return std::nullopt;
      in.insert(in.end(), buf, buf + got);
    }
    return std::nullopt;
  }

 private:
  int fd_ = -1;
  std::vector<std::uint8_t> in_;  // bytes received beyond the last reply returned
};

// Sends stderr to a file while alive, so a test can read what the server logged.
class StderrCapture {
 public:
  StderrCapture() : path_(dir_.file("stderr")) {
    std::fflush(stderr);
    saved_ = ::dup(STDERR_FILENO);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDERR_FILENO);
    ::close(fd);
  }
  ~StderrCapture() {
    std::fflush(stderr);
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }
  std::string text() const {
    std::fflush(stderr);
    std::ifstream in(path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  TempDir dir_;
  std::string path_;
  int saved_ = -1;
};

int count_of(const std::string& text, const std::string& part) {
  int n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("TCPStore: hostile input closes only that connection, logged once, others keep working") {
  ds::TCPStore master("127.0.0.1", 0, -1, true, 10s);
  const int port = master.port();
  ds::TCPStore good("127.0.0.1", port, -1, false, 10s);
  good.set("before", "1");
  // A client blocked in get() across all of it must still get its answer.
  std::string waited;
  Async blocked([&] {
    ds::TCPStore waiter("127.0.0.1", port, -1, false, 10s);
    waited = waiter.get_string("after the storm");
  });

  StderrCapture log;
  auto expect_closed = [&](const std::vector<std::uint8_t>& bytes, const std::string& reason) {
    INFO("expected reason: " << reason);
    RawSocket raw(port);
    raw.send(bytes);
    CHECK(raw.closed_by_peer());
    CHECK(count_of(log.text(), reason) == 1);
    // The server is alive and serving: the good client works after each attack.
    good.set("probe", reason);
    CHECK(good.get_string("probe") == reason);
  };

  SUBCASE("garbage bytes (an HTTP request)") {
    // 'G' is no query type of either numbering.
    const std::string http = "GET / HTTP/1.1\r\n\r\n";
    expect_closed(std::vector<std::uint8_t>(http.begin(), http.end()), "unknown query type 0x47");
  }
  SUBCASE("an unknown query type") {
    expect_closed({0x7f}, "unknown query type 0x7f");
  }
  SUBCASE("an absurd key length") {
    std::vector<std::uint8_t> q = {kQSet};
    append(q, le64(0xffffffffffffffffull));
    expect_closed(q, "the key length 18446744073709551615 is over the limit of 65537 bytes");
  }
  SUBCASE("an absurd value length") {
    std::vector<std::uint8_t> q = {kQSet};
    append(q, str_field("/k"));
    append(q, le64(std::uint64_t(1) << 40));
    expect_closed(q, "the value length 1099511627776 is over the limit of 67108864 bytes");
  }
  SUBCASE("an absurd key count") {
    std::vector<std::uint8_t> q = {kQWait};
    append(q, le64(0xffffffffu));
    expect_closed(q, "the key count 4294967295 is over the limit of 131072");
  }
  SUBCASE("WATCH_KEY is refused") {
    std::vector<std::uint8_t> q = {7};
    append(q, str_field("/k"));
    expect_closed(q, "WATCH_KEY (key change callbacks) is not supported");
  }
  SUBCASE("VALIDATE with a wrong magic on a validated connection") {
    std::vector<std::uint8_t> q = {0, 0xce, 0xf7, 0x85, 0x3c, 0, 1, 2, 3, 4};
    expect_closed(q, "VALIDATE with a wrong magic number");
  }
  SUBCASE("a request while a wait is pending abandons the wait (PyTorch 1.13 clients do that)") {
    RawSocket raw(port);
    std::vector<std::uint8_t> q = {kQWait};
    append(q, le64(1));
    append(q, str_field("/abandoned"));
    raw.send(q);
    std::this_thread::sleep_for(50ms);
    raw.send(std::vector<std::uint8_t>{kQNumKeys});
    auto r = raw.reply(8);
    REQUIRE(r);
    CHECK(*r == le64(static_cast<std::uint64_t>(good.num_keys())));
    // The key appearing later sends no stale STOP_WAITING on that connection.
    good.set("abandoned", "now");
    CHECK_FALSE(raw.reply(1, 300ms));
    CHECK_FALSE(raw.closed_by_peer(100ms));
    CHECK(count_of(log.text(), "closing the connection") == 0);
  }
  SUBCASE("add on a value that is not a number") {
    good.set("word", "abc");
    std::vector<std::uint8_t> q = {kQAdd};
    append(q, str_field("/word"));
    append(q, le64(1));
    expect_closed(q, "is not a 64-bit decimal integer");
    CHECK(good.get_string("word") == "abc");
  }
  SUBCASE("a truncated request, then close") {
    RawSocket raw(port);
    std::vector<std::uint8_t> q = {kQSet};
    append(q, str_field("/k"));
    append(q, le64(100));
    append(q, {'a', 'b'});
    raw.send(q);
    raw.close();
    // The server notices EOF inside a request and says how much had come.
    const auto t0 = Clock::now();
    while (!contains(log.text(), "disconnected mid-request") && since(t0) < 2s) {
      std::this_thread::sleep_for(10ms);
    }
    CHECK(count_of(log.text(), "disconnected mid-request (21 bytes of an unfinished request") == 1);
    CHECK_FALSE(good.check({"k"}));
    good.set("probe", "x");
    CHECK(good.get_string("probe") == "x");
  }
  SUBCASE("a request split into single bytes is served") {
    RawSocket raw(port);
    std::vector<std::uint8_t> q = {kQSet};
    append(q, str_field("/split"));
    append(q, str_field("bytewise"));
    q.push_back(kQCheck);
    append(q, le64(1));
    append(q, str_field("/split"));
    for (std::uint8_t byte : q) {
      raw.send(std::vector<std::uint8_t>{byte});
      std::this_thread::sleep_for(1ms);
    }
    auto r = raw.reply(1);
    REQUIRE(r);
    CHECK((*r)[0] == 0);  // READY
    CHECK(good.get_string("split") == "bytewise");
    CHECK(count_of(log.text(), "closing the connection") == 0);
  }

  good.set("after the storm", "calm");
  CHECK_FALSE(blocked.join());
  CHECK(waited == "calm");
  CHECK(good.get_string("before") == "1");
}

namespace {
long rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}
}  // namespace

TEST_CASE("TCPStore: a client that pipelines requests and reads nothing cannot pile up replies") {
  ds::TCPStore master("127.0.0.1", 0, -1, true, 10s);
  master.set("v", ds::Bytes(16 * 1024, 'v'));
  RawSocket raw(master.port());
  // 10,000 GETs of a 16 KiB value: 160 MiB of replies if the server queued them all.
  constexpr int kRequests = 10'000;
  std::vector<std::uint8_t> one = {kQGet};
  append(one, str_field("/v"));
  std::vector<std::uint8_t> all;
  for (int i = 0; i < kRequests; ++i) append(all, one);
  const long before = rss_kib();
  // On its own thread: once the server stops reading, this send blocks until replies are read.
  Async sender([&] { raw.send(all); });
  std::this_thread::sleep_for(300ms);
  const long grown = rss_kib() - before;
  CHECK(grown < 64 * 1024);
  // Then every reply arrives, in order, intact.
  int good = 0;
  for (int i = 0; i < kRequests; ++i) {
    auto r = raw.reply(8 + 16 * 1024, 5s);
    if (!r) break;
    if (std::equal(r->begin(), r->begin() + 8, le64(16 * 1024).begin()) && (*r)[8] == 'v') ++good;
  }
  CHECK(good == kRequests);
  CHECK_FALSE(sender.join());
  CHECK(master.get("v").size() == 16 * 1024);
}

TEST_CASE("TCPStore: a connection that sends no request is closed after handshake_timeout") {
  ds::TCPStoreOptions opts;
  opts.is_master = true;
  opts.timeout = 5s;
  opts.handshake_timeout = 300ms;
  ds::TCPStore master(opts);
  StderrCapture log;
  RawSocket silent(master.port());
  const auto t0 = Clock::now();
  CHECK(silent.closed_by_peer(3s));
  CHECK(since(t0) >= 250ms);
  CHECK(count_of(log.text(), "no request within 300 ms") == 1);
  // A client that did shake hands may stay idle for longer.
  ds::TCPStore client("127.0.0.1", master.port(), -1, false, 5s);
  std::this_thread::sleep_for(500ms);
  client.set("idle", "fine");
  CHECK(master.get_string("idle") == "fine");
}

TEST_CASE("TCPStore: a client connects to a server that starts later") {
  const int port = free_port();
  std::shared_ptr<ds::TCPStore> client;
  Async connecting(
      [&] { client = std::make_shared<ds::TCPStore>("127.0.0.1", port, 2, false, 5s); });
  std::this_thread::sleep_for(300ms);
  ds::TCPStore master("127.0.0.1", port, 2, true, 5s);
  CHECK_FALSE(connecting.join());
  REQUIRE(client);
  client->set("k", "v");
  CHECK(master.get_string("k") == "v");
  client.reset();
}

TEST_CASE("TCPStore: no server within the timeout is a DistNetworkError naming host:port") {
  const int port = free_port();
  const auto t0 = Clock::now();
  const auto text = thrown_text<distrpc::DistNetworkError>(
      [&] { ds::TCPStore client("127.0.0.1", port, 2, false, 300ms); });
  CHECK(contains(text, "127.0.0.1:" + std::to_string(port)));
  CHECK(contains(text, "300 ms"));
  CHECK(contains(text, "Connection refused"));
  CHECK(since(t0) >= 290ms);
  CHECK(since(t0) < 3s);
}

TEST_CASE("TCPStore: bad constructor arguments are refused with their values") {
  CHECK(
      contains(thrown_text<distrpc::DistError>([] { ds::TCPStore s("127.0.0.1", 70000, 1, true); }),
               "port 70000"));
  CHECK(contains(thrown_text<distrpc::DistError>([] { ds::TCPStore s("127.0.0.1", 0, 1, false); }),
                 "port 0"));
  CHECK(contains(
      thrown_text<distrpc::DistError>([] { ds::TCPStore s("127.0.0.1", 0, -1, true, 1s, true); }),
      "wait_for_workers=true needs world_size > 0"));
  ds::TCPStore first("127.0.0.1", 0, 1, true, 1s);
  const auto text = thrown_text<distrpc::DistNetworkError>(
      [&] { ds::TCPStore second("127.0.0.1", first.port(), 1, true, 1s); });
  CHECK(contains(text, "cannot listen on 127.0.0.1:" + std::to_string(first.port())));
}

TEST_CASE("TCPStore: wait_for_workers=true makes the master's constructor wait for the clients") {
  SUBCASE("returns once world_size objects connected") {
    const int port = free_port();
    std::atomic<bool> constructed{false};
    std::unique_ptr<ds::TCPStore> master;
    Async hosting([&] {
      master = std::make_unique<ds::TCPStore>("127.0.0.1", port, 3, true, 5s, true);
      constructed = true;
    });
    std::this_thread::sleep_for(200ms);
    CHECK_FALSE(constructed.load());
    ds::TCPStore c1("127.0.0.1", port, 3, false, 5s);
    std::this_thread::sleep_for(200ms);
    CHECK_FALSE(constructed.load());
    ds::TCPStore c2("127.0.0.1", port, 3, false, 5s);
    CHECK_FALSE(hosting.join());
    CHECK(constructed.load());
    c2.set("x", "y");
    CHECK(master->get_string("x") == "y");
  }
  SUBCASE("times out saying how many joined") {
    const auto t0 = Clock::now();
    const auto text = thrown_text<ds::StoreTimeoutError>(
        [] { ds::TCPStore master("127.0.0.1", 0, 3, true, 300ms, true); });
    CHECK(contains(text, "Timeout after 300 ms"));
    CHECK(contains(text, "1/3 joined"));
    CHECK(since(t0) < 2s);
  }
  SUBCASE("false does not block") {
    const auto t0 = Clock::now();
    ds::TCPStore master("127.0.0.1", 0, 8, true, 5s, false);
    CHECK(since(t0) < 1s);
  }
}

TEST_CASE("TCPStore: threads sharing one object do not queue behind a blocked get") {
  ds::TCPStore master("127.0.0.1", 0, -1, true, 5s);
  ds::TCPStore shared("127.0.0.1", master.port(), -1, false, 5s);
  std::string got;
  Async getter([&] { got = shared.get_string("from the same object"); });
  std::this_thread::sleep_for(100ms);
  const auto t0 = Clock::now();
  shared.set("from the same object", "no deadlock");
  CHECK(since(t0) < 1s);
  CHECK_FALSE(getter.join());
  CHECK(got == "no deadlock");
}

TEST_CASE("TCPStore: destroying the server wakes blocked clients with an error, promptly") {
  auto master = std::make_unique<ds::TCPStore>("127.0.0.1", 0, -1, true, 30s);
  ds::TCPStore client("127.0.0.1", master->port(), -1, false, 30s);
  Clock::time_point woken;
  std::optional<std::string> error;
  {
    Async blocked([&] {
      try {
        client.get("never set");
      } catch (...) {
        woken = Clock::now();
        throw;
      }
    });
    std::this_thread::sleep_for(200ms);
    const auto t0 = Clock::now();
    master.reset();
    CHECK(since(t0) < 2s);  // the destructor does not hang
    error = blocked.join();
    CHECK(woken - t0 < 2s);
  }
  REQUIRE(error);
  CHECK(contains(*error, "lost"));
  CHECK(contains(*error, "never set"));
  // Later operations fail fast instead of waiting for a timeout.
  const auto t1 = Clock::now();
  CHECK_THROWS_AS(client.set("k", "v"), distrpc::DistNetworkError);
  CHECK(since(t1) < 1s);
}

// A worker's exit barrier adds to a store whose host may have died: the check that explains a
// closed add (is the key not a counter?) must not retry the refused connection for its 2 s grace.
TEST_CASE("TCPStore: an add after the server died fails at once, naming the loss") {
  auto master = std::make_unique<ds::TCPStore>("127.0.0.1", 0, -1, true, 30s);
  ds::TCPStore client("127.0.0.1", master->port(), -1, false, 30s);
  CHECK(client.add("exit", 1) == 1);  // a pooled connection, as a running worker has
  master.reset();
  const auto t0 = Clock::now();
  const auto text = thrown_text<distrpc::DistNetworkError>([&] { client.add("exit", 1); });
  CHECK(since(t0) < 1s);
  CHECK(contains(text, "lost"));
  CHECK(contains(text, "exit"));
}

// A connection dropped by a timed-out wait leaves the pool empty: the next operation opens a new
// one. Once the server is gone, that refused connection is a lost server, not a server that has
// not started yet: it fails at once (not after the 30 s store timeout), and so does what follows.
TEST_CASE("TCPStore: once the server was reached, a refused new connection fails at once") {
  auto master = std::make_unique<ds::TCPStore>("127.0.0.1", 0, -1, true, 30s);
  ds::TCPStore client("127.0.0.1", master->port(), -1, false, 300ms);
  CHECK_THROWS_AS(client.get("never set"), ds::StoreTimeoutError);  // drops its connection
  client.set_timeout(30s);
  master.reset();
  const auto t0 = Clock::now();
  const auto text = thrown_text<distrpc::DistNetworkError>([&] { client.set("k", "v"); });
  CHECK(since(t0) < 5s);
  CHECK(contains(text, "refused a new connection: nothing listens there any more"));
  const auto t1 = Clock::now();
  CHECK(thrown_text<distrpc::DistNetworkError>([&] { client.add("n", 1); }) == text);
  CHECK(since(t1) < 1s);
}

// ---- FileStore ---------------------------------------------------------------------------------

TEST_CASE("FileStore: a path that cannot be opened names the path and the reason") {
  const auto text =
      thrown_text<distrpc::DistStoreError>([] { ds::FileStore s("/proc/nonexistent/x"); });
  CHECK(contains(text, "/proc/nonexistent/x"));
  CHECK(contains(text, "No such file or directory"));
}

TEST_CASE("FileStore: a file that is not a store is refused, not overwritten") {
  TempDir dir;
  const auto path = dir.file("notes.txt");
  std::ofstream(path) << "my notes";
  const auto text = thrown_text<distrpc::DistStoreError>([&] { ds::FileStore s(path); });
  CHECK(contains(text, path));
  CHECK(contains(text, "is not a FileStore file"));
  std::ifstream in(path);
  std::string content;
  std::getline(in, content);
  CHECK(content == "my notes");
}

TEST_CASE("FileStore: the last of world_size objects removes the file; world_size -1 keeps it") {
  TempDir dir;
  const auto path = dir.file("cleanup");
  {
    auto a = std::make_unique<ds::FileStore>(path, 2);
    auto b = std::make_unique<ds::FileStore>(path, 2);
    a->set("k", "v");
    a.reset();
    CHECK(fs::exists(path));
    CHECK(b->get_string("k") == "v");
    b.reset();
    CHECK_FALSE(fs::exists(path));
  }
  {
    auto a = std::make_unique<ds::FileStore>(path);
    a->set("k", "v");
    a.reset();
    CHECK(fs::exists(path));
    // And a new object reads what the file holds.
    ds::FileStore again(path);
    CHECK(again.get_string("k") == "v");
  }
}

// ---- rendezvous ------------------------------------------------------------------------------

namespace {

std::string rendezvous_error(const std::string& url, int rank = 0, int world = 1) {
  return thrown_text<distrpc::DistError>([&] { ds::rendezvous(url, rank, world, 1s); });
}

}  // namespace

TEST_CASE("rendezvous: malformed URLs quote the URL and say which form is expected") {
  auto text = rendezvous_error("tcp://127.0.0.1");
  CHECK(contains(text, "malformed URL 'tcp://127.0.0.1'"));
  CHECK(contains(text, "no port"));
  CHECK(contains(text, "tcp://host:port"));
  CHECK(contains(rendezvous_error("127.0.0.1:29500"), "no scheme"));
  CHECK(contains(rendezvous_error("tcp://:29500"), "empty host"));
  text = rendezvous_error("tcp://127.0.0.1:99999");
  CHECK(contains(text, "port '99999' is not a number in 0..65535"));
  CHECK(contains(rendezvous_error("tcp://127.0.0.1:http"), "port 'http'"));
  CHECK(contains(rendezvous_error("tcp://[::1"), "IPv6"));
  text = rendezvous_error("udp://127.0.0.1:1");
  CHECK(contains(text, "unknown scheme 'udp'"));
  CHECK(contains(text, "env://"));
  CHECK(contains(rendezvous_error("file://relative/path"), "absolute path"));
  CHECK(contains(rendezvous_error("tcp://127.0.0.1:1?rank=x"), "rank='x' is not"));
  CHECK(contains(rendezvous_error("tcp://127.0.0.1:1?ranks=1"), "unknown query parameter 'ranks'"));
  CHECK(contains(rendezvous_error("env://somewhere"), "env:// takes nothing"));
}

TEST_CASE("rendezvous: rank and world size from arguments or the URL, checked") {
  CHECK(contains(rendezvous_error("tcp://127.0.0.1:1", -1, 2), "rank parameter missing"));
  CHECK(contains(rendezvous_error("tcp://127.0.0.1:1", 0, -1), "world_size missing"));
  CHECK(contains(rendezvous_error("tcp://127.0.0.1:1", 2, 2), "rank 2 is not below world_size 2"));
  CHECK(contains(rendezvous_error("tcp://127.0.0.1:1?rank=1&world_size=2", 0, 2),
                 "rank 0 given as an argument but 1 in the URL"));
  CHECK(contains(rendezvous_error("tcp://127.0.0.1:0", 1, 2), "port 0"));

  auto r = ds::rendezvous("tcp://127.0.0.1:0?rank=0&world_size=1", -1, -1, 5s);
  CHECK(r.rank == 0);
  CHECK(r.world_size == 1);
  r.store->set("k", "v");
  CHECK(r.store->get_string("k") == "v");

  TempDir dir;
  auto f = ds::rendezvous("file://" + dir.file("rdv") + "?world_size=1", 0, -1, 5s);
  CHECK(f.world_size == 1);
  REQUIRE(std::dynamic_pointer_cast<ds::FileStore>(f.store));
  f.store->set("k", "v");
  CHECK(f.store->get_string("k") == "v");
}

TEST_CASE("rendezvous: env:// names the missing or bad variable") {
  ScopedEnv env(ScopedEnv::unset, {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"});
  CHECK(contains(rendezvous_error("env://"),
                 "environment variable MASTER_ADDR expected, but not set"));
  env.set("MASTER_ADDR", "127.0.0.1");
  CHECK(contains(rendezvous_error("env://"),
                 "environment variable MASTER_PORT expected, but not set"));
  env.set("MASTER_PORT", "twelve");
  CHECK(contains(rendezvous_error("env://"), "MASTER_PORT='twelve' is not an integer"));
  env.set("MASTER_PORT", "0");
  CHECK(contains(rendezvous_error("env://", -1, 1), "environment variable RANK expected"));
  env.set("RANK", "0");
  CHECK(contains(rendezvous_error("env://", -1, -1),
                 "environment variable WORLD_SIZE expected, but not set"));
  env.set("WORLD_SIZE", "1");
  auto r = ds::rendezvous("env://", -1, -1, 5s);
  CHECK(r.rank == 0);
  CHECK(r.world_size == 1);
  auto tcp = std::dynamic_pointer_cast<ds::TCPStore>(r.store);
  REQUIRE(tcp);
  CHECK(tcp->is_master());
  r.store->set("k", "v");
  CHECK(r.store->get_string("k") == "v");
}

TEST_CASE(
    "rendezvous: env:// under torchrun's agent store joins it as a client, under its prefix") {
  // The store torchrun's elastic agent hosts (played here by ours: the protocol is c10d's).
  ds::TCPStore agent("127.0.0.1", 0, -1, true, 10s);
  ScopedEnv env;
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("MASTER_PORT", std::to_string(agent.port()).c_str());
  env.set("RANK", nullptr);
  env.set("WORLD_SIZE", nullptr);
  env.set("TORCHELASTIC_RESTART_COUNT", "3");
  for (const char* flag : {"True", "1"}) {
    INFO("TORCHELASTIC_USE_AGENT_STORE=" << flag);
    env.set("TORCHELASTIC_USE_AGENT_STORE", flag);
    // Rank 0 too is a client: hosting would fail, the port being the agent's.
    auto r0 = ds::rendezvous("env://", 0, 2, 5s);
    auto r1 = ds::rendezvous("env://", 1, 2, 5s);
    CHECK(r0.rank == 0);
    CHECK(r1.rank == 1);
    CHECK(std::dynamic_pointer_cast<ds::PrefixStore>(r0.store));
    r0.store->set(std::string("from rank 0 ") + flag, "x");
    CHECK(r1.store->get_string(std::string("from rank 0 ") + flag) == "x");
    // PyTorch's env:// rendezvous keys: PrefixStore("/worker/attempt_<restarts>") over TCPStore.
    CHECK(agent.get_string(std::string("/worker/attempt_3/from rank 0 ") + flag) == "x");
  }
  env.set("TORCHELASTIC_USE_AGENT_STORE", "False");
  CHECK(contains(rendezvous_error("env://", 0, 2), "cannot listen on 127.0.0.1:"));
  env.set("TORCHELASTIC_USE_AGENT_STORE", "True");
  env.set("TORCHELASTIC_RESTART_COUNT", nullptr);
  CHECK(contains(rendezvous_error("env://", 0, 2),
                 "environment variable TORCHELASTIC_RESTART_COUNT expected, but not set"));
  env.set("TORCHELASTIC_RESTART_COUNT", "x");
  CHECK(contains(rendezvous_error("env://", 0, 2),
                 "TORCHELASTIC_RESTART_COUNT='x' is not an integer"));
}

TEST_CASE("rendezvous: env:// reads what torchrun, mpirun or srun set, in that order") {
  ScopedEnv env(
      ScopedEnv::unset,
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
       "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"});
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("MASTER_PORT", "0");  // rank 0 hosts the store on a free port

  SUBCASE("none set: the error names every variable it tried") {
    CHECK(contains(rendezvous_error("env://", -1, -1),
                   "environment variable RANK expected, but not set (nor OMPI_COMM_WORLD_RANK "
                   "or SLURM_PROCID, as mpirun and srun set)"));
    env.set("RANK", "0");
    CHECK(contains(rendezvous_error("env://", -1, -1),
                   "environment variable WORLD_SIZE expected, but not set (nor "
                   "OMPI_COMM_WORLD_SIZE or SLURM_NTASKS, as mpirun and srun set)"));
  }
  SUBCASE("SLURM: srun's variables") {
    env.set("SLURM_PROCID", "0");
    env.set("SLURM_NTASKS", "1");
    env.set("SLURM_LOCALID", "0");
    env.set("SLURM_NTASKS_PER_NODE", "1");
    auto r = ds::rendezvous("env://", -1, -1, 5s);
    CHECK(r.rank == 0);
    CHECK(r.world_size == 1);
    CHECK(r.local_rank == 0);
    CHECK(r.local_world_size == 1);
  }
  SUBCASE("Open MPI: mpirun's variables") {
    env.set("OMPI_COMM_WORLD_RANK", "0");
    env.set("OMPI_COMM_WORLD_SIZE", "1");
    env.set("OMPI_COMM_WORLD_LOCAL_RANK", "0");
    env.set("OMPI_COMM_WORLD_LOCAL_SIZE", "1");
    auto r = ds::rendezvous("env://", -1, -1, 5s);
    CHECK(r.rank == 0);
    CHECK(r.world_size == 1);
    CHECK(r.local_rank == 0);
    CHECK(r.local_world_size == 1);
    // mpirun inside a SLURM allocation: every process inherits the batch step's SLURM values;
    // mpirun's own are the ones that tell the processes apart.
    env.set("SLURM_PROCID", "0");
    env.set("SLURM_NTASKS", "8");
    env.set("SLURM_LOCALID", "0");
    env.set("SLURM_NTASKS_PER_NODE", "8");
    env.set("OMPI_COMM_WORLD_RANK", "5");  // refused before any store is made: shows the source
    env.set("OMPI_COMM_WORLD_SIZE", "4");
    CHECK(contains(rendezvous_error("env://", -1, -1), "rank 5 is not below world_size 4"));
    env.set("OMPI_COMM_WORLD_RANK", "2");
    env.set("OMPI_COMM_WORLD_LOCAL_RANK", "3");
    env.set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
    CHECK(contains(rendezvous_error("env://", -1, -1),
                   "local rank 3 is not below the local world size 2"));
  }
  SUBCASE("torchrun's names come first; local values are optional") {
    env.set("RANK", "0");
    env.set("WORLD_SIZE", "1");
    env.set("SLURM_PROCID", "5");  // a job step inside an allocation: torchrun's names win
    env.set("SLURM_NTASKS", "9");
    auto r = ds::rendezvous("env://", -1, -1, 5s);
    CHECK(r.rank == 0);
    CHECK(r.world_size == 1);
    CHECK(r.local_rank == -1);
    CHECK(r.local_world_size == -1);
    env.set("LOCAL_RANK", "3");
    env.set("LOCAL_WORLD_SIZE", "2");
    CHECK(contains(rendezvous_error("env://"),
                   "rendezvous 'env://': local rank 3 is not below the local world size 2"));
    env.set("LOCAL_RANK", "one");
    CHECK(contains(rendezvous_error("env://"), "LOCAL_RANK='one' is not an integer"));
  }
}

TEST_CASE("finalize_rendezvous: rank 0 waits for every rank, and times out saying how many") {
  auto hash = std::make_shared<ds::HashStore>();
  std::atomic<bool> rank0_done{false};
  Async rank0([&] {
    ds::finalize_rendezvous(*hash, 0, 3, 5s);
    rank0_done = true;
  });
  ds::finalize_rendezvous(*hash, 1, 3, 5s);
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(rank0_done.load());
  ds::finalize_rendezvous(*hash, 2, 3, 5s);
  CHECK_FALSE(rank0.join());
  CHECK(rank0_done.load());

  ds::HashStore alone;
  const auto text = thrown_text<ds::StoreTimeoutError>(
      [&] { ds::finalize_rendezvous(alone, 0, 2, 100ms, "lonely"); });
  CHECK(contains(text, "Timeout after 100 ms"));
  CHECK(contains(text, "1 done"));
}

TEST_CASE("log: set_log_sink receives a store's diagnostic; an empty sink restores stderr") {
  ds::TCPStore master("127.0.0.1", 0, -1, true, 10s);
  const int port = master.port();
  struct Line {
    distrpc::LogLevel level;
    std::string who, text;
  };
  std::mutex mu;
  std::vector<Line> lines;
  // Restores the default even when a check below throws: the sink refers to this test's locals.
  struct ResetSink {
    ~ResetSink() { distrpc::set_log_sink(nullptr); }
  } reset;
  distrpc::set_log_sink([&](distrpc::LogLevel level, std::string_view who, std::string_view text) {
    std::lock_guard<std::mutex> lk(mu);
    lines.push_back({level, std::string(who), std::string(text)});
  });
  const std::string who = "TCPStore server 127.0.0.1:" + std::to_string(port);
  const auto hostile_connection = [&] {
    RawSocket raw(port);
    raw.send(std::vector<std::uint8_t>{0x7f});
    CHECK(raw.closed_by_peer());  // the server logs before it closes
  };

  StderrCapture err;
  hostile_connection();
  {
    std::lock_guard<std::mutex> lk(mu);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].level == distrpc::LogLevel::warning);
    CHECK(lines[0].who == who);
    CHECK(lines[0].text.rfind("closing the connection from 127.0.0.1:", 0) == 0);
    CHECK(count_of(lines[0].text, "unknown query type 0x7f") == 1);
    CHECK(lines[0].text.find('\n') == std::string::npos);
  }
  CHECK(count_of(err.text(), "unknown query type") == 0);  // the sink took it instead of stderr

  distrpc::set_log_sink(nullptr);
  hostile_connection();
  CHECK(count_of(err.text(), "[distrpc] " + who + ": closing the connection from 127.0.0.1:") == 1);
  CHECK(count_of(err.text(), "unknown query type 0x7f") == 1);
  std::lock_guard<std::mutex> lk(mu);
  CHECK(lines.size() == 1);  // the sink set before got nothing more
}

TEST_CASE("TCPStore: a PyTorch 2.x client (VALIDATE, new numbering, PING, CANCEL_WAIT, MULTI_*)") {
  // The bytes a PyTorch >= 2.2 TCPStore client sends, written from the protocol description.
  constexpr std::uint8_t kV2Set = 1, kV2Get = 3, kV2Add = 4, kV2Check = 5, kV2Wait = 6,
                         kV2NumKeys = 7, kV2Delete = 8, kV2Append = 9, kV2MultiGet = 10,
                         kV2MultiSet = 11, kV2CancelWait = 12, kV2Ping = 13;
  ds::TCPStore master("127.0.0.1", 0, -1, true, 10s);
  StderrCapture log;
  RawSocket raw(master.port());
  std::vector<std::uint8_t> q = {0, 0xce, 0xf7, 0x85, 0x3c};  // VALIDATE, magic 0x3C85F7CE
  q.push_back(kV2Ping);
  append(q, {0x78, 0x56, 0x34, 0x12});
  raw.send(q);
  auto r = raw.reply(4);
  REQUIRE(r);
  CHECK(*r == std::vector<std::uint8_t>{0x78, 0x56, 0x34, 0x12});  // the nonce, echoed

  q = {kV2Set};
  append(q, str_field("/a"));
  append(q, str_field("1"));
  q.push_back(kV2MultiSet);
  append(q, le64(2));
  append(q, str_field("/b"));
  append(q, str_field("2"));
  append(q, str_field("/c"));
  append(q, str_field("3"));
  q.push_back(kV2Append);
  append(q, str_field("/a"));
  append(q, str_field("+more"));
  q.push_back(kV2Add);
  append(q, str_field("/n"));
  append(q, le64(41));
  raw.send(q);
  r = raw.reply(8);
  REQUIRE(r);
  CHECK(*r == le64(41));
  CHECK(master.get_string("a") == "1+more");
  CHECK(master.get_string("b") == "2");
  CHECK(master.add("n", 1) == 42);

  q = {kV2MultiGet};
  append(q, le64(2));
  append(q, str_field("/c"));
  append(q, str_field("/a"));
  raw.send(q);
  r = raw.reply(8 + 1 + 8 + 6);
  REQUIRE(r);
  std::vector<std::uint8_t> expected = str_field("3");
  append(expected, str_field("1+more"));
  CHECK(*r == expected);

  q = {kV2Check};
  append(q, le64(2));
  append(q, str_field("/a"));
  append(q, str_field("/zz"));
  q.push_back(kV2NumKeys);
  q.push_back(kV2Delete);
  append(q, str_field("/c"));
  q.push_back(kV2Get);
  append(q, str_field("/b"));
  raw.send(q);
  r = raw.reply(1 + 8 + 8 + 9);
  REQUIRE(r);
  expected = {1};  // NOT_READY
  append(expected, le64(4));
  append(expected, le64(1));
  append(expected, str_field("2"));
  CHECK(*r == expected);

  // A wait that the client cancels after its timeout: WAIT_CANCELED, and nothing stale later.
  q = {kV2Wait};
  append(q, le64(1));
  append(q, str_field("/late"));
  raw.send(q);
  CHECK_FALSE(raw.reply(1, 100ms));
  raw.send(std::vector<std::uint8_t>{kV2CancelWait});
  r = raw.reply(1);
  REQUIRE(r);
  CHECK((*r)[0] == 1);  // WAIT_CANCELED
  master.set("late", "x");
  CHECK_FALSE(raw.reply(1, 200ms));
  // A wait answered when the key appears: STOP_WAITING.
  q = {kV2Wait};
  append(q, le64(1));
  append(q, str_field("/later"));
  raw.send(q);
  std::this_thread::sleep_for(50ms);
  master.set("later", "y");
  r = raw.reply(1);
  REQUIRE(r);
  CHECK((*r)[0] == 0);  // STOP_WAITING
  CHECK(count_of(log.text(), "closing the connection") == 0);
}

TEST_CASE("TCPStore: requests that arrive in pieces cut anywhere are read whole") {
  // Numbered as after VALIDATE (PyTorch >= 2.2).
  constexpr std::uint8_t kV2CompareSet = 2, kV2MultiSet = 11;
  ds::TCPStore master("127.0.0.1", 0, -1, true, 10s);
  StderrCapture log;
  const std::string big_old(100000, 'o'), big_new(100000, 'n');
  master.set("big", big_old);
  std::vector<std::uint8_t> q = {0, 0xce, 0xf7, 0x85, 0x3c};  // VALIDATE, magic 0x3C85F7CE
  q.push_back(kV2MultiSet);
  append(q, le64(40));
  const auto value_of = [](int i) {
    return std::string(static_cast<std::size_t>(i) * 7, 'a' + i % 26);
  };
  for (int i = 0; i < 40; ++i) {
    append(q, str_field("/k" + std::to_string(i)));
    append(q, str_field(value_of(i)));
  }
  q.push_back(kV2CompareSet);
  append(q, str_field("/big"));
  append(q, str_field(big_old));
  append(q, str_field(big_new));
  // Pieces of 1 to 13 bytes (cutting length fields too), with a pause now and then so that the
  // server reads them apart.
  RawSocket raw(master.port());
  std::size_t at = 0;
  for (int n = 0; at < q.size(); ++n) {
    const std::size_t len = std::min<std::size_t>(q.size() - at, 1 + (n * 7) % 13);
    raw.send(std::vector<std::uint8_t>(q.begin() + static_cast<std::ptrdiff_t>(at),
                                       q.begin() + static_cast<std::ptrdiff_t>(at + len)));
    at += len;
    if (n % 400 == 0) std::this_thread::sleep_for(1ms);
  }
  const auto r = raw.reply(8 + big_new.size());  // compare_set answers with the value now
  REQUIRE(r);
  CHECK(*r == str_field(big_new));
  CHECK(master.get_string("big") == big_new);
  for (int i = 0; i < 40; ++i) CHECK(master.get_string("k" + std::to_string(i)) == value_of(i));
  CHECK(count_of(log.text(), "closing the connection") == 0);
}

TEST_CASE("TCPStore: random bytes never take the server down") {
  ds::TCPStore master("127.0.0.1", 0, -1, true, 10s);
  master.set("kept", "value");
  // Deterministic: a failure reproduces.
  std::uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  StderrCapture log;  // the closings are logged; keep them out of the test output
  for (int round = 0; round < 200; ++round) {
    RawSocket raw(master.port());
    std::vector<std::uint8_t> bytes(1 + next() % 64);
    for (auto& b : bytes) b = static_cast<std::uint8_t>(next());
    // Sometimes a valid query type first, so the parser goes past the first byte.
    bytes[0] = static_cast<std::uint8_t>(bytes[0] % 16);
    raw.send(bytes);
    raw.close();
  }
  // Still serving, with its data intact.
  ds::TCPStore client("127.0.0.1", master.port(), -1, false, 5s);
  CHECK(client.get_string("kept") == "value");
  client.set("after", "fuzz");
  CHECK(master.get_string("after") == "fuzz");
}

TEST_CASE("TCPStore: a PyTorch 2.x client that puts the magic number before every query") {
  ds::TCPStore master("127.0.0.1", 0, -1, true, 10s);
  master.set("k", "v");
  StderrCapture log;
  const std::vector<std::uint8_t> magic = {0xce, 0xf7, 0x85, 0x3c};
  RawSocket raw(master.port());
  std::vector<std::uint8_t> q = magic;
  q.push_back(3);  // GET, numbered as after VALIDATE
  append(q, str_field("/k"));
  append(q, magic);
  q.push_back(7);  // GETNUMKEYS
  raw.send(q);
  auto r = raw.reply(9 + 8);
  REQUIRE(r);
  std::vector<std::uint8_t> expected = str_field("v");
  append(expected, le64(1));
  CHECK(*r == expected);
  // A query without the prefix on such a connection closes it.
  raw.send(std::vector<std::uint8_t>{7, 0, 0, 0});
  CHECK(raw.closed_by_peer());
  CHECK(count_of(log.text(), "a request without the magic number prefix") == 1);
}

// ---- authentication (docs/security.md) -----------------------------------------------------

namespace {

constexpr const char* kSecret = "correct horse battery staple";

ds::TCPStoreOptions auth_options(int port, bool master, const std::string& secret) {
  ds::TCPStoreOptions o;
  o.port = port;
  o.is_master = master;
  o.timeout = 5s;
  o.auth_secret = secret;
  return o;
}

// Every diagnostic written while alive (a user sink: whatever the default routing is).
class LogLines {
 public:
  LogLines() {
    distrpc::set_log_sink([this](distrpc::LogLevel, std::string_view who, std::string_view text) {
      std::lock_guard<std::mutex> lk(mu_);
      lines_.push_back(std::string(who) + ": " + std::string(text));
    });
  }
  ~LogLines() { distrpc::set_log_sink(nullptr); }
  // Waits up to 2 s for a line containing `part`; returns it ("" if none came).
  std::string wait_for(const std::string& part) {
    const auto t0 = Clock::now();
    while (since(t0) < 2s) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        for (const auto& l : lines_) {
          if (contains(l, part)) return l;
        }
      }
      std::this_thread::sleep_for(10ms);
    }
    return "";
  }
  std::string all() {
    std::lock_guard<std::mutex> lk(mu_);
    std::string out;
    for (const auto& l : lines_) out += l + "\n";
    return out;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// A client's challenge as tcp_store_protocol.hpp describes it: 0xa7, u32 "AUTH", its nonce.
std::vector<std::uint8_t> store_challenge(const distrpc::wire::auth::Nonce& nonce) {
  std::vector<std::uint8_t> out{0xa7, 0x41, 0x55, 0x54, 0x48};
  out.insert(out.end(), nonce.begin(), nonce.end());
  return out;
}

// The process environment's secret variables, cleared while alive and restored after.
struct NoSecretEnv : ScopedEnv {
  NoSecretEnv()
      : ScopedEnv(unset, {distrpc::wire::auth::kSecretEnv, distrpc::wire::auth::kSecretFileEnv}) {}
};

}  // namespace

TEST_CASE("TCPStore auth: the right secret connects, a wrong or missing one is refused") {
  NoSecretEnv env;
  LogLines log;
  ds::TCPStore master(auth_options(0, true, kSecret));
  const int port = master.port();
  const std::string where = "127.0.0.1:" + std::to_string(port);
  ds::TCPStore good(auth_options(port, false, kSecret));
  good.set("k", "v");
  CHECK(master.get_string("k") == "v");

  SUBCASE("a wrong secret") {
    const auto text = thrown_text<distrpc::DistNetworkError>(
        [&] { ds::TCPStore bad(auth_options(port, false, "guess")); });
    CHECK(text == "TCPStore: authentication with the server at " + where +
                      " failed: it answered our challenge with a wrong proof (a different shared "
                      "secret, or a replayed answer)");
  }
  SUBCASE("no secret: the server drops it before serving anything") {
    const auto text = thrown_text<distrpc::DistNetworkError>(
        [&] { ds::TCPStore bad(auth_options(port, false, "")); });
    CHECK(text == "TCPStore: the connection to the server at " + where +
                      " was lost during the first request: the server closed the connection (a "
                      "server with a shared secret refuses a client without one, and a server "
                      "with TLS a client without TLS: see the server's log)");
    const std::string line = log.wait_for("without authenticating");
    CHECK(contains(line, "closing the connection from 127.0.0.1:"));
    CHECK(contains(line,
                   "authentication failed: the client sent query type 0x04 without "
                   "authenticating (it has no shared secret configured, and this server "
                   "requires one)"));
    // A raw client that writes without authenticating changes nothing.
    RawSocket raw(port);
    std::vector<std::uint8_t> set{kQSet};
    append(set, str_field("/k"));
    append(set, str_field("overwritten"));
    raw.send(set);
    CHECK(raw.closed_by_peer());
    CHECK(master.get_string("k") == "v");
  }
  SUBCASE("a secret on the client only") {
    ds::TCPStore open_master("127.0.0.1", 0, -1, true, 5s);
    const std::string open_where = "127.0.0.1:" + std::to_string(open_master.port());
    const auto text = thrown_text<distrpc::DistNetworkError>(
        [&] { ds::TCPStore bad(auth_options(open_master.port(), false, kSecret)); });
    CHECK(text == "TCPStore: authentication with the server at " + open_where +
                      " failed: it has no shared secret configured, and this client has one");
  }
  CHECK(good.get_string("k") == "v");  // the good client is unaffected throughout
  CHECK_FALSE(contains(log.all(), kSecret));
}

TEST_CASE("TCPStore auth: an answer replayed on a new connection is refused") {
  NoSecretEnv env;
  LogLines log;
  namespace auth = distrpc::wire::auth;
  ds::TCPStore master(auth_options(0, true, kSecret));
  master.set("k", "v");
  const auth::Party client{"TCPStore client", -1}, server{"TCPStore server", -1};
  const auth::Nonce nonce = auth::make_nonce();

  // A first connection, authenticated properly: its answer is recorded.
  RawSocket first(master.port());
  first.send(store_challenge(nonce));
  auto challenge = first.reply(1 + 32 + 32);
  REQUIRE(challenge);
  REQUIRE((*challenge)[0] == 1);
  auth::Nonce server_nonce{};
  std::memcpy(server_nonce.data(), challenge->data() + 1, 32);
  const auth::Proof recorded =
      auth::compute_proof(kSecret, auth::Prover::kDialler, nonce, server_nonce, client, server);
  first.send(std::vector<std::uint8_t>(recorded.begin(), recorded.end()));
  auto accepted = first.reply(1);
  REQUIRE(accepted);
  CHECK((*accepted)[0] == 1);
  std::vector<std::uint8_t> check{kQCheck};
  append(check, le64(0));
  first.send(check);
  auto ready = first.reply(1);
  REQUIRE(ready);
  CHECK((*ready)[0] == 0);  // served once authenticated

  // The same challenge and the recorded answer on a second connection: the server's nonce is new.
  RawSocket second(master.port());
  second.send(store_challenge(nonce));
  auto challenge2 = second.reply(1 + 32 + 32);
  REQUIRE(challenge2);
  CHECK(std::memcmp(challenge2->data() + 1, server_nonce.data(), 32) != 0);
  second.send(std::vector<std::uint8_t>(recorded.begin(), recorded.end()));
  CHECK(second.closed_by_peer());
  CHECK(contains(log.wait_for("wrong proof"),
                 "authentication failed: the client answered our challenge with a wrong proof (a "
                 "different shared secret, or a replayed answer)"));
  CHECK_FALSE(contains(log.all(), kSecret));
}

TEST_CASE("TCPStore auth: the secret never travels; a server without it is found out") {
  NoSecretEnv env;
  // A raw socket acting as the server: it records what the client sends and answers the
  // challenge with a made-up proof.
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(lfd, 4) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int port = ntohs(a.sin_port);
  std::string received;
  Async fake([&] {
    const int fd = ::accept(lfd, nullptr, nullptr);
    char buf[4096];
    while (received.size() < 37) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      received.append(buf, static_cast<std::size_t>(n));
    }
    std::string reply(1 + 32 + 32, '\x11');
    reply[0] = 1;
    (void)::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
    for (;;) {  // whatever else comes, until the client hangs up
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      received.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fd);
  });
  const auto text = thrown_text<distrpc::DistNetworkError>(
      [&] { ds::TCPStore client(auth_options(port, false, kSecret)); });
  fake.join();
  ::close(lfd);
  CHECK(text == "TCPStore: authentication with the server at 127.0.0.1:" + std::to_string(port) +
                    " failed: it answered our challenge with a wrong proof (a different shared "
                    "secret, or a replayed answer)");
  CHECK(received.size() == 37);  // the challenge only: no answer to a server that failed its own
  CHECK(static_cast<std::uint8_t>(received[0]) == 0xa7);
  CHECK(received.find(kSecret) == std::string::npos);
  CHECK_FALSE(contains(text, kSecret));
}

TEST_CASE("auth: the secret comes from the option, else a file, else the environment") {
  NoSecretEnv env;
  namespace auth = distrpc::wire::auth;
  TempDir dir;
  const std::string file = dir.file("secret");
  {
    std::ofstream out(file);
    out << "from-file\n";
  }
  ::chmod(file.c_str(), 0600);
  const std::string env_file = dir.file("env-secret");
  {
    std::ofstream out(env_file);
    out << "from-env-file";
  }
  ::chmod(env_file.c_str(), 0400);

  CHECK_FALSE(auth::resolve_secret("", "").has_value());
  ::setenv(auth::kSecretEnv, "from-env", 1);
  CHECK(auth::resolve_secret("", "") == std::optional<std::string>("from-env"));
  ::setenv(auth::kSecretFileEnv, env_file.c_str(), 1);
  CHECK(auth::resolve_secret("", "") == std::optional<std::string>("from-env-file"));
  CHECK(auth::resolve_secret("", file) == std::optional<std::string>("from-file"));  // newline cut
  CHECK(auth::resolve_secret("from-option", file) == std::optional<std::string>("from-option"));

  ::chmod(file.c_str(), 0644);
  CHECK(thrown_text<distrpc::DistError>([&] { auth::resolve_secret("", file); }) ==
        "authentication: the secret file '" + file +
            "' (from the options) has mode 0644, open to group or others: make it private "
            "(chmod 600)");
  {
    std::ofstream out(file, std::ios::trunc);
    out << "\n";
  }
  ::chmod(file.c_str(), 0600);
  CHECK(thrown_text<distrpc::DistError>([&] { auth::resolve_secret("", file); }) ==
        "authentication: the secret file '" + file + "' (from the options) is empty");
  const std::string missing = dir.file("missing");
  CHECK(thrown_text<distrpc::DistError>([&] { auth::resolve_secret("", missing); }) ==
        "authentication: cannot read the secret file '" + missing +
            "' (from the options): No such file or directory");

  // A store takes its secret the same way: here from the environment on both sides.
  ::unsetenv(auth::kSecretFileEnv);
  ds::TCPStore master("127.0.0.1", 0, -1, true, 5s);
  ds::TCPStore client("127.0.0.1", master.port(), -1, false, 5s);
  client.set("k", "v");
  CHECK(master.get_string("k") == "v");
  ::unsetenv(auth::kSecretEnv);
  const auto text = thrown_text<distrpc::DistNetworkError>(
      [&] { ds::TCPStore bare("127.0.0.1", master.port(), -1, false, 5s); });
  CHECK(contains(text, "a server with a shared secret refuses a client without one"));
}

TEST_CASE("auth: the rendezvous store takes the secret it is given, on both URL forms") {
  NoSecretEnv env;
  auto r = ds::rendezvous("tcp://127.0.0.1:0?rank=0&world_size=1", -1, -1, 5s, kSecret);
  const int port = static_cast<ds::TCPStore&>(*r.store).port();
  r.store->set("addr/worker1", "10.0.0.7:29500");
  ds::TCPStore peer(auth_options(port, false, kSecret));
  CHECK(peer.get_string("addr/worker1") == "10.0.0.7:29500");
  // Without the secret nobody reads or rewrites the workers' addresses.
  const auto text = thrown_text<distrpc::DistNetworkError>(
      [&] { ds::TCPStore bare(auth_options(port, false, "")); });
  CHECK(contains(text, "a server with a shared secret refuses a client without one"));
  const auto wrong = thrown_text<distrpc::DistNetworkError>(
      [&] { ds::TCPStore bad(auth_options(port, false, "guess")); });
  CHECK(contains(wrong, "failed: it answered our challenge with a wrong proof"));

  // env:// joins as a client with the same secret.
  ScopedEnv vars;
  vars.set("MASTER_ADDR", "127.0.0.1");
  vars.set("MASTER_PORT", std::to_string(port).c_str());
  vars.set("TORCHELASTIC_USE_AGENT_STORE", nullptr);
  auto joined = ds::rendezvous("env://", 1, 2, 5s, kSecret);
  CHECK(joined.store->get_string("addr/worker1") == "10.0.0.7:29500");
  const auto env_text =
      thrown_text<distrpc::DistNetworkError>([&] { ds::rendezvous("env://", 1, 2, 5s, "guess"); });
  CHECK(contains(env_text, "failed: it answered our challenge with a wrong proof"));
}

// ---- TLS (docs/security.md, "TLS") -------------------------------------------------------------

namespace {

// The process environment's TLS variables, cleared while alive and restored after.
struct NoTlsEnv : ScopedEnv {
  NoTlsEnv()
      : ScopedEnv(unset, {distrpc::net::tls::kCertEnv, distrpc::net::tls::kKeyEnv,
                          distrpc::net::tls::kCaEnv}) {}
};

ds::TCPStoreOptions tls_options(int port, bool master, const distrpc::TlsOptions& tls,
                                std::chrono::milliseconds timeout = 5s) {
  ds::TCPStoreOptions o;
  o.port = port;
  o.is_master = master;
  o.timeout = timeout;
  o.tls = tls;
  return o;
}

}  // namespace

TEST_CASE("TCPStore TLS: set, get, wait and add over mutual TLS, with a shared secret inside it") {
  NoTlsEnv env;
  NoSecretEnv no_secret;
  const auto& certs = distrpc::testing::tls_files();
  auto mo = tls_options(0, true, certs.server);
  mo.auth_secret = kSecret;
  ds::TCPStore master(mo);
  auto co = tls_options(master.port(), false, certs.client);
  co.auth_secret = kSecret;
  ds::TCPStore client(co);

  client.set("k", "v");
  CHECK(master.get_string("k") == "v");
  // A big value crosses many TLS records.
  std::string big(3 << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + 7);
  master.set("big", big);
  CHECK(client.get_string("big") == big);
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    master.set("late", "here");
  });
  client.wait({"late"}, 5s);
  later.join();
  CHECK(client.get_string("late") == "here");
  CHECK(client.add("n", 5) == 5);
  CHECK(master.add("n", 2) == 7);
  CHECK(client.add("n", 0) == 7);
  // The server closes a refused add's connection; the client reads why on a side connection,
  // under TLS too, and stays usable.
  master.set("text", "abc");
  const auto refused = thrown_text<distrpc::DistStoreError>([&] { client.add("text", 1); });
  CHECK_MESSAGE(contains(refused, "not a 64-bit decimal integer"), refused);
  CHECK(client.get_string("text") == "abc");
  CHECK(client.add("n", 1) == 8);
  // A timed-out wait for several keys names the missing one (asked on a side connection).
  const auto waited = thrown_text<ds::StoreTimeoutError>([&] {
    client.wait({"n", "absent"}, 300ms);
  });
  CHECK_MESSAGE(contains(waited, "(missing ['absent'"), waited);
}

TEST_CASE("TCPStore TLS: a certificate from another CA is refused, on either side") {
  NoTlsEnv env;
  const auto& certs = distrpc::testing::tls_files();
  SUBCASE("a client with a rogue certificate") {
    LogLines log;
    ds::TCPStore master(tls_options(0, true, certs.server));
    const std::string where = "127.0.0.1:" + std::to_string(master.port());
    const auto text = thrown_text<distrpc::DistNetworkError>(
        [&] { ds::TCPStore rogue(tls_options(master.port(), false, certs.rogue)); });
    CHECK(text == "TCPStore: TLS handshake with " + where + " failed: tlsv1 alert unknown ca");
    const std::string line = log.wait_for("TLS handshake failed");
    CHECK(contains(line, "closing the connection from 127.0.0.1:"));
    CHECK(contains(line, "TLS handshake failed: certificate verify failed"));
    // The server serves the good client as before.
    ds::TCPStore good(tls_options(master.port(), false, certs.client));
    good.set("k", "v");
    CHECK(master.get_string("k") == "v");
  }
  SUBCASE("a server with a rogue certificate") {
    ds::TCPStore master(tls_options(0, true, certs.rogue));
    const std::string where = "127.0.0.1:" + std::to_string(master.port());
    const auto text = thrown_text<distrpc::DistNetworkError>(
        [&] { ds::TCPStore client(tls_options(master.port(), false, certs.client)); });
    CHECK(text == "TCPStore: TLS handshake with " + where +
                      " failed: certificate verify failed (self-signed certificate in "
                      "certificate chain)");
  }
}

TEST_CASE("TCPStore TLS: TLS on one side only fails cleanly, well within the timeout") {
  NoTlsEnv env;
  const auto& certs = distrpc::testing::tls_files();
  SUBCASE("a plain client, a TLS server") {
    LogLines log;
    ds::TCPStore master(tls_options(0, true, certs.server));
    const std::string where = "127.0.0.1:" + std::to_string(master.port());
    const auto t0 = Clock::now();
    const auto text = thrown_text<distrpc::DistNetworkError>(
        [&] { ds::TCPStore plain("127.0.0.1", master.port(), -1, false, 10s); });
    CHECK(since(t0) < 3s);
    CHECK(text == "TCPStore: the connection to the server at " + where +
                      " was lost during the first request: the server closed the connection (a "
                      "server with a shared secret refuses a client without one, and a server "
                      "with TLS a client without TLS: see the server's log)");
    CHECK(contains(log.wait_for("TLS handshake failed"), "closing the connection from 127.0.0.1:"));
  }
  SUBCASE("a TLS client, a plain server") {
    ds::TCPStore master("127.0.0.1", 0, -1, true, 5s);
    const std::string where = "127.0.0.1:" + std::to_string(master.port());
    const auto t0 = Clock::now();
    const auto text = thrown_text<distrpc::DistNetworkError>(
        [&] { ds::TCPStore tls(tls_options(master.port(), false, certs.client, 10s)); });
    CHECK(since(t0) < 3s);
    CHECK(text == "TCPStore: TLS handshake with " + where +
                      " failed: the server closed the connection (does it have TLS configured?)");
  }
}

TEST_CASE("TCPStore TLS: the rendezvous store takes the TLS files it is given") {
  NoTlsEnv env;
  NoSecretEnv no_secret;
  const auto& certs = distrpc::testing::tls_files();
  auto r = ds::rendezvous("tcp://127.0.0.1:0?rank=0&world_size=1", -1, -1, 5s, "", certs.server);
  const int port = static_cast<ds::TCPStore&>(*r.store).port();
  r.store->set("addr/worker1", "10.0.0.7:29500");
  ds::TCPStore member(tls_options(port, false, certs.client));
  CHECK(member.get_string("addr/worker1") == "10.0.0.7:29500");
  CHECK(contains(thrown_text<distrpc::DistNetworkError>(
                     [&] { ds::TCPStore plain("127.0.0.1", port, -1, false, 5s); }),
                 "a server with TLS a client without TLS"));
}

TEST_CASE("TCPStore TLS: a missing file or a partial setting is named; the environment works") {
  NoTlsEnv env;
  const auto& certs = distrpc::testing::tls_files();
  distrpc::TlsOptions missing = certs.server;
  missing.ca_file = certs.dir + "/no-such-ca.pem";
  CHECK(thrown_text<distrpc::DistError>([&] { ds::TCPStore s(tls_options(0, true, missing)); }) ==
        "TLS: cannot read the CA file '" + missing.ca_file + "': No such file or directory");
  missing = certs.client;
  missing.key_file = certs.dir + "/no-such.key";
  CHECK(thrown_text<distrpc::DistError>([&] { ds::TCPStore s(tls_options(0, true, missing)); }) ==
        "TLS: cannot read the private key file '" + missing.key_file +
            "': No such file or directory");
  distrpc::TlsOptions crossed = certs.client;
  crossed.key_file = certs.server.key_file;
  CHECK(contains(
      thrown_text<distrpc::DistError>([&] { ds::TCPStore s(tls_options(0, true, crossed)); }),
      "TLS: the private key file '" + crossed.key_file + "' does not match the certificate file '" +
          crossed.cert_file + "'"));
  distrpc::TlsOptions partial;
  partial.cert_file = certs.client.cert_file;
  CHECK(thrown_text<distrpc::DistError>([&] { ds::TCPStore s(tls_options(0, true, partial)); }) ==
        "TLS: TlsOptions::key_file is not set, but other TLS settings are: a certificate, its key "
        "and a CA file are all needed (TlsOptions)");

  // The variables alone turn TLS on: a plain store object (options left empty) speaks TLS.
  ::setenv(distrpc::net::tls::kCertEnv, certs.server.cert_file.c_str(), 1);
  ::setenv(distrpc::net::tls::kKeyEnv, certs.server.key_file.c_str(), 1);
  CHECK(thrown_text<distrpc::DistError>([&] { ds::TCPStore s("127.0.0.1", 0, -1, true, 5s); }) ==
        "TLS: DISTRPC_TLS_CA is not set, but other TLS settings are: a certificate, its key and a "
        "CA file are all needed (the environment)");
  ::setenv(distrpc::net::tls::kCaEnv, certs.server.ca_file.c_str(), 1);
  ds::TCPStore master("127.0.0.1", 0, -1, true, 5s);
  ds::TCPStore client("127.0.0.1", master.port(), -1, false, 5s);
  client.set("k", "v");
  CHECK(master.get_string("k") == "v");
  // Options given in code win over the environment: a rogue certificate is refused.
  CHECK(contains(thrown_text<distrpc::DistNetworkError>(
                     [&] { ds::TCPStore rogue(tls_options(master.port(), false, certs.rogue)); }),
                 "TLS handshake with"));
  for (const char* v :
       {distrpc::net::tls::kCertEnv, distrpc::net::tls::kKeyEnv, distrpc::net::tls::kCaEnv}) {
    ::unsetenv(v);
  }
  // Without them, a plain client meets a TLS server: refused, not served.
  CHECK(contains(thrown_text<distrpc::DistNetworkError>(
                     [&] { ds::TCPStore plain("127.0.0.1", master.port(), -1, false, 5s); }),
                 "a server with TLS a client without TLS"));
}
