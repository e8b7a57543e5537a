// PowerSGD gradient compression for DDP (PyTorch's
// torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook; Vogels et al., "PowerSGD: Practical
// Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019).
//
//   distrpc::ddp::PowerSGDState state({.matrix_approximation_rank = 2,
//                                      .start_powerSGD_iter = 1000});
//   ddp.register_comm_hook(std::move(state), distrpc::ddp::powerSGD_hook);
//
// For the first start_powerSGD_iter iterations a hook all-reduces the bucket plainly (as
// allreduce_hook). From then on powerSGD_hook views each gradient of the bucket as a matrix
// (first dimension x the rest): those of rank <= 1 and those too small to be worth compressing
// (min_compression_rate) are all-reduced as they are, in one flat batch; every other matrix M is
// approximated as P Q^T with P = M Q all-reduced, orthogonalized (Gram-Schmidt), then
// Q = M^T P all-reduced and divided by the group's size. With error feedback, what the
// approximation lost on this rank is added to the bucket's gradients the next iteration; with
// warm start, Q carries over to the next iteration (one step of power iteration per iteration).
// batched_powerSGD_hook instead compresses the whole bucket as one square matrix (faster, much
// less accurate unless matrix_approximation_rank is 1). Buckets of float32, float64, float16 and
// bfloat16 (on the CPU the last two multiply in float32; all else stays in the bucket's dtype).
//
// Ranks agree without talking: the random Qs come from a generator seeded with random_seed, drawn
// in the order the hooks are called, which DDP keeps the same on every rank.
//
// Threads and order: a hook returns at once; the all-reduces of P and Q are chained through
// futures and the decompression runs on the backend thread that completes the last one. The
// collectives of one state are issued in the order its hooks were called, even though the Q
// all-reduce of one bucket is issued from a completion callback: the next bucket's collectives
// wait (asynchronously) until it has been, so every rank issues them in the same order whatever
// the timing (a backend pairs the members' n-th collectives). Collectives of the group issued
// meanwhile by other code are not ordered with them: DDP issues none while buckets are reduced.
//
// Errors: PowerSGDState's constructor refuses inconsistent settings (std::invalid_argument, with
// PyTorch's text where PyTorch has one); a hook refuses a group this process is not a member of,
// a buffer that is not 1-D, contiguous and floating-point, and a bucket whose size changed after
// PowerSGD started (std::invalid_argument, from the call). A failed collective fails the Future.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <distrpc/ddp/comm_hooks.hpp>
#include <distrpc/ddp/grad_bucket.hpp>
#include <distrpc/dist.hpp>
#include <distrpc/future.hpp>

namespace distrpc::ddp {

// PowerSGD's hyperparameters, with PyTorch's names and defaults (designated initializers).
struct PowerSGDOptions {
  std::shared_ptr<dist::ProcessGroup> process_group{};  // null: the default group
  // The rank of the approximation: lower compresses more. 1 to 4 is typical.
  int matrix_approximation_rank = 1;
  // Plain all-reduce until this iteration (DDP rebuilds its buckets after the first one, which
  // would invalidate the error and warm-start memory kept per bucket).
  std::int64_t start_powerSGD_iter = 1000;
  // A matrix n x m is compressed only if (n + m) * rank * min_compression_rate < n * m.
  double min_compression_rate = 2;
  bool use_error_feedback = true;
  bool warm_start = true;
  // Added to each column's norm when orthogonalizing (e.g. 1e-8) where columns may vanish;
  // with 0 a column of zeros stays zero.
  double orthogonalization_epsilon = 0;
  std::uint64_t random_seed = 0;
  // Compress same-shaped matrices of a bucket in one batched product (more parallel compute, one
  // stacked copy of them in memory).
  bool batch_tensors_with_same_shape = false;
};

// PowerSGDState::compression_stats(): PyTorch's (compress_rate, numel_before, numel_after).
struct CompressionStats {
  double compress_rate = 0;  // numel_before / numel_after; 0 before any compression
  std::int64_t numel_before_compression = 0;
  std::int64_t numel_after_compression = 0;
};

namespace detail {
struct PowerSGDShared;
}

// PowerSGD's settings and what it remembers between iterations, per bucket index: the local error
// (error feedback) and the P and Q memory (warm start). One state serves every bucket of a DDP
// model. Movable; the futures of hooks still in flight keep what they need alive.
class PowerSGDState {
 public:
  explicit PowerSGDState(PowerSGDOptions options = {});
  // PyTorch's positional form: PowerSGDState(process_group, matrix_approximation_rank, ...).
  explicit PowerSGDState(std::shared_ptr<dist::ProcessGroup> process_group,
                         int matrix_approximation_rank = 1, std::int64_t start_powerSGD_iter = 1000,
                         double min_compression_rate = 2, bool use_error_feedback = true,
                         bool warm_start = true, double orthogonalization_epsilon = 0,
                         std::uint64_t random_seed = 0, bool batch_tensors_with_same_shape = false);

