// Gradient bucket assignment: which tensors share an all-reduce bucket, PyTorch's
// compute_bucket_assignment_by_size (torch.distributed._compute_bucket_assignment_by_size).
// Pure and transport-independent, so a data-parallel front end and its tests agree on the
// buckets without communicating.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace distrpc::dist {

// The limit a bucket holding one sparse gradient reports: it never closes by size.
inline constexpr std::size_t kNoSizeLimit = std::numeric_limits<std::size_t>::max();

struct BucketAssignment {
  std::vector<std::vector<std::size_t>> buckets;  // tensor indices per bucket
  std::vector<std::size_t> size_limits;           // the limit each bucket was filled against
};

// Groups tensors by (dtype, device); each group fills one open bucket and walks the limit list
// on its own: a bucket closes once its byte size reaches the group's current limit, and the
// group then moves to the next limit (staying on the last). A tensor expected to have a sparse
// gradient gets a bucket of its own (limit kNoSizeLimit). Open buckets are emitted at the end.
// Without tensor_indices the buckets are ordered by their smallest tensor index; with them
// (tensor i is reported as tensor_indices[i], the gradient-ready order) the order is the order
// in which buckets closed, as PyTorch leaves it.
inline BucketAssignment compute_bucket_assignment_by_size(
    const std::vector<at::Tensor>& tensors, const std::vector<std::size_t>& bucket_size_limits,
    const std::vector<bool>& expect_sparse_gradient = {},
    const std::vector<std::int64_t>& tensor_indices = {}) {
  if (bucket_size_limits.empty()) {
    throw std::invalid_argument(
        "compute_bucket_assignment_by_size: expected at least one bucket size limit");
  }
  if (!expect_sparse_gradient.empty() && expect_sparse_gradient.size() != tensors.size()) {
    throw std::invalid_argument("compute_bucket_assignment_by_size: expect_sparse_gradient has " +
                                std::to_string(expect_sparse_gradient.size()) +
                                " entries but there are " + std::to_string(tensors.size()) +
                                " tensors");
  }
  if (!tensor_indices.empty() && tensor_indices.size() != tensors.size()) {
    throw std::invalid_argument("compute_bucket_assignment_by_size: tensor_indices has " +
                                std::to_string(tensor_indices.size()) + " entries but there are " +
                                std::to_string(tensors.size()) + " tensors");
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) {
      throw std::invalid_argument("compute_bucket_assignment_by_size: tensor " + std::to_string(i) +
                                  " is undefined");
    }
    if (!tensor_indices.empty() && tensor_indices[i] < 0) {
      throw std::invalid_argument("compute_bucket_assignment_by_size: tensor_indices[" +
                                  std::to_string(i) + "] is negative (" +
                                  std::to_string(tensor_indices[i]) + ")");
    }
  }

  struct Open {
    std::vector<std::size_t> indices;
    std::size_t bytes = 0;
    std::size_t limit_pos = 0;   // this group's position in bucket_size_limits
    std::size_t first_seen = 0;  // keeps leftover emission deterministic
  };
  // Key: dtype and device (type and index), the properties a flat bucket tensor must share.
  using Key = std::tuple<int, int, int>;
  std::map<Key, Open> open;
  BucketAssignment out;
  std::size_t seen = 0;

  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const std::size_t index =
        tensor_indices.empty() ? i : static_cast<std::size_t>(tensor_indices[i]);
    if (!expect_sparse_gradient.empty() && expect_sparse_gradient[i]) {
      out.buckets.push_back({index});
      out.size_limits.push_back(kNoSizeLimit);
      continue;
    }
    const Key key{static_cast<int>(t.scalar_type()), static_cast<int>(t.device().type()),
                  static_cast<int>(t.device().index())};
    auto [it, inserted] = open.try_emplace(key);
    Open& b = it->second;
    if (inserted) b.first_seen = seen++;
    b.indices.push_back(index);
    b.bytes += static_cast<std::size_t>(t.numel()) * t.element_size();
    const std::size_t limit = bucket_size_limits[b.limit_pos];
    if (b.bytes >= limit) {
      out.buckets.push_back(std::move(b.indices));
      out.size_limits.push_back(limit);
      b.indices.clear();
      b.bytes = 0;
      if (b.limit_pos + 1 < bucket_size_limits.size()) ++b.limit_pos;
    }
  }

  std::vector<const Open*> leftovers;
  for (const auto& [key, b] : open) {
    if (!b.indices.empty()) leftovers.push_back(&b);
  }
  std::sort(leftovers.begin(), leftovers.end(),
            [](const Open* a, const Open* b) { return a->first_seen < b->first_seen; });
  for (const Open* b : leftovers) {
    out.buckets.push_back(b->indices);
    out.size_limits.push_back(bucket_size_limits[b->limit_pos]);
  }

  if (tensor_indices.empty()) {
    // Indices inside a bucket ascend, so a bucket's smallest index is its first.
    std::vector<std::size_t> order(out.buckets.size());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return out.buckets[a].front() < out.buckets[b].front();
    });
    BucketAssignment sorted;
    for (std::size_t k : order) {
      sorted.buckets.push_back(std::move(out.buckets[k]));
      sorted.size_limits.push_back(out.size_limits[k]);
    }
    return sorted;
  }
  return out;
}

}  // namespace distrpc::dist
