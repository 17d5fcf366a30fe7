#include "kvport/backends/host_backend.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport {
namespace {

constexpr const char* kName = "host";
// How many freed ranges to remember, to say "use after free" rather than
// "bad pointer" when a stale pointer comes back.
constexpr std::size_t kFreedHistory = 4096;

// ---- one stream: a worker thread draining a FIFO queue -------------------------

class HostStream {
 public:
  using Op = std::function<void()>;

  HostStream() : worker_([this] { run(); }) {}

  ~HostStream() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_worker_.notify_one();
    worker_.join();
    if (first_error_) {
      try {
        std::rethrow_exception(first_error_);
      } catch (const std::exception& e) {
        log::error(fmt::format("host: stream destroyed with an unsynchronized error: {}", e.what()));
      } catch (...) {
        log::error("host: stream destroyed with an unsynchronized unknown error");
      }
    }
  }

  void enqueue(Op op) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(op));
      ++enqueued_;
    }
    wake_worker_.notify_one();
  }

  // Waits for everything queued so far; rethrows and clears the first error.
  void synchronize() {
    std::unique_lock lock(mutex_);
    const std::uint64_t target = enqueued_;
    idle_.wait(lock, [&] { return completed_ >= target; });
    if (first_error_) std::rethrow_exception(std::exchange(first_error_, nullptr));
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_worker_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      Op op = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::exception_ptr error;
      try {
        op();
      } catch (...) {
        error = std::current_exception();
      }
      op = nullptr;  // release captures outside the lock
      lock.lock();
      if (error && !first_error_) {
        first_error_ = error;
      } else if (error) {
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          log::error(fmt::format("host: further asynchronous error on a stream: {}", e.what()));
        } catch (...) {
        }
      }
      ++completed_;
      idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_worker_;
  std::condition_variable idle_;
  std::deque<Op> queue_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t completed_ = 0;
  bool stopping_ = false;
  std::exception_ptr first_error_;
  std::thread worker_;  // last: starts after every other member exists
};

// ---- events: a monotonic record counter --------------------------------------------

struct HostEvent {
  std::mutex mutex;
  std::condition_variable done;
  std::uint64_t recorded = 0;   // records issued (at call time)
  std::uint64_t completed = 0;  // records whose stream reached them

  void wait_for(std::uint64_t target) {
    std::unique_lock lock(mutex);
    done.wait(lock, [&] { return completed >= target; });
  }
};

// ---- the backend -------------------------------------------------------------------

class HostBackend final : public Backend {
 public:
  explicit HostBackend(std::size_t capacity) : Backend(kName), capacity_(capacity) {
    default_stream_ = std::make_unique<HostStream>();
  }

  ~HostBackend() override {
    default_stream_.reset();
    {
      std::lock_guard lock(handles_mutex_);
      streams_.clear();
      events_.clear();
    }
    std::unique_lock lock(memory_mutex_);
    if (!live_.empty()) {
      log::warn(fmt::format("host: backend destroyed with {} live allocations ({} bytes); freeing them",
                            live_.size(), used_));
    }
    for (auto& [address, bytes] : live_) std::free(reinterpret_cast<void*>(address));
  }

 private:
  // ---- memory checking ----

  // Throws when [p, p + bytes) is not inside one live allocation.
  // Caller holds memory_mutex_ (shared or exclusive).
  void check_range_locked(DevicePtr p, std::size_t bytes, const char* op) const {
    const std::uintptr_t a = p.address();
    auto it = live_.upper_bound(a);
    if (it != live_.begin()) {
      --it;
      const std::uintptr_t base = it->first;
      const std::size_t size = it->second;
      if (a < base + size) {
        if (bytes > base + size - a) {
          throw InvalidArgument(fmt::format(
              "host: {}: out of bounds: [{:#x}, +{}) runs {} bytes past the end of allocation "
              "[{:#x}, +{})",
              op, a, bytes, bytes - (base + size - a), base, size));
        }
        return;
      }
    }
    for (auto f = freed_.rbegin(); f != freed_.rend(); ++f) {
      if (a >= f->first && a < f->first + f->second) {
        throw InvalidArgument(
            fmt::format("host: {}: use after free: {:#x} lies in allocation [{:#x}, +{}) which "
                        "was freed",
                        op, a, f->first, f->second));
      }
    }
    throw InvalidArgument(
        fmt::format("host: {}: bad pointer: {:#x} is not inside any live allocation", op, a));
  }

  void check_range(DevicePtr p, std::size_t bytes, const char* op) const {
    std::shared_lock lock(memory_mutex_);
    check_range_locked(p, bytes, op);
  }

