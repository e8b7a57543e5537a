// libtorch's module options structs on the wire: what lets
//   RemoteModule<I>::create<torch::nn::Linear>("worker1/cpu",
//                                              torch::nn::LinearOptions(64, 64).bias(false))
// send the options themselves to the worker that builds the module (docs/remote_module.md,
// "Options structs").
//
// An options struct has no default constructor (LinearOptions needs its two sizes), while a
// decoded call argument is default-constructed first and then read. So options travel inside
// WireOptions<O>, which is empty until decoded, and each type's fields are written and read by
// OptionsCodec<O>: save writes every field, load builds O from the required fields, then sets
// the others through their setters. The accessors used are those of libtorch 1.13 and 2.x alike;
// the variant fields (padding, padding_mode, nonlinearity) and the optional ones are written as
// a tag and a value, so neither c10::variant nor std::variant appears in the format.
//
// Supported: LinearOptions, Conv1d/2d/3dOptions (ConvOptions<D>), EmbeddingOptions,
// LayerNormOptions, BatchNormOptions (= BatchNorm1d/2d/3dOptions), DropoutOptions
// (= Dropout2d/3d, AlphaDropout, FeatureAlphaDropout options), LSTMOptions, GRUOptions,
// RNNOptions. Another options struct: specialize OptionsCodec<O> (below); RemoteModule::create
// then takes it like these.
#pragma once

#include <torch/enum.h>
#include <torch/expanding_array.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/options/conv.h>
#include <torch/nn/options/dropout.h>
#include <torch/nn/options/embedding.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/options/normalization.h>
#include <torch/nn/options/rnn.h>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "distrpc/function_id.hpp"
#include "distrpc/wire.hpp"

namespace distrpc::nn {

// How an options struct O is written and read. Specialize it for a struct of your own:
//   template <> struct distrpc::nn::OptionsCodec<MyOptions> {
//     template <class Archive> static void save(Archive& ar, const MyOptions& o) {
//       ar(o.size(), o.scale());
//     }
//     template <class Archive> static MyOptions load(Archive& ar) {
//       int64_t size = 0; double scale = 0;
//       ar(size, scale);
//       return MyOptions(size).scale(scale);
//     }
//   };
// The primary template is empty on purpose: "no codec" is what has_options_codec detects.
template <class O>
struct OptionsCodec {};

template <class O>
concept has_options_codec = requires(wire::OutputArchive& out, wire::InputArchive& in, const O& o) {
  OptionsCodec<O>::save(out, o);
  { OptionsCodec<O>::load(in) } -> std::same_as<O>;
};

// An options struct as a call argument: empty until decoded (O itself may have no default
// constructor). Converts implicitly from O, so it can be passed where an O is meant to travel.
template <class O>
class WireOptions {
  static_assert(has_options_codec<O>,
                "distrpc::nn::WireOptions<O>: O has no wire serialization: specialize "
                "distrpc::nn::OptionsCodec<O> with `template <class Archive> static void "
                "save(Archive&, const O&)` and `template <class Archive> static O "
                "load(Archive&)` (see distrpc/nn/module_options.hpp)");

 public:
  using options_type = O;

  WireOptions() = default;
  WireOptions(O options) : value_(std::move(options)) {}  // NOLINT: implicit on purpose

  bool has_value() const noexcept { return value_.has_value(); }
  const O& get() const {
    if (!value_) {
      throw std::logic_error("distrpc::nn::WireOptions<" +
                             std::string(::distrpc::detail::type_name<O>()) +
                             ">: no options held (a default-made value that was never decoded)");
    }
    return *value_;
  }

  template <class Archive>
  void save(Archive& ar) const {
    OptionsCodec<O>::save(ar, get());
  }
  template <class Archive>
  void load(Archive& ar) {
    value_.emplace(OptionsCodec<O>::load(ar));
  }

