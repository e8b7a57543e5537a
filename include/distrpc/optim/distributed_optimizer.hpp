// DistributedOptimizer<Opt>: one libtorch optimizer over parameters spread across workers, stepped
// with the gradients distributed autograd left on each of them (PyTorch's
// torch.distributed.optim.DistributedOptimizer). docs/dist_optim.md.
//
//   distrpc::optim::DistributedOptimizer<torch::optim::SGD> opt(rm.remote_parameters(),
//                                                               torch::optim::SGDOptions(0.05));
//   {
//     distrpc::dist_autograd::Context ctx;
//     at::Tensor loss = rm.forward(x).sum();
//     distrpc::dist_autograd::backward(ctx.id(), {loss});
//     opt.step(ctx.id());  // every owner steps its own parameters with its own gradients
//   }
//
// The constructor groups the parameters by owner and builds one LocalOptimizer<Opt> on each (over
// the owner's own tensors, so the optimizer's state — momentum buffers, Adam's moments — lives
// beside the parameters and never travels). step(context_id) asks every owner at once to step
// with the gradients of that context, and waits for all of them.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/dist_autograd.hpp"
#include "distrpc/future.hpp"
#include "distrpc/nn/module_options.hpp"
#include "distrpc/optim/optimizer_options.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/rref.hpp"

namespace distrpc::optim {

namespace detail {

// Steps on one worker run one at a time, first come first served. Process-wide rather than per
// optimizer: trainers that each build their own DistributedOptimizer over the same parameters
// (PyTorch's parameter server) get separate LocalOptimizers sharing those tensors, and a step
// sets the tensors' .grad, so two steps over shared tensors must never interleave. PyTorch's
// _LocalOptimizer holds one global lock for the same reason. A ticket lock keeps arrival order,
// which a plain mutex does not promise.
class StepQueue {
 public:
  static StepQueue& instance() {
    static StepQueue q;
    return q;
  }

  class Turn {
   public:
    explicit Turn(StepQueue& q) : q_(q) {
      std::unique_lock<std::mutex> lk(q_.mu_);
      const std::uint64_t ticket = q_.next_++;
      q_.cv_.wait(lk, [&] { return q_.serving_ == ticket; });
    }
    ~Turn() {
      {
        std::lock_guard<std::mutex> lk(q_.mu_);
        ++q_.serving_;
      }
      q_.cv_.notify_all();
    }
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;

   private:
    StepQueue& q_;
  };

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t next_ = 0;
  std::uint64_t serving_ = 0;
};

// "parameter 3 (on worker1)": what the errors about one parameter name. `where` is empty outside
// RPC (a LocalOptimizer built directly).
inline std::string parameter_label(std::int64_t position, const std::string& where) {
  std::string s = "parameter " + std::to_string(position);
  if (!where.empty()) s += " (on " + where + ")";
  return s;
}

// What torch::optim accepts, checked up front with the parameter's position and worker named.
// PyTorch accepts a parameter that does not require grad and never updates it (no gradient ever
// reaches it); here it is refused, since a parameter listed for an optimizer that can never move
// is a mistake the caller wants to hear about.
inline void check_parameter(const at::Tensor& t, std::int64_t position, const std::string& where) {
  const std::string what =
      "distrpc::optim::DistributedOptimizer: " + parameter_label(position, where);
  if (!t.defined()) throw std::invalid_argument(what + " is an undefined tensor");
  if (!t.requires_grad()) {
    throw std::invalid_argument(what +
                                " does not require grad, so no gradient can ever reach it (PyTorch "
                                "would keep it and never update it): call requires_grad_() on it "
                                "or leave it out of the parameter list");
  }
  if (!t.is_leaf()) {
    throw std::invalid_argument(
        what +
        " is not a leaf tensor (it was computed from other tensors), and an "
        "optimizer can only update leaves (PyTorch: \"can't optimize a "
        "non-leaf Tensor\")");
  }
}

// The text of a failure, without c10's backtrace.
inline std::string failure_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& ex) {
    return ex.what_without_backtrace();
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error (not derived from std::exception)";
  }
}

