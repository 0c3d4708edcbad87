// Shared segments and the shared-memory barrier (see shm_segment.hpp).
#include "os/shm_segment.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <new>
#include <thread>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "xlr8/error.hpp"
#include "xlr8/env.hpp"

namespace xlr8::os {

namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string link_target(const std::string& path) {
  char buffer[256];
  ssize_t n = ::readlink(path.c_str(), buffer, sizeof buffer - 1);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
}

std::string errno_text(int code = errno) { return std::strerror(code); }

constexpr const char* kShmHint =
    "is /dev/shm full or too small (Docker: --shm-size)? Set XLR8_SHM=0 to use Gloo between local ranks";

// True once `pid` has exited (gone, or a zombie its parent has not reaped yet).
bool process_exited(int pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) == -1 && errno == ESRCH) return true;
  std::string stat = read_first_line(fmt::format("/proc/{}/stat", pid));
  if (stat.empty()) return false;  // no /proc: rely on kill() alone
  auto paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  char state = stat[paren + 2];
  return state == 'Z' || state == 'X';
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Sleeps until *word != seen, a wake-up, or `limit` passes (a shared, not process-private, futex).
void wait_on(std::atomic<std::uint32_t>& word, std::uint32_t seen, std::chrono::microseconds limit) {
#ifdef __linux__
  timespec ts{static_cast<time_t>(limit.count() / 1000000), static_cast<long>(limit.count() % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
#else
  (void)seen;
  std::this_thread::sleep_for(std::min(limit, std::chrono::microseconds(50)));
#endif
}

void wake_all(std::atomic<std::uint32_t>& word) {
#ifdef __linux__
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// The arrival counter wraps; `value` has reached `target` when it is at most 2^31 past it.
bool reached(std::uint32_t value, std::uint32_t target) { return static_cast<std::int32_t>(value - target) >= 0; }

void copy_text(char* dst, std::size_t capacity, const std::string& text) {
  std::size_t n = std::min(capacity - 1, text.size());
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

}  // namespace

// ---------------------------------------------------------------------------------------------- naming

std::string shared_memory_host_key() {
  std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  std::string mnt = link_target("/proc/self/ns/mnt"), pid = link_target("/proc/self/ns/pid");
  if (boot.empty() || mnt.empty() || pid.empty()) return "";
  return boot + "|" + mnt + "|" + pid;
}

std::string shared_memory_job() {
  return env_var("XLR8_SHM_JOB").value_or("0");
}

std::string new_segment_name() {
  static std::atomic<unsigned> counter{0};
  return fmt::format("/xlr8.{}.{}.{}", shared_memory_job(), ::getpid(), counter++);
}

int remove_job_segments(const std::string& job) {
  const std::string prefix = "xlr8." + job + ".";
  DIR* dir = ::opendir("/dev/shm");
  if (!dir) return 0;
  std::vector<std::string> names;
  while (dirent* entry = ::readdir(dir))
    if (std::strncmp(entry->d_name, prefix.c_str(), prefix.size()) == 0) names.emplace_back(entry->d_name);
  ::closedir(dir);
  int removed = 0;
  for (auto& name : names) removed += ::shm_unlink(("/" + name).c_str()) == 0;
  return removed;
}

// ---------------------------------------------------------------------------------------------- SharedSegment

std::shared_ptr<SharedSegment> SharedSegment::create(const std::string& name, std::size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw Error(fmt::format("cannot create shared memory {}: {}; {}", name, errno_text(), kShmHint));
  auto fail = [&](const std::string& step, int code) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw Error(fmt::format("cannot {} shared memory {} ({} bytes): {}; {}", step, name, bytes, errno_text(code),
                            kShmHint));
  };
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) fail("size", errno);
  if (int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); rc != 0 && rc != EOPNOTSUPP && rc != EINVAL)
    fail("reserve", rc);
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) fail("map", errno);
  ::close(fd);
  return std::shared_ptr<SharedSegment>(new SharedSegment(name, static_cast<std::byte*>(data), bytes, true));
}

std::shared_ptr<SharedSegment> SharedSegment::open(const std::string& name, std::size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw Error(fmt::format("cannot open shared memory {}: {}", name, errno_text()));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < bytes) {
    ::close(fd);
    throw Error(fmt::format("shared memory {} has {} bytes, expected {}", name, st.st_size, bytes));
  }
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int code = errno;
  ::close(fd);
  if (data == MAP_FAILED) throw Error(fmt::format("cannot map shared memory {}: {}", name, errno_text(code)));
  return std::shared_ptr<SharedSegment>(new SharedSegment(name, static_cast<std::byte*>(data), bytes, false));
}

SharedSegment::~SharedSegment() {
  ::munmap(data_, size_);
  unlink();
}

void SharedSegment::unlink() {
  if (linked_) ::shm_unlink(name_.c_str());
  linked_ = false;
}

// ---------------------------------------------------------------------------------------------- ShmControl

struct ShmControl::Header {
  static constexpr std::uint32_t kMagic = 0x786c7238;  // "xlr8"
  std::uint32_t magic;
  std::int32_t size;
  alignas(64) std::atomic<std::uint32_t> arrived;  // arrivals over all barriers, all ranks (the futex word)
  alignas(64) std::atomic<std::int32_t> failed_rank;  // -1, or the first rank that abandoned the group
};

