// Device maps without processes or GPUs: device names, set_device_map / set_devices and their
// errors, the entry each worker publishes, and the group-wide check with every one of its texts
// (synthetic device counts stand in for GPUs, so each rule is exercised on any machine).
#include <doctest/doctest.h>

#include "distrpc/device_map.hpp"
#include "distrpc/options.hpp"
#include "support/error_text.hpp"

#include <stdexcept>
#include <string>
#include <vector>

using distrpc::DeviceMap;
using distrpc::DeviceName;
using distrpc::NodeDevices;
using distrpc::RpcBackendOptions;
using distrpc::testing::contains;

namespace {

DeviceName cuda(int i) {
  return DeviceName::cuda(i);
}
const DeviceName kCpu = DeviceName::cpu();

NodeDevices node(const std::string& name, int count, std::map<std::string, DeviceMap> maps = {},
                 std::vector<DeviceName> devices = {}) {
  NodeDevices n;
  n.name = name;
  n.device_count = count;
  n.maps = std::move(maps);
  n.devices = std::move(devices);
  return n;
}

// The text validate_device_maps throws for `nodes`, "<no exception>" when it accepts them.
std::string check(const std::vector<NodeDevices>& nodes) {
  return distrpc::testing::error_text<std::invalid_argument>(
      [&] { distrpc::validate_device_maps(nodes); });
}

}  // namespace

TEST_CASE("device map: device names parse PyTorch's spellings and name what is wrong") {
  CHECK(DeviceName::parse("cpu") == kCpu);
  CHECK(DeviceName::parse("cpu:0") == kCpu);
  CHECK(DeviceName::parse("cuda:3") == cuda(3));
  CHECK(DeviceName::parse("cuda:3").str() == "cuda:3");
  CHECK(kCpu.str() == "cpu");
  CHECK(kCpu < cuda(0));
  CHECK(cuda(0) < cuda(1));
  CHECK(distrpc::testing::error_text<std::invalid_argument>([] { DeviceName::parse("cuda:-1"); }) ==
        "Device index must not be negative, got -1");
  CHECK(contains(
      distrpc::testing::error_text<std::invalid_argument>([] { DeviceName::parse("cuda"); }),
      "Device 'cuda' has no index"));
  CHECK(distrpc::testing::error_text<std::invalid_argument>([] { DeviceName::parse("gpu:0"); }) ==
        "Invalid device 'gpu:0': expected 'cpu' or 'cuda:<index>'");
  CHECK(contains(
      distrpc::testing::error_text<std::invalid_argument>([] { DeviceName::parse("cuda:1x"); }),
      "Invalid device 'cuda:1x'"));
  CHECK(contains(distrpc::testing::error_text<std::invalid_argument>([] { DeviceName::parse(""); }),
                 "Invalid device ''"));
}

