// Store benchmark. Prints one JSON object:
//   tcpstore_ops_per_s  set+get pairs (2 ops each) from one client thread to a TCPStore server on
//                       loopback, 16-byte values, keys k0..k99 (as
//                       /work/shared/bench/c10d_store_ref.py)
//   rendezvous_64_ms    wall time for 64 clients (threads) to connect, publish one key each and
//   read
//                       all 64, server start included
// Each figure is the median of several runs.
//
//   bench_store [--iterations N] [--runs R]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "distrpc/store.hpp"

namespace {

namespace ds = distrpc::store;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double tcpstore_ops_per_s(int iterations) {
  ds::TCPStore server("127.0.0.1", 0, 2, true, 30s);
  double result = 0;
  std::thread client([&] {
    ds::TCPStore store("127.0.0.1", server.port(), 2, false, 30s);
    const ds::Bytes value(16, 'v');
    std::vector<std::string> keys;
    for (int i = 0; i < 100; ++i) keys.push_back("k" + std::to_string(i));
    for (int i = 0; i < 200; ++i) {  // warm-up: connection, allocator, caches
      store.set(keys[i % 100], value);
      store.get(keys[i % 100]);
    }
    const auto t0 = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      store.set(keys[i % 100], value);
      store.get(keys[i % 100]);
    }
    result = 2.0 * iterations / std::chrono::duration<double>(Clock::now() - t0).count();
  });
  client.join();
  return result;
}

double rendezvous_ms(int ranks) {
  const auto t0 = Clock::now();
  ds::TCPStore server("127.0.0.1", 0, ranks + 1, true, 30s);
  const int port = server.port();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(ranks);
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        ds::TCPStore store("127.0.0.1", port, ranks + 1, false, 30s);
        store.set("addr/" + std::to_string(r), "127.0.0.1:" + std::to_string(40000 + r));
        for (int other = 0; other < ranks; ++other) store.get("addr/" + std::to_string(other));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (!e.empty()) throw std::runtime_error("rendezvous rank failed: " + e);
  }
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = 5000;
  int runs = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iterations") && i + 1 < argc) {
      iterations = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--iterations N] [--runs R]\n", argv[0]);
      return 2;
    }
  }
  if (iterations < 1 || runs < 1) {
    std::fprintf(stderr, "bench_store: --iterations and --runs must be positive\n");
    return 2;
  }
  try {
    std::vector<double> ops, rdv;
    for (int r = 0; r < runs; ++r) ops.push_back(tcpstore_ops_per_s(iterations));
    for (int r = 0; r < runs; ++r) rdv.push_back(rendezvous_ms(64));
    std::printf("{\"tcpstore_ops_per_s\": %.0f, \"rendezvous_64_ms\": %.1f}\n", median(ops),
                median(rdv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_store: %s\n", e.what());
    return 1;
  }
  return 0;
}
