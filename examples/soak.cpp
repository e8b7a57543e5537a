// Chaos soak: a dynamic group of workers keeps many calls in flight for a set time while a chaos
// thread kills a worker with SIGKILL at random times and starts a replacement under its name.
// Prints one JSON line: calls issued, completed, failed (each failure must name a lost worker),
// lost (issued but never completed nor failed: must be 0), hangs (must be 0), and each worker's
// memory at start, after warm-up and at the end. Exits 1 when a rule is broken.
//
//   build/examples/soak [--transport tcp|shm|auto] [--workers 4] [--seconds 20] [--inflight 1000]
//                       [--kill-every-ms 4000] [--spare 1] [--max-growth-pct 5]
//
// --max-growth-pct bounds how much the bytes malloc has in use may grow after warm-up on each
// worker judged (a leak of per-call or per-peer state grows them); the resident sizes are
// reported beside it.
//
// The launcher is this binary without --role: it starts the workers itself (posix_spawn of
// /proc/self/exe, never fork()), because a launcher that stops the group when one member dies
// (launch_local) is what a soak must not have. The group meets through a file:// store, so no
// worker is special: any of them may be killed, except the first --spare ones (1 by default),
// which live through the whole run, so that memory is watched in a process whose peers die and
// are replaced around it (where state kept per peer would pile up).
#include <malloc.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "distrpc/distrpc.hpp"
#include "distrpc/transport/tcp.hpp"
#if __has_include("distrpc/transport/shm.hpp")
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#define SOAK_HAVE_SHM 1
#endif

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// ---- what the workers run for each other -------------------------------------------------

std::int64_t echo_small(std::int64_t v) {
  return v;
}

at::Tensor echo_large(at::Tensor t) {
  return t;
}

at::Tensor make_tensor(std::int64_t n) {
  return at::full({n}, static_cast<double>(n));
}

// A nested call: the callee asks `via` to echo. Asynchronous by its type, so the callee's thread is
// free while the nested call is out (1,000 blocked nested calls would exhaust any pool).
distrpc::Future<std::int64_t> relay(std::int64_t v, std::string via) {
  return distrpc::rpc_async<&echo_small>(via, v);
}

// ---- small helpers -----------------------------------------------------------------------

std::int64_t now_epoch_ms() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::int64_t rss_kb() {
  std::ifstream in("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

// One "<key> <n> kB" line of /proc/self/status (0 when the kernel does not report it).
std::int64_t status_kb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string k;
  std::int64_t n = 0;
  std::string unit;
  while (in >> k) {
    if (k == key) {
      in >> n;
      return n;
    }
    std::getline(in, unit);
  }
  return 0;
}

// Resident private memory (heap, stacks, the process's own mappings): where a leak shows. The
// resident size also counts shared memory (RssShmem): the shared-memory transport's rings, mapped
// per connected peer and touched as messages go round, so it moves by a ring's size whenever a
// peer dies or a replacement connects, whatever the process keeps.
std::int64_t anon_kb() {
  return status_kb("RssAnon:");
}
std::int64_t shmem_kb() {
  return status_kb("RssShmem:");
}

// Bytes malloc hands out now (in use, arenas and its own mappings): beside the resident size, it
// tells a leak (this grows) from memory the allocator keeps without using it (only RSS grows).
std::int64_t heap_in_use_kb() {
  const struct mallinfo2 mi = ::mallinfo2();
  return static_cast<std::int64_t>((mi.uordblks + mi.hblkhd) / 1024);
}

// What the received-buffer cache holds (resident, reused by the next large message: bounded,
// docs/transports.md "Received buffers").
std::int64_t recv_cache_kb() {
  return static_cast<std::int64_t>(distrpc::wire::RecvStorage::instance().stats().cached_bytes /
                                   1024);
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
  }
  std::filesystem::rename(tmp, path);  // readers never see half a file
}

