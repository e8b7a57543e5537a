// The small ATen value types that appear in operator signatures: c10::Scalar, at::ScalarType,
// at::Layout, at::MemoryFormat and c10::Device. Enums are range-checked on receipt: an out-of-range
// ScalarType or DeviceType indexes tables inside libtorch and must never reach it.
// Record layouts: docs/wire-protocol.md, "ATen values".
#pragma once

#include <distrpc/wire/archive.hpp>

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/Layout.h>
#include <c10/core/MemoryFormat.h>
#include <c10/core/Scalar.h>
#include <c10/core/ScalarType.h>

#include <concepts>
#include <cstdint>
#include <string>

namespace distrpc::wire {

namespace detail {

enum class ScalarKind : std::uint8_t { Double = 0, Int = 1, ComplexDouble = 2, Bool = 3 };

template <class Enum>
inline Enum checked_enum(std::int8_t value, Enum num_options, const char* what) {
  if (value < 0 || value >= static_cast<std::int8_t>(num_options)) {
    decode_fail(std::string(what) + " value " + std::to_string(value) + " out of range [0, " +
                std::to_string(static_cast<int>(num_options)) + ")");
  }
  return static_cast<Enum>(value);
}

}  // namespace detail

// Scalar: u8 kind | f64, i64, (f64 real, f64 imag) or u8.
template <class T>
requires std::same_as<T, c10::Scalar>
inline void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& s) {
  if (s.isSymbolic()) {
    throw EncodeError(
        "cannot encode a symbolic Scalar (SymInt or SymFloat): only concrete values "
        "can be sent");
  }
  if (s.isBoolean()) {
    ar.write(static_cast<std::uint8_t>(detail::ScalarKind::Bool));
    ar.write(static_cast<std::uint8_t>(s.toBool() ? 1 : 0));
  } else if (s.isComplex()) {
    const auto z = s.toComplexDouble();
    ar.write(static_cast<std::uint8_t>(detail::ScalarKind::ComplexDouble));
    ar.write(z.real());
    ar.write(z.imag());
  } else if (s.isIntegral(/*includeBool=*/false)) {
    ar.write(static_cast<std::uint8_t>(detail::ScalarKind::Int));
    ar.write(static_cast<std::int64_t>(s.toLong()));
  } else {
    ar.write(static_cast<std::uint8_t>(detail::ScalarKind::Double));
    ar.write(s.toDouble());
  }
}

inline void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, c10::Scalar& s) {
  const auto kind = ar.read<std::uint8_t>();
  switch (static_cast<detail::ScalarKind>(kind)) {
    case detail::ScalarKind::Double:
      s = c10::Scalar(ar.read<double>());
      return;
    case detail::ScalarKind::Int:
      s = c10::Scalar(ar.read<std::int64_t>());
      return;
    case detail::ScalarKind::ComplexDouble: {
      const auto re = ar.read<double>();
      const auto im = ar.read<double>();
      s = c10::Scalar(c10::complex<double>(re, im));
      return;
    }
    case detail::ScalarKind::Bool: {
      bool b = false;
      ar(b);
      s = c10::Scalar(b);
      return;
    }
  }
  detail::decode_fail("unknown Scalar kind " + std::to_string(kind));
}

// Enums travel as their int8 value (cereal's enum encoding), checked on receipt.
inline std::int8_t CEREAL_SAVE_MINIMAL_FUNCTION_NAME(const OutputArchive&,
                                                     const c10::ScalarType& t) {
  return static_cast<std::int8_t>(t);
}
inline void CEREAL_LOAD_MINIMAL_FUNCTION_NAME(const InputArchive&, c10::ScalarType& t,
                                              const std::int8_t& v) {
  t = detail::checked_enum(v, c10::ScalarType::NumOptions, "ScalarType");
}
inline std::int8_t CEREAL_SAVE_MINIMAL_FUNCTION_NAME(const OutputArchive&, const c10::Layout& l) {
  return static_cast<std::int8_t>(l);
}
inline void CEREAL_LOAD_MINIMAL_FUNCTION_NAME(const InputArchive&, c10::Layout& l,
                                              const std::int8_t& v) {
  l = detail::checked_enum(v, c10::Layout::NumOptions, "Layout");
}
inline std::int8_t CEREAL_SAVE_MINIMAL_FUNCTION_NAME(const OutputArchive&,
                                                     const c10::MemoryFormat& m) {
  return static_cast<std::int8_t>(m);
}
inline void CEREAL_LOAD_MINIMAL_FUNCTION_NAME(const InputArchive&, c10::MemoryFormat& m,
                                              const std::int8_t& v) {
  m = detail::checked_enum(v, c10::MemoryFormat::NumOptions, "MemoryFormat");
}

namespace detail {

inline void write_device(OutputArchive& ar, const c10::Device& d) {
  ar.write(static_cast<std::int8_t>(d.type()));
  ar.write(static_cast<std::int8_t>(d.index()));
}

inline c10::Device read_device(InputArchive& ar) {
  const auto type = ar.read<std::int8_t>();
  const auto index = ar.read<std::int8_t>();
  if (type < 0 || !c10::isValidDeviceType(static_cast<c10::DeviceType>(type))) {
    decode_fail("unknown device type " + std::to_string(type));
  }
  const auto device_type = static_cast<c10::DeviceType>(type);
  if (index < -1 || (device_type == c10::DeviceType::CPU && index > 0)) {
    decode_fail("device index " + std::to_string(index) + " is invalid for device type " +
                c10::DeviceTypeName(device_type));
  }
  return c10::Device(device_type, index);
}

}  // namespace detail

// Device: i8 type | i8 index.
template <class T>
requires std::same_as<T, c10::Device>
inline void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& d) {
  detail::write_device(ar, d);
}

inline void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, c10::Device& d) {
  d = detail::read_device(ar);
}

}  // namespace distrpc::wire

namespace cereal {

template <class Archive, class T>
requires std::same_as<T, c10::Scalar>
void CEREAL_SAVE_FUNCTION_NAME(Archive&, const T&) {
  static_assert(distrpc::wire::detail::dependent_false<Archive>,
                "c10::Scalar is serialized by distrpc::wire::OutputArchive only: use "
                "distrpc::wire::encode(message, values...)");
}

template <class Archive>
void CEREAL_LOAD_FUNCTION_NAME(Archive&, c10::Scalar&) {
  static_assert(distrpc::wire::detail::dependent_false<Archive>,
                "c10::Scalar is deserialized by distrpc::wire::InputArchive only: use "
                "distrpc::wire::decode(message, values...)");
}

}  // namespace cereal
