// The identity check of a handshake: the peer that answered must be the worker we dialled. Both
// transports phrase the mismatch alike; each adds its own prefix ("distrpc tcp: handshake with
// ... failed: ").
#pragma once

#include <cstdint>
#include <string>

namespace distrpc::transport::detail {

// Empty when worker `their_id` named `their_name` is the worker `id` ('name') we dialled (an
// empty `name`: any name); else what is wrong, for the error text.
inline std::string identity_mismatch(int id, const std::string& name, std::int64_t their_id,
                                     const std::string& their_name) {
  if (their_id != id) {
    return "reached worker " + std::to_string(their_id) + " ('" + their_name + "') instead";
  }
  if (!name.empty() && their_name != name) return "the peer there is named '" + their_name + "'";
  return {};
}

}  // namespace distrpc::transport::detail
