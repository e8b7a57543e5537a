// Tests of the gate the agent's destructor and the transports' shutdown() close to wait for the
// threads inside them (entry_gate.hpp): who is waited for, who is refused, and that a close never
// waits for itself nor for ever.
#include <doctest/doctest.h>

#include "distrpc/entry_gate.hpp"
#include "support/finishes_within.hpp"

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

using distrpc::detail::EntryGate;
using distrpc::testing::finishes_within;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// Holds an entry on a thread of its own until release().
class Holder {
 public:
  explicit Holder(EntryGate& gate) {
    auto entered = in_.get_future();
    thread_ = std::thread([this, &gate, released = released_.get_future()]() mutable {
      const bool ok = gate.enter();
      in_.set_value(ok);
      released.wait();
      if (ok) gate.leave();
    });
    entered_ = entered.get();
  }
  ~Holder() {
    release();
    thread_.join();
  }
  bool entered() const { return entered_; }
  void release() {
    if (!released_set_) released_.set_value();
    released_set_ = true;
  }

 private:
  std::promise<bool> in_;
  std::promise<void> released_;
  bool released_set_ = false;
  bool entered_ = false;
  std::thread thread_;
};

}  // namespace

TEST_CASE("entry gate: close waits for the thread inside and refuses later entries") {
  auto* gate = new EntryGate;  // leaked: a hung close would still use it
  Holder holder(*gate);
  REQUIRE(holder.entered());
  std::atomic<bool> closed{false};
  const auto t0 = Clock::now();
  std::thread releaser([&] {
    std::this_thread::sleep_for(150ms);
    CHECK_FALSE(closed.load());  // still waiting for the holder
    holder.release();
  });
  CHECK(finishes_within(
      [gate, &closed] {
        gate->close_and_wait();
        closed.store(true);
      },
      5s));
  releaser.join();
  CHECK(Clock::now() - t0 >= 140ms);
  CHECK(gate->closed());
  CHECK_FALSE(gate->enter());
  EntryGate::Scope refused(*gate);
  CHECK_FALSE(static_cast<bool>(refused));
}

TEST_CASE("entry gate: a thread closing from inside its own entry waits only for the others") {
  auto* gate = new EntryGate;
  SUBCASE("alone: returns at once, through nested entries") {
    CHECK(finishes_within(
        [gate] {
          EntryGate::Scope outer(*gate);
          EntryGate::Scope inner(*gate);
          gate->close_and_wait();
        },
        5s));
  }
  SUBCASE("another thread inside: returns when that one leaves, not when the count reaches 0") {
    // The closer's own entry keeps the count above zero: the wake-up must come with the other
    // thread's leave, or the closer waits for ever.
    auto holder = std::make_shared<Holder>(*gate);
    REQUIRE(holder->entered());
    std::thread releaser([holder] {
      std::this_thread::sleep_for(100ms);
      holder->release();
    });
    CHECK(finishes_within(
        [gate] {
          EntryGate::Scope own(*gate);
          gate->close_and_wait();
        },
        5s));
    releaser.join();
  }
}

TEST_CASE("entry gate: a thread that keeps trying to enter does not hold up the close") {
  // A caller looping on drive() after the shutdown began: its refused entries must not count.
  auto* gate = new EntryGate;
  Holder holder(*gate);
  REQUIRE(holder.entered());
  std::atomic<bool> stop{false};
  std::atomic<long> refused{0};
  std::thread knocking([&] {
    while (!stop.load()) {
      if (gate->enter()) {
        gate->leave();
      } else {
        refused.fetch_add(1);
      }
    }
  });
  std::thread releaser([&] {
    std::this_thread::sleep_for(100ms);
    holder.release();
  });
  const auto t0 = Clock::now();
  const bool all_left = gate->close_and_wait_until(t0 + 3s);
  const auto waited = Clock::now() - t0;
  stop.store(true);
  knocking.join();
  releaser.join();
  CHECK(all_left);
  CHECK(waited < 1s);
  CHECK(refused.load() > 0);
}

TEST_CASE("entry gate: a bounded close gives up at its deadline and says so") {
  auto* gate = new EntryGate;
  Holder holder(*gate);
  REQUIRE(holder.entered());
  const auto t0 = Clock::now();
  CHECK_FALSE(gate->close_and_wait_until(t0 + 200ms));
  const auto waited = Clock::now() - t0;
  CHECK(waited >= 190ms);
  CHECK(waited < 3s);
  CHECK_FALSE(gate->enter());  // closed even though the wait gave up
  holder.release();
  CHECK(gate->close_and_wait_until(Clock::now() + 5s));  // closing again is allowed
}

TEST_CASE("entry gate: the closer may free the gate as soon as close returns") {
  // Each thread enters once and leaves after a short spin, racing the close; the closer frees the
  // gate the moment close returns. No thread may still be inside then, nor still touching the
  // gate on its way out (the sanitizer build sees the second).
  for (int round = 0; round < 50; ++round) {
    auto* gate = new EntryGate;
    std::atomic<int> entered{0};
    std::atomic<int> inside{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([gate, &entered, &inside, t, round] {
        const bool in = gate->enter();
        if (in) inside.fetch_add(1);
        entered.fetch_add(1);
        std::atomic<int> spin{0};
        while (spin.fetch_add(1) < (t + round) % 4 * 2000) {
        }
        if (in) {
          inside.fetch_sub(1);
          gate->leave();
        }
      });
    }
    while (entered.load() < 4) std::this_thread::yield();
    int inside_after = -1;
    CHECK(finishes_within(
        [gate, &inside, &inside_after] {
          gate->close_and_wait();
          inside_after = inside.load();
          delete gate;
        },
        5s));
    for (auto& th : threads) th.join();
    CHECK(inside_after == 0);
  }
}
