// c10::IValue in wire archives, so builtin ATen operators can be called by schema name with boxed
// arguments. Covered: None, bool, int, double, complex, string, Tensor (same identity rules as a
// plain tensor), Device, lists of int/double/complex/bool/Tensor, generic lists (with their element
// type, e.g. Tensor?[]) and tuples. Any other kind is refused with its name. Nesting is bounded.
// Record layouts: docs/wire-protocol.md, "IValues".
#pragma once

#include <distrpc/wire/archive.hpp>
#include <distrpc/wire/scalar_codec.hpp>
#include <distrpc/wire/tensor_codec.hpp>

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

#include <concepts>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace distrpc::wire {

namespace detail {

enum class IValueTag : std::uint8_t {
  None = 0,
  Bool = 1,
  Int = 2,
  Double = 3,
  ComplexDouble = 4,
  String = 5,
  Tensor = 6,
  IntList = 7,
  DoubleList = 8,
  BoolList = 9,
  TensorList = 10,
  GenericList = 11,
  Tuple = 12,
  Device = 13,
  ComplexDoubleList = 14,
};

// Element types of generic lists, recursively: u8 code [| operands].
enum class TypeCode : std::uint8_t {
  Any = 0,
  None = 1,
  Bool = 2,
  Int = 3,
  Float = 4,
  Complex = 5,
  String = 6,
  Tensor = 7,
  Number = 8,
  Optional = 9,  // | element type
  List = 10,     // | element type
  Tuple = 11,    // | u32 count | element types
  Device = 12,
};

inline void write_type(OutputArchive& ar, const c10::TypePtr& type) {
  NestingGuard<OutputArchive> guard(ar);
  const auto code = [&](TypeCode c) { ar.write(static_cast<std::uint8_t>(c)); };
  switch (type->kind()) {
    case c10::TypeKind::AnyType:
      return code(TypeCode::Any);
    case c10::TypeKind::NoneType:
      return code(TypeCode::None);
    case c10::TypeKind::BoolType:
      return code(TypeCode::Bool);
    case c10::TypeKind::IntType:
      return code(TypeCode::Int);
    case c10::TypeKind::FloatType:
      return code(TypeCode::Float);
    case c10::TypeKind::ComplexType:
      return code(TypeCode::Complex);
    case c10::TypeKind::StringType:
      return code(TypeCode::String);
    case c10::TypeKind::TensorType:
      return code(TypeCode::Tensor);
    case c10::TypeKind::NumberType:
      return code(TypeCode::Number);
    case c10::TypeKind::DeviceObjType:
      return code(TypeCode::Device);
    case c10::TypeKind::OptionalType:
      code(TypeCode::Optional);
      return write_type(ar, type->expectRef<c10::OptionalType>().getElementType());
    case c10::TypeKind::ListType:
      code(TypeCode::List);
      return write_type(ar, type->expectRef<c10::ListType>().getElementType());
    case c10::TypeKind::TupleType: {
      const auto& elements = type->expectRef<c10::TupleType>().elements();
      code(TypeCode::Tuple);
      ar.write(static_cast<std::uint32_t>(elements.size()));
      for (const auto& e : elements) write_type(ar, e);
      return;
    }
    default:
      throw EncodeError("cannot encode an IValue list of element type " + type->str() +
                        ": supported element types are Any, None, bool, int, float, complex, str, "
                        "Tensor, number, Device and Optional/List/Tuple of those");
  }
}

inline c10::TypePtr read_type(InputArchive& ar) {
  NestingGuard<InputArchive> guard(ar);
  const auto code = ar.read<std::uint8_t>();
  switch (static_cast<TypeCode>(code)) {
    case TypeCode::Any:
      return c10::AnyType::get();
    case TypeCode::None:
      return c10::NoneType::get();
    case TypeCode::Bool:
      return c10::BoolType::get();
    case TypeCode::Int:
      return c10::IntType::get();
    case TypeCode::Float:
      return c10::FloatType::get();
    case TypeCode::Complex:
      return c10::ComplexType::get();
    case TypeCode::String:
      return c10::StringType::get();
    case TypeCode::Tensor:
      return c10::TensorType::get();
    case TypeCode::Number:
      return c10::NumberType::get();
    case TypeCode::Device:
      return c10::DeviceObjType::get();
    case TypeCode::Optional: {
      c10::TypePtr element = read_type(ar);
      // libtorch asserts (rather than throws) on Optional[None].
      if (element->kind() == c10::TypeKind::NoneType) decode_fail("IValue type Optional[None]");
      return c10::OptionalType::create(std::move(element));
    }
    case TypeCode::List:
      return c10::ListType::create(read_type(ar));
    case TypeCode::Tuple: {
      const auto n = ar.read<std::uint32_t>();
      ar.check_count(n, 1, "tuple type element");
      std::vector<c10::TypePtr> elements;
      elements.reserve(n);
      for (std::uint32_t i = 0; i < n; ++i) elements.push_back(read_type(ar));
      return c10::TupleType::create(std::move(elements));
    }
  }
  decode_fail("unknown IValue type code " + std::to_string(code));
}

// Whether a decoded value belongs to a decoded element type (only the types read_type builds).
inline bool value_matches(const c10::IValue& v, const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::AnyType:
      return true;
    case c10::TypeKind::NoneType:
      return v.isNone();
    case c10::TypeKind::BoolType:
      return v.isBool();
    case c10::TypeKind::IntType:
      return v.isInt();
    case c10::TypeKind::FloatType:
      return v.isDouble();
    case c10::TypeKind::ComplexType:
      return v.isComplexDouble();
    case c10::TypeKind::StringType:
      return v.isString();
    case c10::TypeKind::TensorType:
      return v.isTensor();
    case c10::TypeKind::NumberType:
      return v.isInt() || v.isDouble() || v.isComplexDouble();
    case c10::TypeKind::DeviceObjType:
      return v.isDevice();
    case c10::TypeKind::OptionalType:
      return v.isNone() || value_matches(v, type->expectRef<c10::OptionalType>().getElementType());
    case c10::TypeKind::ListType: {
      if (!v.isList()) return false;
      const auto& want = type->expectRef<c10::ListType>().getElementType();
      return want->kind() == c10::TypeKind::AnyType || *v.toList().elementType() == *want;
    }
    case c10::TypeKind::TupleType: {
      if (!v.isTuple()) return false;
      const auto& want = type->expectRef<c10::TupleType>().elements();
      const auto& have = v.toTupleRef().elements();
      if (want.size() != have.size()) return false;
      for (std::size_t i = 0; i < want.size(); ++i) {
        if (!value_matches(have[i], want[i])) return false;
      }
      return true;
    }
    default:
      return false;
  }
}

