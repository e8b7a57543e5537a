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

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <fcntl.h>
#include <algorithm>
#include <atomic>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <asio/write.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "distrpc/log.hpp"
#include "distrpc/net/dial.hpp"
#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/fd.hpp"
#include "distrpc/store/detail/common.hpp"
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

namespace detail {

inline constexpr std::uint32_t kMagic = 0x53545244;  // "DRTS"
inline constexpr std::uint16_t kVersion = 1;
inline constexpr std::uint8_t kPrimaryFlag = 1;
// The largest legal request: COMPARE_SET with a maximal key and two maximal values.
inline constexpr std::size_t kMaxFrameBytes = 2 * Store::kMaxValueBytes + Store::kMaxKeyBytes + 64;
// A client waits this much longer than the timeout it gave the server before it calls the server
// unresponsive: the server's own timeout reply should always arrive first.
inline constexpr std::chrono::milliseconds kClientGrace{2000};

enum Op : std::uint8_t {
  kHello = 1,
  kSet = 2,
  kGet = 3,
  kAdd = 4,
  kCompareSet = 5,
  kCheck = 6,
  kWait = 7,
  kDelete = 8,
  kNumKeys = 9,
};
enum Status : std::uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

// A frame that does not follow the protocol; the text says how.
class WireError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Buffer = std::vector<std::uint8_t>;

inline void put_u8(Buffer& b, std::uint8_t v) {
  b.push_back(v);
}
template <class T>
inline void put_le(Buffer& b, T v) {
  using U = std::make_unsigned_t<T>;
  const auto u = static_cast<U>(v);
  for (std::size_t i = 0; i < sizeof(T); ++i) b.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
}
inline void put_str(Buffer& b, const void* p, std::size_t n) {
  put_le<std::uint32_t>(b, static_cast<std::uint32_t>(n));
  const auto* c = static_cast<const std::uint8_t*>(p);
  b.insert(b.end(), c, c + n);
}
inline void put_str(Buffer& b, std::string_view s) {
  put_str(b, s.data(), s.size());
}
inline void put_str(Buffer& b, const Bytes& s) {
  put_str(b, s.data(), s.size());
}

// Starts a frame: room for the length, then the first byte. end_frame() fills the length in.
inline void begin_frame(Buffer& b, std::uint8_t first) {
  b.clear();
  b.resize(4);
  b.push_back(first);
}
inline void end_frame(Buffer& b) {
  const auto n = static_cast<std::uint32_t>(b.size() - 4);
  for (int i = 0; i < 4; ++i) b[i] = static_cast<std::uint8_t>(n >> (8 * i));
}
inline std::uint32_t read_le32(const std::uint8_t* p) {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
         std::uint32_t(p[3]) << 24;
}

// Bounds-checked reading of one frame body; every overrun is a WireError naming the field.
class Reader {
 public:
  Reader(const std::uint8_t* p, std::size_t n) : p_(p), n_(n) {}
  std::uint8_t u8(const char* what) {
    need(1, what);
    return p_[at_++];
  }
  template <class T>
  T le(const char* what) {
    need(sizeof(T), what);
    std::make_unsigned_t<T> v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      v |= static_cast<std::make_unsigned_t<T>>(p_[at_ + i]) << (8 * i);
    }
    at_ += sizeof(T);
    return static_cast<T>(v);
  }
  std::string str(const char* what) {
    const auto n = le<std::uint32_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(p_ + at_), n);
    at_ += n;
    return s;
  }
  Bytes bytes(const char* what) {
    const auto n = le<std::uint32_t>(what);
    need(n, what);
    Bytes b(p_ + at_, p_ + at_ + n);
    at_ += n;
    return b;
  }
  std::vector<std::string> strs(const char* what) {
    const auto n = le<std::uint32_t>(what);
    // Each string takes at least 4 bytes: refuse a count the frame cannot hold before reserving.
    if (n > (n_ - at_) / 4) {
      throw WireError(std::string("the ") + what + " count " + std::to_string(n) +
                      " exceeds what the frame can hold");
    }
    std::vector<std::string> out;
    out.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) out.push_back(str(what));
    return out;
  }
  void finish() const {
    if (at_ != n_) {
      throw WireError(std::to_string(n_ - at_) + " unexpected bytes after the last field");
    }
  }

 private:
  void need(std::size_t k, const char* what) const {
    if (n_ - at_ < k) throw WireError(std::string("the frame ends inside the ") + what);
  }
  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t at_ = 0;
};

