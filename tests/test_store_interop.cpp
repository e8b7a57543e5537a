// TCPStore against PyTorch's own: a Python torch.distributed.TCPStore (tests/interop/store_peer.py)
// as a client of a distrpc-hosted store, and as the host a distrpc client joins. Every operation
// is checked from both sides. Skipped, saying so, when Python cannot import torch.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/store.hpp"
#include "multiprocess.hpp"
#include "support/error_text.hpp"

extern char** environ;

namespace ds = distrpc::store;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

namespace fs = std::filesystem;

std::string python() {
  const char* p = std::getenv("DISTRPC_TEST_PYTHON");
  return p && *p ? p : "/usr/bin/python3";
}

std::string peer_script() {
  return std::string(DISTRPC_SOURCE_DIR) + "/tests/interop/store_peer.py";
}

// A child process whose stdout and stderr go to files; killed if it outlives `limit`.
class Child {
 public:
  Child(const std::vector<std::string>& argv, std::chrono::seconds limit) : limit_(limit) {
    std::string tmpl = (fs::temp_directory_path() / "distrpc-interop-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, (dir_ / "out").c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_addopen(&fa, 2, (dir_ / "err").c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    // posix_spawn, not fork(): this process has threads (the store server's among them).
    const int rc = ::posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0)
      throw std::runtime_error("posix_spawn " + argv[0] + " failed: " + std::to_string(rc));
    start_ = Clock::now();
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // The exit status; -1 when the child had to be killed at its wall-clock limit.
  int join() {
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) break;
      if (Clock::now() - start_ > limit_) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        pid_ = -1;
        return -1;
      }
      std::this_thread::sleep_for(10ms);
    }
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  std::string out() const { return read(dir_ / "out"); }
  std::string err() const { return read(dir_ / "err"); }
  // The "name=value" lines printed so far.
  std::map<std::string, std::string> values() const {
    std::map<std::string, std::string> m;
    std::istringstream in(out());
    std::string line;
    while (std::getline(in, line)) {
      const auto eq = line.find('=');
      if (eq != std::string::npos) m[line.substr(0, eq)] = line.substr(eq + 1);
    }
    return m;
  }

 private:
  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  fs::path dir_;
  pid_t pid_ = -1;
  std::chrono::seconds limit_;
  Clock::time_point start_;
};

// True when Python can import torch.distributed; otherwise the reason, for the skip message.
std::optional<std::string> python_torch_missing() {
  try {
    Child probe({python(), "-c", "import torch.distributed"}, std::chrono::seconds(60));
    const int rc = probe.join();
    if (rc == 0) return std::nullopt;
    return python() + " -c 'import torch.distributed' exited with " + std::to_string(rc) + ": " +
           probe.err().substr(0, 300);
  } catch (const std::exception& e) {
    return e.what();  // no such interpreter
  }
}

using distrpc::testing::contains;

}  // namespace

TEST_CASE("TCPStore interop: Python TCPStore clients use a distrpc-hosted store") {
  if (auto why = python_torch_missing()) {
    MESSAGE("SKIPPED (no PyTorch for Python): " << *why);
    return;
  }
  ds::TCPStoreOptions opts;
  opts.world_size = 2;
  opts.is_master = true;
  opts.timeout = 30s;
  // PyTorch 1.13's client opens a second connection that stays silent (for key-change callbacks):
  // the server closes it after this, and the client must not mind.
  opts.handshake_timeout = 500ms;
  ds::TCPStore master(opts);
  master.set("from_cpp", "hello");
  CHECK(master.add("cnt", 5) == 5);
  master.set("to_delete", "x");

  Child py({python(), peer_script(), "client", std::to_string(master.port())},
           std::chrono::seconds(90));
  // Evaluated when a check fails: what Python printed so far.
  INFO("python stdout:\n" << py.out() << "\npython stderr:\n" << py.err());
  // The Python client registers on c10d's "init/" counter like ours did.
  master.wait({"py_done"}, 60s);
  CHECK(master.get_string("from_py") == "world");
  CHECK(master.get("binary") == ds::Bytes{0x00, 0x01, 0xff});
  CHECK(master.add("cnt", 0) == 8);
  CHECK(master.get_string("cs") == "second");
  CHECK_FALSE(master.check({"to_delete"}));
  const auto keys_here = master.num_keys();
  master.set("cpp_after", "released");
  const int rc = py.join();
  REQUIRE(rc == 0);
  auto v = py.values();
  CHECK(v["get_from_cpp"] == "hello");
  CHECK(v["add_cnt"] == "8");
  CHECK(v["cs_missing"] == "first");
  CHECK(v["cs_swap"] == "second");
  CHECK(v["cs_differs"] == "second");
  if (v["has_check"] == "True") {
    CHECK(v["check_some_missing"] == "False");
    CHECK(v["check_present"] == "True");
  } else {
    CHECK(v["has_check"] == "False");
    MESSAGE("this PyTorch's Python TCPStore has no check(); checked from the C++ side only");
  }
  CHECK(contains(v["wait_timeout"], "RuntimeError"));
  CHECK(contains(v["wait_timeout"], "imeout"));
  CHECK(std::stoi(v["wait_timeout_ms"]) >= 250);
  CHECK(std::stoi(v["wait_timeout_ms"]) < 5000);
  CHECK(v["delete_present"] == "True");
  CHECK(v["delete_absent"] == "False");
  CHECK(v["get_late"] == "released");
  // Both sides count the same keys, c10d's "init/" counter included: Python saw from_cpp cnt
  // from_py binary cs + "init/" (to_delete gone); ours came after py_done.
  CHECK(v["num_keys"] == "6");
  CHECK(keys_here == 7);
}

