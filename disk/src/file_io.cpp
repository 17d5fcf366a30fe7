// SPDX-License-Identifier: Apache-2.0
#include "kvport/disk/file_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "kvport/platform/error.hpp"
#include "store_file.hpp"

#if KVPORT_HAVE_LIBURING
#include <liburing.h>
#endif

namespace kvport::disk {

const char* to_string(IoEngine engine) noexcept {
  switch (engine) {
    case IoEngine::automatic:
      return "automatic";
    case IoEngine::io_uring:
      return "io_uring";
    case IoEngine::sync:
      return "sync";
  }
  return "unknown";
}

std::optional<IoEngine> parse_io_engine(std::string_view text) noexcept {
  if (text == "automatic") return IoEngine::automatic;
  if (text == "io_uring") return IoEngine::io_uring;
  if (text == "sync") return IoEngine::sync;
  return std::nullopt;
}

bool io_uring_compiled() noexcept {
  return KVPORT_HAVE_LIBURING != 0;
}

// ---- FileIo: the checks every implementation shares ---------------------------------------

void FileIo::run(std::span<const IoRequest> requests, std::span<IoResult> results,
                 std::chrono::milliseconds deadline, const IoCompletion& on_complete,
                 const IoPrepare& prepare) {
  if (requests.size() != results.size()) {
    throw InvalidArgument("FileIo::run: " + std::to_string(requests.size()) + " requests but " +
                          std::to_string(results.size()) + " results");
  }
  if (deadline.count() < 0) throw InvalidArgument("FileIo::run: negative deadline");
  const bool aligned = direct();
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const IoRequest& r = requests[i];
    if ((r.buffer == nullptr && !prepare) || r.bytes == 0) {
      throw InvalidArgument("FileIo::run: request " + std::to_string(i) +
                            " has a null buffer or zero bytes");
    }
    if (r.op == IoOp::write && read_only()) {
      throw InvalidArgument("FileIo::run: request " + std::to_string(i) +
                            " writes to a file opened read-only");
    }
    if (aligned && (reinterpret_cast<std::uintptr_t>(r.buffer) % kDirectAlignment != 0 ||
                    r.offset % kDirectAlignment != 0 || r.bytes % kDirectAlignment != 0)) {
      throw InvalidArgument("FileIo::run: request " + std::to_string(i) +
                            " is not aligned to 4096 bytes (O_DIRECT): offset " +
                            std::to_string(r.offset) + ", bytes " + std::to_string(r.bytes));
    }
    results[i] = IoResult{};
  }
  if (requests.empty()) return;
  static const IoCompletion kNone = [](std::size_t) {};
  do_run(requests, results, deadline, IoHooks{on_complete ? on_complete : kNone, prepare});
}

int FileIo::sync() {
  return do_sync();
}
int FileIo::allocate(std::uint64_t bytes) {
  if (read_only()) throw InvalidArgument("FileIo::allocate: the file is opened read-only");
  return do_allocate(bytes);
}
int FileIo::reserve(std::uint64_t offset, std::uint64_t bytes) {
  if (read_only()) throw InvalidArgument("FileIo::reserve: the file is opened read-only");
  if (bytes == 0) return 0;
  return do_reserve(offset, bytes);
}
std::optional<std::uint64_t> FileIo::size() {
  return do_size();
}
bool FileIo::linked() {
  return do_linked();
}
std::vector<std::uint64_t> FileIo::reap_orphans(bool wait) {
  return do_reap_orphans(wait);
}
std::size_t FileIo::orphans() const noexcept {
  return do_orphans();
}
std::string FileIo::describe() const {
  return do_describe();
}
bool FileIo::direct() const noexcept {
  return do_direct();
}
bool FileIo::preallocated() const noexcept {
  return do_preallocated();
}
bool FileIo::read_only() const noexcept {
  return do_read_only();
}