 private:
  std::optional<O> value_;
};

namespace detail {

// Field helpers shared by the codecs. Variants and optionals are reached through ADL
// (holds_alternative, has_value), which finds c10's in libtorch 1.13 and std's in 2.x.

template <class Archive, std::size_t D>
void save_expanding(Archive& ar, const torch::ExpandingArray<D>& a) {
  for (const int64_t v : *a) ar(v);
}
template <std::size_t D, class Archive>
torch::ExpandingArray<D> load_expanding(Archive& ar) {
  std::array<int64_t, D> v{};
  for (auto& x : v) ar(x);
  return torch::ExpandingArray<D>(v);
}

// An optional field: a presence flag, then the value.
template <class Archive, class Opt>
void save_optional(Archive& ar, const Opt& o) {
  const bool present = o.has_value();
  ar(present);
  if (present) ar(*o);
}
// Reads an optional field written by save_optional into `set` (the options' setter): the value,
// or an empty optional of the field's own type (c10::optional or std::optional).
template <class T, class Opt, class Archive, class Set>
void load_optional(Archive& ar, Set&& set) {
  bool present = false;
  ar(present);
  if (present) {
    T v{};
    ar(v);
    set(Opt(v));
  } else {
    set(Opt());
  }
}

[[noreturn]] inline void bad_tag(const char* options, const char* field, std::uint8_t tag) {
  throw wire::DecodeError(std::string("torch::nn::") + options + ": unknown " + field + " tag " +
                          std::to_string(tag) +
                          " (sender and receiver disagree on the options format)");
}

// Conv padding: an ExpandingArray<D>, or the modes kValid / kSame.
template <std::size_t D, class Archive, class Padding>
void save_conv_padding(Archive& ar, const Padding& p) {
  if (holds_alternative<torch::enumtype::kValid>(p)) {
    ar(std::uint8_t{1});
  } else if (holds_alternative<torch::enumtype::kSame>(p)) {
    ar(std::uint8_t{2});
  } else {
    ar(std::uint8_t{0});
    save_expanding(ar, *get_if<torch::ExpandingArray<D>>(&p));
  }
}
template <std::size_t D, class Options, class Archive>
void load_conv_padding(Archive& ar, Options& o) {
  std::uint8_t tag = 0;
  ar(tag);
  switch (tag) {
    case 0:
      o.padding(load_expanding<D>(ar));
      return;
    case 1:
      o.padding(torch::kValid);
      return;
    case 2:
      o.padding(torch::kSame);
      return;
    default:
      bad_tag("ConvOptions", "padding", tag);
  }
}

template <class Archive, class Mode>
void save_padding_mode(Archive& ar, const Mode& m) {
  std::uint8_t tag = 0;
  if (holds_alternative<torch::enumtype::kReflect>(m)) tag = 1;
  if (holds_alternative<torch::enumtype::kReplicate>(m)) tag = 2;
  if (holds_alternative<torch::enumtype::kCircular>(m)) tag = 3;
  ar(tag);
}
template <class Options, class Archive>
void load_padding_mode(Archive& ar, Options& o) {
  std::uint8_t tag = 0;
  ar(tag);
  switch (tag) {
    case 0:
      o.padding_mode(torch::kZeros);
      return;
    case 1:
      o.padding_mode(torch::kReflect);
      return;
    case 2:
      o.padding_mode(torch::kReplicate);
      return;
    case 3:
      o.padding_mode(torch::kCircular);
      return;
    default:
      bad_tag("ConvOptions", "padding_mode", tag);
  }
}

// The fields LSTM, GRU and RNN options share, after input_size and hidden_size.
template <class Archive, class O>
void save_rnn_common(Archive& ar, const O& o) {
  ar(o.num_layers(), o.bias(), o.batch_first(), o.dropout(), o.bidirectional());
}
template <class Archive, class O>
void load_rnn_common(Archive& ar, O& o) {
  int64_t num_layers = 0;
  bool bias = false, batch_first = false, bidirectional = false;
  double dropout = 0;
  ar(num_layers, bias, batch_first, dropout, bidirectional);
  o.num_layers(num_layers)
      .bias(bias)
      .batch_first(batch_first)
      .dropout(dropout)
      .bidirectional(bidirectional);
}

}  // namespace detail

// ---- the codecs of libtorch's options -----------------------------------------------------------

template <>
struct OptionsCodec<torch::nn::LinearOptions> {
  using O = torch::nn::LinearOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.in_features(), o.out_features(), o.bias());
  }
  template <class Archive>
  static O load(Archive& ar) {
    int64_t in = 0, out = 0;
    bool bias = false;
    ar(in, out, bias);
    return O(in, out).bias(bias);
  }
};

template <std::size_t D>
struct OptionsCodec<torch::nn::ConvOptions<D>> {
  using O = torch::nn::ConvOptions<D>;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.in_channels(), o.out_channels());
    detail::save_expanding(ar, o.kernel_size());
    detail::save_expanding(ar, o.stride());
    detail::save_conv_padding<D>(ar, o.padding());
    detail::save_expanding(ar, o.dilation());
    ar(o.groups(), o.bias());
    detail::save_padding_mode(ar, o.padding_mode());
  }
  template <class Archive>
  static O load(Archive& ar) {
    int64_t in = 0, out = 0;
    ar(in, out);
    O o(in, out, detail::load_expanding<D>(ar));
    o.stride(detail::load_expanding<D>(ar));
    detail::load_conv_padding<D>(ar, o);
    o.dilation(detail::load_expanding<D>(ar));
    int64_t groups = 0;
    bool bias = false;
    ar(groups, bias);
    o.groups(groups).bias(bias);
    detail::load_padding_mode(ar, o);
    return o;
  }
};

