// ProcessGroup: the facade a group member holds (PyTorch's c10d::ProcessGroup). It knows the
// member's rank and the group's size, the group's global ranks, its store (a PrefixStore private
// to the group) and its name, and owns one Backend per backend named in its BackendConfig. Each
// collective is checked here (PyTorch's texts for the mistakes users make most: mixed dtypes,
// sending to oneself, ranks out of range) and then handed to the backend of its tensors' device.
//
// Ranks here are group ranks. The free functions of <distrpc/dist.hpp> take global ranks, as
// PyTorch's Python functions do, and translate them with group_rank().
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/DeviceType.h>

#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/store/prefix_store.hpp>

namespace distrpc::dist {

namespace detail {

// "cpu", "cuda": the device type a tensor lives on, as BackendConfig names it.
inline std::string device_type_of(const at::Tensor& t) {
  return c10::DeviceTypeName(t.device().type(), /*lower_case=*/true);
}

// PyTorch's _ensure_all_tensors_same_dtype: a complex tensor counts as its real dtype, so a
// complex view of real data may be mixed with that data.
class SameDtype {
 public:
  void add(const at::Tensor& t) {
    if (!t.defined()) return;  // undefined tensors are refused by the callers with their own text
    (t.is_complex() ? saw_complex_ : saw_real_) = true;
    const at::ScalarType real = at::isComplexType(t.scalar_type())
                                    ? c10::toRealValueType(t.scalar_type())
                                    : t.scalar_type();
    if (!first_.defined()) {
      first_ = t;
      first_real_ = real;
      return;
    }
    if (real != first_real_) {
      throw std::invalid_argument(
          std::string("Invalid usage of tensors with different dtypes Found ") +
          c10::toString(first_.scalar_type()) + " and " + c10::toString(t.scalar_type()));
    }
  }
  void add(const std::vector<at::Tensor>& ts) {
    for (const at::Tensor& t : ts) add(t);
  }
  void add(const std::vector<std::vector<at::Tensor>>& tss) {
    for (const auto& ts : tss) add(ts);
  }
  // Complex tensors beside real ones (of their real dtype, else add() threw).
  bool mixes_complex() const { return saw_complex_ && saw_real_; }

 private:
  at::Tensor first_;
  at::ScalarType first_real_ = at::ScalarType::Undefined;
  bool saw_complex_ = false;
  bool saw_real_ = false;
};

// Throws unless the tensors share one dtype (SameDtype); returns whether they mix complex
// tensors with real ones, which the callers then hand over as real views (real_view()).
template <class... Ts>
bool check_same_dtype(const Ts&... tensors) {
  SameDtype check;
  (check.add(tensors), ...);
  return check.mixes_complex();
}

// The backends take complex tensors as they are, or as real views (view_as_real: the same memory
// with a last dimension of 2, as PyTorch's front end hands them over). A call that mixes the two
// (check_same_dtype() says so) goes to its backend with real views of the complex tensors, in
// copies of the caller's lists: the results land in the caller's tensors all the same.
inline at::Tensor real_view(const at::Tensor& t) {
  return t.defined() && t.is_complex() ? at::view_as_real(t) : t;
}
inline std::vector<at::Tensor> real_view(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(real_view(t));
  return out;
}
inline std::vector<std::vector<at::Tensor>> real_view(
    const std::vector<std::vector<at::Tensor>>& tss) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(tss.size());
  for (const auto& ts : tss) out.push_back(real_view(ts));
  return out;
}

}  // namespace detail