  PowerSGDState(PowerSGDState&&) noexcept = default;
  PowerSGDState& operator=(PowerSGDState&&) noexcept = default;
  PowerSGDState(const PowerSGDState&) = delete;
  PowerSGDState& operator=(const PowerSGDState&) = delete;

  const PowerSGDOptions& options() const noexcept { return options_; }
  const std::shared_ptr<dist::ProcessGroup>& process_group() const noexcept {
    return options_.process_group;
  }
  int matrix_approximation_rank() const noexcept { return options_.matrix_approximation_rank; }
  std::int64_t start_powerSGD_iter() const noexcept { return options_.start_powerSGD_iter; }
  double min_compression_rate() const noexcept { return options_.min_compression_rate; }
  bool use_error_feedback() const noexcept { return options_.use_error_feedback; }
  bool warm_start() const noexcept { return options_.warm_start; }
  double orthogonalization_epsilon() const noexcept { return options_.orthogonalization_epsilon; }
  std::uint64_t random_seed() const noexcept { return options_.random_seed; }
  bool batch_tensors_with_same_shape() const noexcept {
    return options_.batch_tensors_with_same_shape;
  }

  // Iterations seen: advanced when a hook is called with the last bucket of an iteration.
  std::int64_t iter() const;
  // Elements the compressed buckets held, and what travelled instead, since the start.
  CompressionStats compression_stats() const;
  // What bucket `bucket_index` keeps between iterations (undefined where nothing yet): this rank's
  // compression error (error feedback), and the P and Q memory (warm start, flat). Read them
  // between iterations, not while that bucket's hook is in flight.
  at::Tensor error(std::size_t bucket_index) const;
  at::Tensor p_memory(std::size_t bucket_index) const;
  at::Tensor q_memory(std::size_t bucket_index) const;

 private:
  friend Future<at::Tensor> powerSGD_hook(PowerSGDState& state, GradBucket& bucket);
  friend Future<at::Tensor> batched_powerSGD_hook(PowerSGDState& state, GradBucket& bucket);

  const detail::PowerSGDShared& shared(const char* what) const;

  PowerSGDOptions options_;
  std::shared_ptr<detail::PowerSGDShared> shared_;
};

// PyTorch's powerSGD_hook: layer-wise low-rank compression (see the header comment). The Future
// holds the bucket's buffer, overwritten with the averaged (approximated) gradients.
inline Future<at::Tensor> powerSGD_hook(PowerSGDState& state, GradBucket& bucket);

// PyTorch's batched_powerSGD_hook: the whole bucket as one square matrix, zero-padded.
inline Future<at::Tensor> batched_powerSGD_hook(PowerSGDState& state, GradBucket& bucket);

// ---- Implementation

namespace detail {

inline constexpr const char* kPowerSGDLog = "distrpc::ddp::PowerSGD";

struct PowerSGDShared {
  explicit PowerSGDShared(std::uint64_t seed) : rng(seed) {}

  mutable std::mutex mu;  // guards every member below; held for bookkeeping only
  std::int64_t iter = 0;
  std::int64_t numel_before = 0;
  std::int64_t numel_after = 0;
  // The seeds of the random Qs: mt19937_64's sequence is fixed by the standard, so ranks built
  // with different standard libraries draw the same seeds.
  std::mt19937_64 rng;
  std::map<std::size_t, at::Tensor> error;
  std::map<std::size_t, at::Tensor> p_memory;
  std::map<std::size_t, at::Tensor> q_memory;
  // Completes once the previous hook has issued all its collectives (see the header comment).
  Future<void> issue_tail = make_ready_future();