inline std::string host_port(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// ------------------------------------------------------------------------------------------------
// The server.

class Server {
 public:
  // Binds and listens synchronously (so a busy port fails here, with its text), then serves on a
  // thread of its own until destroyed.
  Server(const std::string& listen_host, int port, std::chrono::milliseconds handshake_timeout)
      : acceptor_(io_), handshake_timeout_(handshake_timeout) {
    asio::ip::tcp::endpoint ep;
    try {
      asio::ip::tcp::resolver resolver(io_);
      auto results =
          resolver.resolve(listen_host, std::to_string(port), asio::ip::tcp::resolver::passive);
      if (results.empty()) throw DistNetworkError("no address");
      ep = results.begin()->endpoint();
    } catch (const std::exception& e) {
      throw DistNetworkError("TCPStore: cannot resolve the listen address '" + listen_host +
                             "': " + e.what());
    }
    asio::error_code ec;
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      throw DistNetworkError("TCPStore: cannot listen on " + host_port(listen_host, port) + ": " +
                             ec.message());
    }
    port_ = acceptor_.local_endpoint().port();
    name_ = "TCPStore server " + host_port(listen_host, port_);
    accept_next();
    thread_ = std::thread([this] {
      // Handlers catch what they expect; anything else is logged and serving goes on.
      for (;;) {
        try {
          io_.run();
          return;
        } catch (const std::exception& e) {
          distrpc::detail::log_error(
              name_, std::string("unexpected error in the I/O thread: ") + e.what());
        }
      }
    });
  }

  ~Server() {
    // Closing every connection first is what wakes clients blocked in get() with an error.
    asio::post(io_, [this] {
      asio::error_code ignored;
      acceptor_.close(ignored);
      for (const auto& s : sessions_) s->shut();
      sessions_.clear();
      waiters_.clear();
      io_.stop();
    });
    thread_.join();
  }

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  std::uint16_t port() const { return port_; }

  // Waits until `count` store objects have connected since the start; returns how many did.
  int wait_for_clients(int count, std::chrono::milliseconds timeout) {
    std::unique_lock lock(hello_mu_);
    const Deadline deadline(timeout);
    auto enough = [&] { return primaries_ >= count; };
    if (deadline.infinite()) {
      hello_cv_.wait(lock, enough);
    } else {
      hello_cv_.wait_until(lock, deadline.at(), enough);
    }
    return primaries_;
  }

 private:
  struct Session;

  // A get() or wait() parked until its keys exist or its timer fires.
  struct Waiter {
    explicit Waiter(asio::io_context& io) : timer(io) {}
    std::weak_ptr<Session> session;
    bool is_get = false;
    bool done = false;
    std::vector<std::string> keys;
    asio::steady_timer timer;
  };

  struct Session : std::enable_shared_from_this<Session> {
    Session(Server& s, asio::ip::tcp::socket sock)
        : server(s), socket(std::move(sock)), hello_timer(socket.get_executor()) {
      asio::error_code ec;
      auto ep = socket.remote_endpoint(ec);
      peer = ec ? std::string("an unknown peer") : host_port(ep.address().to_string(), ep.port());
    }

    void start() {
      hello_timer.expires_after(server.handshake_timeout_);
      hello_timer.async_wait([weak = weak_from_this()](asio::error_code ec) {
        auto self = weak.lock();
        if (ec || !self || self->closed || self->greeted) return;
        self->fail("no handshake within " +
                   std::to_string(self->server.handshake_timeout_.count()) + " ms");
      });
      read_more();
    }

    void read_more() {
      // Grow by what arrives, never by what a length prefix claims: a peer announcing 128 MiB and
      // sending nothing costs 64 KiB.
      std::size_t want = 64 * 1024;
      if (in_len >= 4) {
        const std::size_t frame = 4 + static_cast<std::size_t>(read_le32(in.data()));
        if (frame > in_len) want = std::max(want, std::min(frame - in_len, in_len));
      }
      if (in.size() - in_len < want) in.resize(in_len + want);
      reading = true;
      socket.async_read_some(asio::buffer(in.data() + in_len, in.size() - in_len),
                             [self = shared_from_this()](asio::error_code ec, std::size_t n) {
                               self->on_read(ec, n);
                             });
    }

    void on_read(asio::error_code ec, std::size_t n) {
      reading = false;
      if (closed) return;
      if (ec) {
        if (ec == asio::error::operation_aborted) return;
        if (ec == asio::error::eof && in_len == 0) {
          close();  // an orderly goodbye between requests
        } else if (ec == asio::error::eof) {
          fail("disconnected mid-request (" + std::to_string(in_len) +
               " bytes of an unfinished frame received)");
        } else {
          fail("read error: " + ec.message());
        }
        return;
      }
      in_len += n;
      pump();
    }

    // Serves the whole frames already buffered, then reads on. A frame is served only once the
    // previous reply has been written, and nothing is read while a reply is being written, so a
    // client that sends requests without reading replies cannot make the server queue replies
    // without bound. (While a get/wait is parked the reading goes on: that is how a disconnect or
    // a protocol violation is noticed.)
    void pump() {
      try {
        process();
      } catch (const WireError& e) {
        fail(e.what());
        return;
      } catch (const std::exception& e) {
        // Out of memory for a big value, say: this connection cannot be served, the others can.
        fail(std::string("cannot serve the request: ") + e.what());
        return;
      }
      if (!closed && out.empty() && !reading) read_more();
    }

    void process() {
      std::size_t at = 0;
      while (in_len - at >= 4 && out.empty()) {
        const std::uint32_t len = read_le32(in.data() + at);
        if (len == 0 || len > kMaxFrameBytes) {
          throw WireError("frame length " + std::to_string(len) + " is outside 1.." +
                          std::to_string(kMaxFrameBytes));
        }
        if (in_len - at - 4 < len) break;
        if (pending) throw WireError("a new request arrived while a get/wait was pending");
        server.handle(*this, in.data() + at + 4, len);
        at += 4 + static_cast<std::size_t>(len);
        if (closed) return;
      }
      if (at > 0) {
        std::memmove(in.data(), in.data() + at, in_len - at);
        in_len -= at;
      }
      // Give back a buffer grown for a big value once it is drained.
      if (in_len == 0 && in.size() > (1u << 20)) in = Buffer();
    }

    void send(Buffer frame) {
      if (closed) return;
      out.push_back(std::move(frame));
      if (out.size() == 1) write_front();
    }

    void write_front() {
      asio::async_write(socket, asio::buffer(out.front()),
                        [self = shared_from_this()](asio::error_code ec, std::size_t) {
                          if (self->closed) return;
                          if (ec) {
                            self->fail("write error: " + ec.message());
                            return;
                          }
                          self->out.pop_front();
                          if (!self->out.empty()) {
                            self->write_front();
                          } else {
                            self->pump();
                          }
                        });
    }

    // Logs why, once, then closes.
    void fail(const std::string& reason) {
      if (closed) return;
      distrpc::detail::log_warning(server.name_,
                                   "closing the connection from " + peer + ": " + reason);
      close();
    }

    void close() {
      if (closed) return;
      shut();
      server.sessions_.erase(shared_from_this());
    }

    // Closes without touching the server's session set (the caller owns that).
    void shut() {
      closed = true;
      hello_timer.cancel();
      if (pending) server.drop_waiter(pending);
      pending.reset();
      asio::error_code ignored;
      socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
      socket.close(ignored);
    }

    Server& server;
    asio::ip::tcp::socket socket;
    asio::steady_timer hello_timer;
    std::string peer;
    Buffer in;
    std::size_t in_len = 0;
    std::deque<Buffer> out;
    bool reading = false;  // an async_read_some is outstanding
    bool greeted = false;
    bool closed = false;
    std::shared_ptr<Waiter> pending;
  };

  void accept_next() {
    acceptor_.async_accept([this](asio::error_code ec, asio::ip::tcp::socket sock) {
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
      if (ec) {
        // Out of descriptors, usually: say so, and try again shortly rather than spin.
        distrpc::detail::log_warning(name_, "accept failed: " + ec.message());
        auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(50));
        t->async_wait([this, t](asio::error_code e) {
          if (!e) accept_next();
        });
        return;
      }
      asio::error_code ignored;
      sock.set_option(asio::ip::tcp::no_delay(true), ignored);
      auto s = std::make_shared<Session>(*this, std::move(sock));
      sessions_.insert(s);
      s->start();
      accept_next();
    });
  }

  static Buffer reply(Status st) {
    Buffer b;
    begin_frame(b, st);
    return b;
  }
  static Buffer finish(Buffer b) {
    end_frame(b);
    return b;
  }

  void handle(Session& s, const std::uint8_t* p, std::size_t n) {
    Reader r(p, n);
    const std::uint8_t op = r.u8("opcode");
    if (!s.greeted) {
      if (op != kHello) {
        throw WireError("the first frame has opcode " + std::to_string(op) +
                        ", not the TCPStore handshake");
      }
      const auto magic = r.le<std::uint32_t>("handshake magic");
      const auto version = r.le<std::uint16_t>("handshake version");
      const auto flags = r.u8("handshake flags");
      r.finish();
      if (magic != kMagic) throw WireError("wrong handshake magic: not a TCPStore client");
      if (version != kVersion) {
        Buffer b = reply(kError);
        put_str(b, "TCPStore server speaks protocol version " + std::to_string(kVersion) +
                       ", the client " + std::to_string(version));
        s.send(finish(std::move(b)));
        return;
      }
      s.greeted = true;
      s.hello_timer.cancel();
      if (flags & kPrimaryFlag) {
        {
          std::lock_guard lock(hello_mu_);
          ++primaries_;
        }
        hello_cv_.notify_all();
      }
      Buffer b = reply(kOk);
      put_le<std::uint16_t>(b, kVersion);
      s.send(finish(std::move(b)));
      return;
    }
    try {
      dispatch(s, op, r);
    } catch (const DistStoreError& e) {
      // Well-formed but refused (size limits, add on a non-number): the connection stays usable.
      Buffer b = reply(kError);
      put_str(b, std::string(e.what()));
      s.send(finish(std::move(b)));
    }
  }

  void dispatch(Session& s, std::uint8_t op, Reader& r) {
    static constexpr const char* kName = "TCPStore server";
    switch (op) {
      case kSet: {
        auto key = r.str("key");
        auto value = r.bytes("value");
        r.finish();
        check_key(kName, "set", key);
        check_value(kName, "set", key, value.size());
        map_[key] = std::move(value);
        s.send(finish(reply(kOk)));
        wake(key);
        return;
      }
      case kGet:
      case kWait: {
        std::vector<std::string> keys;
        if (op == kGet) {
          keys.push_back(r.str("key"));
        } else {
          keys = r.strs("key");
        }
        const auto timeout_ms = r.le<std::uint64_t>("timeout");
        r.finish();
        for (const auto& k : keys) check_key(kName, op == kGet ? "get" : "wait", k);
        park(s, op == kGet, std::move(keys), timeout_ms);
        return;
      }
      case kAdd: {
        auto key = r.str("key");
        const auto delta = r.le<std::int64_t>("delta");
        r.finish();
        check_key(kName, "add", key);
        auto it = map_.find(key);
        const std::int64_t old = it == map_.end() ? 0 : parse_counter(kName, key, it->second);
        const std::int64_t now = checked_add(kName, key, old, delta);
        map_[key] = format_counter(now);
        Buffer b = reply(kOk);
        put_le<std::int64_t>(b, now);
        s.send(finish(std::move(b)));
        wake(key);
        return;
      }
      case kCompareSet: {
        auto key = r.str("key");
        auto expected = r.bytes("expected value");
        auto desired = r.bytes("desired value");
        r.finish();
        check_key(kName, "compare_set", key);
        check_value(kName, "compare_set", key, expected.size());
        check_value(kName, "compare_set", key, desired.size());
        Buffer b = reply(kOk);
        auto it = map_.find(key);
        bool changed = false;
        if (it == map_.end()) {
          if (expected.empty()) {
            put_str(b, desired);
            map_.emplace(key, std::move(desired));
            changed = true;
          } else {
            put_str(b, expected);
          }
        } else if (it->second == expected) {
          put_str(b, desired);
          it->second = std::move(desired);
          changed = true;
        } else {
          put_str(b, it->second);
        }
        s.send(finish(std::move(b)));
        if (changed) wake(key);
        return;
      }
      case kCheck: {
        auto keys = r.strs("key");
        r.finish();
        for (const auto& k : keys) check_key(kName, "check", k);
        Buffer b = reply(kOk);
        put_u8(b, all_present(keys) ? 1 : 0);
        s.send(finish(std::move(b)));
        return;
      }
      case kDelete: {
        auto key = r.str("key");
        r.finish();
        check_key(kName, "delete_key", key);
        Buffer b = reply(kOk);
        put_u8(b, map_.erase(key) > 0 ? 1 : 0);
        s.send(finish(std::move(b)));
        return;
      }
      case kNumKeys: {
        r.finish();
        Buffer b = reply(kOk);
        put_le<std::int64_t>(b, static_cast<std::int64_t>(map_.size()));
        s.send(finish(std::move(b)));
        return;
      }
      case kHello:
        throw WireError("a second handshake on one connection");
      default: {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", op);
        throw WireError(std::string("unknown opcode ") + hex);
      }
    }
  }

  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return map_.contains(k); });
  }

  // Answers at once when the keys exist, else parks the request until wake() or its timer.
  void park(Session& s, bool is_get, std::vector<std::string> keys, std::uint64_t timeout_ms) {
    if (all_present(keys)) {
      answer_ready(s, is_get, keys);
      return;
    }
    auto w = std::make_shared<Waiter>(io_);
    w->session = s.weak_from_this();
    w->is_get = is_get;
    w->keys = std::move(keys);
    for (const auto& k : w->keys) {
      if (!map_.contains(k)) waiters_[k].push_back(w);
    }
    s.pending = w;
    if (timeout_ms > 0) {
      w->timer.expires_after(
          std::chrono::milliseconds(std::min<std::uint64_t>(timeout_ms, std::uint64_t(1) << 40)));
      w->timer.async_wait([this, weak = std::weak_ptr<Waiter>(w)](asio::error_code ec) {
        auto waiter = weak.lock();
        if (ec || !waiter || waiter->done) return;
        auto session = waiter->session.lock();
        drop_waiter(waiter);
        if (!session || session->closed) return;
        session->pending.reset();
        Buffer b = reply(kTimeout);
        std::vector<std::string> missing;
        for (const auto& k : waiter->keys) {
          if (!map_.contains(k)) missing.push_back(k);
        }
        put_le<std::uint32_t>(b, static_cast<std::uint32_t>(missing.size()));
        for (const auto& k : missing) put_str(b, k);
        session->send(finish(std::move(b)));
      });
    }
  }

  void answer_ready(Session& s, bool is_get, const std::vector<std::string>& keys) {
    Buffer b = reply(kOk);
    if (is_get) put_str(b, map_.at(keys[0]));
    s.send(finish(std::move(b)));
  }

  // A key was written: answer the waiters whose keys now all exist.
  void wake(const std::string& key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    auto list = std::move(it->second);
    waiters_.erase(it);
    for (auto& w : list) {
      if (w->done) continue;
      bool ready = true;
      for (const auto& k : w->keys) {
        if (!map_.contains(k)) {
          // Still missing (or deleted again): stays parked on that key.
          ready = false;
          auto& l = waiters_[k];
          if (std::find(l.begin(), l.end(), w) == l.end()) l.push_back(w);
        }
      }
      if (!ready) continue;
      auto session = w->session.lock();
      drop_waiter(w);
      if (!session || session->closed) continue;
      session->pending.reset();
      answer_ready(*session, w->is_get, w->keys);
    }
  }

  void drop_waiter(const std::shared_ptr<Waiter>& w) {
    if (w->done) return;
    w->done = true;
    w->timer.cancel();
    for (const auto& k : w->keys) {
      auto it = waiters_.find(k);
      if (it == waiters_.end()) continue;
      auto& l = it->second;
      l.erase(std::remove(l.begin(), l.end(), w), l.end());
      if (l.empty()) waiters_.erase(it);
    }
  }

  // Declared first so it is destroyed last: handlers it still holds own sessions and timers.
  asio::io_context io_{1};
  asio::ip::tcp::acceptor acceptor_;
  std::chrono::milliseconds handshake_timeout_;
  std::uint16_t port_ = 0;
  std::string name_;
  std::unordered_map<std::string, Bytes> map_;
  std::unordered_map<std::string, std::vector<std::shared_ptr<Waiter>>> waiters_;
  std::unordered_set<std::shared_ptr<Session>> sessions_;
  std::mutex hello_mu_;
  std::condition_variable hello_cv_;
  int primaries_ = 0;
  std::thread thread_;
};

