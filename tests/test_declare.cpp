// DISTRPC_REMOTE declarations and DISTRPC_EXPOSE: the library's spelling of types (the identity
// two binaries agree on), calls through declarations between two agents of this process (values,
// CallOptions, remote(), a declaration whose signature differs, a name nobody exposed, a worker
// that serves only what it exposes), and one implementation per name (duplicates refused with
// both origins, at once at run time; recorded at start-up and refused by join()). The calls run
// on loopback TCP; every wait is bounded.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <distrpc/declare.hpp>
#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>
#include <distrpc/transport/tcp.hpp>

#include "support/error_text.hpp"
#include "support/fresh_url.hpp"

using distrpc::testing::error_text;
using distrpc::testing::fresh_file_url;

using namespace std::chrono_literals;
using distrpc::RpcGroup;
using distrpc::transport::Tcp;

namespace decl_test {

struct Point {
  double x = 0;
  double y = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(x, y);
  }
};
// Names itself with a member.
struct Named {
  static constexpr std::string_view distrpc_type_name = "test.Named";
};
struct Unnamed {};

}  // namespace decl_test

DISTRPC_TYPE_NAME(decl_test::Point, "geo.Point");

namespace decl_test {

DISTRPC_REMOTE(add, "decl_test.add", at::Tensor(at::Tensor, at::Tensor));
DISTRPC_REMOTE(add_i64, "decl_test.add", at::Tensor(at::Tensor, std::int64_t));
DISTRPC_REMOTE(mirror, "decl_test.mirror", Point(const Point&));
DISTRPC_REMOTE(nobody, "decl_test.nobody", void(std::string));
DISTRPC_REMOTE(scale, "decl_test.scale", double(double));

at::Tensor add_impl(const at::Tensor& a, at::Tensor b) {
  return a + b;
}
Point mirror_impl(Point p) {
  return {p.y, p.x};
}
double scale_a(double x) {
  return 2 * x;
}
double scale_b(double x) {
  return x + x;
}
std::int64_t echo(std::int64_t x) {
  return x;
}
Unnamed pass_unnamed(Unnamed u) {
  return u;
}

}  // namespace decl_test

DISTRPC_EXPOSE(decl_test::add, &decl_test::add_impl);
DISTRPC_EXPOSE(decl_test::mirror, &decl_test::mirror_impl);

namespace {

distrpc::RpcBackendOptions options(const std::string& url, bool exposed_only) {
  distrpc::RpcBackendOptions o;
  o.init_method = url;
  o.rpc_timeout = 20s;
  o.init_timeout = 20s;
  o.serve_exposed_only = exposed_only;
  return o;
}

}  // namespace

TEST_CASE("declare: the library spells types the same whatever the compiler") {
  using distrpc::detail::signature_spelling;
  using distrpc::detail::spelling;
  CHECK(spelling<at::Tensor>() == "Tensor");
  CHECK(spelling<const at::Tensor&>() == "Tensor");
  CHECK(spelling<bool>() == "bool");
  CHECK(spelling<std::int8_t>() == "i8");
  CHECK(spelling<std::int16_t>() == "i16");
  CHECK(spelling<std::int32_t>() == "i32");
  CHECK(spelling<std::int64_t>() == "i64");
  CHECK(spelling<long long>() == "i64");  // the same width as long: the same spelling
  CHECK(spelling<std::uint8_t>() == "u8");
  CHECK(spelling<std::uint64_t>() == "u64");
  CHECK(spelling<double>() == "f64");
  CHECK(spelling<float>() == "f32");
  CHECK(spelling<std::string>() == "str");
  CHECK(spelling<c10::IValue>() == "IValue");
  CHECK(spelling<std::vector<std::optional<std::string>>>() == "list<optional<str>>");
  CHECK(spelling<std::tuple<std::int32_t, double, float, bool>>() == "tuple<i32, f64, f32, bool>");
  CHECK(spelling<std::tuple<>>() == "tuple<>");
  CHECK(spelling<std::pair<std::int16_t, c10::IValue>>() == "pair<i16, IValue>");
  CHECK(spelling<std::map<std::string, std::vector<at::Tensor>>>() == "map<str, list<Tensor>>");
  CHECK(spelling<std::unordered_map<std::int64_t, std::uint8_t>>() == "unordered_map<i64, u8>");
  CHECK(spelling<distrpc::Future<std::int64_t>>() == "Future<i64>");
  CHECK(spelling<distrpc::RRef<at::Tensor>>() == "RRef<Tensor>");
  CHECK(spelling<decl_test::Point>() == "geo.Point");
  CHECK(spelling<std::vector<decl_test::Named>>() == "list<test.Named>");

  CHECK(distrpc::detail::spellable<std::vector<std::map<std::string, decl_test::Point>>>());
  CHECK_FALSE(distrpc::detail::spellable<decl_test::Unnamed>());
  CHECK_FALSE(distrpc::detail::spellable<std::vector<decl_test::Unnamed>>());
  CHECK_FALSE(distrpc::detail::spellable<std::tuple<int, decl_test::Unnamed>>());

  // Signatures: parameters as they travel, a Future result as its value.
  CHECK(signature_spelling<at::Tensor, const at::Tensor&, std::int64_t>() == "Tensor(Tensor, i64)");
  CHECK(signature_spelling<distrpc::Future<double>, std::string>() == "f64(str)");
  CHECK(signature_spelling<void>() == "void()");
}

