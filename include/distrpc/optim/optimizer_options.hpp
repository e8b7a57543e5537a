// Which libtorch optimizers DistributedOptimizer takes, and how their options travel to the
// workers that own the parameters (docs/dist_optim.md).
//
// optimizer_traits<Opt> maps an optimizer type to its options type (torch::optim::SGD ->
// torch::optim::SGDOptions); OptionsOf<Opt> names it. The options go to each owner inside
// nn::WireOptions<O> (the wrapper RemoteModule's constructor arguments use), written field by
// field by an nn::OptionsCodec<O> below: every field of SGD, Adam, AdamW, Adagrad and RMSprop
// options, so the owner's optimizer is configured exactly as the caller's would be.
//
// Another optimizer (a torch::optim::Optimizer subclass of your own, constructible from
// (std::vector<at::Tensor>, const MyOptions&)):
//   template <> struct distrpc::optim::optimizer_traits<MyOptim> {
//     using options_type = MyOptions;
//     static constexpr const char* name = "MyOptim";
//   };
//   template <> struct distrpc::nn::OptionsCodec<MyOptions> { ... save / load ... };
#pragma once

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <tuple>

#include "distrpc/nn/module_options.hpp"

namespace distrpc::optim {

// Specialized for each optimizer DistributedOptimizer takes; the primary template is empty on
// purpose (what supported_optimizer detects).
template <class Opt>
struct optimizer_traits {};

template <>
struct optimizer_traits<torch::optim::SGD> {
  using options_type = torch::optim::SGDOptions;
  static constexpr const char* name = "SGD";
};
template <>
struct optimizer_traits<torch::optim::Adam> {
  using options_type = torch::optim::AdamOptions;
  static constexpr const char* name = "Adam";
};
template <>
struct optimizer_traits<torch::optim::AdamW> {
  using options_type = torch::optim::AdamWOptions;
  static constexpr const char* name = "AdamW";
};
template <>
struct optimizer_traits<torch::optim::Adagrad> {
  using options_type = torch::optim::AdagradOptions;
  static constexpr const char* name = "Adagrad";
};
template <>
struct optimizer_traits<torch::optim::RMSprop> {
  using options_type = torch::optim::RMSpropOptions;
  static constexpr const char* name = "RMSprop";
};

// Opt's options type: torch::optim::SGDOptions for torch::optim::SGD.
template <class Opt>
using OptionsOf = typename optimizer_traits<Opt>::options_type;

// An optimizer with traits whose options can travel, and that can be built from the owner's
// parameters and those options.
template <class Opt>
concept supported_optimizer = requires {
  typename optimizer_traits<Opt>::options_type;
  { optimizer_traits<Opt>::name } -> std::convertible_to<const char*>;
} && nn::has_options_codec<OptionsOf<Opt>> &&
    std::is_constructible_v<Opt, std::vector<at::Tensor>, const OptionsOf<Opt>&> &&
    std::is_base_of_v<torch::optim::Optimizer, Opt>;

}  // namespace distrpc::optim

namespace distrpc::nn {

// ---- the codecs of the optimizers' options (every field, in declaration order) -----------------

template <>
struct OptionsCodec<torch::optim::SGDOptions> {
  using O = torch::optim::SGDOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.lr(), o.momentum(), o.dampening(), o.weight_decay(), o.nesterov());
  }
  template <class Archive>
  static O load(Archive& ar) {
    double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
    bool nesterov = false;
    ar(lr, momentum, dampening, weight_decay, nesterov);
    return O(lr)
        .momentum(momentum)
        .dampening(dampening)
        .weight_decay(weight_decay)
        .nesterov(nesterov);
  }
};

namespace detail {

// Adam and AdamW options have the same fields (their defaults differ: weight_decay).
template <class O>
struct AdamFamilyCodec {
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
       o.amsgrad());
  }
  template <class Archive>
  static O load(Archive& ar) {
    double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
    bool amsgrad = false;
    ar(lr, beta1, beta2, eps, weight_decay, amsgrad);
    return O(lr)
        .betas(std::make_tuple(beta1, beta2))
        .eps(eps)
        .weight_decay(weight_decay)
        .amsgrad(amsgrad);
  }
};

}  // namespace detail

template <>
struct OptionsCodec<torch::optim::AdamOptions>
    : detail::AdamFamilyCodec<torch::optim::AdamOptions> {};
template <>
struct OptionsCodec<torch::optim::AdamWOptions>
    : detail::AdamFamilyCodec<torch::optim::AdamWOptions> {};

template <>
struct OptionsCodec<torch::optim::AdagradOptions> {
  using O = torch::optim::AdagradOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.lr(), o.lr_decay(), o.weight_decay(), o.initial_accumulator_value(), o.eps());
  }
  template <class Archive>
  static O load(Archive& ar) {
    double lr = 0, lr_decay = 0, weight_decay = 0, initial = 0, eps = 0;
    ar(lr, lr_decay, weight_decay, initial, eps);
    return O(lr)
        .lr_decay(lr_decay)
        .weight_decay(weight_decay)
        .initial_accumulator_value(initial)
        .eps(eps);
  }
};

template <>
struct OptionsCodec<torch::optim::RMSpropOptions> {
  using O = torch::optim::RMSpropOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.lr(), o.alpha(), o.eps(), o.weight_decay(), o.momentum(), o.centered());
  }
  template <class Archive>
  static O load(Archive& ar) {
    double lr = 0, alpha = 0, eps = 0, weight_decay = 0, momentum = 0;
    bool centered = false;
    ar(lr, alpha, eps, weight_decay, momentum, centered);
    return O(lr)
        .alpha(alpha)
        .eps(eps)
        .weight_decay(weight_decay)
        .momentum(momentum)
        .centered(centered);
  }
};

}  // namespace distrpc::nn
