// TCPStore's server: an Asio acceptor and every connection on one I/O thread, answering GET and
// WAIT when their keys appear, closing only a connection that breaks the protocol.
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

#include "distrpc/store/detail/tcp_store_protocol.hpp"

namespace distrpc::store::detail {
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

}  // namespace distrpc::store::detail
