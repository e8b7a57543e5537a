// TCPStore: a Store served over TCP. The master object also runs the server (an Asio acceptor on
// its own I/O thread); every object, the master included, is a client with its own connection.
//
// Wire protocol (all integers little-endian):
//   frame    := u32 body_length, body                 (1 <= body_length <= kMaxFrameBytes)
//   request  := u8 opcode, fields...                  (the first request must be HELLO)
//   reply    := u8 status (0 ok, 1 timeout, 2 error), fields...
//   string   := u32 length, bytes
//   HELLO       u32 magic "DRTS", u16 version, u8 flags (bit 0: a store object's first connection)
//                                                     -> u16 version
//   SET         string key, string value              -> ()
//   GET         string key, u64 timeout_ms (0: none)  -> string value | timeout: u32 n, n strings
//   ADD         string key, i64 delta                 -> i64 new value | error: string text
//   COMPARE_SET string key, string expected, string desired -> string value
//   CHECK       u32 n, n strings                      -> u8 all present
//   WAIT        u32 n, n strings, u64 timeout_ms      -> () | timeout: u32 n, n missing keys
//   DELETE      string key                            -> u8 existed
//   NUM_KEYS                                          -> i64
// A client sends one request per connection at a time. The server answers GET and WAIT when the
// keys appear (waiter lists, no polling) or when their timeout passes. Anything malformed (bad
// length, unknown opcode, a field running past its frame, bytes after the last field, a request
// while one is pending, EOF inside a frame) closes that connection only, with one line logged.
//
// Threads: server state is touched only by the I/O thread. A client object keeps a small pool of
// connections so that threads sharing it do not queue behind one another's blocking get(); the
// common single-threaded path is one blocking send + recv per operation.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "distrpc/store/detail/tcp_store_client.hpp"
#include "distrpc/store/detail/tcp_store_protocol.hpp"
#include "distrpc/store/detail/tcp_store_server.hpp"
#include "distrpc/store/store.hpp"

namespace distrpc::store {

struct TCPStoreOptions {
  std::string host = "127.0.0.1";
  // The server's port; 0 on the master picks a free one (read it back with TCPStore::port()).
  int port = 0;
  // Number of store objects expected (master included); -1 when unknown.
  int world_size = -1;
  bool is_master = false;
  // Default timeout of get()/wait(), and the time allowed to connect.
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
  // Master only: the constructor returns once world_size objects have connected (or throws after
  // `timeout`). false: it returns at once.
  bool wait_for_workers = false;
  // Master only: the address to listen on; empty means the address `host` resolves to (so
  // "127.0.0.1" keeps the server on loopback). "0.0.0.0" or "::" listen everywhere.
  std::string listen_address;
  // Master only: a connection that has not completed the handshake by then is closed, so silent
  // sockets cannot pile up.
  std::chrono::milliseconds handshake_timeout{10'000};
};

class TCPStore : public Store {
 public:
  TCPStore(std::string host, int port, int world_size, bool is_master,
           milliseconds timeout = kDefaultTimeout, bool wait_for_workers = false)
      : TCPStore(make_options(std::move(host), port, world_size, is_master, timeout,
                              wait_for_workers)) {}

  explicit TCPStore(TCPStoreOptions opts) : Store(opts.timeout), opts_(std::move(opts)) {
    if (opts_.port < 0 || opts_.port > 65535) {
      throw DistError("TCPStore: port " + std::to_string(opts_.port) + " is outside 0..65535");
    }
    if (!opts_.is_master && opts_.port == 0) {
      throw DistError(
          "TCPStore: a client needs the server's port; port 0 only means \"pick one\" "
          "on the master (host " +
          opts_.host + ")");
    }
    if (opts_.is_master && opts_.wait_for_workers && opts_.world_size <= 0) {
      throw DistError("TCPStore: wait_for_workers=true needs world_size > 0, got " +
                      std::to_string(opts_.world_size));
    }
    if (opts_.is_master) {
      server_ = std::make_unique<detail::Server>(
          opts_.listen_address.empty() ? opts_.host : opts_.listen_address, opts_.port,
          opts_.handshake_timeout);
      opts_.port = server_->port();
    }
    name_ = "TCPStore(" + detail::host_port(opts_.host, opts_.port) + ")";
    idle_.push_back(
        std::make_unique<detail::Connection>(opts_.host, opts_.port, true, opts_.timeout));
    if (opts_.is_master && opts_.wait_for_workers) {
      const int joined = server_->wait_for_clients(opts_.world_size, opts_.timeout);
      if (joined < opts_.world_size) {
        throw StoreTimeoutError(name_ + ": Timeout after " + std::to_string(opts_.timeout.count()) +
                                " ms waiting for " + std::to_string(opts_.world_size) +
                                " clients to connect (" + std::to_string(joined) + "/" +
                                std::to_string(opts_.world_size) + " joined)");
      }
    }
  }

