// SPDX-License-Identifier: Apache-2.0
// Worker processes of a command (Linux only): each child's stdin and stdout
// are connected to the parent for a line-based protocol, and no child is left
// running behind the group, whatever happens to it or to the parent.
//
// How a child is tied to the group:
// - it leads its own process group, so kill(), shutdown() and the destructor
//   signal everything it started that stayed in that group, and the group is
//   killed as soon as its leader is seen to exit;
// - it carries PR_SET_PDEATHSIG = SIGKILL, so it dies with the parent even when
//   the parent is SIGKILLed and runs no destructor. Limitation: that reaches
//   the direct child only, not what it started (use TerminationSignals so that
//   SIGINT/SIGTERM/SIGHUP end in the destructor instead), and Linux ties it to
//   the *thread* that spawned, so spawn from a thread that outlives the group.
//
// SIGPIPE: a child's stdin is one end of an AF_UNIX socketpair, not a pipe, so
// send_line writes with send(MSG_NOSIGNAL) and a dead reader is an EPIPE
// return, never a signal; the process-wide SIGPIPE disposition is not touched.
// The child's stdout is a pipe.
//
// Not thread-safe: one thread owns a ProcessGroup.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <csignal>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvport::cli {

/// What poll() saw of one child.
struct ProcessEvent {
  enum class Kind {
    line,    ///< one line of the child's stdout in `text`, without the '\n'
    exited,  ///< the child exited and was reaped; reported once, after its lines
    error,   ///< a line longer than ProcessGroup::kMaxLineBytes; it is dropped
  };

  int child = -1;  ///< index returned by ProcessGroup::spawn
  Kind kind = Kind::line;
  std::string text;  ///< the line (Kind::line) or what went wrong (Kind::error)
  /// Kind::exited: the exit status, or -1 when killed by a signal. Both -1
  /// and 0 when the status was lost: someone else reaped the child (SIGCHLD
  /// ignored, a waitpid(-1) elsewhere).
  int exit_code = -1;
  int signal = 0;  ///< Kind::exited: the terminating signal, or 0 on a normal exit
  /// Kind::exited from shutdown(): it was still running after the grace
  /// period and shutdown() SIGKILLed it (then signal is SIGKILL).
  bool force_killed = false;
};

class ProcessGroup {
 public:
  /// The longest line a child may write; a longer one (no '\n' within this
  /// many bytes) becomes one Kind::error event and is skipped up to its '\n',
  /// so a misbehaving child cannot make the parent buffer without bound.
  static constexpr std::size_t kMaxLineBytes = std::size_t{1} << 20;

  ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /// SIGKILLs every child still running (with its process group) and reaps it.
  /// Never throws, never leaves a zombie. Blocks only as long as the kernel
  /// takes to deliver SIGKILL.
  ~ProcessGroup();

  /// Starts `argv[0]` (a path, not searched in PATH; "/proc/self/exe" runs
  /// this program again) with arguments `argv` via fork + execv. The child
  /// gets the parent's stderr, its stdin/stdout connected to this group and
  /// no other file descriptor. An exec failure is the child's exit code 127,
  /// reported by poll(). Returns the child's index (0, 1, ... in spawn order).
  /// Throws kvport::InvalidArgument for an empty argv, kvport::Error naming
  /// the call and errno's text when socketpair/pipe/fork fails.
  int spawn(std::string name, std::vector<std::string> argv);

  /// Writes `line` and a '\n' to the child's stdin, all of it (partial writes
  /// and EINTR are retried). Returns false when the child can no longer read
  /// it: it exited (even if something it started still holds its stdin),
  /// closed its stdin, or shutdown() closed it. Blocks while the child is
  /// alive and not reading (its socket buffer is full); meanwhile the output
  /// of every child is read into the buffer poll() returns next, so a child
  /// blocked writing its stdout cannot deadlock the parent. Throws
  /// kvport::InvalidArgument for a bad index, kvport::Error on an unexpected
  /// write error.
  bool send_line(int child, std::string_view line);

  /// As send_line(child, line), but gives up when the child has not made
  /// room for the whole line within `timeout` (it is alive but not reading:
  /// hung or stopped). Then the child's stdin is closed, since part of the
  /// line may have been written, writable() is false from then on, and
  /// false is returned.
  bool send_line(int child, std::string_view line, std::chrono::milliseconds timeout);

