// bench_rpc: distrpc's RPC figures, with the keys of ../shared/bench/torch_rpc_ref.py so the two
// can be compared side by side. Starts its own two worker processes on loopback (re-executing
// this binary; no fork) and prints one JSON object.
//
//   build/examples/bench_rpc [--transport tcp|shm|auto|cuda_ipc|nccl] [--small N] [--big N]
//   [--async N]
//                            [--async-windows N]
//                            [--sync-spin-us N]   (RpcBackendOptions::sync_wait_spin; default: its)
//                            [--tls [DIR]]   (mutual TLS on tcp: DIR holds ca.pem, cert.pem and
//                                             key.pem; without DIR they are made with the openssl
//                                             command line in a temporary folder)
//   build/examples/bench_rpc --cuda [--transport T] [--big N]   (the GPU figures below only)
//
// echo_small_us    median round trip of rpc_sync(ident, tensor of 4 floats)
// echo_64MiB_GBps  bytes moved (there and back) per second echoing a 64 MiB float tensor (median)
// async_small_cps  completed calls per second with 64 small rpc_async in flight: the median of
//                  --async-windows (5) windows of --async (5000) calls each; one window is the
//                  reference's whole measurement. async_small_cps_first is the first window (the
//                  reference's procedure exactly), async_small_cps_min the slowest.
// idle_cpu_pct     CPU used by the idle 2-worker group (both processes) over 1 s, in % of one core
// remote_to_here_us median of remote(ident, tensor of 4 floats) then to_here() (the fetch goes
//                  along with the remote() call: one round trip, two requests answered)
// remote_fwd_us    median RemoteModule<torch::nn::Linear(64,64)>.forward round trip, input 8x64
// local_fwd_us     median forward of the same Linear(64,64) on the same input, in this process
//                  (the target: remote_fwd_us <= 1.2 x (echo_small_us + local_fwd_us))
// dist_step_us     median distributed-autograd step, as torch_rpc_ref.py measures it: in a fresh
//                  context, that RemoteModule's forward on an 8x64 input requiring grad, .sum(),
//                  the distributed backward, get_gradients (500 steps after 50)
// local_step_us    the same module's forward + backward run locally (the target:
//                  dist_step_us <= 1.25 x (2 x echo_small_us + local_step_us))
//
// With --cuda (two processes sharing cuda:0, device map {0: 0} both ways; nulls and "skipped"
// without a GPU):
// echo_cuda_64MiB_GBps  bytes moved (there and back) per second echoing a 64 MiB float tensor
//                       on cuda:0 (median of --big)
// cuda_d2d_copy_GBps    the GPU's own limit: bytes per second of a 64 MiB device-to-device copy
//                       on cuda:0 (median of 20 samples of 10 copies)
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "distrpc/dist_autograd.hpp"
#include "distrpc/distrpc.hpp"
#include "distrpc/nn/remote_module.hpp"
#include "distrpc/transport/tcp.hpp"
#if __has_include("distrpc/transport/shm.hpp")
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#define BENCH_HAVE_SHM 1
#endif
#ifdef DISTRPC_HAVE_CUDART
#include "distrpc/transport/cuda_ipc.hpp"
#endif
#ifdef DISTRPC_HAVE_NCCL
#include "distrpc/transport/nccl.hpp"
#endif
#include "spawn_self.hpp"

