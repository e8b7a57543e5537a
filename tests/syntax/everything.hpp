// Every public header a program may include, with libtorch's, precompiled once by
// tests/syntax/check.sh: the compile-time failure checks and the examples' compile check parse
// it once instead of once per file (libtorch's and distrpc's headers are most of each file's cost).
// (No #pragma once: it is compiled as a header of its own, where GCC warns about one.)

#include <torch/torch.h>

#include "distrpc/agent.hpp"
#include "distrpc/ddp.hpp"
#include "distrpc/dist.hpp"
#include "distrpc/dist/backend.hpp"
#include "distrpc/dist/backend_config.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/dist/gloo_backend.hpp"  // empty unless USE_C10D_GLOO (gloo found)
#include "distrpc/dist_autograd.hpp"
#include "distrpc/dist_optim.hpp"
#include "distrpc/distrpc.hpp"
#include "distrpc/launch.hpp"
#include "distrpc/nn/remote_module.hpp"
#include "distrpc/store.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/faulty.hpp"
#include "distrpc/transport/shm.hpp"
#include "distrpc/transport/tcp.hpp"
