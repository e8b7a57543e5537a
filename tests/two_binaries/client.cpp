// The client of the two-binary check: declarations only (api.hpp), no implementation. Calls the
// server through them and checks the values and the errors; prints "client: N checks passed" or
// each failure, and exits non-zero on any.
//   two_binaries_client <init_method>
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <string>

#include "api.hpp"
#include "distrpc/distrpc.hpp"
#include "distrpc/nn/remote_module.hpp"
#include "distrpc/transport/tcp.hpp"

namespace client_only {

// Declared here only, on purpose: "math.add" with another signature than the server's, and a
// name the server does not have.
DISTRPC_REMOTE(add_with_i64, "math.add", at::Tensor(at::Tensor, std::int64_t));
DISTRPC_REMOTE(missing, "math.missing", double(double));

}  // namespace client_only

namespace {

int passed = 0;
int failed = 0;

void check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

void check_text(const std::string& got, const std::string& want, const std::string& what) {
  check(got == want, what + ": got \"" + got + "\", want \"" + want + "\"");
}

void run() {
  const auto a = at::tensor({1.0, 2.0});
  const auto b = at::tensor({2.0, 3.0});

  // Values through the declarations: rpc_sync, rpc_async (with CallOptions), remote.
  check(at::equal(distrpc::rpc_sync<two_bin::add>("server", a, b), at::tensor({3.0, 5.0})),
        "rpc_sync<add>");
  auto f =
      distrpc::rpc_async<two_bin::add>(0, distrpc::with_timeout(std::chrono::seconds(20)), a, a);
  check(at::equal(f.value(), at::tensor({2.0, 4.0})), "rpc_async<add> with CallOptions");
  check(distrpc::rpc_sync<two_bin::describe>("server", std::vector<std::int64_t>{1, 2, 3},
                                             std::string("x")) == "3 values, sum 6, tag x",
        "rpc_sync<describe>");
  check(distrpc::rpc_sync<two_bin::describe>("server", std::vector<std::int64_t>{}, std::nullopt) ==
            "0 values, sum 0, tag none",
        "rpc_sync<describe> without a tag");
  const two_bin::Point p = distrpc::rpc_sync<two_bin::move_point>("server", two_bin::Point{1, 2},
                                                                  two_bin::Offset{10, 20});
  check(p.x == 11 && p.y == 22, "rpc_sync<move_point>");
  check(distrpc::rpc_sync<two_bin::slow_double>("server", 21.5) == 43.0,
        "rpc_sync<slow_double> (a Future on the server)");
  {
    auto r = distrpc::remote<two_bin::add>("server", distrpc::CallOptions{}, a, b);
    check(at::equal(r.to_here(), at::tensor({3.0, 5.0})), "remote<add>.to_here()");
  }

  // The signature differs from the server's: refused there, naming both.
  check_text(error_of([&] { (void)distrpc::rpc_sync<client_only::add_with_i64>("server", a, 1); }),
             "signature mismatch: function 'math.add' has signature Tensor(Tensor, Tensor) on "
             "WorkerInfo(id=0, name=server), but the caller's declaration is Tensor(Tensor, i64)",
             "mismatched declaration");
  // A name the server does not have.
  check_text(error_of([&] { (void)distrpc::rpc_sync<client_only::missing>("server", 1.0); }),
             "function 'math.missing' is not registered on WorkerInfo(id=0, name=server): expose "
             "it there (DISTRPC_EXPOSE(stub, &impl) for a DISTRPC_REMOTE declaration, "
             "DISTRPC_REGISTER(f) for a function called as rpc_sync<&f>) or build both sides "
             "from the same source",
             "unknown name");

  // A module the server builds (its type exists only there), called through RemoteModule.
  {
    auto module = distrpc::rpc_sync<two_bin::make_scaler>("server", 3.0);
    auto rm = distrpc::nn::RemoteModule<two_bin::ScaleInterface>::init_from_module_rref(
        "server/cpu", module);
    check(at::equal(rm.forward(a), at::tensor({3.0, 6.0})), "RemoteModule forward");
    check(at::equal(rm.forward_async(b).value(), at::tensor({6.0, 9.0})),
          "RemoteModule forward_async");
  }
}

}  // namespace

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
    distrpc::init_rpc<distrpc::transport::Tcp>("client", 1, 2, o);
    run();
    distrpc::shutdown();
  } catch (const std::exception& e) {
    std::printf("FAILED: unexpected error: %s\n", e.what());
    ++failed;
  }
  std::printf("client: %d checks passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
