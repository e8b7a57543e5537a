// expect: Transport policy: missing `void Context::send(int peer, wire::Message&&);`
#include "distrpc/agent.hpp"
struct NoSend {
  static constexpr std::string_view name = "nosend";
  static bool viable() { return true; }
  static std::string domain_key() { return "x"; }
  struct Context {
    Context(const distrpc::transport::TransportOptions&, distrpc::transport::TransportCallbacks) {}
    std::string address() const { return ""; }
    void add_peer(int, const std::string&, const std::string&) {}
    void shutdown() {}
  };
};
template class distrpc::Agent<NoSend>;
