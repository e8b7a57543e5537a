// ReduceOp: the reduction a collective applies (PyTorch's torch.distributed.ReduceOp), with
// PREMUL_SUM's factor, and reduce_into, the local step a CPU backend repeats per incoming
// contribution. Values compare by kind and factor, and travel with distrpc::wire::encode like any
// value (a tensor factor as a tensor), so ops can be stored and sent like enums.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

#include <ATen/ATen.h>

#include <distrpc/wire/errors.hpp>
#include <distrpc/wire/tensor_codec.hpp>

namespace distrpc::dist {

class ReduceOp {
 public:
  // PyTorch's numbering (c10d::ReduceOp::RedOpType), so a kind converts to the same integer.
  enum Kind : std::uint8_t {
    SUM = 0,
    AVG = 1,
    PRODUCT = 2,
    MIN = 3,
    MAX = 4,
    BAND = 5,
    BOR = 6,
    BXOR = 7,
    PREMUL_SUM = 8,
    UNUSED = 9,
  };

  ReduceOp() = default;  // SUM, as PyTorch's default
  // Implicit, so `ReduceOp::MAX` is usable wherever a ReduceOp is expected.
  ReduceOp(Kind kind) : kind_(kind) {  // NOLINT(google-explicit-constructor)
    if (kind == PREMUL_SUM) {
      throw std::invalid_argument(
          "ReduceOp.PREMUL_SUM needs a factor: use make_premul_sum(factor) instead");
    }
    if (kind > PREMUL_SUM) {
      throw std::invalid_argument("ReduceOp: invalid kind " + std::to_string(int(kind)));
    }
  }

  Kind kind() const noexcept { return kind_; }
  bool has_scalar_factor() const noexcept { return std::holds_alternative<double>(factor_); }
  bool has_tensor_factor() const noexcept { return std::holds_alternative<at::Tensor>(factor_); }
  // The PREMUL_SUM factor; throws for any other kind (there is none to return).
  double scalar_factor() const {
    if (!has_scalar_factor()) throw std::logic_error(describe() + " has no scalar factor");
    return std::get<double>(factor_);
  }
  const at::Tensor& tensor_factor() const {
    if (!has_tensor_factor()) throw std::logic_error(describe() + " has no tensor factor");
    return std::get<at::Tensor>(factor_);
  }

  // PyTorch's printed names: "ReduceOp.SUM", ... and "ReduceOp.PREMUL_SUM".
  std::string describe() const { return std::string("ReduceOp.") + name(kind_); }

  static const char* name(Kind k) noexcept {
    switch (k) {
      case SUM:
        return "SUM";
      case AVG:
        return "AVG";
      case PRODUCT:
        return "PRODUCT";
      case MIN:
        return "MIN";
      case MAX:
        return "MAX";
      case BAND:
        return "BAND";
      case BOR:
        return "BOR";
      case BXOR:
        return "BXOR";
      case PREMUL_SUM:
        return "PREMUL_SUM";
      case UNUSED:
        break;
    }
    return "UNUSED";
  }

  // Value semantics: equal kinds, and for PREMUL_SUM equal factors (same scalar, or tensors of
  // the same dtype, shape and values). A scalar factor never equals a tensor factor.
  friend bool operator==(const ReduceOp& a, const ReduceOp& b) {
    if (a.kind_ != b.kind_) return false;
    if (a.factor_.index() != b.factor_.index()) return false;
    if (a.has_scalar_factor()) return std::get<double>(a.factor_) == std::get<double>(b.factor_);
    if (a.has_tensor_factor()) {
      const at::Tensor& x = std::get<at::Tensor>(a.factor_);
      const at::Tensor& y = std::get<at::Tensor>(b.factor_);
      return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() &&
             at::equal(x.cpu(), y.cpu());
    }
    return true;
  }
  // Against a bare kind only the kind counts (PyTorch's `op == ReduceOp.SUM`).
  friend bool operator==(const ReduceOp& a, Kind b) { return a.kind_ == b; }

