// FileStore: a Store kept in one file, shared by the threads of a process and by processes on one
// host (or on a shared file system that honours flock).
//
// The file is an append-only log of records, as c10d's FileStore is: set/add/compare_set append the
// key's new value, delete_key appends a tombstone. Each object replays the records appended since
// it last looked. Whole-file flock(2) serialises writers: flock locks belong to an open file
// description, so each FileStore object opens its own descriptor and two objects in one process
// exclude each other exactly as two processes do (fcntl record locks would not: they are per
// process). A mutex orders the threads that share one object. Waiting polls with short sleeps.
//
// Cleanup (c10d's rule): with world_size > 0 every object appends a "finished" record when it is
// destroyed, and the one that brings the count to world_size removes the file.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "distrpc/log.hpp"
#include "distrpc/store/detail/common.hpp"
#include "distrpc/store/store.hpp"

namespace distrpc::store {

class FileStore : public Store {
 public:
  // Opens (creating if needed) the store file at `path`. world_size > 0 enables cleanup: the last
  // of world_size destroyed objects removes the file. Throws DistStoreError naming the path and the
  // system's reason when the file cannot be created, opened or is not a FileStore file.
  explicit FileStore(std::string path, int world_size = -1, milliseconds timeout = kDefaultTimeout)
      : Store(timeout), path_(std::move(path)), world_size_(world_size) {
    name_ = "FileStore(" + path_ + ")";
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      throw DistStoreError("FileStore: cannot open or create '" + path_ +
                           "': " + std::strerror(errno));
    }
    try {
      std::lock_guard lock(mu_);
      FileLock flock_guard(*this, LOCK_EX);
      struct stat st {};
      if (::fstat(fd_, &st) != 0) fail_errno("fstat");
      if (st.st_size == 0) append(std::string(kMagic, sizeof kMagic));
      refresh_locked();
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }

  ~FileStore() override {
    try {
      if (world_size_ > 0) finish();
    } catch (const std::exception& e) {
      // A destructor must not throw; the file is then merely left behind.
      distrpc::detail::log_warning(name_,
                                   std::string("cleanup on destruction failed: ") + e.what());
    }
    ::close(fd_);
  }

  const std::string& path() const { return path_; }

  using Store::set;
  using Store::wait;

  void set(const std::string& key, const Bytes& value) override {
    detail::check_key(name_, "set", key);
    detail::check_value(name_, "set", key, value.size());
    std::lock_guard lock(mu_);
    FileLock flock_guard(*this, LOCK_EX);
    append(set_record(key, value));
  }

