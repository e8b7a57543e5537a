// cereal archives for message payloads, with a side channel for tensors. Values are encoded in
// cereal's binary form (little-endian, u64 size prefixes) straight into Message::payload, without
// an ostream; tensor bytes go to Message::buffers and the payload refers to them by index (see
// tensor_codec.hpp). The input archive is safe on hostile bytes: every read is bounds-checked and
// every size prefix is checked against the bytes left before anything is allocated from it.
//
// One archive per message and per direction: tensor identity (a tensor sent twice arrives as one)
// is numbered per archive, so a message written by several encode() calls that each carry tensors
// must be read back with one InputArchive, and the writes must share one OutputArchive too.
#pragma once

#include <distrpc/wire/errors.hpp>
#include <distrpc/wire/message.hpp>

#include <cereal/cereal.hpp>
#include <cereal/details/polymorphic_impl_fwd.hpp>
#include <cereal/types/array.hpp>
#include <cereal/types/complex.hpp>
#include <cereal/types/deque.hpp>
#include <cereal/types/list.hpp>
#include <cereal/types/map.hpp>
#include <cereal/types/memory.hpp>
#include <cereal/types/optional.hpp>
#include <cereal/types/set.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/tuple.hpp>
#include <cereal/types/unordered_map.hpp>
#include <cereal/types/unordered_set.hpp>
#include <cereal/types/utility.hpp>
#include <cereal/types/variant.hpp>
#include <cereal/types/vector.hpp>

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

static_assert(std::endian::native == std::endian::little,
              "distrpc's payload encoding is little-endian and written in host order: big-endian "
              "hosts are not supported");

namespace distrpc::wire {

namespace detail {

template <class>
inline constexpr bool dependent_false = false;

[[noreturn]] inline void decode_fail(const std::string& what) {
  throw DecodeError("cannot decode message payload: " + what);
}

// Bounds the recursion of dynamically nested values (IValue lists and tuples), so neither a hostile
// payload nor a cyclic list can exhaust the stack.
inline constexpr int kMaxNestingDepth = 64;

}  // namespace detail

class OutputArchive : public cereal::OutputArchive<OutputArchive, cereal::AllowEmptyClassElision> {
  using Base = cereal::OutputArchive<OutputArchive, cereal::AllowEmptyClassElision>;

 public:
  // Appends to `message.payload` and `message.buffers`; `message` must outlive the archive.
  explicit OutputArchive(Message& message) : Base(this), message_(&message) {}

  OutputArchive(const OutputArchive&) = delete;
  OutputArchive& operator=(const OutputArchive&) = delete;

  void write_bytes(const void* data, std::size_t size) {
    message_->payload.append(static_cast<const char*>(data), size);
  }

  template <class T>
  void write(T value) {
    static_assert(std::is_arithmetic_v<T>, "write() takes an arithmetic value");
    write_bytes(&value, sizeof value);
  }

  // Grows the payload by `size` bytes and returns where they start, for fixed-size records.
  char* append_uninitialized(std::size_t size) {
    std::string& p = message_->payload;
    const std::size_t at = p.size();
    p.resize(at + size);
    return p.data() + at;
  }

  // Adds an out-of-band byte region; returns its index in Message::buffers.
  std::uint32_t add_buffer(at::Tensor bytes) {
    if (message_->buffers.size() >= std::uint32_t{0xFFFFFFFE}) {
      throw EncodeError("cannot encode more than 4294967294 out-of-band buffers in one message");
    }
    message_->buffers.push_back(std::move(bytes));
    return static_cast<std::uint32_t>(message_->buffers.size() - 1);
  }

  // The slot of a tensor already written by this archive (same TensorImpl), if any.
  std::optional<std::uint32_t> find_tensor(const c10::TensorImpl* impl) const {
    if (index_.empty()) {
      for (std::size_t i = 0; i < tensors_.size(); ++i) {
        if (tensors_[i].unsafeGetTensorImpl() == impl) return static_cast<std::uint32_t>(i);
      }
      return std::nullopt;
    }
    const auto it = index_.find(impl);
    if (it == index_.end()) return std::nullopt;
    return it->second;
  }

  // Records a written tensor under the next slot. The archive keeps a reference, so a temporary
  // tensor written by a user's save() cannot be freed and its address reused by a later one.
  void remember_tensor(const at::Tensor& t) {
    const auto slot = static_cast<std::uint32_t>(tensors_.size());
    tensors_.push_back(t);
    if (!index_.empty()) {
      index_.emplace(t.unsafeGetTensorImpl(), slot);
    } else if (tensors_.size() > kLinearSearchMax) {
      // Many tensors: switch from a linear scan to a hash index.
      for (std::size_t i = 0; i < tensors_.size(); ++i) {
        index_.emplace(tensors_[i].unsafeGetTensorImpl(), static_cast<std::uint32_t>(i));
      }
    }
  }

  // Depth of dynamically nested values being written (see detail::kMaxNestingDepth).
  int& nesting_depth() noexcept { return depth_; }

  Message& message() noexcept { return *message_; }

 private:
  static constexpr std::size_t kLinearSearchMax = 16;

