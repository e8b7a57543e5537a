// Runs a call that must not hang on a thread of its own and waits for it at most `limit`: a
// deadlock then fails the test instead of stalling the suite. A call that does not return is left
// running (detached) until the process exits, so whatever it uses must outlive the test (tests
// leak such objects on purpose).
#pragma once

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <thread>

namespace distrpc::testing {

inline bool finishes_within(std::function<void()> fn, std::chrono::milliseconds limit) {
  auto finished = std::make_shared<std::promise<void>>();
  auto result = finished->get_future();
  std::thread([fn = std::move(fn), finished] {
    fn();
    finished->set_value();
  }).detach();
  return result.wait_for(limit) == std::future_status::ready;
}

}  // namespace distrpc::testing