TEST_CASE("device map: set_device_map merges, refuses remapping a source and negative indices") {
  RpcBackendOptions o;
  o.set_device_map("worker1", {{0, 1}});
  o.set_device_map("worker1", {{1, 0}, {0, 1}});  // the same pair again is no conflict
  o.set_device_map("worker2", {{"cpu", "cuda:0"}});
  CHECK(o.device_maps.at("worker1") == DeviceMap{{cuda(0), cuda(1)}, {cuda(1), cuda(0)}});
  CHECK(o.device_maps.at("worker2") == DeviceMap{{kCpu, cuda(0)}});

  const std::string remap = distrpc::testing::error_text<std::invalid_argument>([&] {
    o.set_device_map("worker1", {{0, 2}});
  });
  CHECK(remap ==
        "`set_device_map` only supports 1-to-1 mapping, trying to map cuda:0 to cuda:2 "
        "and cuda:1");
  CHECK(o.device_maps.at("worker1").at(cuda(0)) == cuda(1));  // nothing changed

  const std::string two_to_one = distrpc::testing::error_text<std::invalid_argument>([&] {
    o.set_device_map("worker3", {{0, 1}, {2, 1}});
  });
  CHECK(two_to_one ==
        "`set_device_map` only supports 1-to-1 mapping, trying to map cuda:2 and cuda:0 to cuda:1");
  CHECK(o.device_maps.count("worker3") == 0);

  CHECK(distrpc::testing::error_text<std::invalid_argument>([&] {
          o.set_device_map("worker1", {{-1, 0}});
        }) == "Device index must not be negative, got -1");
  CHECK(distrpc::testing::error_text<std::invalid_argument>([&] {
          o.set_device_map("worker1", {{0, -1}});
        }) == "Device index must not be negative, got -1");

  o.set_devices({0, "cuda:1"});
  CHECK(o.devices == std::vector<DeviceName>{cuda(0), cuda(1)});
  CHECK(distrpc::testing::error_text<std::invalid_argument>([&] { o.set_devices({"cpu"}); }) ==
        "`set_devices` expect a list of CUDA devices, but got device type cpu.");
  CHECK(o.devices.size() == 2);

  CHECK(distrpc::inverse(o.device_maps.at("worker2")) == DeviceMap{{cuda(0), kCpu}});
}

TEST_CASE("device map: a worker's published entry round-trips, malformed entries are refused") {
  NodeDevices n = node("worker0", 2,
                       {{"worker1", {{cuda(0), cuda(1)}, {kCpu, kCpu}}},
                        {"odd name\nwith 3:colons", {{cuda(1), kCpu}}}},
                       {cuda(0), cuda(1)});
  const NodeDevices back = NodeDevices::parse("worker0", n.serialize());
  CHECK(back.name == "worker0");
  CHECK(back.device_count == 2);
  CHECK(back.devices == n.devices);
  CHECK(back.maps == n.maps);

  const NodeDevices empty = NodeDevices::parse("w", node("w", 0).serialize());
  CHECK(empty.maps.empty());
  CHECK(empty.devices.empty());
  // A worker that published nothing: no GPUs, no devices, no maps.
  const NodeDevices none = NodeDevices::parse("w", "");
  CHECK(none.name == "w");
  CHECK(none.device_count == 0);
  CHECK(none.maps.empty());

  for (const std::string bad : {"1:0", "1:01:0", "x:0", "1:01:01:0junk", "5:0"}) {
    CHECK_MESSAGE(distrpc::testing::error_text<std::runtime_error>([&] {
                    NodeDevices::parse("worker3", bad);
                  }) == "malformed device entry of worker worker3 in the store",
                  "entry '" << bad << "'");
  }
}

TEST_CASE("device map: the group check accepts valid maps and names the first offending node") {
  // Two GPUs each; maps to self, cpu on either side, and the full permutation are fine.
  CHECK(check({node("worker0", 2,
                    {{"worker1", {{cuda(0), cuda(1)}, {cuda(1), cuda(0)}}},
                     {"worker0", {{kCpu, cuda(1)}}}}),
               node("worker1", 2, {{"worker0", {{cuda(1), kCpu}}}})}) == "<no exception>");
  // No maps at all, GPU-less: fine.
  CHECK(check({node("worker0", 0), node("worker1", 0)}) == "<no exception>");

  // Both workers are wrong: every worker reports the first in table order.
  const std::string first = check({node("worker0", 0, {{"worker9", {{kCpu, kCpu}}}}),
                                   node("worker1", 0, {{"worker8", {{kCpu, kCpu}}}})});
  CHECK(contains(first, "Node worker0 has invalid target node names in its device maps\n"));
  CHECK(contains(first, "device maps = {worker9: {cpu: cpu}}"));
  CHECK(contains(first, "node names = [worker0, worker1]"));
}

