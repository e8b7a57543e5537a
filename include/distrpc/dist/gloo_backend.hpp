// GlooBackend: libtorch's own c10d::ProcessGroupGloo behind distrpc's Backend interface, meeting
// its peers through any distrpc store (shown to c10d by detail::C10dStoreAdapter). Registered as
// "gloo" for the "cpu" device by register_gloo_backend().
//
// Built only where libtorch has c10d::ProcessGroupGloo and gloo's headers are installed (Meson's
// gloo_found defines USE_C10D_GLOO, libtorch's own switch for this header).
//
// What ProcessGroupGloo does natively and what this adapter adds (the same code on libtorch 1.13
// and 2.x: only calls both have are used):
//  - Native: broadcast, allreduce, allreduce_coalesced, reduce, allgather, gather, scatter,
//    alltoall_base, send, recv, recv_anysource, barrier.
//  - Composed here: allgather_into_tensor (allgather into slices of one buffer),
//    reduce_scatter and reduce_scatter_tensor (allreduce of the whole input, then this rank's
//    slice), alltoall (one alltoall_base over the flattened tensors). 1.13 lacks the first three
//    (2.x has them natively); neither has a list alltoall.
//  - Reductions gloo lacks: AVG is SUM followed by a division by the group size; PREMUL_SUM
//    multiplies this rank's input by the factor (start_reduction) before a SUM.
//  - Dtypes gloo lacks (1.13 moves and reduces float, double, half, int8, uint8, int32, int64):
//    data movement carries any dtype reinterpreted as a gloo type of the same element size
//    (bool as uint8, bfloat16 and int16 as half, complex as its real pairs); reductions run bool
//    as uint8 (SUM as MAX, PRODUCT as MIN: logical or / and), bfloat16 in float, int16 in int32,
//    complex as real pairs (only SUM, AVG and PREMUL_SUM accept complex).
//  - Gathers of 0-element tensors complete without gloo (its allgather divides by the count).
//  - Non-contiguous tensors travel through a contiguous copy; results are copied back into the
//    caller's tensor before the Work completes.
//  - Timeouts: the backend's timeout is gloo's context timeout (a collective whose peers do not
//    come fails after it, on every member). A per-call timeout is enforced here: the caller's Work
//    fails with a DistBackendError when it passes, while gloo goes on with the operation under the
//    backend's timeout, so that members whose peers are merely late stay in step (the call is not
//    handed to c10d: 2.x would abort the operation on this member alone; 1.13 ignores it).
//  - Errors: c10d's errors (at the call or when the work fails) become DistBackendError with the
//    same text; bad arguments this adapter detects first are std::invalid_argument.
//
// Threads: ProcessGroupGloo's worker threads run the collectives and complete their Work (so a
// callback on a collective's future runs there, with no lock of this backend held). A point-to-
// point call gets one waiter thread that blocks on c10d's work (its futures are 2.x only). One
// watchdog thread serves per-call timeouts, started on first use. shutdown() joins them all.
#pragma once

#ifdef USE_C10D_GLOO

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <distrpc/bounded_thread.hpp>
#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/detail/c10d_store_adapter.hpp>
#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/error.hpp>
#include <distrpc/store/store.hpp>

namespace distrpc::dist {

// Where gloo listens. Empty fields: the interface named by GLOO_SOCKET_IFNAME (PyTorch's
// variable) if set, else the address this host's name resolves to (loopback if it resolves to
// none), as PyTorch picks it.
struct GlooBackendOptions {
  std::string hostname;   // an address or host name to bind to
  std::string interface;  // a network interface ("lo", "eth0"); hostname wins if both are set
  int threads = 2;        // ProcessGroupGloo's worker threads (collectives in flight at once)
};

namespace detail {

// A tensor as gloo sees it (wire) and where the result goes (target, a view of the caller's
// tensor). copy_back: wire is a separate buffer whose contents must be copied into target.
struct GlooStaged {
  at::Tensor target;
  at::Tensor wire;
  bool copy_back = false;

