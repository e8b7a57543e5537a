// The wire layer in one include: messages, framing, the handshake, and the archives with their
// codecs for tensors, ATen scalars and IValues. Specified in docs/wire-protocol.md.
#pragma once

#include <distrpc/wire/archive.hpp>
#include <distrpc/wire/auth.hpp>
#include <distrpc/wire/errors.hpp>
#include <distrpc/wire/frame.hpp>
#include <distrpc/wire/handshake.hpp>
#include <distrpc/wire/ivalue_codec.hpp>
#include <distrpc/wire/message.hpp>
#include <distrpc/wire/recv_storage.hpp>
#include <distrpc/wire/scalar_codec.hpp>
#include <distrpc/wire/tensor_codec.hpp>