  /// False once a send_line to the child timed out, failed, or its stdin was
  /// closed; true before.
  bool writable(int child) const;

  /// Waits up to `timeout` (poll(2); at most a day, negative is 0) for output
  /// or exits and returns what came, in order per child: lines, then at most
  /// one Kind::exited, which is reported once, after the lines the child
  /// wrote (a last line without '\n' is reported as a line). A child is
  /// reaped as soon as it exits, even when something it started still holds
  /// its stdout (that process group is SIGKILLed then). Returns as soon as
  /// there is at least one event; returns early (possibly empty) when a
  /// signal interrupts the wait, so that the caller can check
  /// TerminationSignals::requested(); returns at once, empty, when no child
  /// is left to wait for.
  std::vector<ProcessEvent> poll(std::chrono::milliseconds timeout);

  /// True while the child has not exited: false once it has exited (even if
  /// poll() has not reported it yet) or was reaped. Costs one waitid(2).
  bool alive(int child) const;

  /// The child's process id (also its process-group id). Once the child is
  /// reaped the id may belong to another process: do not signal it.
  pid_t pid(int child) const;

  /// The name given to spawn().
  const std::string& name(int child) const;

  /// How many children were spawned, running or not; indexes are 0..size()-1.
  std::size_t size() const noexcept { return children_.size(); }

  /// Sends `signal` to the child's process group (the child and what it
  /// started). Nothing happens once the child is reaped. poll() reports the
  /// exit it causes (SIGKILL: exit_code -1, signal 9).
  void kill(int child, int signal = SIGKILL);

  /// Closes every child's stdin (the protocol's "quit"), waits up to `grace`
  /// for the children to exit on their own, then SIGKILLs the rest and reaps
  /// everything. Output is discarded; returns one Kind::exited event for
  /// each child reaped now (not those poll() already reported), the ones it
  /// had to SIGKILL marked force_killed. Afterwards alive() is false for
  /// every child; spawn() may be called again.
  std::vector<ProcessEvent> shutdown(std::chrono::milliseconds grace);

 private:
  struct Child {
    std::string name;
    pid_t pid = -1;
    int stdin_fd = -1;        // our end of the stdin socketpair
    int stdout_fd = -1;       // read end of the stdout pipe, non-blocking
    int pid_fd = -1;          // pidfd_open(pid): readable when it exits; -1 if unsupported
    std::string partial;      // stdout bytes after the last '\n'
    bool discarding = false;  // inside an over-long line, skipping to its '\n'
    bool reaped = false;
  };

  Child& at(int child);
  const Child& at(int child) const;
  // Reads what the child's stdout holds now; closes it at EOF.
  void drain(int index, std::vector<ProcessEvent>& out);
  // Reaps the child if it has exited (draining its output first) and reports it.
  void reap_if_exited(int index, std::vector<ProcessEvent>& out);
  // One round: waits up to `wait` for anything, then reads and reaps.
  // Returns false when the wait was interrupted by a signal.
  bool collect(std::chrono::milliseconds wait, std::vector<ProcessEvent>& out);
  // SIGKILLs the group of an unreaped child and reaps it (blocking); returns
  // the wait status, -1 when it was reaped already or elsewhere; noexcept.
  int force_reap(Child& c) noexcept;
  bool send(Child& c, std::string_view line, std::optional<std::chrono::milliseconds> timeout);

  std::vector<Child> children_;
  std::vector<ProcessEvent> pending_;  // read by send_line, returned by poll()
};

/// While alive, SIGINT, SIGTERM and SIGHUP set a flag instead of killing the
/// process, so that a command can stop its loop and clean up its children
/// (poll() returns early when one arrives). The previous handlers are restored
/// on destruction. One may exist at a time (kvport::Error otherwise).
class TerminationSignals {
 public:
  TerminationSignals();
  TerminationSignals(const TerminationSignals&) = delete;
  TerminationSignals& operator=(const TerminationSignals&) = delete;
  ~TerminationSignals();

  /// True once one of the signals arrived while this object was alive.
  bool requested() const noexcept;

  /// The last signal that arrived, or 0.
  int signal() const noexcept;

 private:
  struct sigaction previous_[3];
};

}  // namespace kvport::cli
