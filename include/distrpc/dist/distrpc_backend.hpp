// DistrpcBackend<T>: the "distrpc" collective backend, a Backend over one of the project's
// transport policies (Tcp, Shm, Auto<Shm, Tcp>): c10d's CPU collectives without gloo.
//
// Meeting: the constructor opens its own transport Context, publishes its address in the store it
// is given (the caller prefixes that store per group, so groups never see each other's keys), waits
// for every member's, adds each as a peer and exchanges a hello with each. After that every pair of
// members has a connection both ways, so a member that dies is seen by all (its connections hang
// up) even by members that would not otherwise talk to it in a given collective.
//
// Messages are the transport's control kinds (wire::control_message_type): a small header encoded
// with the wire codec in the payload (kind, collective number, step, chunk, tag, byte counts) and
// the tensor bytes as Message::buffers, a byte view over the caller's contiguous tensor (no copy
// on send; the transports copy out before send() returns, so the tensor may change afterwards).
//
// Threads: the transport's I/O threads only file a message into a mailbox (keyed by source,
// collective number, step and chunk; point-to-point messages in a queue per arrival) and wake the
// waiter: no reduction and no user code runs on them. One executor thread runs the collectives
// one at a time in call order, which is what makes every member's n-th collective meet the
// others' n-th. Point-to-point calls run on a second thread, so a recv waiting for its sender never
// holds up the collectives (and the reverse). Works complete on those threads with no lock held.
//
// Failure: a collective needs every member, so a lost peer (its connection broke) fails the
// collective in progress and every later one, naming the peer. A member that shuts its backend
// down first tells the others the last collective it completed (Goodbye, after all its messages
// on the same connection): its leaving then fails only the later collectives, at once, and a
// member still finishing an earlier one (a barrier's slowest member) is not failed by it. A
// collective that does not complete within its timeout fails with "Timeout", naming the operation,
// its sequence number and the ranks this member had heard nothing from. After either (or any other
// failure inside a collective: a size mismatch, a DETAIL fingerprint mismatch), the members'
// message streams no longer line up, so every later collective fails at once with a text saying
// why, instead of pairing the wrong messages; PyTorch aborts the group in the same situation.
// Point-to-point calls keep working with peers that are still there.
#pragma once

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <distrpc/bounded_thread.hpp>
#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/error.hpp>
#include <distrpc/future.hpp>
#include <distrpc/log.hpp>
#include <distrpc/store/store.hpp>
#include <distrpc/tls_options.hpp>
#include <distrpc/transport/transport.hpp>
#include <distrpc/wire/archive.hpp>
#include <distrpc/wire/message.hpp>

namespace distrpc::dist {

// Where the backend listens and how it splits tensors. Empty hosts are read from
// DISTRPC_LISTEN_ADDR / DISTRPC_ADVERTISE_ADDR (the RPC agent's variables), else loopback: exposing
// a port to the network is a choice, as for the agent.
struct DistrpcBackendOptions {
  std::string listen_host;
  std::string advertise_host;  // empty: the address listened on
  std::string auth_token;      // optional shared secret (docs/security.md), never sent
  TlsOptions tls;              // mutual TLS for Tcp (empty: DISTRPC_TLS_* or plain)
  // Tensors of at most this many bytes are reduced by a direct exchange (every member sends its
  // tensor to every other: one message latency); larger ones by a ring (bandwidth-optimal).
  std::int64_t small_bytes = 64 * 1024;
  // Large transfers travel in chunks of at most this many bytes, so reducing one chunk overlaps
  // with the transfer of the next and no message grows with the tensor (rounded up to 64 bytes).
  std::int64_t chunk_bytes = 2 * 1024 * 1024;
  // Spinning before sleeping, for machines with cores to spare: the executor looks for the next
  // collective, the thread in Work::wait() polls its Work, and the executor reads the transport
  // itself where the policy can (Transport's drive()), each for up to this long, so a small
  // collective needs no thread wake-up. Off by default: on 2 shared vCPUs the spinning threads
  // took the CPU from the ones doing the work (a 4-float all-reduce at world 2 on Shm took
  // 2 to 5 times longer with 50 us than without).
  std::chrono::microseconds wait_spin{0};
};

namespace detail {

// The control kinds this backend uses on its own transport (no agent shares it). Goodbye: sent by
// a member's shutdown(), with the number of the last collective it completed in `coll`.
enum class DistrpcKind : std::uint8_t { Hello = 0, Collective = 1, P2P = 2, Goodbye = 3 };

// The header of every message, in the payload. coll: the collective's number (1, 2, ...; 0 for
// hello and point-to-point); region_bytes: the size of the whole region the chunk belongs to, so a
// member that passes a tensor of another size is caught on the first message, before any bytes
// land anywhere.
struct DistrpcHeader {
  std::uint8_t kind = 0;
  std::uint64_t coll = 0;
  std::uint32_t step = 0;
  std::uint32_t chunk = 0;
  std::int64_t tag = 0;
  std::uint64_t region_bytes = 0;
  std::string text;  // a DETAIL fingerprint; empty otherwise

  template <class Archive>
  void serialize(Archive& ar) {
    ar(kind, coll, step, chunk, tag, region_bytes, text);
  }
};

// The reserved step of the DETAIL fingerprint exchange.
inline constexpr std::uint32_t kFingerprintStep = 0xFFFFFFFFu;
// The reserved step of the acknowledgements that pace a broadcast (see send_paced).
inline constexpr std::uint32_t kAckStep = 0xFFFFFFFEu;

// A 1-D byte view over a contiguous tensor's elements (shares its storage).
inline at::Tensor byte_view(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

// Received bytes as a 1-D tensor of `dtype`. A buffer at an offset that is not a multiple of the
// element size (possible for small buffers copied through a ring) is copied first: ATen refuses
// such a view.
inline at::Tensor typed_view(at::Tensor bytes, at::ScalarType dtype) {
  const auto esize = static_cast<std::int64_t>(c10::elementSize(dtype));
  if (esize > 1 && (bytes.storage_offset() % esize != 0 ||
                    reinterpret_cast<std::uintptr_t>(bytes.data_ptr()) % esize != 0)) {
    bytes = bytes.clone();
  }
  return bytes.view(dtype);
}

inline std::string shape_text(const at::Tensor& t) {
  return c10::str(t.sizes());
}

// TORCH_DISTRIBUTED_DEBUG=DETAIL (case-insensitive), read once per backend.
inline bool debug_detail() {
  const char* v = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  if (v == nullptr) return false;
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s == "DETAIL";
}

inline std::string env_or(const std::string& value, const char* var, const std::string& fallback) {
  if (!value.empty()) return value;
  if (const char* v = std::getenv(var); v != nullptr && *v != '\0') return v;
  return fallback;
}

// Polls a Work's future from the thread that waits on it for a short while before that thread
// sleeps (Future's WaitDriver hook): a small collective then completes without waking its caller.
class SpinWaitDriver final : public distrpc::detail::WaitDriver {
 public:
  explicit SpinWaitDriver(std::chrono::microseconds budget) : budget_(budget) {}
  void drive_wait(const std::function<bool()>& done,
                  std::chrono::steady_clock::time_point until) override {
    const auto end = std::min(until, std::chrono::steady_clock::now() + budget_);
    while (!done() && std::chrono::steady_clock::now() < end) std::this_thread::yield();
  }

 private:
  const std::chrono::microseconds budget_;
};

}  // namespace detail

template <transport::Transport T>
class DistrpcBackend final : public Backend {
  using Clock = std::chrono::steady_clock;
  using Header = detail::DistrpcHeader;
  // How long a wait goes on after a peer's connection broke before it fails. A member has two
  // connections with each peer (one each way), read by different I/O threads: the break of one can
  // be reported before the last messages on the other are read (a peer that finished and shut down
  // sent them before closing). Waiting this long lets them land first, and lets the peer lost first
  // be the one named when a loss makes others leave too.
  static constexpr std::chrono::milliseconds kLossGrace{250};
  // How long shutdown() waits for its goodbyes to be sent (see say_goodbye).
  static constexpr std::chrono::milliseconds kGoodbyeWait{1000};

 public:
  // Meets the other members through `store` (see the top of this file); throws DistBackendError
  // when they do not all arrive within `timeout`, naming the missing ranks.
  DistrpcBackend(std::shared_ptr<store::Store> store, int rank, int size,
                 std::chrono::milliseconds timeout, DistrpcBackendOptions options = {})
      : Backend(rank, size, timeout),
        store_(std::move(store)),
        options_(std::move(options)),
        detail_(detail::debug_detail()) {
    if (!store_) throw std::invalid_argument("DistrpcBackend: the store is null");
    if (options_.small_bytes < 0) {
      throw std::invalid_argument("DistrpcBackend: small_bytes must not be negative, got " +
                                  std::to_string(options_.small_bytes));
    }
    if (options_.wait_spin.count() < 0) {
      throw std::invalid_argument("DistrpcBackend: wait_spin must not be negative, got " +
                                  std::to_string(options_.wait_spin.count()) + " us");
    }
    if (options_.chunk_bytes <= 0) {
      throw std::invalid_argument("DistrpcBackend: chunk_bytes must be positive, got " +
                                  std::to_string(options_.chunk_bytes));
    }
    // Chunk boundaries must fall between elements of every dtype (16 bytes at most).
    options_.chunk_bytes = (options_.chunk_bytes + 63) / 64 * 64;
    lost_.assign(static_cast<std::size_t>(size), std::string());
    lost_at_.assign(static_cast<std::size_t>(size), Clock::time_point{});
    left_after_.assign(static_cast<std::size_t>(size), -1);
    transport::TransportOptions to;
    to.self_id = rank;
    to.self_name = "rank" + std::to_string(rank);
    to.listen_host = detail::env_or(options_.listen_host, "DISTRPC_LISTEN_ADDR", "127.0.0.1");
    to.advertise_host = detail::env_or(options_.advertise_host, "DISTRPC_ADVERTISE_ADDR", "");
    to.auth_token = options_.auth_token;
    to.tls = options_.tls;
    to.connect_timeout = timeout;
    // Peers are added only after they published their address, which they do once listening: a
    // refused connection then means the peer is gone, so a send fails at once (as in the agent).
    to.refused_retry = std::chrono::milliseconds(100);
    transport::TransportCallbacks cb;
    cb.on_message = [this](int peer, wire::Message&& m) { on_message(peer, std::move(m)); };
    cb.on_peer_lost = [this](int peer, const std::string& why) { on_peer_lost(peer, why); };
    if (options_.wait_spin.count() > 0) {
      spin_driver_ = std::make_shared<detail::SpinWaitDriver>(options_.wait_spin);
    }
    ctx_ = std::make_unique<typename T::Context>(to, std::move(cb));
    try {
      meet();
    } catch (...) {
      ctx_->shutdown();
      throw;
    }
    executor_ = std::thread([this, gone = left_] { executor_loop(*gone); });
    p2p_thread_ = std::thread([this, gone = left_] { p2p_loop(*gone); });
  }

