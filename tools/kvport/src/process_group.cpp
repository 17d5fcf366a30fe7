// SPDX-License-Identifier: Apache-2.0
#include "process_group.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "kvport/platform/error.hpp"

namespace kvport::cli {
namespace {

using Clock = std::chrono::steady_clock;

// A caller's timeout as a wait that cannot overflow a time_point: negative is
// 0, more than a day is a day.
std::chrono::milliseconds clamp_wait(std::chrono::milliseconds wait) {
  return std::clamp(wait, std::chrono::milliseconds(0),
                    std::chrono::milliseconds(std::chrono::hours(24)));
}

std::string errno_text(const char* call, int err) {
  return std::string(call) + ": " + std::strerror(err);
}

// `err` is read before the message is built: building it may change errno.
[[noreturn]] void throw_errno(int err, const std::string& what, const char* call) {
  throw Error("ProcessGroup: " + what + ": " + errno_text(call, err));
}

void close_fd(int& fd) noexcept {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

int pidfd_open(pid_t pid) noexcept {
#ifdef SYS_pidfd_open
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) {
    ::fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);  // pidfds are CLOEXEC already
    return static_cast<int>(fd);
  }
#else
  (void)pid;
#endif
  return -1;  // an old kernel: poll() falls back to short waits
}

// Has `pid` exited? Peeks without reaping (WNOWAIT), so that its process
// group can be killed while the group id is still reserved by the zombie.
// ECHILD (someone else reaped it, e.g. SIGCHLD ignored) counts as exited.
bool has_exited(pid_t pid) noexcept {
  siginfo_t info{};
  for (;;) {
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0)
      return info.si_pid != 0;
    if (errno != EINTR) return true;
  }
}

// Signals the child's process group, or the child alone when the group does
// not exist yet (the child has not reached its setpgid).
void signal_group(pid_t pid, int signal) noexcept {
  if (::kill(-pid, signal) != 0) ::kill(pid, signal);
}

// Reaps `pid` (blocking); returns the wait status, or -1 when it was reaped
// elsewhere.
int reap(pid_t pid) noexcept {
  int status = 0;
  for (;;) {
    if (::waitpid(pid, &status, 0) == pid) return status;
    if (errno != EINTR) return -1;
  }
}

// The child between fork and execv: async-signal-safe calls only, no
// allocation. `argv` and `max_fd` were prepared before the fork.
[[noreturn]] void exec_child(pid_t parent, int stdin_fd, int stdout_fd, char* const* argv,
                             int max_fd) noexcept {
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);  // the mask survives exec
  ::setpgid(0, 0);
  // Die with the parent; if it already died (we were reparented before the
  // prctl took effect), nothing would ever send that signal: give up now.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(127);
  // Move both ends above 2 first so that dup2 cannot clobber one with the
  // other (the parent may run with fd 0 or 1 closed); F_DUPFD clears CLOEXEC.
  const int in = ::fcntl(stdin_fd, F_DUPFD, 3);
  const int out = ::fcntl(stdout_fd, F_DUPFD, 3);
  if (in < 0 || out < 0 || ::dup2(in, 0) < 0 || ::dup2(out, 1) < 0) ::_exit(127);
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, 3U, ~0U, 0U) != 0)
#endif
  {
    for (int fd = 3; fd < max_fd; ++fd)
      ::close(fd);
  }
  ::execv(argv[0], argv);
  ::_exit(127);
}

std::atomic<bool> g_signals_installed{false};
volatile std::sig_atomic_t g_signal_received = 0;
constexpr int kTerminationSignals[3] = {SIGINT, SIGTERM, SIGHUP};

extern "C" void on_termination_signal(int signal) {
  g_signal_received = signal;
}

}  // namespace

ProcessGroup::~ProcessGroup() {
  for (Child& c : children_)
    force_reap(c);
}

ProcessGroup::Child& ProcessGroup::at(int child) {
  return const_cast<Child&>(std::as_const(*this).at(child));
}

const ProcessGroup::Child& ProcessGroup::at(int child) const {
  if (child < 0 || static_cast<std::size_t>(child) >= children_.size())
    throw InvalidArgument("ProcessGroup: no child " + std::to_string(child) + " (" +
                          std::to_string(children_.size()) + " spawned)");
  return children_[static_cast<std::size_t>(child)];
}

