// The agent's device routes without processes or GPUs: a group's maps (synthetic device counts
// stand in for GPUs) give each worker its request routes (its own map) and response routes (the
// inverse of the caller's map), per-call maps are checked like the group's, and a tensor no route
// covers is refused naming the direction and the device. c10::Device values need no GPU.
// libtorch's headers first: glog's CHECK, which they bring, must not replace doctest's.
#include <distrpc/agent/device_routes.hpp>
#include <distrpc/agent/membership.hpp>

#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "support/error_text.hpp"

namespace device_routes_test {

using distrpc::DeviceMap;
using distrpc::DeviceName;
using distrpc::NodeDevices;
using distrpc::detail::DeviceRoutes;

const c10::Device kCpu(c10::kCPU);
c10::Device gpu(int i) {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
}

// worker0 (2 GPUs) maps cuda:0 -> worker1's cuda:1 and cpu -> worker1's cuda:0; worker1 (2 GPUs)
// maps its cuda:1 -> worker0's cpu.
std::vector<NodeDevices> group() {
  NodeDevices w0;
  w0.name = "worker0";
  w0.device_count = 2;
  w0.maps["worker1"] = DeviceMap{{DeviceName::cuda(0), DeviceName::cuda(1)},
                                 {DeviceName::cpu(), DeviceName::cuda(0)}};
  NodeDevices w1;
  w1.name = "worker1";
  w1.device_count = 2;
  w1.maps["worker0"] = DeviceMap{{DeviceName::cuda(1), DeviceName::cpu()}};
  return {w0, w1};
}

}  // namespace device_routes_test

TEST_CASE("device routes: requests follow the own map, responses the inverse of the caller's") {
  using namespace device_routes_test;
  distrpc::detail::Membership members0(distrpc::WorkerInfo{0, "worker0"}, 2);
  DeviceRoutes r0;
  r0.set(group(), 0);
  const auto to1 = r0.request(1, nullptr, members0);
  CHECK(to1.target(gpu(0)) == gpu(1));
  CHECK(to1.target(kCpu) == gpu(0));
  const std::string unmapped =
      distrpc::testing::error_text<distrpc::wire::EncodeError>([&] { to1.target(gpu(1)); });
  CHECK(distrpc::testing::contains(unmapped, "RPC only supports CPU tensors by default"));
  CHECK(distrpc::testing::contains(unmapped, "Request device mapping is not available"));
  CHECK(distrpc::testing::contains(unmapped, "(a tensor on cuda:1)"));
  // worker0 answers worker1 through the inverse of worker1's map {cuda:1: cpu}.
  const auto back1 = r0.response(1, members0);
  CHECK(back1.target(kCpu) == gpu(1));
  CHECK(distrpc::testing::contains(
      distrpc::testing::error_text<distrpc::wire::EncodeError>([&] { back1.target(gpu(0)); }),
      "Response device mapping is not available"));
  CHECK(r0.map_to(1) == group()[0].maps.at("worker1"));
  CHECK(r0.devices() == std::vector<DeviceName>{DeviceName::cuda(0)});

  distrpc::detail::Membership members1(distrpc::WorkerInfo{1, "worker1"}, 2);
  DeviceRoutes r1;
  r1.set(group(), 1);
  CHECK(r1.request(0, nullptr, members1).target(gpu(1)) == kCpu);
  // worker1 answers worker0 through the inverse of worker0's map: cuda:1 -> cuda:0, cuda:0 -> cpu;
  // a CPU result stays on the CPU.
  const auto back0 = r1.response(0, members1);
  CHECK(back0.target(gpu(1)) == gpu(0));
  CHECK(back0.target(gpu(0)) == kCpu);
  CHECK(back0.target(kCpu) == kCpu);
  CHECK(r1.devices() == std::vector<DeviceName>{DeviceName::cuda(0), DeviceName::cuda(1)});
  CHECK(r1.map_to(0) == group()[1].maps.at("worker0"));

  // A per-call map replaces the configured one for that request, checked like the group's.
  const DeviceMap swap{{DeviceName::cuda(0), DeviceName::cuda(0)}};
  CHECK(r0.request(1, &swap, members0).target(gpu(0)) == gpu(0));
  const DeviceMap bad{{DeviceName::cuda(5), DeviceName::cuda(0)}};
  CHECK(distrpc::testing::contains(
      distrpc::testing::error_text<std::invalid_argument>(
          [&] { (void)r0.request(1, &bad, members0); }),
      "Node worker0 has source devices with invalid indices in its device map for worker1"));
  const DeviceMap far{{DeviceName::cpu(), DeviceName::cuda(2)}};
  CHECK(distrpc::testing::contains(distrpc::testing::error_text<std::invalid_argument>(
                                       [&] { (void)r0.request(1, &far, members0); }),
                                   "has target devices with invalid indices"));
  // An empty per-call map is no per-call map.
  const DeviceMap empty;
  CHECK(r0.request(1, &empty, members0).target(gpu(0)) == gpu(1));
}

TEST_CASE("device routes: a group whose maps are invalid leaves the routes unset") {
  using namespace device_routes_test;
  auto nodes = group();
  nodes[1].maps["worker7"] = DeviceMap{{DeviceName::cpu(), DeviceName::cpu()}};
  distrpc::detail::Membership members(distrpc::WorkerInfo{0, "worker0"}, 2);
  DeviceRoutes r;
  CHECK(distrpc::testing::contains(
      distrpc::testing::error_text<std::invalid_argument>([&] { r.set(nodes, 0); }),
      "Node worker1 has invalid target node names in its device maps"));
  CHECK(r.map_to(1).empty());
  CHECK(r.devices().empty());
  // Without routes a request carries CPU tensors only.
  const auto route = r.request(1, nullptr, members);
  CHECK(route.target(kCpu) == kCpu);
  CHECK_THROWS_AS(route.target(gpu(0)), distrpc::wire::EncodeError);
}
