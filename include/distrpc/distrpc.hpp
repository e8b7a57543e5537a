// distrpc in one include: futures, errors, stores and rendezvous, the wire layer, RPC and RRefs.
// Add the header of the transport policy you use, e.g. <distrpc/transport/tcp.hpp>.
#pragma once

#include "distrpc/device_future.hpp"
#include "distrpc/error.hpp"
#include "distrpc/future.hpp"
#include "distrpc/options.hpp"
#include "distrpc/rpc.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/rref.hpp"
#include "distrpc/store.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/worker_info.hpp"
