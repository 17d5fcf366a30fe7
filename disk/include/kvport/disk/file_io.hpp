// SPDX-License-Identifier: Apache-2.0
// FileIo: batched reads and writes of one open file with a deadline, through
// io_uring or pread/pwrite, O_DIRECT where the file system takes it. The disk
// tier does every I/O through this seam, so that faults can be injected at
// each step (FaultInjectingFileIo) as the fault-injecting backend does for
// device work.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvport::disk {

/// Alignment of O_DIRECT buffers, offsets and lengths (the logical block size
/// of every file system kvport targets is at most this).
inline constexpr std::size_t kDirectAlignment = 4096;

enum class IoOp : std::uint8_t { read, write };

/// One I/O of a batch: `bytes` at `offset` of the file, into `buffer` (read)
/// or from it (write). Under O_DIRECT the buffer, offset and bytes are
/// multiples of kDirectAlignment. `tag` is the caller's: a request still in
/// flight at the deadline is reported back by it (reap_orphans).
struct IoRequest {
  IoOp op = IoOp::read;
  std::uint64_t offset = 0;
  std::byte* buffer = nullptr;
  std::size_t bytes = 0;
  std::uint64_t tag = 0;
};

/// The outcome of one IoRequest: error 0 when every byte moved; else an errno
/// value: the call's own (EIO, ENOSPC, ...), EREMOTEIO for a short transfer
/// (fewer bytes than asked: past the end of a truncated file), ETIMEDOUT when
/// the deadline passed first. `orphaned`: the request was submitted and had
/// not completed at the deadline, so the kernel may still use its buffer
/// until reap_orphans() returns its tag.
struct IoResult {
  int error = 0;
  std::size_t bytes = 0;
  bool orphaned = false;
};

/// Called by FileIo::run once for each request whose result is final, with
/// its index, on the caller's thread, as soon as it is known: the caller can
/// work on a completed request while the others are still in flight.
using IoCompletion = std::function<void(std::size_t index)>;

/// Gives the buffer of a request whose IoRequest::buffer is null, when it is
/// about to be issued (so that a caller can recycle a few buffers over a
/// long batch: a buffer released in IoCompletion is handed out again here).
/// Null: none free now; the request waits for a completion (or, with nothing
/// in flight to wait for, fails with ENOBUFS).
using IoPrepare = std::function<std::byte*(std::size_t index)>;

/// The callbacks of one FileIo::run.
struct IoHooks {
  IoCompletion on_complete;
  IoPrepare prepare;
};

/// Which implementation runs the I/O.
enum class IoEngine : std::uint8_t {
  automatic,  ///< io_uring when the kernel allows it, else pread/pwrite
  io_uring,   ///< io_uring or fail (InvalidArgument when unavailable)
  sync,       ///< pread/pwrite
};

/// "automatic" / "io_uring" / "sync".
const char* to_string(IoEngine engine) noexcept;
/// Parses the names above; nullopt for anything else.
std::optional<IoEngine> parse_io_engine(std::string_view text) noexcept;

/// How open_file_io opens a file.
struct FileIoOptions {
  IoEngine engine = IoEngine::automatic;
  /// O_DIRECT (no page cache). Refused by the file system (EINVAL at open or
  /// at the first I/O): detected, and the file is used buffered instead;
  /// FileIo::describe() says so.
  bool direct = true;
  bool read_only = false;
  /// Create the file when it does not exist (never with read_only).
  bool create = false;
  /// I/Os in flight at once (io_uring's queue entries). In [1, 4096].
  std::size_t queue_depth = 32;
};

/// One open file. Not thread-safe: one caller at a time.
class FileIo {
 public:
  virtual ~FileIo() = default;
  FileIo() = default;
  FileIo(const FileIo&) = delete;
  FileIo& operator=(const FileIo&) = delete;

  /// Runs every request of the batch (at most the queue depth in flight at
  /// once, refilled as they complete) and waits for them until `deadline`
  /// (measured from the call; 0: no deadline). results[i] is requests[i]'s
  /// outcome; `on_complete` (when set) is called once per request as its
  /// result becomes final, orphaned and timed-out ones last; `prepare` (when
  /// set) gives the buffers of requests that have none. I/O errors are
  /// reported per request, never thrown; throws InvalidArgument when the
  /// spans' sizes differ or a request is malformed (a null buffer without
  /// `prepare`, zero bytes, misaligned under O_DIRECT, a write on a
  /// read-only file).
  void run(std::span<const IoRequest> requests, std::span<IoResult> results,
           std::chrono::milliseconds deadline, const IoCompletion& on_complete = {},
           const IoPrepare& prepare = {});
  /// fdatasync: 0 or the errno value.
  int sync();
  /// Makes the file `bytes` long with its blocks allocated (fallocate); where
  /// the file system does not support it, extends it sparse (ftruncate) and
  /// preallocated() turns false. 0 or the errno value (ENOSPC: not enough
  /// space).
  int allocate(std::uint64_t bytes);
  /// Reserves space for `bytes` at `offset` without changing the file's
  /// size (fallocate with FALLOC_FL_KEEP_SIZE), so that writes there cannot
  /// find the file system full. One system call. 0 (also where the file
  /// system cannot reserve: nothing reserved, the writes will tell) or the
  /// errno value (ENOSPC: not enough space). Throws InvalidArgument on a
  /// read-only file.
  int reserve(std::uint64_t offset, std::uint64_t bytes);
  /// The file's size in bytes, or nullopt when fstat fails.
  std::optional<std::uint64_t> size();
  /// Whether the file still has a name (fstat's link count > 0): a file
  /// deleted under the process keeps serving its old bytes from the inode.
  bool linked();
  /// Tags of requests orphaned at a deadline that have completed since
  /// (their buffers are the caller's again). `wait`: block until every
  /// orphan completed (no deadline: the destructor's and a close's path).
  std::vector<std::uint64_t> reap_orphans(bool wait);
  /// Requests orphaned at a deadline and not yet completed.
  std::size_t orphans() const noexcept;

