// DistributedDataParallel benchmark: the DDP figures PyTorch's own reference prints (examples/
// reference/torch_c10d_ref.py: Python, torch.nn.parallel.DistributedDataParallel on
// ProcessGroupGloo), measured for distrpc::nn::DistributedDataParallel on one of this build's
// process-group backends, with the same model, batch, counts and medians, so the two JSON lines
// compare key by key.
//
//   bench_ddp [--backend distrpc|gloo] [--transport shm|tcp|auto] [--world 2] [--timeout 600]
//
// It starts --world copies of itself on this machine (one per rank, meeting through a file
// rendezvous; each one intra-op thread, as the reference's torch.set_num_threads(1)) and prints
// rank 0's JSON line:
//   ddp_step_ms      median training step through DDP (zero_grad, forward, cross-entropy,
//                    backward with the bucketed all-reduce, SGD step) of an MLP
//                    1024-1024-1024-1024-10 with ReLUs (about 3.2 M parameters, 12.6 MiB of
//                    gradients), batch 16, default 25 MiB buckets: 5 warm-up steps, median of 50
//   local_step_ms    the same step without DDP on rank 0 (the compute alone)
//   ddp_overhead_ms  ddp_step_ms - local_step_ms: what data parallelism costs per step
// and, from ddp.stats() after the timed steps, how much communication overlapped the backward:
//   buckets, bucket_bytes                 the buckets (after their rebuild in gradient order)
//   reductions_launched                   bucket reductions launched in the last pass
//   reductions_before_last_gradient       of those, launched while gradients were still being
//                                         computed (they overlapped the backward pass)
// and, from a second wrapper whose communication hook notes when the first bucket is launched
// (then does exactly the default all-reduce), the medians over 20 steps of:
//   backward_ms                           loss.backward(), start to end
//   first_launch_to_backward_end_ms       the first bucket's launch to the end of backward
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "distrpc/ddp.hpp"
#include "distrpc/dist.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
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

// The reference's counts: median_us(step, 50, 5), and 20 steps for the launch timing.
constexpr int kSteps = 50;
constexpr int kWarm = 5;
constexpr int kTimingSteps = 20;

struct Args {
  std::string backend = "distrpc";
  std::string transport = "auto";  // for the distrpc backend
  int world = 2;
  int timeout_s = 600;
  int rank = -1;  // -1: the launcher
  std::string init;
  std::string out;
};

std::string backends_built() {
  std::string out = "distrpc";
#ifdef USE_C10D_GLOO
  out += ", gloo";
#endif
  return out;
}

std::vector<std::string> transports_built() {
#ifdef BENCH_HAVE_SHM
  return {"tcp", "shm", "auto"};
#else
  return {"tcp"};
#endif
}

