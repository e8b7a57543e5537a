// The server of the two-binary check: implements and exposes what api.hpp declares, builds
// the Scale module for RemoteModule<ScaleInterface>, and serves only what it exposes.
//   two_binaries_server <init_method>
#include <torch/nn/module.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "api.hpp"
#include "distrpc/distrpc.hpp"
#include "distrpc/nn/remote_module.hpp"
#include "distrpc/transport/tcp.hpp"

namespace server_impl {

at::Tensor add(const at::Tensor& a, at::Tensor b) {
  return a + b;
}

std::string describe(std::vector<std::int64_t> values, std::optional<std::string> tag) {
  std::int64_t sum = 0;
  for (auto v : values) sum += v;
  return std::to_string(values.size()) + " values, sum " + std::to_string(sum) + ", tag " +
         tag.value_or("none");
}

two_bin::Point move_point(two_bin::Point p, const two_bin::Offset& by) {
  return {p.x + by.dx, p.y + by.dy};
}

distrpc::Future<double> slow_double(double x) {
  distrpc::Future<double> f;
  std::thread([f, x]() mutable {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    f.set_result(2 * x);
  }).detach();
  return f;
}

// The module only the server has.
struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(double k) : k(k) {}
  at::Tensor forward(at::Tensor x) { return x * k; }
  double k;
};

distrpc::RRef<distrpc::nn::InterfaceModule<two_bin::ScaleInterface>> make_scaler(double k) {
  return distrpc::RRef<distrpc::nn::InterfaceModule<two_bin::ScaleInterface>>(
      distrpc::nn::InterfaceModule<two_bin::ScaleInterface>::adopt(std::make_shared<ScaleImpl>(k)));
}

}  // namespace server_impl

DISTRPC_EXPOSE(two_bin::add, &server_impl::add);
DISTRPC_EXPOSE(two_bin::describe, &server_impl::describe);
DISTRPC_EXPOSE(two_bin::move_point, &server_impl::move_point);
DISTRPC_EXPOSE(two_bin::slow_double, &server_impl::slow_double);
DISTRPC_EXPOSE(two_bin::make_scaler, &server_impl::make_scaler);
// What a RemoteModule<ScaleInterface> asks of the module's owner.
DISTRPC_REGISTER_MODULE(two_bin::ScaleInterface, server_impl::ScaleImpl, double);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <init_method>\n", argv[0]);
    return 2;
  }
  try {
    distrpc::RpcBackendOptions o;
    o.init_method = argv[1];
    o.init_timeout = std::chrono::seconds(60);
    o.rpc_timeout = std::chrono::seconds(30);
    o.serve_exposed_only = true;
    distrpc::init_rpc<distrpc::transport::Tcp>("server", 0, 2, o);
    distrpc::shutdown();  // graceful: returns once the client is done
  } catch (const std::exception& e) {
    std::fprintf(stderr, "server: %s\n", e.what());
    return 1;
  }
  std::printf("server: done\n");
  return 0;
}
