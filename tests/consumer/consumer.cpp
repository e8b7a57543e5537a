// The smallest user of distrpc as a subproject: a store round trip and a libtorch tensor.
#include <torch/torch.h>

#include <cstdio>

#include "distrpc/store.hpp"

int main() {
  distrpc::store::HashStore store;
  store.set("answer", "42");
  const auto t = torch::ones({2, 2}) * std::stoi(store.get_string("answer"));
  const double sum = t.sum().item<double>();
  std::printf("consumer: sum=%.0f keys=%lld\n", sum, static_cast<long long>(store.num_keys()));
  return sum == 168.0 ? 0 : 1;
}