int int_arg(const std::string& flag, const std::string& v) {
  std::size_t used = 0;
  int n = 0;
  try {
    n = std::stoi(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty()) {
    throw std::invalid_argument(flag + " needs a whole number, got '" + v + "'");
  }
  return n;
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
      a.world = int_arg(k, next());
    } else if (k == "--timeout") {
      a.timeout_s = int_arg(k, next());
    } else if (k == "--rank") {
      a.rank = int_arg(k, distrpc_examples::rank_text(next()));
    } else if (k == "--init") {
      a.init = next();
    } else if (k == "--out") {
      a.out = next();
    } else {
      throw std::invalid_argument("unknown argument '" + k +
                                  "' (expected --backend distrpc|gloo, --transport tcp|shm|auto, "
                                  "--world N, --timeout SECONDS)");
    }
  }
  if (a.backend != "distrpc" &&
      !(a.backend == "gloo" && backends_built().find("gloo") != std::string::npos)) {
    throw std::invalid_argument("unknown backend '" + a.backend +
                                "': this build has: " + backends_built());
  }
  const auto ts = transports_built();
  if (std::find(ts.begin(), ts.end(), a.transport) == ts.end()) {
    std::string have;
    for (const auto& t : ts) have += (have.empty() ? "" : ", ") + t;
    throw std::invalid_argument("unknown transport '" + a.transport + "': this build has: " + have);
  }
  if (a.world < 2 || a.world > 64) {
    throw std::invalid_argument("--world must be 2..64, got " + std::to_string(a.world));
  }
  if (a.timeout_s < 1) {
    throw std::invalid_argument("--timeout must be at least 1 second, got " +
                                std::to_string(a.timeout_s));
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

// Python's statistics.median: the mean of the two middle values for an even count (the
// reference's 50 steps).
double median_even(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

template <class F>
double median_ms(F&& fn, int n, int warm) {
  for (int i = 0; i < warm; ++i) fn();
  std::vector<double> lat;
  lat.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    fn();
    lat.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return median_even(std::move(lat));
}

// The reference's model, seeded the same way before it is built.
torch::nn::Sequential mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

// One training step of `forward` (the DDP wrapper or the bare module), as the reference's step().
template <class Forward>
auto step_fn(Forward& forward, torch::optim::SGD& opt, const at::Tensor& x, const at::Tensor& y) {
  return [&forward, &opt, x, y] {
    opt.zero_grad();
    at::Tensor loss = torch::nn::functional::cross_entropy(forward(x), y);
    loss.backward();
    opt.step();
  };
}

// The default averaging with a timestamp: the first call of a pass (bucket 0, since buckets are
// launched in order) records when communication started.
struct TimingHookState {
  std::shared_ptr<dist::ProcessGroup> group;  // null: the default group
  std::shared_ptr<std::atomic<Clock::rep>> first_launch =
      std::make_shared<std::atomic<Clock::rep>>(0);
};

distrpc::Future<at::Tensor> timing_hook(TimingHookState& s, distrpc::ddp::GradBucket& b) {
  if (b.index() == 0) s.first_launch->store(Clock::now().time_since_epoch().count());
  return distrpc::ddp::allreduce_hook(s.group, b);
}

int run_worker(const Args& a) {
  at::set_num_threads(1);
  register_backends(a);
  dist::init_process_group(a.backend, a.init, a.rank, a.world);

  torch::nn::Sequential model = mlp();
  distrpc::nn::DistributedDataParallel ddp(model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  const at::Tensor x = torch::randn({16, 1024});
  const at::Tensor y = torch::randint(0, 10, {16}, torch::kLong);
  auto ddp_forward = [&ddp](const at::Tensor& in) { return ddp(in); };
  const double ddp_step = median_ms(step_fn(ddp_forward, opt, x, y), kSteps, kWarm);
  const distrpc::ddp::ReducerStats stats = ddp.stats();

  // The overlap in time, on a second replica set with the timing hook.
  torch::nn::Sequential tmodel = mlp();
  distrpc::nn::DistributedDataParallel tddp(tmodel);
  TimingHookState hook_state;
  auto first_launch = hook_state.first_launch;
  tddp.register_comm_hook(hook_state, timing_hook);
  torch::optim::SGD topt(tmodel->parameters(), torch::optim::SGDOptions(0.01));
  std::vector<double> backward_ms, launch_to_end_ms;
  for (int i = 0; i < kWarm + kTimingSteps; ++i) {
    topt.zero_grad();
    at::Tensor loss = torch::nn::functional::cross_entropy(tddp(x), y);
    first_launch->store(0);
    const auto t0 = Clock::now();
    loss.backward();
    const auto t1 = Clock::now();
    topt.step();
    if (i < kWarm) continue;
    const Clock::time_point launched{Clock::duration{first_launch->load()}};
    backward_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    launch_to_end_ms.push_back(std::chrono::duration<double, std::milli>(t1 - launched).count());
  }

  if (a.rank == 0) {
    torch::nn::Sequential local = mlp();
    torch::optim::SGD lopt(local->parameters(), torch::optim::SGDOptions(0.01));
    auto local_forward = [&local](const at::Tensor& in) { return local->forward(in); };
    const double local_step = median_ms(step_fn(local_forward, lopt, x, y), kSteps, kWarm);
    std::string bytes;
    for (std::size_t b : stats.bucket_bytes) {
      bytes += (bytes.empty() ? "" : ", ") + std::to_string(b);
    }
    std::ofstream out(a.out);
    char buf[1024];
    std::snprintf(
        buf, sizeof buf,
        "{\"backend\": \"%s\", \"transport\": \"%s\", \"world\": %d, \"ddp_step_ms\": %.3f, "
        "\"local_step_ms\": %.3f, \"ddp_overhead_ms\": %.3f, \"buckets\": %zu, "
        "\"bucket_bytes\": [%s], \"reductions_launched\": %zu, "
        "\"reductions_before_last_gradient\": %zu, \"backward_ms\": %.3f, "
        "\"first_launch_to_backward_end_ms\": %.3f}",
        a.backend.c_str(), a.backend == "distrpc" ? a.transport.c_str() : "gloo", a.world, ddp_step,
        local_step, ddp_step - local_step, stats.bucket_count, bytes.c_str(),
        stats.reductions_launched, stats.reductions_before_last_gradient, median(backward_ms),
        median(launch_to_end_ms));
    out << buf << "\n";
  }
  // Rank 0 writes before anyone leaves, and the store's host (rank 0) outlives the others.
  dist::barrier();
  dist::destroy_process_group();
  return 0;
}

int launch(const Args& a) {
  const std::vector<std::string> args{"--backend",   a.backend,
                                      "--transport", a.transport,
                                      "--world",     std::to_string(a.world),
                                      "--timeout",   std::to_string(a.timeout_s)};
  const std::string line = distrpc_examples::run_local_group_for_result(
      a.world, "bench_ddp", args, std::chrono::seconds(a.timeout_s));
  if (line.empty()) {
    std::fprintf(stderr, "bench_ddp: a rank failed\n");
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
    std::fprintf(stderr, "bench_ddp: %s\n", e.what());
    return 2;
  }
}
