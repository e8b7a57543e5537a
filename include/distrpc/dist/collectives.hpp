// The collectives and point-to-point calls of <distrpc/dist.hpp>, with PyTorch's names: single
// tensors, global ranks for src/dst, an options struct; they run on the default group unless
// the options name another.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/detail/world.hpp>
#include <distrpc/dist/process_group.hpp>
#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>

namespace distrpc::dist {

// Every member of these options has a default initializer, so a designated initializer may leave
// any out (GCC's -Wmissing-field-initializers warns for members without one).

// all_reduce, all_reduce_coalesced, reduce, reduce_scatter, reduce_scatter_tensor.
struct ReduceCollectiveOptions {
  ReduceOp op{};
  std::shared_ptr<ProcessGroup> group{};  // null: the default group
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;  // unset: the group's
};
// broadcast, all_gather, all_gather_into_tensor, all_to_all, barrier.
struct CollectiveOptions {
  std::shared_ptr<ProcessGroup> group{};
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct GatherCollectiveOptions {
  int dst = 0;  // global rank
  std::shared_ptr<ProcessGroup> group{};
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct ScatterCollectiveOptions {
  int src = 0;  // global rank
  std::shared_ptr<ProcessGroup> group{};
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct AllToAllSingleOptions {
  std::vector<std::int64_t> output_split_sizes{};  // empty: equal slices
  std::vector<std::int64_t> input_split_sizes{};
  std::shared_ptr<ProcessGroup> group{};
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
// send, recv, isend, irecv.
struct PointToPointOptions {
  std::shared_ptr<ProcessGroup> group{};
  int tag = 0;
};

// ---- Collectives. Ranks (src, dst) are global ranks.

inline std::shared_ptr<Work> all_reduce(at::Tensor& tensor,
                                        const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_reduce");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  return detail::finish(g->allreduce(ts, {opts.op, opts.timeout}), opts.async_op, "all_reduce");
}

inline std::shared_ptr<Work> all_reduce_coalesced(std::vector<at::Tensor>& tensors,
                                                  const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_reduce_coalesced");
  if (!g) return nullptr;
  return detail::finish(g->allreduce_coalesced(tensors, {opts.op, opts.timeout}), opts.async_op,
                        "all_reduce_coalesced");
}

inline std::shared_ptr<Work> broadcast(at::Tensor& tensor, int src,
                                       const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "broadcast");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  BroadcastOptions o;
  o.root_rank = detail::group_rank_of(*g, src, "broadcast", "src:");
  o.timeout = opts.timeout;
  return detail::finish(g->broadcast(ts, o), opts.async_op, "broadcast");
}

inline std::shared_ptr<Work> reduce(at::Tensor& tensor, int dst,
                                    const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "reduce");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  ReduceOptions o;
  o.op = opts.op;
  o.root_rank = detail::group_rank_of(*g, dst, "reduce", "dst:");
  o.timeout = opts.timeout;
  return detail::finish(g->reduce(ts, o), opts.async_op, "reduce");
}

// tensor_list must hold one tensor per member of the group; tensor_list[r] receives member r's.
inline std::shared_ptr<Work> all_gather(std::vector<at::Tensor>& tensor_list,
                                        const at::Tensor& tensor,
                                        const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_gather");
  if (!g) return nullptr;
  std::vector<std::vector<at::Tensor>> out{tensor_list};  // handles: the user's tensors
  std::vector<at::Tensor> in{tensor};
  return detail::finish(g->allgather(out, in, {opts.timeout}), opts.async_op, "all_gather");
}

inline std::shared_ptr<Work> all_gather_into_tensor(at::Tensor& output, const at::Tensor& input,
                                                    const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_gather_into_tensor");
  if (!g) return nullptr;
  at::Tensor in = input;
  return detail::finish(g->allgather_into_tensor(output, in, {opts.timeout}), opts.async_op,
                        "all_gather_into_tensor");
}

// On dst, gather_list holds one tensor per member; elsewhere it must be empty.
inline std::shared_ptr<Work> gather(const at::Tensor& tensor, std::vector<at::Tensor> gather_list,
                                    const GatherCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "gather");
  if (!g) return nullptr;
  GatherOptions o;
  o.root_rank = detail::group_rank_of(*g, opts.dst, "gather", "dst:");
  o.timeout = opts.timeout;
  detail::check_same_dtype(tensor, gather_list);
  std::vector<std::vector<at::Tensor>> out;
  if (g->rank() == o.root_rank || !gather_list.empty()) out.push_back(std::move(gather_list));
  std::vector<at::Tensor> in{tensor};
  return detail::finish(g->gather(out, in, o), opts.async_op, "gather");
}

// On src, scatter_list holds one tensor per member; elsewhere it must be empty.
inline std::shared_ptr<Work> scatter(at::Tensor& tensor, std::vector<at::Tensor> scatter_list,
                                     const ScatterCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "scatter");
  if (!g) return nullptr;
  ScatterOptions o;
  o.root_rank = detail::group_rank_of(*g, opts.src, "scatter", "src:");
  o.timeout = opts.timeout;
  detail::check_same_dtype(tensor, scatter_list);
  std::vector<std::vector<at::Tensor>> in;
  if (g->rank() == o.root_rank || !scatter_list.empty()) in.push_back(std::move(scatter_list));
  std::vector<at::Tensor> out{tensor};
  return detail::finish(g->scatter(out, in, o), opts.async_op, "scatter");
}

// output receives the reduction of every member's input_list[my group rank].
inline std::shared_ptr<Work> reduce_scatter(at::Tensor& output,
                                            const std::vector<at::Tensor>& input_list,
                                            const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "reduce_scatter");
  if (!g) return nullptr;
  std::vector<at::Tensor> out{output};
  std::vector<std::vector<at::Tensor>> in{input_list};
  return detail::finish(g->reduce_scatter(out, in, {opts.op, opts.timeout}), opts.async_op,
                        "reduce_scatter");
}