  void land() const {
    if (copy_back) target.copy_(wire);
  }
};

inline bool gloo_native_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// t reinterpreted (no copy) as a dtype gloo can move, keeping every byte.
inline at::Tensor gloo_movable_view(const at::Tensor& t) {
  if (gloo_native_dtype(t.scalar_type())) return t;
  if (t.is_complex()) return gloo_movable_view(at::view_as_real(t));
  switch (t.element_size()) {
    case 1:
      return t.view(at::kByte);
    case 2:
      return t.view(at::kHalf);
    case 4:
      return t.view(at::kInt);
    case 8:
      return t.view(at::kLong);
    default:
      break;
  }
  throw std::invalid_argument(std::string("GlooBackend: tensors of dtype ") +
                              c10::toString(t.scalar_type()) + " cannot be sent");
}

// For data movement: gloo reads and writes wire; results land in the caller's tensor.
inline GlooStaged gloo_stage_move(const at::Tensor& user) {
  at::Tensor v = gloo_movable_view(user);
  if (v.is_contiguous()) return {v, v, false};
  return {v, v.contiguous(), true};
}

// For reductions: wire holds this rank's contribution in a dtype gloo reduces (PREMUL_SUM's
// factor already applied), target is where the reduced values land.
inline GlooStaged gloo_stage_reduce(const at::Tensor& user, const ReduceOp& op) {
  at::Tensor x = user;
  bool fresh = false;
  if (op.kind() == ReduceOp::PREMUL_SUM) {
    x = start_reduction(user, op);
    fresh = true;
  }
  at::Tensor target = user;
  if (x.is_complex()) {
    x = at::view_as_real(x);
    target = at::view_as_real(user);
  }
  switch (x.scalar_type()) {
    case at::kBool:
      // Reinterpreted, not converted: the byte values 0 and 1 stay 0 and 1 under the ops used.
      x = x.view(at::kByte);
      break;
    case at::kBFloat16:
      x = x.to(at::kFloat);
      fresh = true;
      break;
    case at::kShort:
      x = x.to(at::kInt);
      fresh = true;
      break;
    default:
      if (!gloo_native_dtype(x.scalar_type())) {
        throw std::invalid_argument(std::string("GlooBackend: tensors of dtype ") +
                                    c10::toString(user.scalar_type()) + " cannot be reduced");
      }
  }
  if (!x.is_contiguous()) {
    x = x.contiguous();
    fresh = true;
  }
  return {target, x, fresh};
}

// The c10d reduction gloo runs for op on tensors of dtype t (see gloo_stage_reduce).
inline c10d::ReduceOp gloo_reduce_op(const ReduceOp& op, at::ScalarType t) {
  const bool is_bool = t == at::kBool;
  switch (op.kind()) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
    case ReduceOp::PREMUL_SUM:
      return is_bool ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    case ReduceOp::PRODUCT:
      return is_bool ? c10d::ReduceOp::MIN : c10d::ReduceOp::PRODUCT;
    case ReduceOp::MIN:
      return c10d::ReduceOp::MIN;
    case ReduceOp::MAX:
      return c10d::ReduceOp::MAX;
    case ReduceOp::BAND:
      return c10d::ReduceOp::BAND;
    case ReduceOp::BOR:
      return c10d::ReduceOp::BOR;
    case ReduceOp::BXOR:
      return c10d::ReduceOp::BXOR;
    case ReduceOp::UNUSED:
      break;
  }
  throw std::invalid_argument("GlooBackend: invalid " + op.describe());
}

// Any failure as the DistError a caller of this backend catches: distrpc's errors unchanged,
// c10d's (c10::Error) and others as DistBackendError with their text.
inline std::exception_ptr as_dist_error(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const DistError&) {
    return std::current_exception();
  } catch (const std::invalid_argument&) {
    return std::current_exception();
  } catch (const c10::Error& err) {
    return std::make_exception_ptr(DistBackendError(err.what_without_backtrace()));
  } catch (const std::exception& err) {
    return std::make_exception_ptr(DistBackendError(err.what()));
  } catch (...) {
    return std::make_exception_ptr(DistBackendError("GlooBackend: unknown error"));
  }
}

// Set while a thread of gloo's own (a ProcessGroupGloo worker) completes one of our works, so
// that user callbacks run under it: the group's destruction joins those threads, and must not
// run on one of them.
inline thread_local int tls_on_gloo_thread = 0;
struct OnGlooThread {
  OnGlooThread() { ++tls_on_gloo_thread; }
  ~OnGlooThread() { --tls_on_gloo_thread; }
  OnGlooThread(const OnGlooThread&) = delete;
  OnGlooThread& operator=(const OnGlooThread&) = delete;
};

}  // namespace detail