TEST_CASE("device map: every rule of the group check, with its text") {
  const auto w1 = node("worker1", 2);

  CHECK(contains(check({node("worker0", 2, {}, {cuda(0), cuda(0)}), w1}),
                 "Node worker0 has duplicated devices\ndevices = [cuda:0, cuda:0]"));
  CHECK(contains(check({node("worker0", 2, {}, {cuda(0), cuda(2)}), w1}),
                 "Node worker0 has devices with invalid indices\ndevices = [cuda:0, cuda:2]\n"
                 "device count = 2"));

  CHECK(check({node("worker0", 2, {{"worker1", {{cuda(0), cuda(1)}, {cuda(1), cuda(1)}}}}), w1}) ==
        "Node worker0 has duplicated target devices in its device map for worker1\n"
        "device map = {cuda:0: cuda:1, cuda:1: cuda:1}");

  // The CPU is always usable, whatever `devices` lists.
  CHECK(check({node("worker0", 2, {{"worker1", {{kCpu, cuda(1)}, {cuda(0), kCpu}}}}, {cuda(0)}),
               node("worker1", 2, {}, {cuda(1)})}) == "<no exception>");
  CHECK(check({node("worker0", 2, {{"worker1", {{cuda(1), cuda(0)}}}}, {cuda(0)}), w1}) ==
        "Node worker0 has unexpected source devices in its device map for worker1\n"
        "device map = {cuda:1: cuda:0}\ndevices = [cuda:0]");
  CHECK(check({node("worker0", 2, {{"worker1", {{cuda(2), cuda(0)}}}}), w1}) ==
        "Node worker0 has source devices with invalid indices in its device map for worker1\n"
        "device map = {cuda:2: cuda:0}\ndevice count = 2");
  // No GPU at all: any CUDA source is an invalid index (what a GPU-less worker reports).
  CHECK(contains(check({node("worker0", 0, {{"worker1", {{cuda(0), kCpu}}}}), w1}),
                 "Node worker0 has source devices with invalid indices in its device map for "
                 "worker1"));

  CHECK(check({node("worker0", 2, {{"worker1", {{cuda(0), cuda(1)}}}}),
               node("worker1", 2, {}, {cuda(0)})}) ==
        "Node worker0 has unexpected target devices in its device map for worker1\n"
        "device map = {cuda:0: cuda:1}\ndevices = [cuda:0]");
  CHECK(check({node("worker0", 2, {{"worker1", {{kCpu, cuda(5)}}}}), w1}) ==
        "Node worker0 has target devices with invalid indices in its device map for worker1\n"
        "device map = {cpu: cuda:5}\ndevice count = 2");
  // The target's device count decides, not the source's.
  CHECK(contains(check({node("worker0", 4, {{"worker1", {{cuda(3), cuda(3)}}}}), w1}),
                 "has target devices with invalid indices"));
  // The check order of each map: duplicates before sources before targets.
  CHECK(contains(
      check({node("worker0", 0, {{"worker1", {{cuda(7), cuda(9)}, {kCpu, cuda(9)}}}}), w1}),
      "has duplicated target devices"));
  CHECK(contains(check({node("worker0", 0, {{"worker1", {{cuda(7), cuda(9)}}}}), w1}),
                 "has source devices with invalid indices"));
}

TEST_CASE("device map: the devices a worker uses when it set none come from the group's maps") {
  const std::vector<NodeDevices> nodes = {
      node("worker0", 4, {{"worker1", {{cuda(0), cuda(1)}, {kCpu, cuda(3)}}}}),
      node("worker1", 4, {{"worker0", {{cuda(2), cuda(2)}}}, {"worker1", {{cuda(0), kCpu}}}})};
  CHECK(distrpc::inferred_devices(nodes, "worker0") == std::vector<DeviceName>{cuda(0), cuda(2)});
  CHECK(distrpc::inferred_devices(nodes, "worker1") ==
        std::vector<DeviceName>{cuda(0), cuda(1), cuda(2), cuda(3)});
}
