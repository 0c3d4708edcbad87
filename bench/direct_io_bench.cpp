// Offload's disk tier, its I/O layer against the disk itself (issue 47): `bytes` written to and read back from an
// O_DIRECT swap file through xlr8::os::DirectIo (block_size pieces over `threads` threads), against `dd` with
// oflag=direct / iflag=direct on a file of the same size in the same directory, alternating over rounds; medians. The
// swapper's rows move the same bytes as tensors through xlr8::shard::TensorSwapper (copies into its pool included).
//   build/bin/xlr8-direct-io-bench --dir /var/tmp --gib 2 --threads 1,2,4 --rounds 3
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "os/direct_io.hpp"
#include "parallel/shard/tensor_swapper.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// GB/s of dd moving `mib` MiB in 1 MiB blocks with direct I/O (writing a file of zeros, or reading it back).
double dd_gbps(const fs::path& file, int64_t mib, bool writing) {
  const auto cmd = writing ? fmt::format("dd if=/dev/zero of={} bs=1M count={} oflag=direct status=none", file.string(), mib)
                           : fmt::format("dd if={} of=/dev/null bs=1M count={} iflag=direct status=none", file.string(), mib);
  const auto start = Clock::now();
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("failed: " + cmd);
  return static_cast<double>(mib << 20) / seconds_since(start) / 1e9;
}

// GB/s of DirectIo writing then reading `bytes` (requests of `request` bytes, all queued at once).
std::pair<double, double> direct_io_gbps(const fs::path& file, int64_t bytes, int64_t request, int threads) {
  xlr8::os::DirectIo io({.block_size = 1 << 20, .intra_op_parallelism = threads});
  xlr8::os::SwapFile swap(file, bytes);
  xlr8::os::AlignedBuffer buffer(request);  // every request from / into it: the disk's speed, not memory's
  std::memset(buffer.data(), 7, static_cast<size_t>(request));
  auto run = [&](bool writing) {
    const auto start = Clock::now();
    std::vector<xlr8::os::IoTicket> tickets;
    for (int64_t at = 0; at < bytes; at += request) {
      const int64_t n = std::min(request, bytes - at);
      tickets.push_back(writing ? io.write(swap, at, buffer, n) : io.read(swap, at, buffer, n));
    }
    for (auto& t : tickets) t.wait();
    return static_cast<double>(bytes) / seconds_since(start) / 1e9;
  };
  const double w = run(true);
  const double r = run(false);
  return {w, r};
}

// GB/s of the swapper (what offload's optimizer tier moves through): `bytes` as 64 MiB tensors swapped out (copied
// into the pool, written behind) then swapped in, the next read ahead while one is taken.
std::pair<double, double> swapper_gbps(const fs::path& file, int64_t bytes, int threads) {
  const int64_t each = int64_t{64} << 20;
  std::vector<xlr8::shard::TensorSwapper::Slot> slots;
  for (int64_t at = 0; at < bytes; at += each)
    slots.push_back({fmt::format("t{}", slots.size()), at::kFloat, {each / 4}});
  xlr8::shard::TensorSwapper swapper({.file = file, .buffer_size = each, .buffer_count = 4,
                                      .aio = {.block_size = 1 << 20, .intra_op_parallelism = threads}},
                                     slots);
  const auto values = at::full({each / 4}, 7.0f);
  auto start = Clock::now();
  for (const auto& slot : slots) swapper.swap_out(slot.name, values);
  swapper.flush();
  const double w = static_cast<double>(bytes) / seconds_since(start) / 1e9;
  start = Clock::now();
  swapper.prefetch(slots.front().name);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (i + 1 < slots.size()) swapper.prefetch(slots[i + 1].name);
    (void)swapper.swap_in(slots[i].name);  // freed at once: its buffer goes back to the pool
  }
  return {w, static_cast<double>(bytes) / seconds_since(start) / 1e9};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"direct I/O throughput: xlr8's swap layer against dd (oflag/iflag=direct)"};
  std::string dir = "/var/tmp";
  double gib = 2;
  std::vector<int> threads{1, 2, 4};
  int rounds = 3;
  app.add_option("--dir", dir, "A directory on the disk to measure (not tmpfs)");
  app.add_option("--gib", gib, "GiB moved each way per run");
  app.add_option("--threads", threads, "intra_op_parallelism values")->delimiter(',');
  app.add_option("--rounds", rounds);
  CLI11_PARSE(app, argc, argv);
  const int64_t mib = static_cast<int64_t>(gib * 1024);
  const int64_t bytes = mib << 20;
  const auto file = fs::path(dir) / fmt::format("xlr8-direct-io-bench-{}.swp", ::getpid());
  std::map<std::string, std::vector<double>> runs;
  for (int r = 0; r < rounds; ++r) {
    runs["dd write"].push_back(dd_gbps(file, mib, true));
    runs["dd read"].push_back(dd_gbps(file, mib, false));
    fs::remove(file);
    for (int t : threads) {
      // The request size the swapper would use for one tensor's shard: 64 MiB.
      const auto [w, rd] = direct_io_gbps(file, bytes, int64_t{64} << 20, t);
      runs[fmt::format("xlr8 write, {} thread(s)", t)].push_back(w);
      runs[fmt::format("xlr8 read, {} thread(s)", t)].push_back(rd);
      const auto [sw, sr] = swapper_gbps(file, bytes, t);
      runs[fmt::format("swapper write, {} thread(s)", t)].push_back(sw);
      runs[fmt::format("swapper read, {} thread(s)", t)].push_back(sr);
    }
  }
  nlohmann::json out;
  const double dd_w = median(runs["dd write"]), dd_r = median(runs["dd read"]);
  for (const auto& [name, values] : runs) {
    const double m = median(values);
    const bool writing = name.find("write") != std::string::npos;
    out[name] = {{"gb_per_s", m}, {"vs_dd", m / (writing ? dd_w : dd_r)}, {"runs", values}};
    fmt::print("{:<29} {:7.3f} GB/s  {:5.2f}x dd  (runs {:.3f})\n", name, m, m / (writing ? dd_w : dd_r),
               fmt::join(values, ", "));
  }
  fmt::print("{}\n", out.dump());
}