class ProcessGroup {
 public:
  // A member's view of a group. store: the group's own store (every key under its prefix);
  // rank/size: this member's rank in the group and the group's size; config: which backend serves
  // which device type (one backend object per distinct backend name, as PyTorch builds them, so
  // "gloo" = "cpu:gloo,cuda:gloo" makes one); timeout: the backends' default per operation;
  // global_ranks: the group's members by their rank in the world, ascending (empty: 0..size-1);
  // made: backends made already, by backend name (new_group's splits), used instead of making
  // those.
  ProcessGroup(std::shared_ptr<store::PrefixStore> store, int rank, int size,
               const BackendConfig& config, std::chrono::milliseconds timeout,
               std::string group_name = "default_pg", std::vector<int> global_ranks = {},
               std::map<std::string, std::shared_ptr<Backend>> made = {})
      : store_(std::move(store)),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        group_name_(std::move(group_name)),
        global_ranks_(std::move(global_ranks)),
        config_(config) {
    if (!store_) throw std::invalid_argument("ProcessGroup: the store is null");
    if (size_ < 1) {
      throw std::invalid_argument("ProcessGroup: the group size must be at least 1, got " +
                                  std::to_string(size_));
    }
    if (rank_ < 0 || rank_ >= size_) {
      throw std::invalid_argument("ProcessGroup: rank " + std::to_string(rank_) +
                                  " is outside the group of size " + std::to_string(size_));
    }
    if (timeout_ <= std::chrono::milliseconds::zero()) {
      throw std::invalid_argument("ProcessGroup: the timeout must be positive, got " +
                                  std::to_string(timeout_.count()) + " ms");
    }
    if (global_ranks_.empty()) {
      for (int r = 0; r < size_; ++r) global_ranks_.push_back(r);
    }
    if (static_cast<int>(global_ranks_.size()) != size_) {
      throw std::invalid_argument("ProcessGroup: " + std::to_string(global_ranks_.size()) +
                                  " global ranks given for a group of size " +
                                  std::to_string(size_));
    }
    for (std::size_t i = 0; i < global_ranks_.size(); ++i) {
      if (global_ranks_[i] < 0 || (i > 0 && global_ranks_[i] <= global_ranks_[i - 1])) {
        throw std::invalid_argument(
            "ProcessGroup: the global ranks must be non-negative, ascending and distinct, got " +
            ranks_text(global_ranks_));
      }
    }
    if (config_->device_backend_map().empty()) {
      throw std::invalid_argument("ProcessGroup: backend config '" + config_->to_string() +
                                  "' names no backend available in this process");
    }
    make_backends(std::move(made));
  }

  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  ~ProcessGroup() = default;  // the backends stop in their own destructors

  // What new_group returns to a process outside the group (PyTorch's
  // GroupMember.NON_GROUP_MEMBER): one shared object with rank() and size() -1 and no backend.
  // The free functions of <distrpc/dist.hpp> return at once on it, with a warning.
  static const std::shared_ptr<ProcessGroup>& non_member() {
    static const std::shared_ptr<ProcessGroup> g(new ProcessGroup(NonMemberTag{}));
    return g;
  }
  bool is_member() const noexcept { return rank_ >= 0; }

