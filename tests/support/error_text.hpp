// error_text<E>(f): the text of the E that f() throws, or "<no exception>" (so a CHECK on the
// text fails with both texts shown). Another exception type propagates and fails the test.
// contains(text, part): whether an error text (or any text) has `part` in it.
#pragma once

#include <string>

namespace distrpc::testing {

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

template <class E, class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception>";
}

}  // namespace distrpc::testing