int ProcessGroup::spawn(std::string name, std::vector<std::string> argv) {
  if (argv.empty() || argv[0].empty())
    throw InvalidArgument("ProcessGroup::spawn(" + name + "): empty argv");
  std::vector<char*> args;
  for (std::string& a : argv)
    args.push_back(a.data());
  args.push_back(nullptr);
  rlimit files{};
  int max_fd = 4096;
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY)
    max_fd = static_cast<int>(std::min<rlim_t>(files.rlim_cur, 1 << 16));

  // Every parent-side descriptor is CLOEXEC so that no other child (of this
  // group or of another thread) holds a copy, which would hide an EOF.
  int in[2] = {-1, -1};   // [0] ours, [1] the child's stdin
  int out[2] = {-1, -1};  // [0] ours, [1] the child's stdout
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in) != 0) {
    const int err = errno;
    throw_errno(err, "spawn(" + name + ")", "socketpair");
  }
  if (::pipe2(out, O_CLOEXEC) != 0) {
    const int err = errno;
    close_fd(in[0]);
    close_fd(in[1]);
    throw_errno(err, "spawn(" + name + ")", "pipe2");
  }
  ::fcntl(out[0], F_SETFL, ::fcntl(out[0], F_GETFL) | O_NONBLOCK);
  ::fcntl(in[0], F_SETFL, ::fcntl(in[0], F_GETFL) | O_NONBLOCK);
  ::shutdown(in[0], SHUT_RD);  // the child's stdin carries data one way

  children_.reserve(children_.size() + 1);  // no throw after the fork
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) exec_child(parent, in[1], out[1], args.data(), max_fd);
  const int fork_errno = errno;
  close_fd(in[1]);
  close_fd(out[1]);
  if (pid < 0) {
    close_fd(in[0]);
    close_fd(out[0]);
    throw_errno(fork_errno, "spawn(" + name + ")", "fork");
  }
  ::setpgid(pid, pid);  // also here, so that kill() reaches the group at once

  Child c;
  c.name = std::move(name);
  c.pid = pid;
  c.stdin_fd = in[0];
  c.stdout_fd = out[0];
  c.pid_fd = pidfd_open(pid);
  children_.push_back(std::move(c));
  return static_cast<int>(children_.size() - 1);
}

bool ProcessGroup::send_line(int child, std::string_view line) {
  return send(at(child), line, std::nullopt);
}

bool ProcessGroup::send_line(int child, std::string_view line, std::chrono::milliseconds timeout) {
  return send(at(child), line, clamp_wait(timeout));
}

bool ProcessGroup::writable(int child) const {
  return at(child).stdin_fd >= 0;
}

bool ProcessGroup::send(Child& c, std::string_view line,
                        std::optional<std::chrono::milliseconds> timeout) {
  const auto deadline = Clock::now() + timeout.value_or(std::chrono::milliseconds(0));
  std::string data;
  data.reserve(line.size() + 1);
  data.append(line);
  data.push_back('\n');
  std::size_t sent = 0;
  while (sent < data.size()) {
    if (c.stdin_fd < 0) return false;
    const ssize_t n =
        ::send(c.stdin_fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) {
      close_fd(c.stdin_fd);
      return false;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      throw Error("ProcessGroup::send_line(" + c.name + "): " + errno_text("send", errno));
    // The child's buffer is full: wait for room, reading everyone's output
    // meanwhile (into pending_) so that a child blocked writing can go on,
    // and give up when the child exits (something it started may hold its
    // stdin without reading; poll() reaps and reports the exit).
    int wait_ms = c.pid_fd >= 0 ? -1 : 20;
    if (timeout) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        close_fd(c.stdin_fd);  // part of the line may be in; nothing more may follow it
        return false;
      }
      wait_ms = static_cast<int>(std::min<std::chrono::milliseconds::rep>(
          left.count(), wait_ms < 0 ? left.count() : wait_ms));
    }
    std::vector<pollfd> fds{{c.stdin_fd, POLLOUT, 0}};
    if (c.pid_fd >= 0) fds.push_back({c.pid_fd, POLLIN, 0});
    for (const Child& other : children_)
      if (other.stdout_fd >= 0) fds.push_back({other.stdout_fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR)
      throw Error("ProcessGroup::send_line(" + c.name + "): " + errno_text("poll", errno));
    for (std::size_t i = 0; i < children_.size(); ++i)
      if (children_[i].stdout_fd >= 0) drain(static_cast<int>(i), pending_);
    if (has_exited(c.pid)) return false;
  }
  return true;
}

