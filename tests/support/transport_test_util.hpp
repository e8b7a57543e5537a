// What the transport test files share: an inbox recording a Context's callbacks, a node (Context +
// inbox) for any policy, byte-exact message helpers, and the scenarios the conformance suite runs
// for every policy. Header-only, used by the transport tests (one binary, test_wire).
#pragma once

#include <sys/resource.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/log.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/message.hpp"
#include "support/error_text.hpp"

namespace distrpc::testing {

using namespace std::chrono_literals;

// The text of what fn() threw, checking the exception's exact type.
template <class E, class Fn>
std::string thrown_exactly(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    CHECK_MESSAGE(typeid(e) == typeid(E), "threw " << typeid(e).name() << ": " << e.what());
    return e.what();
  }
  FAIL_CHECK("nothing was thrown");
  return {};
}

// What a Context reported, for the test thread to wait on.
struct Inbox {
  using Clock = std::chrono::steady_clock;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<int, wire::Message>> messages;
  std::vector<std::pair<int, std::string>> lost;
  std::vector<Clock::time_point> lost_at;

  transport::TransportCallbacks callbacks() {
    transport::TransportCallbacks cb;
    cb.on_message = [this](int peer, wire::Message&& m) {
      std::lock_guard<std::mutex> lk(mu);
      messages.emplace_back(peer, std::move(m));
      cv.notify_all();
    };
    cb.on_peer_lost = [this](int peer, const std::string& reason) {
      std::lock_guard<std::mutex> lk(mu);
      lost.emplace_back(peer, reason);
      lost_at.push_back(Clock::now());
      cv.notify_all();
    };
    return cb;
  }
  bool wait_messages(std::size_t n, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, timeout, [&] { return messages.size() >= n; });
  }
  bool wait_lost(std::size_t n, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, timeout, [&] { return lost.size() >= n; });
  }
  std::size_t message_count() {
    std::lock_guard<std::mutex> lk(mu);
    return messages.size();
  }
  std::size_t lost_count() {
    std::lock_guard<std::mutex> lk(mu);
    return lost.size();
  }
  wire::Message take(std::size_t i) {
    std::lock_guard<std::mutex> lk(mu);
    return std::move(messages.at(i).second);
  }
};

inline transport::TransportOptions options_for(int id, const std::string& token = "",
                                               std::chrono::milliseconds connect_timeout = 5s) {
  transport::TransportOptions o;
  o.self_id = id;
  o.self_name = "w" + std::to_string(id);
  o.auth_token = token;
  o.connect_timeout = connect_timeout;
  return o;
}

// A Context of policy P with its inbox. The inbox is declared first so it outlives the
// Context's callbacks.
template <class P>
struct NodeOf {
  explicit NodeOf(const transport::TransportOptions& o)
      : ctx(std::make_unique<typename P::Context>(o, inbox.callbacks())) {}
  explicit NodeOf(int id) : NodeOf(options_for(id)) {}
  Inbox inbox;
  std::unique_ptr<typename P::Context> ctx;
};

template <class N>
void introduce(N& a, int a_id, N& b, int b_id) {
  a.ctx->add_peer(b_id, "w" + std::to_string(b_id), b.ctx->address());
  b.ctx->add_peer(a_id, "w" + std::to_string(a_id), a.ctx->address());
}

// A kByte view over any CPU contiguous tensor's bytes (what the wire layer sends).
inline at::Tensor bytes_of(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {static_cast<int64_t>(t.nbytes())}, at::kByte);
}

inline wire::Message make_message(wire::MessageType type, std::uint64_t id, std::string payload,
                                  std::vector<at::Tensor> buffers = {}) {
  wire::Message m;
  m.type = type;
  m.id = id;
  m.payload = std::move(payload);
  m.buffers = std::move(buffers);
  return m;
}

// CPU time (user + system) of this whole process so far, in seconds.
inline double process_cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// The CPU this whole process uses in the second that starts `after` from now, in percent of one
// core: what a transport costs while its threads poll, or once they sleep.
inline double cpu_percent_in_a_second(std::chrono::milliseconds after) {
  std::this_thread::sleep_for(after);
  const double c0 = process_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 100.0 * (process_cpu_seconds() - c0) / wall;
}

