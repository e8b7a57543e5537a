// Collective benchmark: the figures PyTorch's own reference prints (examples/reference/
// torch_c10d_ref.py: Python + ProcessGroupGloo), measured for one of this build's process-group
// backends, with the same sizes, counts and medians, so the two JSON lines compare key by key.
//
//   bench_collectives --backend distrpc --transport shm --world 2
//   bench_collectives --backend gloo --world 4
//
// It starts --world copies of itself on this machine (one per rank, meeting through a file
// rendezvous) and prints rank 0's JSON line:
//   allreduce_small_us    median all-reduce (SUM) of a 4-float tensor
//   allreduce_64MiB_GBps  64 MiB float all-reduce, bytes / time (algorithm bandwidth)
//   allreduce_64MiB_busbw the same * 2(n-1)/n (bus bandwidth, as nccl-tests reports it)
//   broadcast_64MiB_GBps  64 MiB broadcast from rank 0, bytes / time
//   allgather_small_us    median all-gather of a 4-float tensor
//   barrier_us            median barrier
// Each rank uses one intra-op thread, as the reference does (torch.set_num_threads(1)).
// --gib instead runs one 1 GiB all-reduce, checks every element and prints its time.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "distrpc/dist/backend.hpp"
#include "distrpc/dist/backend_config.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/transport/tcp.hpp"
#if __has_include("distrpc/transport/shm.hpp")
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#define BENCH_HAVE_SHM 1
#endif
#ifdef USE_C10D_GLOO
#include "distrpc/dist/gloo_backend.hpp"
#endif
#include "spawn_self.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace dist = distrpc::dist;

struct Args {
  std::string backend = "distrpc";
  std::string transport = "auto";  // for the distrpc backend
  int world = 2;
  int rank = -1;  // -1: the launcher
  std::string init;
  std::string out;
  int small = 2000;
  int big = 10;
  bool gib = false;  // --gib: one 1 GiB all-reduce, checked, instead of the figures
};

std::string backends_built() {
  std::string out = "distrpc";
#ifdef USE_C10D_GLOO
  out += ", gloo";
#endif
  return out;
}

std::string transports_built() {
#ifdef BENCH_HAVE_SHM
  return "tcp, shm, auto";
#else
  return "tcp";
#endif
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + k);
      return argv[++i];
    };
    if (k == "--backend") {
      a.backend = next();
    } else if (k == "--transport") {
      a.transport = next();
    } else if (k == "--world") {
      a.world = std::stoi(next());
    } else if (k == "--rank") {
      a.rank = std::stoi(distrpc_examples::rank_text(next()));
    } else if (k == "--init") {
      a.init = next();
    } else if (k == "--out") {
      a.out = next();
    } else if (k == "--small") {
      a.small = std::stoi(next());
    } else if (k == "--big") {
      a.big = std::stoi(next());
    } else if (k == "--gib") {
      a.gib = true;
    } else {
      throw std::invalid_argument("unknown argument '" + k +
                                  "' (expected --backend distrpc|gloo, --transport tcp|shm|auto, "
                                  "--world N, --small N, --big N, --gib)");
    }
  }
  if (a.backend != "distrpc" &&
      !(a.backend == "gloo" && backends_built().find("gloo") != std::string::npos)) {
    throw std::invalid_argument("unknown backend '" + a.backend +
                                "': this build has: " + backends_built());
  }
  if (transports_built().find(a.transport) == std::string::npos || a.transport.empty() ||
      a.transport.find(',') != std::string::npos) {
    throw std::invalid_argument("unknown transport '" + a.transport +
                                "': this build has: " + transports_built());
  }
  if (a.world < 2 || a.world > 64) {
    throw std::invalid_argument("--world must be 2..64, got " + std::to_string(a.world));
  }
  if (a.small < 1 || a.big < 1) {
    throw std::invalid_argument("--small and --big must be at least 1");
  }
  return a;
}

