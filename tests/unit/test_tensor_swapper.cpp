// Offload's disk tier, its swapper (src/parallel/shard/tensor_swapper.hpp): real tensors through a real O_DIRECT file
// and a pool smaller than what they total, read back exactly, in write order, within the pool's memory.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>

#include <filesystem>
#include <functional>

#include "parallel/shard/tensor_swapper.hpp"
#include "xlr8/error.hpp"

namespace {

namespace fs = std::filesystem;
using xlr8::shard::SwapOptions;
using xlr8::shard::TensorSwapper;

fs::path swap_file_here() {
  return fs::current_path() / ("swapper_" + std::to_string(::getpid()) + "_" +
                               ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".swp");
}

std::string thrown_by(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const xlr8::Error& e) {
    return e.what();
  }
  return "";
}

std::vector<TensorSwapper::Slot> slots_of(const std::vector<at::Tensor>& tensors) {
  std::vector<TensorSwapper::Slot> slots;
  for (size_t i = 0; i < tensors.size(); ++i)
    slots.push_back({"t" + std::to_string(i), tensors[i].scalar_type(), tensors[i].sizes().vec()});
  return slots;
}

}  // namespace

// Ten tensors (about 2.6 MB) through three 512 KiB buffers: each comes back exactly, read ahead while the one before
// is used; a write after a read ahead of the same slot wins; the file holds every slot and nothing more.
TEST(TensorSwapper, TensorsComeBackExactlyThroughFewerBuffersThanTheyNeedAndTheLastWriteWins) {
  at::manual_seed(0);
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 10; ++i) tensors.push_back(at::randn({256, 250 + i}));
  const auto path = swap_file_here();
  {
    TensorSwapper swapper({.file = path, .buffer_size = 512 << 10, .buffer_count = 3}, slots_of(tensors));
    int64_t slot_bytes = 0;
    for (const auto& t : tensors) slot_bytes += (t.numel() * 4 + 4095) / 4096 * 4096;
    EXPECT_EQ(swapper.file_bytes(), slot_bytes);
    for (size_t i = 0; i < tensors.size(); ++i) swapper.swap_out("t" + std::to_string(i), tensors[i]);
    swapper.prefetch("t0");
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (i + 1 < tensors.size()) swapper.prefetch("t" + std::to_string(i + 1));
      const auto back = swapper.swap_in("t" + std::to_string(i));
      EXPECT_TRUE(at::equal(back, tensors[i])) << "t" << i;
    }
    swapper.prefetch("t3");  // old values on their way in
    const auto changed = tensors[3] * 2;
    swapper.swap_out("t3", changed);
    EXPECT_TRUE(at::equal(swapper.swap_in("t3"), changed));
    EXPECT_EQ(swapper.bytes_written(), slot_bytes + (tensors[3].numel() * 4 + 4095) / 4096 * 4096);
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path));  // scratch: gone with the swapper
}

// Swapped-in tensors hold their buffers: with every buffer held the next swap_in says so instead of waiting
// forever; freeing one lets it go on; a tensor outliving the swapper keeps its values.
TEST(TensorSwapper, BuffersHeldByLiveTensorsAreNamedAndATensorMayOutliveTheSwapper) {
  std::vector<at::Tensor> tensors{at::arange(1000, at::kFloat), at::arange(2000, at::kFloat), at::ones({300}, at::kDouble)};
  at::Tensor survivor;
  {
    TensorSwapper swapper({.file = swap_file_here(), .buffer_size = 8192, .buffer_count = 2}, slots_of(tensors));
    for (size_t i = 0; i < tensors.size(); ++i) swapper.swap_out("t" + std::to_string(i), tensors[i]);
    auto a = swapper.swap_in("t0");
    auto b = swapper.swap_in("t1");
    EXPECT_NE(thrown_by([&] { swapper.swap_in("t2"); }).find("all 2 swap buffers hold tensors swapped in and still alive"),
              std::string::npos);
    a = at::Tensor();  // its buffer goes back
    survivor = swapper.swap_in("t2");
  }
  EXPECT_TRUE(at::equal(survivor, tensors[2]));
}

TEST(TensorSwapper, ABufferSmallerThanATensorOrAWrongTensorIsRefusedNamingIt) {
  const std::vector<at::Tensor> tensors{at::zeros({4096})};  // 16 KiB
  EXPECT_NE(thrown_by([&] { TensorSwapper s({.file = swap_file_here(), .buffer_size = 8192}, slots_of(tensors)); })
                .find("buffer_size 8192 is smaller than tensor t0 (16384 bytes)"),
            std::string::npos);
  TensorSwapper swapper({.file = swap_file_here(), .buffer_size = 16384}, slots_of(tensors));
  EXPECT_NE(thrown_by([&] { swapper.swap_out("t0", at::zeros({4096}, at::kDouble)); }).find("its slot holds Float [4096]"),
            std::string::npos);
  EXPECT_NE(thrown_by([&] { swapper.swap_in("nope"); }).find("no swapped tensor is named nope"), std::string::npos);
}

// A write that fails (the kernel refuses writes past RLIMIT_FSIZE with EFBIG, as a full disk refuses with ENOSPC)
// breaks the swap: the failure names itself and the way on, and every later use (a read of another slot, a write,
// a prefetch, a flush) says the same instead of handing out a half-written state.
TEST(TensorSwapper, AFailedWriteBreaksTheSwapAndEveryLaterUseSaysWhatToDo) {
  const std::vector<at::Tensor> tensors{at::randn({1024}), at::randn({1024})};  // 4 KiB each: t1 at offset 4096
  TensorSwapper swapper({.file = swap_file_here(), .buffer_size = 4096, .buffer_count = 2}, slots_of(tensors));
  swapper.swap_out("t0", tensors[0]);
  swapper.flush();
  // Files of this process may not grow past 4 KiB while `limit` lives (restored however the block ends).
  struct FileSizeLimit {
    rlimit old{};
    void (*old_handler)(int) = SIG_DFL;
    explicit FileSizeLimit(rlim_t bytes) {
      ::getrlimit(RLIMIT_FSIZE, &old);
      old_handler = std::signal(SIGXFSZ, SIG_IGN);  // else the signal ends the process
      rlimit small = old;
      small.rlim_cur = bytes;
      ::setrlimit(RLIMIT_FSIZE, &small);
    }
    ~FileSizeLimit() {
      ::setrlimit(RLIMIT_FSIZE, &old);
      std::signal(SIGXFSZ, old_handler);
    }
  };
  std::string failed;
  {
    const FileSizeLimit limit(4096);
    swapper.swap_out("t1", tensors[1]);  // written behind
    failed = thrown_by([&] { swapper.flush(); });
  }
  EXPECT_NE(failed.find("writing 4096 bytes at offset 4096"), std::string::npos) << failed;
  EXPECT_NE(failed.find("no longer holds the run's state"), std::string::npos) << failed;
  EXPECT_NE(failed.find("resume from the last checkpoint"), std::string::npos) << failed;
  for (const auto& use : std::vector<std::function<void()>>{[&] { swapper.swap_in("t0"); },
                                                            [&] { swapper.swap_out("t0", tensors[0]); },
                                                            [&] { swapper.prefetch("t1"); }, [&] { swapper.flush(); }})
    EXPECT_EQ(thrown_by(use), failed);
}
