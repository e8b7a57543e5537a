// The error hierarchy shared by every layer. Mirrors c10d's (DistError and its children) so code
// ported from PyTorch catches the same families; defined here because libtorch 1.13 lacks them.
#pragma once

#include <stdexcept>
#include <string>

namespace distrpc {

// Base of every error raised by the distributed layers (store, rendezvous, transports, RPC).
class DistError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A store operation failed or timed out (texts say "Timeout" and name the keys and the duration).
class DistStoreError : public DistError {
 public:
  using DistError::DistError;
};

// A connection could not be made or was lost.
class DistNetworkError : public DistError {
 public:
  using DistError::DistError;
};

// A collective or transport backend failed.
class DistBackendError : public DistError {
 public:
  using DistError::DistError;
};

}  // namespace distrpc