template <class Opt, bool = supported_optimizer<Opt>>
struct checked_optimizer {
  static_assert(supported_optimizer<Opt>,
                "distrpc::optim::DistributedOptimizer<Opt>: Opt must be a torch::optim optimizer "
                "with distrpc::optim::optimizer_traits<Opt> (given for SGD, Adam, AdamW, Adagrad "
                "and RMSprop) and a wire codec for its options, "
                "distrpc::nn::OptionsCodec<OptionsOf<Opt>> (see "
                "distrpc/optim/optimizer_options.hpp)");
  using type = Opt;
};

}  // namespace detail

// The part of a DistributedOptimizer that lives on one owner: a torch optimizer over that
// worker's parameters. Built by DistributedOptimizer on each owner (docs/dist_optim.md); it may
// also be built directly over local tensors, e.g. to test an optimizer on given gradients.
template <class Opt>
class LocalOptimizer {
  static_assert(supported_optimizer<Opt>,
                "distrpc::optim::LocalOptimizer<Opt>: Opt needs distrpc::optim::optimizer_traits "
                "and an options codec (see distrpc/optim/optimizer_options.hpp)");

 public:
  using optimizer_type = Opt;
  using options_type = OptionsOf<Opt>;

  // Throws std::invalid_argument naming the parameter (position in `params`) when one is
  // undefined, does not require grad, is not a leaf or is listed twice; torch's own checks of the
  // options (c10::Error, e.g. "Invalid learning rate: -1") are raised as they are.
  LocalOptimizer(std::vector<at::Tensor> params, const options_type& options)
      : LocalOptimizer(std::move(params), options, {}, std::string()) {}

  // `positions`: each tensor's position in the caller's list, `where`: this worker's name, for
  // the errors (what DistributedOptimizer's owners pass).
  LocalOptimizer(std::vector<at::Tensor> params, const options_type& options,
                 const std::vector<std::int64_t>& positions, const std::string& where) {
    std::unordered_map<const c10::TensorImpl*, std::int64_t> seen;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::int64_t position =
          positions.empty() ? static_cast<std::int64_t>(i) : positions.at(i);
      detail::check_parameter(params[i], position, where);
      // The same tensor twice would be stepped twice per step (PyTorch warns about duplicate
      // parameters and means to refuse them).
      const auto [first, fresh] = seen.emplace(params[i].unsafeGetTensorImpl(), position);
      if (!fresh) {
        throw std::invalid_argument(
            "distrpc::optim::DistributedOptimizer: " + detail::parameter_label(position, where) +
            " is the same tensor as parameter " + std::to_string(first->second));
      }
    }
    params_ = std::move(params);
    optimizer_ = std::make_unique<Opt>(params_, options);
  }

  // PyTorch's _LocalOptimizer.step: the gradients distributed autograd accumulated on this worker
  // in `context_id` (dist_autograd::get_gradients), then step_with_gradients. An unknown context
  // raises get_gradients' error.
  void step(std::int64_t context_id) {
    step_with_gradients(dist_autograd::get_gradients(context_id));
  }

  // One optimizer step with `gradients` (keyed by tensor identity, as get_gradients returns them):
  // each parameter's .grad is set to its gradient (undefined when it has none, so the optimizer
  // skips it), the optimizer steps, and every .grad is put back as it was: distributed autograd
  // never writes .grad, so a program's own .grad is unchanged by a step. Steps on one worker run
  // one at a time in arrival order, each whole (StepQueue).
  void step_with_gradients(const c10::Dict<at::Tensor, at::Tensor>& gradients) {
    detail::StepQueue::Turn turn(detail::StepQueue::instance());
    std::vector<at::Tensor> saved;
    saved.reserve(params_.size());
    for (const auto& p : params_) saved.push_back(p.grad());
    struct Restore {
      const std::vector<at::Tensor>& params;
      std::vector<at::Tensor>& saved;
      ~Restore() {
        for (std::size_t i = 0; i < params.size(); ++i) {
          params[i].mutable_grad() = std::move(saved[i]);
        }
      }
    } restore{params_, saved};
    for (auto& p : params_) {
      auto it = gradients.find(p);
      p.mutable_grad() = it != gradients.end() ? it->value() : at::Tensor();
    }
    optimizer_->step();
  }

  // The tensors this optimizer updates (the owner's own parameter tensors).
  const std::vector<at::Tensor>& parameters() const noexcept { return params_; }

 private:
  std::vector<at::Tensor> params_;
  std::unique_ptr<Opt> optimizer_;
};

