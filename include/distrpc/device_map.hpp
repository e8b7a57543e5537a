// Device maps: which device a tensor sent to a worker arrives on (PyTorch's `device_maps`), the
// devices a worker uses, and the group-wide check made when the group meets. Free of libtorch:
// options are plain data, and the check is a pure function of what every worker published.
//
//   opts.set_device_map("worker1", {{0, 1}, {1, 0}});  // cuda:0 -> cuda:1, cuda:1 -> cuda:0
//   opts.set_device_map("worker2", {{"cpu", "cuda:0"}});  // CPU tensors: worker2's cuda:0
//
// A request tensor on local device s arrives on the callee's map[s]; the callee's response tensor
// on d arrives on the caller's inverse(map)[d]. Without an entry only CPU tensors may be sent.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace distrpc {

namespace detail {
// `text` as a non-negative number of 1 to `max_digits` decimal digits; nullopt otherwise.
inline std::optional<int> small_number(std::string_view text, std::size_t max_digits) {
  if (text.empty() || text.size() > max_digits ||
      !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::stoi(std::string(text));
}
}  // namespace detail

// A device as device maps name it: "cpu" or "cuda:<index>". Ordered, so it can key a map.
struct DeviceName {
  enum class Type : std::uint8_t { Cpu, Cuda };
  Type type = Type::Cpu;
  int index = -1;  // -1 for the CPU; >= 0 for CUDA

  static DeviceName cpu() { return {}; }
  static DeviceName cuda(int index) {
    if (index < 0) {
      throw std::invalid_argument("Device index must not be negative, got " +
                                  std::to_string(index));
    }
    return DeviceName{Type::Cuda, index};
  }
  // Parses "cpu", "cpu:0", "cuda:<n>" (PyTorch's spellings); anything else is an error naming it.
  static DeviceName parse(std::string_view s) {
    if (s == "cpu" || s == "cpu:0") return cpu();
    const std::string_view prefix = "cuda:";
    if (s.substr(0, prefix.size()) == prefix) {
      std::string_view digits = s.substr(prefix.size());
      const bool negative = !digits.empty() && digits.front() == '-';
      if (negative) digits.remove_prefix(1);
      if (const auto n = detail::small_number(digits, 4)) {
        return cuda(negative ? -*n : *n);
      }
    }
    if (s == "cuda") {
      throw std::invalid_argument(
          "Device 'cuda' has no index: device maps and devices name CUDA devices as cuda:<index>");
    }
    throw std::invalid_argument("Invalid device '" + std::string(s) +
                                "': expected 'cpu' or 'cuda:<index>'");
  }

