// Authentication on a shared secret without ever sending it: each side sends a fresh random nonce
// and proves it knows the secret with an HMAC-SHA256 over both nonces, both identities and the
// direction of the proof. A captured proof is worthless on another connection (the other side's
// nonce differs), and one side's proof cannot be reflected back as the other's (the direction is
// part of what is signed). Also: where the secret comes from (an option, a file or the
// environment). No libtorch here: the TCPStore (store layer, test_core) uses it too.
#pragma once

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>

#include <distrpc/error.hpp>
#include <distrpc/wire/byte_order.hpp>

namespace distrpc::wire::auth {

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kProofBytes = 32;  // SHA-256's output
// A secret longer than this is refused where it is read (it would only be hashed down anyway).
inline constexpr std::size_t kMaxSecretBytes = 4096;
// The environment variables a secret may come from (see resolve_secret for the precedence).
inline constexpr const char* kSecretEnv = "DISTRPC_AUTH_SECRET";
inline constexpr const char* kSecretFileEnv = "DISTRPC_AUTH_SECRET_FILE";

using Nonce = std::array<unsigned char, kNonceBytes>;
using Proof = std::array<unsigned char, kProofBytes>;

// Who proves: the side that dialled the connection or the side that accepted it. Part of what is
// signed, so an answer cannot be reflected to the side that asked.
enum class Prover : std::uint8_t { kDialler = 1, kAcceptor = 2 };

// A side's claimed identity, bound into both proofs: a proof made for one identity does not
// authenticate another.
struct Party {
  std::string_view name;
  std::int64_t id = -1;
};

// A fresh nonce from OpenSSL's CSPRNG. Throws DistError when no randomness is to be had.
inline Nonce make_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    throw DistError("authentication: RAND_bytes could not produce a nonce");
  }
  return n;
}

// HMAC-SHA256(secret, label | prover | dialler nonce | acceptor nonce | dialler | acceptor), each
// identity as u32 name length | name | i64 id, so no two transcripts serialize alike.
inline Proof compute_proof(std::string_view secret, Prover prover, const Nonce& dialler_nonce,
                           const Nonce& acceptor_nonce, Party dialler, Party acceptor) {
  std::string msg = "distrpc-auth-v1";
  msg.push_back(static_cast<char>(prover));
  msg.append(reinterpret_cast<const char*>(dialler_nonce.data()), dialler_nonce.size());
  msg.append(reinterpret_cast<const char*>(acceptor_nonce.data()), acceptor_nonce.size());
  for (const Party& p : {dialler, acceptor}) {
    char fixed[8];
    detail::put_le<std::uint32_t>(fixed, static_cast<std::uint32_t>(p.name.size()));
    msg.append(fixed, 4);
    msg.append(p.name);
    detail::put_le<std::int64_t>(fixed, p.id);
    msg.append(fixed, 8);
  }
  Proof out{};
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out.data(),
           &len) == nullptr ||
      len != out.size()) {
    throw DistError("authentication: HMAC-SHA256 failed");
  }
  return out;
}

// Constant time: how long it takes says nothing about where the proofs differ.
inline bool same_proof(const Proof& a, const Proof& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// Reads a secret file: one line (a trailing newline is dropped). Refused when it is readable or
// writable by group or others, empty, or longer than kMaxSecretBytes. `from` names where the path
// came from, for the error text (which never holds the secret).
inline std::string read_secret_file(const std::string& path, const std::string& from) {
  const std::string what = "the secret file '" + path + "' (" + from + ")";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw DistError("authentication: cannot read " + what + ": " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) throw DistError("authentication: " + what + " is not a regular file");
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw DistError("authentication: " + what + " has mode " + mode +
                    ", open to group or others: make it private (chmod 600)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DistError("authentication: cannot open " + what);
  std::string secret((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  if (secret.empty()) throw DistError("authentication: " + what + " is empty");
  if (secret.size() > kMaxSecretBytes) {
    throw DistError("authentication: " + what + " holds " + std::to_string(secret.size()) +
                    " bytes, over the limit of " + std::to_string(kMaxSecretBytes));
  }
  return secret;
}

// The shared secret, first found wins:
//   1. `value` (an options field such as auth_token), when not empty;
//   2. the file `file` names (an options field), when not empty;
//   3. the file the environment variable DISTRPC_AUTH_SECRET_FILE names;
//   4. the environment variable DISTRPC_AUTH_SECRET.
// nullopt: no secret anywhere, so connections are not authenticated. Never from the command line:
// other users of the machine can read a process's arguments.
inline std::optional<std::string> resolve_secret(const std::string& value,
                                                 const std::string& file = "") {
  if (!value.empty()) {
    if (value.size() > kMaxSecretBytes) {
      throw DistError("authentication: the configured secret holds " +
                      std::to_string(value.size()) + " bytes, over the limit of " +
                      std::to_string(kMaxSecretBytes));
    }
    return value;
  }
  if (!file.empty()) return read_secret_file(file, "from the options");
  if (const char* f = std::getenv(kSecretFileEnv); f && *f) {
    return read_secret_file(f, std::string("from ") + kSecretFileEnv);
  }
  if (const char* s = std::getenv(kSecretEnv); s && *s) {
    const std::string secret(s);
    if (secret.size() > kMaxSecretBytes) {
      throw DistError(std::string("authentication: ") + kSecretEnv + " holds " +
                      std::to_string(secret.size()) + " bytes, over the limit of " +
                      std::to_string(kMaxSecretBytes));
    }
    return secret;
  }
  return std::nullopt;
}

}  // namespace distrpc::wire::auth