  // cereal: the kind, which factor follows (0 none, 1 scalar, 2 tensor), then the factor. Reading
  // refuses a kind PyTorch lacks and a factor that does not fit the kind (DecodeError).
  template <class Archive>
  void save(Archive& ar) const {
    ar(static_cast<std::uint8_t>(kind_), static_cast<std::uint8_t>(factor_.index()));
    if (has_scalar_factor()) ar(std::get<double>(factor_));
    if (has_tensor_factor()) ar(std::get<at::Tensor>(factor_));
  }
  template <class Archive>
  void load(Archive& ar) {
    std::uint8_t kind = 0;
    std::uint8_t tag = 0;
    ar(kind, tag);
    if (kind > PREMUL_SUM) {
      throw wire::DecodeError("ReduceOp: invalid kind " + std::to_string(int(kind)));
    }
    if (tag > 2 || (kind == PREMUL_SUM) != (tag != 0)) {
      throw wire::DecodeError(std::string("ReduceOp: ") + name(Kind(kind)) + " with factor tag " +
                              std::to_string(int(tag)));
    }
    kind_ = Kind(kind);
    if (tag == 0) {
      factor_ = std::monostate{};
    } else if (tag == 1) {
      double f = 0;
      ar(f);
      factor_ = f;
    } else {
      at::Tensor f;
      ar(f);
      if (!f.defined() || f.numel() != 1) {
        throw wire::DecodeError("ReduceOp: PREMUL_SUM with an invalid factor tensor");
      }
      factor_ = std::move(f);
    }
  }

  friend ReduceOp make_premul_sum(double factor);
  friend ReduceOp make_premul_sum(const at::Tensor& factor);

 private:
  struct PremulTag {};
  template <class F>
  ReduceOp(PremulTag, F factor) : kind_(PREMUL_SUM), factor_(std::move(factor)) {}

