// SPDX-License-Identifier: Apache-2.0
// ProcessGroup: worker processes on a line protocol, and none left behind.
// Children are /bin/sh scripts, /bin/cat and /bin/sleep; every test is bounded
// by a few seconds, and the group's destructor (RAII) kills what an early
// assertion failure leaves running.
#include "process_group.hpp"

#include <gtest/gtest.h>
#include <poll.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "kvport/platform/error.hpp"

namespace kvport::cli {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Kind = ProcessEvent::Kind;
using std::chrono::duration_cast;
using std::chrono::milliseconds;

std::vector<std::string> sh(std::string script) {
  return {"/bin/sh", "-c", std::move(script)};
}

/// Everything poll() reported for one child, up to its exit.
struct Outcome {
  std::vector<std::string> lines;
  std::vector<std::string> errors;
  bool exited = false;
  int exit_code = -1;
  int signal = 0;
};

/// Outcomes of `children`, polled until all of them exit (bounded).
std::map<int, Outcome> until_all_exit(ProcessGroup& group, const std::vector<int>& children,
                                      milliseconds limit = 4000ms) {
  std::map<int, Outcome> outcomes;
  for (int c : children)
    outcomes[c];
  const auto all_exited = [&] {
    return std::all_of(outcomes.begin(), outcomes.end(),
                       [](const auto& entry) { return entry.second.exited; });
  };
  const auto deadline = Clock::now() + limit;
  while (!all_exited() && Clock::now() < deadline) {
    for (ProcessEvent& e : group.poll(duration_cast<milliseconds>(deadline - Clock::now()))) {
      const auto it = outcomes.find(e.child);
      if (it == outcomes.end()) continue;
      Outcome& o = it->second;
      EXPECT_FALSE(o.exited) << "an event after the exit: " << e.text;
      if (e.kind == Kind::line) o.lines.push_back(std::move(e.text));
      if (e.kind == Kind::error) o.errors.push_back(std::move(e.text));
      if (e.kind == Kind::exited) {
        o.exited = true;
        o.exit_code = e.exit_code;
        o.signal = e.signal;
      }
    }
  }
  for (const auto& [child, o] : outcomes)
    EXPECT_TRUE(o.exited) << "child " << child << " did not exit within " << limit.count() << " ms";
  return outcomes;
}

Outcome until_exit(ProcessGroup& group, int child, milliseconds limit = 4000ms) {
  return until_all_exit(group, {child}, limit)[child];
}

/// The next `count` lines of `child` (bounded wait).
std::vector<std::string> next_lines(ProcessGroup& group, int child, std::size_t count) {
  std::vector<std::string> lines;
  const auto deadline = Clock::now() + 4s;
  while (lines.size() < count && Clock::now() < deadline)
    for (ProcessEvent& e : group.poll(duration_cast<milliseconds>(deadline - Clock::now())))
      if (e.child == child && e.kind == Kind::line) lines.push_back(std::move(e.text));
  return lines;
}

/// No such process, or a zombie (dead, waiting for a reaper that is not us).
bool gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

bool eventually_gone(pid_t pid, milliseconds limit = 3000ms) {
  const auto deadline = Clock::now() + limit;
  while (!gone(pid)) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

/// Kills a grandchild the group should have killed, so that a failing test
/// leaves nothing behind either.
struct KillOnExit {
  pid_t pid = -1;
  ~KillOnExit() {
    if (pid > 0 && !gone(pid)) ::kill(pid, SIGKILL);
  }
};

TEST(ProcessGroup, LinesComeBackInOrderThenOneExit) {
  ProcessGroup group;
  const int c = group.spawn("echo", sh("echo one; echo two; echo three"));
  EXPECT_EQ(c, 0);
  EXPECT_EQ(group.size(), 1u);
  EXPECT_EQ(group.name(c), "echo");
  EXPECT_GT(group.pid(c), 0);
  const Outcome o = until_exit(group, c);
  EXPECT_EQ(o.lines, (std::vector<std::string>{"one", "two", "three"}));
  EXPECT_EQ(o.exit_code, 0);
  EXPECT_EQ(o.signal, 0);
  EXPECT_FALSE(group.alive(c));
  EXPECT_TRUE(group.poll(50ms).empty()) << "the exit is reported once";
}

TEST(ProcessGroup, PartialWritesAreJoinedIntoLines) {
  ProcessGroup group;
  const int c = group.spawn(
      "partial", sh("printf hel; sleep 0.1; printf 'lo\\nwor'; sleep 0.1; printf 'ld\\n'; "
                    "printf tail"));
  const Outcome o = until_exit(group, c);
  EXPECT_EQ(o.lines, (std::vector<std::string>{"hello", "world", "tail"}));
  EXPECT_EQ(o.exit_code, 0);
}

TEST(ProcessGroup, SendLineReachesAChildThatEchoesStdin) {
  ProcessGroup group;
  const int c = group.spawn("cat", {"/bin/cat"});
  EXPECT_TRUE(group.send_line(c, "alpha"));
  EXPECT_TRUE(group.send_line(c, "beta gamma"));
  EXPECT_TRUE(group.send_line(c, ""));
  EXPECT_EQ(next_lines(group, c, 3), (std::vector<std::string>{"alpha", "beta gamma", ""}));
  EXPECT_TRUE(group.alive(c));
}

TEST(ProcessGroup, LargeWritesDoNotDeadlockWithAChildBlockedOnOutput) {
  // cat writes back everything: more than the socket and pipe buffers hold,
  // so send_line must read cat's output while it waits for room.
  ProcessGroup group;
  const int c = group.spawn("cat", {"/bin/cat"});
  const std::string line(4000, 'x');
  for (int i = 0; i < 500; ++i)
    ASSERT_TRUE(group.send_line(c, line));
  const auto lines = next_lines(group, c, 500);
  ASSERT_EQ(lines.size(), 500u);
  EXPECT_EQ(lines.back(), line);
}

TEST(ProcessGroup, ExitCodesAndSignalsAreReported) {
  ProcessGroup group;
  const int three = group.spawn("three", sh("exit 3"));
  const int term = group.spawn("term", sh("kill -TERM $$"));
  auto outcomes = until_all_exit(group, {three, term});
  const Outcome& a = outcomes[three];
  EXPECT_EQ(a.exit_code, 3);
  EXPECT_EQ(a.signal, 0);
  const Outcome& b = outcomes[term];
  EXPECT_EQ(b.exit_code, -1);
  EXPECT_EQ(b.signal, SIGTERM);
}

TEST(ProcessGroup, ExecFailureIsExitCode127) {
  ProcessGroup group;
  const int c = group.spawn("missing", {"/nonexistent/kvport-no-such-program"});
  EXPECT_EQ(until_exit(group, c).exit_code, 127);
}

TEST(ProcessGroup, SpawnsItselfThroughProcSelfExe) {
  ProcessGroup group;
  const int c = group.spawn("self", {"/proc/self/exe", "--gtest_list_tests",
                                     "--gtest_filter=ProcessGroup.SpawnsItselfThroughProcSelfExe"});
  const Outcome o = until_exit(group, c);
  EXPECT_EQ(o.exit_code, 0);
  EXPECT_NE(std::find(o.lines.begin(), o.lines.end(), "ProcessGroup."), o.lines.end());
}

TEST(ProcessGroup, KillIsReportedAsSignal9) {
  ProcessGroup group;
  const int c = group.spawn("sleep", {"/bin/sleep", "30"});
  EXPECT_TRUE(group.alive(c));
  group.kill(c);
  const Outcome o = until_exit(group, c);
  EXPECT_EQ(o.signal, SIGKILL);
  EXPECT_EQ(o.exit_code, -1);
  EXPECT_FALSE(group.alive(c));
  group.kill(c);  // reaped: a no-op, not a signal to a reused pid
}

TEST(ProcessGroup, SendLineToADeadChildReturnsFalseAndTheParentSurvives) {
  ProcessGroup group;
  const int c = group.spawn("sleep", {"/bin/sleep", "30"});
  group.kill(c);
  const auto deadline = Clock::now() + 3s;
  while (group.alive(c) && Clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  ASSERT_FALSE(group.alive(c));
  // Dead but not yet reaped: the write hits a closed reader (EPIPE; a pipe
  // would have raised SIGPIPE and killed this test).
  EXPECT_FALSE(group.send_line(c, std::string(1 << 20, 'x')));
  EXPECT_EQ(until_exit(group, c).signal, SIGKILL);
  EXPECT_FALSE(group.send_line(c, "after the exit"));

  const int done = group.spawn("done", sh("exit 0"));
  EXPECT_EQ(until_exit(group, done).exit_code, 0);
  EXPECT_FALSE(group.send_line(done, "hello"));
}

TEST(ProcessGroup, SendLineGivesUpWhenTheChildExitsAndAGrandchildHoldsItsStdin) {
  ProcessGroup group;
  const int c = group.spawn("parent", sh("exec 3<&0; sleep 30 <&3 & exit 0"));
  const pid_t leader = group.pid(c);
  // A watchdog bounds the test if send_line waits on the grandchild forever.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 400 && !done.load(); ++i)
      std::this_thread::sleep_for(10ms);
    if (!done.load()) ::kill(-leader, SIGKILL);
  });
  const auto start = Clock::now();
  const bool sent = group.send_line(c, std::string(4 << 20, 'x'));  // more than the buffer
  const auto took = Clock::now() - start;
  done.store(true);
  watchdog.join();
  EXPECT_FALSE(sent);
  EXPECT_LT(took, 2s) << "waited on the grandchild, not the child";
  EXPECT_EQ(until_exit(group, c).exit_code, 0);
}

TEST(ProcessGroup, ExitIsReportedWhileAGrandchildHoldsStdout) {
  ProcessGroup group;
  const auto start = Clock::now();
  const int c = group.spawn("parent", sh("sleep 30 & echo $!; exit 4"));
  const Outcome o = until_exit(group, c);
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_EQ(o.exit_code, 4);
  ASSERT_EQ(o.lines.size(), 1u);
  KillOnExit grandchild{std::stoi(o.lines[0])};
  EXPECT_TRUE(eventually_gone(grandchild.pid)) << "its process group dies with it";
}

TEST(ProcessGroup, AnOverlongLineIsAnErrorEventNotUnboundedMemory) {
  ProcessGroup group;
  const int c = group.spawn("long", sh("echo before; head -c 1500000 /dev/zero | tr '\\0' x; "
                                       "echo; echo after"));
  const Outcome o = until_exit(group, c);
  EXPECT_EQ(o.lines, (std::vector<std::string>{"before", "after"}));
  EXPECT_EQ(o.errors.size(), 1u);
  EXPECT_EQ(o.exit_code, 0);
}

TEST(ProcessGroup, ShutdownLetsChildrenExitOnStdinEof) {
  ProcessGroup group;
  const int a = group.spawn("cat-a", {"/bin/cat"});
  const int b = group.spawn("cat-b", {"/bin/cat"});
  const auto start = Clock::now();
  group.shutdown(3000ms);
  EXPECT_LT(Clock::now() - start, 1500ms) << "cat exits at EOF: no need to wait the grace";
  EXPECT_FALSE(group.alive(a));
  EXPECT_FALSE(group.alive(b));
  EXPECT_TRUE(gone(group.pid(a)));
  EXPECT_TRUE(gone(group.pid(b)));
  EXPECT_TRUE(group.poll(10ms).empty()) << "shutdown reports nothing";
}

TEST(ProcessGroup, ShutdownKillsChildrenThatIgnoreEofAfterTheGrace) {
  ProcessGroup group;
  const int sleeper = group.spawn("sleep", {"/bin/sleep", "30"});
  const int shell = group.spawn("shell", sh("sleep 30 & echo $!; wait"));
  const auto lines = next_lines(group, shell, 1);
  ASSERT_EQ(lines.size(), 1u);
  KillOnExit grandchild{std::stoi(lines[0])};
  const auto start = Clock::now();
  group.shutdown(300ms);
  const auto took = Clock::now() - start;
  EXPECT_GE(took, 250ms) << "the grace is given";
  EXPECT_LT(took, 1300ms) << "and not much more";
  EXPECT_FALSE(group.alive(sleeper));
  EXPECT_FALSE(group.alive(shell));
  errno = 0;
  EXPECT_EQ(::kill(group.pid(sleeper), 0), -1);
  EXPECT_EQ(errno, ESRCH) << "reaped, not a zombie";
  EXPECT_TRUE(gone(group.pid(shell)));
  EXPECT_TRUE(eventually_gone(grandchild.pid)) << "the shell's own child is killed too";
}

TEST(ProcessGroup, DestructorLeavesNoProcess) {
  std::vector<pid_t> pids;
  KillOnExit grandchild;
  {
    ProcessGroup group;
    pids.push_back(group.pid(group.spawn("sleep", {"/bin/sleep", "30"})));
    pids.push_back(group.pid(group.spawn("cat", {"/bin/cat"})));
    const int shell = group.spawn("shell", sh("sleep 30 & echo $!; wait"));
    pids.push_back(group.pid(shell));
    const auto lines = next_lines(group, shell, 1);
    ASSERT_EQ(lines.size(), 1u);
    grandchild.pid = std::stoi(lines[0]);
  }
  for (pid_t pid : pids) {
    errno = 0;
    EXPECT_EQ(::kill(pid, 0), -1) << pid;
    EXPECT_EQ(errno, ESRCH) << pid << " is still there (a zombie?)";
  }
  EXPECT_TRUE(eventually_gone(grandchild.pid));
}

// The parent is SIGKILLed (no destructor runs): PR_SET_PDEATHSIG must kill
// the child. A forked "middle" process owns the group and kills itself; this
// test is the subreaper, so the orphaned child becomes ours to wait for and
// its termination signal can be read. Without the prctl the sleep lives 30 s
// and the test fails after 3.
TEST(ProcessGroup, ChildDiesWhenTheParentIsKilled) {
  struct Subreaper {
    Subreaper() { ::prctl(PR_SET_CHILD_SUBREAPER, 1); }
    ~Subreaper() { ::prctl(PR_SET_CHILD_SUBREAPER, 0); }
  } subreaper;
  int report[2];
  ASSERT_EQ(::pipe(report), 0);
  const pid_t middle = ::fork();
  ASSERT_GE(middle, 0);
  if (middle == 0) {
    ::close(report[0]);
    ProcessGroup group;
    const pid_t child = group.pid(group.spawn("sleep", {"/bin/sleep", "30"}));
    // Wait for the exec, so that it is the prctl and not the getppid check
    // before the exec that has to kill it.
    pid_t told = -1;
    for (int i = 0; i < 200 && told < 0; ++i) {
      std::ifstream comm("/proc/" + std::to_string(child) + "/comm");
      std::string name;
      std::getline(comm, name);
      if (name == "sleep")
        told = child;
      else
        ::usleep(10000);
    }
    if (::write(report[1], &told, sizeof told) != sizeof told) ::_exit(3);
    ::raise(SIGKILL);
    ::_exit(2);
  }
  ::close(report[1]);
  pid_t child = -1;
  pollfd ready{report[0], POLLIN, 0};
  if (::poll(&ready, 1, 3000) == 1 && ::read(report[0], &child, sizeof child) != sizeof child)
    child = -1;
  ::close(report[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(middle, &status, 0), middle);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  ASSERT_GT(child, 0) << "the middle process did not report its child";

  bool reaped = false;
  status = 0;
  const auto deadline = Clock::now() + 3s;
  while (!reaped && Clock::now() < deadline) {
    reaped = ::waitpid(child, &status, WNOHANG) == child;
    if (!reaped) std::this_thread::sleep_for(10ms);
  }
  if (!reaped) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
  }
  EXPECT_TRUE(reaped) << "the child outlived its killed parent";
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

TEST(ProcessGroup, BadArgumentsThrow) {
  ProcessGroup group;
  EXPECT_THROW(group.spawn("empty", {}), InvalidArgument);
  EXPECT_THROW(group.pid(0), InvalidArgument);
  EXPECT_THROW(group.send_line(-1, "x"), InvalidArgument);
  EXPECT_TRUE(group.poll(1000ms).empty()) << "no child: returns at once";
}

TEST(TerminationSignals, TurnSignalsIntoAFlagAndRestoreTheHandlers) {
  struct sigaction before {};
  ASSERT_EQ(::sigaction(SIGTERM, nullptr, &before), 0);
  {
    TerminationSignals signals;
    EXPECT_THROW(TerminationSignals{}, Error);
    EXPECT_FALSE(signals.requested());
    ::raise(SIGTERM);
    EXPECT_TRUE(signals.requested());
    EXPECT_EQ(signals.signal(), SIGTERM);

    // A signal ends a long poll() early, so the caller can clean up.
    ProcessGroup group;
    group.spawn("sleep", {"/bin/sleep", "30"});
    std::atomic<bool> stop{false};
    const pthread_t self = ::pthread_self();
    std::thread sender([&] {
      while (!stop.load()) {
        std::this_thread::sleep_for(50ms);
        if (!stop.load()) ::pthread_kill(self, SIGHUP);
      }
    });
    const auto start = Clock::now();
    group.poll(3000ms);
    const auto took = Clock::now() - start;
    stop.store(true);
    sender.join();
    EXPECT_LT(took, 1500ms);
    EXPECT_EQ(signals.signal(), SIGHUP);
  }
  struct sigaction after {};
  ASSERT_EQ(::sigaction(SIGTERM, nullptr, &after), 0);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
  TerminationSignals again;  // the slot is free again
  EXPECT_FALSE(again.requested());
}

}  // namespace
}  // namespace kvport::cli