namespace {

using Clock = std::chrono::steady_clock;

std::string errno_text(int error) {
  return std::strerror(error);
}

// The file and what both engines do with it outside the reads and writes.
class PosixFile : public FileIo {
 public:
  PosixFile(int fd, bool direct, bool read_only, std::string direct_note)
      : fd_(fd), direct_(direct), read_only_(read_only), direct_note_(std::move(direct_note)) {}
  ~PosixFile() override { ::close(fd_); }

 protected:
  int do_sync() override { return ::fdatasync(fd_) == 0 ? 0 : errno; }

  int do_allocate(std::uint64_t bytes) override {
    const auto len = static_cast<off_t>(bytes);
    if (::fallocate(fd_, 0, 0, len) == 0) {
      preallocated_ = true;
      return 0;
    }
    const int e = errno;
    if (e != EOPNOTSUPP && e != ENOSYS) return e;
    // No fallocate on this file system (some network and FUSE ones): a sparse
    // file of the size; writes may then find the disk full, which the store
    // reports per write.
    preallocated_ = false;
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && st.st_size >= len) return 0;
    return ::ftruncate(fd_, len) == 0 ? 0 : errno;
  }

  int do_reserve(std::uint64_t offset, std::uint64_t bytes) override {
    if (::fallocate(fd_, FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                    static_cast<off_t>(bytes)) == 0) {
      return 0;
    }
    const int e = errno;
    // Nothing to reserve with on this file system: the writes will tell.
    return e == EOPNOTSUPP || e == ENOSYS ? 0 : e;
  }

  std::optional<std::uint64_t> do_size() override {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return std::nullopt;
    return static_cast<std::uint64_t>(st.st_size);
  }

  bool do_linked() override {
    struct stat st {};
    return ::fstat(fd_, &st) == 0 && st.st_nlink > 0;
  }

  bool do_direct() const noexcept override { return direct_; }
  bool do_preallocated() const noexcept override { return preallocated_; }
  bool do_read_only() const noexcept override { return read_only_; }

  std::string direct_text() const {
    if (direct_) return "O_DIRECT";
    return direct_note_.empty() ? "buffered" : "buffered (" + direct_note_ + ")";
  }

  // A direct I/O refused with EINVAL although aligned (a file system that
  // takes O_DIRECT at open but not for I/O): the file goes on buffered.
  bool fall_back_to_buffered() {
    if (!direct_) return false;
    const int flags = ::fcntl(fd_, F_GETFL);
    if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0) return false;
    direct_ = false;
    direct_note_ = "O_DIRECT refused at the first I/O: " + errno_text(EINVAL);
    return true;
  }

  // One pread/pwrite of the whole request, retried on EINTR and continued
  // after a partial transfer; a transfer that stops early is EREMOTEIO.
  IoResult transfer_sync(const IoRequest& r) {
    std::size_t done = 0;
    while (done < r.bytes) {
      const auto offset = static_cast<off_t>(r.offset + done);
      const ssize_t n = r.op == IoOp::read ? ::pread(fd_, r.buffer + done, r.bytes - done, offset)
                                           : ::pwrite(fd_, r.buffer + done, r.bytes - done, offset);
      if (n < 0) {
        if (errno == EINTR) continue;
        return IoResult{errno, done, false};
      }
      if (n == 0) return IoResult{EREMOTEIO, done, false};
      done += static_cast<std::size_t>(n);
    }
    return IoResult{0, done, false};
  }

  int fd_;
  bool direct_;
  bool read_only_;
  bool preallocated_ = false;
  std::string direct_note_;
};

class SyncFileIo final : public PosixFile {
 public:
  SyncFileIo(int fd, bool direct, bool read_only, std::string direct_note, std::string why)
      : PosixFile(fd, direct, read_only, std::move(direct_note)), why_(std::move(why)) {}