  Bytes get(const std::string& key) override {
    detail::check_key(name_, "get", key);
    const std::vector<std::string> keys{key};
    Bytes out;
    poll_until(keys, timeout(), "get", [&] {
      auto it = cache_.find(key);
      if (it == cache_.end()) return false;
      out = it->second;
      return true;
    });
    return out;
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    detail::check_key(name_, "add", key);
    std::lock_guard lock(mu_);
    FileLock flock_guard(*this, LOCK_EX);
    refresh_locked();
    auto it = cache_.find(key);
    const std::int64_t old = it == cache_.end() ? 0 : detail::parse_counter(name_, key, it->second);
    const std::int64_t result = detail::checked_add(name_, key, old, delta);
    append(set_record(key, detail::format_counter(result)));
    return result;
  }

  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    detail::check_key(name_, "compare_set", key);
    detail::check_value(name_, "compare_set", key, expected.size());
    detail::check_value(name_, "compare_set", key, desired.size());
    std::lock_guard lock(mu_);
    FileLock flock_guard(*this, LOCK_EX);
    refresh_locked();
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      if (!expected.empty()) return expected;
    } else if (it->second != expected) {
      return it->second;
    }
    append(set_record(key, desired));
    return desired;
  }

  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) detail::check_key(name_, "check", k);
    std::lock_guard lock(mu_);
    FileLock flock_guard(*this, LOCK_SH);
    refresh_locked();
    return all_present(keys);
  }

  void wait(const std::vector<std::string>& keys, milliseconds timeout) override {
    for (const auto& k : keys) detail::check_key(name_, "wait", k);
    poll_until(keys, timeout, "wait", [&] { return all_present(keys); });
  }

  bool delete_key(const std::string& key) override {
    detail::check_key(name_, "delete_key", key);
    std::lock_guard lock(mu_);
    FileLock flock_guard(*this, LOCK_EX);
    refresh_locked();
    if (!cache_.contains(key)) return false;
    std::string rec(1, kDelete);
    put_string(rec, key);
    append(rec);
    return true;
  }

  std::int64_t num_keys() override {
    std::lock_guard lock(mu_);
    FileLock flock_guard(*this, LOCK_SH);
    refresh_locked();
    return static_cast<std::int64_t>(cache_.size());
  }

 private:
  // Identifies a FileStore file, so pointing a store at some other file fails clearly.
  static constexpr char kMagic[8] = {'D', 'R', 'P', 'C', 'F', 'S', '1', '\n'};
  static constexpr char kSet = 'S';
  static constexpr char kDelete = 'D';
  static constexpr char kFinished = 'F';

  class FileLock {
   public:
    FileLock(FileStore& s, int how) : s_(s) {
      while (::flock(s_.fd_, how) != 0) {
        if (errno != EINTR) s_.fail_errno("flock");
      }
    }
    ~FileLock() { ::flock(s_.fd_, LOCK_UN); }
    FileLock(const FileLock&) = delete;
    FileLock& operator=(const FileLock&) = delete;

   private:
    FileStore& s_;
  };

  [[noreturn]] void fail_errno(const char* what) const {
    throw DistStoreError(name_ + ": " + what + " failed: " + std::strerror(errno));
  }

  static void put_u32(std::string& out, std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  static void put_string(std::string& out, std::string_view s) {
    put_u32(out, static_cast<std::uint32_t>(s.size()));
    out.append(s);
  }
  static std::string set_record(const std::string& key, const Bytes& value) {
    std::string rec(1, kSet);
    rec.reserve(9 + key.size() + value.size());
    put_string(rec, key);
    put_string(rec, std::string_view(reinterpret_cast<const char*>(value.data()), value.size()));
    return rec;
  }

  // Appends one whole record; the caller holds the exclusive file lock, so readers never see half.
  void append(const std::string& rec) {
    std::size_t done = 0;
    while (done < rec.size()) {
      const ssize_t n = ::write(fd_, rec.data() + done, rec.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_errno("write");
      }
      done += static_cast<std::size_t>(n);
    }
  }

  // Replays the records appended since the last look. Caller holds mu_ and a file lock.
  void refresh_locked() {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail_errno("fstat");
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size < pos_) {
      // Someone truncated the file: start over from what it holds now.
      cache_.clear();
      finished_ = 0;
      pos_ = 0;
    }
    if (size == pos_) return;
    std::string buf(size - pos_, '\0');
    std::size_t got = 0;
    while (got < buf.size()) {
      const ssize_t n =
          ::pread(fd_, buf.data() + got, buf.size() - got, static_cast<off_t>(pos_ + got));
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_errno("read");
      }
      if (n == 0) break;
      got += static_cast<std::size_t>(n);
    }
    buf.resize(got);
    std::size_t at = 0;
    if (pos_ == 0) {
      if (buf.size() < sizeof kMagic || std::memcmp(buf.data(), kMagic, sizeof kMagic) != 0) {
        throw DistStoreError("FileStore: '" + path_ +
                             "' is not a FileStore file (its header is not DRPCFS1): refusing to "
                             "use or overwrite it");
      }
      at = sizeof kMagic;
    }
    while (at < buf.size()) {
      const std::size_t start = at;
      const char op = buf[at++];
      if (op == kFinished) {
        ++finished_;
        continue;
      }
      if (op != kSet && op != kDelete) corrupt(pos_ + start, "unknown record type");
      std::string key;
      if (!take_string(buf, at, Store::kMaxKeyBytes, key)) corrupt(pos_ + start, "bad key");
      if (op == kDelete) {
        cache_.erase(key);
        continue;
      }
      std::string value;
      if (!take_string(buf, at, Store::kMaxValueBytes, value)) corrupt(pos_ + start, "bad value");
      cache_[std::move(key)] = Bytes(value.begin(), value.end());
    }
    pos_ += at;
  }

  static bool take_string(const std::string& buf, std::size_t& at, std::size_t limit,
                          std::string& out) {
    if (buf.size() - at < 4) return false;
    std::uint32_t n = 0;
    for (int i = 0; i < 4; ++i) {
      n |= static_cast<std::uint32_t>(static_cast<unsigned char>(buf[at + i])) << (8 * i);
    }
    at += 4;
    if (n > limit || buf.size() - at < n) return false;
    out.assign(buf, at, n);
    at += n;
    return true;
  }

  // Under the lock the log is always whole, so a short or unknown record means the file was damaged
  // (a writer killed in mid-write, or another program wrote to it).
  [[noreturn]] void corrupt(std::uint64_t offset, const char* what) const {
    throw DistStoreError("FileStore: '" + path_ + "' is corrupt at offset " +
                         std::to_string(offset) + " (" + what + ")");
  }

  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return cache_.contains(k); });
  }

  // Polls the file until `found()` (called under the lock, after a refresh) holds; sleeps between
  // looks, growing from 1 ms to 10 ms so a quick answer comes quickly and a long wait stays cheap.
  template <class Found>
  void poll_until(const std::vector<std::string>& keys, milliseconds timeout, const char* op,
                  Found found) {
    const detail::Deadline deadline(timeout);
    auto sleep = std::chrono::microseconds(1000);
    for (;;) {
      {
        std::lock_guard lock(mu_);
        FileLock flock_guard(*this, LOCK_SH);
        refresh_locked();
        if (found()) return;
        if (deadline.expired()) {
          std::vector<std::string> missing;
          for (const auto& k : keys) {
            if (!cache_.contains(k)) missing.push_back(k);
          }
          throw StoreTimeoutError(detail::timeout_text(name_, op, keys, missing, timeout));
        }
      }
      auto nap = sleep;
      if (!deadline.infinite()) {
        nap = std::min<std::chrono::microseconds>(
            nap, std::chrono::duration_cast<std::chrono::microseconds>(deadline.at() -
                                                                       detail::Clock::now()));
      }
      if (nap.count() > 0) std::this_thread::sleep_for(nap);
      sleep = std::min(sleep * 2, std::chrono::microseconds(10'000));
    }
  }

  // Appends this object's "finished" record; the object that completes world_size removes the file,
  // unless the path now names another file (a later run may have recreated it).
  void finish() {
    std::lock_guard lock(mu_);
    FileLock flock_guard(*this, LOCK_EX);
    refresh_locked();
    append(std::string(1, kFinished));
    refresh_locked();
    if (finished_ < world_size_) return;
    struct stat mine {
    }, named{};
    if (::fstat(fd_, &mine) == 0 && ::stat(path_.c_str(), &named) == 0 &&
        mine.st_dev == named.st_dev && mine.st_ino == named.st_ino) {
      ::unlink(path_.c_str());
    }
  }

  std::string path_;
  std::string name_;
  int world_size_;
  int fd_ = -1;
  std::mutex mu_;  // orders this object's threads; held together with the file lock
  std::unordered_map<std::string, Bytes> cache_;
  std::uint64_t pos_ = 0;  // bytes of the file replayed into cache_
  std::int64_t finished_ = 0;
};

}  // namespace distrpc::store
