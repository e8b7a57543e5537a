// The errors raised by the wire layer. Each names the field or value that was wrong, because these
// texts end up in logs of connections that were dropped and are all an operator has to go on.
#pragma once

#include <distrpc/error.hpp>

namespace distrpc::wire {

// A peer broke the framing or the handshake (bad magic, unknown version or message type, a length
// over the limits, a wrong auth token). The connection it arrived on cannot be trusted any more:
// the transport closes it and logs this text. A network error because, to the caller, the peer is
// gone.
class ProtocolError : public DistNetworkError {
 public:
  using DistNetworkError::DistNetworkError;
};

// A message payload could not be decoded: truncated, malformed, inconsistent with its out-of-band
// buffers, or with values out of range. Raised by every decoding path; nothing else escapes them
// for malformed input, so a receiver can catch this one type and drop the message or the
// connection.
class DecodeError : public DistError {
 public:
  using DistError::DistError;
};

// A value cannot be sent: a non-CPU tensor, an unsupported layout or IValue kind, or a message over
// the configured limits. Raised on the sender, before anything is written to the wire.
class EncodeError : public DistError {
 public:
  using DistError::DistError;
};

}  // namespace distrpc::wire
