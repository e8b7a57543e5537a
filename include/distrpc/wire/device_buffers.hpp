// Whether the message being encoded on this thread may keep its device tensors' bytes on their
// device. By default a CUDA tensor's bytes are staged through a CPU copy, because a transport moves
// host memory. A policy that moves device memory itself (transport/device_direct.hpp) lets the
// agent open this scope around the encoding of messages it sends: a strided CUDA tensor's buffer
// is then a byte view over its device storage (no copy), and the receiver's policy hands the
// decoder a device buffer, which it adopts as the tensor's storage.
#pragma once

namespace distrpc::wire {

namespace detail {
inline thread_local bool tls_device_buffers = false;
}  // namespace detail

// Sets the flag for its lifetime, restoring the previous value.
class DeviceBuffersScope {
 public:
  explicit DeviceBuffersScope(bool on) : saved_(detail::tls_device_buffers) {
    detail::tls_device_buffers = on;
  }
  ~DeviceBuffersScope() { detail::tls_device_buffers = saved_; }
  DeviceBuffersScope(const DeviceBuffersScope&) = delete;
  DeviceBuffersScope& operator=(const DeviceBuffersScope&) = delete;

 private:
  const bool saved_;
};

}  // namespace distrpc::wire