 private:
  void do_run(std::span<const IoRequest> requests, std::span<IoResult> results,
              std::chrono::milliseconds deadline, const IoHooks& hooks) override {
    const Clock::time_point end = Clock::now() + deadline;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      // A blocked pread cannot be interrupted: the deadline is checked
      // between requests.
      IoRequest r = requests[i];
      if (deadline.count() > 0 && Clock::now() >= end) {
        results[i] = IoResult{ETIMEDOUT, 0, false};
      } else if (r.buffer == nullptr && (r.buffer = hooks.prepare(i)) == nullptr) {
        results[i] = IoResult{ENOBUFS, 0, false};  // nothing in flight to wait for
      } else {
        results[i] = transfer_sync(r);
        if (results[i].error == EINVAL && fall_back_to_buffered()) results[i] = transfer_sync(r);
      }
      hooks.on_complete(i);
    }
  }
  std::vector<std::uint64_t> do_reap_orphans(bool) override { return {}; }
  std::size_t do_orphans() const noexcept override { return 0; }
  std::string do_describe() const override {
    std::string s = "pread/pwrite, " + direct_text();
    if (!why_.empty()) s += "; " + why_;
    return s;
  }

  std::string why_;
};

#if KVPORT_HAVE_LIBURING
class UringFileIo final : public PosixFile {
 public:
  UringFileIo(int fd, bool direct, bool read_only, std::string direct_note, io_uring ring,
              unsigned depth)
      : PosixFile(fd, direct, read_only, std::move(direct_note)), ring_(ring), depth_(depth) {}

  ~UringFileIo() override {
    // The kernel may still read or write orphaned buffers: wait them out
    // before the ring (and the caller's buffers after us) go away.
    (void)do_reap_orphans(true);
    io_uring_queue_exit(&ring_);
  }

 private:
  void do_run(std::span<const IoRequest> requests, std::span<IoResult> results,
              std::chrono::milliseconds deadline, const IoHooks& hooks) override {
    // EINVAL on aligned direct I/O: the file system takes O_DIRECT at open
    // only. Those requests are held back, and run again buffered (with the
    // buffers they were issued with).
    std::vector<std::size_t> again;
    std::vector<std::byte*> buffers(requests.size(), nullptr);
    const bool may_fall_back = direct_;
    run_once(requests, results, deadline, Clock::now() + deadline, buffers,
             IoHooks{[&](std::size_t i) {
                       if (may_fall_back && results[i].error == EINVAL) {
                         again.push_back(i);
                       } else {
                         hooks.on_complete(i);
                       }
                     },
                     hooks.prepare});
    if (again.empty()) return;
    if (!fall_back_to_buffered()) {
      for (std::size_t i : again)
        hooks.on_complete(i);
      return;
    }
    std::vector<IoRequest> sub;
    for (std::size_t i : again) {
      sub.push_back(requests[i]);
      sub.back().buffer = buffers[i];
    }
    std::vector<IoResult> sub_results(sub.size());
    std::vector<std::byte*> sub_buffers(sub.size(), nullptr);
    run_once(sub, sub_results, deadline, Clock::now() + deadline, sub_buffers,
             IoHooks{[&](std::size_t k) {
                       results[again[k]] = sub_results[k];
                       hooks.on_complete(again[k]);
                     },
                     {}});
  }

