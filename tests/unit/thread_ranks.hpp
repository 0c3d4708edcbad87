#pragma once
// Ranks as threads for unit tests: N communicators over one in-process store.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "distributed/self_check.hpp"
#include "xlr8/communicator.hpp"

namespace xlr8::testing {

using namespace std::chrono_literals;

inline std::string unique_key() {
  static std::atomic<int> counter{0};
  return fmt::format("{}-{}", ::testing::UnitTest::GetInstance()->current_test_info()->name(), counter++);
}

// Rank threads share LibTorch's global generator: seeding and drawing happen under this lock.
inline std::mutex& generator_lock() {
  static std::mutex lock;
  return lock;
}

// Runs fn(comm) on P ranks, one thread each; rethrows the first failure.
template <class Fn>
void run_ranks(int P, Fn fn, std::chrono::milliseconds timeout = 30s, bool shared_memory = true) {
  std::string key = unique_key();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(P);
  for (int r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = Communicator::in_process(key, r, P, timeout, shared_memory);
        fn(comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace xlr8::testing
