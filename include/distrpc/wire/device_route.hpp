// Where the tensors of the message being encoded on this thread are to arrive: the agent sets a
// route for each message (its device map towards the receiver, or the inverse map for a response)
// and the codec asks it per tensor, without either knowing the other. Without a route only CPU
// tensors can be encoded.
#pragma once

#include <c10/core/Device.h>

namespace distrpc::wire {

class DeviceRoute {
 public:
  // The receiver's device for a tensor on local device `from`; throws EncodeError when the route
  // has none.
  virtual c10::Device target(c10::Device from) const = 0;

 protected:
  ~DeviceRoute() = default;
};

namespace detail {
inline thread_local const DeviceRoute* tls_device_route = nullptr;
}  // namespace detail

// Sets the route of this thread for its lifetime (null: none), restoring the previous one.
class DeviceRouteScope {
 public:
  explicit DeviceRouteScope(const DeviceRoute* route) : saved_(detail::tls_device_route) {
    detail::tls_device_route = route;
  }
  ~DeviceRouteScope() { detail::tls_device_route = saved_; }
  DeviceRouteScope(const DeviceRouteScope&) = delete;
  DeviceRouteScope& operator=(const DeviceRouteScope&) = delete;

 private:
  const DeviceRoute* const saved_;
};

}  // namespace distrpc::wire