struct ShmControl::RankSlot {
  alignas(64) std::atomic<std::uint64_t> arrivals;  // barriers this rank has reached
  std::atomic<std::int32_t> pid;
  OpDescriptor op;
  char what[192];      // description of `op`, for mismatch errors
  char failure[320];   // why this rank failed the group
};

static_assert(std::atomic<std::uint32_t>::is_always_lock_free && std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free to work across processes");

std::size_t ShmControl::bytes(int size) { return sizeof(Header) + static_cast<std::size_t>(size) * sizeof(RankSlot); }

ShmControl::ShmControl(std::byte* base, int rank, int size) : base_(base), rank_(rank), size_(size) {}

ShmControl::Header& ShmControl::header() const { return *std::launder(reinterpret_cast<Header*>(base_)); }
ShmControl::RankSlot& ShmControl::slot(int r) const {
  return std::launder(reinterpret_cast<RankSlot*>(base_ + sizeof(Header)))[r];
}

void ShmControl::initialise() {
  auto* h = new (base_) Header{};
  h->magic = Header::kMagic;
  h->size = size_;
  h->arrived.store(0);
  h->failed_rank.store(-1);
  for (int r = 0; r < size_; ++r) new (&slot(r)) RankSlot{};
}

void ShmControl::register_self() {
  if (header().magic != Header::kMagic || header().size != size_)
    throw Error(fmt::format("shared memory control block is not initialised for {} ranks", size_));
  slot(rank_).pid.store(static_cast<std::int32_t>(::getpid()));
}

void ShmControl::enter(const OpDescriptor& op, const std::string& what, std::chrono::milliseconds timeout) {
  auto& mine = slot(rank_);
  mine.op = op;
  copy_text(mine.what, sizeof mine.what, what);
  barrier(what, timeout);  // its release/acquire makes every rank's descriptor visible
  for (int r = 0; r < size_; ++r) {
    if (slot(r).op == op) continue;
    std::string reason =
        fmt::format("{}: rank {} called {} at the same point; every rank must issue the same collectives in the "
                    "same order with the same sizes and dtypes",
                    what, r, slot(r).what);
    fail(reason);
    throw Error(reason);
  }
}

void ShmControl::barrier(const std::string& what, std::chrono::milliseconds timeout) {
  using clock = std::chrono::steady_clock;
  auto& h = header();
  auto& mine = slot(rank_);
  const std::uint64_t generation = mine.arrivals.load(std::memory_order_relaxed) + 1;
  mine.arrivals.store(generation, std::memory_order_release);
  const auto target = static_cast<std::uint32_t>(generation * static_cast<std::uint64_t>(size_));
  if (h.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
    wake_all(h.arrived);
    return;
  }
  // Spin briefly (peers usually arrive within microseconds), then sleep on the futex so the
  // waiting thread does not take the core from the rank's compute.
  for (int i = 0; i < 2000; ++i) {
    if (reached(h.arrived.load(std::memory_order_acquire), target)) return;
    cpu_relax();
  }
  const auto start = clock::now();
  auto next_check = start + std::chrono::milliseconds(100);
  for (;;) {
    std::uint32_t seen = h.arrived.load(std::memory_order_acquire);
    if (reached(seen, target)) return;
    check_not_failed(what);
    auto now = clock::now();
    if (now >= next_check) {
      check_laggards_alive(generation, what);
      next_check = now + std::chrono::milliseconds(100);
    }
    if (now - start >= timeout) {
      std::string missing;
      for (int r = 0; r < size_; ++r)
        if (slot(r).arrivals.load() < generation)
          missing += fmt::format("{}rank {} (pid {})", missing.empty() ? "" : ", ", r, slot(r).pid.load());
      throw TimeoutError(fmt::format(
          "{} timed out after {} s in shared memory: {} did not reach it (still computing, stuck, or waiting in a "
          "different collective); set XLR8_COLLECTIVE_TIMEOUT to wait longer",
          what, timeout.count() / 1000.0, missing));
    }
    wait_on(h.arrived, seen, std::chrono::microseconds(20000));
  }
}

void ShmControl::check_laggards_alive(std::uint64_t generation, const std::string& what) const {
  for (int r = 0; r < size_; ++r) {
    if (slot(r).arrivals.load() >= generation) continue;
    int pid = slot(r).pid.load();
    if (!process_exited(pid)) continue;
    std::string reason =
        fmt::format("{}: rank {} (pid {}) exited while rank {} waited for it in this collective; its own log says why",
                    what, r, pid, rank_);
    fail(reason);
    throw Error(reason);
  }
}

void ShmControl::fail(const std::string& reason) const noexcept {
  copy_text(slot(rank_).failure, sizeof slot(rank_).failure, reason);
  std::int32_t none = -1;
  header().failed_rank.compare_exchange_strong(none, rank_);
  // Sleepers wake and see the flag (one that goes to sleep just after sees it within one 20 ms slice).
  wake_all(header().arrived);
}

void ShmControl::check_not_failed(const std::string& what) const {
  int failed = header().failed_rank.load(std::memory_order_acquire);
  if (failed >= 0) throw_failed(what, failed);
}

void ShmControl::throw_failed(const std::string& what, int failed) const {
  if (failed == rank_) throw Error(fmt::format("{}: this group failed earlier: {}", what, slot(failed).failure));
  throw Error(fmt::format("{}: rank {} abandoned the group: {}", what, failed, slot(failed).failure));
}

}  // namespace xlr8::os
