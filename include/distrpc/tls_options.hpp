// TlsOptions: where a process finds its TLS certificate, private key and the certificate authority
// it trusts (mutual TLS, docs/security.md "TLS"). Plain values, no OpenSSL: the options structs of
// every layer (RpcBackendOptions, TransportOptions, TCPStoreOptions) hold one.
#pragma once

#include <string>

namespace distrpc {

struct TlsOptions {
  // PEM files. All three empty: TLS is off, unless DISTRPC_TLS_CERT, DISTRPC_TLS_KEY and
  // DISTRPC_TLS_CA name them (so a launcher can turn TLS on without code). Set, all three are
  // needed: this process's certificate (a chain may follow it), its private key, and the CA whose
  // signature a peer's certificate must carry.
  std::string cert_file;
  std::string key_file;
  std::string ca_file;

  bool empty() const { return cert_file.empty() && key_file.empty() && ca_file.empty(); }
};

}  // namespace distrpc