  bool is_cpu() const { return type == Type::Cpu; }
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
  friend auto operator<=>(const DeviceName&, const DeviceName&) = default;
};

inline std::ostream& operator<<(std::ostream& os, const DeviceName& d) {
  return os << d.str();
}

// What set_device_map and set_devices take: a CUDA index (PyTorch's {0: 1}), a device string
// ("cpu", "cuda:1") or a DeviceName.
struct DeviceSpec {
  DeviceName device;
  DeviceSpec(int cuda_index) : device(DeviceName::cuda(cuda_index)) {}  // NOLINT: implicit
  DeviceSpec(const char* s) : device(DeviceName::parse(s)) {}           // NOLINT: implicit
  DeviceSpec(const std::string& s) : device(DeviceName::parse(s)) {}    // NOLINT: implicit
  DeviceSpec(DeviceName d) : device(d) {}                               // NOLINT: implicit
};

using DeviceMap = std::map<DeviceName, DeviceName>;

inline std::string to_string(const DeviceMap& m) {
  std::string out = "{";
  for (const auto& [from, to] : m) {
    if (out.size() > 1) out += ", ";
    out += from.str() + ": " + to.str();
  }
  return out + "}";
}

inline std::string to_string(const std::vector<DeviceName>& devices) {
  std::string out = "[";
  for (const auto& d : devices) out += (out.size() > 1 ? ", " : "") + d.str();
  return out + "]";
}

// The DeviceMap given as pairs; two sources mapped to one target are refused here already.
inline DeviceMap make_device_map(std::initializer_list<std::pair<DeviceSpec, DeviceSpec>> pairs,
                                 std::string_view who = "`set_device_map`") {
  DeviceMap out;
  std::map<DeviceName, DeviceName> reverse;
  for (const auto& [k, v] : pairs) {
    const DeviceName from = k.device;
    const DeviceName to = v.device;
    if (auto it = out.find(from); it != out.end() && it->second != to) {
      throw std::invalid_argument(std::string(who) +
                                  " only supports 1-to-1 mapping, trying to map " + from.str() +
                                  " to " + to.str() + " and " + it->second.str());
    }
    if (auto it = reverse.find(to); it != reverse.end() && it->second != from) {
      throw std::invalid_argument(std::string(who) +
                                  " only supports 1-to-1 mapping, trying to map " + from.str() +
                                  " and " + it->second.str() + " to " + to.str());
    }
    out[from] = to;
    reverse[to] = from;
  }
  return out;
}

// Merges `add` into `into` (set_device_map's rule): a source already mapped elsewhere is refused.
inline void merge_device_map(DeviceMap& into, const DeviceMap& add) {
  for (const auto& [from, to] : add) {
    if (auto it = into.find(from); it != into.end() && it->second != to) {
      throw std::invalid_argument("`set_device_map` only supports 1-to-1 mapping, trying to map " +
                                  from.str() + " to " + to.str() + " and " + it->second.str());
    }
  }
  for (const auto& [from, to] : add) into[from] = to;
}

// The inverse of a map that passed validation (its targets are distinct).
inline DeviceMap inverse(const DeviceMap& m) {
  DeviceMap out;
  for (const auto& [from, to] : m) out[to] = from;
  return out;
}

// What one worker publishes when the group meets: its CUDA device count, its devices (empty: not
// set) and its device maps keyed by target worker name.
struct NodeDevices {
  std::string name;
  int device_count = 0;
  std::vector<DeviceName> devices;
  std::map<std::string, DeviceMap> maps;

  // Length-prefixed text: target names are whatever the user wrote, unvalidated.
  std::string serialize() const {
    std::string out;
    const auto field = [&](const std::string& s) { out += std::to_string(s.size()) + ":" + s; };
    field(std::to_string(device_count));
    field(std::to_string(devices.size()));
    for (const auto& d : devices) field(d.str());
    field(std::to_string(maps.size()));
    for (const auto& [target, m] : maps) {
      field(target);
      field(std::to_string(m.size()));
      for (const auto& [from, to] : m) {
        field(from.str());
        field(to.str());
      }
    }
    return out;
  }

