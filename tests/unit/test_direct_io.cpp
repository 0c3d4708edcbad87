// Offload's disk tier, its I/O layer (src/os/direct_io.hpp): real O_DIRECT files on this machine's disk, read back
// byte for byte through the thread pool; what cannot be written fails before anything is swapped, naming the path.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <fcntl.h>
#include <unistd.h>

#include "os/direct_io.hpp"
#include "xlr8/error.hpp"

namespace {

namespace fs = std::filesystem;
using xlr8::os::AlignedBuffer;
using xlr8::os::DirectIo;
using xlr8::os::SwapFile;

// A scratch directory on the disk (not /tmp, which may be tmpfs), removed afterwards.
struct DiskDir {
  fs::path path = fs::current_path() / ("direct_io_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
  DiskDir() { fs::create_directories(path); }
  // Whether its file system takes O_DIRECT (tmpfs before Linux 6.6 does not).
  bool direct_io() const {
    const int fd = ::open((path / "probe").c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
    if (fd >= 0) ::close(fd);
    return fd >= 0;
  }
  ~DiskDir() { fs::remove_all(path); }
};

void fill_random(AlignedBuffer& b, unsigned seed) {
  std::mt19937 gen(seed);
  auto* bytes = static_cast<unsigned char*>(b.data());
  for (int64_t i = 0; i < b.size(); ++i) bytes[i] = static_cast<unsigned char>(gen());
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const xlr8::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// 3.5 MiB in 1 MiB blocks (a partial last one) over four threads, two files, written then read back into other
// buffers: every byte equal, the byte counts exact, the files gone with their owners.
TEST(DirectIo, WhatIsWrittenReadsBackByteForByteAndTheFilesAreRemoved) {
  DiskDir dir;
  if (!dir.direct_io()) GTEST_SKIP() << dir.path << " is on a file system without O_DIRECT";
  const int64_t bytes = 3 * (1 << 20) + (1 << 19);
  fs::path first_path;
  {
    DirectIo io({.block_size = 1 << 20, .intra_op_parallelism = 4});
    SwapFile a(dir.path / "a.swp", bytes), b(dir.path / "b.swp", 2 * bytes);
    first_path = a.path();
    EXPECT_EQ(fs::file_size(a.path()), static_cast<uintmax_t>(bytes));  // reserved at creation
    AlignedBuffer out1(bytes), out2(bytes), in1(bytes), in2(bytes);
    fill_random(out1, 1);
    fill_random(out2, 2);
    auto w1 = io.write(a, 0, out1, bytes);
    auto w2 = io.write(b, bytes, out2, bytes);  // the second half of the larger file
    w1.wait();
    w2.wait();
    EXPECT_TRUE(w1.done());
    auto r2 = io.read(b, bytes, in2, bytes);
    auto r1 = io.read(a, 0, in1, bytes);
    r1.wait();
    r2.wait();
    EXPECT_EQ(std::memcmp(out1.data(), in1.data(), static_cast<size_t>(bytes)), 0);
    EXPECT_EQ(std::memcmp(out2.data(), in2.data(), static_cast<size_t>(bytes)), 0);
    EXPECT_EQ(io.bytes_written(), 2 * bytes);
    EXPECT_EQ(io.bytes_read(), 2 * bytes);
  }
  EXPECT_FALSE(fs::exists(first_path));
}

TEST(DirectIo, AMisalignedOrOutOfRangeTransferIsRefusedNamingIt) {
  DiskDir dir;
  if (!dir.direct_io()) GTEST_SKIP() << dir.path << " is on a file system without O_DIRECT";
  DirectIo io;
  SwapFile file(dir.path / "x.swp", 1 << 16);
  AlignedBuffer buffer(1 << 16);
  EXPECT_NE(error_of([&] { io.write(file, 100, buffer, 4096); }).find("are not aligned to 4096"), std::string::npos);
  EXPECT_NE(error_of([&] { io.read(file, 1 << 16, buffer, 4096); }).find("or lie outside"), std::string::npos);
  EXPECT_NE(error_of([&] { io.write(file, 0, buffer, 1 << 17); }).find("from a buffer of 65536"), std::string::npos);
  EXPECT_NE(error_of([] { DirectIo bad({.block_size = 1000}); }).find("aio.block_size 1000"), std::string::npos);
}

// A path that cannot hold a file, and a disk without room for the reservation (a file-size limit makes the
// allocation fail as a full disk does): one error each, before any transfer, naming the path and what to do.
TEST(DirectIo, AnUnwritablePathOrADiskWithoutRoomFailsAtCreationNamingThePath) {
  DiskDir dir;
  if (!dir.direct_io()) GTEST_SKIP() << dir.path << " is on a file system without O_DIRECT";
  const auto not_a_dir = dir.path / "file";
  { std::ofstream(not_a_dir) << "x"; }
  const auto unwritable = error_of([&] { SwapFile f(not_a_dir / "a.swp", 4096); });
  EXPECT_NE(unwritable.find("cannot create the swap file " + (not_a_dir / "a.swp").string()), std::string::npos)
      << unwritable;
  EXPECT_NE(unwritable.find("give a writable nvme_path"), std::string::npos) << unwritable;
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);  // the limit reports EFBIG instead of a signal
  rlimit small = saved;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const auto full = error_of([&] { SwapFile f(dir.path / "big.swp", 8 << 20); });
  setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous);
  EXPECT_NE(full.find("cannot reserve 8388608 bytes for the swap file"), std::string::npos) << full;
  EXPECT_NE(full.find("free space under nvme_path"), std::string::npos) << full;
  EXPECT_FALSE(fs::exists(dir.path / "big.swp"));
}

// More threads than the process may start (an address-space limit makes the threads' stacks fail, as a
// thread limit does): one error naming the key, in a child process, since a pool left with joinable threads
// ends its process (std::terminate) instead of throwing.
TEST(DirectIo, ThreadsThatCannotStartAreOneErrorNamingTheKeyNotAnAbort) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    rlimit limit{};
    ::getrlimit(RLIMIT_AS, &limit);
    std::ifstream status("/proc/self/status");
    int64_t vm_kb = 0;
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stoll(line.substr(7));
    limit.rlim_cur = static_cast<rlim_t>(vm_kb + 64 * 1024) * 1024;  // room for a few 8 MiB stacks, not 1000
    ::setrlimit(RLIMIT_AS, &limit);
    const auto message = error_of([] { DirectIo io({.intra_op_parallelism = 1000}); });
    const bool named = message.find("aio.intra_op_parallelism 1000: could not start thread ") != std::string::npos &&
                       message.find("of 1000") != std::string::npos;
    ::_exit(message.empty() ? 3 : named ? 0 : 4);
  }
  int status = 0;
  pid_t ended = 0;
  for (int waited_ms = 0; ended == 0 && waited_ms < 60000; waited_ms += 50) {
    ended = ::waitpid(child, &status, WNOHANG);
    if (ended == 0) ::usleep(50000);
  }
  if (ended == 0) {  // before the fix: the pool's unwinding destroyed the condition its threads waited on
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "the child hung for 60 s";
  }
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended by signal " << WTERMSIG(status);  // or std::terminate
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: no error; 4: the error did not name the key and the thread";
}

