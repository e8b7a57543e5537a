// A type-erased value: a shared pointer to the object and a table of what can be done with it
// without knowing its type (name it, check it, serialize it). A registered function's result is
// boxed this way when a layer keeps it instead of sending it back (the owner of an RRef made by
// remote()). Objects that cannot be serialized may be boxed: their table says so at run time
// instead of failing to compile.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cereal/details/traits.hpp>

#include "distrpc/function_id.hpp"
#include "distrpc/wire.hpp"

namespace distrpc::detail {

struct ValueOps {
  std::string type_name;    // the compiler's spelling of T
  std::uint64_t type_hash;  // fnv1a(type_name): what a peer expecting T compares
  bool serializable;
  void (*encode)(wire::Message& out, const void* value);
};

template <class T>
inline constexpr bool wire_serializable_v =
    cereal::traits::is_output_serializable<T, wire::OutputArchive>::value&&
        cereal::traits::is_input_serializable<T, wire::InputArchive>::value;

// The boxed result of a function returning void: nothing but the fact that the function ran. An
// empty serializable unit, so that whoever keeps results (e.g. RRef cells, fetches, type checks)
// treats it like any other value; it is spelled "void" to users.
struct NoValue {
  template <class Archive>
  void serialize(Archive&) {}
};

// The type a result of type R is boxed as.
template <class R>
using boxed_storage_t = std::conditional_t<std::is_void_v<R>, NoValue, R>;

template <class T>
std::uint64_t type_hash_of() {
  return fnv1a(type_name<T>());
}

// The name users see for a boxed type (e.g. RRef type_name(), type mismatch errors).
template <class T>
std::string value_type_name() {
  if constexpr (std::is_same_v<T, NoValue>) {
    return "void";
  } else {
    return std::string(type_name<T>());
  }
}

template <class T>
const ValueOps* value_ops() {
  static const ValueOps ops{
      value_type_name<T>(), type_hash_of<T>(), wire_serializable_v<T>,
      [](wire::Message& out, const void* value) {
        if constexpr (wire_serializable_v<T>) {
          wire::encode(out, *static_cast<const T*>(value));
        } else {
          (void)out;
          (void)value;
          throw std::invalid_argument("the value of type '" + std::string(type_name<T>()) +
                                      "' held by this RRef cannot be serialized (it has no cereal "
                                      "serialize/save function): call its methods through the "
                                      "RRef's proxies instead of fetching it");
        }
      }};
  return &ops;
}

// A result kept where it was produced (e.g. by remote(): what the owner's cell will hold).
struct BoxedValue {
  std::shared_ptr<void> value;
  const ValueOps* ops = nullptr;
};

}  // namespace distrpc::detail
