// The records a shm connection's ring carries, one per message: the writer's encoding of a
// record's head and the reader's state machine that parses records back into messages.
//
// A record is: the record header (kRecordHeaderBytes: magic, segment, flags, forget), the wire
// frame header, the placement table (one little-endian u64 per buffer: its offset in the record's
// segment, or kInline), the payload, then the inline buffers in order. A record may be larger
// than the ring: the writer streams it while the reader consumes, so the parser keeps its state
// between calls and accepts the bytes in pieces of any size.
//
// The parser touches no socket and no eventfd: it reads a RingReader and asks a SegmentSource for
// the segments records name (reader.hpp gives it one that reads announcements from the socket;
// tests give it memory of their own).
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/error.hpp"
#include "distrpc/transport/shm/ring.hpp"
#include "distrpc/transport/shm/segment.hpp"
#include "distrpc/wire/byte_order.hpp"
#include "distrpc/wire/errors.hpp"
#include "distrpc/wire/frame.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport::shm::detail {

// Every ring record starts with this (then, for a message: the wire frame header, the placement
// table, the payload and the inline buffers).
inline constexpr std::uint32_t kRecordMagic = 0x52485344u;  // "DSHR"
inline constexpr std::uint32_t kRecordOneShot = 1;          // drop `segment` after this message
inline constexpr std::size_t kRecordHeaderBytes = 16;       // magic, segment, flags, forget
// Placement of a buffer: its offset in the record's segment, or inline in the ring.
inline constexpr std::uint64_t kInline = ~std::uint64_t{0};

// Appends the head of `m`'s record to `out`: the record header, the frame header and the
// placement table (`place[i]` for buffer i). The payload and the inline buffers follow it in the
// ring.
inline void append_record_head(std::string& out, const wire::Message& m, std::uint32_t segment,
                               std::uint32_t flags, std::uint32_t forget,
                               const std::vector<std::uint64_t>& place) {
  const std::size_t head = out.size();
  out.resize(head + kRecordHeaderBytes);
  char* r = out.data() + head;
  wire::detail::put_le<std::uint32_t>(r + 0, kRecordMagic);
  wire::detail::put_le<std::uint32_t>(r + 4, segment);
  wire::detail::put_le<std::uint32_t>(r + 8, flags);
  wire::detail::put_le<std::uint32_t>(r + 12, forget);
  wire::append_frame_header(out, m);
  const std::size_t at = out.size();
  out.resize(at + 8 * m.buffers.size());
  for (std::size_t i = 0; i < m.buffers.size(); ++i) {
    wire::detail::put_le<std::uint64_t>(out.data() + at + 8 * i, place[i]);
  }
}

// Parses the records of one ring into messages. Not thread-safe: it belongs to the ring's reader.
class RecordParser {
 public:
  // Maps segment `id` the first time a record names it (the real reader takes the descriptor the
  // writer sent on the socket just before the record). Throws wire::ProtocolError.
  using SegmentSource = std::function<std::shared_ptr<RecvSegment>(std::uint32_t id)>;

  RecordParser(const wire::Limits& limits, SegmentSource segments)
      : decoder_(limits), source_(std::move(segments)) {}

  // Reads from `reader` (up to `avail` bytes, which it lowers by what it consumes) until one
  // message is complete and returns it; nullopt when `avail` ran out first (the parse goes on at
  // the next call). The caller releases the consumed bytes. Throws wire::ProtocolError for a
  // malformed record, and DistNetworkError when this process cannot allocate a record's buffers;
  // either way the connection is unusable.
  std::optional<wire::Message> parse(RingReader& reader, std::uint64_t& avail) {
    while (avail > 0) {
      switch (stage_) {
        case Stage::Record: {
          record_filled_ += take(reader, record_.data() + record_filled_,
                                 kRecordHeaderBytes - record_filled_, avail);
          if (record_filled_ < kRecordHeaderBytes) break;
          begin_record();
          break;
        }
        case Stage::Frame: {
          auto [p, k] = reader.span(std::min<std::uint64_t>(avail, decoder_.bytes_needed()));
          const std::size_t used = decoder_.feed(p, k);
          reader.consume(used);
          avail -= used;
          if (decoder_.done()) begin_placement();
          break;
        }
        case Stage::Placement: {
          placement_filled_ += take(reader, placement_.data() + placement_filled_,
                                    placement_.size() - placement_filled_, avail);
          if (placement_filled_ == placement_.size()) begin_body();
          break;
        }
        case Stage::Body: {
          read_body(reader, avail);
          break;
        }
      }
      if (stage_ == Stage::Body && body_received_ == body_total_) return finish();
    }
    return std::nullopt;
  }

