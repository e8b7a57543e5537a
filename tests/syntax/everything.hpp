// Every public header a program may include, with libtorch's: tests/syntax/check.sh puts it first
// in both of its translation units, so every public header is also checked with -Wall -Wextra
// -Werror, and each file's own #includes of them are no-ops inside the namespace it is wrapped in.
#pragma once

#include <torch/torch.h>

#include "distrpc/agent.hpp"
#include "distrpc/ddp.hpp"
#include "distrpc/device_future.hpp"
#include "distrpc/dist.hpp"
#include "distrpc/dist/backend.hpp"
#include "distrpc/dist/backend_config.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/dist/gloo_backend.hpp"  // empty unless USE_C10D_GLOO (gloo found)
#include "distrpc/dist/nccl_backend.hpp"  // empty unless DISTRPC_HAVE_NCCL (NCCL found)
#include "distrpc/dist_autograd.hpp"
#include "distrpc/dist_optim.hpp"
#include "distrpc/distrpc.hpp"
#include "distrpc/launch.hpp"
#include "distrpc/nn/remote_module.hpp"
#include "distrpc/store.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/transport/auto.hpp"
#ifdef DISTRPC_HAVE_CUDART  // the CUDA runtime found (Meson: distrpc_cuda_ipc_dep)
#include "distrpc/transport/cuda_ipc.hpp"
#endif
#include "distrpc/transport/device_direct.hpp"
#include "distrpc/transport/faulty.hpp"
#include "distrpc/transport/shm.hpp"
#include "distrpc/transport/tcp.hpp"