// 200 messages each way between workers 0 (a) and 1 (b), all delivered.
template <class N>
void exchange_a_while(N& a, N& b) {
  for (int i = 0; i < 200; ++i) {
    a.ctx->send(1, make_message(wire::MessageType::Request, i, "warm"));
    b.ctx->send(0, make_message(wire::MessageType::Response, i, "warm"));
  }
  REQUIRE(a.inbox.wait_messages(200));
  REQUIRE(b.inbox.wait_messages(200));
}

// Pseudo-random bytes, different per seed, so a misplaced byte shows.
inline at::Tensor pattern_bytes(std::int64_t n, std::uint32_t seed) {
  at::Tensor t = at::empty({n}, at::kByte);
  auto* p = t.data_ptr<std::uint8_t>();
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::int64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<std::uint8_t>(x);
  }
  return t;
}

inline bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() != b.numel()) return false;
  return a.numel() == 0 ||
         std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<std::size_t>(a.numel())) == 0;
}

// The good peer still works both ways, a tensor included: proves that one bad connection or
// record did not take the transport down.
template <class N>
void check_still_works(N& a, N& b, std::uint64_t id) {
  const std::size_t before_a = a.inbox.message_count();
  const std::size_t before_b = b.inbox.message_count();
  b.ctx->send(0, make_message(wire::MessageType::Request, id, "still-alive"));
  a.ctx->send(
      1, make_message(wire::MessageType::Response, id, "still-alive", {pattern_bytes(100000, 5)}));
  REQUIRE(a.inbox.wait_messages(before_a + 1));
  REQUIRE(b.inbox.wait_messages(before_b + 1));
  {
    std::lock_guard<std::mutex> lk(a.inbox.mu);
    CHECK(a.inbox.messages.back().first == 1);
    CHECK(a.inbox.messages.back().second.id == id);
    CHECK(a.inbox.messages.back().second.payload == "still-alive");
  }
  std::lock_guard<std::mutex> lk(b.inbox.mu);
  CHECK(b.inbox.messages.back().first == 0);
  CHECK(same_bytes(b.inbox.messages.back().second.buffers.at(0), pattern_bytes(100000, 5)));
}

// Worker 7 moved by add_peer() while a's send() to it dials its old address, where an old
// incarnation played by hand has taken the Hello and answers only once `moved` is set: the send
// reaches `replacement` (at the new address), nothing reached the old one, and nobody is lost.
// The caller then checks what its old incarnation saw.
template <class N>
void check_send_follows_move(N& a, N& replacement, std::future<void> dialled,
                             std::promise<void>& moved) {
  std::promise<std::string> sent;
  std::thread sender([&] {
    try {
      a.ctx->send(7, make_message(wire::MessageType::Request, 1, "for the replacement"));
      sent.set_value("");
    } catch (const DistNetworkError& e) {
      sent.set_value(e.what());
    }
  });
  const bool dialling = dialled.wait_for(10s) == std::future_status::ready;
  CHECK(dialling);
  a.ctx->add_peer(7, "w7", replacement.ctx->address());
  moved.set_value();
  std::future<std::string> outcome = sent.get_future();
  const bool done = outcome.wait_for(10s) == std::future_status::ready;
  CHECK(done);
  sender.join();  // within connect_timeout either way: no REQUIRE may leave it running
  CHECK(outcome.get() == "");
  // CHECKs only from here: the caller's thread playing the old incarnation is still to be joined.
  const bool arrived = replacement.inbox.wait_messages(1, 5s);
  CHECK(arrived);
  if (arrived) {
    std::lock_guard<std::mutex> lk(replacement.inbox.mu);
    CHECK(replacement.inbox.messages[0].first == 0);
    CHECK(replacement.inbox.messages[0].second.payload == "for the replacement");
  }
  std::this_thread::sleep_for(200ms);  // time for a wrongly reported loss to arrive
  CHECK(a.inbox.lost_count() == 0);
  CHECK_NOTHROW(a.ctx->send(7, make_message(wire::MessageType::Request, 2, "again")));
  CHECK(replacement.inbox.wait_messages(2, 5s));
}