struct Args {
  std::string role;  // "" (the launcher) or "worker"
  std::string transport = "tcp";
  int workers = 4;
  int seconds = 20;
  int inflight = 1000;
  int kill_every_ms = 4000;
  int spare = 1;  // the first `spare` workers are never killed: they watch memory all along
  double max_growth_pct = 5.0;
  // Workers only.
  std::string name;
  int rank = -1;
  std::string dir;
  std::int64_t until_ms = 0;  // wall-clock end of issuing (epoch ms), shared by replacements
  std::int64_t warm_ms = 0;   // wall-clock end of warm-up
  int incarnation = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
      return argv[++i];
    };
    if (k == "--role") {
      a.role = next();
    } else if (k == "--transport") {
      a.transport = next();
    } else if (k == "--workers") {
      a.workers = std::stoi(next());
    } else if (k == "--seconds") {
      a.seconds = std::stoi(next());
    } else if (k == "--inflight") {
      a.inflight = std::stoi(next());
    } else if (k == "--kill-every-ms") {
      a.kill_every_ms = std::stoi(next());
    } else if (k == "--spare") {
      a.spare = std::stoi(next());
    } else if (k == "--max-growth-pct") {
      a.max_growth_pct = std::stod(next());
    } else if (k == "--name") {
      a.name = next();
    } else if (k == "--rank") {
      a.rank = std::stoi(next());
    } else if (k == "--dir") {
      a.dir = next();
    } else if (k == "--until-ms") {
      a.until_ms = std::stoll(next());
    } else if (k == "--warm-ms") {
      a.warm_ms = std::stoll(next());
    } else if (k == "--incarnation") {
      a.incarnation = std::stoi(next());
    } else {
      throw std::invalid_argument("unknown argument '" + k + "'");
    }
  }
  if (a.transport != "tcp" && a.transport != "shm" && a.transport != "auto") {
    throw std::invalid_argument("--transport must be tcp, shm or auto, got '" + a.transport + "'");
  }
#ifndef SOAK_HAVE_SHM
  if (a.transport != "tcp") throw std::invalid_argument("this build has no shm transport");
#endif
  if (a.workers < 2 || a.workers > 64) throw std::invalid_argument("--workers must be in 2..64");
  if (a.seconds < 5) throw std::invalid_argument("--seconds must be at least 5");
  if (a.inflight < 1 || a.inflight > 100000) {
    throw std::invalid_argument("--inflight must be in 1..100000");
  }
  if (a.kill_every_ms < 0) throw std::invalid_argument("--kill-every-ms must be >= 0 (0: none)");
  if (a.spare < 0 || a.spare >= a.workers) {
    throw std::invalid_argument("--spare must be in 0..workers-1 (at least one worker is killed)");
  }
  return a;
}

// ---- a worker ----------------------------------------------------------------------------

// One worker's counts. Completion callbacks run on whatever thread completes the call, so they
// only count (atomics) and keep the first few unexpected texts.
struct Counts {
  std::atomic<std::int64_t> issued{0}, completed{0}, failed{0}, failed_unnamed{0}, wrong{0};
  std::atomic<std::int64_t> small{0}, large{0}, rrefs{0}, nested{0};
  std::mutex mu;
  std::condition_variable cv;
  std::int64_t outstanding = 0;  // under mu
  int large_outstanding = 0;     // under mu: 1 MiB calls in flight, capped
  std::vector<std::string> unnamed_texts;
  std::map<std::string, std::int64_t> failed_by_target;

