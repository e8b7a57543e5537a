// Backend names, the backend registry and BackendConfig: which backend serves which device type
// in a process group (PyTorch's dist.Backend.register_backend, dist.is_backend_available and
// dist.BackendConfig, with their canonical strings and error texts).
#pragma once

#include <algorithm>
#include <cctype>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <distrpc/store/store.hpp>

namespace distrpc::dist {

class Backend;  // the collective backend interface, defined with the process group

// Makes the backend of one group member: (store, rank, world size, timeout).
using BackendCreator = std::function<std::shared_ptr<Backend>(std::shared_ptr<store::Store>, int,
                                                              int, std::chrono::milliseconds)>;

namespace detail {

inline std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}
inline std::string upper(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return out;
}

// The names PyTorch knows without registration, with the devices each serves
// (Backend.backend_capability), so BackendConfig("nccl") reads "cuda:nccl" on any build.
inline const std::vector<std::pair<std::string, std::vector<std::string>>>& builtin_backends() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> table{
      {"gloo", {"cpu", "cuda"}},
      {"nccl", {"cuda"}},
      {"ucc", {"cpu", "cuda"}},
      {"mpi", {"cpu", "cuda"}},
  };
  return table;
}

struct RegisteredBackend {
  BackendCreator creator;
  std::vector<std::string> devices;
};

// Process-wide, as PyTorch's Backend class attributes are.
struct BackendRegistry {
  std::mutex mu;
  std::map<std::string, RegisteredBackend> by_name;  // lower-case names

  static BackendRegistry& instance() {
    static BackendRegistry r;
    return r;
  }
};

}  // namespace detail

// Registers a backend under name (case-insensitive, kept lower-case) for the given device types.
// A second registration of the same name is refused, as PyTorch refuses it.
inline void register_backend(std::string_view name, BackendCreator creator,
                             std::vector<std::string> devices = {"cpu", "cuda"}) {
  if (name.empty()) throw std::invalid_argument("register_backend: the backend name is empty");
  if (name.find_first_of(":,") != std::string_view::npos) {
    throw std::invalid_argument("register_backend: the backend name '" + std::string(name) +
                                "' must not contain ':' or ','");
  }
  if (!creator) {
    throw std::invalid_argument("register_backend: the creator of backend '" + std::string(name) +
                                "' is empty");
  }
  if (devices.empty()) {
    throw std::invalid_argument("register_backend: backend '" + std::string(name) +
                                "' names no device type");
  }
  for (std::string& d : devices) {
    if (d.empty() || d.find_first_of(":,") != std::string::npos) {
      throw std::invalid_argument("register_backend: backend '" + std::string(name) +
                                  "' has an invalid device type '" + d + "'");
    }
    d = detail::lower(d);
  }
  auto& reg = detail::BackendRegistry::instance();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto [it, inserted] = reg.by_name.try_emplace(detail::lower(name));
  if (!inserted) {
    throw std::invalid_argument(detail::upper(name) + " c10d backend already exist");
  }
  it->second = detail::RegisteredBackend{std::move(creator), std::move(devices)};
}

// True once a backend of that name (any case) is registered.
inline bool is_backend_available(std::string_view name) {
  auto& reg = detail::BackendRegistry::instance();
  std::lock_guard<std::mutex> lock(reg.mu);
  return reg.by_name.count(detail::lower(name)) != 0;
}

// Registers `name` for `devices`, each member made by B(store, rank, size, timeout) (a backend
// class whose further options have defaults), once per process: a later call, or a call after
// `name` was registered some other way, changes nothing (register_gloo_backend,
// register_nccl_backend).
template <class B>
void register_backend_class_once(std::string_view name, std::vector<std::string> devices) {
  static std::once_flag once;
  std::call_once(once, [&] {
    if (is_backend_available(name)) return;
    register_backend(
        name,
        [](std::shared_ptr<store::Store> store, int rank, int size,
           std::chrono::milliseconds timeout) -> std::shared_ptr<Backend> {
          return std::make_shared<B>(std::move(store), rank, size, timeout);
        },
        std::move(devices));
  });
}

// The creator registered under name; throws naming the backend if there is none. The creator is
// returned, not called, so no registry lock is held while it runs.
inline BackendCreator backend_creator(std::string_view name) {
  auto& reg = detail::BackendRegistry::instance();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.by_name.find(detail::lower(name));
  if (it == reg.by_name.end()) {
    throw std::invalid_argument("Backend '" + detail::lower(name) + "' is not registered");
  }
  return it->second.creator;
}

// device type -> backend name, parsed from "gloo", "nccl", "undefined", a registered name, or
// "cpu:gloo,cuda:nccl". Everything is lower-cased; to_string() is the canonical form.
class BackendConfig {
 public:
  explicit BackendConfig(std::string_view backend) {
    const std::string b = detail::lower(backend);
    if (b == "undefined") {
      // PyTorch's default per device, where that backend is available in this process.
      if (is_backend_available("gloo")) map_.emplace_back("cpu", "gloo");
      if (is_backend_available("nccl")) map_.emplace_back("cuda", "nccl");
      return;
    }
    for (const auto& [name, devices] : detail::builtin_backends()) {
      if (b == name) {
        for (const std::string& d : devices) map_.emplace_back(d, name);
        return;
      }
    }
    {
      auto& reg = detail::BackendRegistry::instance();
      std::lock_guard<std::mutex> lock(reg.mu);
      auto it = reg.by_name.find(b);
      if (it != reg.by_name.end()) {
        for (const std::string& d : it->second.devices) map_.emplace_back(d, b);
        return;
      }
    }
    parse_pairs(std::string(backend), b);
  }

  // "cpu:gloo,cuda:nccl", in the order the devices were given.
  std::string to_string() const {
    std::string out;
    for (const auto& [device, name] : map_) {
      if (!out.empty()) out += ',';
      out += device + ':' + name;
    }
    return out;
  }
  const std::vector<std::pair<std::string, std::string>>& device_backend_map() const {
    return map_;
  }
  // The backend serving device, or throws naming the device and the configuration.
  const std::string& backend_for(std::string_view device) const {
    const std::string d = detail::lower(device);
    for (const auto& [dev, name] : map_) {
      if (dev == d) return name;
    }
    throw std::invalid_argument("No backend type associated with device type " + d +
                                " in backend config '" + to_string() + "'");
  }

 private:
  void parse_pairs(const std::string& original, const std::string& b) {
    const std::string help =
        "The custom backend string argument is invalid: " + original +
        ".\nCustom backend string is an experimental feature where the backend string must be "
        "in the format:\n\"<device_type1>:<backend1>,<device_type2>:<backend2>...\". e.g. "
        "'cpu:gloo,cuda:nccl'";
    std::size_t start = 0;
    while (true) {
      const std::size_t comma = b.find(',', start);
      const std::string pair =
          b.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      const std::size_t colon = pair.find(':');
      if (colon == std::string::npos || pair.find(':', colon + 1) != std::string::npos ||
          colon == 0 || colon + 1 == pair.size()) {
        throw std::invalid_argument("Invalid device:backend pairing: " + pair + ". " + help);
      }
      std::string device = pair.substr(0, colon);
      std::string name = pair.substr(colon + 1);
      for (const auto& [dev, existing] : map_) {
        if (dev == device) {
          throw std::invalid_argument("Duplicate device type " + device +
                                      " in backend string: " + name + ". " + help);
        }
      }
      map_.emplace_back(std::move(device), std::move(name));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }

  std::vector<std::pair<std::string, std::string>> map_;
};

}  // namespace distrpc::dist