// ------------------------------------------------------------------------------------------------
// The client side: one blocking socket per connection.

// The server went away (EOF, reset): every later operation of the object fails fast.
class ConnectionLost : public DistNetworkError {
 public:
  using DistNetworkError::DistNetworkError;
};

class Connection {
 public:
  // Connects, retrying until `timeout` (the server may start later), then shakes hands.
  Connection(const std::string& host, int port, bool primary, std::chrono::milliseconds timeout)
      : where_(host_port(host, port)) {
    const Deadline deadline(timeout);
    // The server may start later: a refusal is retried like any failure until the deadline (none
    // with kNoTimeout), and nothing stops the loop early (a store has no shutdown flag).
    static const std::atomic<bool> kNeverStopped{false};
    const net::DialTiming timing{.start = deadline.at() - timeout,
                                 .connect_timeout = timeout,
                                 .refused_retry = std::chrono::milliseconds::max(),
                                 .first_backoff = std::chrono::milliseconds(5),
                                 .max_backoff = std::chrono::milliseconds(200),
                                 .unbounded = deadline.infinite()};
    fd_ = net::dial_with_backoff(
        timing, kNeverStopped,
        [&](net::DialFailure& failure) { return try_connect(host, port, deadline, failure.text); },
        [&](const net::DialGiveUp& end) {
          return DistNetworkError("TCPStore: could not connect to " + where_ + " within " +
                                  std::to_string(timeout.count()) +
                                  " ms (last error: " + end.last.text + ")");
        });
    begin_frame(out_, kHello);
    put_le<std::uint32_t>(out_, kMagic);
    put_le<std::uint16_t>(out_, kVersion);
    put_u8(out_, primary ? kPrimaryFlag : 0);
    try {
      Reader r = call(deadline, [] { return std::string("the handshake"); });
      if (status_ != kOk) {
        throw DistNetworkError("TCPStore: " + where_ + " refused the handshake: " + r.str("text"));
      }
      r.le<std::uint16_t>("version");
    } catch (const std::exception& e) {
      fd_.reset();
      if (dynamic_cast<const DistNetworkError*>(&e)) throw;
      throw DistNetworkError("TCPStore: " + where_ +
                             " did not complete the TCPStore handshake: " + e.what());
    }
  }

  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // The request buffer; begin_frame(out(), op) then the fields.
  Buffer& out() { return out_; }
  std::uint8_t status() const { return status_; }
  // True once the connection is out of step with the server (a reply never came); not reusable.
  bool broken() const { return broken_; }