inline void write_tag(OutputArchive& ar, IValueTag tag) {
  ar.write(static_cast<std::uint8_t>(tag));
}

inline void write_string(OutputArchive& ar, const std::string& s) {
  ar.write(static_cast<std::uint64_t>(s.size()));
  ar.write_bytes(s.data(), s.size());
}

inline void write_ivalue(OutputArchive& ar, const c10::IValue& v) {
  NestingGuard<OutputArchive> guard(ar);
  if (v.isNone()) {
    write_tag(ar, IValueTag::None);
  } else if (v.isBool()) {
    write_tag(ar, IValueTag::Bool);
    ar.write(static_cast<std::uint8_t>(v.toBool() ? 1 : 0));
  } else if (v.isInt()) {
    write_tag(ar, IValueTag::Int);
    ar.write(static_cast<std::int64_t>(v.toInt()));
  } else if (v.isDouble()) {
    write_tag(ar, IValueTag::Double);
    ar.write(v.toDouble());
  } else if (v.isComplexDouble()) {
    const auto z = v.toComplexDouble();
    write_tag(ar, IValueTag::ComplexDouble);
    ar.write(z.real());
    ar.write(z.imag());
  } else if (v.isString()) {
    write_tag(ar, IValueTag::String);
    write_string(ar, v.toStringRef());
  } else if (v.isTensor()) {
    write_tag(ar, IValueTag::Tensor);
    CEREAL_SAVE_FUNCTION_NAME(ar, v.toTensor());
  } else if (v.isDevice()) {
    write_tag(ar, IValueTag::Device);
    write_device(ar, v.toDevice());
  } else if (v.isIntList()) {
    const auto items = v.toListRef();
    write_tag(ar, IValueTag::IntList);
    ar.write(static_cast<std::uint64_t>(items.size()));
    for (const auto& e : items) ar.write(static_cast<std::int64_t>(e.toInt()));
  } else if (v.isDoubleList()) {
    const auto items = v.toListRef();
    write_tag(ar, IValueTag::DoubleList);
    ar.write(static_cast<std::uint64_t>(items.size()));
    for (const auto& e : items) ar.write(e.toDouble());
  } else if (v.isComplexDoubleList()) {
    const auto items = v.toListRef();
    write_tag(ar, IValueTag::ComplexDoubleList);
    ar.write(static_cast<std::uint64_t>(items.size()));
    for (const auto& e : items) {
      const auto z = e.toComplexDouble();
      ar.write(z.real());
      ar.write(z.imag());
    }
  } else if (v.isBoolList()) {
    const auto items = v.toListRef();
    write_tag(ar, IValueTag::BoolList);
    ar.write(static_cast<std::uint64_t>(items.size()));
    for (const auto& e : items) ar.write(static_cast<std::uint8_t>(e.toBool() ? 1 : 0));
  } else if (v.isTensorList()) {
    const auto items = v.toListRef();
    write_tag(ar, IValueTag::TensorList);
    ar.write(static_cast<std::uint64_t>(items.size()));
    for (const auto& e : items) CEREAL_SAVE_FUNCTION_NAME(ar, e.toTensor());
  } else if (v.isList()) {
    const auto list = v.toList();
    write_tag(ar, IValueTag::GenericList);
    write_type(ar, list.elementType());
    ar.write(static_cast<std::uint64_t>(list.size()));
    for (const auto& e : v.toListRef()) write_ivalue(ar, e);
  } else if (v.isTuple()) {
    const auto& elements = v.toTupleRef().elements();
    write_tag(ar, IValueTag::Tuple);
    ar.write(static_cast<std::uint64_t>(elements.size()));
    for (const auto& e : elements) write_ivalue(ar, e);
  } else {
    throw EncodeError("cannot encode an IValue of kind " + v.tagKind() +
                      ": supported kinds are None, Bool, Int, Double, ComplexDouble, String, "
                      "Tensor, Device, GenericList (incl. int/double/bool/Tensor lists) and Tuple");
  }
}