TEST_CASE("declare: a declaration's identity is its name and its spelled signature") {
  using Add = std::remove_cvref_t<decltype(decl_test::add)>;
  using AddI64 = std::remove_cvref_t<decltype(decl_test::add_i64)>;
  CHECK(Add::name() == "decl_test.add");
  CHECK(Add::signature_text() == "Tensor(Tensor, Tensor)");
  CHECK(Add::signature() == distrpc::detail::fnv1a("Tensor(Tensor, Tensor)"));
  CHECK(AddI64::name() == "decl_test.add");
  CHECK(AddI64::signature_text() == "Tensor(Tensor, i64)");
  CHECK(AddI64::signature() != Add::signature());
  using Mirror = std::remove_cvref_t<decltype(decl_test::mirror)>;
  CHECK(Mirror::signature_text() == "geo.Point(geo.Point)");

  // The exposure: under the declaration's name and signature, exposed, not the library's.
  const auto e = distrpc::Registry::instance().find("decl_test.add");
  REQUIRE(e.has_value());
  CHECK(e->signature == Add::signature());
  CHECK(e->signature_text == "Tensor(Tensor, Tensor)");
  CHECK(e->exposed);
  CHECK_FALSE(e->library);
  CHECK(e->origin.find("'decl_test::add_impl' (DISTRPC_EXPOSE at ") == 0);

  // The SPMD form spells its signature the library's way when it can, else the compiler's way.
  CHECK(distrpc::detail::signature_text<&decl_test::echo>() == "i64(i64)");
  CHECK(distrpc::detail::signature_hash<&decl_test::echo>() == distrpc::detail::fnv1a("i64(i64)"));
  CHECK(distrpc::detail::signature_text<&decl_test::pass_unnamed>().find("Unnamed") !=
        std::string::npos);
}

TEST_CASE("declare: one implementation per name, refused at once with both origins") {
  distrpc::Registry r;
  r.expose<decl_test::scale, &decl_test::scale_a>();
  const int line_a = __LINE__ - 1;
  r.expose<decl_test::scale, &decl_test::scale_a>();  // the same implementation again: fine
  CHECK(r.contains("decl_test.scale"));
  std::string text;
  int line_b = 0;
  try {
    line_b = __LINE__ + 1;
    r.expose<decl_test::scale, &decl_test::scale_b>();
  } catch (const std::invalid_argument& e) {
    text = e.what();
  }
  const std::string file = __FILE__;
  CHECK(text ==
        "two implementations are registered under the function name 'decl_test.scale': "
        "'decl_test::scale_a' (Registry::expose at " +
            file + ":" + std::to_string(line_a) +
            ") and 'decl_test::scale_b' (Registry::expose at " + file + ":" +
            std::to_string(line_b) + ") (a name identifies one function: rename one of them)");
  // The first one stays.
  CHECK(r.find("decl_test.scale")->origin.find("'decl_test::scale_a'") == 0);

  // The SPMD registration of a function, twice: fine; a raw entry under a taken name: refused.
  r.add<&decl_test::echo>();
  r.add<&decl_test::echo>();
  const std::string echo_name(distrpc::detail::function_name<&decl_test::echo>());
  CHECK_THROWS_WITH_AS(r.add(echo_name, 1, "i64(i64)", {}),
                       ("two implementations are registered under the function name '" + echo_name +
                        "': " + distrpc::detail::function_origin<&decl_test::echo>() +
                        " (Registry::add) and Registry::add(\"" + echo_name +
                        "\", ...) (a name identifies one function: rename one of them)")
                           .c_str(),
                       std::invalid_argument);
  CHECK(r.conflicts().empty());
}