void ProcessGroup::drain(int index, std::vector<ProcessEvent>& out) {
  Child& c = children_[static_cast<std::size_t>(index)];
  char buffer[65536];
  while (c.stdout_fd >= 0) {
    const ssize_t n = ::read(c.stdout_fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // EOF (or an error, treated alike): the last line may lack its '\n'
      if (!c.partial.empty() && !c.discarding)
        out.push_back({index, ProcessEvent::Kind::line, std::move(c.partial)});
      c.partial.clear();
      close_fd(c.stdout_fd);
      return;
    }
    std::string_view chunk(buffer, static_cast<std::size_t>(n));
    while (!chunk.empty()) {
      const std::size_t newline = chunk.find('\n');
      const std::string_view piece = chunk.substr(0, newline);
      if (!c.discarding) {
        if (c.partial.size() + piece.size() > kMaxLineBytes) {
          out.push_back({index, ProcessEvent::Kind::error,
                         "line longer than " + std::to_string(kMaxLineBytes) + " bytes, dropped"});
          c.partial.clear();
          c.partial.shrink_to_fit();
          c.discarding = true;
        } else {
          c.partial.append(piece);
        }
      }
      if (newline == std::string_view::npos) break;
      if (!c.discarding) out.push_back({index, ProcessEvent::Kind::line, std::move(c.partial)});
      c.partial.clear();
      c.discarding = false;
      chunk.remove_prefix(newline + 1);
    }
  }
}

void ProcessGroup::reap_if_exited(int index, std::vector<ProcessEvent>& out) {
  Child& c = children_[static_cast<std::size_t>(index)];
  if (c.reaped || !has_exited(c.pid)) return;
  // What it wrote before exiting is in the pipe now; anything a leftover of
  // its group writes later is not its output. The zombie still reserves the
  // group id, so the group kill cannot hit a stranger.
  signal_group(c.pid, SIGKILL);
  drain(index, out);
  if (c.stdout_fd >= 0) {
    if (!c.partial.empty() && !c.discarding)
      out.push_back({index, ProcessEvent::Kind::line, std::move(c.partial)});
    c.partial.clear();
    close_fd(c.stdout_fd);
  }
  const int status = reap(c.pid);
  c.reaped = true;
  close_fd(c.stdin_fd);
  close_fd(c.pid_fd);
  ProcessEvent e{index, ProcessEvent::Kind::exited, {}};
  if (status >= 0 && WIFEXITED(status)) e.exit_code = WEXITSTATUS(status);
  if (status >= 0 && WIFSIGNALED(status)) e.signal = WTERMSIG(status);
  out.push_back(std::move(e));
}

bool ProcessGroup::collect(std::chrono::milliseconds wait, std::vector<ProcessEvent>& out) {
  std::vector<pollfd> fds;
  std::vector<int> owner;
  bool blind = false;  // a running child without a pidfd: its exit needs a recheck
  for (std::size_t i = 0; i < children_.size(); ++i) {
    const Child& c = children_[i];
    if (c.reaped) continue;
    if (c.stdout_fd >= 0) {
      fds.push_back({c.stdout_fd, POLLIN, 0});
      owner.push_back(static_cast<int>(i));
    }
    if (c.pid_fd >= 0) {
      fds.push_back({c.pid_fd, POLLIN, 0});
      owner.push_back(static_cast<int>(i));
    } else {
      blind = true;
    }
  }
  if (blind) wait = std::min(wait, std::chrono::milliseconds(20));
  const int timeout_ms = static_cast<int>(std::max<std::chrono::milliseconds::rep>(
      0, std::min<std::chrono::milliseconds::rep>(wait.count(), 1 << 30)));
  const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
  if (ready < 0 && errno != EINTR) throw Error("ProcessGroup::poll: " + errno_text("poll", errno));
  for (std::size_t k = 0; ready > 0 && k < fds.size(); ++k) {
    Child& c = children_[static_cast<std::size_t>(owner[k])];
    if (fds[k].revents != 0 && fds[k].fd == c.stdout_fd) drain(owner[k], out);
  }
  for (std::size_t i = 0; i < children_.size(); ++i)
    reap_if_exited(static_cast<int>(i), out);
  return ready >= 0;
}