  void run_once(std::span<const IoRequest> requests, std::span<IoResult> results,
                std::chrono::milliseconds deadline, Clock::time_point end,
                std::vector<std::byte*>& buffers, const IoHooks& hooks) {
    const IoCompletion& on_complete = hooks.on_complete;
    const std::uint64_t base = next_id_;
    next_id_ += requests.size();
    std::size_t submitted = 0;
    std::size_t completed = 0;
    std::size_t in_flight = 0;
    std::vector<bool> done(requests.size(), false);
    std::vector<std::size_t> finished;
    bool timed_out = false;
    const auto refill = [&] {
      while (submitted < requests.size() && in_flight + orphans_.size() < depth_ &&
             io_uring_sq_space_left(&ring_) > 0) {
        const IoRequest& r = requests[submitted];
        std::byte* buf = r.buffer != nullptr ? r.buffer : hooks.prepare(submitted);
        if (buf == nullptr) {
          // A completion, or one still to be handed to on_complete, may free
          // one: wait for it. With none, the request cannot be served.
          if (in_flight > 0 || !orphans_.empty() || !finished.empty()) break;
          results[submitted] = IoResult{ENOBUFS, 0, false};
          done[submitted] = true;
          ++completed;
          on_complete(submitted++);
          continue;
        }
        buffers[submitted] = buf;
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (r.op == IoOp::read) {
          io_uring_prep_read(sqe, fd_, buf, static_cast<unsigned>(r.bytes), r.offset);
        } else {
          io_uring_prep_write(sqe, fd_, buf, static_cast<unsigned>(r.bytes), r.offset);
        }
        io_uring_sqe_set_data64(sqe, base + submitted);
        ++submitted;
        ++in_flight;
      }
    };
    while (completed < requests.size() && !timed_out) {
      refill();
      const int s = io_uring_submit(&ring_);
      if (s < 0 && s != -EINTR && s != -EAGAIN && s != -EBUSY) {
        // The ring refused the batch: nothing more goes in; what is in
        // flight is still waited for.
        for (std::size_t i = submitted; i < requests.size(); ++i) {
          if (!done[i]) {
            results[i] = IoResult{-s, 0, false};
            done[i] = true;
            ++completed;
            on_complete(i);
          }
        }
        submitted = requests.size();
      }
      // Nothing of ours in flight: submitted everything (then all completed)
      // or orphans of earlier batches fill the ring (wait for one of them).
      if (in_flight == 0 && orphans_.empty()) continue;
      io_uring_cqe* cqe = nullptr;
      int w;
      if (deadline.count() > 0) {
        const auto left = std::max<Clock::duration>(end - Clock::now(), Clock::duration::zero());
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
        __kernel_timespec ts{};
        ts.tv_sec = ns / 1'000'000'000;
        ts.tv_nsec = ns % 1'000'000'000;
        w = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
      } else {
        w = io_uring_wait_cqe(&ring_, &cqe);
      }
      if (w == -ETIME) {
        timed_out = true;
        break;
      }
      if (w == -EINTR) continue;
      if (w < 0) {
        timed_out = true;  // the ring itself failed: what is in flight is orphaned
        break;
      }
      unsigned head;
      unsigned seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        const std::uint64_t id = io_uring_cqe_get_data64(cqe);
        if (id < base || id >= base + requests.size()) {
          complete_orphan(id);
          continue;
        }
        const std::size_t i = static_cast<std::size_t>(id - base);
        const IoRequest& r = requests[i];
        IoResult& out = results[i];
        if (cqe->res < 0) {
          out = IoResult{-cqe->res, 0, false};
        } else if (static_cast<std::size_t>(cqe->res) < r.bytes) {
          out = IoResult{EREMOTEIO, static_cast<std::size_t>(cqe->res), false};
        } else {
          out = IoResult{0, r.bytes, false};
        }
        done[i] = true;
        ++completed;
        --in_flight;
        finished.push_back(i);
      }
      io_uring_cq_advance(&ring_, seen);
      // The caller's work on what completed, with the rest still in flight:
      // refill the queue first.
      if (!finished.empty()) {
        refill();
        (void)io_uring_submit(&ring_);
        for (std::size_t i : finished)
          on_complete(i);
        finished.clear();
        refill();  // with the buffers those completions gave back
      }
    }
    if (!timed_out) return;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      if (done[i]) continue;
      const bool issued = i < submitted;
      results[i] = IoResult{ETIMEDOUT, 0, issued};
      if (issued) orphans_.emplace(base + i, requests[i].tag);
      on_complete(i);
    }
  }

  void complete_orphan(std::uint64_t id) {
    const auto it = orphans_.find(id);
    if (it == orphans_.end()) return;
    reaped_.push_back(it->second);
    orphans_.erase(it);
  }

  std::vector<std::uint64_t> do_reap_orphans(bool wait) override {
    while (!orphans_.empty()) {
      io_uring_cqe* cqe = nullptr;
      const int w = wait ? io_uring_wait_cqe(&ring_, &cqe) : io_uring_peek_cqe(&ring_, &cqe);
      if (w == -EINTR) continue;
      if (w < 0 || cqe == nullptr) break;
      complete_orphan(io_uring_cqe_get_data64(cqe));
      io_uring_cqe_seen(&ring_, cqe);
    }
    return std::exchange(reaped_, {});
  }

  std::size_t do_orphans() const noexcept override { return orphans_.size(); }

  std::string do_describe() const override {
    return "io_uring (queue depth " + std::to_string(depth_) + "), " + direct_text();
  }

  io_uring ring_;
  unsigned depth_;
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::uint64_t, std::uint64_t> orphans_;  // id -> caller's tag
  std::vector<std::uint64_t> reaped_;
};
#endif

}  // namespace