template <class T, class Read>
inline c10::List<T> read_typed_list(InputArchive& ar, std::uint64_t min_bytes_each, Read read) {
  const auto n = ar.read<std::uint64_t>();
  ar.check_count(n, min_bytes_each, "IValue list element");
  c10::List<T> list;
  list.reserve(static_cast<std::size_t>(n));
  for (std::uint64_t i = 0; i < n; ++i) list.push_back(read());
  return list;
}

inline c10::IValue read_ivalue(InputArchive& ar) {
  NestingGuard<InputArchive> guard(ar);
  const auto tag = ar.read<std::uint8_t>();
  const auto read_bool = [&] {
    bool b = false;
    ar(b);
    return b;
  };
  const auto read_complex = [&] {
    const auto re = ar.read<double>();
    const auto im = ar.read<double>();
    return c10::complex<double>(re, im);
  };
  const auto read_tensor = [&] {
    at::Tensor t;
    CEREAL_LOAD_FUNCTION_NAME(ar, t);
    return t;
  };
  switch (static_cast<IValueTag>(tag)) {
    case IValueTag::None:
      return c10::IValue();
    case IValueTag::Bool:
      return c10::IValue(read_bool());
    case IValueTag::Int:
      return c10::IValue(ar.read<std::int64_t>());
    case IValueTag::Double:
      return c10::IValue(ar.read<double>());
    case IValueTag::ComplexDouble:
      return c10::IValue(read_complex());
    case IValueTag::String: {
      const auto n = ar.read<std::uint64_t>();
      ar.check_count(n, 1, "string byte");
      std::string s(static_cast<std::size_t>(n), '\0');
      ar.read_bytes(s.data(), s.size());
      return c10::IValue(std::move(s));
    }
    case IValueTag::Tensor:
      return c10::IValue(read_tensor());
    case IValueTag::Device:
      return c10::IValue(read_device(ar));
    case IValueTag::IntList:
      return c10::IValue(
          read_typed_list<std::int64_t>(ar, 8, [&] { return ar.read<std::int64_t>(); }));
    case IValueTag::DoubleList:
      return c10::IValue(read_typed_list<double>(ar, 8, [&] { return ar.read<double>(); }));
    case IValueTag::ComplexDoubleList:
      return c10::IValue(read_typed_list<c10::complex<double>>(ar, 16, read_complex));
    case IValueTag::BoolList:
      return c10::IValue(read_typed_list<bool>(ar, 1, read_bool));
    case IValueTag::TensorList:
      return c10::IValue(read_typed_list<at::Tensor>(ar, 1, read_tensor));
    case IValueTag::GenericList: {
      c10::TypePtr element_type = read_type(ar);
      const auto n = ar.read<std::uint64_t>();
      ar.check_count(n, 1, "IValue list element");
      c10::impl::GenericList list(element_type);
      list.reserve(static_cast<std::size_t>(n));
      for (std::uint64_t i = 0; i < n; ++i) {
        c10::IValue e = read_ivalue(ar);
        if (!value_matches(e, element_type)) {
          decode_fail("IValue list of element type " + element_type->str() + " holds a " +
                      e.tagKind() + " at index " + std::to_string(i));
        }
        list.push_back(std::move(e));
      }
      return c10::IValue(std::move(list));
    }
    case IValueTag::Tuple: {
      const auto n = ar.read<std::uint64_t>();
      ar.check_count(n, 1, "IValue tuple element");
      std::vector<c10::IValue> elements;
      elements.reserve(static_cast<std::size_t>(n));
      for (std::uint64_t i = 0; i < n; ++i) elements.push_back(read_ivalue(ar));
      return c10::IValue(c10::ivalue::Tuple::create(std::move(elements)));
    }
  }
  decode_fail("unknown IValue tag " + std::to_string(tag));
}

}  // namespace detail

template <class T>
requires std::same_as<T, c10::IValue>
inline void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& v) {
  detail::write_ivalue(ar, v);
}

inline void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, c10::IValue& v) {
  v = detail::read_ivalue(ar);
}

}  // namespace distrpc::wire

namespace cereal {

template <class Archive, class T>
requires std::same_as<T, c10::IValue>
void CEREAL_SAVE_FUNCTION_NAME(Archive&, const T&) {
  static_assert(distrpc::wire::detail::dependent_false<Archive>,
                "c10::IValue is serialized by distrpc::wire::OutputArchive only (tensors inside "
                "travel out of band): use distrpc::wire::encode(message, values...)");
}

template <class Archive>
void CEREAL_LOAD_FUNCTION_NAME(Archive&, c10::IValue&) {
  static_assert(distrpc::wire::detail::dependent_false<Archive>,
                "c10::IValue is deserialized by distrpc::wire::InputArchive only: use "
                "distrpc::wire::decode(message, values...)");
}

}  // namespace cereal