class GlooBackend : public Backend {
 public:
  // Joins the group of size members through store (every member passes the same store
  // contents, e.g. a TCPStore, or a PrefixStore per group); blocks until all have arrived or
  // timeout passes (DistBackendError with the store's timeout text).
  GlooBackend(std::shared_ptr<store::Store> store, int rank, int size,
              std::chrono::milliseconds timeout, GlooBackendOptions options = {})
      : Backend(rank, size, timeout), state_(std::make_shared<State>()) {
    if (!store) throw std::invalid_argument("GlooBackend: the store is null");
    if (options.threads < 1) {
      throw std::invalid_argument("GlooBackend: threads must be at least 1, got " +
                                  std::to_string(options.threads));
    }
    try {
      auto c10d_opts = c10d::ProcessGroupGloo::Options::create(timeout);
      c10d_opts->devices.push_back(make_device(options));
      c10d_opts->threads = options.threads;
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<detail::C10dStoreAdapter>(std::move(store)), rank, size, c10d_opts);
    } catch (...) {
      std::rethrow_exception(detail::as_dist_error(std::current_exception()));
    }
  }

  ~GlooBackend() override { shutdown(); }

  std::string name() const override { return "gloo"; }

  std::shared_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                  const BroadcastOptions& opts = {}) override {
    const at::Tensor& t = check_single_tensor("broadcast", tensors);
    check_root("broadcast", opts.root_rank);
    check_root_tensor("broadcast", opts.root_tensor);
    auto staged = detail::gloo_stage_move(t);
    c10d::BroadcastOptions c;
    c.rootRank = opts.root_rank;
    std::vector<at::Tensor> wire{staged.wire};
    return collective(
        "broadcast", opts.timeout, [&] { return pg_->broadcast(wire, c); },
        [staged, t] {
          staged.land();
          return std::vector<at::Tensor>{t};
        });
  }

  std::shared_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                  const AllreduceOptions& opts = {}) override {
    const at::Tensor& t = check_single_tensor("allreduce", tensors);
    check_reduce_dtype(opts.op, t.scalar_type());
    auto staged = detail::gloo_stage_reduce(t, opts.op);
    c10d::AllreduceOptions c;
    c.reduceOp = detail::gloo_reduce_op(opts.op, t.scalar_type());
    std::vector<at::Tensor> wire{staged.wire};
    const ReduceOp op = opts.op;
    const int world = size();
    return collective(
        "allreduce", opts.timeout, [&] { return pg_->allreduce(wire, c); },
        [staged, t, op, world] {
          at::Tensor acc = staged.wire;
          finish_reduction(acc, op, world);
          staged.land();
          return std::vector<at::Tensor>{t};
        });
  }

  std::shared_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                            const AllreduceCoalescedOptions& opts = {}) override {
    if (tensors.empty()) {
      throw std::invalid_argument("allreduce_coalesced: the tensor list is empty");
    }
    std::vector<detail::GlooStaged> staged;
    std::vector<at::Tensor> wire;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      check_cpu_tensor("allreduce_coalesced", tensors[i], i);
      check_same_dtype(tensors[0], tensors[i]);
      check_reduce_dtype(opts.op, tensors[i].scalar_type());
      staged.push_back(detail::gloo_stage_reduce(tensors[i], opts.op));
      wire.push_back(staged.back().wire);
    }
    c10d::AllreduceCoalescedOptions c;
    c.reduceOp = detail::gloo_reduce_op(opts.op, tensors[0].scalar_type());
    const ReduceOp op = opts.op;
    const int world = size();
    std::vector<at::Tensor> users = tensors;
    return collective(
        "allreduce_coalesced", opts.timeout, [&] { return pg_->allreduce_coalesced(wire, c); },
        [staged, users, op, world] {
          for (const auto& s : staged) {
            at::Tensor acc = s.wire;
            finish_reduction(acc, op, world);
            s.land();
          }
          return users;
        });
  }

  std::shared_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                               const ReduceOptions& opts = {}) override {
    const at::Tensor& t = check_single_tensor("reduce", tensors);
    check_root("reduce", opts.root_rank);
    check_root_tensor("reduce", opts.root_tensor);
    check_reduce_dtype(opts.op, t.scalar_type());
    auto staged = detail::gloo_stage_reduce(t, opts.op);
    c10d::ReduceOptions c;
    c.reduceOp = detail::gloo_reduce_op(opts.op, t.scalar_type());
    c.rootRank = opts.root_rank;
    std::vector<at::Tensor> wire{staged.wire};
    const ReduceOp op = opts.op;
    const int world = size();
    const bool is_root = opts.root_rank == rank();
    return collective(
        "reduce", opts.timeout, [&] { return pg_->reduce(wire, c); },
        [staged, t, op, world, is_root] {
          // Only the root receives the result (elsewhere gloo may have used the buffer).
          if (is_root) {
            at::Tensor acc = staged.wire;
            finish_reduction(acc, op, world);
            staged.land();
          }
          return std::vector<at::Tensor>{t};
        });
  }

  std::shared_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const AllgatherOptions& opts = {}) override {
    const at::Tensor& in = check_single_tensor("allgather", inputs);
    check_one_list("allgather", outputs.size(), "output");
    auto staged = stage_list("allgather", outputs[0], in, "output");
    if (in.numel() == 0) return without_data("allgather", outputs[0]);
    std::vector<std::vector<at::Tensor>> wire_out{wires(staged)};
    std::vector<at::Tensor> wire_in{detail::gloo_stage_move(in).wire};
    c10d::AllgatherOptions c;
    std::vector<at::Tensor> users = outputs[0];
    return collective(
        "allgather", opts.timeout, [&] { return pg_->allgather(wire_out, wire_in, c); },
        [staged, users] {
          for (const auto& s : staged) s.land();
          return users;
        });
  }

  // Composed: allgather into the slices of one contiguous buffer, copied into output.
  std::shared_ptr<Work> allgather_into_tensor(at::Tensor& output, at::Tensor& input,
                                              const AllgatherOptions& opts = {}) override {
    check_cpu_tensor("allgather_into_tensor", input, 0);
    check_cpu_tensor("allgather_into_tensor", output, 0, "output");
    check_same_dtype(output, input);
    if (output.numel() != input.numel() * size()) {
      throw std::invalid_argument(
          "GlooBackend allgather_into_tensor: the output must have size() times the input's "
          "elements (" +
          std::to_string(input.numel() * size()) + "), got " + std::to_string(output.numel()));
    }
    if (input.numel() == 0) return without_data("allgather_into_tensor", {output});
    at::Tensor in_wire = detail::gloo_stage_move(input).wire.reshape({-1});
    at::Tensor buffer = at::empty({size(), in_wire.numel()}, in_wire.options());
    std::vector<std::vector<at::Tensor>> wire_out(1);
    for (int r = 0; r < size(); ++r) wire_out[0].push_back(buffer[r]);
    std::vector<at::Tensor> wire_in{in_wire};
    c10d::AllgatherOptions c;
    at::Tensor out = output;
    return collective(
        "allgather_into_tensor", opts.timeout, [&] { return pg_->allgather(wire_out, wire_in, c); },
        [buffer, out] {
          detail::gloo_movable_view(out).copy_(buffer.view(detail::gloo_movable_view(out).sizes()));
          return std::vector<at::Tensor>{out};
        });
  }

  std::shared_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                               std::vector<at::Tensor>& inputs,
                               const GatherOptions& opts = {}) override {
    const at::Tensor& in = check_single_tensor("gather", inputs);
    check_root("gather", opts.root_rank);
    const bool is_root = opts.root_rank == rank();
    std::vector<detail::GlooStaged> staged;
    std::vector<std::vector<at::Tensor>> wire_out;
    std::vector<at::Tensor> users;
    check_root_lists("gather", outputs, opts.root_rank, "output");
    if (is_root) {
      staged = stage_list("gather", outputs[0], in, "output");
      wire_out.push_back(wires(staged));
      users = outputs[0];
    }
    if (in.numel() == 0) return without_data("gather", users);
    std::vector<at::Tensor> wire_in{detail::gloo_stage_move(in).wire};
    c10d::GatherOptions c;
    c.rootRank = opts.root_rank;
    return collective(
        "gather", opts.timeout, [&] { return pg_->gather(wire_out, wire_in, c); },
        [staged, users] {
          for (const auto& s : staged) s.land();
          return users;
        });
  }

  std::shared_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                std::vector<std::vector<at::Tensor>>& inputs,
                                const ScatterOptions& opts = {}) override {
    const at::Tensor& out = check_single_tensor("scatter", outputs, "output");
    check_root("scatter", opts.root_rank);
    const bool is_root = opts.root_rank == rank();
    std::vector<std::vector<at::Tensor>> wire_in;
    check_root_lists("scatter", inputs, opts.root_rank, "input");
    if (is_root) {
      auto staged = stage_list("scatter", inputs[0], out, "input");
      wire_in.push_back(wires(staged));
    }
    if (out.numel() == 0) return without_data("scatter", {out});
    auto staged_out = detail::gloo_stage_move(out);
    std::vector<at::Tensor> wire_out{staged_out.wire};
    c10d::ScatterOptions c;
    c.rootRank = opts.root_rank;
    at::Tensor user = out;
    return collective(
        "scatter", opts.timeout, [&] { return pg_->scatter(wire_out, wire_in, c); },
        [staged_out, user] {
          staged_out.land();
          return std::vector<at::Tensor>{user};
        });
  }

  // Composed: every input reduced with one allreduce, then this rank's part copied out.
  std::shared_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                       std::vector<std::vector<at::Tensor>>& inputs,
                                       const ReduceScatterOptions& opts = {}) override {
    const at::Tensor& out = check_single_tensor("reduce_scatter", outputs, "output");
    check_one_list("reduce_scatter", inputs.size(), "input");
    auto& list = inputs[0];
    check_tensor_list("reduce_scatter", list, out, "input");
    std::vector<at::Tensor> flat;
    for (std::size_t i = 0; i < list.size(); ++i) {
      check_same_shape("reduce_scatter", list[i], i, out, "input");
      flat.push_back(list[i].reshape({-1}));
    }
    return reduce_scatter_flat("reduce_scatter", out, at::cat(flat), opts);
  }

  std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor& output, at::Tensor& input,
                                              const ReduceScatterOptions& opts = {}) override {
    check_cpu_tensor("reduce_scatter_tensor", input, 0);
    check_cpu_tensor("reduce_scatter_tensor", output, 0, "output");
    check_same_dtype(output, input);
    if (input.numel() != output.numel() * size()) {
      throw std::invalid_argument(
          "GlooBackend reduce_scatter_tensor: the input must have size() times the output's "
          "elements (" +
          std::to_string(output.numel() * size()) + "), got " + std::to_string(input.numel()));
    }
    return reduce_scatter_flat("reduce_scatter_tensor", output, input.reshape({-1}), opts);
  }

  std::shared_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                      std::vector<std::int64_t> output_split_sizes,
                                      std::vector<std::int64_t> input_split_sizes,
                                      const AllToAllOptions& opts = {}) override {
    check_cpu_tensor("alltoall_base", input, 0);
    check_cpu_tensor("alltoall_base", output, 0, "output");
    check_same_dtype(output, input);
    (void)split_rows("alltoall_base", "output", output, output_split_sizes);
    (void)split_rows("alltoall_base", "input", input, input_split_sizes);
    auto staged_out = detail::gloo_stage_move(output);
    at::Tensor wire_in = detail::gloo_stage_move(input).wire;
    at::Tensor wire_out = staged_out.wire;
    c10d::AllToAllOptions c;
    at::Tensor user = output;
    return collective(
        "alltoall_base", opts.timeout,
        [&] {
          return pg_->alltoall_base(wire_out, wire_in, output_split_sizes, input_split_sizes, c);
        },
        [staged_out, user] {
          staged_out.land();
          return std::vector<at::Tensor>{user};
        });
  }

  // Composed: one alltoall_base over the tensors flattened end to end.
  std::shared_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                 const AllToAllOptions& opts = {}) override {
    const auto n = static_cast<std::size_t>(size());
    // An empty list fails the count check before its first element is read.
    check_tensor_list("alltoall", inputs, inputs.empty() ? at::Tensor() : inputs.front(), "input");
    check_tensor_list("alltoall", outputs, inputs.front(), "output");
    std::vector<at::Tensor> flat_in;
    std::vector<std::int64_t> in_splits;
    std::vector<std::int64_t> out_splits;
    std::vector<at::Tensor> targets;
    for (std::size_t i = 0; i < n; ++i) {
      at::Tensor in = detail::gloo_movable_view(inputs[i]).reshape({-1});
      flat_in.push_back(in);
      in_splits.push_back(in.numel());
      targets.push_back(detail::gloo_movable_view(outputs[i]));
      out_splits.push_back(targets.back().numel());
    }
    at::Tensor wire_in = at::cat(flat_in);
    std::int64_t total_out = 0;
    for (auto s : out_splits) total_out += s;
    at::Tensor wire_out = at::empty({total_out}, wire_in.options());
    c10d::AllToAllOptions c;
    std::vector<at::Tensor> users = outputs;
    return collective(
        "alltoall", opts.timeout,
        [&] { return pg_->alltoall_base(wire_out, wire_in, out_splits, in_splits, c); },
        [wire_out, targets, out_splits, users] {
          std::int64_t offset = 0;
          for (std::size_t i = 0; i < targets.size(); ++i) {
            targets[i].copy_(wire_out.narrow(0, offset, out_splits[i]).view(targets[i].sizes()));
            offset += out_splits[i];
          }
          return users;
        });
  }

  std::shared_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override {
    const at::Tensor& t = check_single_tensor("send", tensors);
    check_peer("send", "destination", dst_rank);
    std::vector<at::Tensor> wire{detail::gloo_stage_move(t).wire};
    at::Tensor user = t;
    return point_to_point(
        "send", [&] { return pg_->send(wire, dst_rank, tag); },
        [user](int) { return std::vector<at::Tensor>{user}; }, false);
  }

  std::shared_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override {
    const at::Tensor& t = check_single_tensor("recv", tensors);
    check_peer("recv", "source", src_rank);
    auto staged = detail::gloo_stage_move(t);
    std::vector<at::Tensor> wire{staged.wire};
    at::Tensor user = t;
    return point_to_point(
        "recv", [&] { return pg_->recv(wire, src_rank, tag); },
        [staged, user](int) {
          staged.land();
          return std::vector<at::Tensor>{user};
        },
        true);
  }

  std::shared_ptr<Work> recv_anysource(std::vector<at::Tensor>& tensors, int tag) override {
    const at::Tensor& t = check_single_tensor("recv_anysource", tensors);
    auto staged = detail::gloo_stage_move(t);
    std::vector<at::Tensor> wire{staged.wire};
    at::Tensor user = t;
    return point_to_point(
        "recv_anysource", [&] { return pg_->recvAnysource(wire, tag); },
        [staged, user](int) {
          staged.land();
          return std::vector<at::Tensor>{user};
        },
        true);
  }

  std::shared_ptr<Work> barrier(const BarrierOptions& opts = {}) override {
    c10d::BarrierOptions c;
    return collective(
        "barrier", opts.timeout, [&] { return pg_->barrier(c); },
        [] { return std::vector<at::Tensor>{}; });
  }

  // Pending work fails ("Backend gloo was shut down"), the waiter and watchdog threads are
  // joined, then ProcessGroupGloo is destroyed (it joins its workers; a collective still running
  // ends at the latest after the backend's timeout).
  void shutdown() override {
    std::vector<std::weak_ptr<Work>> pending;
    std::vector<Waiter> waiters;
    std::thread watchdog;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->stopped.exchange(true)) return;
      pending.swap(state_->pending);
      waiters.swap(state_->waiters);
      watchdog.swap(state_->watchdog);
    }
    state_->cv.notify_all();
    const auto err = std::make_exception_ptr(DistBackendError("Backend gloo was shut down"));
    for (auto& w : pending) {
      if (auto work = w.lock()) work->finish_error(err);
    }
    // A Work callback runs on the watchdog or a waiter thread; one that drops the backend's last
    // reference runs this shutdown there, and a thread cannot join itself: that one is detached
    // (it touches only the shared state and its own captures, never the backend).
    join_or_detach(watchdog);
    for (auto& w : waiters) {
      if (!w.done->load(std::memory_order_acquire)) {
        try {
          w.work->abort();
        } catch (...) {
          // Already finished between the check and the abort: nothing to stop.
        }
      }
      join_or_detach(w.thread);
    }
    if (detail::tls_on_gloo_thread > 0) {
      // A callback of a collective's work, on a thread of the group: ~ProcessGroupGloo joins
      // that thread, so the group is destroyed on one of its own, once this callback returned.
      std::thread([pg = std::move(pg_)]() mutable { pg.reset(); }).detach();
    } else {
      pg_.reset();
    }
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct Waiter {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
    c10::intrusive_ptr<c10d::Work> work;
  };

  // Shared with completion callbacks and threads, which may outlive a call (never the backend:
  // shutdown() joins or fails them first).
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::atomic<bool> stopped{false};
    std::vector<std::weak_ptr<Work>> pending;
    std::vector<Waiter> waiters;
    std::multimap<Clock::time_point, std::pair<std::weak_ptr<Work>, std::string>> deadlines;
    std::thread watchdog;
  };

  static std::shared_ptr<::gloo::transport::Device> make_device(const GlooBackendOptions& o) {
    if (!o.hostname.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname(o.hostname);
    if (!o.interface.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(o.interface);
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    }
    return c10d::ProcessGroupGloo::createDefaultDevice();
  }

  // ---- argument checks (std::invalid_argument naming the operation and what was wrong)

  void check_running(const char* op) const {
    if (state_->stopped.load(std::memory_order_acquire)) {
      throw DistBackendError(std::string("GlooBackend ") + op + ": the backend was shut down");
    }
  }

  // reduce_scatter's inputs and the gathers' lists: shaped as like (gloo moves whole tensors).
  static void check_same_shape(const char* op, const at::Tensor& t, std::size_t index,
                               const at::Tensor& like, const char* what) {
    if (t.sizes() != like.sizes()) {
      throw std::invalid_argument(std::string(op) + ": " + what + " " + std::to_string(index) +
                                  " has shape " + c10::str(t.sizes()) + ", expected " +
                                  c10::str(like.sizes()));
    }
  }

  // One staged tensor per rank, each shaped and typed as like.
  std::vector<detail::GlooStaged> stage_list(const char* op, const std::vector<at::Tensor>& list,
                                             const at::Tensor& like, const char* what) const {
    check_tensor_list(op, list, like, what);
    std::vector<detail::GlooStaged> staged;
    for (std::size_t i = 0; i < list.size(); ++i) {
      check_same_shape(op, list[i], i, like, what);
      staged.push_back(detail::gloo_stage_move(list[i]));
    }
    return staged;
  }

  static std::vector<at::Tensor> wires(const std::vector<detail::GlooStaged>& staged) {
    std::vector<at::Tensor> out;
    for (const auto& s : staged) out.push_back(s.wire);
    return out;
  }

  // flat: the whole input, size() slices of output's element count end to end.
  std::shared_ptr<Work> reduce_scatter_flat(const char* op_name, const at::Tensor& output,
                                            const at::Tensor& flat,
                                            const ReduceScatterOptions& opts) {
    check_reduce_dtype(opts.op, output.scalar_type());
    auto staged = detail::gloo_stage_reduce(flat, opts.op);
    if (!staged.copy_back) staged.wire = staged.wire.clone();  // never reduce the caller's input
    c10d::AllreduceOptions c;
    c.reduceOp = detail::gloo_reduce_op(opts.op, output.scalar_type());
    std::vector<at::Tensor> wire{staged.wire};
    const ReduceOp op = opts.op;
    const int world = size();
    const std::int64_t n = output.numel();
    const std::int64_t me = rank();
    at::Tensor out = output;
    at::Tensor target = out.is_complex() ? at::view_as_real(out) : out;
    return collective(
        op_name, opts.timeout, [&] { return pg_->allreduce(wire, c); },
        [wire_t = staged.wire, target, out, op, world, n, me] {
          at::Tensor mine = wire_t.view({world, -1})[me];
          finish_reduction(mine, op, world);
          target.copy_(mine.view(target.sizes()));
          return std::vector<at::Tensor>{out};
        });
  }

  // A gathering call whose tensors have no elements (on every member alike, as the call
  // requires): nothing to exchange, and gloo's allgather divides by the element count. It still
  // takes its sequence number, as on the members' other backends.
  std::shared_ptr<Work> without_data(const char* op, std::vector<at::Tensor> outputs) {
    check_running(op);
    auto work = std::make_shared<Work>(op, static_cast<std::int64_t>(next_sequence_number()));
    work->finish(std::move(outputs));
    return work;
  }

  // Issues a collective (start() calls ProcessGroupGloo) and completes our Work from c10d's
  // future: done() lands the results; errors become DistBackendError.
  template <class Start, class Done>
  std::shared_ptr<Work> collective(const char* op, std::chrono::milliseconds timeout, Start&& start,
                                   Done done) {
    check_running(op);
    check_call_timeout(op, timeout);
    c10::intrusive_ptr<c10d::Work> cw;
    try {
      cw = start();
    } catch (...) {
      std::rethrow_exception(detail::as_dist_error(std::current_exception()));
    }
    auto work = std::make_shared<Work>(op, static_cast<std::int64_t>(next_sequence_number()));
    track(work, op, timeout);
    auto state = state_;
    cw->getFuture()->addCallback(
        [work, state, done = std::move(done)](c10::ivalue::Future& f) mutable {
          const detail::OnGlooThread on_gloo_thread;
          if (f.hasError()) {
            work->finish_error(detail::as_dist_error(f.exception_ptr()));
            return;
          }
          // After shutdown (or a per-call timeout) the caller no longer owns the result.
          if (state->stopped.load(std::memory_order_acquire) || work->is_completed()) return;
          complete(*work, [&] { return done(); });
        });
    return work;
  }

  // Issues a send or receive and completes our Work from a waiter thread (c10d's point-to-point
  // works have no future in 1.13). done(source rank) lands a received tensor.
  template <class Start, class Done>
  std::shared_ptr<Work> point_to_point(const char* op, Start&& start, Done done, bool is_recv) {
    check_running(op);
    c10::intrusive_ptr<c10d::Work> cw;
    try {
      cw = start();
    } catch (...) {
      std::rethrow_exception(detail::as_dist_error(std::current_exception()));
    }
    // No sequence number: members send and receive different counts, and the group's number
    // must stay equal on every member (it counts collectives, as PyTorch's does).
    auto work = std::make_shared<Work>(op, -1);
    auto finished = std::make_shared<std::atomic<bool>>(false);
    auto state = state_;
    const auto limit = timeout();
    std::vector<Waiter> reaped;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->stopped.load())
        throw DistBackendError(std::string("GlooBackend ") + op + ": the backend was shut down");
      // Joined outside the lock below: these have returned already.
      auto& ws = state_->waiters;
      for (auto it = ws.begin(); it != ws.end();) {
        if (it->done->load(std::memory_order_acquire)) {
          reaped.push_back(std::move(*it));
          it = ws.erase(it);
        } else {
          ++it;
        }
      }
      state_->pending.push_back(work);
      ws.push_back(Waiter{std::thread([work, cw, finished, state, limit, is_recv,
                                       done = std::move(done)]() mutable {
                            try {
                              cw->wait(limit);
                              if (!state->stopped.load(std::memory_order_acquire)) {
                                const int src = is_recv ? cw->sourceRank() : -1;
                                auto outs = done(src);
                                if (is_recv)
                                  work->finish_recv(std::move(outs), src);
                                else
                                  work->finish(std::move(outs));
                              }
                            } catch (...) {
                              work->finish_error(detail::as_dist_error(std::current_exception()));
                            }
                            finished->store(true, std::memory_order_release);
                          }),
                          finished, cw});
    }
    for (auto& w : reaped) w.thread.join();
    return work;
  }

  template <class F>
  static void complete(Work& work, F&& produce) {
    std::vector<at::Tensor> outs;
    try {
      outs = produce();
    } catch (...) {
      work.finish_error(detail::as_dist_error(std::current_exception()));
      return;
    }
    work.finish(std::move(outs));
  }

  // Remembers pending work (for shutdown) and arms the per-call deadline, if the call has one.
  void track(const std::shared_ptr<Work>& work, const char* op, std::chrono::milliseconds t) {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto& p = state_->pending;
    if (p.size() >= 64) {
      p.erase(std::remove_if(p.begin(), p.end(),
                             [](const std::weak_ptr<Work>& w) {
                               auto s = w.lock();
                               return !s || s->is_completed();
                             }),
              p.end());
    }
    p.push_back(work);
    if (t == kUnsetTimeout) return;
    state_->deadlines.emplace(
        Clock::now() + t,
        std::make_pair(std::weak_ptr<Work>(work),
                       "GlooBackend: Timeout: " + std::string(op) + " (sequence number " +
                           std::to_string(work->sequence_number()) + ") timed out after " +
                           std::to_string(t.count()) + " ms"));
    if (!state_->watchdog.joinable()) {
      state_->watchdog = std::thread([state = state_] { watch(*state); });
    }
    state_->cv.notify_all();
  }

  // Fails work whose per-call deadline passed; the failures happen with no lock held.
  static void watch(State& s) {
    std::unique_lock<std::mutex> lock(s.mu);
    while (!s.stopped.load()) {
      if (s.deadlines.empty()) {
        s.cv.wait(lock);
        continue;
      }
      const auto next = s.deadlines.begin()->first;
      if (Clock::now() < next) {
        s.cv.wait_until(lock, next);
        continue;
      }
      std::vector<std::pair<std::weak_ptr<Work>, std::string>> due;
      while (!s.deadlines.empty() && s.deadlines.begin()->first <= Clock::now()) {
        due.push_back(std::move(s.deadlines.begin()->second));
        s.deadlines.erase(s.deadlines.begin());
      }
      lock.unlock();
      for (auto& [w, text] : due) {
        if (auto work = w.lock())
          work->finish_error(std::make_exception_ptr(DistBackendError(text)));
      }
      lock.lock();
    }
  }

  std::shared_ptr<State> state_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

// Registers "gloo" (for "cpu") with register_backend, once per process; afterwards
// is_backend_available("gloo") is true and backend_creator("gloo") makes a GlooBackend.
inline void register_gloo_backend() {
  register_backend_class_once<GlooBackend>("gloo", {"cpu"});
}

}  // namespace distrpc::dist

#endif  // USE_C10D_GLOO
