// DeviceTransfer<T>: how the tensors inside a value move to another device, in place.
//
// A RemoteModule on a non-CPU device (e.g. "worker1/cuda:0") moves the tensors among the forward
// arguments to the module's device before calling it and, when no device map is set, moves every
// tensor in the result back to the CPU (the wire carries CPU tensors only). PyTorch's template
// does this with a loop over the top-level arguments and over the elements of the result, which
// splits a bare tensor result into its rows; here the walk is by type, so a tensor is always a
// leaf and containers are walked to any depth.
//
// Known shapes: at::Tensor (an undefined tensor stays undefined), std::tuple, std::pair,
// std::array, std::vector, std::optional, std::map / std::unordered_map (values) and c10::IValue
// (tensors, tuples, lists and dicts inside it). Other types are left as they are; a type holding
// tensors of its own specializes DeviceTransfer:
//
//   template <> struct distrpc::nn::DeviceTransfer<MyBatch> {
//     static void to(MyBatch& b, c10::Device d) { distrpc::nn::to_device(b.features, d); }
//   };
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <array>
#include <cstddef>
#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace distrpc::nn {

// The default: a value without tensors (or one this header does not know) is left as it is.
template <class T>
struct DeviceTransfer {
  static void to(T&, c10::Device) {}
};

// Moves every tensor inside `value` to `device`, in place.
template <class T>
void to_device(T& value, c10::Device device) {
  DeviceTransfer<T>::to(value, device);
}

template <>
struct DeviceTransfer<at::Tensor> {
  static void to(at::Tensor& t, c10::Device device) {
    if (t.defined() && t.device() != device) t = t.to(device);
  }
};

template <class... T>
struct DeviceTransfer<std::tuple<T...>> {
  static void to(std::tuple<T...>& v, c10::Device device) {
    std::apply([&](auto&... e) { (to_device(e, device), ...); }, v);
  }
};

template <class A, class B>
struct DeviceTransfer<std::pair<A, B>> {
  static void to(std::pair<A, B>& v, c10::Device device) {
    to_device(v.first, device);
    to_device(v.second, device);
  }
};

template <class T, std::size_t N>
struct DeviceTransfer<std::array<T, N>> {
  static void to(std::array<T, N>& v, c10::Device device) {
    for (auto& e : v) to_device(e, device);
  }
};

template <class T, class A>
struct DeviceTransfer<std::vector<T, A>> {
  static void to(std::vector<T, A>& v, c10::Device device) {
    for (auto& e : v) to_device(e, device);
  }
};

template <class T>
struct DeviceTransfer<std::optional<T>> {
  static void to(std::optional<T>& v, c10::Device device) {
    if (v) to_device(*v, device);
  }
};

template <class K, class V, class C, class A>
struct DeviceTransfer<std::map<K, V, C, A>> {
  static void to(std::map<K, V, C, A>& v, c10::Device device) {
    for (auto& [k, e] : v) to_device(e, device);
  }
};

template <class K, class V, class H, class E, class A>
struct DeviceTransfer<std::unordered_map<K, V, H, E, A>> {
  static void to(std::unordered_map<K, V, H, E, A>& v, c10::Device device) {
    for (auto& [k, e] : v) to_device(e, device);
  }
};

// IValues are rebuilt rather than edited: tuples are immutable, and lists or dicts may be shared
// with the caller's own IValues, which must not change under it.
template <>
struct DeviceTransfer<c10::IValue> {
  static void to(c10::IValue& v, c10::Device device) { v = moved(v, device); }

  static c10::IValue moved(const c10::IValue& v, c10::Device device) {
    if (v.isTensor()) {
      at::Tensor t = v.toTensor();
      to_device(t, device);
      return t;
    }
    if (v.isTuple()) {
      std::vector<c10::IValue> elems;
      for (const auto& e : v.toTupleRef().elements()) elems.push_back(moved(e, device));
      return c10::ivalue::Tuple::create(std::move(elems));
    }
    if (v.isList()) {
      auto in = v.toList();
      c10::impl::GenericList out(in.elementType());
      out.reserve(in.size());
      for (std::size_t i = 0; i < in.size(); ++i) out.push_back(moved(in.get(i), device));
      return out;
    }
    if (v.isGenericDict()) {
      auto in = v.toGenericDict();
      c10::impl::GenericDict out(in.keyType(), in.valueType());
      for (const auto& e : in) out.insert(e.key(), moved(e.value(), device));
      return out;
    }
    return v;
  }
};

}  // namespace distrpc::nn