  Message* message_;
  std::vector<at::Tensor> tensors_;
  std::unordered_map<const c10::TensorImpl*, std::uint32_t> index_;
  int depth_ = 0;
};

class InputArchive : public cereal::InputArchive<InputArchive, cereal::AllowEmptyClassElision> {
  using Base = cereal::InputArchive<InputArchive, cereal::AllowEmptyClassElision>;

 public:
  // Reads `message.payload` and adopts `message.buffers`; `message` must outlive the archive.
  explicit InputArchive(const Message& message)
      : Base(this),
        begin_(message.payload.data()),
        cur_(begin_),
        end_(begin_ + message.payload.size()),
        buffers_(&message.buffers) {}

  InputArchive(const InputArchive&) = delete;
  InputArchive& operator=(const InputArchive&) = delete;

  // cereal's own operator(), with every failure inside (cereal's own checks, libtorch's, length
  // errors) turned into DecodeError, so that malformed input surfaces as one error type.
  template <class... Ts>
  InputArchive& operator()(Ts&&... args) {
    try {
      Base::operator()(std::forward<Ts>(args)...);
    } catch (const DecodeError&) {
      throw;
    } catch (const cereal::Exception& e) {
      detail::decode_fail(e.what());
    } catch (const c10::Error& e) {
      detail::decode_fail(e.what_without_backtrace());
    } catch (const std::length_error& e) {
      detail::decode_fail(std::string("size out of range: ") + e.what());
    }
    return *this;
  }

  std::size_t remaining() const noexcept { return static_cast<std::size_t>(end_ - cur_); }
  std::size_t position() const noexcept { return static_cast<std::size_t>(cur_ - begin_); }

  void read_bytes(void* out, std::size_t size) {
    require(size, "needed");
    if (size != 0) std::memcpy(out, cur_, size);
    cur_ += size;
  }

  // Moves past `size` bytes (bounds-checked like read_bytes).
  void skip(std::size_t size) {
    require(size, "to skip");
    cur_ += size;
  }

  template <class T>
  T read() {
    static_assert(std::is_trivially_copyable_v<T>, "read() takes a trivially copyable type");
    T value;
    read_bytes(&value, sizeof value);
    return value;
  }

  // Rejects a count of items of at least `min_bytes_each` payload bytes each that cannot fit in
  // what is left: a size prefix must never drive an allocation the payload cannot back.
  void check_count(std::uint64_t count, std::uint64_t min_bytes_each, const char* what) const {
    const std::uint64_t each = min_bytes_each == 0 ? 1 : min_bytes_each;
    if (count > remaining() / each) {
      detail::decode_fail(std::string(what) + " count " + std::to_string(count) + " at offset " +
                          std::to_string(position()) + " needs at least " + std::to_string(each) +
                          " bytes each, but only " + std::to_string(remaining()) +
                          " bytes are left");
    }
  }

  std::size_t buffer_count() const noexcept { return buffers_->size(); }

  // The out-of-band buffer `index`, checked to exist and to be a plain byte buffer: host memory,
  // or CUDA memory that a policy moving device memory handed over (transport/device_direct.hpp).
  const at::Tensor& buffer(std::uint32_t index) {
    if (index >= buffers_->size()) {
      detail::decode_fail("buffer index " + std::to_string(index) +
                          " out of range: the message has " + std::to_string(buffers_->size()) +
                          " buffers");
    }
    const at::Tensor& b = (*buffers_)[index];
    if (!b.defined() || !(b.device().is_cpu() || b.device().is_cuda()) ||
        b.scalar_type() != at::kByte || b.dim() != 1 || b.layout() != at::kStrided ||
        (b.numel() > 1 && b.stride(0) != 1)) {
      detail::decode_fail("buffer " + std::to_string(index) +
                          " is not a 1-D contiguous kByte CPU or CUDA tensor");
    }
    if (used_.empty()) used_.assign(buffers_->size(), false);
    used_[index] = true;
    return b;
  }

  std::size_t tensor_count() const noexcept { return tensors_.size(); }

  // A tensor decoded earlier in this payload, by slot (back-references preserve identity).
  const at::Tensor& tensor(std::uint32_t slot) const {
    if (slot >= tensors_.size()) {
      detail::decode_fail("tensor back-reference " + std::to_string(slot) + " out of range: " +
                          std::to_string(tensors_.size()) + " tensors decoded so far");
    }
    return tensors_[slot];
  }

  void remember_tensor(at::Tensor t) { tensors_.push_back(std::move(t)); }

  int& nesting_depth() noexcept { return depth_; }

  // Call once the whole payload has been read: leftover bytes or buffers nobody referenced mean the
  // sender wrote something other than what was read, so the values cannot be trusted.
  void finish() const {
    if (cur_ != end_) {
      detail::decode_fail(std::to_string(remaining()) + " trailing bytes after offset " +
                          std::to_string(position()) +
                          " (sender and receiver disagree on the types)");
    }
    std::size_t used = 0;
    for (bool u : used_) used += u ? 1 : 0;
    if (used != buffers_->size()) {
      detail::decode_fail("the message carries " + std::to_string(buffers_->size()) +
                          " out-of-band buffers but the payload referenced " +
                          std::to_string(used));
    }
  }

