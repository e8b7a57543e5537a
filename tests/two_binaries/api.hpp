// The declarations shared by the server and the client of the two-binary check (check.sh): what
// the server offers, by name and signature, with no implementation.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "distrpc/declare.hpp"
#include "distrpc/nn/interface_module.hpp"
#include "distrpc/rref.hpp"

namespace two_bin {

// A user type: it names itself with a member (Offset below is named with DISTRPC_TYPE_NAME).
struct Point {
  static constexpr std::string_view distrpc_type_name = "geo.Point";
  double x = 0;
  double y = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(x, y);
  }
};

struct Offset {
  double dx = 0;
  double dy = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(dx, dy);
  }
};

// The interface of the module the server builds; the client calls it through RemoteModule.
struct ScaleInterface {
  at::Tensor forward(at::Tensor x);
};

}  // namespace two_bin

DISTRPC_TYPE_NAME(two_bin::Offset, "geo.Offset");
DISTRPC_TYPE_NAME(two_bin::ScaleInterface, "model.Scale");

namespace two_bin {

DISTRPC_REMOTE(add, "math.add", at::Tensor(at::Tensor, at::Tensor));
DISTRPC_REMOTE(describe, "text.describe",
               std::string(std::vector<std::int64_t>, std::optional<std::string>));
DISTRPC_REMOTE(move_point, "geo.move", Point(Point, Offset));
// Runs asynchronously on the server (its implementation returns a Future): the same declaration.
DISTRPC_REMOTE(slow_double, "math.slow_double", double(double));
// Builds a module on the server: the client wraps the RRef in a RemoteModule<ScaleInterface>.
DISTRPC_REMOTE(make_scaler, "model.make_scaler",
               distrpc::RRef<distrpc::nn::InterfaceModule<ScaleInterface>>(double));

}  // namespace two_bin
