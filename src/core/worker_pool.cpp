#include "core/worker_pool.hpp"

#include <fmt/format.h>

#include <exception>

#include "xlr8/error.hpp"

namespace xlr8 {

WorkerPool::WorkerPool(int threads) {
  try {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
  } catch (const std::exception& e) {  // system_error (no thread), or bad_alloc
    // The destructor will not run: join the threads that started, or their destruction ends the process.
    const auto started = threads_.size();
    stop_and_join();
    throw Error(fmt::format("could not start thread {} of {} ({}); ask for fewer threads, or raise the limit on "
                            "threads (ulimit -u)",
                            started + 1, threads, e.what()));
  }
}

WorkerPool::~WorkerPool() { stop_and_join(); }

void WorkerPool::stop_and_join() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void WorkerPool::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void WorkerPool::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace xlr8