// "distrpc" runs on the transport chosen at start; the choice instantiates that policy only.
void register_backends(const Args& a) {
  using namespace distrpc::transport;
#ifdef BENCH_HAVE_SHM
  if (a.transport == "shm") {
    dist::register_distrpc_backend<Shm>();
  } else if (a.transport == "auto") {
    dist::register_distrpc_backend<Auto<Shm, Tcp>>();
  } else
#endif
  {
    dist::register_distrpc_backend<Tcp>();
  }
#ifdef USE_C10D_GLOO
  dist::register_gloo_backend();
#endif
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double median_us(F&& fn, int n, int warm) {
  for (int i = 0; i < warm; ++i) fn();
  std::vector<double> lat;
  lat.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    fn();
    lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return median(std::move(lat));
}

// The largest size the backends promise: one 1 GiB float all-reduce (2^28 elements), every element
// checked, its time reported.
int run_gib(const Args& a, dist::Backend& pg) {
  std::vector<at::Tensor> t{torch::full({std::int64_t{1} << 28}, a.rank + 1.0f)};
  const auto t0 = Clock::now();
  pg.allreduce(t)->wait();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  const float expect = a.world * (a.world + 1) / 2.0f;
  const bool ok = t[0].eq(expect).all().item<bool>();
  if (a.rank == 0) {
    std::ofstream out(a.out);
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "{\"backend\": \"%s\", \"world\": %d, \"allreduce_1GiB_s\": %.3f, "
                  "\"allreduce_1GiB_correct\": %s}",
                  a.backend.c_str(), a.world, s, ok ? "true" : "false");
    out << buf << "\n";
  }
  pg.barrier()->wait();
  pg.shutdown();
  return ok ? 0 : 1;
}

int run_worker(const Args& a) {
  at::set_num_threads(1);
  register_backends(a);
  auto rv = distrpc::store::rendezvous(a.init, a.rank, a.world);
  const std::shared_ptr<dist::Backend> pg =
      dist::backend_creator(a.backend)(rv.store, a.rank, a.world, std::chrono::seconds(120));

  if (a.gib) return run_gib(a, *pg);
  std::vector<at::Tensor> small{torch::ones({4})};
  const double allreduce_small =
      median_us([&] { pg->allreduce(small)->wait(); }, a.small, a.small / 10);
  std::vector<at::Tensor> big{torch::ones({16 * 1024 * 1024})};
  const double bytes = static_cast<double>(big[0].nbytes());
  const double allreduce_big_s = median_us([&] { pg->allreduce(big)->wait(); }, a.big, 2) / 1e6;
  const double allreduce_gbps = bytes / allreduce_big_s / 1e9;
  const double busbw = allreduce_gbps * 2.0 * (a.world - 1) / a.world;
  const double broadcast_s = median_us([&] { pg->broadcast(big)->wait(); }, a.big, 2) / 1e6;
  std::vector<std::vector<at::Tensor>> gathered(1);
  for (int r = 0; r < a.world; ++r) gathered[0].push_back(torch::empty({4}));
  const double allgather_small =
      median_us([&] { pg->allgather(gathered, small)->wait(); }, a.small, a.small / 10);
  const double barrier = median_us([&] { pg->barrier()->wait(); }, a.small / 2, a.small / 20);

  // The engine is checked, not only timed: each rank gives rank+1, the sum is n(n+1)/2.
  std::vector<at::Tensor> check{torch::full({1024}, a.rank + 1.0)};
  pg->allreduce(check)->wait();
  const double expect = a.world * (a.world + 1) / 2.0;
  if (!check[0].eq(expect).all().item<bool>()) {
    throw std::runtime_error("all-reduce gave a wrong result: expected " + std::to_string(expect) +
                             " everywhere");
  }
  if (a.rank == 0) {
    std::ofstream out(a.out);
    char buf[640];
    std::snprintf(buf, sizeof buf,
                  "{\"backend\": \"%s\", \"transport\": \"%s\", \"world\": %d, "
                  "\"allreduce_small_us\": %.1f, \"allreduce_64MiB_GBps\": %.3f, "
                  "\"allreduce_64MiB_busbw\": %.3f, \"broadcast_64MiB_GBps\": %.3f, "
                  "\"allgather_small_us\": %.1f, \"barrier_us\": %.1f}",
                  a.backend.c_str(), a.backend == "distrpc" ? a.transport.c_str() : "gloo", a.world,
                  allreduce_small, allreduce_gbps, busbw, bytes / broadcast_s / 1e9,
                  allgather_small, barrier);
    out << buf << "\n";
  }
  // Rank 0 writes before anyone leaves, and the store's host (rank 0) outlives the others.
  pg->barrier()->wait();
  pg->shutdown();
  return 0;
}

int launch(const Args& a) {
  std::vector<std::string> args{"--backend",   a.backend,
                                "--transport", a.transport,
                                "--world",     std::to_string(a.world),
                                "--small",     std::to_string(a.small),
                                "--big",       std::to_string(a.big)};
  if (a.gib) args.push_back("--gib");
  const std::string line =
      distrpc_examples::run_local_group_for_result(a.world, "collectives", args);
  if (line.empty()) {
    std::fprintf(stderr, "bench_collectives: a rank failed\n");
    return 1;
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    return a.rank < 0 ? launch(a) : run_worker(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: %s\n", e.what());
    return 2;
  }
}