namespace kvport::cli {
namespace {

TEST(ProcessGroup, ShutdownReturnsEachExitAndMarksTheOnesItKilled) {
  ProcessGroup group;
  const int cat = group.spawn("cat", {"/bin/cat"});
  const int sleeper = group.spawn("sleep", {"/bin/sleep", "30"});
  const std::vector<ProcessEvent> exits = group.shutdown(300ms);
  ASSERT_EQ(exits.size(), 2u);
  std::map<int, ProcessEvent> by_child;
  for (const ProcessEvent& e : exits) {
    EXPECT_EQ(e.kind, Kind::exited);
    by_child[e.child] = e;
  }
  EXPECT_EQ(by_child.at(cat).exit_code, 0);
  EXPECT_EQ(by_child.at(cat).signal, 0);
  EXPECT_FALSE(by_child.at(cat).force_killed) << "cat exits at EOF by itself";
  EXPECT_EQ(by_child.at(sleeper).signal, SIGKILL);
  EXPECT_TRUE(by_child.at(sleeper).force_killed);
  EXPECT_TRUE(group.shutdown(0ms).empty()) << "an exit is reported once";
}

TEST(ProcessGroup, ShutdownReportsAChildThatExitedBeforeItUnpolled) {
  ProcessGroup group;
  const int quick = group.spawn("exit7", sh("exit 7"));
  group.spawn("cat", {"/bin/cat"});
  for (int i = 0; i < 400 && group.alive(quick); ++i)
    std::this_thread::sleep_for(10ms);
  ASSERT_FALSE(group.alive(quick));
  const std::vector<ProcessEvent> exits = group.shutdown(3000ms);
  bool seen = false;
  for (const ProcessEvent& e : exits) {
    if (e.child == quick) {
      seen = true;
      EXPECT_EQ(e.exit_code, 7);
    }
  }
  EXPECT_TRUE(seen);
}

// A stopped child (SIGSTOP: the "hung worker") never reads its stdin: a write
// with a timeout gives up, closes the child's stdin and says so, instead of
// blocking the parent for as long as the child stays stopped.
TEST(ProcessGroup, SendLineWithATimeoutGivesUpOnAStoppedChild) {
  ProcessGroup group;
  const int cat = group.spawn("cat", {"/bin/cat"});
  group.kill(cat, SIGSTOP);
  const std::string line(64 * 1024, 'x');
  bool refused = false;
  // The socket buffer holds a few hundred KiB: bounded well below 4096 lines.
  for (int i = 0; i < 4096 && !refused; ++i)
    refused = !group.send_line(cat, line, 100ms);
  EXPECT_TRUE(refused);
  EXPECT_FALSE(group.writable(cat));
  EXPECT_TRUE(group.alive(cat)) << "stopped, not dead";
  EXPECT_FALSE(group.send_line(cat, "more", 100ms));
  group.kill(cat, SIGKILL);
  const Outcome o = until_exit(group, cat);
  EXPECT_EQ(o.signal, SIGKILL);
}

}  // namespace
}  // namespace kvport::cli