inline std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input,
                                                   const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "reduce_scatter_tensor");
  if (!g) return nullptr;
  at::Tensor in = input;
  return detail::finish(g->reduce_scatter_tensor(output, in, {opts.op, opts.timeout}),
                        opts.async_op, "reduce_scatter_tensor");
}

// input_list[i] goes to member i; output_list[j] comes from member j.
inline std::shared_ptr<Work> all_to_all(std::vector<at::Tensor>& output_list,
                                        const std::vector<at::Tensor>& input_list,
                                        const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_to_all");
  if (!g) return nullptr;
  std::vector<at::Tensor> in(input_list);
  return detail::finish(g->alltoall(output_list, in, {opts.timeout}), opts.async_op, "all_to_all");
}

inline std::shared_ptr<Work> all_to_all_single(at::Tensor& output, const at::Tensor& input,
                                               const AllToAllSingleOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_to_all_single");
  if (!g) return nullptr;
  at::Tensor in = input;
  return detail::finish(
      g->alltoall_base(output, in, opts.output_split_sizes, opts.input_split_sizes, {opts.timeout}),
      opts.async_op, "all_to_all_single");
}

inline std::shared_ptr<Work> barrier(const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "barrier");
  if (!g) return nullptr;
  return detail::finish(g->barrier({opts.timeout}), opts.async_op, "barrier");
}

// ---- Point to point. dst/src are global ranks.

inline std::shared_ptr<Work> isend(at::Tensor& tensor, int dst,
                                   const PointToPointOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "isend");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  return detail::finish(g->send(ts, detail::group_rank_of(*g, dst, "send", "dst:"), opts.tag), true,
                        "isend");
}

inline std::shared_ptr<Work> send(at::Tensor& tensor, int dst,
                                  const PointToPointOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "send");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  return detail::finish(g->send(ts, detail::group_rank_of(*g, dst, "send", "dst:"), opts.tag),
                        false, "send");
}

// src: a global rank, or nullopt / -1 for whichever member sends first (Work::source_rank()
// then gives its group rank).
inline std::shared_ptr<Work> irecv(at::Tensor& tensor, std::optional<int> src = std::nullopt,
                                   const PointToPointOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "irecv");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  if (!src || *src == -1) {
    return detail::finish(g->recv_anysource(ts, opts.tag), true, "irecv");
  }
  return detail::finish(g->recv(ts, detail::group_rank_of(*g, *src, "recv", "src:"), opts.tag),
                        true, "irecv");
}

// Blocks until tensor is received; returns the sender's global rank (-1 where this process is
// not a member of the group, as PyTorch returns).
inline int recv(at::Tensor& tensor, std::optional<int> src = std::nullopt,
                const PointToPointOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "recv");
  if (!g) return -1;
  std::vector<at::Tensor> ts{tensor};
  if (!src || *src == -1) {
    auto w = detail::finish(g->recv_anysource(ts, opts.tag), false, "recv");
    return g->global_rank(w->source_rank());
  }
  detail::finish(g->recv(ts, detail::group_rank_of(*g, *src, "recv", "src:"), opts.tag), false,
                 "recv");
  return *src;
}

}  // namespace distrpc::dist