  Kind kind_ = SUM;
  std::variant<std::monostate, double, at::Tensor> factor_;
};

// PyTorch's _make_nccl_premul_sum: every contribution is multiplied by factor before summing.
inline ReduceOp make_premul_sum(double factor) {
  return ReduceOp(ReduceOp::PremulTag{}, factor);
}
// A one-element floating-point tensor; it is kept (not copied), as PyTorch keeps it.
inline ReduceOp make_premul_sum(const at::Tensor& factor) {
  if (!factor.defined()) {
    throw std::invalid_argument("make_premul_sum: the factor tensor is undefined");
  }
  if (factor.numel() != 1) {
    throw std::invalid_argument("make_premul_sum: the factor tensor must have one element, got " +
                                std::to_string(factor.numel()));
  }
  if (!at::isFloatingType(factor.scalar_type())) {
    throw std::invalid_argument(
        std::string("make_premul_sum: the factor tensor must be floating point, got ") +
        c10::toString(factor.scalar_type()));
  }
  return ReduceOp(ReduceOp::PremulTag{}, factor);
}

namespace detail {

inline void check_reduce_operands(const at::Tensor& acc, const at::Tensor& x, const char* what) {
  if (!acc.defined() || !x.defined()) {
    throw std::invalid_argument(std::string(what) + ": " +
                                (acc.defined() ? "the input" : "the accumulator") +
                                " is undefined");
  }
  if (acc.scalar_type() != x.scalar_type()) {
    // PyTorch's text for the same mistake in a collective.
    throw std::invalid_argument(
        std::string("Invalid usage of tensors with different dtypes Found ") +
        c10::toString(acc.scalar_type()) + " and " + c10::toString(x.scalar_type()));
  }
  if (acc.sizes() != x.sizes()) {
    throw std::invalid_argument(std::string(what) + ": the accumulator has shape " +
                                c10::str(acc.sizes()) + " but the input has shape " +
                                c10::str(x.sizes()));
  }
}

// The factor as a 0-dim tensor of x's dtype and device, so multiplying keeps x's dtype and shape.
inline at::Tensor factor_like(const at::Tensor& factor, const at::Tensor& x) {
  return factor.reshape({}).to(x.device(), x.scalar_type());
}

// PyTorch refuses these on complex tensors (distributed_c10d.supports_complex).
inline bool supports_complex(ReduceOp::Kind k) {
  return k == ReduceOp::SUM || k == ReduceOp::AVG || k == ReduceOp::PREMUL_SUM;
}

}  // namespace detail

// Checks that op can reduce tensors of dtype t; the texts are PyTorch's where it has one.
inline void check_reduce_dtype(const ReduceOp& op, at::ScalarType t) {
  const ReduceOp::Kind k = op.kind();
  const std::string dtype = c10::toString(t);
  if (at::isComplexType(t) && !detail::supports_complex(k)) {
    throw std::invalid_argument(std::string("all_reduce does not support ") + op.describe() +
                                " on complex tensors");
  }
  if ((k == ReduceOp::BAND || k == ReduceOp::BOR || k == ReduceOp::BXOR) &&
      !at::isIntegralType(t, /*includeBool=*/true)) {
    throw std::invalid_argument("Cannot use " + op.describe() + " with non-integral dtype " +
                                dtype);
  }
  if (t == at::kBool && k == ReduceOp::AVG) {
    throw std::invalid_argument("Cannot use ReduceOp.AVG with boolean inputs");
  }
  if (k == ReduceOp::AVG && at::isIntegralType(t, /*includeBool=*/false)) {
    throw std::invalid_argument("Cannot use ReduceOp.AVG with integral dtype " + dtype +
                                ": the mean is not representable");
  }
  if (k == ReduceOp::PREMUL_SUM && !at::isFloatingType(t) && !at::isComplexType(t)) {
    throw std::invalid_argument("Cannot use ReduceOp.PREMUL_SUM with non-floating-point dtype " +
                                dtype);
  }
}

// Starts a reduction from this process's own contribution: a copy (PREMUL_SUM: times factor).
inline at::Tensor start_reduction(const at::Tensor& x, const ReduceOp& op) {
  if (!x.defined()) throw std::invalid_argument("start_reduction: the input is undefined");
  check_reduce_dtype(op, x.scalar_type());
  if (op.kind() == ReduceOp::PREMUL_SUM) {
    return op.has_scalar_factor() ? x * op.scalar_factor()
                                  : x * detail::factor_like(op.tensor_factor(), x);
  }
  return x.clone();
}

// acc = acc (op) x, in place, with ATen kernels. For AVG this sums (finish_reduction divides);
// for PREMUL_SUM x is multiplied by the factor first. Bool follows PyTorch: SUM is logical or,
// PRODUCT logical and, MIN/MAX/BAND/BOR/BXOR as for integers.
inline void reduce_into(at::Tensor& acc, const at::Tensor& x, const ReduceOp& op) {
  detail::check_reduce_operands(acc, x, "reduce_into");
  check_reduce_dtype(op, acc.scalar_type());
  const bool is_bool = acc.scalar_type() == at::kBool;
  switch (op.kind()) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      if (is_bool)
        acc.logical_or_(x);
      else
        acc.add_(x);
      return;
    case ReduceOp::PRODUCT:
      if (is_bool)
        acc.logical_and_(x);
      else
        acc.mul_(x);
      return;
    case ReduceOp::MIN:
      at::minimum_out(acc, acc, x);
      return;
    case ReduceOp::MAX:
      at::maximum_out(acc, acc, x);
      return;
    case ReduceOp::BAND:
      acc.bitwise_and_(x);
      return;
    case ReduceOp::BOR:
      acc.bitwise_or_(x);
      return;
    case ReduceOp::BXOR:
      acc.bitwise_xor_(x);
      return;
    case ReduceOp::PREMUL_SUM:
      if (op.has_scalar_factor()) {
        acc.add_(x, op.scalar_factor());
      } else {
        acc.add_(x * detail::factor_like(op.tensor_factor(), x));
      }
      return;
    case ReduceOp::UNUSED:
      break;
  }
  throw std::invalid_argument("reduce_into: invalid " + op.describe());
}

// Ends a reduction over world_size contributions: AVG divides; every other op is already done.
inline void finish_reduction(at::Tensor& acc, const ReduceOp& op, std::int64_t world_size) {
  if (world_size < 1) {
    throw std::invalid_argument("finish_reduction: world_size must be at least 1, got " +
                                std::to_string(world_size));
  }
  if (op.kind() == ReduceOp::AVG) acc.div_(world_size);
}

}  // namespace distrpc::dist
