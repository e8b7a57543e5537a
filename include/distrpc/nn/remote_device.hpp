// RemoteDevice: where a RemoteModule lives, parsed from PyTorch's remote_device strings.
//
//   "worker1/cpu"     worker by name, device cpu
//   "rank:1/cuda:0"   worker by rank, device cuda:0
//   "worker1"         worker by name, device cpu
//   "cuda:0"          a device alone (a RemoteModule needs a worker: it refuses this one)
//
// The rules and texts are those of torch.distributed's _remote_device, so programs ported from
// Python fail on the same inputs with the same messages. Every parse error is a
// std::invalid_argument (Python raises ValueError for the format and RuntimeError for the device
// part; c10::Device's own texts are kept: "Expected one of ... device type at start of device
// string", "Invalid device string: 'cpu2'", "Device string must not be empty").
//
// A worker name that contains ':' is read as the rank form, as in PyTorch: "rank:<n>" is the only
// accepted spelling with a colon, anything else with one ("a:b") does not parse.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <charconv>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <variant>

namespace distrpc::nn {

class RemoteDevice {
 public:
  // cpu, no worker: what a default-made (or not yet decoded) value holds.
  RemoteDevice() = default;

  // Parses `text` (see the forms above). Throws std::invalid_argument.
  explicit RemoteDevice(std::string_view text) { parse(text); }

  RemoteDevice(std::string worker_name, c10::Device device)
      : worker_(std::move(worker_name)), device_(device) {
    if (std::get<std::string>(worker_).empty()) {
      throw std::invalid_argument("distrpc::nn::RemoteDevice: the worker name must not be empty");
    }
  }
  RemoteDevice(int rank, c10::Device device) : worker_(rank), device_(device) {
    if (rank < 0) {
      throw std::invalid_argument("distrpc::nn::RemoteDevice: the rank must be >= 0, got " +
                                  std::to_string(rank));
    }
  }

  bool has_worker() const noexcept { return !std::holds_alternative<std::monostate>(worker_); }
  // The worker's name for the "<workername>/..." form.
  std::optional<std::string> worker_name() const {
    if (auto* n = std::get_if<std::string>(&worker_)) return *n;
    return std::nullopt;
  }
  // The worker's rank for the "rank:<n>/..." form.
  std::optional<int> rank() const {
    if (auto* r = std::get_if<int>(&worker_)) return *r;
    return std::nullopt;
  }
  c10::Device device() const noexcept { return device_; }

  // The canonical text: "worker1/cpu", "rank:1/cuda:0", "cuda:0" (no worker).
  std::string str() const {
    const std::string dev = device_.str();
    if (auto n = worker_name()) return *n + "/" + dev;
    if (auto r = rank()) return "rank:" + std::to_string(*r) + "/" + dev;
    return dev;
  }

  friend bool operator==(const RemoteDevice& a, const RemoteDevice& b) {
    return a.worker_ == b.worker_ && a.device_ == b.device_;
  }

  // Travels inside a RemoteModule (wire archives only: c10::Device has no other cereal form).
  template <class Archive>
  void serialize(Archive& ar) {
    ar(worker_, device_);
  }

 private:
  static std::string format_error(std::string_view text) {
    return "Could not parse remote_device: " + std::string(text) +
           ". The valid format is '<workername>/<device>' or 'rank:<rank>/<device>' or "
           "'<workername>' or 'rank:<rank>'";
  }

  // c10::Device's parse, its error as std::invalid_argument with c10's text (no C++ backtrace).
  static c10::Device parse_device(const std::string& s) {
    try {
      return c10::Device(s);
    } catch (const c10::Error& e) {
      throw std::invalid_argument(e.what_without_backtrace());
    }
  }

  static bool is_valid_device(const std::string& s) {
    try {
      (void)c10::Device(s);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }

  void parse(std::string_view text) {
    const auto slash = text.find('/');
    std::string worker;
    std::string device;
    bool has_worker_field = true;
    if (slash == std::string_view::npos) {
      // One field: a device if it reads as one, otherwise a worker on the CPU.
      const std::string field(text);
      if (is_valid_device(field)) {
        has_worker_field = false;
        device = field;
      } else {
        worker = field;
        device = "cpu";
      }
    } else {
      if (text.find('/', slash + 1) != std::string_view::npos) {
        throw std::invalid_argument(format_error(text));
      }
      worker = std::string(text.substr(0, slash));
      device = std::string(text.substr(slash + 1));
    }
    if (has_worker_field && worker.empty()) throw std::invalid_argument(format_error(text));
    device_ = parse_device(device);
    if (!has_worker_field) return;
    const auto colon = worker.find(':');
    if (colon == std::string::npos) {
      worker_ = std::move(worker);
      return;
    }
    // "rank:<digits>" is the rank form; any other name with a colon does not parse.
    const std::string_view head(worker.data(), colon);
    const std::string_view digits(worker.data() + colon + 1, worker.size() - colon - 1);
    int rank = -1;
    const bool all_digits =
        !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos;
    if (head != "rank" || !all_digits) throw std::invalid_argument(format_error(text));
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
    if (ec != std::errc() || end != digits.data() + digits.size()) {
      throw std::invalid_argument(format_error(text) + " (rank out of range)");
    }
    worker_ = rank;
  }

  std::variant<std::monostate, std::string, int> worker_;
  c10::Device device_{c10::kCPU};
};

}  // namespace distrpc::nn