  static at::Tensor find(const std::map<std::size_t, at::Tensor>& m, std::size_t i) {
    auto it = m.find(i);
    return it == m.end() ? at::Tensor() : it->second;
  }
};

// Runs issue(issued) once every hook called before on this state has issued its collectives;
// `issue` completes `issued` once it has issued its own (on every path, failures included).
template <class Issue>
Future<at::Tensor> in_issue_order(PowerSGDShared& s, Issue issue) {
  Future<void> issued;
  Future<void> previous;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    previous = s.issue_tail;
    s.issue_tail = issued;
  }
  return previous.then(
      [issue = std::move(issue), issued](Future<void>&) mutable -> Future<at::Tensor> {
        try {
          return issue(issued);
        } catch (...) {
          issued.try_set_value();
          throw;
        }
      });
}

// Completes `issued` when a stage ends, however it ends.
class IssuedOnExit {
 public:
  explicit IssuedOnExit(Future<void> issued) : issued_(std::move(issued)) {}
  ~IssuedOnExit() { issued_.try_set_value(); }
  IssuedOnExit(const IssuedOnExit&) = delete;
  IssuedOnExit& operator=(const IssuedOnExit&) = delete;

 private:
  Future<void> issued_;
};

// Gram-Schmidt on each matrix of a batch (b x n x r), in place: orthonormal columns. A column of
// zeros stays zero with epsilon 0 (PyTorch's intent; dividing by its norm would make NaNs).
inline void orthogonalize(const at::Tensor& matrices, double epsilon) {
  const std::int64_t cols = matrices.size(2);
  for (std::int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    at::Tensor norm = col.norm(2, {1}, /*keepdim=*/true);
    if (epsilon == 0) {
      col.div_(at::where(norm > 0, norm, at::ones_like(norm)));
    } else {
      col.div_(norm + epsilon);
    }
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_((col * rest).sum({1}, /*keepdim=*/true) * col);
    }
  }
}

// Standard normal values, the same on every rank for the same seed (drawn on the CPU, as
// PyTorch does, then copied to the tensor's device and dtype).
inline void fill_random(const std::vector<at::Tensor>& tensors, std::uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (const at::Tensor& t : tensors) {
    const at::ScalarType dt = t.scalar_type();
    const at::ScalarType draw = (dt == at::kFloat || dt == at::kDouble) ? dt : at::kFloat;
    t.copy_(at::randn(t.sizes(), gen, at::TensorOptions().dtype(draw).device(at::kCPU)));
  }
}

// a @ b batched, in a's dtype. libtorch has no CPU matrix product for float16: there the product
// runs in float32 (only the product: what travels and is stored stays in the bucket's dtype).
inline at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
  const at::ScalarType dt = a.scalar_type();
  if (a.is_cpu() && (dt == at::kHalf || dt == at::kBFloat16)) {
    return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(dt);
  }
  return at::matmul(a, b);
}

// The reduced tensor of a Work into `dst`, which the backends reduce in place (kept correct for
// one that returns a fresh tensor).
inline void take_result(const at::Tensor& dst, const Future<std::vector<at::Tensor>>& f) {
  const at::Tensor& out = f.value().at(0);
  if (!out.is_same(dst)) dst.copy_(out);
}

inline std::int64_t draw_seed(PowerSGDShared& s) {
  std::lock_guard<std::mutex> lk(s.mu);
  return static_cast<std::int64_t>(s.rng() % 1000000000ULL);
}

// The error kept for bucket `index`, added to `input`; a zero error is made the first time.
inline void add_error(PowerSGDShared& s, std::size_t index, const at::Tensor& input,
                      const char* hook) {
  at::Tensor err;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    err = PowerSGDShared::find(s.error, index);
    if (!err.defined()) s.error[index] = at::zeros_like(input);
  }
  if (!err.defined()) return;
  if (err.numel() != input.numel()) {
    throw std::invalid_argument(
        std::string(hook) + ": bucket " + std::to_string(index) + " holds " +
        std::to_string(input.numel()) + " elements but held " + std::to_string(err.numel()) +
        " when PowerSGD started on it; buckets must not change after start_powerSGD_iter");
  }
  input.add_(err);
}