template <>
struct OptionsCodec<torch::nn::EmbeddingOptions> {
  using O = torch::nn::EmbeddingOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.num_embeddings(), o.embedding_dim());
    detail::save_optional(ar, o.padding_idx());
    detail::save_optional(ar, o.max_norm());
    ar(o.norm_type(), o.scale_grad_by_freq(), o.sparse(), o._weight());
  }
  template <class Archive>
  static O load(Archive& ar) {
    int64_t num = 0, dim = 0;
    ar(num, dim);
    O o(num, dim);
    using PaddingIdx = std::decay_t<decltype(o.padding_idx())>;
    using MaxNorm = std::decay_t<decltype(o.max_norm())>;
    detail::load_optional<int64_t, PaddingIdx>(ar, [&](PaddingIdx v) { o.padding_idx(v); });
    detail::load_optional<double, MaxNorm>(ar, [&](MaxNorm v) { o.max_norm(v); });
    double norm_type = 0;
    bool scale_grad_by_freq = false, sparse = false;
    at::Tensor weight;
    ar(norm_type, scale_grad_by_freq, sparse, weight);
    o.norm_type(norm_type).scale_grad_by_freq(scale_grad_by_freq).sparse(sparse)._weight(weight);
    return o;
  }
};

template <>
struct OptionsCodec<torch::nn::LayerNormOptions> {
  using O = torch::nn::LayerNormOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.normalized_shape(), o.eps(), o.elementwise_affine());
  }
  template <class Archive>
  static O load(Archive& ar) {
    std::vector<int64_t> shape;
    double eps = 0;
    bool affine = false;
    ar(shape, eps, affine);
    return O(std::move(shape)).eps(eps).elementwise_affine(affine);
  }
};

template <>
struct OptionsCodec<torch::nn::BatchNormOptions> {
  using O = torch::nn::BatchNormOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.num_features(), o.eps());
    detail::save_optional(ar, o.momentum());
    ar(o.affine(), o.track_running_stats());
  }
  template <class Archive>
  static O load(Archive& ar) {
    int64_t num_features = 0;
    double eps = 0;
    ar(num_features, eps);
    O o(num_features);
    o.eps(eps);
    using Momentum = std::decay_t<decltype(o.momentum())>;
    detail::load_optional<double, Momentum>(ar, [&](Momentum v) { o.momentum(v); });
    bool affine = false, track = false;
    ar(affine, track);
    o.affine(affine).track_running_stats(track);
    return o;
  }
};

template <>
struct OptionsCodec<torch::nn::DropoutOptions> {
  using O = torch::nn::DropoutOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.p(), o.inplace());
  }
  template <class Archive>
  static O load(Archive& ar) {
    double p = 0;
    bool inplace = false;
    ar(p, inplace);
    return O(p).inplace(inplace);
  }
};

template <>
struct OptionsCodec<torch::nn::LSTMOptions> {
  using O = torch::nn::LSTMOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.input_size(), o.hidden_size());
    detail::save_rnn_common(ar, o);
    ar(o.proj_size());
  }
  template <class Archive>
  static O load(Archive& ar) {
    int64_t input = 0, hidden = 0;
    ar(input, hidden);
    O o(input, hidden);
    detail::load_rnn_common(ar, o);
    int64_t proj_size = 0;
    ar(proj_size);
    o.proj_size(proj_size);
    return o;
  }
};

template <>
struct OptionsCodec<torch::nn::GRUOptions> {
  using O = torch::nn::GRUOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.input_size(), o.hidden_size());
    detail::save_rnn_common(ar, o);
  }
  template <class Archive>
  static O load(Archive& ar) {
    int64_t input = 0, hidden = 0;
    ar(input, hidden);
    O o(input, hidden);
    detail::load_rnn_common(ar, o);
    return o;
  }
};

template <>
struct OptionsCodec<torch::nn::RNNOptions> {
  using O = torch::nn::RNNOptions;
  template <class Archive>
  static void save(Archive& ar, const O& o) {
    ar(o.input_size(), o.hidden_size());
    detail::save_rnn_common(ar, o);
    const bool relu = holds_alternative<torch::enumtype::kReLU>(o.nonlinearity());
    ar(static_cast<std::uint8_t>(relu ? 1 : 0));
  }
  template <class Archive>
  static O load(Archive& ar) {
    int64_t input = 0, hidden = 0;
    ar(input, hidden);
    O o(input, hidden);
    detail::load_rnn_common(ar, o);
    std::uint8_t tag = 0;
    ar(tag);
    switch (tag) {
      case 0:
        o.nonlinearity(torch::kTanh);
        break;
      case 1:
        o.nonlinearity(torch::kReLU);
        break;
      default:
        detail::bad_tag("RNNOptions", "nonlinearity", tag);
    }
    return o;
  }
};

}  // namespace distrpc::nn