  ~DistrpcBackend() override {
    try {
      shutdown();
    } catch (...) {
      // A destructor must not throw; shutdown() only fails works and joins threads.
    }
  }

  std::string name() const override { return "distrpc"; }
  const DistrpcBackendOptions& options() const noexcept { return options_; }

  // ---- collectives ------------------------------------------------------------------------

  std::shared_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                  const AllreduceOptions& opts = {}) override {
    at::Tensor t = check_single_tensor("allreduce", tensors);
    check_reduce_dtype(opts.op, t.scalar_type());
    ReduceOp op = opts.op;
    return enqueue("allreduce", opts.timeout, fingerprint("ALLREDUCE", {t}, op.describe()),
                   [this, t, op](Op& o) {
                     in_place(t, [&](at::Tensor& flat) { allreduce_flat(o, flat, op); });
                     return std::vector<at::Tensor>{t};
                   });
  }

  std::shared_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                            const AllreduceCoalescedOptions& opts = {}) override {
    if (tensors.empty()) {
      throw std::invalid_argument("allreduce_coalesced: the tensor list is empty");
    }
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      check_cpu_tensor("allreduce_coalesced", tensors[i], i);
      check_same_dtype(tensors.front(), tensors[i]);
    }
    check_reduce_dtype(opts.op, tensors.front().scalar_type());
    std::vector<at::Tensor> ts = tensors;
    ReduceOp op = opts.op;
    return enqueue("allreduce_coalesced", opts.timeout,
                   fingerprint("ALLREDUCE_COALESCED", ts, op.describe()), [this, ts, op](Op& o) {
                     // One buffer, one exchange: the reason for the coalesced form.
                     std::vector<at::Tensor> flats;
                     for (const at::Tensor& t : ts) flats.push_back(t.reshape({-1}));
                     at::Tensor flat = at::cat(flats);
                     allreduce_flat(o, flat, op);
                     std::int64_t off = 0;
                     for (const at::Tensor& t : ts) {
                       t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
                       off += t.numel();
                     }
                     return ts;
                   });
  }

  std::shared_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                  const BroadcastOptions& opts = {}) override {
    at::Tensor t = check_single_tensor("broadcast", tensors);
    check_root("broadcast", opts.root_rank);
    check_root_tensor("broadcast", opts.root_tensor);
    const int root = opts.root_rank;
    return enqueue("broadcast", opts.timeout,
                   fingerprint("BROADCAST", {t}, "root=" + std::to_string(root)),
                   [this, t, root](Op& o) {
                     in_place(t, [&](at::Tensor& flat) { broadcast_flat(o, flat, root); });
                     return std::vector<at::Tensor>{t};
                   });
  }

  std::shared_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                               const ReduceOptions& opts = {}) override {
    at::Tensor t = check_single_tensor("reduce", tensors);
    check_root("reduce", opts.root_rank);
    check_root_tensor("reduce", opts.root_tensor);
    check_reduce_dtype(opts.op, t.scalar_type());
    const int root = opts.root_rank;
    ReduceOp op = opts.op;
    return enqueue("reduce", opts.timeout,
                   fingerprint("REDUCE", {t}, op.describe() + " root=" + std::to_string(root)),
                   [this, t, root, op](Op& o) {
                     const at::Tensor flat = t.contiguous().reshape({-1});
                     if (rank() != root) {
                       send_region(o, root, 0, detail::byte_view(flat));
                       return std::vector<at::Tensor>{t};
                     }
                     std::vector<at::Tensor> parts(static_cast<std::size_t>(size()));
                     for (int q = 0; q < size(); ++q) {
                       parts[static_cast<std::size_t>(q)] =
                           q == rank() ? flat : recv_new(o, q, 0, flat);
                     }
                     t.copy_(reduce_in_rank_order(parts, op).view(t.sizes()));
                     return std::vector<at::Tensor>{t};
                   });
  }

  std::shared_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const AllgatherOptions& opts = {}) override {
    at::Tensor in = check_single_tensor("allgather", inputs);
    check_one_list("allgather", outputs.size(), "output");
    std::vector<at::Tensor> outs = outputs[0];
    check_tensor_list("allgather", outs, in, "output");
    for (const at::Tensor& o : outs) check_same_numel(in, o, "allgather", "an output tensor");
    return enqueue("allgather", opts.timeout, fingerprint("ALLGATHER", {in}, ""),
                   [this, in, outs](Op& o) {
                     gather_all(o, in.contiguous().reshape({-1}), outs);
                     return outs;
                   });
  }

  std::shared_ptr<Work> allgather_into_tensor(at::Tensor& output, at::Tensor& input,
                                              const AllgatherOptions& opts = {}) override {
    check_cpu_tensor("allgather_into_tensor", input);
    check_cpu_tensor("allgather_into_tensor", output, 0, "output");
    check_same_dtype(input, output);
    if (output.numel() != input.numel() * size()) {
      throw std::invalid_argument(
          "allgather_into_tensor: the output must hold size() * input.numel() = " +
          std::to_string(input.numel() * size()) + " elements, got " +
          std::to_string(output.numel()));
    }
    at::Tensor in = input;
    at::Tensor out = output;
    return enqueue("allgather_into_tensor", opts.timeout,
                   fingerprint("ALLGATHER_INTO_TENSOR", {in}, ""), [this, in, out](Op& o) {
                     in_place(out, [&](at::Tensor& flat) {
                       std::vector<at::Tensor> slots;
                       for (int q = 0; q < size(); ++q) {
                         slots.push_back(flat.narrow(0, q * in.numel(), in.numel()));
                       }
                       gather_all(o, in.contiguous().reshape({-1}), slots);
                     });
                     return std::vector<at::Tensor>{out};
                   });
  }

  std::shared_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                               std::vector<at::Tensor>& inputs,
                               const GatherOptions& opts = {}) override {
    at::Tensor in = check_single_tensor("gather", inputs);
    check_root("gather", opts.root_rank);
    const int root = opts.root_rank;
    check_root_lists("gather", outputs, root, "output");
    std::vector<at::Tensor> outs;
    if (rank() == root) {
      outs = outputs[0];
      check_tensor_list("gather", outs, in, "output");
      for (const at::Tensor& o : outs) check_same_numel(in, o, "gather", "an output tensor");
    }
    return enqueue("gather", opts.timeout,
                   fingerprint("GATHER", {in}, "root=" + std::to_string(root)),
                   [this, in, outs, root](Op& o) {
                     const at::Tensor flat = in.contiguous().reshape({-1});
                     if (rank() != root) {
                       send_region(o, root, 0, detail::byte_view(flat));
                       return std::vector<at::Tensor>{};
                     }
                     for (int q = 0; q < size(); ++q) {
                       const at::Tensor& dst = outs[static_cast<std::size_t>(q)];
                       if (q == rank()) {
                         dst.copy_(flat.view(dst.sizes()));
                       } else {
                         recv_into(o, q, 0, dst);
                       }
                     }
                     return outs;
                   });
  }

  std::shared_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                std::vector<std::vector<at::Tensor>>& inputs,
                                const ScatterOptions& opts = {}) override {
    at::Tensor out = check_single_tensor("scatter", outputs, "output");
    check_root("scatter", opts.root_rank);
    const int root = opts.root_rank;
    check_root_lists("scatter", inputs, root, "input");
    std::vector<at::Tensor> ins;
    if (rank() == root) {
      ins = inputs[0];
      check_tensor_list("scatter", ins, out, "input");
      for (const at::Tensor& i : ins) check_same_numel(out, i, "scatter", "an input tensor");
    }
    return enqueue(
        "scatter", opts.timeout, fingerprint("SCATTER", {out}, "root=" + std::to_string(root)),
        [this, out, ins, root](Op& o) {
          if (rank() == root) {
            for (int q = 0; q < size(); ++q) {
              const at::Tensor src = ins[static_cast<std::size_t>(q)].contiguous().reshape({-1});
              if (q == rank()) {
                out.copy_(src.view(out.sizes()));
              } else {
                send_region(o, q, 0, detail::byte_view(src));
              }
            }
          } else {
            recv_into(o, root, 0, out);
          }
          return std::vector<at::Tensor>{out};
        });
  }

  std::shared_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                       std::vector<std::vector<at::Tensor>>& inputs,
                                       const ReduceScatterOptions& opts = {}) override {
    at::Tensor out = check_single_tensor("reduce_scatter", outputs, "output");
    check_one_list("reduce_scatter", inputs.size(), "input");
    std::vector<at::Tensor> ins = inputs[0];
    check_tensor_list("reduce_scatter", ins, out, "input");
    for (const at::Tensor& i : ins) check_same_numel(out, i, "reduce_scatter", "an input tensor");
    check_reduce_dtype(opts.op, out.scalar_type());
    ReduceOp op = opts.op;
    return enqueue("reduce_scatter", opts.timeout,
                   fingerprint("REDUCE_SCATTER", {out}, op.describe()),
                   [this, out, ins, op](Op& o) {
                     std::vector<at::Tensor> flats;
                     for (const at::Tensor& i : ins) flats.push_back(i.contiguous().reshape({-1}));
                     out.copy_(reduce_scatter_flat(o, flats, op).view(out.sizes()));
                     return std::vector<at::Tensor>{out};
                   });
  }

  std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor& output, at::Tensor& input,
                                              const ReduceScatterOptions& opts = {}) override {
    check_cpu_tensor("reduce_scatter_tensor", input);
    check_cpu_tensor("reduce_scatter_tensor", output, 0, "output");
    check_same_dtype(output, input);
    if (input.numel() != output.numel() * size()) {
      throw std::invalid_argument(
          "reduce_scatter_tensor: the input must hold size() * output.numel() = " +
          std::to_string(output.numel() * size()) + " elements, got " +
          std::to_string(input.numel()));
    }
    check_reduce_dtype(opts.op, output.scalar_type());
    at::Tensor in = input;
    at::Tensor out = output;
    ReduceOp op = opts.op;
    return enqueue("reduce_scatter_tensor", opts.timeout,
                   fingerprint("REDUCE_SCATTER_TENSOR", {in}, op.describe()),
                   [this, in, out, op](Op& o) {
                     const at::Tensor flat = in.contiguous().reshape({-1});
                     std::vector<at::Tensor> flats;
                     for (int q = 0; q < size(); ++q) {
                       flats.push_back(flat.narrow(0, q * out.numel(), out.numel()));
                     }
                     out.copy_(reduce_scatter_flat(o, flats, op).view(out.sizes()));
                     return std::vector<at::Tensor>{out};
                   });
  }

  std::shared_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                      std::vector<std::int64_t> output_split_sizes,
                                      std::vector<std::int64_t> input_split_sizes,
                                      const AllToAllOptions& opts = {}) override {
    check_cpu_tensor("alltoall_base", input);
    check_cpu_tensor("alltoall_base", output, 0, "output");
    check_same_dtype(output, input);
    const auto in_rows = split_rows("alltoall_base", "input", input, input_split_sizes);
    const auto out_rows = split_rows("alltoall_base", "output", output, output_split_sizes);
    at::Tensor in = input;
    at::Tensor out = output;
    return enqueue("alltoall_base", opts.timeout, fingerprint("ALLTOALL_BASE", {in}, ""),
                   [this, in, out, in_rows, out_rows](Op& o) {
                     const at::Tensor src = in.contiguous();
                     at::Tensor dst = out.is_contiguous() ? out : out.contiguous();
                     std::vector<at::Tensor> sends;
                     std::vector<at::Tensor> recvs;
                     std::int64_t ioff = 0;
                     std::int64_t ooff = 0;
                     for (int q = 0; q < size(); ++q) {
                       const auto qi = static_cast<std::size_t>(q);
                       sends.push_back(src.narrow(0, ioff, in_rows[qi]).reshape({-1}));
                       recvs.push_back(dst.narrow(0, ooff, out_rows[qi]));
                       ioff += in_rows[qi];
                       ooff += out_rows[qi];
                     }
                     exchange_all(o, sends, recvs);
                     if (!dst.is_same(out)) out.copy_(dst);
                     return std::vector<at::Tensor>{out};
                   });
  }

  std::shared_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                 const AllToAllOptions& opts = {}) override {
    // An empty list fails the count check before its first element is read.
    check_tensor_list("alltoall", inputs, inputs.empty() ? at::Tensor() : inputs.front(), "input");
    check_tensor_list("alltoall", outputs, inputs.front(), "output");
    std::vector<at::Tensor> ins = inputs;
    std::vector<at::Tensor> outs = outputs;
    return enqueue("alltoall", opts.timeout, fingerprint("ALLTOALL", ins, ""),
                   [this, ins, outs](Op& o) {
                     std::vector<at::Tensor> sends;
                     for (const at::Tensor& t : ins) sends.push_back(t.contiguous().reshape({-1}));
                     exchange_all(o, sends, outs);
                     return outs;
                   });
  }

  std::shared_ptr<Work> barrier(const BarrierOptions& opts = {}) override {
    return enqueue("barrier", opts.timeout, fingerprint("BARRIER", {}, ""), [this](Op& o) {
      for (int k = 1; k < size(); ++k) {
        send_region(o, (rank() + k) % size(), 0, at::Tensor());
      }
      for (int k = 1; k < size(); ++k) {
        const int q = (rank() - k + size()) % size();
        (void)take_checked(o, q, 0, 0, 0, 0);
      }
      return std::vector<at::Tensor>{};
    });
  }

  // ---- point to point ---------------------------------------------------------------------

  std::shared_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override {
    at::Tensor t = check_single_tensor("send", tensors);
    check_peer("send", "destination", dst_rank);
    check_tag(tag, "send");
    // Copied now if not contiguous, so the thread that sends owns bytes in the right order. No
    // sequence number (-1): members send and receive different counts, and the group's number
    // must stay equal on every member (PyTorch's rule).
    auto work = std::make_shared<Work>("send", -1);
    work->set_completing_thread(p2p_thread_.get_id());
    P2PSend s{work, t.contiguous(), dst_rank, tag};
    {
      std::lock_guard<std::mutex> lk(p2p_mu_);
      if (stopping_) throw DistBackendError("DistrpcBackend: send after shutdown()");
      p2p_sends_.push_back(std::move(s));
    }
    p2p_cv_.notify_all();
    return work;
  }

  std::shared_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override {
    at::Tensor t = check_single_tensor("recv", tensors);
    check_peer("recv", "source", src_rank);
    check_tag(tag, "recv");
    return post_recv(t, src_rank, tag, "recv");
  }

  std::shared_ptr<Work> recv_anysource(std::vector<at::Tensor>& tensors, int tag) override {
    at::Tensor t = check_single_tensor("recv_anysource", tensors);
    check_tag(tag, "recv_anysource");
    return post_recv(t, -1, tag, "recv_anysource");
  }

  // Messages received and held for a collective or a receive not yet posted here (diagnostics: a
  // count that only grows means the members' calls no longer line up).
  std::size_t held_messages() {
    std::scoped_lock lk(mu_, p2p_mu_);
    return box_.size() + p2p_box_.size();
  }

  // Fails what is pending ("shut down"), joins the threads, closes the transport. Idempotent.
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lk(shutdown_mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    // Called from a Work callback on one of the backend's threads, that thread leaves its loop
    // without touching the backend again, so what is queued for it fails here, at the end. Every
    // other loop fails its own queue when it sees stopping_, before it is joined (a callback
    // there waiting on queued work then ends before the join waits for it).
    const auto me = std::this_thread::get_id();
    const bool from_executor = executor_.get_id() == me;
    const bool from_p2p = p2p_thread_.get_id() == me;
    std::deque<Task> tasks;
    std::deque<P2PRecv> recvs;
    std::deque<P2PSend> sends;
    {
      std::lock_guard<std::mutex> a(mu_);
      std::lock_guard<std::mutex> b(p2p_mu_);
      stopping_ = true;
      stopping_flag_.store(true, std::memory_order_release);
      if (from_executor) {
        tasks.swap(tasks_);
        queued_.fetch_sub(static_cast<std::int64_t>(tasks.size()), std::memory_order_acq_rel);
      }
      if (from_p2p) {
        recvs.swap(p2p_recvs_);
        sends.swap(p2p_sends_);
      }
    }
    std::thread watchdog;
    {
      std::lock_guard<std::mutex> lk(watch_mu_);
      watch_stop_ = true;
      watchdog.swap(watchdog_);
    }
    watch_cv_.notify_all();
    cv_.notify_all();
    p2p_cv_.notify_all();
    // The watchdog completes Works (user callbacks may run on it): detached if this is it.
    if (watchdog.joinable() && watchdog.get_id() == std::this_thread::get_id()) {
      left_->store(std::this_thread::get_id(), std::memory_order_release);
    }
    join_or_detach(watchdog);
    say_goodbye();
    // The transport first: a thread blocked in send() (back-pressure) returns with an error.
    ctx_->shutdown();
    // A Work callback that shuts the backend down runs on one of these threads: it cannot join
    // itself, so that one is detached and returns to its loop, which sees stopping_ and exits.
    for (std::thread* t : {&executor_, &p2p_thread_}) {
      if (t->joinable() && t->get_id() == std::this_thread::get_id()) {
        left_->store(std::this_thread::get_id(), std::memory_order_release);
      }
      join_or_detach(*t);
    }
    // Last, touching no member: a callback may drop the last reference to this backend.
    for (Task& t : tasks) {
      t.work->finish_error(std::make_exception_ptr(DistBackendError(
          "DistrpcBackend: " + t.op.what() + " was not run: the backend was shut down")));
    }
    for (P2PRecv& r : recvs) r.work->finish_error(shut_down_error(r));
    for (P2PSend& x : sends) x.work->finish_error(shut_down_error(x));
  }

 private:
  using LeftThread = std::atomic<std::thread::id>;
  static bool has_left(const LeftThread& gone) {
    return gone.load(std::memory_order_acquire) == std::this_thread::get_id();
  }

  // One collective as it runs: what errors name and when it must be done.
  struct Op {
    const char* name;
    std::uint64_t coll;  // the collective's number, shared by all members
    std::int64_t seq;    // the backend's sequence number (Work::sequence_number)
    Clock::time_point deadline;
    std::chrono::milliseconds timeout;

    std::string what() const {
      return std::string(name) + " (sequence number " + std::to_string(seq) + ")";
    }
  };
  struct Task {
    std::shared_ptr<Work> work;
    Op op;
    std::string fingerprint;
    std::function<std::vector<at::Tensor>(Op&)> body;
  };
  struct CallDeadline {
    std::weak_ptr<Work> work;
    Op op;
    std::chrono::milliseconds requested;
  };
  struct Key {
    int src;
    std::uint64_t coll;
    std::uint32_t step;
    std::uint32_t chunk;
    auto operator<=>(const Key&) const = default;
  };
  struct Arrived {
    Header h;
    at::Tensor bytes;  // undefined for a message without tensor bytes
  };
  struct P2PSend {
    std::shared_ptr<Work> work;
    at::Tensor tensor;
    int dst;
    int tag;
  };
  struct P2PRecv {
    std::shared_ptr<Work> work;
    at::Tensor tensor;
    int src;  // -1: any
    int tag;
    Clock::time_point deadline;
    const char* name;
  };
  struct P2PArrived {
    int src;
    std::int64_t tag;
    at::Tensor bytes;
  };

  // ---- input checks (on the caller's thread, before anything is queued) ----

  static void check_same_numel(const at::Tensor& a, const at::Tensor& b, const char* op,
                               const char* what) {
    if (a.numel() != b.numel()) {
      throw std::invalid_argument(std::string(op) + ": " + what + " has " +
                                  std::to_string(b.numel()) + " elements, expected " +
                                  std::to_string(a.numel()));
    }
  }
  static void check_tag(int tag, const char* op) {
    if (tag < 0) {
      throw std::invalid_argument(std::string(op) + ": the tag must not be negative, got " +
                                  std::to_string(tag));
    }
  }
  // The DETAIL fingerprint (PyTorch's CollectiveFingerPrint): op, dtypes and shapes. The sequence
  // number is added when the collective is numbered.
  std::string fingerprint(const char* op, const std::vector<at::Tensor>& ts,
                          const std::string& extra) const {
    if (!detail_) return {};
    std::string shapes;
    std::string dtypes;
    for (const at::Tensor& t : ts) {
      shapes += (shapes.empty() ? "" : ", ") + detail::shape_text(t);
      dtypes += (dtypes.empty() ? "" : ", ") + std::string(c10::toString(t.scalar_type()));
    }
    std::string fp = std::string("OpType=") + op + ", TensorShape=[" + shapes +
                     "], TensorDtypes=[" + dtypes + "]";
    if (!extra.empty()) fp += ", " + extra;
    return fp;
  }

  // Runs f on a flat contiguous view of t, copying back when t is not contiguous.
  template <class F>
  static void in_place(const at::Tensor& t, F&& f) {
    if (t.is_contiguous()) {
      at::Tensor flat = t.view({-1});
      f(flat);
    } else {
      at::Tensor flat = t.contiguous().view({-1});
      f(flat);
      t.copy_(flat.view(t.sizes()));
    }
  }

  // ---- the executor ----

  std::shared_ptr<Work> enqueue(const char* name, std::chrono::milliseconds requested,
                                std::string fp, std::function<std::vector<at::Tensor>(Op&)> body) {
    check_call_timeout(name, requested);
    // The executor runs the collective until the group's timeout (or the call's, if longer): a
    // shorter call timeout fails only the caller's Work (the watchdog below), so a member that is
    // merely late does not leave the members' message streams out of step.
    const std::chrono::milliseconds run_for = std::max(timeout(), timeout_for(requested));
    const bool call_deadline = requested != kUnsetTimeout && requested < timeout();
    std::shared_ptr<Work> work;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) {
        throw DistBackendError(std::string("DistrpcBackend: ") + name + " after shutdown()");
      }
      // Numbered under the queue's lock, so the numbers follow the queue's order even when
      // several threads call (every member must still call in the same order).
      const auto seq = static_cast<std::int64_t>(next_sequence_number());
      work = std::make_shared<Work>(name, seq);
      work->set_completing_thread(executor_.get_id());
      if (spin_driver_) {
        distrpc::detail::set_wait_driver(work->get_future(),
                                         std::weak_ptr<distrpc::detail::WaitDriver>(spin_driver_));
      }
      Op op{name, ++coll_count_, seq, Clock::now() + run_for, run_for};
      if (call_deadline) arm_call_deadline(work, op, requested);
      tasks_.push_back(Task{work, op, std::move(fp), std::move(body)});
      queued_.fetch_add(1, std::memory_order_acq_rel);
    }
    cv_.notify_all();
    return work;
  }

  // ---- per-call timeouts (the watchdog) ----

  // With mu_ held. The caller's Work fails `requested` from now; the collective itself goes on
  // (its results may still land in the caller's tensors afterwards, as with the gloo backend).
  void arm_call_deadline(const std::shared_ptr<Work>& work, const Op& op,
                         std::chrono::milliseconds requested) {
    {
      std::lock_guard<std::mutex> lk(watch_mu_);
      if (!watchdog_.joinable()) {
        watchdog_ = std::thread([this, gone = left_] { watch_loop(*gone); });
      }
      call_deadlines_.emplace(Clock::now() + requested, CallDeadline{work, op, requested});
    }
    watch_cv_.notify_all();
  }

  // Fails the Works whose call timeout passed; the text is made under mu_ (it reads who was
  // heard from), the Works fail with no lock held.
  void watch_loop(const LeftThread& gone) {
    std::unique_lock<std::mutex> lk(watch_mu_);
    while (!watch_stop_) {
      if (call_deadlines_.empty()) {
        watch_cv_.wait(lk);
        continue;
      }
      if (Clock::now() < call_deadlines_.begin()->first) {
        watch_cv_.wait_until(lk, call_deadlines_.begin()->first);
        continue;
      }
      std::vector<CallDeadline> due;
      while (!call_deadlines_.empty() && call_deadlines_.begin()->first <= Clock::now()) {
        due.push_back(std::move(call_deadlines_.begin()->second));
        call_deadlines_.erase(call_deadlines_.begin());
      }
      lk.unlock();
      for (CallDeadline& d : due) {
        auto work = d.work.lock();
        if (!work || work->is_completed()) continue;
        if (has_left(gone)) {  // shut down by an earlier callback: `this` may be gone
          work->finish_error(std::make_exception_ptr(
              DistBackendError("DistrpcBackend: " + d.op.what() + ": the backend was shut down")));
          continue;
        }
        std::string text;
        {
          std::lock_guard<std::mutex> g(mu_);
          const std::string missing = missing_ranks(d.op.coll);
          text = "DistrpcBackend: Timeout: " + d.op.what() + " on rank " + std::to_string(rank()) +
                 " timed out after " + std::to_string(d.requested.count()) + " ms; " +
                 (missing.empty() ? std::string("every rank was heard from, still running")
                                  : "nothing heard for it from rank(s) " + missing) +
                 " (it goes on until the group's timeout of " +
                 std::to_string(d.op.timeout.count()) + " ms)";
        }
        work->finish_error(std::make_exception_ptr(DistBackendError(text)));
      }
      if (has_left(gone)) return;
      lk.lock();
    }
  }

  void executor_loop(const LeftThread& gone) {
    for (;;) {
      Task task;
      std::string broken;
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (tasks_.empty() && !stopping_ && options_.wait_spin.count() > 0) {
          // A caller issuing collectives back to back queues the next one within microseconds:
          // look for it a while before sleeping, so it needs no wake-up.
          lk.unlock();
          const auto end = Clock::now() + options_.wait_spin;
          while (queued_.load(std::memory_order_acquire) == 0 &&
                 !stopping_flag_.load(std::memory_order_acquire) && Clock::now() < end) {
            std::this_thread::yield();
          }
          lk.lock();
        }
        cv_.wait(lk, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping, nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
        queued_.fetch_sub(1, std::memory_order_acq_rel);
        // The group's timeout counts from the start here, as gloo's does: collectives queued
        // behind a slow one do not use up their time waiting for it. (A call's own, shorter
        // timeout counts from the call: the watchdog above.)
        task.op.deadline = Clock::now() + task.op.timeout;
        broken = broken_;
        if (stopping_) broken = "the backend was shut down";
      }
      if (!broken.empty()) {
        task.work->finish_error(std::make_exception_ptr(
            DistBackendError("DistrpcBackend: " + task.op.what() + " was not run: " + broken)));
        if (has_left(gone)) return;
        continue;
      }
      try {
        if (detail_ && size() > 1) check_fingerprint(task.op, task.fingerprint);
        std::vector<at::Tensor> out = task.body(task.op);
        forget(task.op);
        task.work->finish(std::move(out));
        if (has_left(gone)) return;
      } catch (...) {
        std::string text = "unknown error";
        try {
          throw;
        } catch (const std::exception& e) {
          text = e.what();
        } catch (...) {
        }
        {
          // No collective runs from now on: what is held, and what comes later, is dropped.
          std::lock_guard<std::mutex> lk(mu_);
          if (broken_.empty()) {
            broken_ = "the group is unusable after an earlier failure (" + text + ")";
          }
          box_.clear();
          heard_.clear();
        }
        task.work->finish_error(std::current_exception());
        if (has_left(gone)) return;
      }
    }
  }

  // Drops what is left of a finished collective (nothing, when every member agreed on sizes) and
  // records it as the last one completed (what Goodbye tells the others). After the goodbye told
  // them an earlier one, it fails here too, as it does on the others.
  void forget(const Op& o) {
    const std::uint64_t coll = o.coll;
    std::lock_guard<std::mutex> lk(mu_);
    if (goodbye_sent_) {
      throw DistBackendError("DistrpcBackend: " + o.what() + " failed: the backend was shut down");
    }
    done_through_ = coll;
    heard_.erase(coll);
    for (auto it = box_.begin(); it != box_.end();) {
      it = it->first.coll == coll ? box_.erase(it) : std::next(it);
    }
  }

  // ---- messages ----

  wire::Message make_message(detail::DistrpcKind kind, const Header& h, at::Tensor bytes) const {
    wire::Message m;
    m.type = wire::control_message_type(static_cast<std::uint8_t>(kind));
    wire::encode(m, h);
    if (bytes.defined() && bytes.numel() > 0) m.buffers.push_back(std::move(bytes));
    return m;
  }

  void send_raw(const Op& o, int peer, std::uint32_t step, std::uint32_t chunk,
                std::uint64_t region_bytes, at::Tensor bytes, std::string text = {}) {
    Header h;
    h.kind = static_cast<std::uint8_t>(detail::DistrpcKind::Collective);
    h.coll = o.coll;
    h.step = step;
    h.chunk = chunk;
    h.region_bytes = region_bytes;
    h.text = std::move(text);
    try {
      ctx_->send(peer, make_message(detail::DistrpcKind::Collective, h, std::move(bytes)));
    } catch (const std::exception& e) {
      // A send fails when the peer is gone: say so as a wait for it would.
      std::string lost;
      Leave leave = Leave::No;
      {
        std::lock_guard<std::mutex> lk(mu_);
        lost = lost_[static_cast<std::size_t>(peer)];
        leave = left(peer, o.coll);
      }
      // It completed this collective before it left: it needed nothing more from this member.
      if (leave == Leave::After) return;
      if (leave == Leave::Before) throw DistBackendError(left_text(o, peer));
      if (!lost.empty()) {
        throw DistBackendError("DistrpcBackend: " + o.what() + " failed on rank " +
                               std::to_string(rank()) + ": connection to rank " +
                               std::to_string(peer) + " lost (" + lost + "; " + e.what() + ")");
      }
      throw DistBackendError("DistrpcBackend: " + o.what() + " failed on rank " +
                             std::to_string(rank()) + ": sending to rank " + std::to_string(peer) +
                             " failed: " + e.what());
    }
  }

  // Waits for the message (src, step, chunk) of collective o: fails on shutdown, on a lost peer
  // and at o's deadline (see the top of this file for the texts).
  Arrived take(const Op& o, int src, std::uint32_t step, std::uint32_t chunk) {
    const Key key{src, o.coll, step, chunk};
    std::unique_lock<std::mutex> lk(mu_);
    bool drove = false;  // read on this thread since the last wait on cv_
    for (;;) {
      if (auto it = box_.find(key); it != box_.end()) {
        Arrived a = std::move(it->second);
        box_.erase(it);
        return a;
      }
      if (stopping_) {
        throw DistBackendError("DistrpcBackend: " + o.what() +
                               " failed: the backend was shut down");
      }
      // A member that left before this collective will not take part in it. One that left after
      // completing it sent all its messages for it first: its leaving does not concern this wait.
      for (int q = 0; q < size(); ++q) {
        if (left(q, o.coll) == Leave::Before) throw DistBackendError(left_text(o, q));
      }
      // The member lost first is the one to name: the others may only be leaving because of it.
      int first = -1;
      for (int q = 0; q < size(); ++q) {
        const auto qi = static_cast<std::size_t>(q);
        if (!lost_[qi].empty() && (q == src || left(q, o.coll) == Leave::No) &&
            (first < 0 || lost_at_[qi] < lost_at_[static_cast<std::size_t>(first)])) {
          first = q;
        }
      }
      Clock::time_point until = o.deadline;
      if constexpr (transport::has_drive<typename T::Context>) {
        if (options_.wait_spin.count() > 0 && first < 0 && !drove) {
          // Read on this thread for a while (the lock released: on_message takes it). Then
          // everything is looked at again: a loss or a shutdown notified cv_ meanwhile, with
          // nobody waiting on it.
          const std::uint64_t seen = arrivals_.load(std::memory_order_acquire);
          lk.unlock();
          ctx_->drive(
              [&] {
                return arrivals_.load(std::memory_order_acquire) != seen ||
                       stopping_flag_.load(std::memory_order_acquire);
              },
              std::min(o.deadline, Clock::now() + options_.wait_spin));
          lk.lock();
          drove = true;
          continue;
        }
      }
      drove = false;
      if (first >= 0) {
        const auto fi = static_cast<std::size_t>(first);
        if (Clock::now() >= lost_at_[fi] + kLossGrace) {
          throw DistBackendError("DistrpcBackend: " + o.what() + " failed on rank " +
                                 std::to_string(rank()) + ": connection to rank " +
                                 std::to_string(first) + " lost (" + lost_[fi] + ")");
        }
        until = std::min(until, lost_at_[fi] + kLossGrace);
      }
      if (cv_.wait_until(lk, until) == std::cv_status::timeout && box_.find(key) == box_.end() &&
          !stopping_ && Clock::now() >= o.deadline) {
        throw DistBackendError(timeout_text(o, src));
      }
    }
  }

  // With mu_ held: whether `peer` said goodbye, and then before collective `coll` (it will not
  // take part) or after completing it (all its messages for it came before the goodbye).
  enum class Leave { No, Before, After };
  Leave left(int peer, std::uint64_t coll) const {
    const std::int64_t after = left_after_[static_cast<std::size_t>(peer)];
    if (after < 0) return Leave::No;
    return static_cast<std::uint64_t>(after) < coll ? Leave::Before : Leave::After;
  }

  std::string left_text(const Op& o, int peer) const {
    return "DistrpcBackend: " + o.what() + " failed on rank " + std::to_string(rank()) + ": rank " +
           std::to_string(peer) + " left the group (it shut its backend down)";
  }

  // Tells every peer still connected the last collective this member completed (see the top of
  // this file). Its sends are in order behind the collectives' own. A peer that does not read
  // (stopped, its socket buffer full) would block a send for ever: the sends run on a thread of
  // their own, given a second, then ended by the transport's shutdown.
  void say_goodbye() {
    if (size() == 1) return;
    Header h;
    h.kind = static_cast<std::uint8_t>(detail::DistrpcKind::Goodbye);
    std::vector<int> peers;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!broken_.empty()) return;  // the others fail on their own; nothing to vouch for
      h.coll = done_through_;
      goodbye_sent_ = true;
      for (int q = 0; q < size(); ++q) {
        if (q != rank() && lost_[static_cast<std::size_t>(q)].empty()) peers.push_back(q);
      }
    }
    if (peers.empty()) return;
    std::packaged_task<void()> sends([this, h, peers] {
      for (const int q : peers) {
        try {
          ctx_->send(q, make_message(detail::DistrpcKind::Goodbye, h, at::Tensor()));
        } catch (const std::exception&) {
          // Gone already: its loss is what the others see, as without a goodbye.
        }
      }
    });
    std::future<void> done = sends.get_future();
    std::thread sender;
    try {
      sender = std::thread(std::move(sends));
    } catch (const std::system_error&) {
      return;  // no thread to be had: the others see the loss, as without a goodbye
    }
    if (done.wait_for(kGoodbyeWait) != std::future_status::ready) {
      ctx_->shutdown();  // ends the blocked send
    }
    sender.join();
  }

  // With mu_ held: the other ranks no message of collective coll came from ("1, 3").
  std::string missing_ranks(std::uint64_t coll) const {
    std::string missing;
    const auto heard = heard_.find(coll);
    for (int q = 0; q < size(); ++q) {
      if (q == rank()) continue;
      if (heard != heard_.end() && heard->second.count(q) != 0) continue;
      missing += (missing.empty() ? "" : ", ") + std::to_string(q);
    }
    return missing;
  }

  // Called with mu_ held.
  std::string timeout_text(const Op& o, int waiting_for) const {
    const std::string missing = missing_ranks(o.coll);
    std::string text = "DistrpcBackend: Timeout: " + o.what() + " on rank " +
                       std::to_string(rank()) + " did not complete within " +
                       std::to_string(o.timeout.count()) + " ms; ";
    if (!missing.empty()) {
      text += "nothing heard for it from rank(s) " + missing;
    } else {
      text += "still waiting for rank " + std::to_string(waiting_for);
    }
    return text;
  }

  // take() and check that the message carries exactly the bytes expected: a member that passed a
  // tensor of another size is refused here, before its bytes are written anywhere.
  Arrived take_checked(const Op& o, int src, std::uint32_t step, std::uint32_t chunk,
                       std::uint64_t region_bytes, std::int64_t chunk_bytes) {
    Arrived a = take(o, src, step, chunk);
    const std::int64_t got = a.bytes.defined() ? a.bytes.numel() : 0;
    if (a.h.region_bytes != region_bytes || got != chunk_bytes) {
      throw DistBackendError("DistrpcBackend: " + o.what() + ": size mismatch: rank " +
                             std::to_string(src) + " sent " + std::to_string(a.h.region_bytes) +
                             " bytes but rank " + std::to_string(rank()) + " expects " +
                             std::to_string(region_bytes) +
                             " (do all ranks pass tensors of the same size?)");
    }
    return a;
  }

  std::int64_t chunk_count(std::int64_t bytes) const {
    return bytes == 0 ? 1 : (bytes + options_.chunk_bytes - 1) / options_.chunk_bytes;
  }

  // A region in chunks (an empty or undefined one as one empty message, so the receiver hears it).
  void send_region(const Op& o, int peer, std::uint32_t step, const at::Tensor& bytes) {
    const std::int64_t n = bytes.defined() ? bytes.numel() : 0;
    const std::int64_t chunks = chunk_count(n);
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t off = c * options_.chunk_bytes;
      const std::int64_t len = std::min(options_.chunk_bytes, n - off);
      send_raw(o, peer, step, static_cast<std::uint32_t>(c), static_cast<std::uint64_t>(n),
               n == 0 ? at::Tensor() : bytes.narrow(0, off, len));
    }
  }

  // Receives a region of dst's size into dst (any shape; copied back if not contiguous).
  void recv_into(const Op& o, int src, std::uint32_t step, const at::Tensor& dst) {
    in_place(dst, [&](at::Tensor& flat) {
      at::Tensor bytes = detail::byte_view(flat);
      const std::int64_t n = bytes.numel();
      const std::int64_t chunks = chunk_count(n);
      for (std::int64_t c = 0; c < chunks; ++c) {
        const std::int64_t off = c * options_.chunk_bytes;
        const std::int64_t len = std::min(options_.chunk_bytes, n - off);
        Arrived a = take_checked(o, src, step, static_cast<std::uint32_t>(c),
                                 static_cast<std::uint64_t>(n), n == 0 ? 0 : len);
        if (len > 0) bytes.narrow(0, off, len).copy_(a.bytes);
      }
    });
  }

  // A fresh tensor like `like` (1-D) received from src.
  at::Tensor recv_new(const Op& o, int src, std::uint32_t step, const at::Tensor& like) {
    at::Tensor out = at::empty({like.numel()}, like.options());
    recv_into(o, src, step, out);
    return out;
  }

  // The reduction of parts (one per rank) in rank order: every member combines the same values in
  // the same order, so all get bitwise equal results.
  static at::Tensor reduce_in_rank_order(const std::vector<at::Tensor>& parts, const ReduceOp& op) {
    at::Tensor acc = start_reduction(parts[0], op);
    for (std::size_t q = 1; q < parts.size(); ++q) reduce_into(acc, parts[q], op);
    finish_reduction(acc, op, static_cast<std::int64_t>(parts.size()));
    return acc;
  }

  // ---- algorithms ----

  void allreduce_flat(const Op& o, at::Tensor& flat, const ReduceOp& op) {
    const int n = size();
    if (n == 1) {
      flat.copy_(reduce_in_rank_order({flat}, op));
      return;
    }
    const std::int64_t bytes = flat.numel() * static_cast<std::int64_t>(flat.element_size());
    if (bytes <= options_.small_bytes || flat.numel() < n) {
      allreduce_direct(o, flat, op);
    } else {
      allreduce_ring(o, flat, op);
    }
  }

  // Latency-optimal for small tensors: every member sends its tensor to every other (one message
  // time for any world size) and reduces all of them in rank order.
  void allreduce_direct(const Op& o, at::Tensor& flat, const ReduceOp& op) {
    const at::Tensor bytes = detail::byte_view(flat);
    for (int k = 1; k < size(); ++k) send_region(o, (rank() + k) % size(), 0, bytes);
    std::vector<at::Tensor> parts(static_cast<std::size_t>(size()));
    for (int q = 0; q < size(); ++q) {
      parts[static_cast<std::size_t>(q)] = q == rank() ? flat : recv_new(o, q, 0, flat);
    }
    flat.copy_(reduce_in_rank_order(parts, op));
  }

  // Bandwidth-optimal for large tensors: ring reduce-scatter then ring all-gather, each segment in
  // chunks, software-pipelined: the chunk just reduced is sent on at once, so the next member
  // reduces it while this one reduces the following chunk, and at most a few chunks per
  // connection are in flight (which keeps shared-memory segments reused rather than fresh).
  void allreduce_ring(const Op& o, at::Tensor& flat, const ReduceOp& op) {
    const int n = size();
    const int r = rank();
    const int next = (r + 1) % n;
    const int prev = (r - 1 + n) % n;
    const std::int64_t numel = flat.numel();
    const auto esize = static_cast<std::int64_t>(flat.element_size());
    const auto region = static_cast<std::uint64_t>(numel * esize);
    // PREMUL_SUM scales each member's own contribution once; partial sums then combine by SUM.
    // AVG sums too and divides at the end (finish_reduction on each reduced chunk).
    ReduceOp combine = op;
    if (op.kind() == ReduceOp::PREMUL_SUM) {
      flat.copy_(start_reduction(flat, op));
      combine = ReduceOp::SUM;
    }
    std::vector<std::int64_t> seg_off(static_cast<std::size_t>(n) + 1, 0);
    for (int i = 0; i < n; ++i) {
      seg_off[static_cast<std::size_t>(i) + 1] =
          seg_off[static_cast<std::size_t>(i)] + numel / n + (i < numel % n ? 1 : 0);
    }
    const std::int64_t cap = std::max<std::int64_t>(1, options_.chunk_bytes / esize);
    const auto seg_len = [&](int i) {
      return seg_off[static_cast<std::size_t>(i) + 1] - seg_off[static_cast<std::size_t>(i)];
    };
    const auto subs = [&](int i) {
      return std::max<std::int64_t>(1, (seg_len(i) + cap - 1) / cap);
    };
    const auto sub = [&](int i, std::int64_t j) {
      const std::int64_t off = j * cap;
      return flat.narrow(0, seg_off[static_cast<std::size_t>(i)] + off,
                         std::min(cap, seg_len(i) - off));
    };
    const auto mod = [n](int x) { return ((x % n) + n) % n; };
    const auto u32 = [](std::int64_t v) { return static_cast<std::uint32_t>(v); };
    // The 2(n-1) stages a chunk column goes through: stage k < n-1 is reduce-scatter step k (this
    // member adds the partial sum of segment r-k-1 from its predecessor and passes it on), stage
    // n-1+s is all-gather step s (it stores the finished segment r-s and passes it on). The
    // message feeding stage k is step k, chunk c. Both sides of a message work on the same
    // segment, so they agree on its chunk count.
    const int stages = 2 * (n - 1);
    const auto segment_of = [&](int k) {
      return k < n - 1 ? mod(r - k - 1) : mod(r - (k - n + 1));
    };
    std::int64_t columns = 0;
    for (int i = 0; i < n; ++i) columns = std::max(columns, subs(i));
    // Skewed schedule: at time t, stage k works on column t - k, latest stage first. Stage k's
    // input was produced by the predecessor at its time t - 1 (stage 0's: sent at the start of its
    // time t), so no member waits on one that waits on it, and each connection carries only about
    // one message per stage at a time: receive buffers (shared-memory segments) are released as
    // fast as they come, and reused rather than made anew. Step-major order (all of reduce-scatter,
    // then all of all-gather) would leave every all-gather chunk waiting in the mailbox.
    for (std::int64_t t = 0; t < columns + stages - 1; ++t) {
      if (t < subs(r)) send_raw(o, next, 0, u32(t), region, detail::byte_view(sub(r, t)));
      for (int k = static_cast<int>(std::min<std::int64_t>(stages - 1, t)); k >= 0; --k) {
        const std::int64_t c = t - k;
        const int seg = segment_of(k);
        if (c >= subs(seg)) continue;
        at::Tensor part = sub(seg, c);
        Arrived a = take_checked(o, prev, u32(k), u32(c), region, part.numel() * esize);
        if (k < n - 1) {
          reduce_into(part, detail::typed_view(a.bytes, part.scalar_type()), combine);
          a = Arrived{};  // release the received buffer (its shared segment) at once
          // After the last reduce-scatter step this member owns the finished chunk.
          if (k == n - 2) finish_reduction(part, op, n);
          send_raw(o, next, u32(k + 1), u32(c), region, detail::byte_view(part));
        } else {
          part.copy_(detail::typed_view(a.bytes, part.scalar_type()));
          // Forward what arrived as it is: no copy of our own on the way.
          if (k < stages - 1) send_raw(o, next, u32(k + 1), u32(c), region, a.bytes);
        }
      }
    }
  }

  // Small tensors or two members: the root sends to each. Otherwise a pipelined chain from the
  // root: each member forwards chunk k (the received bytes as they are) before taking chunk k+1,
  // so the root sends the tensor once whatever the world size.
  void broadcast_flat(const Op& o, at::Tensor& flat, int root) {
    const int n = size();
    if (n == 1) return;
    const at::Tensor bytes = detail::byte_view(flat);
    const std::int64_t nbytes = bytes.numel();
    if (nbytes <= options_.small_bytes) {
      if (rank() == root) {
        for (int k = 1; k < n; ++k) send_region(o, (root + k) % n, 0, bytes);
      } else {
        recv_into(o, root, 0, flat);
      }
      return;
    }
    // A chain from the root (two members: root and receiver), each chunk forwarded as it arrives,
    // so a member's link carries each byte once and all links work at the same time.
    const int pos = (rank() - root + n) % n;
    const int next = pos == n - 1 ? -1 : (rank() + 1) % n;
    const int prev = (rank() - 1 + n) % n;
    const std::int64_t chunks = chunk_count(nbytes);
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t off = c * options_.chunk_bytes;
      const std::int64_t len = std::min(options_.chunk_bytes, nbytes - off);
      const auto chunk = static_cast<std::uint32_t>(c);
      if (pos == 0) {
        send_paced(o, next, chunk, static_cast<std::uint64_t>(nbytes), bytes.narrow(0, off, len));
        continue;
      }
      Arrived a = take_checked(o, prev, 0, chunk, static_cast<std::uint64_t>(nbytes), len);
      if (next >= 0) {
        send_paced(o, next, chunk, static_cast<std::uint64_t>(nbytes), a.bytes);
      }
      bytes.narrow(0, off, len).copy_(a.bytes);
      a = Arrived{};  // its transport memory is free again before the sender hears so
      if (c + kPaceWindow < chunks) send_raw(o, prev, detail::kAckStep, chunk, 0, at::Tensor());
    }
  }

  // Chunk c of a region of `chunks` to `peer`, at most kPaceWindow chunks ahead of what the peer
  // has taken: the shared-memory transport reuses a few segments per connection, and a sender
  // that ran ahead would make it map fresh ones (a page fault on every byte), which made a 64 MiB
  // broadcast five times slower than the ring's all-reduce. The receiver acknowledges chunk c
  // (an empty message at kAckStep) when c + kPaceWindow < chunks.
  static constexpr std::int64_t kPaceWindow = 3;
  void send_paced(const Op& o, int peer, std::uint32_t chunk, std::uint64_t region_bytes,
                  const at::Tensor& bytes) {
    if (chunk >= kPaceWindow) {
      (void)take(o, peer, detail::kAckStep, static_cast<std::uint32_t>(chunk - kPaceWindow));
    }
    send_raw(o, peer, 0, chunk, region_bytes, bytes);
  }

  // Every member's input into slots[q] (slots[rank()] gets this member's own).
  void gather_all(const Op& o, const at::Tensor& in_flat, const std::vector<at::Tensor>& slots) {
    std::vector<at::Tensor> sends(static_cast<std::size_t>(size()), in_flat);
    exchange_all(o, sends, slots);
  }

  // sends[q] goes to rank q, recvs[q] comes from rank q (any shapes; sizes checked). Members send
  // starting with their successor, so no member is every other's first target.
  void exchange_all(const Op& o, const std::vector<at::Tensor>& sends,
                    const std::vector<at::Tensor>& recvs) {
    const int n = size();
    const auto at_ = [](const std::vector<at::Tensor>& v, int q) -> const at::Tensor& {
      return v[static_cast<std::size_t>(q)];
    };
    at::Tensor self_src = at_(sends, rank());
    const at::Tensor& self_dst = at_(recvs, rank());
    if (self_src.numel() != self_dst.numel()) {
      throw DistBackendError("DistrpcBackend: " + o.what() + ": size mismatch: rank " +
                             std::to_string(rank()) + " sends itself " +
                             std::to_string(self_src.numel()) + " elements but expects " +
                             std::to_string(self_dst.numel()));
    }
    // Own part after the sends (they copy out before send returns) and before the receives: in
    // place (one tensor in and out) with splits that differ, this member's part lands on rows
    // still to be sent, and the parts received land on rows of its own.
    for (int k = 1; k < n; ++k) {
      const int q = (rank() + k) % n;
      send_region(o, q, 0, detail::byte_view(at_(sends, q).contiguous()));
    }
    at::Tensor own = self_src.reshape(self_dst.sizes());
    if (own.is_alias_of(self_dst)) own = own.clone();  // the two may overlap in part
    self_dst.copy_(own);
    for (int k = 1; k < n; ++k)
      recv_into(o, (rank() - k + n) % n, 0, at_(recvs, (rank() - k + n) % n));
  }

  // flats[q] (this member's contribution to rank q's result): sends each to its owner and
  // reduces the contributions to its own slice in rank order. Each member sends and receives
  // (n-1)/n of a tensor, as the ring does, in one message time.
  at::Tensor reduce_scatter_flat(const Op& o, const std::vector<at::Tensor>& flats,
                                 const ReduceOp& op) {
    const int n = size();
    for (int k = 1; k < n; ++k) {
      const int q = (rank() + k) % n;
      send_region(o, q, 0, detail::byte_view(flats[static_cast<std::size_t>(q)]));
    }
    std::vector<at::Tensor> parts(static_cast<std::size_t>(n));
    const at::Tensor& mine = flats[static_cast<std::size_t>(rank())];
    for (int q = 0; q < n; ++q) {
      parts[static_cast<std::size_t>(q)] = q == rank() ? mine : recv_new(o, q, 0, mine);
    }
    return reduce_in_rank_order(parts, op);
  }

  // DETAIL: every member sends its fingerprint to every other and compares what it receives.
  void check_fingerprint(const Op& o, const std::string& fp) {
    const std::string mine =
        "CollectiveFingerPrint(SequenceNumber=" + std::to_string(o.seq) + ", " + fp + ")";
    for (int k = 1; k < size(); ++k) {
      send_raw(o, (rank() + k) % size(), detail::kFingerprintStep, 0, 0, at::Tensor(), mine);
    }
    for (int k = 1; k < size(); ++k) {
      const int q = (rank() - k + size()) % size();
      Arrived a = take(o, q, detail::kFingerprintStep, 0);
      if (a.h.text != mine) {
        throw DistBackendError("Detected mismatch between collectives on ranks. Rank " +
                               std::to_string(rank()) + " is running collective: " + mine +
                               ", but Rank " + std::to_string(q) +
                               " is running collective: " + a.h.text + ".");
      }
    }
  }

  // ---- transport callbacks (I/O threads: file and wake only) ----

  void on_message(int peer, wire::Message&& m) {
    Header h;
    try {
      wire::InputArchive ar(m);
      ar(h);
    } catch (const std::exception& e) {
      distrpc::detail::log_error("distrpc backend", "rank " + std::to_string(rank()) +
                                                        ": dropped a malformed message from rank " +
                                                        std::to_string(peer) + ": " + e.what());
      return;
    }
    at::Tensor bytes = m.buffers.empty() ? at::Tensor() : std::move(m.buffers.front());
    if (h.kind == static_cast<std::uint8_t>(detail::DistrpcKind::P2P)) {
      bool late = false;
      {
        std::lock_guard<std::mutex> lk(p2p_mu_);
        if (const auto owed = p2p_owed_.find({peer, h.tag}); owed != p2p_owed_.end()) {
          late = true;
          if (--owed->second == 0) p2p_owed_.erase(owed);
        } else {
          p2p_box_.push_back(P2PArrived{peer, h.tag, std::move(bytes)});
        }
      }
      if (late) {
        distrpc::detail::log_warning(
            "distrpc backend", "rank " + std::to_string(rank()) + ": dropped a message from rank " +
                                   std::to_string(peer) + " (tag " + std::to_string(h.tag) + ", " +
                                   std::to_string(h.region_bytes) +
                                   " bytes) that arrived after its receive timed out");
        return;
      }
      p2p_cv_.notify_all();
      return;
    }
    if (h.kind == static_cast<std::uint8_t>(detail::DistrpcKind::Goodbye)) {
      if (peer < 0 || peer >= size()) return;
      {
        std::lock_guard<std::mutex> lk(mu_);
        left_after_[static_cast<std::size_t>(peer)] = static_cast<std::int64_t>(h.coll);
        arrivals_.fetch_add(1, std::memory_order_release);  // ends a take() reading in drive()
      }
      cv_.notify_all();
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      // After a failure no collective runs again: nothing is kept for one (the meeting's hellos,
      // collective 0, come before any failure).
      if (!broken_.empty()) return;
      heard_[h.coll].insert(peer);  // collective 0 is the meeting's hello
      box_.emplace(Key{peer, h.coll, h.step, h.chunk}, Arrived{std::move(h), std::move(bytes)});
      arrivals_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }

  void on_peer_lost(int peer, const std::string& why) {
    if (peer < 0 || peer >= size()) return;
    {
      std::lock_guard<std::mutex> a(mu_);
      std::lock_guard<std::mutex> b(p2p_mu_);
      std::string& slot = lost_[static_cast<std::size_t>(peer)];
      if (slot.empty()) {
        slot = why.empty() ? "connection closed" : why;
        lost_at_[static_cast<std::size_t>(peer)] = Clock::now();
      }
      arrivals_.fetch_add(1, std::memory_order_release);  // ends a take() reading in drive()
    }
    cv_.notify_all();
    p2p_cv_.notify_all();
  }

  // ---- meeting ----

  void meet() {
    if (size() == 1) return;
    const std::string prefix = "distrpc_backend/addr/";
    store_->set(prefix + std::to_string(rank()), ctx_->address());
    std::vector<std::string> keys;
    for (int q = 0; q < size(); ++q) {
      if (q != rank()) keys.push_back(prefix + std::to_string(q));
    }
    try {
      store_->wait(keys, timeout());
    } catch (const DistError& e) {
      throw DistBackendError("DistrpcBackend: rank " + std::to_string(rank()) +
                             ": not every member published its address within " +
                             std::to_string(timeout().count()) + " ms: " + e.what());
    }
    for (int q = 0; q < size(); ++q) {
      if (q == rank()) continue;
      ctx_->add_peer(q, "rank" + std::to_string(q), store_->get_string(prefix + std::to_string(q)));
    }
    // A hello both ways with everyone: connections exist before the first collective, so a lost
    // member is noticed by all, and nobody's first collective message waits for a connect.
    Header h;
    h.kind = static_cast<std::uint8_t>(detail::DistrpcKind::Hello);
    for (int k = 1; k < size(); ++k) {
      const int q = (rank() + k) % size();
      try {
        ctx_->send(q, make_message(detail::DistrpcKind::Hello, h, at::Tensor()));
      } catch (const std::exception& e) {
        throw DistBackendError("DistrpcBackend: rank " + std::to_string(rank()) +
                               ": cannot reach rank " + std::to_string(q) + ": " + e.what());
      }
    }
    const Op hello{"meeting", 0, 0, Clock::now() + timeout(), timeout()};
    for (int k = 1; k < size(); ++k) (void)take(hello, (rank() - k + size()) % size(), 0, 0);
  }

  // ---- point to point ----

  std::shared_ptr<Work> post_recv(const at::Tensor& t, int src, int tag, const char* name) {
    auto work = std::make_shared<Work>(name, -1);  // no sequence number: see send()
    work->set_completing_thread(p2p_thread_.get_id());
    {
      std::lock_guard<std::mutex> lk(p2p_mu_);
      if (stopping_)
        throw DistBackendError(std::string("DistrpcBackend: ") + name + " after shutdown()");
      p2p_recvs_.push_back(P2PRecv{work, t, src, tag, Clock::now() + timeout(), name});
    }
    p2p_cv_.notify_all();
    return work;
  }

  // What a receive or send still pending at shutdown fails with (shutdown() and p2p_loop()).
  static std::exception_ptr shut_down_error(const P2PRecv& r) {
    return std::make_exception_ptr(
        DistBackendError("DistrpcBackend: " + recv_what(r) + " failed: the backend was shut down"));
  }
  static std::exception_ptr shut_down_error(const P2PSend& s) {
    return std::make_exception_ptr(DistBackendError("DistrpcBackend: send to rank " +
                                                    std::to_string(s.dst) +
                                                    " failed: the backend was shut down"));
  }

  static std::string recv_what(const P2PRecv& r) {
    return std::string(r.name) + (r.src >= 0 ? " from rank " + std::to_string(r.src) : "") +
           " (tag " + std::to_string(r.tag) + ")";
  }

  // Matches receives with arrived messages (in the order each was posted / arrived, so messages
  // with one (peer, tag) are received in the order sent), sends, and fails what cannot complete.
  // Copies and completions run with no lock held.
  void p2p_loop(const LeftThread& gone) {
    for (;;) {
      std::vector<P2PSend> sends;
      std::vector<std::pair<P2PRecv, P2PArrived>> matched;
      std::vector<std::pair<std::shared_ptr<Work>, std::string>> failed;
      std::vector<P2PRecv> stopped;  // failed because the backend stops
      bool stop = false;
      {
        std::unique_lock<std::mutex> lk(p2p_mu_);
        const auto next_deadline = [&] {
          Clock::time_point d = Clock::time_point::max();
          for (const P2PRecv& r : p2p_recvs_) {
            d = std::min(d, r.deadline);
            if (r.src >= 0 && !lost_[static_cast<std::size_t>(r.src)].empty()) {
              d = std::min(d, lost_at_[static_cast<std::size_t>(r.src)] + kLossGrace);
            }
          }
          return d;
        };
        const auto ready = [&] {
          return stopping_ || !p2p_sends_.empty() || has_match_or_failure();
        };
        // One wait, then a scan: a receive posted meanwhile, a loss reported, or a deadline that
        // passed is seen on the next round, with the deadlines as they are then (a wait that kept
        // its predicate would sleep through all three).
        if (!ready()) {
          const Clock::time_point until = next_deadline();
          if (until == Clock::time_point::max()) {
            p2p_cv_.wait(lk);
          } else {
            p2p_cv_.wait_until(lk, until);
          }
        }
        stop = stopping_;
        sends.assign(std::make_move_iterator(p2p_sends_.begin()),
                     std::make_move_iterator(p2p_sends_.end()));
        p2p_sends_.clear();
        const auto now = Clock::now();
        for (auto it = p2p_recvs_.begin(); it != p2p_recvs_.end();) {
          auto m = std::find_if(p2p_box_.begin(), p2p_box_.end(), [&](const P2PArrived& a) {
            return (it->src < 0 || a.src == it->src) && a.tag == it->tag;
          });
          if (m != p2p_box_.end()) {
            matched.emplace_back(std::move(*it), std::move(*m));
            p2p_box_.erase(m);
            it = p2p_recvs_.erase(it);
          } else if (stop) {
            stopped.push_back(std::move(*it));
            it = p2p_recvs_.erase(it);
          } else if (it->src >= 0 && lost_for_good(it->src, now)) {
            failed.emplace_back(it->work, "DistrpcBackend: " + recv_what(*it) +
                                              " failed: connection to rank " +
                                              std::to_string(it->src) + " lost (" +
                                              lost_[static_cast<std::size_t>(it->src)] + ")");
            it = p2p_recvs_.erase(it);
          } else if (now >= it->deadline) {
            // The sender's message for it may still come: it is this receive's (the n-th send
            // pairs with the n-th receive), so it is dropped on arrival rather than given to the
            // next receive. An any-source receive names no sender to owe it.
            if (it->src >= 0) ++p2p_owed_[{it->src, it->tag}];
            failed.emplace_back(it->work, "DistrpcBackend: Timeout: " + recv_what(*it) +
                                              " on rank " + std::to_string(rank()) +
                                              " got no message within " +
                                              std::to_string(timeout().count()) + " ms");
            it = p2p_recvs_.erase(it);
          } else {
            ++it;
          }
        }
      }
      // Past here a callback may have shut the backend down and freed it: what is left is finished
      // without touching a member (complete_recv is static), and sends fail (has_left).
      for (auto& [w, text] : failed)
        w->finish_error(std::make_exception_ptr(DistBackendError(text)));
      for (P2PRecv& r : stopped) r.work->finish_error(shut_down_error(r));
      for (auto& [r, a] : matched) complete_recv(r, a);
      for (P2PSend& s : sends) {
        if (stop || has_left(gone)) {
          s.work->finish_error(shut_down_error(s));
          continue;
        }
        Header h;
        h.kind = static_cast<std::uint8_t>(detail::DistrpcKind::P2P);
        h.tag = s.tag;
        h.region_bytes = static_cast<std::uint64_t>(s.tensor.numel() * s.tensor.element_size());
        try {
          ctx_->send(s.dst, make_message(detail::DistrpcKind::P2P, h, detail::byte_view(s.tensor)));
          s.work->finish({s.tensor});
        } catch (const std::exception& e) {
          s.work->finish_error(std::make_exception_ptr(
              DistBackendError("DistrpcBackend: send to rank " + std::to_string(s.dst) + " (tag " +
                               std::to_string(s.tag) + ") failed: " + e.what())));
        }
      }
      if (stop || has_left(gone)) return;
    }
  }

  // With p2p_mu_ held: peer's connection broke at least kLossGrace ago.
  bool lost_for_good(int peer, Clock::time_point now) const {
    const auto pi = static_cast<std::size_t>(peer);
    return !lost_[pi].empty() && now >= lost_at_[pi] + kLossGrace;
  }

  // With p2p_mu_ held: something for the loop to do now.
  bool has_match_or_failure() const {
    for (const P2PRecv& r : p2p_recvs_) {
      if (r.src >= 0 && lost_for_good(r.src, Clock::now())) return true;
      for (const P2PArrived& a : p2p_box_) {
        if ((r.src < 0 || a.src == r.src) && a.tag == r.tag) return true;
      }
    }
    return false;
  }

  static void complete_recv(P2PRecv& r, P2PArrived& a) {
    const at::Tensor& t = r.tensor;
    const std::int64_t want = t.numel() * static_cast<std::int64_t>(t.element_size());
    const std::int64_t got = a.bytes.defined() ? a.bytes.numel() : 0;
    if (want != got) {
      r.work->finish_error(std::make_exception_ptr(DistBackendError(
          "DistrpcBackend: " + recv_what(r) + ": size mismatch: rank " + std::to_string(a.src) +
          " sent " + std::to_string(got) + " bytes but the tensor holds " + std::to_string(want))));
      return;
    }
    try {
      if (got > 0) {
        in_place(t, [&](at::Tensor& flat) { detail::byte_view(flat).copy_(a.bytes); });
      }
    } catch (const std::exception& e) {
      r.work->finish_error(std::make_exception_ptr(
          DistBackendError("DistrpcBackend: " + recv_what(r) + ": " + e.what())));
      return;
    }
    r.work->finish_recv({t}, a.src);
  }

  std::shared_ptr<store::Store> store_;
  DistrpcBackendOptions options_;
  const bool detail_;

  // Collectives: the queue, the mailbox and what the I/O threads learnt, under mu_.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  std::uint64_t coll_count_ = 0;
  std::map<Key, Arrived> box_;
  std::map<std::uint64_t, std::set<int>> heard_;  // collective -> ranks a message came from
  std::string broken_;                            // why later collectives fail at once
  std::vector<Clock::time_point> lost_at_;        // per rank: when on_peer_lost said so
  std::vector<std::string> lost_;                 // per rank: why its connection broke (also read
                                                  // under p2p_mu_; written under both)
  std::vector<std::int64_t> left_after_;  // per rank: its Goodbye's collective, -1 before one
  std::uint64_t done_through_ = 0;        // the last collective this member completed
  bool goodbye_sent_ = false;             // done_through_ was told: no later one completes
  bool stopping_ = false;                         // written under both mutexes
  std::atomic<bool> stopping_flag_{false};        // the same, for drive()'s predicate
  std::atomic<std::uint64_t> arrivals_{0};        // messages filed: drive()'s predicate
  std::atomic<std::int64_t> queued_{0};           // tasks_.size(), for the executor's spin

  // Point to point, under p2p_mu_.
  std::mutex p2p_mu_;
  std::condition_variable p2p_cv_;
  std::deque<P2PSend> p2p_sends_;
  std::deque<P2PRecv> p2p_recvs_;
  std::deque<P2PArrived> p2p_box_;
  // (source, tag) -> messages still to come for receives from that source that timed out.
  std::map<std::pair<int, std::int64_t>, std::uint64_t> p2p_owed_;

  std::mutex shutdown_mu_;
  bool shut_down_ = false;

  // Per-call timeouts, under watch_mu_ (taken after mu_, never before it: arm_call_deadline runs
  // with mu_ held, watch_loop takes mu_ only with watch_mu_ released).
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::multimap<Clock::time_point, CallDeadline> call_deadlines_;
  bool watch_stop_ = false;
  std::thread watchdog_;  // started by the first call with its own timeout

  std::shared_ptr<detail::SpinWaitDriver> spin_driver_;  // null when wait_spin is 0
  std::unique_ptr<typename T::Context> ctx_;
  // The backend's thread that shutdown() ran on and detached (a Work callback that shut the
  // backend down or dropped its last reference), once it has. That thread may find the backend
  // freed when the callback returns: it leaves its loop without touching a member. Shared with the
  // threads so it outlives the backend.
  std::shared_ptr<LeftThread> left_ = std::make_shared<LeftThread>();
  std::thread executor_;
  std::thread p2p_thread_;
};

// Registers "distrpc" for CPU tensors, each group member's backend on transport policy T. Throws
// (as register_backend does) when "distrpc" is already registered.
template <class T>
void register_distrpc_backend(DistrpcBackendOptions options = {}) {
  register_backend("distrpc",
                   [options](std::shared_ptr<store::Store> store, int rank, int size,
                             std::chrono::milliseconds timeout) -> std::shared_ptr<Backend> {
                     return std::make_shared<DistrpcBackend<T>>(std::move(store), rank, size,
                                                                timeout, options);
                   },
                   {"cpu"});
}

}  // namespace distrpc::dist