// Whether this call compresses (PyTorch: from iteration start_powerSGD_iter on).
inline bool compressing_now(PowerSGDShared& s, const PowerSGDOptions& o) {
  std::lock_guard<std::mutex> lk(s.mu);
  return s.iter >= o.start_powerSGD_iter;
}
// The last bucket of an iteration ends it. Advanced when the hook is called (PyTorch advances it
// when the compressed bucket's future completes; DDP waits for every bucket before the next
// iteration, so both see the same count at every call).
inline void advance_iter(PowerSGDShared& s, const GradBucket& b) {
  if (!b.is_last()) return;
  std::lock_guard<std::mutex> lk(s.mu);
  ++s.iter;
}

// allreduce_hook's reduction, in the state's issue order like the compressed path's collectives.
inline Future<at::Tensor> plain_allreduce(PowerSGDShared& s,
                                          std::shared_ptr<dist::ProcessGroup> group,
                                          at::Tensor input) {
  return in_issue_order(s, [group = std::move(group), input](const Future<void>& issued) {
    IssuedOnExit done(issued);
    return allreduce_fut(group, input);
  });
}

// One batch of same-shaped matrices compressed together (b x n x m), with its P (b x n x r) and
// Q (b x m x r) views of the bucket's P and Q memory. `originals` are set where `matrices` is a
// stacked copy (written back after decompression); otherwise `matrices` views the buffer.
struct CompressBatch {
  at::Tensor matrices;
  std::vector<at::Tensor> originals;
  at::Tensor p;
  at::Tensor q;
};

}  // namespace detail

inline PowerSGDState::PowerSGDState(PowerSGDOptions options) : options_(std::move(options)) {
  // PyTorch's check and text.
  if ((options_.use_error_feedback || options_.warm_start) && options_.start_powerSGD_iter <= 1) {
    throw std::invalid_argument(
        "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
        "because PowerSGD can only be applied after the first two iterations in DDP.");
  }
  if (options_.matrix_approximation_rank < 1) {
    throw std::invalid_argument(
        "PowerSGDState: matrix_approximation_rank must be at least 1, got " +
        std::to_string(options_.matrix_approximation_rank));
  }
  if (!(options_.min_compression_rate >= 0)) {
    throw std::invalid_argument("PowerSGDState: min_compression_rate must not be negative, got " +
                                std::to_string(options_.min_compression_rate));
  }
  if (!(options_.orthogonalization_epsilon >= 0)) {
    throw std::invalid_argument(
        "PowerSGDState: orthogonalization_epsilon must not be negative, got " +
        std::to_string(options_.orthogonalization_epsilon));
  }
  if (options_.start_powerSGD_iter < 0) {
    throw std::invalid_argument("PowerSGDState: start_powerSGD_iter must not be negative, got " +
                                std::to_string(options_.start_powerSGD_iter));
  }
  shared_ = std::make_shared<detail::PowerSGDShared>(options_.random_seed);
}

inline PowerSGDState::PowerSGDState(std::shared_ptr<dist::ProcessGroup> process_group,
                                    int matrix_approximation_rank, std::int64_t start_powerSGD_iter,
                                    double min_compression_rate, bool use_error_feedback,
                                    bool warm_start, double orthogonalization_epsilon,
                                    std::uint64_t random_seed, bool batch_tensors_with_same_shape)
    : PowerSGDState(PowerSGDOptions{std::move(process_group), matrix_approximation_rank,
                                    start_powerSGD_iter, min_compression_rate, use_error_feedback,
                                    warm_start, orthogonalization_epsilon, random_seed,
                                    batch_tensors_with_same_shape}) {}

inline const detail::PowerSGDShared& PowerSGDState::shared(const char* what) const {
  if (!shared_) {
    throw std::logic_error(std::string(what) + ": this PowerSGDState was moved from");
  }
  return *shared_;
}

inline std::int64_t PowerSGDState::iter() const {
  const auto& s = shared("PowerSGDState::iter");
  std::lock_guard<std::mutex> lk(s.mu);
  return s.iter;
}

inline CompressionStats PowerSGDState::compression_stats() const {
  const auto& s = shared("PowerSGDState::compression_stats");
  std::lock_guard<std::mutex> lk(s.mu);
  CompressionStats out;
  out.numel_before_compression = s.numel_before;
  out.numel_after_compression = s.numel_after;
  out.compress_rate = s.numel_after > 0
                          ? static_cast<double>(s.numel_before) / static_cast<double>(s.numel_after)
                          : 0.0;
  return out;
}

