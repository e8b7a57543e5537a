// WorkerInfo: the identity of one worker of an RPC group (its rank and its unique name).
#pragma once

#include <cstddef>
#include <functional>
#include <ostream>
#include <stdexcept>
#include <string>

namespace distrpc {

// Names are short identifiers: they appear in store keys, logs and error texts.
inline constexpr std::size_t kMaxWorkerNameLength = 128;

// Throws std::invalid_argument with the texts users search for (kept from PyTorch).
inline void validate_worker_name(const std::string& name) {
  if (name.empty()) throw std::invalid_argument("Worker name must be non-empty.");
  if (name.size() >= kMaxWorkerNameLength) {
    throw std::invalid_argument("RPC worker name " + name.substr(0, 32) + "... (" +
                                std::to_string(name.size()) + " characters) is not shorter than " +
                                std::to_string(kMaxWorkerNameLength) + ".");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == ':';
    if (!ok) {
      throw std::invalid_argument("Worker name must match ^[A-Za-z0-9-_:]*$, but got '" + name +
                                  "'.");
    }
  }
}

struct WorkerInfo {
  int id = -1;
  std::string name;

  friend bool operator==(const WorkerInfo&, const WorkerInfo&) = default;

  std::string str() const { return "WorkerInfo(id=" + std::to_string(id) + ", name=" + name + ")"; }

  template <class Archive>
  void serialize(Archive& ar) {
    ar(id, name);
  }
};

inline std::ostream& operator<<(std::ostream& os, const WorkerInfo& w) {
  return os << w.str();
}

}  // namespace distrpc

template <>
struct std::hash<distrpc::WorkerInfo> {
  std::size_t operator()(const distrpc::WorkerInfo& w) const noexcept {
    return std::hash<std::string>{}(w.name) ^ (std::hash<int>{}(w.id) << 1);
  }
};