namespace {

using Clock = std::chrono::steady_clock;

at::Tensor ident(at::Tensor t) {
  return t;
}

// remote_fwd_us: the interface torch_rpc_ref.py's RemoteModule(nn.Linear) is called through.
struct LinearInterface {
  at::Tensor forward(at::Tensor x);
};

// CPU seconds (user + system) this process has used: called remotely to measure an idle group.
double process_cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

struct Args {
  std::string transport = "tcp";
  int rank = -1;  // -1: the launcher
  std::string init;
  std::string out;
  int small = 2000;
  int big = 10;
  int async_calls = 5000;
  int async_windows = 5;
  int sync_spin_us = -1;  // -1: the library's default (RpcBackendOptions::sync_wait_spin)
  bool tls = false;
  std::string tls_dir;  // empty with tls: made for this run
  bool cuda = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + k);
      return argv[++i];
    };
    if (k == "--transport") {
      a.transport = next();
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
    } else if (k == "--async") {
      a.async_calls = std::stoi(next());
    } else if (k == "--async-windows") {
      a.async_windows = std::stoi(next());
    } else if (k == "--sync-spin-us") {
      a.sync_spin_us = std::stoi(next());
    } else if (k == "--cuda") {
      a.cuda = true;
    } else if (k == "--tls") {
      a.tls = true;
      if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) a.tls_dir = argv[++i];
    } else {
      throw std::invalid_argument(
          "unknown argument '" + k +
          "' (expected --transport tcp|shm|auto, --small N, --big N, "
          "--async N, --async-windows N, --sync-spin-us N, --tls [DIR], --cuda)");
    }
  }
  for (const auto& [name, value] : {std::pair<const char*, int>{"--small", a.small},
                                    {"--big", a.big},
                                    {"--async", a.async_calls},
                                    {"--async-windows", a.async_windows}}) {
    if (value < 1) {
      throw std::invalid_argument(std::string(name) + " must be at least 1, got " +
                                  std::to_string(value));
    }
  }
  std::vector<std::string> known{"tcp"};
#ifdef BENCH_HAVE_SHM
  known.insert(known.end(), {"shm", "auto"});
#endif
#ifdef DISTRPC_HAVE_CUDART
  known.push_back("cuda_ipc");
#endif
#ifdef DISTRPC_HAVE_NCCL
  known.push_back("nccl");
#endif
  if (std::find(known.begin(), known.end(), a.transport) == known.end()) {
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    throw std::invalid_argument("unknown transport '" + a.transport + "': this build has: " + list);
  }
  return a;
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
    auto t0 = Clock::now();
    fn();
    lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return median(std::move(lat));
}

// The GPU figures (--cuda), on worker0; the group is already up with device maps {0: 0}.
std::string cuda_figures(const Args& a) {
  const at::Tensor big = torch::ones({16 * 1024 * 1024}, torch::device(torch::kCUDA));
  torch::cuda::synchronize();
  // rpc_sync returns once the reply's tensor is on cuda:0 (copied there before the reply
  // completes), so no synchronization is needed inside the timed call.
  const double echo_us =
      median_us([&] { (void)distrpc::rpc_sync<&ident>("worker1", big); }, a.big, 1);
  // 10 copies per sample, so one launch and one synchronization are not what is measured.
  at::Tensor dst = torch::empty_like(big);
  auto ten_copies = [&] {
    for (int i = 0; i < 10; ++i) dst.copy_(big);
    torch::cuda::synchronize();
  };
  const double copy_us = median_us(ten_copies, 20, 2) / 10;
  const double bytes = static_cast<double>(big.nbytes());
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "{\"transport\": \"%s\", \"echo_cuda_64MiB_GBps\": %.3f, "
                "\"cuda_d2d_copy_GBps\": %.3f}",
                a.transport.c_str(), 2.0 * bytes / (echo_us / 1e6) / 1e9,
                bytes / (copy_us / 1e6) / 1e9);
  return buf;
}

// init_rpc on the policy --transport names (parse() accepted it for this build).
void init_worker(const Args& a, const std::string& me, const distrpc::RpcBackendOptions& opts) {
  using namespace distrpc::transport;
#ifdef BENCH_HAVE_SHM
  if (a.transport == "shm") return distrpc::init_rpc<Shm>(me, a.rank, 2, opts);
  if (a.transport == "auto") return distrpc::init_rpc<Auto<Shm, Tcp>>(me, a.rank, 2, opts);
#endif
#ifdef DISTRPC_HAVE_CUDART
  // CUDA tensors GPU to GPU through CUDA IPC, the messages over tcp.
  if (a.transport == "cuda_ipc") return distrpc::init_rpc<CudaIpc<Tcp>>(me, a.rank, 2, opts);
#endif
#ifdef DISTRPC_HAVE_NCCL
  // Nccl<Tcp>: NCCL between different GPUs; on one GPU shared by both workers, its CUDA IPC side.
  if (a.transport == "nccl") return distrpc::init_rpc<Nccl<Tcp>>(me, a.rank, 2, opts);
#endif
  distrpc::init_rpc<Tcp>(me, a.rank, 2, opts);
}