  /// "io_uring (queue depth 32), O_DIRECT" or "pread/pwrite, buffered
  /// (O_DIRECT refused: Invalid argument)": what runs the I/O and why.
  std::string describe() const;
  /// Whether I/O bypasses the page cache (O_DIRECT in effect).
  bool direct() const noexcept;
  /// Whether the last allocate() preallocated (false after the ftruncate
  /// fallback, and before any allocate()).
  bool preallocated() const noexcept;
  bool read_only() const noexcept;

 protected:
  /// Runs a checked, non-empty batch; calls hooks.on_complete (never empty
  /// here) once per request, hooks.prepare (set when a buffer is null) once
  /// per request issued without a buffer, just before issuing it.
  virtual void do_run(std::span<const IoRequest> requests, std::span<IoResult> results,
                      std::chrono::milliseconds deadline, const IoHooks& hooks) = 0;
  virtual int do_sync() = 0;
  virtual int do_allocate(std::uint64_t bytes) = 0;
  virtual int do_reserve(std::uint64_t offset, std::uint64_t bytes) = 0;
  virtual std::optional<std::uint64_t> do_size() = 0;
  virtual bool do_linked() = 0;
  virtual std::vector<std::uint64_t> do_reap_orphans(bool wait) = 0;
  virtual std::size_t do_orphans() const noexcept = 0;
  virtual std::string do_describe() const = 0;
  virtual bool do_direct() const noexcept = 0;
  virtual bool do_preallocated() const noexcept = 0;
  virtual bool do_read_only() const noexcept = 0;
};

/// Opens `path` as options say, never through a symbolic link (O_NOFOLLOW)
/// and only a regular file (checked with fstat after an O_NONBLOCK open, so a
/// FIFO cannot block it). Throws InvalidArgument naming the path and the
/// reason when it cannot be opened (missing and not created, not writable, a
/// symbolic link, a directory, FIFO, socket or device) or options are out of
/// range, or io_uring was asked for and is unavailable.
std::unique_ptr<FileIo> open_file_io(const std::filesystem::path& path,
                                     const FileIoOptions& options);

/// Whether this build has io_uring (liburing found at configure time).
bool io_uring_compiled() noexcept;

// ---- faults ----------------------------------------------------------------------------

/// The step of an I/O where a fault is injected.
enum class IoStep : std::uint8_t {
  submit,    ///< the request is not issued; its result is the error
  complete,  ///< the request is issued, its result replaced by the error
  short_io,  ///< the request is issued, reported as having moved half its bytes
  timeout,   ///< the request is not issued and reported as past its deadline
  sync,      ///< sync() returns the error
  allocate,  ///< allocate() or reserve() returns the error
};

/// One planned fault: the (skip + 1)-th event of `step` (restricted to `op`
/// for the request steps when set) and the `count - 1` after it fail with
/// `error`.
struct IoFault {
  IoStep step = IoStep::complete;
  std::optional<IoOp> op;
  int error = 5;  // EIO
  std::uint64_t skip = 0;
  std::uint64_t count = 1;
};

/// A FileIo that runs its inner FileIo and injects planned faults, counting
/// what it injected. Tests use it to fail every step of the disk tier.
class FaultInjectingFileIo final : public FileIo {
 public:
  explicit FaultInjectingFileIo(std::unique_ptr<FileIo> inner);
  /// Plans a fault (faults are matched in the order planned).
  void plan(const IoFault& fault);
  /// Drops every planned fault not yet injected.
  void clear();
  /// Faults injected so far.
  std::uint64_t injected() const noexcept;
  FileIo& inner() noexcept;

 private:
  struct Planned {
    IoFault fault;
    std::uint64_t seen = 0;
    std::uint64_t fired = 0;
  };
  bool fire(IoStep step, std::optional<IoOp> op, int& error);

  void do_run(std::span<const IoRequest> requests, std::span<IoResult> results,
              std::chrono::milliseconds deadline, const IoHooks& hooks) override;
  int do_sync() override;
  int do_allocate(std::uint64_t bytes) override;
  int do_reserve(std::uint64_t offset, std::uint64_t bytes) override;
  std::optional<std::uint64_t> do_size() override;
  bool do_linked() override;
  std::vector<std::uint64_t> do_reap_orphans(bool wait) override;
  std::size_t do_orphans() const noexcept override;
  std::string do_describe() const override;
  bool do_direct() const noexcept override;
  bool do_preallocated() const noexcept override;
  bool do_read_only() const noexcept override;

  std::unique_ptr<FileIo> inner_;
  std::vector<Planned> planned_;
  std::uint64_t injected_ = 0;
};

}  // namespace kvport::disk