// A rank the launcher stops (SIGTERM, after another rank failed) or Ctrl-C (SIGINT) runs no destructor: its swap
// files stayed on disk, the whole state's size, until a later job used the directory. The signal still ends the
// process as it did (killed by the signal), and a file already closed is not touched.
TEST(DirectIo, ASignalThatStopsTheProcessRemovesItsSwapFilesAndStillEndsIt) {
  DiskDir dir;
  if (!dir.direct_io()) GTEST_SKIP() << dir.path << " is on a file system without O_DIRECT";
  for (const int signal_number : {SIGTERM, SIGINT}) {
    struct sigaction inherited {};
    ::sigaction(signal_number, nullptr, &inherited);
    if (inherited.sa_handler == SIG_IGN) continue;  // started in the background: ignored, and so it stays
    const auto held = dir.path / "held.swp", closed = dir.path / "closed.swp";
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      { SwapFile done(closed, 4096); }  // created and removed by its owner before the signal
      std::ofstream(closed) << "a file of the same name, the user's";
      SwapFile file(held, 1 << 20);
      (void)!::write(ready[1], "x", 1);
      ::pause();
      ::_exit(3);
    }
    ::close(ready[1]);  // a child that fails before it is ready ends the read
    char byte = 0;
    const bool child_ready = ::read(ready[0], &byte, 1) == 1;
    ::close(ready[0]);
    EXPECT_TRUE(child_ready && fs::exists(held));
    ::kill(child, signal_number);
    int status = 0;
    pid_t ended = 0;
    for (int waited_ms = 0; ended == 0 && waited_ms < 30000; waited_ms += 20) {
      ended = ::waitpid(child, &status, WNOHANG);
      if (ended == 0) ::usleep(20000);
    }
    if (ended == 0) ::kill(child, SIGKILL), ::waitpid(child, &status, 0);
    ASSERT_NE(ended, 0) << "the child did not end on " << strsignal(signal_number);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == signal_number) << "status " << status;
    EXPECT_FALSE(fs::exists(held)) << strsignal(signal_number);
    EXPECT_TRUE(fs::exists(closed)) << "a removed owner's slot must not remove a later file of that name";
    fs::remove(closed);
    fs::remove(held);  // if the test failed: the next signal's child creates it anew (O_EXCL)
  }
}
