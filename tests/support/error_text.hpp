// error_text<E>(f): the text of the E that f() throws, or "<no exception>" (so a CHECK on the
// text fails with both texts shown). Another exception type propagates and fails the test.
#pragma once

#include <string>

namespace distrpc::testing {

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