  // Sends out() and reads one reply; returns a reader over its fields (valid until the next call).
  // Throws ConnectionLost when the server goes away, StoreTimeoutError past the deadline.
  // `describe()` names the operation in error texts; it is only called when one is thrown, so the
  // fast path builds no strings.
  template <class Describe>
  Reader call(const Deadline& deadline, const Describe& describe) {
    end_frame(out_);
    send_all(deadline, describe);
    return receive(deadline, describe);
  }

 private:
  // One attempt per resolved address; nullopt with `last_error` set when none answers.
  static std::optional<net::Fd> try_connect(const std::string& host, int port,
                                            const Deadline& deadline, std::string& last_error) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string service = std::to_string(port);
    const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
    if (rc != 0) {
      last_error = std::string("cannot resolve host: ") + ::gai_strerror(rc);
      return std::nullopt;
    }
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(res, &::freeaddrinfo);
    net::Fd fd;
    for (addrinfo* a = res; a && !fd; a = a->ai_next) {
      net::Fd s(
          ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
      if (!s) {
        last_error = net::errno_text(errno);
        continue;
      }
      int err = 0;
      if (::connect(s.get(), a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          // Bounded per attempt so a black-holed address is retried rather than waited on.
          int wait_ms = 1000;
          if (!deadline.infinite()) {
            wait_ms = static_cast<int>(std::min<long>(1000, deadline.remaining().count()));
          }
          pollfd p{s.get(), POLLOUT, 0};
          const int pr = ::poll(&p, 1, wait_ms);
          socklen_t len = sizeof err;
          if (pr == 1) {
            ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          } else {
            err = pr == 0 ? ETIMEDOUT : errno;
          }
        }
      }
      if (err != 0) {
        last_error = net::errno_text(err);
        continue;  // `s` closes
      }
      fd = std::move(s);
    }
    if (!fd) return std::nullopt;
    // Blocking from here on; the 100 ms socket timeouts only let a blocked call look at its
    // deadline.
    const int flags = ::fcntl(fd.get(), F_GETFL);
    ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    timeval tick{0, 100'000};
    ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tick, sizeof tick);
    ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tick, sizeof tick);
    return fd;
  }

  [[noreturn]] void lost(const std::string& what, const std::string& why) {
    broken_ = true;
    throw ConnectionLost("TCPStore: the connection to the server at " + where_ +
                         " was lost during " + what + ": " + why);
  }

  [[noreturn]] void no_answer(const std::string& what) {
    broken_ = true;
    throw StoreTimeoutError("TCPStore(" + where_ + "): Timeout: no answer from the server within " +
                            "the deadline of " + what);
  }

  template <class Describe>
  void send_all(const Deadline& deadline, const Describe& what) {
    std::size_t done = 0;
    while (done < out_.size()) {
      const ssize_t n = ::send(fd_.get(), out_.data() + done, out_.size() - done, MSG_NOSIGNAL);
      if (n >= 0) {
        done += static_cast<std::size_t>(n);
        continue;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (deadline.expired()) no_answer(what());
        continue;
      }
      lost(what(), net::errno_text(errno));
    }
  }

  template <class Describe>
  Reader receive(const Deadline& deadline, const Describe& what) {
    std::size_t have = 0;
    std::size_t need = 5;  // length and status
    if (in_.size() < 4096) in_.resize(4096);
    for (;;) {
      if (have >= 4) {
        const std::size_t len = read_le32(in_.data());
        if (len == 0 || len > kMaxFrameBytes) {
          broken_ = true;
          throw DistNetworkError("TCPStore: malformed reply from " + where_ + " during " + what() +
                                 " (frame length " + std::to_string(len) + ")");
        }
        need = 4 + len;
        if (have >= need) break;
        if (in_.size() < need) in_.resize(need);
      }
      const ssize_t n = ::recv(fd_.get(), in_.data() + have, in_.size() - have, 0);
      if (n > 0) {
        have += static_cast<std::size_t>(n);
        continue;
      }
      if (n == 0) lost(what(), "the server closed the connection");
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (deadline.expired()) no_answer(what());
        continue;
      }
      lost(what(), net::errno_text(errno));
    }
    if (have != need) {
      // The server never sends ahead of a request.
      broken_ = true;
      throw DistNetworkError("TCPStore: " + where_ + " sent more than one reply during " + what());
    }
    status_ = in_[4];
    return Reader(in_.data() + 5, need - 5);
  }

  std::string where_;
  net::Fd fd_;
  Buffer out_;
  Buffer in_;
  std::uint8_t status_ = 0;
  bool broken_ = false;
};

}  // namespace detail

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
