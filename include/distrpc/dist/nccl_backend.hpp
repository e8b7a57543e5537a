// NcclBackend: the "nccl" process-group backend, for CUDA tensors, on NVIDIA's NCCL directly.
// Registered as "nccl" for the "cuda" device by register_nccl_backend().
//
// Built where Meson finds NCCL and the CUDA runtime (DISTRPC_HAVE_NCCL); it runs on a libtorch
// with CUDA (2.x: the stream handles come from c10's device-generic interface) and a GPU.
//
// One communicator per backend, on one device: BackendOptions' device, else the current CUDA
// device when the backend is made (call c10::cuda::set_device / use a DeviceGuard first, as with
// PyTorch's torch.cuda.set_device). Members meet through the store: rank 0 puts NCCL's unique id
// there, every member counts itself in, and the communicator is made once all have arrived, so a
// member that never comes fails the others after the timeout instead of hanging them.
//
// Streams:
//  - every operation runs on the backend's own stream, which first waits for the work already
//    queued on the caller's current stream (so a tensor made just before the call is complete);
//  - the tensors' memory is marked in use on that stream (the caching allocator does not hand it
//    out again before the operation is done);
//  - the Work completes once the GPU has finished the operation (a host function queued behind
//    it wakes the backend's thread; a thread waiting on the Work watches an event recorded behind
//    it and completes the work itself, the first 2 ms), so its outputs are complete for every
//    stream and thread that sees it complete. wait() therefore blocks the calling thread until
//    then: PyTorch's Work.wait() only makes the current stream wait, which ends at the same point,
//    and here a failure or timeout reaches the waiter as an exception.
//  - Point-to-point calls share the collectives' communicator and stream: a member's sends,
//    receives and collectives run in the order it issued them, so members must issue them in the
//    same relative order (PyTorch keeps a communicator per pair of peers for them).
//
// Failures:
//  - Timeout: an operation not done within its timeout (the call's, else the backend's) aborts
//    the communicator (ncclCommAbort, which also ends the operations still queued) and fails every
//    pending Work with PyTorch's watchdog text, "Watchdog caught collective operation timeout:
//    WorkNCCL(SeqNum=N, OpType=ALLREDUCE, Timeout(ms)=T) ran for M milliseconds before timing
//    out." Every later call throws DistBackendError saying the communicator was aborted.
//  - NCCL's asynchronous errors (a peer gone, a network failure) are polled while work is pending
//    and handled alike, with NCCL's own error text.
//  - Bad arguments (a CPU tensor, a tensor on another device, a dtype or reduction NCCL lacks)
//    throw std::invalid_argument on the caller's thread before anything is queued.
//
// What NCCL lacks, as PyTorch's backend handles it: BAND/BOR/BXOR are refused ("Cannot use
// ReduceOp.BAND with NCCL"); bool tensors reduce as uint8 with SUM as MAX and PRODUCT as MIN
// (logical or / and) and refuse AVG; PREMUL_SUM with a scalar factor is NCCL's own
// (ncclRedOpCreatePreMulSum). gather, scatter and the all-to-alls are grouped sends and receives;
// list all-gathers and reduce-scatters go through one flat buffer. recv from any source is not
// supported (NCCL names its peer). Tags are ignored (NCCL has none), as in PyTorch.
//
// Threads: callers queue operations under one lock (NCCL's calls on a communicator must not run
// concurrently); no lock is held while a Work completes. One thread per backend completes the
// Works no waiter completed, fails them on errors and keeps the watchdog; shutdown() joins it. A
// future's callbacks run on the thread that completes its Work: that thread, one waiting on the
// Work (wait(), result(), a wait on its future), or the one calling shutdown() (PyTorch runs them
// on the thread that marks the future complete). A callback must not wait for a later Work of
// the same backend: the backend's thread may be the one that completes it.
#pragma once

#ifdef DISTRPC_HAVE_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <distrpc/bounded_thread.hpp>
#include <distrpc/cuda_device_scope.hpp>
#include <distrpc/cuda_event_poll.hpp>
#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/error.hpp>
#include <distrpc/store/store.hpp>
#include <distrpc/torch_compat.hpp>