  // ---- What the group is.
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  // The members' global ranks, ascending: global_ranks()[r] is group rank r.
  const std::vector<int>& global_ranks() const noexcept { return global_ranks_; }
  const std::string& group_name() const noexcept { return group_name_; }
  const std::shared_ptr<store::PrefixStore>& store() const noexcept { return store_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  const BackendConfig& backend_config() const {
    require_member("backend_config");
    return *config_;
  }
  // The backend string: the one backend's name ("gloo", "dummy"), or the config's canonical form
  // ("cpu:gloo,cuda:nccl") when devices are served by different backends.
  std::string name() const {
    require_member("name");
    const auto& map = config_->device_backend_map();
    for (const auto& [device, backend] : map) {
      if (backend != map.front().second) return config_->to_string();
    }
    return map.front().second;
  }

  // The backend serving a device type ("cpu", "cuda"); throws naming the device and the config.
  std::shared_ptr<Backend> backend(std::string_view device) const {
    require_member("backend");
    const std::string d = dist::detail::lower(device);
    for (const auto& [dev, b] : by_device_) {
      if (dev == d) return b;
    }
    throw std::invalid_argument("ProcessGroup " + group_name_ + ": no backend for device type " +
                                d + " (backend config '" + config_->to_string() + "')");
  }
  bool has_backend(std::string_view device) const {
    const std::string d = dist::detail::lower(device);
    return std::any_of(by_device_.begin(), by_device_.end(),
                       [&](const auto& p) { return p.first == d; });
  }
  // The device type that serves device-less operations (barrier, the object collectives):
  // cpu where the group has it, else the first in the config (PyTorch's default device).
  std::string default_device() const {
    require_member("default_device");
    return has_backend("cpu") ? std::string("cpu") : by_device_.front().first;
  }

  // The sequence number of the default device's backend (PyTorch's
  // _get_sequence_number_for_group): equal on every member between calls.
  std::uint64_t sequence_number() const { return backend(default_device())->sequence_number(); }

  // ---- Ranks.
  // This group's rank of a world rank; throws if that process is not a member.
  int group_rank(int global_rank) const {
    auto it = std::lower_bound(global_ranks_.begin(), global_ranks_.end(), global_rank);
    if (it == global_ranks_.end() || *it != global_rank) {
      throw std::invalid_argument("Global rank " + std::to_string(global_rank) +
                                  " is not part of group " + group_name_);
    }
    return static_cast<int>(it - global_ranks_.begin());
  }
  int global_rank(int group_rank) const {
    if (group_rank < 0 || group_rank >= size_) {
      throw std::invalid_argument("Group rank " + std::to_string(group_rank) +
                                  " is not part of group " + group_name_ + " (of size " +
                                  std::to_string(size_) + ")");
    }
    return global_ranks_[static_cast<std::size_t>(group_rank)];
  }

  // ---- Collectives, in c10d's shapes; roots and peers are group ranks.
  std::shared_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                  const BroadcastOptions& opts = {}) {
    check_root("broadcast", "root", opts.root_rank);
    return backend_for("broadcast", tensors)->broadcast(tensors, opts);
  }
  std::shared_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                  const AllreduceOptions& opts = {}) {
    auto b = backend_for("allreduce", tensors);
    check_reduce_dtype(opts.op, tensors.front().scalar_type());
    return b->allreduce(tensors, opts);
  }
  std::shared_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                            const AllreduceCoalescedOptions& opts = {}) {
    detail::check_same_dtype(tensors);
    auto b = backend_for("allreduce_coalesced", tensors, /*single=*/false);
    check_reduce_dtype(opts.op, tensors.front().scalar_type());
    return b->allreduce_coalesced(tensors, opts);
  }
  std::shared_ptr<Work> reduce(std::vector<at::Tensor>& tensors, const ReduceOptions& opts = {}) {
    check_root("reduce", "root", opts.root_rank);
    auto b = backend_for("reduce", tensors);
    check_reduce_dtype(opts.op, tensors.front().scalar_type());
    return b->reduce(tensors, opts);
  }
  std::shared_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const AllgatherOptions& opts = {}) {
    if (detail::check_same_dtype(outputs, inputs)) {
      auto o = detail::real_view(outputs);
      auto i = detail::real_view(inputs);
      return allgather(o, i, opts);
    }
    check_lists("allgather", "output", outputs, /*required=*/true);
    auto b = backend_for("allgather", inputs, true, &outputs);
    return b->allgather(outputs, inputs, opts);
  }
  std::shared_ptr<Work> allgather_into_tensor(at::Tensor& output, at::Tensor& input,
                                              const AllgatherOptions& opts = {}) {
    std::vector<at::Tensor> both{output, input};
    if (detail::check_same_dtype(both)) {
      at::Tensor o = detail::real_view(output);
      at::Tensor i = detail::real_view(input);
      return allgather_into_tensor(o, i, opts);
    }
    auto b = backend_for("allgather_into_tensor", both, /*single=*/false);
    if (output.numel() != input.numel() * size_) {
      throw std::invalid_argument("allgather_into_tensor: the output has " +
                                  std::to_string(output.numel()) +
                                  " elements but the group of size " + std::to_string(size_) +
                                  " needs " + std::to_string(input.numel() * size_) +
                                  " (size x the input's " + std::to_string(input.numel()) + ")");
    }
    return b->allgather_into_tensor(output, input, opts);
  }
  std::shared_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                               std::vector<at::Tensor>& inputs, const GatherOptions& opts = {}) {
    if (detail::check_same_dtype(outputs, inputs)) {
      auto o = detail::real_view(outputs);
      auto i = detail::real_view(inputs);
      return gather(o, i, opts);
    }
    check_root("gather", "root", opts.root_rank);
    check_lists("gather", "output", outputs, /*required=*/rank_ == opts.root_rank);
    auto b = backend_for("gather", inputs, true, &outputs);
    return b->gather(outputs, inputs, opts);
  }
  std::shared_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                std::vector<std::vector<at::Tensor>>& inputs,
                                const ScatterOptions& opts = {}) {
    if (detail::check_same_dtype(outputs, inputs)) {
      auto o = detail::real_view(outputs);
      auto i = detail::real_view(inputs);
      return scatter(o, i, opts);
    }
    check_root("scatter", "root", opts.root_rank);
    check_lists("scatter", "input", inputs, /*required=*/rank_ == opts.root_rank);
    auto b = backend_for("scatter", outputs, true, &inputs);
    return b->scatter(outputs, inputs, opts);
  }
  std::shared_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                       std::vector<std::vector<at::Tensor>>& inputs,
                                       const ReduceScatterOptions& opts = {}) {
    detail::check_same_dtype(outputs, inputs);
    check_lists("reduce_scatter", "input", inputs, /*required=*/true);
    auto b = backend_for("reduce_scatter", outputs, true, &inputs);
    check_reduce_dtype(opts.op, outputs.front().scalar_type());
    return b->reduce_scatter(outputs, inputs, opts);
  }
  std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor& output, at::Tensor& input,
                                              const ReduceScatterOptions& opts = {}) {
    std::vector<at::Tensor> both{output, input};
    detail::check_same_dtype(both);
    auto b = backend_for("reduce_scatter_tensor", both, /*single=*/false);
    if (input.numel() != output.numel() * size_) {
      throw std::invalid_argument("reduce_scatter_tensor: the input has " +
                                  std::to_string(input.numel()) +
                                  " elements but the group of size " + std::to_string(size_) +
                                  " needs " + std::to_string(output.numel() * size_) +
                                  " (size x the output's " + std::to_string(output.numel()) + ")");
    }
    check_reduce_dtype(opts.op, output.scalar_type());
    return b->reduce_scatter_tensor(output, input, opts);
  }
  std::shared_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                      std::vector<std::int64_t> output_split_sizes,
                                      std::vector<std::int64_t> input_split_sizes,
                                      const AllToAllOptions& opts = {}) {
    std::vector<at::Tensor> both{output, input};
    if (detail::check_same_dtype(both)) {
      at::Tensor o = detail::real_view(output);
      at::Tensor i = detail::real_view(input);
      return alltoall_base(o, i, std::move(output_split_sizes), std::move(input_split_sizes), opts);
    }
    auto b = backend_for("alltoall_base", both, /*single=*/false);
    check_splits("output", output, output_split_sizes);
    check_splits("input", input, input_split_sizes);
    // The one exchange this rank can check alone, before anything is sent: with itself. (A
    // mismatch found later fails the collective with the group unusable, and leaves the peers
    // that already sent waiting.)
    const auto self_rows = [&](const at::Tensor& t, const std::vector<std::int64_t>& splits) {
      return splits.empty() ? t.size(0) / size_ : splits[static_cast<std::size_t>(rank_)];
    };
    const auto row = [](const at::Tensor& t) {
      return t.size(0) == 0 ? std::int64_t{0} : t.numel() / t.size(0);
    };
    const std::int64_t out_n = self_rows(output, output_split_sizes) * row(output);
    const std::int64_t in_n = self_rows(input, input_split_sizes) * row(input);
    if (out_n != in_n) {
      throw std::invalid_argument("alltoall_base: rank " + std::to_string(rank_) +
                                  " sends itself " + std::to_string(in_n) +
                                  " elements but its output takes " + std::to_string(out_n) +
                                  " from it (the input's and output's split sizes for rank " +
                                  std::to_string(rank_) + " must match)");
    }
    return b->alltoall_base(output, input, std::move(output_split_sizes),
                            std::move(input_split_sizes), opts);
  }
  std::shared_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                 const AllToAllOptions& opts = {}) {
    if (detail::check_same_dtype(outputs, inputs)) {
      auto o = detail::real_view(outputs);
      auto i = detail::real_view(inputs);
      return alltoall(o, i, opts);
    }
    for (const auto* list : {&outputs, &inputs}) {
      if (static_cast<int>(list->size()) != size_) {
        throw std::invalid_argument(std::string("alltoall: the ") +
                                    (list == &outputs ? "output" : "input") + " list has " +
                                    std::to_string(list->size()) + " tensors but the group has " +
                                    std::to_string(size_) + " members");
      }
    }
    std::vector<at::Tensor> all(outputs);
    all.insert(all.end(), inputs.begin(), inputs.end());
    auto b = backend_for("alltoall", all, /*single=*/false);
    // What this rank sends itself must fit its own output, checked before anything is sent (see
    // alltoall_base).
    const auto self = static_cast<std::size_t>(rank_);
    if (inputs[self].numel() != outputs[self].numel()) {
      throw std::invalid_argument("alltoall: rank " + std::to_string(rank_) + " sends itself " +
                                  std::to_string(inputs[self].numel()) + " elements (input " +
                                  std::to_string(rank_) + ") but its output " +
                                  std::to_string(rank_) + " holds " +
                                  std::to_string(outputs[self].numel()));
    }
    return b->alltoall(outputs, inputs, opts);
  }
  std::shared_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
    check_root("send", "destination", dst_rank);
    if (dst_rank == rank_) {
      throw std::invalid_argument(
          "Invalid destination rank: destination rank should not be the same as the rank of the "
          "current process.");
    }
    return backend_for("send", tensors)->send(tensors, dst_rank, tag);
  }
  std::shared_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
    check_root("recv", "source", src_rank);
    if (src_rank == rank_) {
      throw std::invalid_argument(
          "Invalid source rank: source rank should not be the same as the rank of the current "
          "process.");
    }
    return backend_for("recv", tensors)->recv(tensors, src_rank, tag);
  }
  std::shared_ptr<Work> recv_anysource(std::vector<at::Tensor>& tensors, int tag) {
    return backend_for("recv_anysource", tensors)->recv_anysource(tensors, tag);
  }
  std::shared_ptr<Work> barrier(const BarrierOptions& opts = {}) {
    return backend(default_device())->barrier(opts);
  }

  // Stops every backend once (pending work fails, threads are joined). Idempotent.
  void shutdown() {
    std::vector<std::shared_ptr<Backend>> to_stop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (shut_down_) return;
      shut_down_ = true;
      to_stop = distinct_;
    }
    // Outside the lock: a backend's shutdown may wait for its own threads.
    for (const auto& b : to_stop) b->shutdown();
  }

 private:
  struct NonMemberTag {};
  explicit ProcessGroup(NonMemberTag)
      : rank_(-1), size_(-1), timeout_(0), group_name_("NON_GROUP_MEMBER") {}

  void require_member(const char* what) const {
    if (!is_member()) {
      throw std::logic_error(std::string("ProcessGroup::") + what +
                             ": this process is not a member of the group (NON_GROUP_MEMBER)");
    }
  }

  static std::string ranks_text(const std::vector<int>& ranks) {
    std::string out = "[";
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (i) out += ", ";
      out += std::to_string(ranks[i]);
    }
    return out + "]";
  }

  void make_backends(std::map<std::string, std::shared_ptr<Backend>> given) {
    // One object per distinct backend name, created with the store view of the first device it
    // serves (PyTorch's layout: "<group prefix>/<device>/..."), unless one was given.
    std::vector<std::pair<std::string, std::shared_ptr<Backend>>> made;
    for (const auto& [device, name] : config_->device_backend_map()) {
      std::shared_ptr<Backend> b;
      for (const auto& [n, existing] : made) {
        if (n == name) b = existing;
      }
      if (!b) {
        if (const auto it = given.find(name); it != given.end()) {
          b = it->second;
        } else {
          BackendCreator create = backend_creator(name);
          b = create(std::make_shared<store::PrefixStore>(device, store_), rank_, size_, timeout_);
        }
        if (!b) {
          throw std::invalid_argument("ProcessGroup: the creator of backend '" + name +
                                      "' returned no backend");
        }
        if (b->rank() != rank_ || b->size() != size_) {
          throw std::logic_error("ProcessGroup: backend '" + name + "' was made for rank " +
                                 std::to_string(rank_) + " of " + std::to_string(size_) +
                                 " but reports rank " + std::to_string(b->rank()) + " of " +
                                 std::to_string(b->size()));
        }
        made.emplace_back(name, b);
        distinct_.push_back(b);
      }
      by_device_.emplace_back(device, std::move(b));
    }
  }

  void check_root(const char* op, const char* what, int r) const {
    if (r < 0 || r >= size_) {
      throw std::invalid_argument(std::string(op) + ": " + what + " rank " + std::to_string(r) +
                                  " is out of range for group " + group_name_ + " of size " +
                                  std::to_string(size_));
    }
  }

  // The backend of the tensors' device, after checking they are defined and on one device.
  // single: the operation takes exactly one tensor (every backend here takes one per call);
  // nested: tensor lists that must be on that device too.
  std::shared_ptr<Backend> backend_for(
      const char* op, const std::vector<at::Tensor>& tensors, bool single = true,
      const std::vector<std::vector<at::Tensor>>* nested = nullptr) const {
    if (tensors.empty()) throw std::invalid_argument(std::string(op) + ": no tensor given");
    if (single && tensors.size() != 1) {
      throw std::invalid_argument(std::string(op) + ": expects exactly one tensor, got " +
                                  std::to_string(tensors.size()));
    }
    std::string device;
    auto visit = [&](const at::Tensor& t) {
      if (!t.defined()) throw std::invalid_argument(std::string(op) + ": a tensor is undefined");
      const std::string d = detail::device_type_of(t);
      if (device.empty()) device = d;
      if (d != device) {
        throw std::invalid_argument(std::string(op) + ": tensors on different device types (" +
                                    device + " and " + d + ")");
      }
    };
    for (const at::Tensor& t : tensors) visit(t);
    if (nested) {
      for (const auto& list : *nested) {
        for (const at::Tensor& t : list) visit(t);
      }
    }
    return backend(device);
  }

  // The per-rank tensor lists of gather, scatter, allgather, reduce_scatter: one list of size()
  // tensors where the rank takes part with them, none elsewhere (PyTorch's texts for the latter).
  void check_lists(const char* op, const char* kind,
                   const std::vector<std::vector<at::Tensor>>& lists, bool required) const {
    if (!required) {
      if (!lists.empty() && !(lists.size() == 1 && lists.front().empty())) {
        throw std::invalid_argument(std::string("Argument ``") +
                                    (std::string(op) == "gather" ? "gather_list" : "scatter_list") +
                                    "`` must NOT be specified on non-" +
                                    (std::string(op) == "gather" ? "destination" : "source") +
                                    " ranks.");
      }
      return;
    }
    if (lists.size() != 1) {
      throw std::invalid_argument(std::string(op) + ": expects one " + kind + " tensor list, got " +
                                  std::to_string(lists.size()));
    }
    if (static_cast<int>(lists.front().size()) != size_) {
      throw std::invalid_argument(
          std::string(op) + ": the " + kind + " list has " + std::to_string(lists.front().size()) +
          " tensors but the group has " + std::to_string(size_) + " members");
    }
  }

  void check_splits(const char* kind, const at::Tensor& t,
                    const std::vector<std::int64_t>& splits) const {
    if (splits.empty()) {
      if (t.dim() == 0 || t.size(0) % size_ != 0) {
        throw std::invalid_argument(std::string("alltoall_base: without split sizes the ") + kind +
                                    " tensor's first dimension must divide by the group size " +
                                    std::to_string(size_) + ", got shape " + c10::str(t.sizes()));
      }
      return;
    }
    if (static_cast<int>(splits.size()) != size_) {
      throw std::invalid_argument(std::string("alltoall_base: ") + std::to_string(splits.size()) +
                                  " " + kind + " split sizes for a group of size " +
                                  std::to_string(size_));
    }
    std::int64_t sum = 0;
    for (std::int64_t s : splits) {
      if (s < 0) {
        throw std::invalid_argument(std::string("alltoall_base: negative ") + kind +
                                    " split size " + std::to_string(s));
      }
      sum += s;
    }
    if (t.dim() == 0 || sum != t.size(0)) {
      throw std::invalid_argument(std::string("alltoall_base: the ") + kind +
                                  " split sizes add up to " + std::to_string(sum) +
                                  " but the tensor's shape is " + c10::str(t.sizes()));
    }
  }

  const std::shared_ptr<store::PrefixStore> store_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  const std::string group_name_;
  std::vector<int> global_ranks_;
  const std::optional<BackendConfig> config_;  // empty only in non_member()
  std::vector<std::pair<std::string, std::shared_ptr<Backend>>> by_device_;
  std::vector<std::shared_ptr<Backend>> distinct_;
  std::mutex mu_;
  bool shut_down_ = false;
};

}  // namespace distrpc::dist