inline at::Tensor PowerSGDState::error(std::size_t bucket_index) const {
  const auto& s = shared("PowerSGDState::error");
  std::lock_guard<std::mutex> lk(s.mu);
  return detail::PowerSGDShared::find(s.error, bucket_index);
}
inline at::Tensor PowerSGDState::p_memory(std::size_t bucket_index) const {
  const auto& s = shared("PowerSGDState::p_memory");
  std::lock_guard<std::mutex> lk(s.mu);
  return detail::PowerSGDShared::find(s.p_memory, bucket_index);
}
inline at::Tensor PowerSGDState::q_memory(std::size_t bucket_index) const {
  const auto& s = shared("PowerSGDState::q_memory");
  std::lock_guard<std::mutex> lk(s.mu);
  return detail::PowerSGDShared::find(s.q_memory, bucket_index);
}

inline Future<at::Tensor> powerSGD_hook(PowerSGDState& state, GradBucket& bucket) {
  constexpr const char* kHook = "powerSGD_hook";
  state.shared(kHook);
  const std::shared_ptr<detail::PowerSGDShared> shared = state.shared_;
  const PowerSGDOptions& o = state.options_;
  std::shared_ptr<dist::ProcessGroup> group = detail::hook_group(o.process_group, kHook);
  at::Tensor input = detail::checked_buffer(bucket, kHook, detail::BufferKinds::floating);

  if (!detail::compressing_now(*shared, o)) {
    detail::advance_iter(*shared, bucket);
    return detail::plain_allreduce(*shared, std::move(group), input);
  }

  const std::size_t index = bucket.index();
  const int world = group->size();
  const double epsilon = o.orthogonalization_epsilon;

  // Error feedback: last iteration's local error joins this iteration's gradients; the copy is
  // what the decompressed result is compared with to get this iteration's error.
  at::Tensor input_copy;
  if (o.use_error_feedback) {
    detail::add_error(*shared, index, input, kHook);
    input_copy = input.clone();
  }

  // Step I: which gradients are compressed (as n x m matrices) and which are reduced as they are.
  std::vector<at::Tensor> uncompressed;
  std::vector<at::Tensor> to_compress;
  std::int64_t total_p = 0;
  std::int64_t total_q = 0;
  std::int64_t before = 0;
  std::int64_t after = 0;
  for (const at::Tensor& grad : bucket.gradients()) {
    if (grad.dim() <= 1 || grad.numel() == 0) {
      // A vector (n x 1) never pays: (n + 1) * rank * rate >= n for any rate >= 1.
      uncompressed.push_back(grad);
      before += grad.numel();
      after += grad.numel();
      continue;
    }
    at::Tensor matrix = grad.view({grad.size(0), -1});
    const std::int64_t n = matrix.size(0);
    const std::int64_t m = matrix.size(1);
    const std::int64_t r = std::min({n, m, static_cast<std::int64_t>(o.matrix_approximation_rank)});
    const std::int64_t compressed = (n + m) * r;
    before += n * m;
    if (static_cast<double>(compressed) * o.min_compression_rate < static_cast<double>(n * m)) {
      to_compress.push_back(matrix);
      total_p += n * r;
      total_q += m * r;
      after += compressed;
    } else {
      uncompressed.push_back(grad);
      after += n * m;
    }
  }

  // Step II: the uncompressed gradients in one contiguous tensor, one all-reduce for them all.
  std::vector<at::Tensor> flat;
  flat.reserve(uncompressed.size());
  for (const at::Tensor& t : uncompressed) flat.push_back(t.reshape({-1}));
  at::Tensor uncompressed_memory = flat.empty() ? at::empty({0}, input.options()) : at::cat(flat);

  // Step III: P and Q memory, kept per bucket with warm start (made again if the bucket's
  // compressed layout changed).
  at::Tensor p_memory;
  at::Tensor q_memory;
  if (o.warm_start) {
    std::lock_guard<std::mutex> lk(shared->mu);
    p_memory = detail::PowerSGDShared::find(shared->p_memory, index);
    q_memory = detail::PowerSGDShared::find(shared->q_memory, index);
  }
  bool randomize = false;
  if (!p_memory.defined() || p_memory.numel() != total_p || q_memory.numel() != total_q) {
    randomize = true;
    p_memory = at::empty({total_p}, input.options());
    q_memory = at::empty({total_q}, input.options());
    if (o.warm_start) {
      std::lock_guard<std::mutex> lk(shared->mu);
      shared->p_memory[index] = p_memory;
      shared->q_memory[index] = q_memory;
    }
  }

  // Batches by shape, in the order each shape first appears (the same on every rank).
  std::vector<std::vector<at::Tensor>> by_shape;
  for (const at::Tensor& mat : to_compress) {
    auto it = std::find_if(by_shape.begin(), by_shape.end(),
                           [&](const auto& g) { return g.front().sizes() == mat.sizes(); });
    if (it == by_shape.end()) {
      by_shape.push_back({mat});
    } else {
      it->push_back(mat);
    }
  }
  auto batches = std::make_shared<std::vector<detail::CompressBatch>>();
  for (const auto& same : by_shape) {
    if (o.batch_tensors_with_same_shape && same.size() > 1) {
      batches->push_back({at::stack(same), same, {}, {}});
    } else {
      for (const at::Tensor& mat : same) batches->push_back({mat.unsqueeze(0), {}, {}, {}});
    }
  }
  std::int64_t p_at = 0;
  std::int64_t q_at = 0;
  for (auto& b : *batches) {
    const std::int64_t count = b.matrices.size(0);
    const std::int64_t n = b.matrices.size(1);
    const std::int64_t m = b.matrices.size(2);
    const std::int64_t r = std::min({n, m, static_cast<std::int64_t>(o.matrix_approximation_rank)});
    b.p = p_memory.narrow(0, p_at, count * n * r).view({count, n, r});
    b.q = q_memory.narrow(0, q_at, count * m * r).view({count, m, r});
    p_at += count * n * r;
    q_at += count * m * r;
  }

  // Q: last iteration's (warm start), re-orthogonalized, or fresh random values that every rank
  // draws alike.
  if (randomize) {
    std::vector<at::Tensor> qs;
    for (const auto& b : *batches) qs.push_back(b.q);
    detail::fill_random(qs, static_cast<std::uint64_t>(detail::draw_seed(*shared)));
  }
  for (const auto& b : *batches) detail::orthogonalize(b.q, epsilon);

  // P = M Q, computed before anything is issued (it needs nothing from the other ranks).
  for (const auto& b : *batches) b.p.copy_(detail::product(b.matrices, b.q));

  {
    std::lock_guard<std::mutex> lk(shared->mu);
    shared->numel_before += before;
    shared->numel_after += after;
  }
  detail::advance_iter(*shared, bucket);

  const bool error_feedback = o.use_error_feedback;
  return detail::in_issue_order(*shared, [=](const Future<void>& issued) -> Future<at::Tensor> {
    Future<std::vector<at::Tensor>> u = detail::issue_all_reduce(group, uncompressed_memory);
    // The Ps are orthogonalized after the sum, so they need no division by the group's size.
    Future<std::vector<at::Tensor>> p = detail::issue_all_reduce(group, p_memory);
    Future<std::vector<at::Tensor>> q =
        p.then([=](Future<std::vector<at::Tensor>>& reduced_p) -> Future<std::vector<at::Tensor>> {
          detail::IssuedOnExit done(issued);
          detail::take_result(p_memory, reduced_p);
          for (const auto& b : *batches) detail::orthogonalize(b.p, epsilon);
          for (const auto& b : *batches)
            b.q.copy_(detail::product(b.matrices.transpose(1, 2), b.p));
          return detail::issue_all_reduce(group, q_memory);
        });
    return when_all_succeed(std::vector<Future<std::vector<at::Tensor>>>{u, q})
        .then([=](Future<std::vector<std::vector<at::Tensor>>>& both) -> at::Tensor {
          const auto& reduced = both.value();
          // The uncompressed gradients: summed, now averaged and put back into the buffer.
          at::Tensor sum = reduced.at(0).at(0);
          sum.div_(world);
          std::int64_t offset = 0;
          for (const at::Tensor& t : uncompressed) {
            t.copy_(sum.narrow(0, offset, t.numel()).view(t.sizes()));
            offset += t.numel();
          }
          const at::Tensor& q_sum = reduced.at(1).at(0);
          if (!q_sum.is_same(q_memory)) q_memory.copy_(q_sum);
          q_memory.div_(world);
          for (const auto& b : *batches) {
            b.matrices.copy_(detail::product(b.p, b.q.transpose(1, 2)));
            for (std::size_t i = 0; i < b.originals.size(); ++i) {
              b.originals[i].copy_(b.matrices[static_cast<std::int64_t>(i)]);
            }
          }
          if (error_feedback) {
            at::Tensor err = input_copy - input;
            std::lock_guard<std::mutex> lk(shared->mu);
            shared->error[index] = std::move(err);
          }
          return input;
        });
  });
}