 private:
  // Fails unless `size` bytes are left ("truncated: N bytes <what> at offset ...").
  void require(std::size_t size, const char* what) const {
    if (size > remaining()) {
      detail::decode_fail("truncated: " + std::to_string(size) + " bytes " + what + " at offset " +
                          std::to_string(position()) + ", " + std::to_string(remaining()) +
                          " left in a payload of " + std::to_string(end_ - begin_) + " bytes");
    }
  }

  const char* begin_;
  const char* cur_;
  const char* end_;
  const std::vector<at::Tensor>* buffers_;
  std::vector<bool> used_;
  std::vector<at::Tensor> tensors_;
  int depth_ = 0;
};

// Counts one level of dynamic nesting for as long as it lives; throws past kMaxNestingDepth.
template <class Archive>
class NestingGuard {
 public:
  explicit NestingGuard(Archive& ar) : depth_(ar.nesting_depth()) {
    if (++depth_ > detail::kMaxNestingDepth) {
      --depth_;
      const std::string what =
          "values nested deeper than " + std::to_string(detail::kMaxNestingDepth) + " levels";
      if constexpr (std::is_same_v<Archive, InputArchive>) {
        detail::decode_fail(what);
      } else {
        throw EncodeError("cannot encode " + what + " (is a list cyclic?)");
      }
    }
  }
  ~NestingGuard() { --depth_; }
  NestingGuard(const NestingGuard&) = delete;
  NestingGuard& operator=(const NestingGuard&) = delete;

 private:
  int& depth_;
};

// ---- cereal primitives for the two archives (found by argument-dependent lookup) ----

template <class T>
inline std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar,
                                                                           const T& t) {
  ar.write_bytes(&t, sizeof t);
}

template <class T>
inline std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>>
CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, T& t) {
  ar.read_bytes(&t, sizeof t);
}

// A bool byte other than 0 or 1 would be undefined behaviour once loaded: reject it.
inline void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, bool& b) {
  const auto v = ar.read<std::uint8_t>();
  if (v > 1) {
    detail::decode_fail("bool byte " + std::to_string(v) + " at offset " +
                        std::to_string(ar.position() - 1) + " is neither 0 nor 1");
  }
  b = v == 1;
}

template <class T>
inline void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const cereal::NameValuePair<T>& t) {
  ar(t.value);
}

template <class T>
inline void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, cereal::NameValuePair<T>& t) {
  ar(t.value);
}

template <class T>
inline void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const cereal::SizeTag<T>& t) {
  ar.write(static_cast<cereal::size_type>(t.size));
}

// Every element of a cereal container occupies at least one payload byte, so a count above the
// bytes left is malformed; checking it here stops cereal from resizing to a hostile count.
template <class T>
inline void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, cereal::SizeTag<T>& t) {
  const auto n = ar.read<cereal::size_type>();
  ar.check_count(n, 1, "container element");
  t.size = static_cast<std::remove_reference_t<T>>(n);
}

template <class T>
inline void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const cereal::BinaryData<T>& bd) {
  ar.write_bytes(bd.data, static_cast<std::size_t>(bd.size));
}

template <class T>
inline void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, cereal::BinaryData<T>& bd) {
  ar.read_bytes(bd.data, static_cast<std::size_t>(bd.size));
}

// Vectors of numbers: same encoding as cereal's (u64 count, raw elements), but the count is checked
// against the bytes the elements need before the vector is sized.
template <class T, class A>
inline std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>>
CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, std::vector<T, A>& v) {
  const auto n = ar.read<cereal::size_type>();
  ar.check_count(n, sizeof(T), "vector element");
  v.resize(static_cast<std::size_t>(n));
  ar.read_bytes(v.data(), static_cast<std::size_t>(n) * sizeof(T));
}

// ---- one-call entry points ----

// Appends `values` to `message` (payload and buffers).
template <class... Ts>
void encode(Message& message, const Ts&... values) {
  OutputArchive ar(message);
  if constexpr (sizeof...(Ts) > 0) ar(values...);
}

// Reads `values` back from the whole of `message`; throws DecodeError if the payload is malformed,
// is not exactly these types, or leaves buffers unreferenced.
template <class... Ts>
void decode(const Message& message, Ts&... values) {
  InputArchive ar(message);
  if constexpr (sizeof...(Ts) > 0) ar(values...);
  ar.finish();
}

// decode() into default-constructed values, returned as a tuple.
template <class... Ts>
std::tuple<Ts...> decode_as(const Message& message) {
  std::tuple<Ts...> out;
  std::apply([&](auto&... v) { decode(message, v...); }, out);
  return out;
}

}  // namespace distrpc::wire

CEREAL_REGISTER_ARCHIVE(distrpc::wire::OutputArchive)
CEREAL_REGISTER_ARCHIVE(distrpc::wire::InputArchive)
CEREAL_SETUP_ARCHIVE_TRAITS(distrpc::wire::InputArchive, distrpc::wire::OutputArchive)