int run_worker(const Args& a) {
  distrpc::RpcBackendOptions opts;
  opts.init_method = a.init;
  opts.num_worker_threads = 8;
  opts.rpc_timeout = std::chrono::seconds(120);
  if (a.sync_spin_us >= 0) opts.sync_wait_spin = std::chrono::microseconds(a.sync_spin_us);
  const std::string me = "worker" + std::to_string(a.rank);
  if (a.cuda) opts.set_device_map("worker" + std::to_string(1 - a.rank), {{0, 0}});
  init_worker(a, me, opts);
  if (a.rank == 0 && a.cuda) {
    std::ofstream(a.out) << cuda_figures(a) << "\n";
  } else if (a.rank == 0) {
    const at::Tensor small = torch::ones({4});
    const double echo_small = median_us([&] { (void)distrpc::rpc_sync<&ident>("worker1", small); },
                                        a.small, a.small / 10);
    const double remote_to_here = median_us(
        [&] { (void)distrpc::remote<&ident>("worker1", small).to_here(); }, a.small, a.small / 10);
    // RemoteModule forward round trip as torch_rpc_ref.py measures it (1000 calls after 100 by
    // default), and the same module's forward run locally, so the target can be read off one run;
    // right after the echo, in the same machine state.
    const int fwd_calls = std::max(10, a.small / 2);
    double remote_fwd = 0;
    double local_fwd = 0;
    double dist_step = 0;
    double local_step = 0;
    {
      auto rm = distrpc::nn::RemoteModule<LinearInterface>::create<torch::nn::Linear>("worker1/cpu",
                                                                                      64, 64);
      const at::Tensor x = torch::randn({8, 64});
      remote_fwd = median_us([&] { (void)rm.forward(x); }, fwd_calls, fwd_calls / 10);
      torch::nn::Linear local(64, 64);
      local_fwd = median_us([&] { (void)local->forward(x); }, fwd_calls, fwd_calls / 10);
      const at::Tensor xg = torch::randn({8, 64}, torch::requires_grad());
      const int steps = std::max(10, a.small / 4);
      dist_step = median_us(
          [&] {
            distrpc::dist_autograd::Context ctx;
            at::Tensor loss = rm.forward(xg).sum();
            distrpc::dist_autograd::backward(ctx.id(), {loss});
            (void)distrpc::dist_autograd::get_gradients(ctx.id());
          },
          steps, steps / 10);
      local_step = median_us(
          [&] {
            at::Tensor loss = local->forward(xg).sum();
            (void)torch::autograd::grad({loss}, {xg, local->weight, local->bias});
          },
          steps, steps / 10);
    }
    const at::Tensor big = torch::ones({16 * 1024 * 1024});
    const double big_us =
        median_us([&] { (void)distrpc::rpc_sync<&ident>("worker1", big); }, a.big, 1);
    const double gbps = 2.0 * static_cast<double>(big.nbytes()) / (big_us / 1e6) / 1e9;
    // One window is the reference's measurement (5000 calls, 64 in flight). Ours lasts 20-50 ms
    // where PyTorch's lasts seconds, so one preemption of either process moves it by half; the
    // figure is the median of --async-windows windows, and the first window (exactly the
    // reference's procedure, no warm-up) is reported beside it.
    auto async_window = [&] {
      std::deque<distrpc::Future<at::Tensor>> inflight;
      const auto t0 = Clock::now();
      for (int i = 0; i < a.async_calls; ++i) {
        inflight.push_back(distrpc::rpc_async<&ident>("worker1", small));
        if (inflight.size() >= 64) {
          inflight.front().wait();
          inflight.pop_front();
        }
      }
      for (auto& f : inflight) f.wait();
      return a.async_calls / std::chrono::duration<double>(Clock::now() - t0).count();
    };
    std::vector<double> windows;
    for (int w = 0; w < a.async_windows; ++w) windows.push_back(async_window());
    const double cps_first = windows.front();
    const double cps_min = *std::min_element(windows.begin(), windows.end());
    const double cps = median(std::move(windows));
    // Idle group: both workers connected and doing nothing for 1 s (after 0.5 s for any spinning
    // to stop). The two calls that read worker1's counter are inside the window's edges, not in it.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const double w1_before = distrpc::rpc_sync<&process_cpu_seconds>("worker1");
    const double w0_before = process_cpu_seconds();
    const auto idle_t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::seconds(1));
    const double w0_after = process_cpu_seconds();
    const double idle_wall = std::chrono::duration<double>(Clock::now() - idle_t0).count();
    const double w1_after = distrpc::rpc_sync<&process_cpu_seconds>("worker1");
    const double idle_pct = 100.0 * ((w0_after - w0_before) + (w1_after - w1_before)) / idle_wall;
    std::ofstream out(a.out);
    char buf[768];
    std::snprintf(buf, sizeof buf,
                  "{\"transport\": \"%s\", \"echo_small_us\": %.1f, \"echo_64MiB_GBps\": %.3f, "
                  "\"async_small_cps\": %.0f, \"async_small_cps_first\": %.0f, "
                  "\"async_small_cps_min\": %.0f, \"idle_cpu_pct\": %.2f, "
                  "\"remote_to_here_us\": %.1f, \"remote_fwd_us\": %.1f, \"local_fwd_us\": %.1f, "
                  "\"dist_step_us\": %.1f, \"local_step_us\": %.1f}",
                  a.transport.c_str(), echo_small, gbps, cps, cps_first, cps_min, idle_pct,
                  remote_to_here, remote_fwd, local_fwd, dist_step, local_step);
    out << buf << "\n";
  }
  distrpc::shutdown();
  return 0;
}