  // Runs `body` on the worker with the memory lock held shared, so that a
  // concurrent free waits; re-checks the ranges only if something was freed
  // since the call was made.
  template <class Check, class Body>
  void enqueue_checked(void* stream, Check check, Body body) {
    const std::uint64_t generation = free_generation_.load(std::memory_order_acquire);
    stream_of(stream).enqueue([this, generation, check = std::move(check), body = std::move(body)] {
      std::shared_lock lock(memory_mutex_);
      if (free_generation_.load(std::memory_order_acquire) != generation) check();
      body();
    });
  }

  HostStream& stream_of(void* native) const {
    if (native == default_stream_.get()) return *default_stream_;
    std::lock_guard lock(handles_mutex_);
    auto it = streams_.find(native);
    if (it == streams_.end()) {
      throw InvalidArgument(fmt::format("host: stream {} is not a live stream", native));
    }
    return *it->second;
  }

  std::shared_ptr<HostEvent> event_of(void* native) const {
    std::lock_guard lock(handles_mutex_);
    auto it = events_.find(native);
    if (it == events_.end()) {
      throw InvalidArgument(fmt::format("host: event {} is not a live event", native));
    }
    return it->second;
  }

  // ---- Backend ----

  int do_device_count() const override { return 1; }

  MemInfo do_mem_info() const override {
    std::shared_lock lock(memory_mutex_);
    return MemInfo{capacity_ - used_, capacity_};
  }

  DevicePtr do_alloc(std::size_t bytes) override {
    if (bytes > SIZE_MAX - (kAllocAlignment - 1)) throw OutOfMemory(kName, bytes, 0);
    const std::size_t rounded = (bytes + kAllocAlignment - 1) / kAllocAlignment * kAllocAlignment;
    std::unique_lock lock(memory_mutex_);
    if (rounded > capacity_ - used_) throw OutOfMemory(kName, bytes, capacity_ - used_);
    void* p = std::aligned_alloc(kAllocAlignment, rounded);
    if (p == nullptr) throw OutOfMemory(kName, bytes, capacity_ - used_);
    live_.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
    used_ += rounded;
    return DevicePtr::from(p);
  }

  bool do_free(DevicePtr ptr) noexcept override {
    std::unique_lock lock(memory_mutex_);
    auto it = live_.find(ptr.address());
    if (it == live_.end()) return false;
    const std::size_t bytes = it->second;
    used_ -= (bytes + kAllocAlignment - 1) / kAllocAlignment * kAllocAlignment;
    live_.erase(it);
    try {
      if (freed_.size() == kFreedHistory) freed_.pop_front();
      freed_.emplace_back(ptr.address(), bytes);
    } catch (...) {  // the history only improves messages
    }
    free_generation_.fetch_add(1, std::memory_order_acq_rel);
    std::free(ptr.get());
    return true;
  }

  void* do_create_stream() override {
    auto stream = std::make_unique<HostStream>();
    void* native = stream.get();
    std::lock_guard lock(handles_mutex_);
    streams_.emplace(native, std::move(stream));
    return native;
  }

  void do_destroy_stream(void* native) noexcept override {
    std::unique_ptr<HostStream> doomed;
    {
      std::lock_guard lock(handles_mutex_);
      auto it = streams_.find(native);
      if (it == streams_.end()) return;
      doomed = std::move(it->second);
      streams_.erase(it);
    }
    // `doomed` drains its queue and joins its worker here, outside the lock.
  }

  void* do_default_stream() override { return default_stream_.get(); }

  void do_synchronize(void* stream) override { stream_of(stream).synchronize(); }

  void* do_create_event() override {
    auto event = std::make_shared<HostEvent>();
    void* native = event.get();
    std::lock_guard lock(handles_mutex_);
    events_.emplace(native, std::move(event));
    return native;
  }

  void do_destroy_event(void* native) noexcept override {
    std::lock_guard lock(handles_mutex_);
    events_.erase(native);  // queued work keeps its own reference
  }

  void do_record_event(void* event_native, void* stream) override {
    auto event = event_of(event_native);
    HostStream& s = stream_of(stream);
    std::uint64_t seq;
    {
      std::lock_guard lock(event->mutex);
      seq = ++event->recorded;
    }
    s.enqueue([event, seq] {
      {
        std::lock_guard lock(event->mutex);
        if (seq > event->completed) event->completed = seq;
      }
      event->done.notify_all();
    });
  }

  void do_wait_event(void* stream, void* event_native) override {
    auto event = event_of(event_native);
    HostStream& s = stream_of(stream);
    std::uint64_t target;
    {
      std::lock_guard lock(event->mutex);
      target = event->recorded;
    }
    if (target == 0) return;  // never recorded: nothing to wait for
    s.enqueue([event, target] { event->wait_for(target); });
  }