namespace detail {

// Runs on each owner (PyTorch's _new_local_optimizer): the owner's values of its parameter RRefs,
// one LocalOptimizer over them, kept here and returned as an owner RRef. `positions` are the
// parameters' places in the caller's list, for the errors.
template <class Opt>
RRef<LocalOptimizer<Opt>> new_local_optimizer(std::vector<RRef<at::Tensor>> params,
                                              std::vector<std::int64_t> positions,
                                              nn::WireOptions<OptionsOf<Opt>> options) {
  const std::string where = ::distrpc::get_worker_info().name;
  if (positions.size() != params.size()) {
    throw std::invalid_argument(
        "distrpc::optim::DistributedOptimizer: " + std::to_string(params.size()) +
        " parameters but " + std::to_string(positions.size()) + " positions arrived on " + where);
  }
  std::vector<at::Tensor> tensors;
  tensors.reserve(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    try {
      tensors.push_back(params[i].local_value());
    } catch (const std::exception& e) {
      // E.g. the RRef came from a remote() whose function threw: name which parameter it was.
      throw std::invalid_argument(
          "distrpc::optim::DistributedOptimizer: " + parameter_label(positions[i], where) + " (" +
          params[i].str() + ") holds no tensor: " + e.what());
    }
  }
  return RRef<LocalOptimizer<Opt>>::make(std::move(tensors), options.get(), positions, where);
}

// Everything an owner runs for a DistributedOptimizer<Opt>: registered as the library's own, so
// every agent serves it whatever its registry.
template <class Opt>
bool register_optimizer() {
  ::distrpc::detail::ensure_library_registered<&new_local_optimizer<Opt>>();
  ::distrpc::detail::ensure_library_registered<
      &::distrpc::detail::MethodProxy<&LocalOptimizer<Opt>::step>::call>();
  return true;
}

template <class Opt>
struct OptimizerRegistrar {
  // Instantiated by DistributedOptimizer<Opt>: a binary that uses the optimizer also serves it.
  static inline const bool registered = register_optimizer<Opt>();
};

}  // namespace detail

template <class Opt>
class DistributedOptimizer {
  using Checked = typename detail::checked_optimizer<Opt>::type;

 public:
  using optimizer_type = Opt;
  using options_type = OptionsOf<Checked>;

  // Groups `params` by owner and builds one LocalOptimizer<Opt> on each owner (this worker
  // included when it owns some), waiting for all of them. Errors:
  //  - an empty list, or an empty RRef handle at some position: std::invalid_argument;
  //  - invalid options: torch's own check (c10::Error, e.g. "Invalid learning rate: -1"), raised
  //    here before anything is sent;
  //  - a parameter an owner cannot optimize (undefined, not requiring grad, not a leaf, the same
  //    tensor as another one): std::invalid_argument naming its position and owner;
  //  - RPC not initialized, an owner unreachable: the RPC layer's errors.
  DistributedOptimizer(std::vector<RRef<at::Tensor>> params, options_type options) {
    (void)detail::OptimizerRegistrar<Opt>::registered;
    if (params.empty()) {
      throw std::invalid_argument(
          "distrpc::optim::DistributedOptimizer: empty parameter list (PyTorch: \"optimizer got "
          "an empty parameter list\")");
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!params[i].valid()) {
        throw std::invalid_argument("distrpc::optim::DistributedOptimizer: parameter " +
                                    std::to_string(i) + " is an empty RRef handle");
      }
    }
    // torch's checks of the options, here, before any owner is asked.
    (void)Opt(std::vector<at::Tensor>{}, options);

    const WorkerInfo self = ::distrpc::get_worker_info();
    struct Group {
      WorkerInfo owner;
      std::vector<RRef<at::Tensor>> params;
      std::vector<std::int64_t> positions;
    };
    std::vector<Group> groups;  // in order of first appearance in `params`
    for (std::size_t i = 0; i < params.size(); ++i) {
      const WorkerInfo owner = params[i].owner();
      auto g = groups.begin();
      while (g != groups.end() && g->owner.id != owner.id) ++g;
      if (g == groups.end()) g = groups.insert(groups.end(), Group{owner, {}, {}});
      g->params.push_back(params[i]);
      g->positions.push_back(static_cast<std::int64_t>(i));
    }