  void done(bool large_call) {
    std::lock_guard<std::mutex> lk(mu);
    --outstanding;
    if (large_call) --large_outstanding;
    cv.notify_all();
  }
  // Whether `text` names worker `who` as distrpc's errors do: quoted ('w1') or in a WorkerInfo
  // (name=w1).
  static bool names(const std::string& text, const std::string& who) {
    return !who.empty() && (text.find("'" + who + "'") != std::string::npos ||
                            text.find("name=" + who + ")") != std::string::npos);
  }
  // A failure counts as named when its text names the worker called or the one it relayed to.
  void fail(const std::string& text, const std::string& target, const std::string& via) {
    failed.fetch_add(1);
    const bool named = names(text, target) || names(text, via);
    std::lock_guard<std::mutex> lk(mu);
    ++failed_by_target[named ? (names(text, target) ? target : via) : "(unnamed)"];
    if (!named) {
      failed_unnamed.fetch_add(1);
      if (unnamed_texts.size() < 5) unnamed_texts.push_back(text);
    }
  }
};

std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

template <class T>
int run_worker(const Args& a) {
  const std::int64_t rss_start = rss_kb();
  distrpc::RpcBackendOptions opts;
  opts.init_method = "file://" + a.dir + "/store";
  opts.rpc_timeout = std::chrono::seconds(20);
  distrpc::init_rpc<T>(a.name, a.rank, opts);
  write_file(a.dir + "/ready-" + a.name + "-" + std::to_string(::getpid()), "1");

  auto counts = std::make_shared<Counts>();
  std::mt19937_64 rng(static_cast<std::uint64_t>(::getpid()) * 7919u + a.incarnation);
  const at::Tensor mib = at::ones({256 * 1024});  // 1 MiB of float
  std::vector<std::string> peers;
  auto refresh = Clock::now() - std::chrono::seconds(1);
  // RSS after warm-up: at the group's warm-up point, or later for a replacement (below); none (0)
  // when the window left after it is too short to mean anything.
  // A replacement warms up for a tenth of the run (at least 3 s): its pools, connections and
  // buffers grow to their working size first. Growth is judged only over a window of at least a
  // quarter of the run: over a few seconds it says nothing about a leak.
  const std::int64_t run_ms = std::int64_t{a.seconds} * 1000;
  const std::int64_t warm_at =
      std::max(a.warm_ms, now_epoch_ms() + std::max<std::int64_t>(3000, run_ms / 10));
  const bool measure_growth = warm_at <= a.until_ms - std::max<std::int64_t>(2000, run_ms / 4);
  std::int64_t rss_warm = 0, heap_warm = 0, cache_warm = 0, anon_warm = 0, shmem_warm = 0;
  std::int64_t seq = 0;
  // RRefs are held a while after their creation is confirmed, then dropped (a delete message).
  std::deque<distrpc::RRef<at::Tensor>> held;

  while (now_epoch_ms() < a.until_ms) {
    if (measure_growth && rss_warm == 0 && now_epoch_ms() >= warm_at) {
      rss_warm = rss_kb();
      heap_warm = heap_in_use_kb();
      cache_warm = recv_cache_kb();
      anon_warm = anon_kb();
      shmem_warm = shmem_kb();
    }
    if (Clock::now() - refresh > milliseconds(100)) {
      peers.clear();
      for (const auto& w : distrpc::get_worker_infos()) {
        if (w.name != a.name) peers.push_back(w.name);
      }
      refresh = Clock::now();
    }
    if (peers.empty()) {
      std::this_thread::sleep_for(milliseconds(10));
      continue;
    }
    const int roll = static_cast<int>(rng() % 100);
    bool large_call = roll < 2;
    {
      std::unique_lock<std::mutex> lk(counts->mu);
      counts->cv.wait_for(lk, milliseconds(50), [&] {
        return counts->outstanding < a.inflight && (!large_call || counts->large_outstanding < 8);
      });
      if (counts->outstanding >= a.inflight) continue;
      if (large_call && counts->large_outstanding >= 8) large_call = false;
      ++counts->outstanding;
      if (large_call) ++counts->large_outstanding;
    }
    const std::string target = peers[rng() % peers.size()];
    const std::string via = peers[rng() % peers.size()];
    const std::int64_t v = ++seq;
    counts->issued.fetch_add(1);
    try {
      if (large_call) {
        counts->large.fetch_add(1);
        distrpc::rpc_async<&echo_large>(target, mib)
            .add_done_callback([counts, target](const distrpc::Future<at::Tensor>& f) {
              if (f.has_error()) {
                counts->fail(error_text(f.exception_ptr()), target, "");
              } else {
                if (f.value().numel() != 256 * 1024) counts->wrong.fetch_add(1);
                counts->completed.fetch_add(1);
              }
              counts->done(true);
            });
      } else if (roll < 12) {
        counts->rrefs.fetch_add(1);
        held.push_back(
            distrpc::remote<&make_tensor>(target, static_cast<std::int64_t>(v % 16 + 1)));
        if (held.size() > 64) held.pop_front();
        held.back().get_future().add_done_callback(
            [counts, target](const distrpc::Future<void>& f) {
              if (f.has_error()) {
                counts->fail(error_text(f.exception_ptr()), target, "");
              } else {
                counts->completed.fetch_add(1);
              }
              counts->done(false);
            });
      } else if (roll < 22) {
        counts->nested.fetch_add(1);
        distrpc::rpc_async<&relay>(target, v, via)
            .add_done_callback([counts, target, via, v](const distrpc::Future<std::int64_t>& f) {
              if (f.has_error()) {
                counts->fail(error_text(f.exception_ptr()), target, via);
              } else {
                if (f.value() != v) counts->wrong.fetch_add(1);
                counts->completed.fetch_add(1);
              }
              counts->done(false);
            });
      } else {
        counts->small.fetch_add(1);
        distrpc::rpc_async<&echo_small>(target, v).add_done_callback(
            [counts, target, v](const distrpc::Future<std::int64_t>& f) {
              if (f.has_error()) {
                counts->fail(error_text(f.exception_ptr()), target, "");
              } else {
                if (f.value() != v) counts->wrong.fetch_add(1);
                counts->completed.fetch_add(1);
              }
              counts->done(false);
            });
      }
    } catch (const std::exception& e) {  // refused before it left (a departed destination)
      counts->fail(e.what(), target, "");
      counts->done(large_call);
    }
  }
  held.clear();

  // Drain: every call issued must complete or fail within the call timeout (and a margin).
  std::int64_t lost = 0;
  bool drain_hang = false;
  {
    std::unique_lock<std::mutex> lk(counts->mu);
    if (!counts->cv.wait_for(lk, opts.rpc_timeout + std::chrono::seconds(5),
                             [&] { return counts->outstanding == 0; })) {
      drain_hang = true;
    }
    lost = counts->outstanding;
  }
  const std::int64_t rss_end = rss_kb();
  const std::int64_t heap_end = heap_in_use_kb();
  const std::int64_t cache_end = recv_cache_kb();
  const std::int64_t anon_end = anon_kb();
  const std::int64_t shmem_end = shmem_kb();
  // Stay a member until every current member has drained, so nobody's calls fail because a
  // healthy worker left at the end; then until the RRefs this worker owns were released by their
  // users (they dropped theirs before draining), so no member leaves while another still holds
  // one of its RRefs (a leak, which a graceful leave reports).
  const auto meet = [&](const std::string& step, std::chrono::seconds limit) {
    write_file(a.dir + "/" + step + "-" + a.name + "-" + std::to_string(::getpid()), "1");
    const auto wait_end = Clock::now() + limit;
    while (Clock::now() < wait_end) {
      int arrived = 0;
      for (const auto& e : std::filesystem::directory_iterator(a.dir)) {
        if (e.path().filename().string().rfind(step + "-", 0) == 0 &&
            e.path().extension() != ".tmp") {
          ++arrived;
        }
      }
      if (arrived >= static_cast<int>(distrpc::get_worker_infos().size())) return;
      std::this_thread::sleep_for(milliseconds(50));
    }
  };
  meet("drained", std::chrono::seconds(30));
  const auto release_end = Clock::now() + std::chrono::seconds(15);
  while (Clock::now() < release_end && distrpc::get_debug_info()["num_owner_rrefs"] != "0") {
    std::this_thread::sleep_for(milliseconds(50));
  }
  const std::string owned_left = distrpc::get_debug_info()["num_owner_rrefs"];
  meet("released", std::chrono::seconds(20));

  std::ostringstream j;
  {
    std::lock_guard<std::mutex> lk(counts->mu);
    j << "{\"name\":\"" << a.name << "\",\"pid\":" << ::getpid()
      << ",\"incarnation\":" << a.incarnation << ",\"issued\":" << counts->issued.load()
      << ",\"completed\":" << counts->completed.load() << ",\"failed\":" << counts->failed.load()
      << ",\"failed_unnamed\":" << counts->failed_unnamed.load()
      << ",\"wrong\":" << counts->wrong.load() << ",\"lost\":" << lost
      << ",\"drain_hang\":" << (drain_hang ? "true" : "false")
      << ",\"small\":" << counts->small.load() << ",\"large_1MiB\":" << counts->large.load()
      << ",\"rref\":" << counts->rrefs.load() << ",\"nested\":" << counts->nested.load()
      << ",\"rss_start_kb\":" << rss_start << ",\"rss_warm_kb\":" << rss_warm
      << ",\"rss_end_kb\":" << rss_end << ",\"heap_warm_kb\":" << heap_warm
      << ",\"heap_end_kb\":" << heap_end << ",\"recv_cache_warm_kb\":" << cache_warm
      << ",\"recv_cache_end_kb\":" << cache_end << ",\"anon_warm_kb\":" << anon_warm
      << ",\"anon_end_kb\":" << anon_end << ",\"shmem_warm_kb\":" << shmem_warm
      << ",\"shmem_end_kb\":" << shmem_end << ",\"owned_rrefs_at_end\":" << owned_left
      << ",\"failed_by\":{";
    bool first = true;
    for (const auto& [who, n] : counts->failed_by_target) {
      j << (first ? "" : ",") << "\"" << json_escape(who) << "\":" << n;
      first = false;
    }
    j << "},\"unnamed_texts\":[";
    for (std::size_t i = 0; i < counts->unnamed_texts.size(); ++i) {
      j << (i ? "," : "") << "\"" << json_escape(counts->unnamed_texts[i]) << "\"";
    }
    j << "]}";
  }
  write_file(a.dir + "/report-" + a.name + "-" + std::to_string(::getpid()) + ".json", j.str());
  distrpc::shutdown();
  return 0;
}