  // Between records: a hang-up now loses no message.
  bool mid_record() const { return stage_ != Stage::Record || record_filled_ > 0; }
  // Segments records named that are still in use (cached by the writer).
  std::size_t segments_in_use() const { return segments_.size(); }

 private:
  enum class Stage { Record, Frame, Placement, Body };

  // Copies (or, with `dst` null, skips) up to `n` bytes; returns how many.
  static std::size_t take(RingReader& reader, char* dst, std::size_t n, std::uint64_t& avail) {
    std::size_t done = 0;
    while (done < n && avail > 0) {
      auto [p, k] = reader.span(std::min<std::uint64_t>(n - done, avail));
      if (dst) std::memcpy(dst + done, p, k);
      reader.consume(k);
      avail -= k;
      done += k;
    }
    return done;
  }

  void begin_record() {
    const char* r = record_.data();
    const auto magic = wire::detail::get_le<std::uint32_t>(r + 0);
    if (magic != kRecordMagic) {
      throw wire::ProtocolError("bad record magic 0x" + wire::detail::hex32(magic).substr(2) +
                                " in the shared ring (the stream is corrupted)");
    }
    segment_ = wire::detail::get_le<std::uint32_t>(r + 4);
    flags_ = wire::detail::get_le<std::uint32_t>(r + 8);
    const auto forget = wire::detail::get_le<std::uint32_t>(r + 12);
    if ((flags_ & ~kRecordOneShot) != 0) {
      throw wire::ProtocolError("record flags " + std::to_string(flags_) + " are not defined");
    }
    if (forget != 0) {
      if (segments_.erase(forget) == 0) {
        throw wire::ProtocolError("the peer releases segment " + std::to_string(forget) +
                                  ", which is not in use");
      }
    }
    if (segment_ != 0 && segments_.count(segment_) == 0) adopt(segment_);
    record_filled_ = 0;
    decoder_.reset();
    stage_ = Stage::Frame;
  }

  // Segment ids only grow, and a connection holds a bounded number: the checks the stream itself
  // allows; the source checks the announcement.
  void adopt(std::uint32_t id) {
    if (id <= last_announced_) throw never_announced(id, "ids only grow and it is not in use");
    if (segments_.size() >= kMaxReceiverSegments) {
      throw wire::ProtocolError("more than " + std::to_string(kMaxReceiverSegments) +
                                " tensor segments in use on one connection");
    }
    if (!source_) throw never_announced(id, "this reader takes no segments");
    auto s = source_(id);
    last_announced_ = id;
    segments_[id] = std::move(s);
  }

  void begin_placement() {
    const wire::FrameHeader& h = decoder_.header();
    if (h.type == wire::MessageType::Handshake) {
      throw wire::ProtocolError("unexpected Handshake record on an established connection");
    }
    placement_.assign(8 * h.buffer_bytes.size(), '\0');
    placement_filled_ = 0;
    stage_ = Stage::Placement;
    if (placement_.empty()) begin_body();
  }