TEST_CASE("declare: a conflict recorded at start-up fails join() with its text") {
  auto r = std::make_shared<distrpc::Registry>();
  r->add_at_startup("decl_test.twice", [] {
    distrpc::detail::RegistryEntry e;
    e.origin = "first";
    e.impl = &distrpc::detail::impl_tag<&decl_test::scale_a>;
    return e;
  }());
  r->add_at_startup("decl_test.twice", [] {
    distrpc::detail::RegistryEntry e;
    e.origin = "second";
    e.impl = &distrpc::detail::impl_tag<&decl_test::scale_b>;
    return e;
  }());
  const std::string want =
      "two implementations are registered under the function name 'decl_test.twice': first and "
      "second (a name identifies one function: rename one of them)";
  REQUIRE(r->conflicts().size() == 1);
  CHECK(r->conflicts()[0] == want);
  CHECK_THROWS_WITH_AS(r->check_conflicts(), want.c_str(), std::invalid_argument);
  // Refused before the rendezvous: nothing waits for a peer.
  CHECK_THROWS_WITH_AS(
      RpcGroup::join<Tcp>("alone", 0, 1, options(fresh_file_url("declare"), false), r),
      want.c_str(), std::invalid_argument);
}

TEST_CASE("declare: calls through declarations, on a worker that serves only what it exposes") {
  const auto url = fresh_file_url("declare");
  auto server = std::async(std::launch::async, [&] {
    return RpcGroup::join<Tcp>("server", 0, 2, options(url, /*exposed_only=*/true));
  });
  RpcGroup client = RpcGroup::join<Tcp>("client", 1, 2, options(url, false));
  REQUIRE(server.wait_for(30s) == std::future_status::ready);
  RpcGroup s = server.get();

  const auto a = at::tensor({1.0, 2.0});
  const auto b = at::tensor({10.0, 20.0});
  CHECK(at::equal(client.rpc_sync<decl_test::add>("server", a, b), at::tensor({11.0, 22.0})));
  CHECK(at::equal(client.rpc_async<decl_test::add>(0, a, a).value(), at::tensor({2.0, 4.0})));
  {
    const auto use = client.use();
    // With CallOptions first, as the other forms.
    CHECK(at::equal(distrpc::rpc_sync<decl_test::add>("server", distrpc::with_timeout(10s), a, b),
                    at::tensor({11.0, 22.0})));
    CHECK(at::equal(
        distrpc::rpc_async<decl_test::add>("server", distrpc::CallOptions{}, b, b).value(),
        at::tensor({20.0, 40.0})));
    auto r = distrpc::remote<decl_test::add>("server", distrpc::with_timeout(10s), a, a);
    CHECK(at::equal(r.to_here(), at::tensor({2.0, 4.0})));
    const decl_test::Point p =
        distrpc::rpc_sync<decl_test::mirror>("server", decl_test::Point{1, 2});
    CHECK(p.x == 2);
    CHECK(p.y == 1);
  }
  // The same name with another signature: refused on the callee, naming both.
  CHECK(error_text<std::exception>(
            [&] { (void)client.rpc_sync<decl_test::add_i64>("server", a, 3); }) ==
        "signature mismatch: function 'decl_test.add' has signature Tensor(Tensor, Tensor) on "
        "WorkerInfo(id=0, name=server), but the caller's declaration is Tensor(Tensor, i64)");
  // Declared, exposed nowhere.
  CHECK(error_text<std::exception>(
            [&] { client.rpc_sync<decl_test::nobody>("server", std::string("x")); }) ==
        "function 'decl_test.nobody' is not registered on WorkerInfo(id=0, name=server): expose "
        "it there (DISTRPC_EXPOSE(stub, &impl) for a DISTRPC_REMOTE declaration, "
        "DISTRPC_REGISTER(f) for a function called as rpc_sync<&f>) or build both sides from the "
        "same source");
  // The other way (the client serves everything it registered): the same declaration works.
  CHECK(at::equal(s.rpc_sync<decl_test::add>("client", b, b), at::tensor({20.0, 40.0})));

  // Graceful shutdowns wait for each other: at once, from two threads.
  auto first = std::async(std::launch::async, [&] { s.shutdown(); });
  client.shutdown();
  REQUIRE(first.wait_for(30s) == std::future_status::ready);
  first.get();
}