// ---- the launcher ------------------------------------------------------------------------

struct Child {
  std::string name;
  int rank = 0;
  pid_t pid = -1;
  int incarnation = 0;
};

pid_t spawn_worker(const Args& a, const Child& c, const std::string& dir, std::int64_t until,
                   std::int64_t warm) {
  std::vector<std::string> args{"soak",
                                "--role",
                                "worker",
                                "--transport",
                                a.transport,
                                "--name",
                                c.name,
                                "--rank",
                                std::to_string(c.rank),
                                "--dir",
                                dir,
                                "--until-ms",
                                std::to_string(until),
                                "--warm-ms",
                                std::to_string(warm),
                                "--inflight",
                                std::to_string(a.inflight),
                                "--seconds",
                                std::to_string(a.seconds),
                                "--incarnation",
                                std::to_string(c.incarnation)};
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  if (::posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
    throw std::runtime_error("posix_spawn of a worker failed");
  }
  return pid;
}

bool file_exists(const std::string& p) {
  return std::filesystem::exists(p);
}

// Reads the integer field `key` of a flat JSON object written by a worker.
std::int64_t field(const std::string& json, const std::string& key) {
  const auto at = json.find("\"" + key + "\":");
  if (at == std::string::npos) return 0;
  return std::stoll(json.substr(at + key.size() + 3));
}

