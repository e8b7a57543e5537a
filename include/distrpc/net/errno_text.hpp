// The text of an errno value, as the transports and the store put it in their errors and logs.
#pragma once

#include <string>
#include <system_error>

namespace distrpc::net {

inline std::string errno_text(int err) {
  return std::system_category().message(err);
}

}  // namespace distrpc::net