// A CA and one certificate both workers present (each checks the other's against the CA).
std::string make_certs() {
  std::string dir = (std::filesystem::temp_directory_path() / "bench-rpc-tls-XXXXXX").string();
  if (!::mkdtemp(dir.data())) throw std::runtime_error("--tls: cannot make a temporary folder");
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string cmd = "cd " + dir + " && openssl req -x509 " + key +
                          " -keyout ca.key -out ca.pem -days 2 -subj /CN=bench-ca && openssl req " +
                          key + " -keyout key.pem -out cert.csr -subj /CN=bench && openssl x509 " +
                          "-req -in cert.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out " +
                          "cert.pem -days 2";
  if (std::system(("(" + cmd + ") >/dev/null 2>&1").c_str()) != 0) {
    throw std::runtime_error("--tls: making certificates with the openssl command line failed");
  }
  return dir;
}

int launch(Args a) {
  if (a.cuda && !torch::cuda::is_available()) {
    std::printf(
        "{\"transport\": \"%s\", \"echo_cuda_64MiB_GBps\": null, \"cuda_d2d_copy_GBps\": null, "
        "\"skipped\": \"no GPU\"}\n",
        a.transport.c_str());
    return 0;
  }
  std::string made;
  if (a.tls) {
    if (a.transport != "tcp") throw std::invalid_argument("--tls needs --transport tcp");
    if (a.tls_dir.empty()) a.tls_dir = made = make_certs();
    for (const char* f : {"ca.pem", "cert.pem", "key.pem"}) {
      if (!std::filesystem::exists(std::filesystem::path(a.tls_dir) / f)) {
        throw std::invalid_argument("--tls " + a.tls_dir + ": no " + f + " there");
      }
    }
    // The workers inherit these: their rendezvous store and their transport both speak TLS,
    // without a line of code (docs/security.md, "TLS").
    ::setenv("DISTRPC_TLS_CERT", (a.tls_dir + "/cert.pem").c_str(), 1);
    ::setenv("DISTRPC_TLS_KEY", (a.tls_dir + "/key.pem").c_str(), 1);
    ::setenv("DISTRPC_TLS_CA", (a.tls_dir + "/ca.pem").c_str(), 1);
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{made};
  std::vector<std::string> args{"--transport",     a.transport,
                                "--small",         std::to_string(a.small),
                                "--big",           std::to_string(a.big),
                                "--async",         std::to_string(a.async_calls),
                                "--async-windows", std::to_string(a.async_windows),
                                "--sync-spin-us",  std::to_string(a.sync_spin_us)};
  if (a.cuda) args.push_back("--cuda");
  const std::string line = distrpc_examples::run_local_group_for_result(2, "bench", args);
  if (line.empty()) {
    std::fprintf(stderr, "bench_rpc: a worker failed\n");
    return 1;
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse(argc, argv);
    return a.rank < 0 ? launch(a) : run_worker(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_rpc: %s\n", e.what());
    return 2;
  }
}
