// TCPStore's server, speaking c10d's protocol: an Asio acceptor and every connection on one I/O
// thread, answering WAIT and GET when their keys appear, closing only a connection that breaks the
// protocol.
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
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/ssl.hpp>
#include <asio/steady_timer.hpp>
#include <asio/write.hpp>
#include <atomic>
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
  // With a `secret`, a connection is served only once its client has proved it has the secret
  // (tcp_store_protocol.hpp); until then nothing is read or written on its behalf.
  // With `tls` (a context configured by net::tls::configure), every connection opens with a TLS
  // handshake in which the client must present a certificate the CA signed; the secret's
  // challenge-response and every request then run inside it. Asio's ssl::stream here: the server
  // is all Asio, on one thread.
  Server(const std::string& listen_host, int port, std::chrono::milliseconds handshake_timeout,
         std::optional<std::string> secret, std::shared_ptr<asio::ssl::context> tls = nullptr)
      : acceptor_(io_),
        handshake_timeout_(handshake_timeout),
        secret_(std::move(secret)),
        tls_(std::move(tls)) {
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

  // Waits until the registration counter (c10d's "init/" key: every store object that knows the
  // world size adds 1 to it when it connects) reaches `count`; returns its last value.
  int wait_for_clients(int count, std::chrono::milliseconds timeout) {
    std::unique_lock lock(hello_mu_);
    const Deadline deadline(timeout);
    auto enough = [&] { return registered_ >= count; };
    if (deadline.infinite()) {
      hello_cv_.wait(lock, enough);
    } else {
      hello_cv_.wait_until(lock, deadline.at(), enough);
    }
    return static_cast<int>(registered_);
  }

 private:
  struct Session;

  // A WAIT, GET or MULTI_GET parked until its keys exist. c10d's requests carry no timeout: the
  // client gives up on its own (closing the connection, or with CANCEL_WAIT).
  struct Waiter {
    std::weak_ptr<Session> session;
    Query query = Query::kWait;
    bool done = false;
    std::vector<std::string> keys;
  };

  // How a connection numbers its query types: unknown until its first request.
  // kPrefixed: some PyTorch 2.x releases put the magic number before every query type instead of
  // sending VALIDATE once; the query types are then numbered as after VALIDATE.
  enum class Numbering { kUnknown, kLegacy, kValidated, kPrefixed };

  // One parsed request; nothing is executed before the whole request has arrived.
  struct Request {
    Query query = Query::kUnknown;
    std::uint8_t byte = 0;
    std::vector<std::string> keys;
    std::vector<Bytes> values;
    std::int64_t delta = 0;
    std::uint32_t nonce = 0;
    std::optional<std::uint64_t> count;  // of keys, for the queries that carry one, once read
  };

  struct Session : std::enable_shared_from_this<Session> {
    Session(Server& s, asio::ip::tcp::socket sock)
        : server(s), socket(std::move(sock)), hello_timer(socket.get_executor()) {
      asio::error_code ec;
      auto ep = socket.remote_endpoint(ec);
      peer = ec ? std::string("an unknown peer") : host_port(ep.address().to_string(), ep.port());
    }

    void start() {
      // c10d has no handshake: a connection proves itself with its first complete request (with
      // TLS, the TLS handshake comes first, within the same time).
      hello_timer.expires_after(server.handshake_timeout_);
      hello_timer.async_wait([weak = weak_from_this()](asio::error_code ec) {
        auto self = weak.lock();
        if (ec || !self || self->closed || self->greeted) return;
        self->fail("no request within " + std::to_string(self->server.handshake_timeout_.count()) +
                   " ms");
      });
      if (!server.tls_) return read_more();
      tls = std::make_unique<asio::ssl::stream<asio::ip::tcp::socket&>>(socket, *server.tls_);
      tls->async_handshake(asio::ssl::stream_base::server,
                           [self = shared_from_this()](asio::error_code ec) {
                             if (self->closed) return;
                             if (ec) {
                               self->fail("TLS handshake failed: " + tls_reason(ec));
                               return;
                             }
                             self->read_more();
                           });
    }

    // OpenSSL's reason without Asio's "(SSL routines)" suffix.
    static std::string tls_reason(const asio::error_code& ec) {
      if (ec == asio::error::eof || ec == asio::ssl::error::stream_truncated) {
        return "the peer closed the connection";
      }
      std::string m = ec.message();
      if (const auto at = m.find(" (SSL routines)"); at != std::string::npos) m.erase(at);
      return m;
    }

    void read_more() {
      // Grow by what arrives, never by what a length field claims: a peer announcing a 64 MiB
      // value and sending nothing costs 64 KiB. A partial request doubles the room at most.
      const std::size_t want = std::max<std::size_t>(64 * 1024, in_len);
      if (in.size() - in_len < want / 2 || in.size() == in_len) in.resize(in_len + want);
      reading = true;
      auto done = [self = shared_from_this()](asio::error_code ec, std::size_t n) {
        self->on_read(ec, n);
      };
      if (tls) {
        tls->async_read_some(asio::buffer(in.data() + in_len, in.size() - in_len), done);
      } else {
        socket.async_read_some(asio::buffer(in.data() + in_len, in.size() - in_len), done);
      }
    }

    void on_read(asio::error_code ec, std::size_t n) {
      reading = false;
      if (closed) return;
      if (ec) {
        if (ec == asio::error::operation_aborted) return;
        // A TLS client that closes without close_notify: the end of its stream all the same.
        if (ec == asio::ssl::error::stream_truncated) ec = asio::error::eof;
        if (ec == asio::error::eof && in_len == 0) {
          close();  // an orderly goodbye between requests
        } else if (ec == asio::error::eof) {
          fail("disconnected mid-request (" + std::to_string(in_len) +
               " bytes of an unfinished request received)");
        } else {
          fail("read error: " + ec.message());
        }
        return;
      }
      in_len += n;
      pump();
    }

    // Serves the whole requests already buffered, then reads on. A request is served only once
    // the previous reply has been written, and nothing is read while a reply is being written, so
    // a client that sends requests without reading replies cannot make the server queue replies
    // without bound. (While a wait is parked the reading goes on: that is how a disconnect, a
    // CANCEL_WAIT or a protocol violation is noticed.)
    void pump() {
      try {
        process();
      } catch (const WireError& e) {
        fail(e.what());
        return;
      } catch (const std::exception& e) {
        // A counter that is not a number, out of memory for a big value: c10d's protocol has no
        // error reply, so this connection is closed (as c10d's server does); the others go on.
        fail(std::string("cannot serve the request: ") + e.what());
        return;
      }
      if (!closed && out.empty() && !reading) read_more();
    }

    void process() {
      std::size_t at = 0;
      while (at < in_len && out.empty()) {
        std::size_t used = 0;
        try {
          used = server.serve_one(*this, in.data() + at, in_len - at);
        } catch (const NeedMore&) {
          if (in_len - at > kMaxRequestBytes) {
            throw WireError("a request larger than " + std::to_string(kMaxRequestBytes) + " bytes");
          }
          break;
        }
        at += used;
        if (closed) return;
      }
      if (at > 0) {
        std::memmove(in.data(), in.data() + at, in_len - at);
        in_len -= at;
      }
      // Give back a buffer grown for a big value once it is drained.
      if (in_len == 0 && in.size() > (1u << 20)) in = Buffer();
    }

    void send(Buffer bytes) {
      if (closed) return;
      out.push_back(std::move(bytes));
      if (out.size() == 1) write_front();
    }

    void write_front() {
      auto done = [self = shared_from_this()](asio::error_code ec, std::size_t) {
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
      };
      if (tls) {
        asio::async_write(*tls, asio::buffer(out.front()), std::move(done));
      } else {
        asio::async_write(socket, asio::buffer(out.front()), std::move(done));
      }
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
    std::unique_ptr<asio::ssl::stream<asio::ip::tcp::socket&>> tls;  // with TLS, over `socket`
    asio::steady_timer hello_timer;
    std::string peer;
    Buffer in;
    std::size_t in_len = 0;
    std::deque<Buffer> out;
    Numbering numbering = Numbering::kUnknown;
    bool reading = false;  // an async_read_some is outstanding
    bool greeted = false;  // a first complete request arrived
    bool closed = false;
    // With a secret: 0 waits for the client's challenge, 1 for its proof, 2 authenticated.
    int auth_stage = 0;
    wire::auth::Nonce client_nonce{};
    wire::auth::Nonce server_nonce{};
    std::shared_ptr<Waiter> pending;
    // A request cut short by the end of what was read: the fields read so far, and where the next
    // one starts, counted from the request's first byte (parse_more).
    std::optional<Request> partial;
    std::size_t partial_at = 0;
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

  static std::string byte_text(std::uint8_t b) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", b);
    return hex;
  }

  // Parses one request from the front of [p, p + n) and serves it; returns the bytes it took.
  // NeedMore when the request is not complete yet, WireError when it breaks the protocol.
  std::size_t serve_one(Session& s, const std::uint8_t* p, std::size_t n) {
    if (secret_ && s.auth_stage < 2) return authenticate(s, p, n);
    if (s.partial) {
      // The rest of a request whose first fields came with earlier reads.
      Request q = std::move(*s.partial);
      s.partial.reset();
      Reader r(p, n, s.partial_at);
      return finish(s, std::move(q), r);
    }
    Reader r(p, n);
    std::uint8_t byte = r.u8();
    if (!secret_ && s.numbering == Numbering::kUnknown && byte == kAuthByte) {
      // A client with a secret, and this server has none: say so (the client then gives up).
      if (r.le<std::uint32_t>() != kAuthMagic) throw WireError("a challenge with a wrong magic");
      wire::auth::Nonce ignored{};
      r.fixed(ignored.data(), ignored.size());
      send_byte(s, kAuthNoSecret);
      return r.consumed();
    }
    if (s.numbering == Numbering::kUnknown && byte == (kValidateMagic & 0xff)) {
      // 0xce is no query type of either numbering: only the magic number can start this way.
      Reader probe(p, n);
      if (probe.le<std::uint32_t>() == kValidateMagic) s.numbering = Numbering::kPrefixed;
    }
    if (s.numbering == Numbering::kPrefixed) {
      r = Reader(p, n);
      const auto magic = r.le<std::uint32_t>();
      if (magic != kValidateMagic) {
        throw WireError("a request without the magic number prefix (" + std::to_string(magic) +
                        ")");
      }
      byte = r.u8();
      if (byte == kValidateByte) {
        if (r.le<std::uint32_t>() != kValidateMagic) {
          throw WireError("VALIDATE with a wrong magic number");
        }
        greet(s);
        return r.consumed();
      }
    }
    if (s.numbering == Numbering::kUnknown || s.numbering == Numbering::kValidated) {
      if (byte == kValidateByte) {
        // PyTorch >= 2.2 opens with VALIDATE and its magic. Under the old numbering byte 0 is
        // SET, whose u64 key length could never start with the magic and stay under the key limit.
        const auto magic = r.le<std::uint32_t>();
        if (magic == kValidateMagic) {
          s.numbering = Numbering::kValidated;
          greet(s);
          return r.consumed();
        }
        if (s.numbering == Numbering::kValidated) {
          throw WireError("VALIDATE with a wrong magic number " + std::to_string(magic));
        }
        r = Reader(p, n);
        r.u8();
      }
    }
    if (s.numbering == Numbering::kUnknown) s.numbering = Numbering::kLegacy;
    Request q;
    q.byte = byte;
    q.query = s.numbering == Numbering::kLegacy ? legacy_query(byte) : validated_query(byte);
    return finish(s, std::move(q), r);
  }

  // Reads the rest of request `q` from `r` and serves it. Cut short, the request waits in the
  // session with the fields read so far (and NeedMore goes on to the caller).
  std::size_t finish(Session& s, Request q, Reader& r) {
    try {
      parse_more(q, r);
    } catch (const NeedMore&) {
      s.partial_at = r.consumed();
      s.partial = std::move(q);
      throw;
    }
    if (s.pending && q.query != Query::kCancelWait) {
      // A PyTorch 1.13 client whose wait timed out goes on with its next request without
      // cancelling: the wait is abandoned. Dropping it here also spares that client a stale
      // STOP_WAITING later (c10d's own server would still send one).
      drop_waiter(s.pending);
      s.pending.reset();
    }
    greet(s);
    execute(s, q);
    return r.consumed();
  }

  static void send_byte(Session& s, std::uint8_t b) {
    Buffer reply;
    reply.push_back(b);
    s.send(std::move(reply));
  }

  // The server's side of the challenge-response (tcp_store_protocol.hpp). A WireError closes the
  // connection with the reason logged, naming the peer and never the secret.
  std::size_t authenticate(Session& s, const std::uint8_t* p, std::size_t n) {
    Reader r(p, n);
    if (s.auth_stage == 0) {
      const std::uint8_t byte = r.u8();
      if (byte != kAuthByte) {
        throw WireError("authentication failed: the client sent query type " + byte_text(byte) +
                        " without authenticating (it has no shared secret configured, and this "
                        "server requires one)");
      }
      if (r.le<std::uint32_t>() != kAuthMagic) {
        throw WireError("authentication failed: the client's challenge has a wrong magic number");
      }
      r.fixed(s.client_nonce.data(), s.client_nonce.size());
      s.server_nonce = wire::auth::make_nonce();
      const wire::auth::Proof proof =
          wire::auth::compute_proof(*secret_, wire::auth::Prover::kAcceptor, s.client_nonce,
                                    s.server_nonce, kStoreClientParty, kStoreServerParty);
      Buffer reply;
      reply.push_back(kAuthChallenge);
      reply.insert(reply.end(), s.server_nonce.begin(), s.server_nonce.end());
      reply.insert(reply.end(), proof.begin(), proof.end());
      s.auth_stage = 1;
      s.send(std::move(reply));
      return r.consumed();
    }
    wire::auth::Proof answer{};
    r.fixed(answer.data(), answer.size());
    const wire::auth::Proof expected =
        wire::auth::compute_proof(*secret_, wire::auth::Prover::kDialler, s.client_nonce,
                                  s.server_nonce, kStoreClientParty, kStoreServerParty);
    if (!wire::auth::same_proof(expected, answer)) {
      throw WireError(
          "authentication failed: the client answered our challenge with a wrong proof (a "
          "different shared secret, or a replayed answer)");
    }
    s.auth_stage = 2;
    send_byte(s, kAuthAccepted);
    return r.consumed();
  }

  static void greet(Session& s) {
    if (s.greeted) return;
    s.greeted = true;
    s.hello_timer.cancel();
  }

  // Reads the fields of `q` not read yet. Cut short by the end of the bytes (NeedMore), it keeps
  // the fields it read and leaves `r` at the start of the next one, and a later call goes on from
  // there: each field is read and copied once however the request arrives (re-reading from the
  // start would copy a 64 MiB value again for every piece of the next one).
  static void parse_more(Request& q, Reader& r) {
    switch (q.query) {
      case Query::kSet:
      case Query::kAppend:
        if (q.keys.empty()) q.keys.push_back(r.key("key"));
        q.values.push_back(r.bytes("value"));
        return;
      case Query::kCompareSet:
        if (q.keys.empty()) q.keys.push_back(r.key("key"));
        if (q.values.empty()) q.values.push_back(r.bytes("expected value"));
        q.values.push_back(r.bytes("desired value"));
        return;
      case Query::kGet:
      case Query::kDelete:
        q.keys.push_back(r.key("key"));
        return;
      case Query::kAdd:
        if (q.keys.empty()) q.keys.push_back(r.key("key"));
        q.delta = r.le<std::int64_t>();
        return;
      case Query::kCheck:
      case Query::kWait:
      case Query::kMultiGet:
        if (!q.count) q.count = r.count("key");
        while (q.keys.size() < *q.count) q.keys.push_back(r.key("key"));
        return;
      case Query::kMultiSet:
        if (!q.count) q.count = r.count("key");
        while (q.values.size() < *q.count) {
          if (q.keys.size() == q.values.size()) q.keys.push_back(r.key("key"));
          q.values.push_back(r.bytes("value"));
        }
        return;
      case Query::kPing:
        q.nonce = r.le<std::uint32_t>();
        return;
      case Query::kNumKeys:
      case Query::kCancelWait:
        return;
      case Query::kWatchKey:
        throw WireError("WATCH_KEY (key change callbacks) is not supported by this server");
      case Query::kUnknown:
        break;
    }
    throw WireError("unknown query type " + byte_text(q.byte));
  }

  void execute(Session& s, Request& q) {
    static constexpr const char* kName = "TCPStore server";
    switch (q.query) {
      case Query::kSet:
        put(q.keys[0], std::move(q.values[0]));
        return;
      case Query::kMultiSet:
        for (std::size_t i = 0; i < q.keys.size(); ++i) put(q.keys[i], std::move(q.values[i]));
        return;
      case Query::kAppend: {
        auto& v = map_[q.keys[0]];
        if (v.size() + q.values[0].size() > Store::kMaxValueBytes) {
          throw WireError("APPEND would grow the value of " + quote_key(q.keys[0]) +
                          " over the limit of " + std::to_string(Store::kMaxValueBytes) + " bytes");
        }
        v.insert(v.end(), q.values[0].begin(), q.values[0].end());
        changed(q.keys[0]);
        return;
      }
      case Query::kCompareSet: {
        const std::string& key = q.keys[0];
        Bytes& expected = q.values[0];
        Bytes& desired = q.values[1];
        Buffer b;
        auto it = map_.find(key);
        if (it == map_.end()) {
          if (expected.empty()) {
            put_str(b, desired);
            put(key, std::move(desired));
          } else {
            // c10d answers the expected value when the key is missing; so do we.
            put_str(b, expected);
          }
        } else if (it->second == expected) {
          put_str(b, desired);
          put(key, std::move(desired));
        } else {
          put_str(b, it->second);
        }
        s.send(std::move(b));
        return;
      }
      case Query::kAdd: {
        const std::string& key = q.keys[0];
        auto it = map_.find(key);
        const std::int64_t old = it == map_.end() ? 0 : parse_counter(kName, key, it->second);
        const std::int64_t now = checked_add(kName, key, old, q.delta);
        Buffer b;
        put_le<std::int64_t>(b, now);
        s.send(std::move(b));
        put(key, format_counter(now));
        return;
      }
      case Query::kCheck: {
        Buffer b;
        b.push_back(all_present(q.keys) ? kReady : kNotReady);
        s.send(std::move(b));
        return;
      }
      case Query::kGet:
      case Query::kWait:
      case Query::kMultiGet:
        park(s, q.query, std::move(q.keys));
        return;
      case Query::kCancelWait: {
        if (s.pending) drop_waiter(s.pending);
        s.pending.reset();
        s.send(Buffer{kWaitCanceled});
        return;
      }
      case Query::kNumKeys: {
        Buffer b;
        put_le<std::int64_t>(b, static_cast<std::int64_t>(map_.size()));
        s.send(std::move(b));
        return;
      }
      case Query::kDelete: {
        Buffer b;
        const bool existed = map_.erase(q.keys[0]) > 0;
        put_le<std::int64_t>(b, existed ? 1 : 0);
        s.send(std::move(b));
        if (existed && q.keys[0] == kInitKey) count_registrations();
        return;
      }
      case Query::kPing: {
        Buffer b;
        put_le<std::uint32_t>(b, q.nonce);
        s.send(std::move(b));
        return;
      }
      case Query::kWatchKey:
      case Query::kUnknown:
        break;
    }
    throw WireError("unknown query type " + byte_text(q.byte));
  }

  void put(const std::string& key, Bytes value) {
    map_[key] = std::move(value);
    changed(key);
  }

  void changed(const std::string& key) {
    if (key == kInitKey) count_registrations();
    wake(key);
  }

  // Publishes the value of "init/" to wait_for_clients(); a value that is not a counter reads 0.
  void count_registrations() {
    std::int64_t n = 0;
    auto it = map_.find(std::string(kInitKey));
    if (it != map_.end()) {
      try {
        n = parse_counter("TCPStore server", kInitKey, it->second);
      } catch (const DistStoreError&) {
        n = 0;
      }
    }
    {
      std::lock_guard lock(hello_mu_);
      registered_ = n;
    }
    hello_cv_.notify_all();
  }

  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return map_.contains(k); });
  }

  // Answers at once when the keys exist, else parks the request until wake() (or the client's
  // CANCEL_WAIT or disconnect).
  void park(Session& s, Query query, std::vector<std::string> keys) {
    if (all_present(keys)) {
      answer_ready(s, query, keys);
      return;
    }
    auto w = std::make_shared<Waiter>();
    w->session = s.weak_from_this();
    w->query = query;
    w->keys = std::move(keys);
    for (const auto& k : w->keys) {
      if (!map_.contains(k)) waiters_[k].push_back(w);
    }
    s.pending = w;
  }

  void answer_ready(Session& s, Query query, const std::vector<std::string>& keys) {
    Buffer b;
    if (query == Query::kWait) {
      b.push_back(kStopWaiting);
    } else {
      for (const auto& k : keys) put_str(b, map_.at(k));
    }
    s.send(std::move(b));
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
      answer_ready(*session, w->query, w->keys);
    }
  }

  void drop_waiter(const std::shared_ptr<Waiter>& w) {
    if (w->done) return;
    w->done = true;
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
  std::optional<std::string> secret_;        // the shared secret clients must prove; none: no check
  std::shared_ptr<asio::ssl::context> tls_;  // with TLS: what every connection's session comes from
  std::uint16_t port_ = 0;
  std::string name_;
  std::unordered_map<std::string, Bytes> map_;
  std::unordered_map<std::string, std::vector<std::shared_ptr<Waiter>>> waiters_;
  std::unordered_set<std::shared_ptr<Session>> sessions_;
  std::mutex hello_mu_;
  std::condition_variable hello_cv_;
  std::int64_t registered_ = 0;  // the value of "init/"
  std::thread thread_;
};

}  // namespace distrpc::store::detail