int run_launcher(const Args& a) {
  std::string tmpl = "/tmp/distrpc-soak-XXXXXX";
  if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  const std::string dir = tmpl;
  const std::int64_t start = now_epoch_ms();
  const std::int64_t until = start + a.seconds * 1000LL;
  // Warm-up: the first 40 % of the run (at least 3 s): allocator pools and connection buffers
  // reach their working size there; what grows after it is what a leak would look like.
  const std::int64_t warm = start + std::max<std::int64_t>(3000, a.seconds * 400LL);

  std::vector<Child> kids;
  for (int r = 0; r < a.workers; ++r) {
    Child c{"w" + std::to_string(r), r, -1, 0};
    c.pid = spawn_worker(a, c, dir, until, warm);
    kids.push_back(c);
    // One after another: the first one creates the dynamic group, the others join it.
    const auto t0 = Clock::now();
    while (!file_exists(dir + "/ready-" + c.name + "-" + std::to_string(c.pid)) &&
           Clock::now() - t0 < std::chrono::seconds(60)) {
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  // Chaos: kill one ready worker at a time, start its replacement, wait for it to be ready.
  std::mt19937_64 rng(static_cast<std::uint64_t>(start));
  int kills = 0, replacements = 0;
  std::vector<std::string> chaos_log;
  const std::int64_t chaos_end = until - 4000;  // the last seconds are for the drain
  std::vector<pid_t> dead;
  while (a.kill_every_ms > 0 && now_epoch_ms() < chaos_end) {
    const auto pause =
        milliseconds(a.kill_every_ms / 2 + static_cast<int>(rng() % (a.kill_every_ms + 1)));
    const auto wake = Clock::now() + pause;
    while (Clock::now() < wake && now_epoch_ms() < chaos_end) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    if (now_epoch_ms() >= chaos_end) break;
    Child& victim = kids[static_cast<std::size_t>(a.spare) +
                         rng() % (kids.size() - static_cast<std::size_t>(a.spare))];
    ::kill(victim.pid, SIGKILL);
    int status = 0;
    ::waitpid(victim.pid, &status, 0);
    ++kills;
    chaos_log.push_back(victim.name + "@" + std::to_string(now_epoch_ms() - start) + "ms");
    dead.push_back(victim.pid);
    std::this_thread::sleep_for(milliseconds(200));  // the survivors notice the loss first
    ++victim.incarnation;
    victim.pid = spawn_worker(a, victim, dir, until, warm);
    const auto t0 = Clock::now();
    while (!file_exists(dir + "/ready-" + victim.name + "-" + std::to_string(victim.pid)) &&
           Clock::now() - t0 < std::chrono::seconds(30)) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    if (file_exists(dir + "/ready-" + victim.name + "-" + std::to_string(victim.pid))) {
      ++replacements;
    }
  }

  // Every worker must exit by itself: the drain (call timeout + 5 s) and the end meeting (30 s)
  // bound it. One still running after that is a hang; it is killed and counted.
  int hangs = 0;
  const auto deadline =
      Clock::now() + milliseconds(until - now_epoch_ms()) + std::chrono::seconds(70);
  std::vector<int> exit_codes;
  for (Child& c : kids) {
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid) break;
      if (Clock::now() > deadline) {
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, &status, 0);
        ++hangs;
        break;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    exit_codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }

  std::int64_t issued = 0, completed = 0, failed = 0, unnamed = 0, wrong = 0, lost = 0;
  // The rule: the bytes malloc has in use, where state kept per call or per peer piles up. The
  // resident sizes are reported beside it: on a run this short they move with what a leak does
  // not cause (the rings of the shared-memory transport mapped per live peer, and heap pages
  // malloc keeps after frees).
  double max_growth = 0;
  double max_private_growth = 0;  // resident private memory outside the received-buffer cache
  double max_rss_growth = 0;      // the whole resident size, shared-memory rings included
  int reports = 0, drain_hangs = 0;
  std::ostringstream per;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("report-", 0) != 0 || e.path().extension() != ".json") continue;
    std::ifstream in(e.path());
    std::string line((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    issued += field(line, "issued");
    completed += field(line, "completed");
    failed += field(line, "failed");
    unnamed += field(line, "failed_unnamed");
    wrong += field(line, "wrong");
    lost += field(line, "lost");
    if (line.find("\"drain_hang\":true") != std::string::npos) ++drain_hangs;
    // A worker is judged when it took its warm-up sample (rss_warm_kb > 0).
    const auto kb = [&](const char* key) { return static_cast<double>(field(line, key)); };
    const auto growth = [](double warm, double end) { return 100.0 * (end - warm) / warm; };
    if (kb("rss_warm_kb") > 0) {
      max_growth = std::max(max_growth, growth(kb("heap_warm_kb"), kb("heap_end_kb")));
      // The cache of received buffers is resident private memory too, but bounded
      // (docs/transports.md): what it holds is left out on both sides.
      max_private_growth =
          std::max(max_private_growth, growth(kb("anon_warm_kb") - kb("recv_cache_warm_kb"),
                                              kb("anon_end_kb") - kb("recv_cache_end_kb")));
      max_rss_growth = std::max(max_rss_growth, growth(kb("rss_warm_kb"), kb("rss_end_kb")));
    }
    per << (reports ? "," : "") << line;
    ++reports;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);

  hangs += drain_hangs;
  int bad_exits = 0;
  for (int c : exit_codes) bad_exits += c != 0;
  const bool ok = lost == 0 && hangs == 0 && unnamed == 0 && wrong == 0 && bad_exits == 0 &&
                  reports == a.workers && completed > 0 && (a.kill_every_ms == 0 || kills > 0) &&
                  replacements == kills && max_growth < a.max_growth_pct;
  std::ostringstream j;
  j << "{\"bench\":\"soak\",\"transport\":\"" << a.transport << "\",\"workers\":" << a.workers
    << ",\"seconds\":" << a.seconds << ",\"spared\":" << a.spare
    << ",\"inflight_per_worker\":" << a.inflight << ",\"kills\":" << kills
    << ",\"replacements\":" << replacements << ",\"issued\":" << issued
    << ",\"completed\":" << completed << ",\"failed\":" << failed
    << ",\"failed_unnamed\":" << unnamed << ",\"wrong_values\":" << wrong << ",\"lost\":" << lost
    << ",\"hangs\":" << hangs << ",\"bad_exits\":" << bad_exits
    << ",\"max_heap_growth_after_warmup_pct\":" << max_growth
    << ",\"max_private_growth_after_warmup_pct\":" << max_private_growth
    << ",\"max_rss_growth_after_warmup_pct\":" << max_rss_growth << ",\"chaos\":[";
  for (std::size_t i = 0; i < chaos_log.size(); ++i) {
    j << (i ? "," : "") << "\"" << chaos_log[i] << "\"";
  }
  j << "],\"ok\":" << (ok ? "true" : "false") << ",\"workers_final\":[" << per.str() << "]}";
  std::printf("%s\n", j.str().c_str());
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    if (a.role.empty()) return run_launcher(a);
    if (a.role != "worker") throw std::invalid_argument("--role must be worker");
    if (a.transport == "tcp") return run_worker<distrpc::transport::Tcp>(a);
#ifdef SOAK_HAVE_SHM
    if (a.transport == "shm") return run_worker<distrpc::transport::Shm>(a);
    return run_worker<distrpc::transport::Auto<distrpc::transport::Shm, distrpc::transport::Tcp>>(
        a);
#else
    return 2;
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "soak: %s\n", e.what());
    return 2;
  }
}