std::unique_ptr<FileIo> open_file_io(const std::filesystem::path& path,
                                     const FileIoOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    throw InvalidArgument("open_file_io: queue_depth must be in [1, 4096], got " +
                          std::to_string(options.queue_depth));
  }
  if (options.read_only && options.create) {
    throw InvalidArgument("open_file_io: " + path.string() + ": create with read_only");
  }
  int flags = options.read_only ? O_RDONLY : O_RDWR;
  if (options.create) flags |= O_CREAT;
  bool direct = options.direct;
  std::string direct_note;
  // Never through a symbolic link, regular files only (detail::open_regular).
  int fd = detail::open_regular(path, flags | (direct ? O_DIRECT : 0));
  if (fd < 0 && direct && errno == EINVAL) {
    direct_note = "O_DIRECT refused at open: " + errno_text(EINVAL);
    direct = false;
    fd = detail::open_regular(path, flags);
  }
  if (fd < 0) {
    const int e = errno;
    throw InvalidArgument(detail::open_failure(
        path, e, options.read_only ? "open for reading" : "open for reading and writing"));
  }
  if (!options.direct) direct_note.clear();

  std::string why;
  if (options.engine != IoEngine::sync) {
#if KVPORT_HAVE_LIBURING
    io_uring ring{};
    const int r = io_uring_queue_init(static_cast<unsigned>(options.queue_depth), &ring, 0);
    if (r == 0) {
      return std::make_unique<UringFileIo>(fd, direct, options.read_only, std::move(direct_note),
                                           ring, static_cast<unsigned>(options.queue_depth));
    }
    why = "io_uring unavailable: " + errno_text(-r);
#else
    why = "io_uring unavailable: built without liburing";
#endif
    if (options.engine == IoEngine::io_uring) {
      ::close(fd);
      throw InvalidArgument("open_file_io: " + path.string() + ": " + why);
    }
  }
  return std::make_unique<SyncFileIo>(fd, direct, options.read_only, std::move(direct_note),
                                      std::move(why));
}

// ---- FaultInjectingFileIo ----------------------------------------------------------------

FaultInjectingFileIo::FaultInjectingFileIo(std::unique_ptr<FileIo> inner)
    : inner_(std::move(inner)) {
  if (!inner_) throw InvalidArgument("FaultInjectingFileIo: null inner FileIo");
}

void FaultInjectingFileIo::plan(const IoFault& fault) {
  if (fault.count == 0) throw InvalidArgument("FaultInjectingFileIo::plan: count must be > 0");
  planned_.push_back(Planned{fault, 0, 0});
}

void FaultInjectingFileIo::clear() {
  planned_.clear();
}
std::uint64_t FaultInjectingFileIo::injected() const noexcept {
  return injected_;
}
FileIo& FaultInjectingFileIo::inner() noexcept {
  return *inner_;
}

bool FaultInjectingFileIo::fire(IoStep step, std::optional<IoOp> op, int& error) {
  for (Planned& p : planned_) {
    if (p.fault.step != step || p.fired >= p.fault.count) continue;
    if (p.fault.op && op && *p.fault.op != *op) continue;
    if (p.seen++ < p.fault.skip) continue;
    ++p.fired;
    ++injected_;
    error = p.fault.error;
    return true;
  }
  return false;
}

