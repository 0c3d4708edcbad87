#pragma once
// A fixed set of threads running tasks in submission order (with one thread: strictly FIFO).
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace xlr8 {

class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();  // finishes the queued tasks, then joins
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  void submit(std::function<void()> task);

 private:
  void loop();
  void stop_and_join();  // after the queued tasks
  std::vector<std::thread> threads_;
  std::deque<std::function<void()>> tasks_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

}  // namespace xlr8
