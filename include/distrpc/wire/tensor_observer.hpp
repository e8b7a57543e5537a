// Who watches the tensors a message carries while it is encoded or decoded on this thread. The
// codec tells the observer of every tensor that requires grad (once per tensor per message): the
// layer of distributed autograd records, without the codec or the agent knowing it, which
// tensors left in a message (its send function's edges) and which arrived (its recv function's
// outputs).
#pragma once

#include <ATen/core/Tensor.h>

namespace distrpc::wire {

class TensorObserver {
 public:
  // `t` requires grad and was written into the message being encoded.
  virtual void encoded(const at::Tensor& t) = 0;
  // `t` requires grad and was read from the message being decoded.
  virtual void decoded(const at::Tensor& t) = 0;

 protected:
  ~TensorObserver() = default;
};

namespace detail {
inline thread_local TensorObserver* tls_tensor_observer = nullptr;
}  // namespace detail

// Sets the observer of this thread for its lifetime (null: none), restoring the previous one.
class TensorObserverScope {
 public:
  explicit TensorObserverScope(TensorObserver* observer) : saved_(detail::tls_tensor_observer) {
    detail::tls_tensor_observer = observer;
  }
  ~TensorObserverScope() { detail::tls_tensor_observer = saved_; }
  TensorObserverScope(const TensorObserverScope&) = delete;
  TensorObserverScope& operator=(const TensorObserverScope&) = delete;

 private:
  TensorObserver* const saved_;
};

}  // namespace distrpc::wire
