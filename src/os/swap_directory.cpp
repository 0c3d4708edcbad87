// Claiming a swap file in a shared directory, and removing what dead processes left there (swap_directory.hpp).
#include "os/swap_directory.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <chrono>
#include <random>
#include <system_error>
#include <thread>

#include "core/log.hpp"
#include "os/net.hpp"
#include "xlr8/error.hpp"

namespace xlr8::os {

namespace {

bool is_swap_file(const std::filesystem::path& p) {
  const auto name = p.filename().string();
  return name.starts_with("xlr8-") && name.ends_with(".swap");
}

bool made_on_this_host(const std::filesystem::path& p) {
  return p.filename().string().ends_with("@" + host_name() + ".swap");
}

// True when nobody holds `path`'s lock: its maker is gone. The file is removed while this process holds it.
bool remove_if_unlocked(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;  // gone meanwhile, or not ours to read
  const bool stale = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  if (stale) ::unlink(path.c_str());
  ::close(fd);
  return stale;
}

}  // namespace

std::string network_file_system(const std::filesystem::path& dir) {
  struct statfs info {};
  if (::statfs(dir.c_str(), &info) != 0) return "";
  // Linux's magic numbers (statfs(2)); FUSE's may be a network one (sshfs, s3fs, GlusterFS) or not: treated as shared.
  switch (static_cast<uint32_t>(info.f_type)) {
    case 0x6969: return "nfs";
    case 0x517B: return "smb";
    case 0xFF534D42: return "cifs";
    case 0xFE534D42: return "smb2";
    case 0x0BD00BD0: return "lustre";
    case 0x47504653: return "gpfs";
    case 0x19830326: return "beegfs";
    case 0x00C36400: return "ceph";
    case 0x65735546: return "fuse";
    case 0x01021997: return "9p";
    case 0x6A656A63: return "virtiofs";
    default: return "";
  }
}

SwapDirectoryClaim::SwapDirectoryClaim(const std::filesystem::path& dir, double wait_s, std::optional<bool> shared)
    : dir_(dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec)
    throw Error(fmt::format("offload to disk: cannot create the nvme_path directory {} ({}); give a writable directory "
                            "on a local disk",
                            dir_.string(), ec.message()));
  const auto lock_path = dir_ / ".xlr8-swap.lock";
  lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd_ < 0)
    throw Error(fmt::format("offload to disk: cannot create {} ({}); give a writable nvme_path", lock_path.string(),
                            std::system_category().message(errno)));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  while (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {  // held for a directory scan: moments
    if (std::chrono::steady_clock::now() > deadline) {
      ::close(lock_fd_);
      throw Error(fmt::format("offload to disk: {} stayed locked for {} s by another process claiming a swap file "
                              "there; is a process stuck with it open?",
                              lock_path.string(), wait_s));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  try {
    const auto network = network_file_system(dir_);
    static std::atomic<bool> said{false};  // once a process: every rank's every swap claims a file
    if (!shared && !network.empty() && !said.exchange(true))
      log::info("xlr8: the swap directory {} is on a network file system ({}): stale swap files are removed only when "
                "this machine made them (another machine's may look unlocked from here)",
                dir_.string(), network);
    remove_stale_files(shared.value_or(!network.empty()));
    if (!removed_.empty())
      log::info("xlr8: removed {} stale swap file(s) ({} bytes) from {}: runs that ended without removing them",
                removed_.size(), removed_bytes_, dir_.string());
  } catch (...) {  // the destructor will not run: no lock may outlive a failed claim
    ::flock(lock_fd_, LOCK_UN);
    ::close(lock_fd_);
    throw;
  }
}

void SwapDirectoryClaim::remove_stale_files(bool shared) {
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(dir_, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    const auto& entry = *it;
    std::error_code entry_ec;
    if (!entry.is_regular_file(entry_ec) || !is_swap_file(entry.path())) continue;
    if (shared && !made_on_this_host(entry.path())) continue;  // its machine judges it
    const auto bytes = static_cast<int64_t>(entry.file_size(entry_ec));
    if (!remove_if_unlocked(entry.path())) continue;
    removed_.push_back(entry.path());
    removed_bytes_ += entry_ec ? 0 : bytes;
  }
}

SwapDirectoryClaim::~SwapDirectoryClaim() {
  ::flock(lock_fd_, LOCK_UN);
  ::close(lock_fd_);
}

std::filesystem::path SwapDirectoryClaim::new_file(const std::string& stem) const {
  // The pid alone may repeat across PID namespaces sharing the directory: a random part makes a clash unlikely,
  // and SwapFile's O_EXCL turns one into an error instead of a lost file.
  static std::atomic<int> made{0};
  static const unsigned token = std::random_device{}();
  return dir_ / fmt::format("xlr8-{}-{}-{:08x}-{}@{}.swap", stem, ::getpid(), token, made++, host_name());
}

}  // namespace xlr8::os