// Every diagnostic written while alive (a user sink, whatever the default routing is): for the
// tests that check what a refusal logged.
class LogLines {
 public:
  LogLines() {
    distrpc::set_log_sink([this](distrpc::LogLevel, std::string_view who, std::string_view text) {
      std::lock_guard<std::mutex> lk(mu_);
      lines_.push_back(std::string(who) + ": " + std::string(text));
    });
  }
  ~LogLines() { distrpc::set_log_sink(nullptr); }
  LogLines(const LogLines&) = delete;
  LogLines& operator=(const LogLines&) = delete;
  // Waits up to 5 s for a line containing `part`; returns it ("" if none came).
  std::string wait_for(const std::string& part) {
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < until) {
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

// For scenarios whose on_message offers tasks inline (transport.hpp InlineScope): what reached
// the fallback, under the one mutex the scenario also uses for its own records.
struct FallbackLog {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::function<void()>> queued;  // tasks passed to the fallback
  std::vector<std::uint64_t> queued_ids;
  std::function<bool(std::function<void()>)> fallback_for(std::uint64_t id) {
    return [this, id](std::function<void()> t) {
      {
        std::lock_guard<std::mutex> lk(mu);
        queued.push_back(std::move(t));
        queued_ids.push_back(id);
      }
      cv.notify_all();
      return true;
    };
  }
  // Offers `task` to the scope open on this thread; when refused (no scope, or it holds a task
  // already: a second message of the same read) queues it here, as the agent queues to its pool.
  void offer_or_queue(std::uint64_t id, std::function<void()> task) {
    const auto fallback = fallback_for(id);
    if (!transport::offer_inline(task, fallback)) fallback(std::move(task));
  }
};

// A receiver (worker 1) with the scenario's callbacks, introduced to `a` (worker 0).
template <class P>
std::unique_ptr<typename P::Context> receiver_for(NodeOf<P>& a, transport::TransportCallbacks cb) {
  auto b = std::make_unique<typename P::Context>(options_for(1), std::move(cb));
  a.ctx->add_peer(1, "w1", b->address());
  b->add_peer(0, "w0", a.ctx->address());
  return b;
}

// Leader/follower (transport.hpp InlineScope), for any policy that opens the scope: a task handed
// back from on_message runs on the thread that read its message, after reading was re-armed, so a
// blocked task never stops the connection; at most one runs at a time; the rest go to the fallback,
// each exactly once.
template <class P>
void handed_back_task_scenario() {
  FallbackLog log;
  auto& mu = log.mu;
  auto& cv = log.cv;
  auto& queued = log.queued;
  auto& queued_ids = log.queued_ids;
  std::vector<std::uint64_t> order;                     // ids as on_message saw them
  std::map<std::uint64_t, std::thread::id> read_on;     // id -> thread that delivered it
  std::map<std::uint64_t, std::thread::id> ran_inline;  // id -> thread that ran its task inline
  int inline_now = 0, inline_max = 0;
  bool release = false;

  transport::TransportCallbacks cb;
  cb.on_message = [&](int, wire::Message&& m) {
    const std::uint64_t id = m.id;
    const bool blocks = m.payload == "block";
    {
      std::lock_guard<std::mutex> lk(mu);
      order.push_back(id);
      read_on[id] = std::this_thread::get_id();
    }
    cv.notify_all();
    std::function<void()> task = [&, id, blocks] {
      std::unique_lock<std::mutex> lk(mu);
      ran_inline[id] = std::this_thread::get_id();
      inline_max = std::max(inline_max, ++inline_now);
      cv.notify_all();
      if (blocks) cv.wait(lk, [&] { return release; });
      --inline_now;
      cv.notify_all();  // the test waits for inline_now == 0
    };
    log.offer_or_queue(id, std::move(task));
  };
  cb.on_peer_lost = [](int, const std::string&) {};
  NodeOf<P> a(0);
  auto b = receiver_for(a, cb);

  // 1. A lone message: its task runs inline, on the thread that read it.
  a.ctx->send(1, make_message(wire::MessageType::Request, 1, "block"));
  {
    std::unique_lock<std::mutex> lk(mu);
    REQUIRE(cv.wait_for(lk, 10s, [&] { return ran_inline.count(1) == 1; }));
    CHECK(ran_inline[1] == read_on[1]);
  }
  // 2. While it blocks, 50 more messages are still read and delivered in order (by the other
  //    reading thread); none of their tasks runs inline (one is already running).
  for (std::uint64_t id = 2; id <= 51; ++id) {
    a.ctx->send(1, make_message(wire::MessageType::Request, id, "quick"));
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    // (A task reaches the fallback just after its message was delivered: wait for both.)
    CHECK(cv.wait_for(lk, 10s, [&] { return order.size() == 51 && queued.size() == 50; }));
    CHECK(order.size() == 51);
    CHECK(queued.size() == 50);
    CHECK(ran_inline.size() == 1);
    CHECK(read_on[2] != read_on[1]);
    release = true;
  }
  cv.notify_all();
  for (std::uint64_t i = 0; i < order.size(); ++i) CHECK(order[i] == i + 1);

  // 3. Quiet again: a lone message runs inline once more. (The thread that ran task 1 needs a
  //    moment to offer itself for reading again; until then a lone task is queued, correctly:
  //    so send lone messages, each after the previous one settled, until one runs inline.)
  {
    std::unique_lock<std::mutex> lk(mu);
    REQUIRE(cv.wait_for(lk, 10s, [&] { return inline_now == 0; }));
  }
  std::uint64_t last = 51;
  bool ran_lone_inline = false;
  for (int attempt = 0; attempt < 20 && !ran_lone_inline; ++attempt) {
    const std::uint64_t id = ++last;
    a.ctx->send(1, make_message(wire::MessageType::Request, id, "quick"));
    std::unique_lock<std::mutex> lk(mu);
    REQUIRE(cv.wait_for(lk, 10s, [&] {
      return ran_inline.count(id) == 1 ||
             std::find(queued_ids.begin(), queued_ids.end(), id) != queued_ids.end();
    }));
    ran_lone_inline = ran_inline.count(id) == 1;
    if (ran_lone_inline) CHECK(ran_inline[id] == read_on[id]);
    lk.unlock();
    if (!ran_lone_inline) std::this_thread::sleep_for(5ms);
  }
  CHECK(ran_lone_inline);
  {
    std::unique_lock<std::mutex> lk(mu);
    REQUIRE(cv.wait_for(lk, 10s, [&] { return inline_now == 0; }));
    CHECK(inline_max == 1);
    // Every offered task went one way, exactly once.
    std::set<std::uint64_t> seen(queued_ids.begin(), queued_ids.end());
    CHECK(seen.size() == queued_ids.size());
    for (const auto& [id, t] : ran_inline) CHECK(seen.count(id) == 0);
    CHECK(seen.size() + ran_inline.size() == last);
  }
  b->shutdown();
  a.ctx->shutdown();
  for (auto& t : queued) t();  // what the fallback received is a runnable task
  CHECK(inline_max == 1);
  std::function<void()> outside = [] {};
  CHECK_FALSE(transport::offer_inline(outside, {}));  // no scope open on this thread
  CHECK(outside);                                     // and the task was not taken
}

// A stream whose first task blocks: the messages behind it are still read and delivered, in
// order and soon (a policy may leave its rings unattended while a reading thread runs the task
// it read, as shm does in a stream, but only for a bounded time before another thread reads),
// and their tasks go to the fallback while it blocks, each exactly once.
// With `first_runs_inline`, the policy must run the first (blocking) task on its reading thread.
template <class P>
void blocked_stream_scenario(bool first_runs_inline) {
  using Clock = std::chrono::steady_clock;
  FallbackLog log;
  auto& mu = log.mu;
  auto& cv = log.cv;
  std::vector<std::uint64_t> order;
  std::set<std::uint64_t> ran_inline;
  // Tasks that ran on a reading thread while the blocking one blocked: must be none. (Before it
  // starts, another reading thread may run the task of a message it read later: that one
  // finished, so nothing ran at the same time.)
  std::size_t ran_while_blocked = 0;
  std::string while_blocked_detail;  // which task ran while which one blocked (for the message)
  std::uint64_t blocking_id = 0;
  bool blocking = false, release = false;
  transport::TransportCallbacks cb;
  cb.on_message = [&](int, wire::Message&& m) {
    const std::uint64_t id = m.id;
    const bool blocks = m.payload == "block";
    {
      std::lock_guard<std::mutex> lk(mu);
      order.push_back(id);
    }
    cv.notify_all();
    std::function<void()> task = [&, id, blocks] {
      std::unique_lock<std::mutex> lk(mu);
      ran_inline.insert(id);
      if (blocking) {
        ++ran_while_blocked;
        while_blocked_detail += " task " + std::to_string(id) + " ran while task " +
                                std::to_string(blocking_id) + " blocked;";
      }
      if (blocks) {
        blocking = true;
        blocking_id = id;
        cv.notify_all();
        cv.wait(lk, [&] { return release; });
        // It stops blocking here, and only here: a blocking task that starts late, inside the
        // release window, must not leave the flag set for the next round.
        blocking = false;
      }
    };
    log.offer_or_queue(id, std::move(task));
  };
  cb.on_peer_lost = [](int, const std::string&) {};
  NodeOf<P> a(0);
  auto b = receiver_for(a, cb);

  constexpr std::uint64_t kCount = 200;
  for (int round = 0; round < 3; ++round) {
    // Sent back to back: the first is followed at once by the rest.
    const std::uint64_t base = round * kCount;
    a.ctx->send(1, make_message(wire::MessageType::Request, base + 1, "block"));
    for (std::uint64_t id = base + 2; id <= base + kCount; ++id) {
      a.ctx->send(1, make_message(wire::MessageType::Request, id, "quick"));
    }
    const auto t0 = Clock::now();
    std::unique_lock<std::mutex> lk(mu);
    // Unless the blocking task went to the fallback (never run here), it blocks now, and still
    // every message arrives.
    REQUIRE(cv.wait_for(lk, 10s, [&] { return order.size() == base + kCount; }));
    CHECK(Clock::now() - t0 < 2s);
    for (std::uint64_t i = 0; i < order.size(); ++i) CHECK(order[i] == i + 1);
    if (first_runs_inline) {
      CHECK(cv.wait_for(lk, 10s, [&] { return ran_inline.count(base + 1) == 1; }));
    }
    const bool inline_block = ran_inline.count(base + 1) == 1;
    if (inline_block) {
      CHECK(blocking);
      // Nothing else ran on a reading thread while it blocked, and all went one way, once.
      CHECK(cv.wait_for(
          lk, 10s, [&] { return log.queued_ids.size() + ran_inline.size() == base + kCount; }));
      INFO("round " << round << ":" << while_blocked_detail);
      CHECK(ran_while_blocked == 0);
    }
    std::set<std::uint64_t> seen(log.queued_ids.begin(), log.queued_ids.end());
    CHECK(seen.size() == log.queued_ids.size());
    for (auto id : ran_inline) CHECK(seen.count(id) == 0);
    release = true;
    lk.unlock();
    cv.notify_all();
    std::this_thread::sleep_for(20ms);
    lk.lock();
    release = false;
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    release = true;
  }
  cv.notify_all();
  b->shutdown();
  a.ctx->shutdown();
}

// drive() (transport.hpp): a thread waiting for a message reads it itself while no other thread
// does. Whatever it reads is delivered as usual, but a task on_message hands back is never run on
// it (it goes to the fallback, once); drive() stops at its deadline; and afterwards the policy's
// own threads read again. Which thread reads a given message is a race, so the test asks that the
// driving thread read some of the lone messages (200, or up to 2,000 until it read one: a loaded
// machine, or a sanitizer build, can let the policy's threads win 200 times in a row), and checks
// the rules on every one it read.
template <class P>
void driven_reply_scenario() {
  using Clock = std::chrono::steady_clock;
  FallbackLog log;
  auto& mu = log.mu;
  auto& cv = log.cv;
  auto& queued = log.queued;
  auto& queued_ids = log.queued_ids;
  std::map<std::uint64_t, std::thread::id> read_on;
  std::map<std::uint64_t, std::thread::id> ran_on;

  transport::TransportCallbacks cb;
  cb.on_message = [&](int, wire::Message&& m) {
    const std::uint64_t id = m.id;
    {
      std::lock_guard<std::mutex> lk(mu);
      read_on[id] = std::this_thread::get_id();
    }
    cv.notify_all();
    if (m.type != wire::MessageType::Request) return;
    std::function<void()> task = [&, id] {
      std::lock_guard<std::mutex> lk(mu);
      ran_on[id] = std::this_thread::get_id();
      cv.notify_all();
    };
    log.offer_or_queue(id, std::move(task));
  };
  cb.on_peer_lost = [](int, const std::string&) {};
  NodeOf<P> a(0);
  auto b = receiver_for(a, cb);
  auto delivered = [&](std::uint64_t id) {
    std::lock_guard<std::mutex> lk(mu);
    return read_on.count(id) == 1;
  };

  // 1. Lone messages, each awaited with drive() the way a caller awaits its reply; every third
  //    is a request whose task the receiver offers to run inline.
  const auto me = std::this_thread::get_id();
  int read_here = 0;
  std::uint64_t last = 0;  // the last lone message's id
  for (std::uint64_t id = 1; id <= 2000 && (id <= 200 || read_here == 0); ++id) {
    last = id;
    const auto type = id % 3 == 0 ? wire::MessageType::Request : wire::MessageType::Response;
    a.ctx->send(1, make_message(type, id, "m" + std::to_string(id)));
    b->drive([&] { return delivered(id); }, Clock::now() + 2ms);
    std::unique_lock<std::mutex> lk(mu);
    REQUIRE(cv.wait_for(lk, 10s, [&] { return read_on.count(id) == 1; }));
    if (read_on[id] == me) ++read_here;
  }
  CHECK(read_here > 0);
  {
    std::unique_lock<std::mutex> lk(mu);
    // Every request's task ran once or was queued once, and none ran on the driving thread.
    const std::size_t requests = static_cast<std::size_t>(last / 3);
    REQUIRE(cv.wait_for(lk, 10s, [&] { return ran_on.size() + queued_ids.size() == requests; }));
    for (const auto& [id, t] : ran_on) CHECK(t != me);
    std::set<std::uint64_t> seen(queued_ids.begin(), queued_ids.end());
    CHECK(seen.size() == queued_ids.size());
    for (const auto& [id, t] : ran_on) CHECK(seen.count(id) == 0);
    for (const auto& [id, t] : read_on) {
      if (t == me && id % 3 == 0) CHECK(seen.count(id) == 1);
    }
  }
  // 2. With nothing to read, drive() returns at its deadline (and at once when done() holds).
  auto t0 = Clock::now();
  b->drive([] { return false; }, Clock::now() + 20ms);
  const auto waited = Clock::now() - t0;
  CHECK(waited >= 20ms);
  CHECK(waited < 1s);
  t0 = Clock::now();
  b->drive([] { return true; }, Clock::now() + 10s);
  CHECK(Clock::now() - t0 < 1s);
  // 3. No caller drives any more: the policy's threads read again, also after they went idle.
  for (std::uint64_t id = last + 1; id <= last + 20; ++id) {
    a.ctx->send(1, make_message(wire::MessageType::Response, id, "later"));
    if (id % 5 == 0) std::this_thread::sleep_for(2ms);
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    CHECK(cv.wait_for(lk, 10s, [&] { return read_on.size() == last + 20; }));
    for (std::uint64_t id = last + 1; id <= last + 20; ++id) CHECK(read_on[id] != me);
  }
  b->shutdown();
  a.ctx->shutdown();
  for (auto& t : queued) t();
}

// drive() again: a library task that the waiting thread runs for what it read
// (run_library_here()) may itself wait, for long, for another message. The policy's own threads
// must read that message meanwhile: a driving thread busy with a task must not keep them from
// reading. As above, which thread reads the first message is a race; attempts go on (up to 20)
// until the driving thread ran the task, and every attempt must see the second message arrive.
template <class P>
void driven_task_waits_scenario() {
  using Clock = std::chrono::steady_clock;
  std::mutex mu;
  std::condition_variable cv;
  std::set<std::uint64_t> delivered;
  std::map<std::uint64_t, bool> on_driver;  // a waiting task's id -> it ran on the driving thread
  std::map<std::uint64_t, bool> saw_next;   // a waiting task's id -> the next message came
  std::vector<std::thread> elsewhere;       // tasks the policy passed to the fallback
  struct JoinAll {
    std::vector<std::thread>& threads;
    ~JoinAll() {
      for (auto& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } join_all{elsewhere};  // also when a REQUIRE ends the scenario early
  transport::TransportCallbacks cb;
  cb.on_message = [&](int, wire::Message&& m) {
    const std::uint64_t id = m.id;
    {
      std::lock_guard<std::mutex> lk(mu);
      delivered.insert(id);
    }
    cv.notify_all();
    if (m.payload != "wait") return;
    std::function<void()> task = [&, id] {
      std::unique_lock<std::mutex> lk(mu);
      on_driver[id] = transport::in_wait_driver();
      cv.notify_all();
      saw_next[id] = cv.wait_for(lk, 5s, [&] { return delivered.count(id + 1) == 1; });
      cv.notify_all();
    };
    const std::function<bool(std::function<void()>)> fallback = [&](std::function<void()> t) {
      std::lock_guard<std::mutex> lk(mu);
      elsewhere.emplace_back(std::move(t));
      return true;
    };
    if (!transport::offer_inline_library(task, fallback)) fallback(std::move(task));
  };
  cb.on_peer_lost = [](int, const std::string&) {};
  NodeOf<P> a(0);
  auto b = receiver_for(a, cb);
  bool ran_on_driver = false;
  for (std::uint64_t attempt = 0; attempt < 20 && !ran_on_driver; ++attempt) {
    const std::uint64_t id = 2 * attempt + 1;
    std::thread sender([&] {
      std::this_thread::sleep_for(20ms);  // the test thread is in drive() by then
      a.ctx->send(1, make_message(wire::MessageType::Response, id, "wait"));
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait_for(lk, 10s, [&] { return on_driver.count(id) == 1; });  // the task waits now
      }
      a.ctx->send(1, make_message(wire::MessageType::Response, id + 1, "next"));
    });
    b->drive(
        [&] {
          std::lock_guard<std::mutex> lk(mu);
          return saw_next.count(id) == 1;
        },
        Clock::now() + 10s);
    sender.join();
    std::unique_lock<std::mutex> lk(mu);
    REQUIRE(cv.wait_for(lk, 10s, [&] { return saw_next.count(id) == 1; }));
    CAPTURE(attempt);
    CHECK(saw_next[id]);  // the second message was read while the task waited for it
    ran_on_driver = on_driver[id];
  }
  CHECK(ran_on_driver);
  b->shutdown();
  a.ctx->shutdown();
}

// The transport contract (transport.hpp): a peer whose messages already arrive cannot be
// answered until add_peer() gave its address; the refusal names it, and nothing is lost after.
template <class P, bool names_sender = P::name != std::string_view("auto")>
void answer_needs_add_peer_scenario() {
  NodeOf<P> a(0), b(1);
  a.ctx->add_peer(1, "w1", b.ctx->address());
  a.ctx->send(1, make_message(wire::MessageType::Request, 1, "early"));
  REQUIRE(b.inbox.wait_messages(1, 10s));
  std::string text;
  try {
    b.ctx->send(0, make_message(wire::MessageType::Response, 1, "reply"));
  } catch (const DistNetworkError& e) {
    text = e.what();
  }
  // Auto has no connection of its own: the candidate that read the peer's Hello knows its name,
  // Auto (which chose no candidate yet) knows only the id.
  CHECK(text.find(names_sender ? "worker 0 ('w0')" : "worker 0") != std::string::npos);
  CHECK(text.find("add_peer() was not called for it") != std::string::npos);
  b.ctx->add_peer(0, "w0", a.ctx->address());
  b.ctx->send(0, make_message(wire::MessageType::Response, 1, "reply"));
  REQUIRE(a.inbox.wait_messages(1, 10s));
  CHECK(a.inbox.take(0).payload == "reply");
  CHECK(a.inbox.lost_count() == 0);
  CHECK(b.inbox.lost_count() == 0);
}

}  // namespace distrpc::testing

// The names every transport suite uses unqualified: one `using namespace
// distrpc::testing::transport_names;` per file instead of the same list in each.
namespace distrpc::testing::transport_names {
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using distrpc::DistNetworkError;
using distrpc::testing::bytes_of;
using distrpc::testing::contains;
using distrpc::testing::Inbox;
using distrpc::testing::introduce;
using distrpc::testing::LogLines;
using distrpc::testing::make_message;
using distrpc::testing::NodeOf;
using distrpc::testing::options_for;
using distrpc::testing::pattern_bytes;
using distrpc::testing::same_bytes;
using distrpc::transport::TransportCallbacks;
using distrpc::transport::TransportOptions;
using distrpc::wire::Message;
using distrpc::wire::MessageType;
}  // namespace distrpc::testing::transport_names
