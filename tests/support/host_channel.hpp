// A stand-in device channel for DeviceDirect<T, Channel> (transport/device_direct.hpp) on machines
// without a GPU: CPU buffers of at least kMinBytes count as "device buffers", and a descriptor is
// their address in this process (both Contexts of a test live in it). It checks the policy's
// promises: an import finds the buffer still lent (the sender kept it alive until the release),
// and it counts what happened. Knobs let a test make peers unreachable and exports or imports fail.
#pragma once

#include <unistd.h>

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include "distrpc/transport/device_direct.hpp"

namespace distrpc::testing {

struct HostChannel {
  static constexpr std::string_view name = "host_channel";
  static constexpr std::int64_t kMinBytes = 64;

  // Shared by every HostChannel of the process (tests reset them).
  struct Knobs {
    std::atomic<bool> reach{true};          // false: no peer is reached (the policy stages)
    std::atomic<int> failing_exports{0};    // the next n exports throw
    std::atomic<int> failing_imports{0};    // the next n imports throw
    std::atomic<int> forgotten{0};          // forget() calls
    std::atomic<int> retired{0};            // retire() calls: loans ended without a Release
    std::atomic<int> imports_of_unlent{0};  // imports that found the buffer no longer lent
    std::atomic<bool> hold_imports{false};  // true: imports wait until false or stop()
    std::mutex mu;
    std::map<std::uintptr_t, int> lent;  // address -> exports still held by their sender
  };
  static Knobs& knobs() {
    static Knobs k;
    return k;
  }
  static void reset() {
    auto& k = knobs();
    k.reach = true;
    k.failing_exports = 0;
    k.failing_imports = 0;
    k.forgotten = 0;
    k.retired = 0;
    k.imports_of_unlent = 0;
    k.hold_imports = false;
  }
  static int lent_now() {
    auto& k = knobs();
    std::lock_guard<std::mutex> lk(k.mu);
    int n = 0;
    for (const auto& [a, c] : k.lent) n += c;
    return n;
  }

  // Lost peers' loans come back after this (DeviceDirect's kOrphanGrace otherwise), so a test
  // can watch it happen.
  static constexpr std::chrono::milliseconds orphan_grace{300};

  explicit HostChannel(int /*self_id*/) {}
  std::string address() const { return "pid=" + std::to_string(::getpid()); }
  bool connect(int /*peer*/, const std::string& peer_address) {
    return knobs().reach && peer_address == address();
  }
  bool carries(const at::Tensor& b) const { return b.is_cpu() && b.numel() >= kMinBytes; }

  transport::ChannelExport export_buffer(int /*peer*/, const at::Tensor& b) {
    auto& k = knobs();
    if (k.failing_exports.load() > 0) {
      --k.failing_exports;
      throw std::runtime_error("host_channel: export refused (test)");
    }
    const auto addr = reinterpret_cast<std::uintptr_t>(b.data_ptr());
    {
      std::lock_guard<std::mutex> lk(k.mu);
      ++k.lent[addr];
    }
    std::shared_ptr<void> keep(reinterpret_cast<void*>(addr), [](void* p) {
      auto& kk = knobs();
      std::lock_guard<std::mutex> lk(kk.mu);
      const auto it = kk.lent.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != kk.lent.end() && --it->second == 0) kk.lent.erase(it);
    });
    return {std::string(reinterpret_cast<const char*>(&addr), sizeof addr), std::move(keep)};
  }

  at::Tensor import_buffer(int /*peer*/, std::string_view d, std::int64_t nbytes) {
    auto& k = knobs();
    while (k.hold_imports.load() && !stopped_.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (k.failing_imports.load() > 0) {
      --k.failing_imports;
      throw std::runtime_error("host_channel: import refused (test)");
    }
    std::uintptr_t addr = 0;
    if (d.size() != sizeof addr) throw std::runtime_error("host_channel: bad descriptor");
    std::memcpy(&addr, d.data(), sizeof addr);
    {
      std::lock_guard<std::mutex> lk(k.mu);
      if (k.lent.count(addr) == 0) {
        ++k.imports_of_unlent;
        throw std::runtime_error("host_channel: the buffer is no longer lent");
      }
    }
    at::Tensor out = at::empty({nbytes}, at::kByte);
    std::memcpy(out.data_ptr(), reinterpret_cast<const void*>(addr),
                static_cast<std::size_t>(nbytes));
    return out;
  }

  void forget(int /*peer*/) { ++knobs().forgotten; }
  void retire(const std::shared_ptr<void>& keep) {
    if (keep) ++knobs().retired;
  }
  // The policy gives up waits inside import_buffer (a held import returns).
  void stop() { stopped_ = true; }

 private:
  std::atomic<bool> stopped_{false};
};

template <class T>
using HostDirect = transport::DeviceDirect<T, HostChannel>;

}  // namespace distrpc::testing