  void do_synchronize_event(void* event_native) override {
    auto event = event_of(event_native);
    std::uint64_t target;
    {
      std::lock_guard lock(event->mutex);
      target = event->recorded;
    }
    event->wait_for(target);
  }

  void do_memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes,
                       void* stream) override {
    check_range(ptr, bytes, "memset_async");
    enqueue_checked(
        stream, [this, ptr, bytes] { check_range_locked(ptr, bytes, "memset_async"); },
        [ptr, value, bytes] { std::memset(ptr.get(), value, bytes); });
  }

  void do_fill_async(std::span<const FillRegion> regions, std::uint8_t value,
                     void* stream) override {
    {
      std::shared_lock lock(memory_mutex_);
      for (const FillRegion& r : regions) check_range_locked(r.ptr, r.bytes, "fill_async");
    }
    auto copy = std::make_shared<std::vector<FillRegion>>(regions.begin(), regions.end());
    enqueue_checked(
        stream,
        [this, copy] {
          for (const FillRegion& r : *copy) check_range_locked(r.ptr, r.bytes, "fill_async");
        },
        [copy, value] {
          for (const FillRegion& r : *copy) std::memset(r.ptr.get(), value, r.bytes);
        });
  }

  void do_copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes,
                         void* stream) override {
    check_range(dst, bytes, "copy_h2d_async");
    enqueue_checked(
        stream, [this, dst, bytes] { check_range_locked(dst, bytes, "copy_h2d_async"); },
        [dst, src, bytes] { std::memcpy(dst.get(), src, bytes); });
  }

  void do_copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, void* stream) override {
    check_range(src, bytes, "copy_d2h_async");
    enqueue_checked(
        stream, [this, src, bytes] { check_range_locked(src, bytes, "copy_d2h_async"); },
        [dst, src, bytes] { std::memcpy(dst, src.get(), bytes); });
  }

  void do_copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes,
                         void* stream) override {
    auto check = [this, dst, src, bytes] {
      check_range_locked(src, bytes, "copy_d2d_async (source)");
      check_range_locked(dst, bytes, "copy_d2d_async (destination)");
    };
    {
      std::shared_lock lock(memory_mutex_);
      check();
    }
    enqueue_checked(stream, check, [dst, src, bytes] { std::memcpy(dst.get(), src.get(), bytes); });
  }

  void do_copy_batch_async(std::span<const CopyRegion> regions, void* stream) override {
    auto copy = std::make_shared<std::vector<CopyRegion>>(regions.begin(), regions.end());
    auto check = [this, copy] {
      for (const CopyRegion& r : *copy) {
        check_range_locked(r.src, r.bytes, "copy_batch_async (source)");
        check_range_locked(r.dst, r.bytes, "copy_batch_async (destination)");
      }
    };
    {
      std::shared_lock lock(memory_mutex_);
      check();
    }
    enqueue_checked(stream, check, [copy] {
      for (const CopyRegion& r : *copy) std::memcpy(r.dst.get(), r.src.get(), r.bytes);
    });
  }

  const std::size_t capacity_;

  mutable std::shared_mutex memory_mutex_;
  std::map<std::uintptr_t, std::size_t> live_;  // base -> requested bytes
  std::deque<std::pair<std::uintptr_t, std::size_t>> freed_;
  std::size_t used_ = 0;  // rounded bytes
  std::atomic<std::uint64_t> free_generation_{0};

  mutable std::mutex handles_mutex_;
  std::unordered_map<void*, std::unique_ptr<HostStream>> streams_;
  std::unordered_map<void*, std::shared_ptr<HostEvent>> events_;
  std::unique_ptr<HostStream> default_stream_;
};

}  // namespace

std::size_t host_physical_memory() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_size);
}

std::unique_ptr<Backend> make_host_backend(HostBackendOptions options) {
  std::size_t capacity = 0;
  if (options.capacity_bytes) {
    capacity = *options.capacity_bytes;
  } else if (const char* env = std::getenv("KVPORT_HOST_MEMORY"); env != nullptr && *env != '\0') {
    try {
      capacity = parse_byte_size(env);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string("KVPORT_HOST_MEMORY: ") + e.what());
    }
  } else {
    capacity = host_physical_memory();
  }
  return std::make_unique<HostBackend>(capacity);
}

std::unique_ptr<Backend> make_default_host_backend() { return make_host_backend(); }

std::string probe_host_backend() { return {}; }

}  // namespace kvport