  void begin_body() {
    const wire::FrameHeader& h = decoder_.header();
    msg_ = wire::Message{};
    msg_.type = h.type;
    msg_.id = h.id;
    inline_buffers_.clear();
    body_total_ = h.payload_bytes;
    std::shared_ptr<RecvSegment> seg;
    if (segment_ != 0) seg = segments_.at(segment_);
    at::Tensor seg_storage;
    try {
      msg_.payload.resize(static_cast<std::size_t>(h.payload_bytes));
      msg_.buffers.reserve(h.buffer_bytes.size());
      for (std::size_t i = 0; i < h.buffer_bytes.size(); ++i) {
        const std::uint64_t n = h.buffer_bytes[i];
        const auto place = wire::detail::get_le<std::uint64_t>(placement_.data() + 8 * i);
        if (place == kInline) {
          msg_.buffers.push_back(at::empty({static_cast<std::int64_t>(n)}, at::kByte));
          inline_buffers_.push_back(i);
          body_total_ += n;
          continue;
        }
        if (!seg) {
          throw wire::ProtocolError("buffer " + std::to_string(i) +
                                    " is placed in a segment but the record names none");
        }
        if (place > seg->capacity || n > seg->capacity - place) {
          throw wire::ProtocolError("buffer " + std::to_string(i) + " of " + std::to_string(n) +
                                    " bytes at offset " + std::to_string(place) +
                                    " reaches outside segment " + std::to_string(segment_) +
                                    " of " + std::to_string(seg->capacity) + " bytes");
        }
        if (!seg_storage.defined()) {
          // Every buffer of this message is a view of one storage over the segment; when the last
          // tensor using it dies, the segment goes back to the sender (SegmentUse).
          auto use = std::make_shared<SegmentUse>(seg, (flags_ & kRecordOneShot) != 0);
          seg_storage = at::from_blob(
              seg->data(), {static_cast<std::int64_t>(seg->capacity)}, [use](void*) {},
              at::TensorOptions().dtype(at::kByte));
        }
        msg_.buffers.push_back(
            seg_storage.narrow(0, static_cast<std::int64_t>(place), static_cast<std::int64_t>(n)));
      }
    } catch (const std::bad_alloc&) {
      // DistNetworkError, as tcp raises it, not ProtocolError: the record was within our limits,
      // so the peer broke nothing (ProtocolError means it did, wire/errors.hpp); this process ran
      // out of memory and the connection is dropped all the same.
      throw DistNetworkError("cannot allocate " + std::to_string(body_total_) + " bytes for a " +
                             wire::to_string(h.type) + " record");
    }
    if (segment_ != 0 && (flags_ & kRecordOneShot)) segments_.erase(segment_);
    body_received_ = 0;
    part_ = 0;
    part_off_ = 0;
    stage_ = Stage::Body;
  }

  // Part 0 is the payload, part i > 0 inline buffer i-1.
  std::pair<char*, std::size_t> part(std::size_t i) {
    if (i == 0) return {msg_.payload.data(), msg_.payload.size()};
    const at::Tensor& b = msg_.buffers[inline_buffers_[i - 1]];
    return {static_cast<char*>(b.data_ptr()), static_cast<std::size_t>(b.numel())};
  }

  void read_body(RingReader& reader, std::uint64_t& avail) {
    const std::size_t parts = 1 + inline_buffers_.size();
    while (part_ < parts && avail > 0) {
      auto [ptr, len] = part(part_);
      const std::size_t got = take(reader, ptr + part_off_, len - part_off_, avail);
      part_off_ += got;
      body_received_ += got;
      if (part_off_ == len) {
        ++part_;
        part_off_ = 0;
      }
    }
  }

  wire::Message finish() {
    wire::Message m = std::move(msg_);
    msg_ = wire::Message{};
    stage_ = Stage::Record;
    record_filled_ = 0;
    return m;
  }

  Stage stage_ = Stage::Record;
  std::array<char, kRecordHeaderBytes> record_{};
  std::size_t record_filled_ = 0;
  std::uint32_t segment_ = 0;
  std::uint32_t flags_ = 0;
  wire::FrameDecoder decoder_;
  std::string placement_;
  std::size_t placement_filled_ = 0;
  wire::Message msg_;
  std::vector<std::size_t> inline_buffers_;  // indices of msg_.buffers read from the ring
  std::size_t part_ = 0, part_off_ = 0;
  std::uint64_t body_total_ = 0, body_received_ = 0;

  // The segments in use (cached by the writer, or one-shot until their record is read).
  SegmentSource source_;
  std::uint32_t last_announced_ = 0;
  std::map<std::uint32_t, std::shared_ptr<RecvSegment>> segments_;
};

}  // namespace distrpc::transport::shm::detail
