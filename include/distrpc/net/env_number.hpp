// A whole number from an environment variable, for the knobs the transports read at start-up
// (polling times, pool sizes): unset or empty gives the default, anything else must be digits
// only and within range, or start-up fails naming the variable, its value and what it expects.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace distrpc::net {

// The value of `var` as a whole number in 0..max, `fallback` when unset or empty. Throws
// std::invalid_argument "<var>='<value>' is not a number of <unit> in 0..<max>" otherwise.
inline unsigned long long whole_number_from_env(const char* var, unsigned long long fallback,
                                                unsigned long long max, const char* unit) {
  const char* v = std::getenv(var);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  // strtoull also takes leading blanks and a sign: a whole number is digits only.
  if (*v < '0' || *v > '9' || *end != '\0' || n > max) {
    throw std::invalid_argument(std::string(var) + "='" + v + "' is not a number of " + unit +
                                " in 0.." + std::to_string(max));
  }
  return n;
}

}  // namespace distrpc::net
