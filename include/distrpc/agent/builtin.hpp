// Builtin operators by schema name (PyTorch's rpc_sync("worker1", torch.add, ...)): the callee
// runs an ATen operator through the dispatcher, with the schema's defaults and type checks.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/agent.hpp"
#include "distrpc/rpc_error.hpp"

namespace distrpc::detail {

// A peer may run an operator by name only if the agent running it allows it
// (RpcBackendOptions::builtin_operators): by its full schema name, by its name without the
// overload, or "*" for any. Operators can touch files and devices: none are allowed by default.
inline void check_builtin_allowed(const std::string& schema) {
  const RpcAgent* agent = tls_current_agent;
  const std::string op = schema.substr(0, schema.find('.'));
  if (agent != nullptr) {
    for (const auto& allowed : agent->options().builtin_operators) {
      if (allowed == "*" || allowed == schema || allowed == op) return;
    }
  }
  throw RpcError("builtin operator '" + schema + "' is not allowed on " +
                 (agent != nullptr ? agent->self().str() : std::string("this worker")) +
                 ": a worker runs only the operators listed in its "
                 "RpcBackendOptions::builtin_operators (e.g. {\"" + op +
                 "\"}, or \"*\" for any)");
}

// Runs the ATen operator `schema` ("aten::add.Tensor", or "aten::add" for the overload "")
// through the dispatcher. Defaults fill missing trailing arguments.
inline c10::IValue run_builtin(std::string schema, std::vector<c10::IValue> args) {
  check_builtin_allowed(schema);
  std::string op = schema, overload;
  if (auto dot = schema.find('.'); dot != std::string::npos) {
    op = schema.substr(0, dot);
    overload = schema.substr(dot + 1);
  }
  auto handle = c10::Dispatcher::singleton().findSchema({op, overload});
  if (!handle) {
    throw std::invalid_argument("unknown builtin operator '" + schema +
                                "': expected a schema name such as 'aten::add.Tensor'");
  }
  const auto& fs = handle->schema();
  const auto& params = fs.arguments();
  if (args.size() > params.size()) {
    std::ostringstream s;
    s << fs;
    throw std::invalid_argument(schema + " takes at most " + std::to_string(params.size()) +
                                " arguments but got " + std::to_string(args.size()) +
                                " (schema: " + s.str() + ")");
  }
  torch::jit::Stack stack(args.begin(), args.end());
  for (std::size_t i = args.size(); i < params.size(); ++i) {
    if (!params[i].default_value()) {
      std::ostringstream s;
      s << fs;
      throw std::invalid_argument(schema + ": missing value for argument '" + params[i].name() +
                                  "' (schema: " + s.str() + ")");
    }
    stack.push_back(*params[i].default_value());
  }
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (!args[i].type()->isSubtypeOf(*params[i].type()) &&
        !(params[i].type()->kind() == c10::TypeKind::NumberType && args[i].isScalar()) &&
        !(params[i].type()->kind() == c10::TypeKind::OptionalType)) {
      std::ostringstream s;
      s << fs;
      throw std::invalid_argument(schema + ": argument '" + params[i].name() + "' (position " +
                                  std::to_string(i) + ") expected " + params[i].type()->str() +
                                  " but got " + args[i].type()->str() + " (schema: " + s.str() +
                                  ")");
    }
  }
  handle->callBoxed(stack);
  if (stack.size() == 1) return std::move(stack[0]);
  return c10::ivalue::Tuple::create(std::move(stack));
}

}  // namespace distrpc::detail