void FaultInjectingFileIo::do_run(std::span<const IoRequest> requests, std::span<IoResult> results,
                                  std::chrono::milliseconds deadline, const IoHooks& hooks) {
  const IoCompletion& on_complete = hooks.on_complete;
  // Decide each request's fault first, issue the rest as one batch.
  enum class Fate : std::uint8_t { issue, fail, timeout, fail_after, half };
  std::vector<Fate> fate(requests.size(), Fate::issue);
  std::vector<int> error(requests.size(), 0);
  std::vector<IoRequest> issue;
  std::vector<std::size_t> where;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const IoOp op = requests[i].op;
    int e = 0;
    if (fire(IoStep::submit, op, e)) {
      fate[i] = Fate::fail;
    } else if (fire(IoStep::timeout, op, e)) {
      fate[i] = Fate::timeout;
    } else if (fire(IoStep::complete, op, e)) {
      fate[i] = Fate::fail_after;
    } else if (fire(IoStep::short_io, op, e)) {
      fate[i] = Fate::half;
    }
    error[i] = e;
    if (fate[i] == Fate::issue || fate[i] == Fate::fail_after || fate[i] == Fate::half) {
      issue.push_back(requests[i]);
      where.push_back(i);
    }
  }
  // The injected outcome of request i, once its inner result (if issued) is in.
  const auto settle = [&](std::size_t i) {
    switch (fate[i]) {
      case Fate::issue:
        break;
      case Fate::fail:
        results[i] = IoResult{error[i], 0, false};
        break;
      case Fate::timeout:
        results[i] = IoResult{ETIMEDOUT, 0, false};
        break;
      case Fate::fail_after:
        if (results[i].error == 0) results[i] = IoResult{error[i], 0, results[i].orphaned};
        break;
      case Fate::half:
        if (results[i].error == 0) results[i] = IoResult{EREMOTEIO, requests[i].bytes / 2, false};
        break;
    }
    on_complete(i);
  };
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (fate[i] == Fate::fail || fate[i] == Fate::timeout) settle(i);
  }
  std::vector<IoResult> issued(issue.size());
  if (!issue.empty()) {
    IoPrepare prepare;
    if (hooks.prepare) prepare = [&](std::size_t k) { return hooks.prepare(where[k]); };
    inner_->run(
        issue, issued, deadline,
        [&](std::size_t k) {
          results[where[k]] = issued[k];
          settle(where[k]);
        },
        prepare);
  }
}

int FaultInjectingFileIo::do_sync() {
  int e = 0;
  if (fire(IoStep::sync, std::nullopt, e)) return e;
  return inner_->sync();
}

int FaultInjectingFileIo::do_allocate(std::uint64_t bytes) {
  int e = 0;
  if (fire(IoStep::allocate, std::nullopt, e)) return e;
  return inner_->allocate(bytes);
}

int FaultInjectingFileIo::do_reserve(std::uint64_t offset, std::uint64_t bytes) {
  int e = 0;
  if (fire(IoStep::allocate, std::nullopt, e)) return e;
  return inner_->reserve(offset, bytes);
}

std::optional<std::uint64_t> FaultInjectingFileIo::do_size() {
  return inner_->size();
}
bool FaultInjectingFileIo::do_linked() {
  return inner_->linked();
}
std::vector<std::uint64_t> FaultInjectingFileIo::do_reap_orphans(bool wait) {
  return inner_->reap_orphans(wait);
}
std::size_t FaultInjectingFileIo::do_orphans() const noexcept {
  return inner_->orphans();
}
std::string FaultInjectingFileIo::do_describe() const {
  return inner_->describe() + " (faults injected)";
}
bool FaultInjectingFileIo::do_direct() const noexcept {
  return inner_->direct();
}
bool FaultInjectingFileIo::do_preallocated() const noexcept {
  return inner_->preallocated();
}
bool FaultInjectingFileIo::do_read_only() const noexcept {
  return inner_->read_only();
}

}  // namespace kvport::disk