std::vector<ProcessEvent> ProcessGroup::poll(std::chrono::milliseconds timeout) {
  std::vector<ProcessEvent> out = std::move(pending_);
  pending_.clear();
  const auto deadline = Clock::now() + clamp_wait(timeout);
  for (;;) {
    bool waiting = false;
    for (const Child& c : children_)
      waiting = waiting || !c.reaped;
    if (!waiting) return out;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const bool interrupted = !collect(
        out.empty() ? std::max(left, std::chrono::milliseconds(0)) : std::chrono::milliseconds(0),
        out);
    if (!out.empty() || interrupted || Clock::now() >= deadline) return out;
  }
}

bool ProcessGroup::alive(int child) const {
  const Child& c = at(child);
  return !c.reaped && !has_exited(c.pid);
}

pid_t ProcessGroup::pid(int child) const {
  return at(child).pid;
}

const std::string& ProcessGroup::name(int child) const {
  return at(child).name;
}

void ProcessGroup::kill(int child, int signal) {
  const Child& c = at(child);
  if (!c.reaped) signal_group(c.pid, signal);
}

std::vector<ProcessEvent> ProcessGroup::shutdown(std::chrono::milliseconds grace) {
  for (Child& c : children_)
    close_fd(c.stdin_fd);
  const auto deadline = Clock::now() + clamp_wait(grace);
  std::vector<ProcessEvent> exits;
  std::vector<ProcessEvent> events;
  // The exits poll() has not returned yet are reported here.
  for (ProcessEvent& e : pending_)
    if (e.kind == ProcessEvent::Kind::exited) exits.push_back(std::move(e));
  pending_.clear();
  for (;;) {
    bool waiting = false;
    for (const Child& c : children_)
      waiting = waiting || !c.reaped;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (!waiting || left.count() <= 0) break;
    collect(left, events);
    for (ProcessEvent& e : events)
      if (e.kind == ProcessEvent::Kind::exited) exits.push_back(std::move(e));
    events.clear();
  }
  for (std::size_t i = 0; i < children_.size(); ++i) {
    Child& c = children_[i];
    const bool running = !c.reaped && c.pid > 0;
    const int status = force_reap(c);
    if (!running) continue;
    ProcessEvent e{static_cast<int>(i), ProcessEvent::Kind::exited, {}};
    if (status >= 0 && WIFEXITED(status)) e.exit_code = WEXITSTATUS(status);
    if (status >= 0 && WIFSIGNALED(status)) e.signal = WTERMSIG(status);
    e.force_killed = true;
    exits.push_back(std::move(e));
  }
  return exits;
}

int ProcessGroup::force_reap(Child& c) noexcept {
  int status = -1;
  if (!c.reaped && c.pid > 0) {
    signal_group(c.pid, SIGKILL);
    ::kill(c.pid, SIGKILL);  // in case it left its group
    status = reap(c.pid);
    c.reaped = true;
  }
  close_fd(c.stdin_fd);
  close_fd(c.stdout_fd);
  close_fd(c.pid_fd);
  return status;
}

TerminationSignals::TerminationSignals() : previous_{} {
  if (g_signals_installed.exchange(true))
    throw Error("TerminationSignals: another instance is already installed");
  g_signal_received = 0;
  struct sigaction action {};
  action.sa_handler = on_termination_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;  // no SA_RESTART: a blocking poll() returns EINTR
  for (int i = 0; i < 3; ++i)
    ::sigaction(kTerminationSignals[i], &action, &previous_[i]);
}

TerminationSignals::~TerminationSignals() {
  for (int i = 0; i < 3; ++i)
    ::sigaction(kTerminationSignals[i], &previous_[i], nullptr);
  g_signals_installed.store(false);
}

bool TerminationSignals::requested() const noexcept {
  return g_signal_received != 0;
}

int TerminationSignals::signal() const noexcept {
  return g_signal_received;
}

}  // namespace kvport::cli
