// RPC error types, and the registry that carries exceptions across the wire.
//
// The callee sends the exception's registered type name and its message (newlines intact); the
// caller rebuilds the same C++ type when it is registered there too, and otherwise raises a
// RemoteError whose text contains "Original exception on remote side was" and the type name.
// Only registered types are ever constructed from wire data: a name is a lookup key, not code.
#pragma once

#include <c10/util/Exception.h>

#include <cxxabi.h>

#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <typeindex>
#include <typeinfo>
#include <unordered_map>

#include "distrpc/error.hpp"

namespace distrpc {

// A call failed for a reason of the RPC layer itself (bad destination, unknown function, ...).
class RpcError : public DistError {
 public:
  using DistError::DistError;
};

// A call ran past its timeout: "RPC ran for more than set timeout (X ms) and will now be marked
// with an error".
class RpcTimeoutError : public RpcError {
 public:
  using RpcError::RpcError;
};

// The remote function raised an exception of a type the caller cannot rebuild.
class RemoteError : public RpcError {
 public:
  RemoteError(std::string type_name, std::string remote_message, const std::string& worker)
      : RpcError("Error on " + worker + ": " + type_name + ": " + remote_message +
                 "\nOriginal exception on remote side was " + type_name + ": " + remote_message),
        type_name_(std::move(type_name)),
        remote_message_(std::move(remote_message)) {}
  const std::string& type_name() const { return type_name_; }
  const std::string& remote_message() const { return remote_message_; }

 private:
  std::string type_name_;
  std::string remote_message_;
};

inline std::string demangle(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(
      abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(mangled);
}

// What travels for a failed call.
struct WireException {
  std::string type_name;
  std::string message;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(type_name, message);
  }
};

class ExceptionRegistry {
 public:
  static ExceptionRegistry& instance() {
    static ExceptionRegistry r;
    return r;
  }

  // Registers E under `name` (defaults to its demangled type name). E needs a constructor from
  // std::string. c10 errors are registered with their own factory (their constructors differ).
  template <class E>
  void add(std::string name = demangle(typeid(E).name())) {
    add_factory(typeid(E), std::move(name),
                [](const std::string& msg) { return std::make_exception_ptr(E(msg)); });
  }

  void add_factory(const std::type_info& type, std::string name,
                   std::function<std::exception_ptr(const std::string&)> make) {
    std::lock_guard<std::mutex> lk(mu_);
    names_[std::type_index(type)] = name;
    factories_[std::move(name)] = std::move(make);
  }

  // The wire form of the exception in `p` (the dynamic type decides the name).
  WireException encode(std::exception_ptr p) const {
    try {
      std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      // what() of a c10::Error carries a C++ backtrace; the caller wants the message. A subclass
      // not registered here (c10::OutOfMemoryError, libtorch 2.x's c10::DistStoreError, ...)
      // travels as c10::Error, which callers catch, rather than as an unknown type.
      return {registered_name(typeid(e)).value_or("c10::Error"), e.what_without_backtrace()};
    } catch (const std::exception& e) {
      return {name_of(typeid(e)), e.what()};
    } catch (...) {
      return {"unknown exception (not derived from std::exception)", ""};
    }
  }

  // The exception to raise at the caller for a failure reported by `worker`.
  std::exception_ptr rebuild(const WireException& w, const std::string& worker) const {
    std::function<std::exception_ptr(const std::string&)> make;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = factories_.find(w.type_name);
      if (it != factories_.end()) make = it->second;
    }
    if (make) {
      try {
        return make(w.message);
      } catch (...) {
        // A factory that throws while rebuilding: report the original instead of the accident.
      }
    }
    return std::make_exception_ptr(RemoteError(w.type_name, w.message, worker));
  }

 private:
  ExceptionRegistry() {
    add<std::runtime_error>("std::runtime_error");
    add<std::invalid_argument>("std::invalid_argument");
    add<std::out_of_range>("std::out_of_range");
    add<std::logic_error>("std::logic_error");
    add<std::domain_error>("std::domain_error");
    add<std::length_error>("std::length_error");
    add<std::overflow_error>("std::overflow_error");
    add<std::range_error>("std::range_error");
    add<std::underflow_error>("std::underflow_error");
    add<DistError>("distrpc::DistError");
    add<DistStoreError>("distrpc::DistStoreError");
    add<DistNetworkError>("distrpc::DistNetworkError");
    add<DistBackendError>("distrpc::DistBackendError");
    add<RpcError>("distrpc::RpcError");
    add<RpcTimeoutError>("distrpc::RpcTimeoutError");
    add_c10<c10::Error>("c10::Error");
    add_c10<c10::ValueError>("c10::ValueError");
    add_c10<c10::TypeError>("c10::TypeError");
    add_c10<c10::IndexError>("c10::IndexError");
    add_c10<c10::NotImplementedError>("c10::NotImplementedError");
    add_c10<c10::LinAlgError>("c10::LinAlgError");
  }

  template <class E>
  void add_c10(std::string name) {
    add_factory(typeid(E), std::move(name), [](const std::string& msg) {
      // {}: an empty backtrace, a std::string in libtorch 1.13 and a null
      // pointer to a lazily made one in 2.x.
      return std::make_exception_ptr(E(msg, /*backtrace=*/{}));
    });
  }

  std::optional<std::string> registered_name(const std::type_info& t) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = names_.find(std::type_index(t));
    return it != names_.end() ? std::optional<std::string>(it->second) : std::nullopt;
  }
  std::string name_of(const std::type_info& t) const {
    return registered_name(t).value_or(demangle(t.name()));
  }

  mutable std::mutex mu_;
  std::unordered_map<std::type_index, std::string> names_;
  std::unordered_map<std::string, std::function<std::exception_ptr(const std::string&)>> factories_;
};

// Makes E travel as itself: raised by a remote function, it is raised as E at the caller. Both
// sides must register it (a static initializer in a shared header does that for SPMD binaries).
template <class E>
void register_exception(std::string name = demangle(typeid(E).name())) {
  ExceptionRegistry::instance().add<E>(std::move(name));
}

}  // namespace distrpc