    // All owners build at once; this worker's own part is built here meanwhile.
    const nn::WireOptions<options_type> wire_options(options);
    std::vector<Future<RRef<LocalOptimizer<Opt>>>> pending;
    std::vector<WorkerInfo> pending_owner;
    std::exception_ptr local_error;
    for (auto& g : groups) {
      if (g.owner.id == self.id) continue;
      // A call refused before it is sent (an owner that left the group) fails like a failed reply:
      // the builds already sent are still awaited.
      try {
        pending.push_back(::distrpc::rpc_async<&detail::new_local_optimizer<Opt>>(
            g.owner, g.params, g.positions, wire_options));
      } catch (...) {
        pending.push_back(::distrpc::make_exceptional_future<RRef<LocalOptimizer<Opt>>>(
            std::current_exception()));
      }
      pending_owner.push_back(g.owner);
    }
    for (auto& g : groups) {
      if (g.owner.id != self.id) continue;
      try {
        local_ = detail::new_local_optimizer<Opt>(g.params, g.positions, wire_options);
      } catch (...) {
        local_error = std::current_exception();
      }
    }
    // Every owner's outcome is awaited before the first error is raised: nothing is left in
    // flight behind the caller's back.
    std::exception_ptr first = local_error;
    for (std::size_t k = 0; k < pending.size(); ++k) {
      try {
        remotes_.push_back(Remote{pending_owner[k], pending[k].value()});
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  // Steps every owner's LocalOptimizer with the gradients of distributed autograd context
  // `context_id` on that owner, all owners at once, and returns when all have finished. When any
  // fails, throws RpcError "DistributedOptimizer step on <worker> failed: <reason>" (after every
  // other owner finished; further failures are named after the first).
  void step(std::int64_t context_id) {
    std::vector<Future<void>> pending;
    pending.reserve(remotes_.size());
    for (const auto& r : remotes_) {
      // An owner that cannot be called (it left the group) fails its part; the others still step.
      try {
        pending.push_back(r.optimizer.template rpc_async<&LocalOptimizer<Opt>::step>(context_id));
      } catch (...) {
        pending.push_back(::distrpc::make_exceptional_future<void>(std::current_exception()));
      }
    }
    std::vector<std::pair<std::string, std::string>> failures;  // worker, reason
    if (local_.valid()) {
      try {
        local_.local_value().step(context_id);
      } catch (...) {
        failures.emplace_back(local_.owner_name(), detail::failure_text(std::current_exception()));
      }
    }
    for (std::size_t k = 0; k < pending.size(); ++k) {
      try {
        pending[k].wait();
      } catch (...) {
        failures.emplace_back(remotes_[k].owner.name,
                              detail::failure_text(std::current_exception()));
      }
    }
    if (failures.empty()) return;
    std::string text =
        "DistributedOptimizer step on " + failures[0].first + " failed: " + failures[0].second;
    for (std::size_t k = 1; k < failures.size(); ++k) {
      text += "; also on " + failures[k].first + ": " + failures[k].second;
    }
    throw RpcError(text);
  }

  // The workers that hold a part of this optimizer, this one first when it owns parameters, then
  // the others in order of their first parameter.
  std::vector<WorkerInfo> owners() const {
    std::vector<WorkerInfo> out;
    if (local_.valid()) out.push_back(local_.owner());
    for (const auto& r : remotes_) out.push_back(r.owner);
    return out;
  }

 private:
  struct Remote {
    WorkerInfo owner;
    RRef<LocalOptimizer<Opt>> optimizer;
  };
  std::vector<Remote> remotes_;
  RRef<LocalOptimizer<Opt>> local_;  // this worker's part (an owner RRef), when it owns any
};

}  // namespace distrpc::optim

// Makes this worker able to hold the parts of a DistributedOptimizer<Opt> that other workers
// build. Needed only in binaries that never construct a DistributedOptimizer<Opt> themselves
// (a binary that constructs one serves it too).
//   DISTRPC_REGISTER_OPTIMIZER(torch::optim::Adam);
#define DISTRPC_REGISTER_OPTIMIZER(...)                                                       \
  [[maybe_unused]] static const bool DISTRPC_REGISTER_CAT(distrpc_optimizer_reg_, __LINE__) = \
      ::distrpc::optim::detail::register_optimizer<__VA_ARGS__>()
