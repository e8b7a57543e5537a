// Backend: what one process group member's collective engine provides (PyTorch's c10d::Backend).
//
// The shapes are c10d's: a collective takes a list of tensors per call (one per device in
// PyTorch's old multi-device form; every backend here takes exactly one, the front end passes
// one) and returns a Work that completes once. A backend issues collectives in call order: every
// member calls the same collectives in the same order, and the n-th call of each member meets the
// n-th of the others (its sequence number). A call returns as soon as the work is queued; the
// caller's tensors must stay alive and untouched until the Work completes (PyTorch's rule).
//
// A backend may leave an operation out: the base class's version throws
// "Backend <name> does not support <op>", which is what the front end reports.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>

namespace distrpc::dist {

// An operation's timeout when the call gives none: the backend's own (its group's).
inline constexpr std::chrono::milliseconds kUnsetTimeout{-1};

struct AllreduceOptions {
  ReduceOp op{};
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct AllreduceCoalescedOptions {
  ReduceOp op{};
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct BroadcastOptions {
  int root_rank = 0;
  int root_tensor = 0;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct ReduceOptions {
  ReduceOp op{};
  int root_rank = 0;
  int root_tensor = 0;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct AllgatherOptions {
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct GatherOptions {
  int root_rank = 0;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct ScatterOptions {
  int root_rank = 0;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct ReduceScatterOptions {
  ReduceOp op{};
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct AllToAllOptions {
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct BarrierOptions {
  std::chrono::milliseconds timeout = kUnsetTimeout;
};

class Backend {
 public:
  // rank and size within the group this backend serves; timeout: its operations' default.
  Backend(int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), timeout_(timeout) {
    if (size < 1) {
      throw std::invalid_argument("Backend: the group size must be at least 1, got " +
                                  std::to_string(size));
    }
    if (rank < 0 || rank >= size) {
      throw std::invalid_argument("Backend: rank " + std::to_string(rank) +
                                  " is outside the group of size " + std::to_string(size));
    }
    if (timeout <= std::chrono::milliseconds::zero()) {
      throw std::invalid_argument("Backend: the timeout must be positive, got " +
                                  std::to_string(timeout.count()) + " ms");
    }
  }
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  virtual ~Backend() = default;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  // The backend's name as registered ("distrpc", "gloo").
  virtual std::string name() const = 0;

  // Subgroups made from this group's communicator (NCCL's ncclCommSplit) rather than from
  // scratch: a backend that can says so here, and new_group then has every process of this group
  // call split(), members of the new group or not, in the same order (only when every process
  // calls new_group: NewGroupOptions::use_local_synchronization false, PyTorch's rule).
  virtual bool can_split() const noexcept { return false; }
  // Collective over this backend's group: the members `ranks` (ranks in this group, ascending)
  // form a new group in which this member's rank is `new_rank`, or -1 when it is not a member
  // (it then gets null). timeout: the new group's default per operation.
  virtual std::shared_ptr<Backend> split(const std::vector<int>& ranks, int new_rank,
                                         std::chrono::milliseconds timeout) {
    (void)ranks, (void)new_rank, (void)timeout;
    throw std::logic_error("Backend " + name() + " cannot split its group");
  }

  // The number of collectives this member has issued: equal on every member between calls, since
  // all issue the same ones (PyTorch's sequence number). Point-to-point calls take none (their
  // Works' sequence_number() is -1): members send and receive different counts.
  virtual std::uint64_t sequence_number() const noexcept {
    return seq_.load(std::memory_order_acquire);
  }

  virtual std::shared_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                          const BroadcastOptions& opts = {}) {
    (void)tensors, (void)opts;
    return unsupported("broadcast");
  }
  virtual std::shared_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                          const AllreduceOptions& opts = {}) {
    (void)tensors, (void)opts;
    return unsupported("allreduce");
  }
  // Every tensor reduced, as one operation (one exchange where the backend can).
  virtual std::shared_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                    const AllreduceCoalescedOptions& opts = {}) {
    (void)tensors, (void)opts;
    return unsupported("allreduce_coalesced");
  }
  virtual std::shared_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                                       const ReduceOptions& opts = {}) {
    (void)tensors, (void)opts;
    return unsupported("reduce");
  }
  // outputs[0][r] receives rank r's inputs[0].
  virtual std::shared_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const AllgatherOptions& opts = {}) {
    (void)outputs, (void)inputs, (void)opts;
    return unsupported("allgather");
  }
  // output holds size() inputs end to end (along dim 0).
  virtual std::shared_ptr<Work> allgather_into_tensor(at::Tensor& output, at::Tensor& input,
                                                      const AllgatherOptions& opts = {}) {
    (void)output, (void)input, (void)opts;
    return unsupported("allgather_into_tensor");
  }
  // On the root, outputs[0][r] receives rank r's inputs[0]; elsewhere outputs is empty.
  virtual std::shared_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                       std::vector<at::Tensor>& inputs,
                                       const GatherOptions& opts = {}) {
    (void)outputs, (void)inputs, (void)opts;
    return unsupported("gather");
  }
  // On the root, inputs[0][r] goes to rank r's outputs[0]; elsewhere inputs is empty.
  virtual std::shared_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                        std::vector<std::vector<at::Tensor>>& inputs,
                                        const ScatterOptions& opts = {}) {
    (void)outputs, (void)inputs, (void)opts;
    return unsupported("scatter");
  }
  // outputs[0] receives the reduction over ranks of their inputs[0][rank()].
  virtual std::shared_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                               std::vector<std::vector<at::Tensor>>& inputs,
                                               const ReduceScatterOptions& opts = {}) {
    (void)outputs, (void)inputs, (void)opts;
    return unsupported("reduce_scatter");
  }
  // input holds size() slices end to end (along dim 0); output receives this rank's, reduced.
  virtual std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor& output, at::Tensor& input,
                                                      const ReduceScatterOptions& opts = {}) {
    (void)output, (void)input, (void)opts;
    return unsupported("reduce_scatter_tensor");
  }
  // Splits along dim 0: input's i-th slice goes to rank i, output's j-th slice comes from rank j.
  // Empty split sizes mean equal slices.
  virtual std::shared_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                              std::vector<std::int64_t> output_split_sizes,
                                              std::vector<std::int64_t> input_split_sizes,
                                              const AllToAllOptions& opts = {}) {
    (void)output, (void)input, (void)output_split_sizes, (void)input_split_sizes, (void)opts;
    return unsupported("alltoall_base");
  }
  // inputs[i] goes to rank i; outputs[j] comes from rank j.
  virtual std::shared_ptr<Work> alltoall(std::vector<at::Tensor>& outputs,
                                         std::vector<at::Tensor>& inputs,
                                         const AllToAllOptions& opts = {}) {
    (void)outputs, (void)inputs, (void)opts;
    return unsupported("alltoall");
  }
  // Point to point: matched by (peer, tag) in call order. These do not take part in the
  // collectives' order (a send needs no matching call on the other members).
  virtual std::shared_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
    (void)tensors, (void)dst_rank, (void)tag;
    return unsupported("send");
  }
  virtual std::shared_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
    (void)tensors, (void)src_rank, (void)tag;
    return unsupported("recv");
  }
  // The first matching send from any member; Work::source_rank() says whose.
  virtual std::shared_ptr<Work> recv_anysource(std::vector<at::Tensor>& tensors, int tag) {
    (void)tensors, (void)tag;
    return unsupported("recv_anysource");
  }
  virtual std::shared_ptr<Work> barrier(const BarrierOptions& opts = {}) {
    (void)opts;
    return unsupported("barrier");
  }

  // Stops the backend: pending work fails with a DistBackendError saying it was shut down, no
  // callback runs afterwards, threads are joined. Idempotent; the destructor of a backend that
  // owns threads calls it.
  virtual void shutdown() {}

 protected:
  // ---- Argument checks shared by every backend, so a mistake reads the same whichever backend
  // serves the group. Each throws std::invalid_argument starting with the operation's name, on
  // the caller's thread, before anything is issued (a refused call takes no sequence number).

  // "<op>: <what> <index> is undefined".
  static void check_defined(const char* op, const at::Tensor& t, std::size_t index = 0,
                            const char* what = "input") {
    if (!t.defined()) {
      throw std::invalid_argument(std::string(op) + ": " + what + " " + std::to_string(index) +
                                  " is undefined");
    }
  }
  // Defined, dense and on the CPU: what every backend here serves (a device backend would check
  // its own device instead).
  void check_cpu_tensor(const char* op, const at::Tensor& t, std::size_t index = 0,
                        const char* what = "input") const {
    check_defined(op, t, index, what);
    const std::string which = std::string(op) + ": " + what + " " + std::to_string(index);
    if (!t.device().is_cpu()) {
      throw std::invalid_argument(which + " is on " + t.device().str() + "; the " + name() +
                                  " backend serves CPU tensors");
    }
    if (t.layout() != at::kStrided) {
      throw std::invalid_argument(which + " is not a dense (strided) tensor");
    }
  }
  // What this backend requires of each tensor it is given: check_cpu_tensor here; a device
  // backend checks its own device instead. The two checks below call it.
  virtual void check_tensor(const char* op, const at::Tensor& t, std::size_t index,
                            const char* what) const {
    check_cpu_tensor(op, t, index, what);
  }
  // "<op>: expects exactly one <what> tensor, got N" (one tensor per call, see the top), then
  // check_tensor on it.
  const at::Tensor& check_single_tensor(const char* op, const std::vector<at::Tensor>& tensors,
                                        const char* what = "input") const {
    if (tensors.size() != 1) {
      throw std::invalid_argument(std::string(op) + ": expects exactly one " + what +
                                  " tensor, got " + std::to_string(tensors.size()));
    }
    check_tensor(op, tensors[0], 0, what);
    return tensors[0];
  }
  // A list with one tensor per member: its size, then check_tensor and the dtype of each.
  void check_tensor_list(const char* op, const std::vector<at::Tensor>& list,
                         const at::Tensor& like, const char* what) const {
    if (list.size() != static_cast<std::size_t>(size())) {
      throw std::invalid_argument(std::string(op) + ": expects " + std::to_string(size()) + " " +
                                  what + " tensors (one per rank), got " +
                                  std::to_string(list.size()));
    }
    for (std::size_t i = 0; i < list.size(); ++i) {
      check_tensor(op, list[i], i, what);
      check_same_dtype(like, list[i]);
    }
  }
  // The list of lists the calls take for one tensor per call: exactly one.
  static void check_one_list(const char* op, std::size_t lists, const char* what) {
    if (lists != 1) {
      throw std::invalid_argument(std::string(op) + ": expects one " + what + " list, got " +
                                  std::to_string(lists));
    }
  }
  // gather's outputs and scatter's inputs: one list on the root, none (or an empty one)
  // elsewhere.
  void check_root_lists(const char* op, const std::vector<std::vector<at::Tensor>>& lists,
                        int root_rank, const char* what) const {
    if (rank() == root_rank) {
      check_one_list(op, lists.size(), what);
      return;
    }
    for (const auto& l : lists) {
      if (!l.empty()) {
        throw std::invalid_argument(std::string(op) + ": only the root (rank " +
                                    std::to_string(root_rank) + ") passes " + what +
                                    " tensors; rank " + std::to_string(rank()) + " passed some");
      }
    }
  }
  // PyTorch's text (the front end's too).
  static void check_same_dtype(const at::Tensor& a, const at::Tensor& b) {
    if (a.scalar_type() != b.scalar_type()) {
      throw std::invalid_argument(
          std::string("Invalid usage of tensors with different dtypes Found ") +
          c10::toString(a.scalar_type()) + " and " + c10::toString(b.scalar_type()));
    }
  }
  void check_root(const char* op, int root_rank) const {
    if (root_rank < 0 || root_rank >= size()) {
      throw std::invalid_argument(std::string(op) + ": root rank " + std::to_string(root_rank) +
                                  " is outside the group of size " + std::to_string(size()));
    }
  }
  static void check_root_tensor(const char* op, int root_tensor) {
    if (root_tensor != 0) {
      throw std::invalid_argument(std::string(op) +
                                  ": root tensor must be 0 (one tensor per call), got " +
                                  std::to_string(root_tensor));
    }
  }
  // role: "destination" or "source".
  void check_peer(const char* op, const char* role, int peer) const {
    if (peer < 0 || peer >= size()) {
      throw std::invalid_argument(std::string(op) + ": " + role + " rank " + std::to_string(peer) +
                                  " is outside the group of size " + std::to_string(size()));
    }
    if (peer == rank()) {
      // PyTorch's text: a member does not message itself.
      throw std::invalid_argument(std::string("Invalid ") + role + " rank: " + role +
                                  " rank should not be the same as the rank of the current "
                                  "process.");
    }
  }
  // A call's own timeout: kUnsetTimeout (the backend's) or positive.
  static void check_call_timeout(const char* op, std::chrono::milliseconds t) {
    if (t != kUnsetTimeout && t <= std::chrono::milliseconds::zero()) {
      throw std::invalid_argument(std::string(op) + ": the timeout must be positive, got " +
                                  std::to_string(t.count()) + " ms");
    }
  }
  // alltoall_base's split sizes for t (which: "input" or "output"), checked, as rows per member:
  // empty sizes mean equal slices.
  std::vector<std::int64_t> split_rows(const char* op, const char* which, const at::Tensor& t,
                                       const std::vector<std::int64_t>& sizes) const {
    const std::string head = std::string(op) + ": the " + which;
    if (t.dim() == 0) {
      throw std::invalid_argument(head + " has no first dimension to split (a 0-dim tensor)");
    }
    const std::int64_t rows = t.size(0);
    if (sizes.empty()) {
      if (rows % size() != 0) {
        throw std::invalid_argument(head + " has " + std::to_string(rows) +
                                    " rows, not divisible by the " + std::to_string(size()) +
                                    " ranks (give split sizes)");
      }
      return std::vector<std::int64_t>(static_cast<std::size_t>(size()), rows / size());
    }
    if (sizes.size() != static_cast<std::size_t>(size())) {
      throw std::invalid_argument(head + " split sizes have " + std::to_string(sizes.size()) +
                                  " entries, expected " + std::to_string(size()));
    }
    std::int64_t sum = 0;
    for (std::int64_t s : sizes) {
      if (s < 0) {
        throw std::invalid_argument(head + " split sizes have a negative entry " +
                                    std::to_string(s));
      }
      sum += s;
    }
    if (sum != rows) {
      throw std::invalid_argument(head + " split sizes add up to " + std::to_string(sum) +
                                  " but the tensor has " + std::to_string(rows) + " rows");
    }
    return sizes;
  }

  // The timeout an operation runs under: the call's, else the backend's.
  std::chrono::milliseconds timeout_for(std::chrono::milliseconds requested) const noexcept {
    return requested == kUnsetTimeout ? timeout_ : requested;
  }
  // Takes the next sequence number (the first call gets 1); backends call it once per call.
  std::uint64_t next_sequence_number() noexcept {
    return seq_.fetch_add(1, std::memory_order_acq_rel) + 1;
  }

 private:
  std::shared_ptr<Work> unsupported(const char* op) const {
    throw std::logic_error("Backend " + name() + " does not support " + op);
  }

  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  std::atomic<std::uint64_t> seq_{0};
};

}  // namespace distrpc::dist
