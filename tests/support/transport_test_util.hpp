// What the transport test files share: an inbox recording a Context's callbacks, a node (Context +
// inbox) for any policy, and byte-exact message helpers. Header-only, used by the TCP and the
// shared-memory transport tests (one binary, test_wire).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::testing {

using namespace std::chrono_literals;

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
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

}  // namespace distrpc::testing