namespace distrpc::dist {

struct NcclBackendOptions {
  // The GPU this member uses; unset: the current CUDA device when the backend is made.
  std::optional<int> device;
};

namespace detail {

// NCCL's element type for a dtype; bool travels as uint8. Throws for the dtypes NCCL lacks.
inline ncclDataType_t nccl_type(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kChar:
      return ncclInt8;
    case at::kByte:
    case at::kBool:
      return ncclUint8;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    default:
      throw std::invalid_argument(std::string(op) + ": dtype " + c10::toString(t) +
                                  " is not supported by NCCL");
  }
}

// "ALLREDUCE" for "allreduce": the OpType PyTorch's watchdog text names.
inline std::string op_type(const std::string& op) {
  std::string out = op;
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace detail

class NcclBackend : public Backend {
 public:
  NcclBackend(std::shared_ptr<store::Store> store, int rank, int size,
              std::chrono::milliseconds timeout, NcclBackendOptions options = {})
      : Backend(rank, size, timeout) {
    if (!store) throw std::invalid_argument("NcclBackend: the store is null");
    const int count = compat::cuda_device_count();
    if (count < 1) {
      throw DistBackendError(
          "NcclBackend: no CUDA device is visible to this process (a CPU-only libtorch, no GPU, "
          "or CUDA_VISIBLE_DEVICES empty)");
    }
    const int index =
        options.device ? *options.device : static_cast<int>(cuda().getDevice().index());
    if (index < 0 || index >= count) {
      throw std::invalid_argument("NcclBackend: device " + std::to_string(index) +
                                  " does not exist here (" + std::to_string(count) +
                                  " CUDA device(s))");
    }
    take_device(index);  // a libtorch that cannot name its stream fails here, before the meeting
    const c10::DeviceGuard on_device(device_);
    start(join(*store, rank, size, timeout));
  }

  ~NcclBackend() override { shutdown(); }

  std::string name() const override { return "nccl"; }
  const c10::Device& device() const noexcept { return device_; }

  // new_group's subgroups come from this communicator (ncclCommSplit, NCCL 2.18 and later):
  // every process of this group takes part, and no store meeting is needed.
  bool can_split() const noexcept override { return NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0); }
  // Collective over this group (every member calls it, in the same order): a member of `ranks`
  // gets a backend of the new group on this backend's GPU, others null. Ordered with this
  // communicator's operations; like ncclCommSplit itself, it waits for every member without a
  // timeout of its own (new_group's rule: every process calls it).
  std::shared_ptr<Backend> split(const std::vector<int>& ranks, int new_rank,
                                 std::chrono::milliseconds timeout) override {
    // Everything that can refuse is checked before the collective: a member that left it would
    // leave the others waiting inside.
    if (new_rank < -1 || new_rank >= static_cast<int>(ranks.size()) ||
        (new_rank >= 0 && ranks[static_cast<std::size_t>(new_rank)] != rank())) {
      throw std::invalid_argument("NcclBackend::split: rank " + std::to_string(new_rank) +
                                  " of a new group of " + std::to_string(ranks.size()) +
                                  " is not this member (rank " + std::to_string(rank()) + ")");
    }
    if (timeout <= std::chrono::milliseconds::zero()) {
      throw std::invalid_argument("NcclBackend::split: the timeout must be positive, got " +
                                  std::to_string(timeout.count()) + " ms");
    }
    // Owns the new communicator until a backend does: aborted on every other way out.
    struct Owned {
      ncclComm_t comm = nullptr;
      ~Owned() {
        if (comm != nullptr) (void)ncclCommAbort(comm);
      }
    } sub;
    {
      std::lock_guard lk(issue_mu_);
      if (!comm_ || state_->stopping) throw DistBackendError("NcclBackend: shut down");
      if (aborted_) throw DistBackendError(abort_text_);
      const c10::DeviceGuard on_device(device_);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      const ncclResult_t r = ncclCommSplit(comm_, new_rank >= 0 ? 0 : NCCL_SPLIT_NOCOLOR,
                                           new_rank >= 0 ? new_rank : 0, &sub.comm, &config);
      // The watchdog may have aborted this communicator meanwhile (a Work past its deadline):
      // then neither its error text nor the new communicator can be trusted.
      if (aborted_) throw DistBackendError(abort_text_);
      if (r != ncclSuccess) throw DistBackendError(nccl_error("ncclCommSplit", r));
#else
      throw std::logic_error("NcclBackend::split: NCCL " + std::to_string(NCCL_VERSION_CODE) +
                             " has no ncclCommSplit (2.18 and later)");
#endif
      ++splits_;
    }
    if (new_rank < 0) return nullptr;
    // The constructor takes the communicator over (it aborts it if it fails itself); the
    // allocation comes first, so a failed one leaves it with `sub`.
    return std::shared_ptr<NcclBackend>(
        new NcclBackend(FromSplit{}, std::exchange(sub.comm, nullptr), new_rank,
                        static_cast<int>(ranks.size()), timeout, device_.index()));
  }
  // How many times this backend's communicator was split (new_group), for tests.
  std::uint64_t splits() const noexcept {
    return splits_.load();
  }
  // Whether this backend's communicator came from a split of another's.
  bool made_by_split() const noexcept {
    return made_by_split_;
  }

  std::shared_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                  const BroadcastOptions& opts = {}) override {
    static constexpr const char* op = "broadcast";
    const at::Tensor& t = check_single_tensor(op, tensors);
    check_root(op, opts.root_rank);
    check_root_tensor(op, opts.root_tensor);
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, t.scalar_type());
    return run(op, opts.timeout, {t}, {t}, [&](cudaStream_t s) {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), count(t), type, opts.root_rank, comm_, s);
    });
  }

  std::shared_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                  const AllreduceOptions& opts = {}) override {
    static constexpr const char* op = "allreduce";
    const at::Tensor& t = check_single_tensor(op, tensors);
    check_reduction(op, opts.op, t.scalar_type());
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, t.scalar_type());
    return run(op, opts.timeout, {t}, {t}, [&](cudaStream_t s) {
      return with_op(op, opts.op, t.scalar_type(), type, [&](ncclRedOp_t r) {
        return ncclAllReduce(t.data_ptr(), t.data_ptr(), count(t), type, r, comm_, s);
      });
    });
  }

  std::shared_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                            const AllreduceCoalescedOptions& opts = {}) override {
    static constexpr const char* op = "allreduce_coalesced";
    if (tensors.empty()) throw std::invalid_argument("allreduce_coalesced: no tensors given");
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      check_tensor(op, tensors[i], i, "input");
      check_same_dtype(tensors[0], tensors[i]);
    }
    check_reduction(op, opts.op, tensors[0].scalar_type());
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, tensors[0].scalar_type());
    return run(op, opts.timeout, tensors, tensors, [&](cudaStream_t s) {
      return with_op(op, opts.op, tensors[0].scalar_type(), type, [&](ncclRedOp_t r) {
        return each_in_group(static_cast<int>(tensors.size()), [&](int i) {
          const at::Tensor& t = tensors[static_cast<std::size_t>(i)];
          return ncclAllReduce(t.data_ptr(), t.data_ptr(), count(t), type, r, comm_, s);
        });
      });
    });
  }

  std::shared_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                               const ReduceOptions& opts = {}) override {
    static constexpr const char* op = "reduce";
    const at::Tensor& t = check_single_tensor(op, tensors);
    check_reduction(op, opts.op, t.scalar_type());
    check_root(op, opts.root_rank);
    check_root_tensor(op, opts.root_tensor);
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, t.scalar_type());
    return run(op, opts.timeout, {t}, {t}, [&](cudaStream_t s) {
      return with_op(op, opts.op, t.scalar_type(), type, [&](ncclRedOp_t r) {
        return ncclReduce(t.data_ptr(), t.data_ptr(), count(t), type, r, opts.root_rank, comm_, s);
      });
    });
  }

  std::shared_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const AllgatherOptions& opts = {}) override {
    static constexpr const char* op = "allgather";
    const at::Tensor& in = check_single_tensor(op, inputs);
    check_one_list(op, outputs.size(), "output");
    check_tensor_list(op, outputs[0], in, "output");
    for (const at::Tensor& o : outputs[0]) check_same_numel(op, o, in);
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, in.scalar_type());
    // Gathered into one buffer by NCCL, then copied into the caller's tensors on our stream.
    at::Tensor flat = at::empty({size(), in.numel()}, in.options());
    std::vector<at::Tensor> touched = outputs[0];
    touched.push_back(in);
    touched.push_back(flat);
    return run(op, opts.timeout, touched, outputs[0], [&](cudaStream_t s) {
      const ncclResult_t r =
          ncclAllGather(in.data_ptr(), flat.data_ptr(), count(in), type, comm_, s);
      if (r == ncclSuccess) {
        for (int i = 0; i < size(); ++i) outputs[0][i].copy_(flat[i].view_as(outputs[0][i]));
      }
      return r;
    });
  }

  std::shared_ptr<Work> allgather_into_tensor(at::Tensor& output, at::Tensor& input,
                                              const AllgatherOptions& opts = {}) override {
    static constexpr const char* op = "allgather_into_tensor";
    check_tensor(op, input, 0, "input");
    check_tensor(op, output, 0, "output");
    check_same_dtype(input, output);
    check_group_multiple(op, output, "output", input, "input");
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, input.scalar_type());
    return run(op, opts.timeout, {input, output}, {output}, [&](cudaStream_t s) {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), count(input), type, comm_, s);
    });
  }

  std::shared_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                               std::vector<at::Tensor>& inputs,
                               const GatherOptions& opts = {}) override {
    static constexpr const char* op = "gather";
    const at::Tensor& in = check_single_tensor(op, inputs);
    check_root(op, opts.root_rank);
    check_root_lists(op, outputs, opts.root_rank, "output");
    const bool root = rank() == opts.root_rank;
    if (root) {
      check_tensor_list(op, outputs[0], in, "output");
      for (const at::Tensor& o : outputs[0]) check_same_numel(op, o, in);
    }
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, in.scalar_type());
    std::vector<at::Tensor> results = root ? outputs[0] : std::vector<at::Tensor>{};
    std::vector<at::Tensor> touched = results;
    touched.push_back(in);
    return run(op, opts.timeout, touched, results, [&](cudaStream_t s) {
      if (root) results[rank()].copy_(in.view_as(results[rank()]));  // before the group opens
      return with_root(opts.root_rank, [&](int r) {
        return root ? ncclRecv(results[r].data_ptr(), count(in), type, r, comm_, s)
                    : ncclSend(in.data_ptr(), count(in), type, r, comm_, s);
      });
    });
  }

  std::shared_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                std::vector<std::vector<at::Tensor>>& inputs,
                                const ScatterOptions& opts = {}) override {
    static constexpr const char* op = "scatter";
    const at::Tensor& out = check_single_tensor(op, outputs, "output");
    check_root(op, opts.root_rank);
    check_root_lists(op, inputs, opts.root_rank, "input");
    const bool root = rank() == opts.root_rank;
    if (root) {
      check_tensor_list(op, inputs[0], out, "input");
      for (const at::Tensor& i : inputs[0]) check_same_numel(op, i, out);
    }
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, out.scalar_type());
    std::vector<at::Tensor> touched = root ? inputs[0] : std::vector<at::Tensor>{};
    touched.push_back(out);
    return run(op, opts.timeout, touched, {out}, [&](cudaStream_t s) {
      if (root) out.copy_(inputs[0][rank()].view_as(out));  // before the group opens
      return with_root(opts.root_rank, [&](int r) {
        return root ? ncclSend(inputs[0][r].data_ptr(), count(out), type, r, comm_, s)
                    : ncclRecv(out.data_ptr(), count(out), type, r, comm_, s);
      });
    });
  }

  std::shared_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                       std::vector<std::vector<at::Tensor>>& inputs,
                                       const ReduceScatterOptions& opts = {}) override {
    static constexpr const char* op = "reduce_scatter";
    const at::Tensor& out = check_single_tensor(op, outputs, "output");
    check_one_list(op, inputs.size(), "input");
    check_tensor_list(op, inputs[0], out, "input");
    for (const at::Tensor& i : inputs[0]) check_same_numel(op, i, out);
    check_reduction(op, opts.op, out.scalar_type());
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, out.scalar_type());
    // The pieces laid end to end (on our stream), then reduce-scattered by NCCL.
    at::Tensor flat = at::empty({size(), out.numel()}, out.options());
    std::vector<at::Tensor> touched = inputs[0];
    touched.push_back(out);
    touched.push_back(flat);
    return run(op, opts.timeout, touched, {out}, [&](cudaStream_t s) {
      for (int r = 0; r < size(); ++r) flat[r].copy_(inputs[0][r].reshape({-1}));
      return with_op(op, opts.op, out.scalar_type(), type, [&](ncclRedOp_t red) {
        return ncclReduceScatter(flat.data_ptr(), out.data_ptr(), count(out), type, red, comm_, s);
      });
    });
  }

  std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor& output, at::Tensor& input,
                                              const ReduceScatterOptions& opts = {}) override {
    static constexpr const char* op = "reduce_scatter_tensor";
    check_tensor(op, input, 0, "input");
    check_tensor(op, output, 0, "output");
    check_same_dtype(input, output);
    check_group_multiple(op, input, "input", output, "output");
    check_reduction(op, opts.op, input.scalar_type());
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, input.scalar_type());
    return run(op, opts.timeout, {input, output}, {output}, [&](cudaStream_t s) {
      return with_op(op, opts.op, input.scalar_type(), type, [&](ncclRedOp_t red) {
        return ncclReduceScatter(input.data_ptr(), output.data_ptr(), count(output), type, red,
                                 comm_, s);
      });
    });
  }

  std::shared_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                      std::vector<std::int64_t> output_split_sizes,
                                      std::vector<std::int64_t> input_split_sizes,
                                      const AllToAllOptions& opts = {}) override {
    static constexpr const char* op = "alltoall_base";
    check_tensor(op, input, 0, "input");
    check_tensor(op, output, 0, "output");
    check_same_dtype(input, output);
    const auto out_rows = split_rows(op, "output", output, output_split_sizes);
    const auto in_rows = split_rows(op, "input", input, input_split_sizes);
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, input.scalar_type());
    return run(op, opts.timeout, {input, output}, {output}, [&](cudaStream_t s) {
      std::int64_t in_at = 0;
      std::int64_t out_at = 0;
      return each_in_group(size(), [&](int r) {
        const at::Tensor send = input.narrow(0, in_at, in_rows[r]);
        const at::Tensor recv = output.narrow(0, out_at, out_rows[r]);
        in_at += in_rows[r];
        out_at += out_rows[r];
        return exchange(send, recv, type, r, s);
      });
    });
  }

  std::shared_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                 const AllToAllOptions& opts = {}) override {
    static constexpr const char* op = "alltoall";
    if (inputs.empty()) throw std::invalid_argument("alltoall: no input tensors given");
    check_tensor_list(op, inputs, inputs[0], "input");
    check_tensor_list(op, outputs, inputs[0], "output");
    check_call_timeout(op, opts.timeout);
    const ncclDataType_t type = detail::nccl_type(op, inputs[0].scalar_type());
    std::vector<at::Tensor> touched = outputs;
    touched.insert(touched.end(), inputs.begin(), inputs.end());
    return run(op, opts.timeout, touched, outputs, [&](cudaStream_t s) {
      return each_in_group(size(),
                           [&](int r) { return exchange(inputs[r], outputs[r], type, r, s); });
    });
  }

  std::shared_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int /*tag*/) override {
    static constexpr const char* op = "send";
    const at::Tensor& t = check_single_tensor(op, tensors);
    check_peer(op, "destination", dst_rank);
    const ncclDataType_t type = detail::nccl_type(op, t.scalar_type());
    return run(
        op, kUnsetTimeout, {t}, {t},
        [&](cudaStream_t s) { return ncclSend(t.data_ptr(), count(t), type, dst_rank, comm_, s); },
        /*collective=*/false);
  }

  std::shared_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int /*tag*/) override {
    static constexpr const char* op = "recv";
    const at::Tensor& t = check_single_tensor(op, tensors, "output");
    check_peer(op, "source", src_rank);
    const ncclDataType_t type = detail::nccl_type(op, t.scalar_type());
    return run(
        op, kUnsetTimeout, {t}, {t},
        [&](cudaStream_t s) { return ncclRecv(t.data_ptr(), count(t), type, src_rank, comm_, s); },
        /*collective=*/false);
  }

  std::shared_ptr<Work> barrier(const BarrierOptions& opts = {}) override {
    static constexpr const char* op = "barrier";
    check_call_timeout(op, opts.timeout);
    at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
    return run(op, opts.timeout, {one}, {}, [&](cudaStream_t s) {
      return ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, comm_, s);
    });
  }

  // Fails the pending Works ("shut down"), joins the backend's thread and releases the
  // communicator (ncclCommAbort: never waits for the peers). Idempotent.
  void shutdown() override {
    std::vector<Pending> failed;
    {
      std::lock_guard issue(issue_mu_);
      if (!state_ || !comm_) return;
      {
        std::lock_guard lk(state_->mu);
        if (state_->stopping) return;
        state_->stopping = true;
        for (auto& [id, p] : state_->pending) failed.push_back(std::move(p));
        state_->pending.clear();
      }
      state_->cv.notify_all();
    }
    // From one of the backend's own callbacks (which dropped the last reference): that thread
    // touches nothing of this object once it sees `stopping`, so it is left to end by itself.
    join_or_detach(completer_);
    {
      // Aborted rather than destroyed: destroying waits for the peers, which may be gone.
      std::lock_guard issue(issue_mu_);
      if (!aborted_) ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    const auto e = std::make_exception_ptr(DistBackendError("NcclBackend: shut down"));
    for (auto& p : failed) p.work->finish_error(e);
  }

 private:
  using Clock = std::chrono::steady_clock;
  // How often the backend's thread looks at deadlines and NCCL's errors while work is pending.
  static constexpr std::chrono::milliseconds kWatchEvery{100};

  // An operation queued on the GPU, until its Work completes.
  struct Pending {
    std::shared_ptr<Work> work;
    std::vector<at::Tensor> outputs;
    std::string op;
    std::int64_t seq = -1;
    std::chrono::milliseconds timeout{0};
    Clock::time_point started;
  };
  // Shared with the host functions CUDA runs behind each operation (they may run after the
  // backend is gone: they hold it weakly) and with the backend's thread.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::uint64_t, Pending> pending;  // queued, not yet completed, by issue order
    std::set<std::uint64_t> done;              // finished on the GPU, not yet completed here
    bool stopping = false;
  };
  struct HostFnArg {
    std::weak_ptr<State> state;
    std::uint64_t id;
  };

  // A Work whose waiters watch the GPU themselves: an event recorded behind the operation, which
  // a waiting thread polls (it is the work's WaitDriver). Once the event is reached the waiter
  // completes the work, so a wait returns as soon as the GPU is done rather than after the host
  // function's thread and the backend's thread have passed the news on (about ten microseconds
  // more, a call's whole cost in a group of one). The backend's thread still completes works
  // nobody waits for, and those whose waiter stopped polling, and delivers every failure.
  class NcclWork final : public Work, public distrpc::detail::WaitDriver {
   public:
    NcclWork(std::string op, std::int64_t seq, std::weak_ptr<State> state, std::uint64_t id,
             int device)
        : Work(std::move(op), seq), state_(std::move(state)), id_(id), device_(device) {}
    ~NcclWork() override {
      if (end_ == nullptr) return;
      const CudaDeviceScope on(device_);  // events are of that device
      (void)cudaEventDestroy(end_);
    }

    // Records the end event on `s` (behind the operation; the work's device is current) and
    // lets waiters poll it. Once, before the work is handed out, by its owner. Without it (CUDA
    // refused) waiters are woken by the backend's thread alone.
    static void record_end(const std::shared_ptr<NcclWork>& w, cudaStream_t s) {
      if (cudaEventCreateWithFlags(&w->end_, cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(w->end_, s) != cudaSuccess) {
        if (w->end_ != nullptr) (void)cudaEventDestroy(w->end_);
        w->end_ = nullptr;
        (void)cudaGetLastError();
        return;
      }
      w->set_wait_driver(w);
    }

    // Polls the event, yielding, for at most kWaiterPoll: a longer operation is left to the
    // backend's thread, so that a hung one does not keep a core busy.
    void drive_wait(const std::function<bool()>& done, Clock::time_point until) override {
      const auto stop = std::min(until, Clock::now() + kWaiterPoll);
      const CudaDeviceScope on(device_);  // events are of that device
      if (done()) return;
      // Yielding throughout (kWaiterPoll bounds it); an error is the watchdog's to report.
      const auto go_on = [&] { return !done() && Clock::now() < stop; };
      if (poll_event(end_, go_on, std::numeric_limits<int>::max()) == cudaSuccess) claim();
    }

   private:
    static constexpr std::chrono::milliseconds kWaiterPoll{2};

    // Completes the work if it is still pending: not when a timeout, an abort or shutdown
    // failed it (each takes the pending entries it fails, and after an abort the backend's
    // thread takes those that came in meanwhile: an aborted operation also reaches its event),
    // nor when the backend's thread got there first.
    void claim() {
      const auto state = state_.lock();
      if (!state) return;
      Pending p;
      {
        std::lock_guard lk(state->mu);
        const auto it = state->pending.find(id_);
        if (it == state->pending.end()) return;
        p = std::move(it->second);
        state->pending.erase(it);
      }
      p.work->finish(std::move(p.outputs));
    }

    std::weak_ptr<State> state_;
    std::uint64_t id_;
    int device_;
    cudaEvent_t end_ = nullptr;
  };

  static std::size_t count(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()); }
  // c10's CUDA interface (streams, events, the allocator): there once a CUDA libtorch is loaded.
  static c10::impl::VirtualGuardImpl cuda() { return c10::impl::VirtualGuardImpl(c10::kCUDA); }

  // "<op>: <what> <i> is on cpu; the nccl backend serves CUDA tensors on cuda:0", and the other
  // checks a tensor NCCL reads or writes in place must pass (Backend's list and single-tensor
  // checks call this).
  void check_tensor(const char* op, const at::Tensor& t, std::size_t index,
                    const char* what) const override {
    check_defined(op, t, index, what);
    const std::string which = std::string(op) + ": " + what + " " + std::to_string(index);
    if (t.device() != device_) {
      throw std::invalid_argument(which + " is on " + t.device().str() +
                                  "; the nccl backend serves CUDA tensors on " + device_.str());
    }
    if (t.layout() != at::kStrided) {
      throw std::invalid_argument(which + " is not a dense (strided) tensor");
    }
    if (!t.is_contiguous()) {
      throw std::invalid_argument(which + " is not contiguous (NCCL reads and writes it in place)");
    }
  }
  // "<op>: the output has 3 elements, expected the input's 2 times the group size 1": `whole`
  // holds one `piece` per member.
  void check_group_multiple(const char* op, const at::Tensor& whole, const char* whole_name,
                            const at::Tensor& piece, const char* piece_name) const {
    if (whole.numel() != piece.numel() * size()) {
      throw std::invalid_argument(std::string(op) + ": the " + whole_name + " has " +
                                  std::to_string(whole.numel()) + " elements, expected the " +
                                  piece_name + "'s " + std::to_string(piece.numel()) +
                                  " times the group size " + std::to_string(size()));
    }
  }
  static void check_same_numel(const char* op, const at::Tensor& a, const at::Tensor& b) {
    if (a.numel() != b.numel()) {
      throw std::invalid_argument(std::string(op) + ": tensors of " + std::to_string(a.numel()) +
                                  " and " + std::to_string(b.numel()) +
                                  " elements where every piece must be the same size");
    }
  }

  // What with_op would refuse, checked before anything is queued (a refused call takes no
  // sequence number).
  static void check_reduction(const char* name, const ReduceOp& op, at::ScalarType dtype) {
    switch (op.kind()) {
      case ReduceOp::SUM:
      case ReduceOp::PRODUCT:
      case ReduceOp::MIN:
      case ReduceOp::MAX:
        return;
      case ReduceOp::AVG:
        if (dtype == at::kBool) {
          throw std::invalid_argument("Cannot use ReduceOp.AVG with boolean inputs");
        }
        return;
      case ReduceOp::PREMUL_SUM:
        if (!op.has_scalar_factor()) {
          throw std::invalid_argument(std::string(name) +
                                      ": the nccl backend takes PREMUL_SUM with a scalar factor");
        }
        if (dtype != at::kDouble && dtype != at::kFloat && dtype != at::kHalf &&
            dtype != at::kBFloat16) {
          throw std::invalid_argument(std::string(name) +
                                      ": PREMUL_SUM needs a floating-point tensor, got " +
                                      c10::toString(dtype));
        }
        return;
      default:
        throw std::invalid_argument(std::string("Cannot use ") + op.describe() + " with NCCL");
    }
  }

  // Runs `call(reduction)` with NCCL's reduction for `op` (PyTorch's rules for bool), releasing a
  // PREMUL_SUM reduction afterwards. check_reduction has accepted `op` for `dtype`.
  template <class F>
  ncclResult_t with_op(const char* name, const ReduceOp& op, at::ScalarType dtype,
                       ncclDataType_t type, F&& call) {
    const bool is_bool = dtype == at::kBool;
    switch (op.kind()) {
      case ReduceOp::SUM:
        return call(is_bool ? ncclMax : ncclSum);
      case ReduceOp::PRODUCT:
        return call(is_bool ? ncclMin : ncclProd);
      case ReduceOp::MIN:
        return call(ncclMin);
      case ReduceOp::MAX:
        return call(ncclMax);
      case ReduceOp::AVG:
        return call(ncclAvg);
      case ReduceOp::PREMUL_SUM: {
        check_reduction(name, op, dtype);
        ncclRedOp_t premul{};
        ncclResult_t r = ncclSuccess;
        // The factor in the tensors' own type, read by NCCL from host memory at the call.
        const double f = op.scalar_factor();
        if (dtype == at::kDouble) {
          double v = f;
          r = ncclRedOpCreatePreMulSum(&premul, &v, type, ncclScalarHostImmediate, comm_);
        } else if (dtype == at::kFloat) {
          float v = static_cast<float>(f);
          r = ncclRedOpCreatePreMulSum(&premul, &v, type, ncclScalarHostImmediate, comm_);
        } else if (dtype == at::kHalf) {
          at::Half v(static_cast<float>(f));
          r = ncclRedOpCreatePreMulSum(&premul, &v, type, ncclScalarHostImmediate, comm_);
        } else {  // bfloat16 (check_reduction allows nothing else)
          at::BFloat16 v(static_cast<float>(f));
          r = ncclRedOpCreatePreMulSum(&premul, &v, type, ncclScalarHostImmediate, comm_);
        }
        if (r != ncclSuccess) return r;
        const ncclResult_t res = call(premul);
        ncclRedOpDestroy(premul, comm_);
        return res;
      }
      default:
        check_reduction(name, op, dtype);  // throws for what NCCL lacks
        throw std::logic_error("NcclBackend: unhandled " + op.describe());
    }
  }

  // NCCL calls between ncclGroupStart and ncclGroupEnd, which run them as one operation. The
  // group is closed whatever happens inside (an open group would defer every later NCCL call of
  // this thread).
  template <class F>
  static ncclResult_t grouped(F&& calls) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    struct Close {
      ncclResult_t* end;
      ~Close() { *end = ncclGroupEnd(); }
    };
    ncclResult_t end = ncclSuccess;
    ncclResult_t inside = ncclSuccess;
    {
      const Close close{&end};
      inside = calls();
    }
    return inside != ncclSuccess ? inside : end;
  }

  // call(i) for i in [0, n), in one group, stopping at the first failure.
  template <class F>
  static ncclResult_t each_in_group(int n, F&& call) {
    return grouped([&] {
      for (int i = 0; i < n; ++i) {
        const ncclResult_t res = call(i);
        if (res != ncclSuccess) return res;
      }
      return ncclSuccess;
    });
  }
  // gather's and scatter's pattern, in one group: a member other than the root makes
  // call(root); the root makes call(r) for every other member.
  template <class F>
  ncclResult_t with_root(int root, F&& call) {
    if (rank() != root) return grouped([&] { return call(root); });
    return each_in_group(size(), [&](int r) { return r == rank() ? ncclSuccess : call(r); });
  }
  // The all-to-alls' step with member r: send `out` to it, receive `in` from it.
  ncclResult_t exchange(const at::Tensor& out, const at::Tensor& in, ncclDataType_t type, int r,
                        cudaStream_t s) {
    const ncclResult_t res = ncclSend(out.data_ptr(), count(out), type, r, comm_, s);
    return res != ncclSuccess ? res : ncclRecv(in.data_ptr(), count(in), type, r, comm_, s);
  }

  struct FromSplit {};
  // A backend over `comm`, a communicator split from another backend's on GPU `index`.
  // (Its arguments were checked by split(), so Backend's own checks cannot throw here and leave
  // `comm` behind.)
  NcclBackend(FromSplit, ncclComm_t comm, int rank, int size, std::chrono::milliseconds timeout,
              int index)
      : Backend(rank, size, timeout), made_by_split_(true) {
    try {
      take_device(index);
    } catch (...) {
      (void)ncclCommAbort(comm);
      throw;
    }
    const c10::DeviceGuard on_device(device_);
    start(comm);
  }

  // On GPU `index`: the stream operations run on, and the event that orders it after the
  // caller's. Throws when this libtorch cannot name a CUDA stream's handle.
  void take_device(int index) {
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    const c10::DeviceGuard on_device(device_);
    stream_ = cuda().getStreamFromGlobalPool(device_);
    ready_.emplace(c10::kCUDA);
    (void)native(stream_);
  }

  // Runs the backend over `comm`: its thread, which completes Works and watches their time.
  void start(ncclComm_t comm) {
    comm_ = comm;
    try {
      state_ = std::make_shared<State>();
      completer_ = std::thread([this] { complete_loop(); });
    } catch (...) {
      // No destructor runs for a constructor that throws: the communicator goes here.
      (void)ncclCommAbort(comm_);
      throw;
    }
  }

  // The CUDA stream behind a c10 stream (compat::native_stream).
  static cudaStream_t native(const c10::Stream& s) {
    if (const auto h = compat::native_stream(s)) return static_cast<cudaStream_t>(*h);
    throw DistBackendError(
        "NcclBackend: this libtorch cannot name a CUDA stream's handle (Stream::native_handle, "
        "libtorch 2.x)");
  }

  std::string nccl_error(const char* what, ncclResult_t r) const {
    std::string text = std::string("NcclBackend: ") + what + " failed: " + ncclGetErrorString(r);
    const char* last = comm_ ? ncclGetLastError(comm_) : ncclGetLastError(nullptr);
    if (last && *last) text += std::string(" (") + last + ")";
    return text;
  }

  // Rendezvous through the store, then the communicator.
  ncclComm_t join(store::Store& store, int rank, int size, std::chrono::milliseconds timeout) {
    ncclUniqueId id{};
    try {
      // The store is the group's own; the members of a group make their backends on it in the
      // same order, so each member's n-th one meets the others' n-th.
      const std::string prefix =
          "nccl/" + std::to_string(store.add("nccl/made/" + std::to_string(rank), 1)) + "/";
      if (rank == 0) {
        const ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) throw DistBackendError(nccl_error("ncclGetUniqueId", r));
        store.set(prefix + "id",
                  store::Bytes(reinterpret_cast<const std::uint8_t*>(&id),
                               reinterpret_cast<const std::uint8_t*>(&id) + sizeof id));
      }
      if (store.add(prefix + "arrived", 1) == size)
        store.set(prefix + "all", std::string_view("1"));
      store.wait({prefix + "id", prefix + "all"}, timeout);
      const store::Bytes got = store.get(prefix + "id");
      if (got.size() != sizeof id) {
        throw DistBackendError("NcclBackend: the unique id in the store has " +
                               std::to_string(got.size()) + " bytes, expected " +
                               std::to_string(sizeof id));
      }
      std::memcpy(&id, got.data(), sizeof id);
    } catch (const DistError&) {
      throw;
    } catch (const std::exception& e) {
      throw DistBackendError(std::string("NcclBackend: meeting the group through the store: ") +
                             e.what());
    }
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRank(&comm, size, id, rank);
    if (r != ncclSuccess) throw DistBackendError(nccl_error("ncclCommInitRank", r));
    return comm;
  }

  // Queues one operation: our stream waits for the caller's, `issue` queues the NCCL calls (and
  // any copies) on it, a host function behind them reports the end. `touched`: every tensor the
  // GPU reads or writes (marked in use on our stream); `outputs`: the Work's result.
  template <class Issue>
  std::shared_ptr<Work> run(const char* op, std::chrono::milliseconds requested,
                            std::vector<at::Tensor> touched, std::vector<at::Tensor> outputs,
                            Issue&& issue, bool collective = true) {
    std::lock_guard lk(issue_mu_);
    if (!comm_ || state_->stopping) throw DistBackendError("NcclBackend: shut down");
    if (aborted_) throw DistBackendError(abort_text_);
    const std::int64_t seq = collective ? static_cast<std::int64_t>(next_sequence_number()) : -1;
    const std::uint64_t id = ++issued_;
    auto work = std::make_shared<NcclWork>(op, seq, state_, id, device_.index());
    // Pending (with its deadline) before NCCL is called: a call stuck inside NCCL is then
    // watched too, and a completion cannot arrive before its entry.
    const auto timeout = timeout_for(requested);
    bool wake = false;
    {
      std::lock_guard slk(state_->mu);
      // The backend's thread sleeps without a deadline only while nothing is pending, and
      // otherwise looks again within kWatchEvery: only a first entry, or one due sooner than
      // that, needs it awake now (a notify per call would cost each call a wake-up).
      wake = state_->pending.empty() || timeout < kWatchEvery;
      state_->pending.emplace(id,
                              Pending{work, std::move(outputs), op, seq, timeout, Clock::now()});
    }
    if (wake) state_->cv.notify_all();
    auto forget = [&] {
      std::lock_guard slk(state_->mu);
      state_->pending.erase(id);
    };

    const c10::DeviceGuard on_device(device_);
    ready_->record(cuda().getStream(device_));
    ready_->block(stream_);
    for (const at::Tensor& t : touched) {
      if (t.defined() && t.has_storage())
        cuda().recordDataPtrOnStream(t.storage().data_ptr(), stream_);
    }
    const cudaStream_t s = native(stream_);
    ncclResult_t r = ncclSuccess;
    try {
      const c10::StreamGuard on_stream(stream_);  // the copies some operations add run here too
      r = issue(s);
    } catch (...) {
      forget();
      throw;
    }
    // The watchdog may have aborted the communicator meanwhile (this call was stuck): it is not
    // touched again.
    if (aborted_) {
      forget();
      throw DistBackendError(abort_text_);
    }
    if (r != ncclSuccess) {
      forget();
      throw DistBackendError(nccl_error(op, r));
    }
    NcclWork::record_end(work, s);
    auto* arg = new HostFnArg{state_, id};
    const cudaError_t e = cudaLaunchHostFunc(s, &NcclBackend::on_gpu_done, arg);
    if (e != cudaSuccess) {
      delete arg;
      forget();
      throw DistBackendError(std::string("NcclBackend: ") + op +
                             ": cudaLaunchHostFunc failed: " + cudaGetErrorString(e));
    }
    return work;
  }

  // Runs on a CUDA thread once the GPU reaches it: no CUDA call here, only the wake-up.
  static void on_gpu_done(void* p) {
    std::unique_ptr<HostFnArg> arg(static_cast<HostFnArg*>(p));
    if (auto state = arg->state.lock()) {
      {
        std::lock_guard lk(state->mu);
        state->done.insert(arg->id);
      }
      state->cv.notify_all();
    }
  }

  // The backend's thread: completes the Works the GPU finished, and watches the others'
  // deadlines and NCCL's errors. It holds the state itself: once `stopping` is set it touches
  // nothing else of this object (shutdown may have come from one of its own callbacks).
  void complete_loop() {
    const std::shared_ptr<State> state = state_;
    std::unique_lock lk(state->mu);
    auto last_poll = Clock::now();
    while (!state->stopping) {
      std::vector<Pending> finished;
      for (const std::uint64_t id : state->done) {
        auto p = state->pending.find(id);
        if (p == state->pending.end()) continue;  // failed by an abort meanwhile
        finished.push_back(std::move(p->second));
        state->pending.erase(p);
      }
      state->done.clear();
      if (!finished.empty()) {
        // The GPU has finished them (the host function runs behind them on our stream): any
        // stream reads the outputs as they are, so the Works' futures need no device.
        lk.unlock();
        for (auto& f : finished) f.work->finish(std::move(f.outputs));
        finished.clear();
        lk.lock();
        continue;
      }
      if (state->pending.empty()) {
        state->cv.wait(lk);
        continue;
      }
      // The earliest deadline, and NCCL's asynchronous errors every kWatchEvery meanwhile.
      const auto now = Clock::now();
      const Pending* late = nullptr;
      auto next = now + kWatchEvery;
      for (const auto& [id, p] : state->pending) {
        // A timeout past the clock's range (milliseconds::max() for "never") has no deadline.
        const auto deadline = p.timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(
                                               Clock::time_point::max() - p.started)
                                  ? Clock::time_point::max()
                                  : p.started + p.timeout;
        if (deadline <= now) {
          late = &p;
          break;
        }
        next = std::min(next, deadline);
      }
      std::string failure;
      if (late) {
        failure = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=" +
                  std::to_string(late->seq) + ", OpType=" + detail::op_type(late->op) +
                  ", Timeout(ms)=" + std::to_string(late->timeout.count()) + ") ran for " +
                  std::to_string(
                      std::chrono::duration_cast<std::chrono::milliseconds>(now - late->started)
                          .count()) +
                  " milliseconds before timing out.";
      } else if (!aborted_ && now - last_poll >= kWatchEvery) {
        last_poll = now;
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress) {
          failure = nccl_error("an operation", async);
        }
      }
      if (failure.empty()) {
        state->cv.wait_until(lk, next);
        continue;
      }
      // Abort: the queued operations end, every pending Work fails with the same text.
      std::vector<Pending> failed;
      for (auto& [id, p] : state->pending) failed.push_back(std::move(p));
      state->pending.clear();
      lk.unlock();
      {
        // Normally no call is inside NCCL and this takes the lock at once. A caller stuck inside
        // one (a send whose peer never comes) holds it: after a second the abort goes ahead
        // anyway, which is what ends that call. Known unsafe: the communicator is blocking, and
        // NCCL supports aborting it from another thread only when it is non-blocking (the stuck
        // call then returns through freed state). A hang there is traded for that risk until
        // the communicator is made non-blocking (docs/cuda.md, "Not there yet").
        std::unique_lock issue(issue_mu_, std::defer_lock);
        (void)issue.try_lock_for(std::chrono::seconds(1));
        if (!aborted_) {
          abort_text_ = failure + " The communicator was aborted; this group cannot be used again.";
          aborted_ = true;  // after the text: a caller that sees the flag reads a finished text
          ncclCommAbort(comm_);
        }
      }
      {
        // Operations queued between taking the pending entries and the abort (a caller that
        // still saw the communicator whole): the abort ends them early, so their events are
        // reached and their host functions run, but they did not finish. After the abort no
        // entry comes in (run() checks the flag first).
        std::lock_guard again(state->mu);
        for (auto& [id, p] : state->pending) failed.push_back(std::move(p));
        state->pending.clear();
      }
      const auto e = std::make_exception_ptr(DistBackendError(failure));
      for (auto& p : failed) p.work->finish_error(e);
      failed.clear();
      lk.lock();
    }
  }

  c10::Device device_{c10::kCUDA, 0};
  c10::Stream stream_{c10::Stream::DEFAULT, c10::Device(c10::kCUDA, 0)};
  // Marks the caller's stream for ours to wait on, reused by every operation under issue_mu_
  // (a wait takes the event as it is when asked). Made once a CUDA device is known to be there.
  std::optional<c10::Event> ready_;
  ncclComm_t comm_ = nullptr;
  std::timed_mutex issue_mu_;  // NCCL calls on comm_; aborted_, abort_text_ (see complete_loop)
  std::atomic<bool> aborted_{false};
  std::string abort_text_;    // set before aborted_
  std::uint64_t issued_ = 0;  // under issue_mu_
  std::shared_ptr<State> state_;
  std::atomic<std::uint64_t> splits_{0};
  const bool made_by_split_ = false;
  std::thread completer_;
};

// Registers "nccl" (for "cuda") with register_backend, once per process; afterwards
// is_backend_available("nccl") is true and backend_creator("nccl") makes an NcclBackend on the
// current CUDA device.
inline void register_nccl_backend() {
  register_backend_class_once<NcclBackend>("nccl", {"cuda"});
}

}  // namespace distrpc::dist

#endif  // DISTRPC_HAVE_NCCL