  // An empty text is a worker that published nothing: no GPUs, no devices, no maps.
  static NodeDevices parse(const std::string& name, const std::string& text) {
    if (text.empty()) {
      NodeDevices none;
      none.name = name;
      return none;
    }
    std::size_t pos = 0;
    const auto bad = [&] {
      return std::runtime_error("malformed device entry of worker " + name + " in the store");
    };
    const auto field = [&]() -> std::string {
      const auto colon = text.find(':', pos);
      if (colon == std::string::npos) throw bad();
      const auto len = detail::small_number(std::string_view(text).substr(pos, colon - pos), 9);
      if (!len || text.size() - (colon + 1) < static_cast<std::size_t>(*len)) throw bad();
      pos = colon + 1 + static_cast<std::size_t>(*len);
      return text.substr(colon + 1, static_cast<std::size_t>(*len));
    };
    const auto number = [&] {
      const auto n = detail::small_number(field(), 9);
      if (!n) throw bad();
      return *n;
    };
    NodeDevices n;
    n.name = name;
    n.device_count = number();
    for (int i = number(); i > 0; --i) n.devices.push_back(DeviceName::parse(field()));
    for (int i = number(); i > 0; --i) {
      DeviceMap& m = n.maps[field()];
      for (int j = number(); j > 0; --j) {
        const DeviceName from = DeviceName::parse(field());
        m[from] = DeviceName::parse(field());
      }
    }
    if (pos != text.size()) throw bad();
    return n;
  }
};

namespace detail {
// Every device is the CPU or a CUDA device this node has.
template <class Range>
bool devices_exist(const Range& devices, int device_count) {
  return std::all_of(devices.begin(), devices.end(), [&](const DeviceName& d) {
    return d.is_cpu() || (d.index >= 0 && d.index < device_count);
  });
}
// Every device is the CPU (always usable) or among `allowed` (a worker's CUDA devices).
template <class Range>
bool all_in(const Range& devices, const std::vector<DeviceName>& allowed) {
  return std::all_of(devices.begin(), devices.end(), [&](const DeviceName& d) {
    return d.is_cpu() || std::find(allowed.begin(), allowed.end(), d) != allowed.end();
  });
}
// A map's sources (`targets` false) or targets, in the map's order.
inline std::vector<DeviceName> side(const DeviceMap& m, bool targets) {
  std::vector<DeviceName> out;
  for (const auto& [from, to] : m) out.push_back(targets ? to : from);
  return out;
}
}  // namespace detail

// The group-wide check made when a static group meets (every worker runs it on the same table, so
// every worker reports the same first offending node, in table order). Throws
// std::invalid_argument with PyTorch's texts.
inline void validate_device_maps(const std::vector<NodeDevices>& nodes) {
  std::map<std::string, const NodeDevices*> by_name;
  for (const auto& n : nodes) by_name[n.name] = &n;
  std::string names = "[";
  for (const auto& n : nodes) names += (names.size() > 1 ? ", " : "") + n.name;
  names += "]";
  for (const auto& n : nodes) {
    if (std::set<DeviceName>(n.devices.begin(), n.devices.end()).size() != n.devices.size()) {
      throw std::invalid_argument("Node " + n.name +
                                  " has duplicated devices\ndevices = " + to_string(n.devices));
    }
    if (!detail::devices_exist(n.devices, n.device_count)) {
      throw std::invalid_argument(
          "Node " + n.name + " has devices with invalid indices\ndevices = " +
          to_string(n.devices) + "\ndevice count = " + std::to_string(n.device_count));
    }
  }
  for (const auto& src : nodes) {
    for (const auto& [target, m] : src.maps) {
      if (!by_name.count(target)) {
        std::string maps = "{";
        for (const auto& [t, tm] : src.maps) {
          maps += (maps.size() > 1 ? ", " : "") + t + ": " + to_string(tm);
        }
        throw std::invalid_argument("Node " + src.name +
                                    " has invalid target node names in its device maps\n"
                                    "device maps = " +
                                    maps + "}\nnode names = " + names);
      }
    }
    for (const auto& [target, m] : src.maps) {
      const std::string where =
          " in its device map for " + target + "\ndevice map = " + to_string(m);
      const auto targets = detail::side(m, true);
      if (std::set<DeviceName>(targets.begin(), targets.end()).size() != targets.size()) {
        throw std::invalid_argument("Node " + src.name + " has duplicated target devices" + where);
      }
      const auto sources = detail::side(m, false);
      if (!src.devices.empty()) {
        if (!detail::all_in(sources, src.devices)) {
          throw std::invalid_argument("Node " + src.name + " has unexpected source devices" +
                                      where + "\ndevices = " + to_string(src.devices));
        }
      } else if (!detail::devices_exist(sources, src.device_count)) {
        throw std::invalid_argument("Node " + src.name +
                                    " has source devices with invalid indices" + where +
                                    "\ndevice count = " + std::to_string(src.device_count));
      }
      const NodeDevices& dst = *by_name.at(target);
      if (!dst.devices.empty()) {
        if (!detail::all_in(targets, dst.devices)) {
          throw std::invalid_argument("Node " + src.name + " has unexpected target devices" +
                                      where + "\ndevices = " + to_string(dst.devices));
        }
      } else if (!detail::devices_exist(targets, dst.device_count)) {
        throw std::invalid_argument("Node " + src.name +
                                    " has target devices with invalid indices" + where +
                                    "\ndevice count = " + std::to_string(dst.device_count));
      }
    }
  }
}

// The CUDA devices worker `self` uses when it set none: the sources of its own maps and the
// targets of the others' maps to it (PyTorch's rule), in order.
inline std::vector<DeviceName> inferred_devices(const std::vector<NodeDevices>& nodes,
                                                const std::string& self) {
  std::set<DeviceName> out;
  for (const auto& n : nodes) {
    for (const auto& [target, m] : n.maps) {
      for (const auto& [from, to] : m) {
        if (n.name == self && !from.is_cpu()) out.insert(from);
        if (target == self && !to.is_cpu()) out.insert(to);
      }
    }
  }
  return {out.begin(), out.end()};
}

}  // namespace distrpc
