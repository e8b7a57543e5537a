// GloballyUniqueId: the identity of an RRef and of each of its forks.
//
// (created_on, local_id): the rank of the worker that made the id and a number from one counter
// per process, starting at 0 and shared by RRef ids and fork ids, as in PyTorch. A local RRef(x)
// takes one id; remote() takes two (the RRef id, then the fork id of the caller's user RRef).
// A worker whose rank an earlier process held in its group (a replacement in a dynamic group)
// adds its incarnation times 2^40 to the counter: the other workers may still hold ids that
// process made (RRefs it created on them and shared), and a repeated id would find its value.
#pragma once

#include <atomic>
#include <compare>
#include <cstdint>
#include <functional>
#include <string>

namespace distrpc {

struct GloballyUniqueId {
  int created_on = -1;
  std::int64_t local_id = -1;

  friend auto operator<=>(const GloballyUniqueId&, const GloballyUniqueId&) = default;

  bool valid() const { return created_on >= 0 && local_id >= 0; }

  std::string str() const {
    return "GloballyUniqueId(created_on=" + std::to_string(created_on) +
           ", local_id=" + std::to_string(local_id) + ")";
  }

  template <class Archive>
  void serialize(Archive& ar) {
    ar(created_on, local_id);
  }
};

using RRefId = GloballyUniqueId;
using ForkId = GloballyUniqueId;

namespace detail {

// The one id counter of this process (never reset, so ids of two RPC sessions never collide).
inline std::atomic<std::int64_t>& rref_local_id_counter() {
  static std::atomic<std::int64_t> next{0};
  return next;
}

inline constexpr int kIncarnationShift = 40;

// `incarnation`: AgentServices::host_incarnation() of the agent making the id.
inline GloballyUniqueId next_guid(int self_rank, std::int64_t incarnation = 0) {
  return GloballyUniqueId{
      self_rank, (incarnation << kIncarnationShift) + rref_local_id_counter().fetch_add(1)};
}

}  // namespace detail
}  // namespace distrpc

template <>
struct std::hash<distrpc::GloballyUniqueId> {
  std::size_t operator()(const distrpc::GloballyUniqueId& g) const noexcept {
    return std::hash<std::int64_t>{}(g.local_id) ^ (std::hash<int>{}(g.created_on) << 1);
  }
};
