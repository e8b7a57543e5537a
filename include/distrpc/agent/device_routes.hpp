// The agent's device maps once the group has met: the route of each message's tensors (this
// worker's map towards the callee for a request, the inverse of the caller's map for a response),
// checked against what every worker published (device_map.hpp). Filled once, before the agent
// serves requests; read-only afterwards, so reading needs no lock.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/agent/membership.hpp"
#include "distrpc/device_map.hpp"
#include "distrpc/torch_compat.hpp"
#include "distrpc/wire/device_route.hpp"
#include "distrpc/wire/errors.hpp"

namespace distrpc::detail {

// One message's route: `map` (may be null: none) towards worker `peer`. `kind` is "Request" or
// "Response", for the error text, which names the peer as `members` knows it.
class MappedRoute final : public wire::DeviceRoute {
 public:
  MappedRoute(const DeviceMap* map, int peer, const Membership& members, const char* kind)
      : map_(map), peer_(peer), members_(members), kind_(kind) {}

  c10::Device target(c10::Device from) const override {
    if (map_ != nullptr && !map_->empty()) {
      if (const auto name = as_name(from)) {
        if (auto it = map_->find(*name); it != map_->end()) return compat::to_c10(it->second);
      }
    }
    if (from.is_cpu()) return from;
    throw wire::EncodeError(
        "RPC only supports CPU tensors by default, please move your tensors to CPU before sending "
        "them over RPC, or call `set_device_map` on `RpcBackendOptions` to explicitly configure "
        "device mapping. " +
        std::string(kind_) + " device mapping is not available for destination " +
        members_.describe(peer_).name + " (a tensor on " + from.str() + ")");
  }

 private:
  static std::optional<DeviceName> as_name(c10::Device d) {
    if (d.is_cpu()) return DeviceName::cpu();
    if (d.is_cuda() && d.has_index()) return DeviceName{DeviceName::Type::Cuda, d.index()};
    return std::nullopt;
  }

  const DeviceMap* const map_;
  const int peer_;
  const Membership& members_;
  const char* const kind_;
};

class DeviceRoutes {
 public:
  // What this worker publishes when the group meets.
  static NodeDevices own_entry(const std::string& self,
                               const std::map<std::string, DeviceMap>& maps,
                               const std::vector<DeviceName>& devices) {
    NodeDevices n;
    n.name = self;
    n.device_count = compat::cuda_device_count();
    n.devices = devices;
    n.maps = maps;
    for (auto it = n.maps.begin(); it != n.maps.end();) {
      it = it->second.empty() ? n.maps.erase(it) : std::next(it);
    }
    return n;
  }

  // Checks the entries of a static group (nodes[r] is rank r's) and keeps the routes of worker
  // `self`. Throws std::invalid_argument naming the first offending worker.
  void set(std::vector<NodeDevices> nodes, int self) {
    validate_device_maps(nodes);
    const std::string& me = nodes.at(static_cast<std::size_t>(self)).name;
    for (std::size_t r = 0; r < nodes.size(); ++r) {
      const NodeDevices& n = nodes[r];
      const int id = static_cast<int>(r);
      if (id == self) {
        devices_ = n.devices.empty() ? inferred_devices(nodes, me) : n.devices;
      }
      for (std::size_t t = 0; t < nodes.size(); ++t) {
        if (auto it = n.maps.find(nodes[t].name); it != n.maps.end()) {
          if (id == self) out_[static_cast<int>(t)] = it->second;
          if (static_cast<int>(t) == self) back_[id] = inverse(it->second);
        }
      }
    }
    stream_devices_.clear();
    if (c10::impl::hasDeviceGuardImpl(c10::kCUDA)) {
      for (const DeviceName& d : std::set<DeviceName>(devices_.begin(), devices_.end())) {
        stream_devices_.push_back(compat::to_c10(d));
      }
    }
    self_ = self;
    nodes_ = std::move(nodes);
  }

  // A request's route to worker `peer`; a non-empty `per_call` map replaces the configured one
  // (checked here as the group checked the configured maps).
  MappedRoute request(int peer, const DeviceMap* per_call, const Membership& members) const {
    if (per_call != nullptr && !per_call->empty()) {
      check_per_call(peer, *per_call, members);
      return MappedRoute(per_call, peer, members, "Request");
    }
    auto it = out_.find(peer);
    return MappedRoute(it == out_.end() ? nullptr : &it->second, peer, members, "Request");
  }
  // A response's route back to the caller `peer`: the inverse of its map to this worker.
  MappedRoute response(int peer, const Membership& members) const {
    auto it = back_.find(peer);
    return MappedRoute(it == back_.end() ? nullptr : &it->second, peer, members, "Response");
  }

  // This worker's map towards worker `peer` (empty: none).
  DeviceMap map_to(int peer) const {
    auto it = out_.find(peer);
    return it == out_.end() ? DeviceMap{} : it->second;
  }
  // The CUDA devices this worker uses: those set, else those the group's maps name for it.
  const std::vector<DeviceName>& devices() const { return devices_; }
  // The same as c10 devices, where this libtorch has streams for them (else none): what the
  // futures of this worker's calls synchronize on (agent/calls.hpp, device_future.hpp). Empty:
  // CPU only. Kept beside devices_ so that a call does not convert them each time.
  const std::vector<c10::Device>& stream_devices() const { return stream_devices_; }

 private:
  void check_per_call(int peer, const DeviceMap& map, const Membership& members) const {
    const auto known = [&](int id) {
      return id >= 0 && static_cast<std::size_t>(id) < nodes_.size();
    };
    if (!known(self_) || !known(peer)) {
      throw std::invalid_argument("a per-call device map needs a static group that knows " +
                                  members.describe(peer).name +
                                  "'s devices (init_rpc with a world size)");
    }
    NodeDevices me = nodes_[static_cast<std::size_t>(self_)];
    NodeDevices them = nodes_[static_cast<std::size_t>(peer)];
    me.maps = {{them.name, map}};
    if (peer == self_) {
      validate_device_maps({me});
    } else {
      them.maps.clear();
      validate_device_maps({me, them});
    }
  }

  int self_ = -1;
  std::vector<NodeDevices> nodes_;
  std::map<int, DeviceMap> out_;
  std::map<int, DeviceMap> back_;
  std::vector<DeviceName> devices_;
  std::vector<c10::Device> stream_devices_;
};

}  // namespace distrpc::detail