  ~TCPStore() override {
    // Clients first, then the server (which closes whatever other clients still hold).
    idle_.clear();
    server_.reset();
  }

  const std::string& host() const { return opts_.host; }
  // The server's port: the one picked when the master was given port 0.
  std::uint16_t port() const { return static_cast<std::uint16_t>(opts_.port); }
  bool is_master() const { return opts_.is_master; }
  int world_size() const { return opts_.world_size; }

  using Store::set;
  using Store::wait;

  void set(const std::string& key, const Bytes& value) override {
    detail::check_key(name_, "set", key);
    detail::check_value(name_, "set", key, value.size());
    roundtrip(
        detail::kSet, "set", one_key(key),
        [&](auto& b) {
          detail::put_str(b, key);
          detail::put_str(b, value);
        },
        [](auto&) { return 0; });
  }

  Bytes get(const std::string& key) override {
    detail::check_key(name_, "get", key);
    const auto timeout = this->timeout();
    return roundtrip(
        detail::kGet, "get", one_key(key),
        [&](auto& b) {
          detail::put_str(b, key);
          detail::put_le<std::uint64_t>(b, static_cast<std::uint64_t>(timeout.count()));
        },
        [](auto& r) { return r.bytes("value"); }, timeout);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    detail::check_key(name_, "add", key);
    return roundtrip(
        detail::kAdd, "add", one_key(key),
        [&](auto& b) {
          detail::put_str(b, key);
          detail::put_le<std::int64_t>(b, delta);
        },
        [](auto& r) { return r.template le<std::int64_t>("counter"); });
  }

  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    detail::check_key(name_, "compare_set", key);
    detail::check_value(name_, "compare_set", key, expected.size());
    detail::check_value(name_, "compare_set", key, desired.size());
    return roundtrip(
        detail::kCompareSet, "compare_set", one_key(key),
        [&](auto& b) {
          detail::put_str(b, key);
          detail::put_str(b, expected);
          detail::put_str(b, desired);
        },
        [](auto& r) { return r.bytes("value"); });
  }

  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) detail::check_key(name_, "check", k);
    return roundtrip(
        detail::kCheck, "check", [&] { return keys; }, [&](auto& b) { put_keys(b, keys); },
        [](auto& r) { return r.u8("flag") != 0; });
  }

  void wait(const std::vector<std::string>& keys, milliseconds timeout) override {
    for (const auto& k : keys) detail::check_key(name_, "wait", k);
    if (keys.empty()) return;
    roundtrip(
        detail::kWait, "wait", [&] { return keys; },
        [&](auto& b) {
          put_keys(b, keys);
          detail::put_le<std::uint64_t>(b, static_cast<std::uint64_t>(timeout.count()));
        },
        [](auto&) { return 0; }, timeout);
  }

  bool delete_key(const std::string& key) override {
    detail::check_key(name_, "delete_key", key);
    return roundtrip(
        detail::kDelete, "delete_key", one_key(key), [&](auto& b) { detail::put_str(b, key); },
        [](auto& r) { return r.u8("flag") != 0; });
  }

  std::int64_t num_keys() override {
    return roundtrip(
        detail::kNumKeys, "num_keys", [] { return std::vector<std::string>{}; }, [](auto&) {},
        [](auto& r) { return r.template le<std::int64_t>("count"); });
  }

 private:
  static TCPStoreOptions make_options(std::string host, int port, int world_size, bool is_master,
                                      milliseconds timeout, bool wait_for_workers) {
    TCPStoreOptions o;
    o.host = std::move(host);
    o.port = port;
    o.world_size = world_size;
    o.is_master = is_master;
    o.timeout = timeout;
    o.wait_for_workers = wait_for_workers;
    return o;
  }

  // The keys of an operation, materialised only for an error text.
  struct OneKey {
    const std::string& key;
    std::vector<std::string> operator()() const { return {key}; }
  };
  static OneKey one_key(const std::string& key) { return OneKey{key}; }

  static void put_keys(detail::Buffer& b, const std::vector<std::string>& keys) {
    detail::put_le<std::uint32_t>(b, static_cast<std::uint32_t>(keys.size()));
    for (const auto& k : keys) detail::put_str(b, k);
  }

  // Takes an idle connection, or opens another when every one is busy in another thread.
  std::unique_ptr<detail::Connection> acquire() {
    {
      std::lock_guard lock(mu_);
      if (!lost_.empty()) throw DistNetworkError(lost_);
      if (!idle_.empty()) {
        auto c = std::move(idle_.back());
        idle_.pop_back();
        return c;
      }
    }
    return std::make_unique<detail::Connection>(opts_.host, opts_.port, false, timeout());
  }

  void release(std::unique_ptr<detail::Connection> c) {
    if (c->broken()) return;
    std::lock_guard lock(mu_);
    idle_.push_back(std::move(c));
  }

  // One request and its reply. `blocking_timeout` is the server-side timeout of get/wait; the other
  // operations are bounded by the store timeout. A connection goes back to the pool only while it
  // is in step with the server.
  template <class Keys, class Encode, class Decode>
  auto roundtrip(std::uint8_t op, const char* what, const Keys& keys, const Encode& encode,
                 const Decode& decode, std::optional<milliseconds> blocking_timeout = std::nullopt)
      -> std::invoke_result_t<const Decode&, detail::Reader&> {
    const milliseconds limit = blocking_timeout.value_or(timeout());
    // kNoTimeout stays "no limit"; otherwise leave the server time to send its own timeout reply.
    const detail::Deadline deadline(limit <= kNoTimeout ? kNoTimeout
                                                        : limit + detail::kClientGrace);
    auto conn = acquire();
    detail::Buffer& b = conn->out();
    detail::begin_frame(b, op);
    encode(b);
    auto describe = [&] {
      return std::string(what) + " " + detail::quote_keys(keys()) + " on " + name_ + " (timeout " +
             std::to_string(limit.count()) + " ms)";
    };
    try {
      auto r = conn->call(deadline, describe);
      const std::uint8_t st = conn->status();
      if (st == detail::kOk) {
        auto result = decode(r);
        r.finish();
        release(std::move(conn));
        return result;
      }
      if (st == detail::kTimeout) {
        auto missing = r.strs("missing key");
        r.finish();
        release(std::move(conn));
        throw StoreTimeoutError(detail::timeout_text(name_, what, keys(), missing, limit));
      }
      if (st == detail::kError) {
        auto text = r.str("error text");
        release(std::move(conn));
        throw DistStoreError(name_ + ": " + what + " refused by the server: " + text);
      }
      throw detail::WireError("unknown reply status " + std::to_string(st));
    } catch (const detail::ConnectionLost& e) {
      std::lock_guard lock(mu_);
      lost_ = e.what();
      throw;
    } catch (const detail::WireError& e) {
      // `conn` is dropped here: its position in the stream can no longer be trusted.
      throw DistNetworkError(name_ + ": malformed reply to " + describe() + ": " + e.what());
    }
  }

  TCPStoreOptions opts_;
  std::string name_;
  std::unique_ptr<detail::Server> server_;
  std::mutex mu_;  // guards idle_ and lost_
  std::vector<std::unique_ptr<detail::Connection>> idle_;
  std::string lost_;  // why the server connection was lost; later operations fail fast with it
};

}  // namespace distrpc::store
