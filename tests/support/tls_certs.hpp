// Certificates for the TLS tests, made at run time with the `openssl` command line (package
// `openssl`) into a fresh temporary folder, once per test process: two certificate authorities,
// A and B; a "server" and a "client" certificate signed by A; a "rogue" one signed by B. The
// server and client trust CA A only; the rogue trusts both (so a rogue TCPStore master can reach
// its own server), so a failure is always an A-only side refusing the rogue's certificate. EC
// P-256 keys: quick to make. No libtorch here: test_core (TCPStore) and test_wire (transport) both
// use it.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <system_error>

#include "distrpc/tls_options.hpp"

namespace distrpc::testing {

struct TlsFiles {
  std::string dir;
  std::string ca_a, ca_b;  // the two authorities' certificates
  TlsOptions server;       // signed by A, trusts A
  TlsOptions client;       // signed by A, trusts A
  TlsOptions rogue;        // signed by B, trusts A and B
};

namespace detail {
inline TlsFiles make_tls_files() {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/distrpc-tls-XXXXXX";
  if (!::mkdtemp(templ.data())) throw std::runtime_error("tls_certs: mkdtemp failed");
  const std::string d = templ;
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const auto ca = [&](const std::string& n) {
    return "openssl req -x509 " + key + " -keyout " + d + "/" + n + ".key -out " + d + "/" + n +
           ".pem -days 2 -subj /CN=distrpc-test-" + n + " && ";
  };
  const auto leaf = [&](const std::string& n, const std::string& by) {
    return "openssl req " + key + " -keyout " + d + "/" + n + ".key -out " + d + "/" + n +
           ".csr -subj /CN=distrpc-test-" + n + " && openssl x509 -req -in " + d + "/" + n +
           ".csr -CA " + d + "/" + by + ".pem -CAkey " + d + "/" + by +
           ".key -CAcreateserial -out " + d + "/" + n + ".pem -days 2 && ";
  };
  const std::string log = d + "/openssl.log";
  const std::string script = "(" + ca("ca_a") + ca("ca_b") + leaf("server", "ca_a") +
                             leaf("client", "ca_a") + leaf("rogue", "ca_b") + "cat " + d +
                             "/ca_a.pem " + d + "/ca_b.pem > " + d + "/ca_ab.pem) > " + log +
                             " 2>&1";
  if (std::system(script.c_str()) != 0) {
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    throw std::runtime_error(
        "tls_certs: making the test certificates with the openssl command line failed (is the "
        "`openssl` package installed?): " +
        text);
  }
  TlsFiles f;
  f.dir = d;
  f.ca_a = d + "/ca_a.pem";
  f.ca_b = d + "/ca_b.pem";
  const auto set = [&](const std::string& n) {
    return TlsOptions{d + "/" + n + ".pem", d + "/" + n + ".key", f.ca_a};
  };
  f.server = set("server");
  f.client = set("client");
  f.rogue = set("rogue");
  f.rogue.ca_file = d + "/ca_ab.pem";
  return f;
}
}  // namespace detail

// Made on first use; the folder is removed when the process exits.
inline const TlsFiles& tls_files() {
  struct Owned {
    TlsFiles files = detail::make_tls_files();
    ~Owned() {
      std::error_code ec;
      std::filesystem::remove_all(files.dir, ec);
    }
  };
  static const Owned owned;
  return owned.files;
}

}  // namespace distrpc::testing