TEST_CASE("TCPStore interop: a distrpc client joins a store hosted by Python") {
  if (auto why = python_torch_missing()) {
    MESSAGE("SKIPPED (no PyTorch for Python): " << *why);
    return;
  }
  const int port = distrpc::testing::free_loopback_port();
  Child py({python(), peer_script(), "server", std::to_string(port)}, std::chrono::seconds(90));
  INFO("python stdout:\n" << py.out() << "\npython stderr:\n" << py.err());
  // Retries until Python listens; registering on "init/" releases Python's wait_for_workers.
  ds::TCPStore client("127.0.0.1", port, 2, false, 60s);
  client.wait({"py_ready"});
  CHECK(client.get_string("from_py") == "hello from python");
  CHECK(client.add("cnt", 5) == 15);
  CHECK(client.compare_set("cs", {}, ds::to_bytes("first")) == ds::to_bytes("first"));
  CHECK(client.compare_set("cs", ds::to_bytes("first"), ds::to_bytes("second")) ==
        ds::to_bytes("second"));
  CHECK(client.compare_set("cs", ds::to_bytes("first"), ds::to_bytes("third")) ==
        ds::to_bytes("second"));
  CHECK(client.compare_set("absent", ds::to_bytes("x"), ds::to_bytes("y")) == ds::to_bytes("x"));
  CHECK(client.check({"from_py", "to_delete"}));
  CHECK_FALSE(client.check({"from_py", "absent"}));
  CHECK(client.delete_key("to_delete"));
  CHECK_FALSE(client.delete_key("to_delete"));
  client.set("binary", ds::Bytes{0x00, 0x01, 0xff});
  // A wait that times out on a c10d server: the same error as against ours.
  const auto t0 = Clock::now();
  std::string text;
  try {
    client.wait({"from_py", "never"}, 300ms);
  } catch (const ds::StoreTimeoutError& e) {
    text = e.what();
  }
  CHECK(Clock::now() - t0 >= 290ms);
  CHECK(contains(text, "Timeout after 300 ms in wait"));
  CHECK(contains(text, "(missing ['never'])"));
  // get() of a missing key times out the same way, and the store object stays usable.
  client.set_timeout(200ms);
  CHECK_THROWS_AS(client.get("never"), ds::StoreTimeoutError);
  client.set_timeout(60s);
  // from_py cnt cs binary py_ready + "init/" (to_delete gone) before cpp_done.
  CHECK(client.num_keys() == 6);
  client.set("cpp_done", "from c++");
  CHECK(client.get_string("py_after") == "late value");
  client.set("cpp_exit", "1");
  const int rc = py.join();
  REQUIRE(rc == 0);
  auto v = py.values();
  CHECK(v["hosting"] == "yes");
  CHECK(v["get_from_cpp"] == "from c++");
  CHECK(v["cnt"] == "15");
  CHECK(v["cs"] == "second");
  if (v["has_check"] == "True") CHECK(v["check_deleted"] == "False");
  CHECK(v["binary"] == "0001ff");
  CHECK(v["num_keys"] == "7");  // and cpp_done
  CHECK(contains(v["wait_timeout"], "imeout"));
  CHECK(v["bye"] == "1");
}
