// TCPStore: a Store served over TCP, speaking PyTorch c10d's TCPStore protocol, so a distrpc
// client can join a store hosted by Python (torch.distributed.TCPStore) or by torchrun's agent,
// and Python processes can use a store a distrpc program hosts. The master object also runs the
// server (an Asio acceptor on its own I/O thread); every object, the master included, is a client
// with its own connection.
//
// Wire protocol (c10d's; integers in host order, i.e. little-endian on every supported machine):
//   request  := u8 query type, fields...   (no length prefix: the server parses incrementally)
//   string   := u64 length, bytes          (keys and values)
//   User keys travel prefixed with "/" (c10d's TCPStore does so; PrefixStore's "p/k" is "/p/k").
//   Query types, PyTorch 1.13-2.1 numbering (what distrpc's client sends):
//     0 SET         key, value                    -> nothing
//     1 COMPARE_SET key, expected, desired        -> string (current value after the swap)
//     2 GET         key                           -> string (the server holds it until the key
//     exists) 3 ADD         key, i64 delta                -> i64 new value (stored as decimal text)
//     4 CHECK       u64 n, n keys                 -> u8 0 all present, 1 not
//     5 WAIT        u64 n, n keys                 -> u8 0 once all exist (no timeout in the
//     request) 6 GETNUMKEYS                                -> i64 7 WATCH_KEY   (not supported: the
//     connection is closed) 8 DELETE_KEY  key                           -> i64 number deleted 9
//     APPEND key, value -> nothing;  10 MULTI_GET u64 n, n keys -> n strings;
//    11 MULTI_SET u64 n, n (key, value) -> nothing;  12 CANCEL_WAIT -> u8 1 (wait cancelled)
//   A PyTorch >= 2.2 client opens with VALIDATE (byte 0, u32 magic 0x3C85F7CE, no reply); that
//   connection then uses the newer numbering: 1 SET, 2 COMPARE_SET, 3 GET, 4 ADD, 5 CHECK, 6 WAIT,
//   7 GETNUMKEYS, 8 DELETE_KEY, 9 APPEND, 10 MULTI_GET, 11 MULTI_SET, 12 CANCEL_WAIT,
//   13 PING (u32 nonce -> the same u32). A connection whose first bytes are that magic number
//   carries it before every query type (some 2.x releases do that), with the same numbering.
//   Every c10d store object that knows the world size adds 1 to the unprefixed key "init/" when it
//   connects; a master with wait_for_workers waits until that count reaches world_size. num_keys()
//   counts that key too, as c10d's does.
//
// Our client: set() sends SET and a CHECK of no keys in one round trip (the reply confirms the
// value is stored); get() is WAIT then GET, as c10d's; a wait or get that times out drops its
// connection (every c10d server treats a closed connection as a cancelled wait) and names the
// keys still missing. A connection's first request is a CHECK of no keys, which every c10d server
// answers READY (that proves the peer is a TCPStore server).
//
// Our server answers WAIT, GET and MULTI_GET when the keys appear (waiter lists, no polling); a
// new request other than CANCEL_WAIT while one is parked abandons it (a 1.13 client whose wait
// timed out simply goes on).
// Every length and count is checked against its limit as soon as it is read (keys
// Store::kMaxKeyBytes + the prefix, values Store::kMaxValueBytes, 128 Ki keys per request, one
// request at most 2 * kMaxValueBytes + kMaxKeyBytes + 64 bytes); anything malformed (an oversized
// length, an unknown query type, an add on a value that is not a number,
// EOF inside a request) closes that connection only, with one line logged, as c10d's
// protocol has no error reply. A connection that sends no request within handshake_timeout is
// closed, so silent sockets cannot pile up.
//
// Threads: server state is touched only by the I/O thread. A client object keeps a small pool of
// connections so that threads sharing it do not queue behind one another's blocking get(); the
// common single-threaded path is one blocking send + recv per operation (two for get()).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "distrpc/net/tls.hpp"
#include "distrpc/store/detail/tcp_store_client.hpp"
#include "distrpc/store/detail/tcp_store_protocol.hpp"
#include "distrpc/store/detail/tcp_store_server.hpp"
#include "distrpc/store/store.hpp"
#include "distrpc/tls_options.hpp"

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
  // Master only: the constructor returns once world_size store objects have registered (or
  // throws after `timeout`); each object with world_size > 0, distrpc's or PyTorch's, registers
  // when it connects. false: it returns at once.
  bool wait_for_workers = false;
  // Master only: the address to listen on; empty means the address `host` resolves to (so
  // "127.0.0.1" keeps the server on loopback). "0.0.0.0" or "::" listen everywhere.
  std::string listen_address;
  // Master only: a connection that has sent no request by then is closed, so silent sockets
  // cannot pile up.
  std::chrono::milliseconds handshake_timeout{10'000};
  // A shared secret: the server serves only clients that prove they have it, and a client checks
  // that the server has it too (challenge-response; the secret is never sent). Empty: the file
  // auth_secret_file names, else DISTRPC_AUTH_SECRET_FILE's file, else DISTRPC_AUTH_SECRET, else
  // none (docs/security.md). With a secret, PyTorch's own TCPStore cannot connect.
  std::string auth_secret;
  // A file holding the secret (one line, mode 0600 or stricter: a file open to group or others is
  // refused).
  std::string auth_secret_file;
  // Mutual TLS (docs/security.md, "TLS"): the server and every client present a certificate the CA
  // in ca_file signed and check the other's; every byte, the secret's challenge-response included,
  // is encrypted. Empty: DISTRPC_TLS_CERT / _KEY / _CA, else plain TCP. With TLS, PyTorch's own
  // TCPStore cannot connect.
  TlsOptions tls;
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
    secret_ = wire::auth::resolve_secret(opts_.auth_secret, opts_.auth_secret_file);
    std::shared_ptr<asio::ssl::context> server_tls;
    if (const auto tls = net::tls::resolve(opts_.tls)) {
      tls_ = net::tls::make_context(*tls);
      if (opts_.is_master) {
        server_tls = std::make_shared<asio::ssl::context>(asio::ssl::context::tls_server);
        net::tls::configure(server_tls->native_handle(), *tls);
      }
    }
    if (opts_.is_master) {
      server_ = std::make_unique<detail::Server>(
          opts_.listen_address.empty() ? opts_.host : opts_.listen_address, opts_.port,
          opts_.handshake_timeout, secret_, std::move(server_tls));
      opts_.port = server_->port();
    }
    name_ = "TCPStore(" + detail::host_port(opts_.host, opts_.port) + ")";
    idle_.push_back(connect(opts_.timeout));
    if (opts_.world_size > 0) {
      // c10d's registration: every store object that knows the world size adds 1 to "init/"
      // (unprefixed), which a c10d master waiting for its workers polls and ours waits on.
      exchange(
          "registration", [] { return std::vector<std::string>{}; }, timeout(),
          [&](detail::Connection& c, const detail::Deadline& d, const auto& what) {
            c.out().push_back(detail::kAddByte);
            detail::put_str(c.out(), detail::kInitKey);
            detail::put_le<std::int64_t>(c.out(), 1);
            c.send(d, what);
            return c.template read_le<std::int64_t>(d, what);
          });
    }
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
    exchange("set", one_key(key), timeout(), [&](auto& c, const auto& d, const auto& what) {
      c.out().push_back(detail::kSetByte);
      detail::put_key(c.out(), key);
      detail::put_str(c.out(), value);
      // SET has no reply in c10d's protocol. A CHECK of no keys behind it (answered in order,
      // in the same round trip) confirms the value is stored before set() returns, so another
      // client's get/check issued afterwards sees it.
      confirm(c, d, what);
      return 0;
    });
  }

  // c10d's way: WAIT for the key (the timeout is ours), then GET it.
  Bytes get(const std::string& key) override {
    detail::check_key(name_, "get", key);
    const auto limit = timeout();
    return exchange("get", one_key(key), limit, [&](auto& c, const auto& d, const auto& what) {
      await(c, {key}, d, what);
      c.out().push_back(detail::kGetByte);
      detail::put_key(c.out(), key);
      c.send(d, what);
      return c.read_bytes(d, what);
    });
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    detail::check_key(name_, "add", key);
    try {
      return exchange("add", one_key(key), timeout(),
                      [&](auto& c, const auto& d, const auto& what) {
                        c.out().push_back(detail::kAddByte);
                        detail::put_key(c.out(), key);
                        detail::put_le<std::int64_t>(c.out(), delta);
                        c.send(d, what);
                        return c.template read_le<std::int64_t>(d, what);
                      });
    } catch (const detail::ConnectionLost&) {
      // A c10d server closes the connection of an add it cannot do (no error reply exists):
      // name the reason when the server is still there.
      explain_refused_add(key, delta);
      throw;
    }
  }

  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    detail::check_key(name_, "compare_set", key);
    detail::check_value(name_, "compare_set", key, expected.size());
    detail::check_value(name_, "compare_set", key, desired.size());
    return exchange("compare_set", one_key(key), timeout(),
                    [&](auto& c, const auto& d, const auto& what) {
                      c.out().push_back(detail::kCompareSetByte);
                      detail::put_key(c.out(), key);
                      detail::put_str(c.out(), expected);
                      detail::put_str(c.out(), desired);
                      c.send(d, what);
                      return c.read_bytes(d, what);
                    });
  }

  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) detail::check_key(name_, "check", k);
    return exchange(
        "check", [&] { return keys; }, timeout(),
        [&](auto& c, const auto& d, const auto& what) {
          c.out().push_back(detail::kCheckByte);
          put_keys(c.out(), keys);
          c.send(d, what);
          const auto r = c.read_u8(d, what);
          if (r != detail::kReady && r != detail::kNotReady) {
            c.set_broken();
            throw DistNetworkError(name_ + ": malformed reply to " + what() + ": check answered " +
                                   std::to_string(r));
          }
          return r == detail::kReady;
        });
  }

  void wait(const std::vector<std::string>& keys, milliseconds timeout) override {
    for (const auto& k : keys) detail::check_key(name_, "wait", k);
    if (keys.empty()) return;
    exchange(
        "wait", [&] { return keys; }, timeout,
        [&](auto& c, const auto& d, const auto& what) {
          await(c, keys, d, what);
          return 0;
        });
  }

  bool delete_key(const std::string& key) override {
    detail::check_key(name_, "delete_key", key);
    return exchange("delete_key", one_key(key), timeout(),
                    [&](auto& c, const auto& d, const auto& what) {
                      c.out().push_back(detail::kDeleteByte);
                      detail::put_key(c.out(), key);
                      c.send(d, what);
                      return c.template read_le<std::int64_t>(d, what) == 1;
                    });
  }

  // Every key the server holds, as c10d counts them: a store whose objects registered with a
  // world size also holds c10d's "init/" counter.
  std::int64_t num_keys() override {
    return exchange(
        "num_keys", [] { return std::vector<std::string>{}; }, timeout(),
        [&](auto& c, const auto& d, const auto& what) {
          c.out().push_back(detail::kNumKeysByte);
          c.send(d, what);
          return c.template read_le<std::int64_t>(d, what);
        });
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
    detail::put_le<std::uint64_t>(b, keys.size());
    for (const auto& k : keys) detail::put_key(b, k);
  }

  template <class Describe>
  void confirm(detail::Connection& c, const detail::Deadline& d, const Describe& what) {
    c.out().push_back(detail::kCheckByte);
    detail::put_le<std::uint64_t>(c.out(), 0);
    c.send(d, what);
    if (c.read_u8(d, what) != detail::kReady) {
      c.set_broken();
      throw DistNetworkError(name_ + ": malformed reply to " + what() +
                             ": the confirming check was not answered READY");
    }
  }

  // WAIT until every key exists. Past the deadline the connection is dropped (the server still
  // holds the wait; closing is the cancel every c10d server understands) and a StoreTimeoutError
  // names the keys still missing.
  template <class Describe>
  void await(detail::Connection& c, const std::vector<std::string>& keys, const detail::Deadline& d,
             const Describe& what) {
    c.out().push_back(detail::kWaitByte);
    put_keys(c.out(), keys);
    c.send(d, what);
    const auto r = c.read_u8(d, what);
    if (r != detail::kStopWaiting) {
      c.set_broken();
      throw DistNetworkError(name_ + ": malformed reply to " + what() + ": wait answered " +
                             std::to_string(r));
    }
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
    return reconnect(timeout());
  }

  // A new connection to the server, authenticated and under TLS as configured: the constructor's
  // first one, which waits for a server that may start later.
  std::unique_ptr<detail::Connection> connect(std::chrono::milliseconds timeout) const {
    return std::make_unique<detail::Connection>(opts_.host, opts_.port, timeout, secret_,
                                                tls_.get());
  }
  // Every later one (another for the pool, the side ones of missing() and explain_refused_add()):
  // the constructor reached the server, so a refusal now means it is gone (the process hosting it
  // exited or crashed) and fails at once with detail::ConnectionLost, instead of being retried
  // for the whole timeout (a survivor's shutdown would wait that long for nothing).
  std::unique_ptr<detail::Connection> reconnect(std::chrono::milliseconds timeout) const {
    return std::make_unique<detail::Connection>(opts_.host, opts_.port, timeout, secret_,
                                                tls_.get(), /*reached=*/true);
  }

  void release(std::unique_ptr<detail::Connection> c) {
    if (c->broken()) return;
    std::lock_guard lock(mu_);
    idle_.push_back(std::move(c));
  }

  // One operation on a pooled connection: `body(conn, deadline, describe)` sends and reads.
  // `limit` bounds the whole operation (the store timeout, or wait's own); kNoTimeout waits
  // forever. A connection goes back to the pool only while it is in step with the server.
  template <class Keys, class Body>
  auto exchange(const char* what, const Keys& keys, milliseconds limit, const Body& body)
      -> std::invoke_result_t<const Body&, detail::Connection&, const detail::Deadline&,
                              const std::function<std::string()>&> {
    const detail::Deadline deadline(limit <= kNoTimeout ? kNoTimeout : limit);
    const std::function<std::string()> describe = [&] {
      return std::string(what) + " " + detail::quote_keys(keys()) + " on " + name_ + " (timeout " +
             std::to_string(limit.count()) + " ms)";
    };
    std::unique_ptr<detail::Connection> conn;
    try {
      conn = acquire();  // a refused reconnect() is a lost server too
      auto result = body(*conn, deadline, describe);
      release(std::move(conn));
      return result;
    } catch (const detail::ReplyTimeout&) {
      conn.reset();  // out of step: the server may still answer
      const auto all = keys();
      throw StoreTimeoutError(detail::timeout_text(name_, what, all, missing(all), limit));
    } catch (const detail::ConnectionLost& e) {
      std::lock_guard lock(mu_);
      lost_ = e.what();
      throw;
    }
  }

  // The keys of a timed-out wait that are still missing, asked on a fresh connection; all of
  // them when that fails too (the text is then only less precise).
  std::vector<std::string> missing(const std::vector<std::string>& keys) {
    if (keys.size() < 2) return keys;
    try {
      const auto conn = reconnect(detail::kClientGrace);
      auto& c = *conn;
      const detail::Deadline d(detail::kClientGrace);
      auto what = [] { return std::string("a check after a timeout"); };
      std::vector<std::string> out;
      for (const auto& k : keys) {
        c.out().push_back(detail::kCheckByte);
        put_keys(c.out(), {k});
        c.send(d, what);
        if (c.read_u8(d, what) != detail::kReady) out.push_back(k);
      }
      return out;
    } catch (const std::exception&) {
      return keys;
    }
  }

  // After the server closed an add's connection: if the server is up and the key's value is not
  // a counter (or the sum overflows), throws the DistStoreError saying so; else returns.
  void explain_refused_add(const std::string& key, std::int64_t delta) {
    Bytes current;
    try {
      const auto conn = reconnect(detail::kClientGrace);
      auto& c = *conn;
      const detail::Deadline d(detail::kClientGrace);
      auto what = [] { return std::string("a read after a refused add"); };
      c.out().push_back(detail::kCheckByte);
      put_keys(c.out(), {key});
      c.send(d, what);
      if (c.read_u8(d, what) != detail::kReady) return;
      c.out().push_back(detail::kGetByte);
      detail::put_key(c.out(), key);
      c.send(d, what);
      current = c.read_bytes(d, what);
    } catch (const std::exception&) {
      return;  // the server is gone: the connection loss stands
    }
    {
      // The server is alive: this object is not lost after all.
      std::lock_guard lock(mu_);
      lost_.clear();
    }
    const std::int64_t old = detail::parse_counter(name_, key, current);
    detail::checked_add(name_, key, old, delta);
  }

  TCPStoreOptions opts_;
  std::optional<std::string> secret_;  // resolved from the options or the environment
  net::tls::SslCtxPtr tls_;            // with TLS: the clients' context (the server has its own)
  std::string name_;
  std::unique_ptr<detail::Server> server_;
  std::mutex mu_;  // guards idle_ and lost_
  std::vector<std::unique_ptr<detail::Connection>> idle_;
  std::string lost_;  // why the server connection was lost; later operations fail fast with it
};

}  // namespace distrpc::store