inline Future<at::Tensor> batched_powerSGD_hook(PowerSGDState& state, GradBucket& bucket) {
  constexpr const char* kHook = "batched_powerSGD_hook";
  state.shared(kHook);
  const std::shared_ptr<detail::PowerSGDShared> shared = state.shared_;
  const PowerSGDOptions& o = state.options_;
  std::shared_ptr<dist::ProcessGroup> group = detail::hook_group(o.process_group, kHook);
  at::Tensor input = detail::checked_buffer(bucket, kHook, detail::BufferKinds::floating);

  if (!detail::compressing_now(*shared, o)) {
    detail::advance_iter(*shared, bucket);
    return detail::plain_allreduce(*shared, std::move(group), input);
  }

  const std::size_t index = bucket.index();
  const int world = group->size();
  const double epsilon = o.orthogonalization_epsilon;
  const std::int64_t total = input.numel();
  // The bucket as a square matrix, zero-padded (a copy: the buffer itself keeps its size).
  const auto side = static_cast<std::int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  const std::int64_t rank =
      std::max<std::int64_t>(1, std::min<std::int64_t>(side, o.matrix_approximation_rank));
  at::Tensor padded = at::zeros({side * side}, input.options());
  padded.narrow(0, 0, total).copy_(input);

  at::Tensor padded_copy;
  if (o.use_error_feedback) {
    detail::add_error(*shared, index, padded, kHook);
    padded_copy = padded.clone();
  }
  at::Tensor matrix = padded.view({side, side});

  at::Tensor p_memory;
  at::Tensor q_memory;
  if (o.warm_start) {
    std::lock_guard<std::mutex> lk(shared->mu);
    p_memory = detail::PowerSGDShared::find(shared->p_memory, index);
    q_memory = detail::PowerSGDShared::find(shared->q_memory, index);
  }
  if (!p_memory.defined() || p_memory.size(0) != side || q_memory.size(1) != rank) {
    p_memory = at::empty({side, rank}, input.options());
    q_memory = at::empty({side, rank}, input.options());
    detail::fill_random({q_memory}, static_cast<std::uint64_t>(detail::draw_seed(*shared)));
    if (o.warm_start) {
      std::lock_guard<std::mutex> lk(shared->mu);
      shared->p_memory[index] = p_memory;
      shared->q_memory[index] = q_memory;
    }
  }
  detail::orthogonalize(q_memory.unsqueeze(0), epsilon);
  p_memory.copy_(detail::product(matrix, q_memory));

  {
    std::lock_guard<std::mutex> lk(shared->mu);
    shared->numel_before += total;
    shared->numel_after += side * rank * 2;
  }
  detail::advance_iter(*shared, bucket);

  const bool error_feedback = o.use_error_feedback;
  return detail::in_issue_order(*shared, [=](const Future<void>& issued) -> Future<at::Tensor> {
    Future<std::vector<at::Tensor>> p = detail::issue_all_reduce(group, p_memory);
    Future<std::vector<at::Tensor>> q =
        p.then([=](Future<std::vector<at::Tensor>>& reduced_p) -> Future<std::vector<at::Tensor>> {
          detail::IssuedOnExit done(issued);
          detail::take_result(p_memory, reduced_p);
          detail::orthogonalize(p_memory.unsqueeze(0), epsilon);
          q_memory.copy_(detail::product(matrix.t(), p_memory));
          return detail::issue_all_reduce(group, q_memory);
        });
    return q.then([=](Future<std::vector<at::Tensor>>& reduced_q) -> at::Tensor {
      detail::take_result(q_memory, reduced_q);
      q_memory.div_(world);
      matrix.copy_(detail::product(p_memory, q_memory.t()));
      if (error_feedback) {
        at::Tensor err = padded_copy - padded;
        std::lock_guard<std::mutex> lk(shared->mu);
        shared->error[index] = std::move(err);
      }
      input.copy_(padded.narrow(0, 0, total));
      return input;
    });
  });
}

}  // namespace distrpc::ddp
