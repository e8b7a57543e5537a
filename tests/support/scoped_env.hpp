// Sets and unsets environment variables for a scope; at its end every variable it touched gets
// back what it held before the first change. Only around code that reads them while no other
// thread reads or writes the environment.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace distrpc::testing {

class ScopedEnv {
 public:
  ScopedEnv() = default;
  // One variable set (or unset, for nullptr).
  ScopedEnv(const char* name, const char* value) { set(name, value); }
  // These variables unset: ScopedEnv(ScopedEnv::unset, {"A", "B"}). The tag keeps
  // ScopedEnv{"NAME", "value"} from meaning this.
  struct Unset {};
  static constexpr Unset unset{};
  ScopedEnv(Unset, std::initializer_list<const char*> names) {
    for (const char* name : names) set(name, nullptr);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      put(it->first.c_str(), it->second ? it->second->c_str() : nullptr);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  // Sets `name` to `value` (unsets it for nullptr) until the scope ends.
  void set(const char* name, const char* value) {
    const char* old = std::getenv(name);
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    put(name, value);
  }
  // Sets the variable this scope was made for (its first one) to `value` (unsets it for nullptr).
  void set(const char* value) {
    if (saved_.empty()) throw std::logic_error("ScopedEnv::set(value): no variable yet");
    put(saved_.front().first.c_str(), value);
  }

 private:
  static void put(const char* name, const char* value) {
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }

  // In the order of the changes; restored in reverse, so the first saved value wins.
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace distrpc::testing
