#pragma once
// Process groups that must be aborted, and never destroyed, when the process exits.
//
// A ProcessGroupNCCL destroyed during exit (the process state's groups are statics) sets its device in its
// destructor, which fails once CUDA's driver is shutting down ("driver shutting down", thrown from a
// destructor: SIGABRT after a finished run, stdout's buffer lost; seen on an H100 with torch 2.11). So an
// exit handler, armed at the first NCCL collective (after our statics, so it runs before their destructors),
// aborts every registered group while it can and keeps a reference to each that is never released: their
// destructors never run. (Aborted, not shut down: a shutdown waits for pending work, which a failing run may
// have.) A template over the group type so that its logic is tested without a GPU (tests/unit).
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

namespace xlr8::compat {

template <class Group>
class AbortAtExit {
 public:
  static AbortAtExit& instance() {
    static auto* registry = new AbortAtExit;  // never destroyed: the handler runs during exit
    return *registry;
  }

  // Registers `group` while the returned handle lives: its owner keeps the handle beside the group and drops it
  // first, so a group dropped during the run is destroyed then, as usual.
  std::shared_ptr<void> add(const c10::intrusive_ptr<Group>& group) {
    auto entry = std::make_shared<Entry>(Entry{group});
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(entries_, [](const auto& weak) { return weak.expired(); });
    entries_.emplace_back(entry);
    return entry;
  }

  // Registers the exit handler once (cheap after the first call): call it where the groups are first used.
  static void arm() {
    static std::once_flag registered;
    std::call_once(registered, [] { std::atexit(&AbortAtExit::abort_all); });
  }

  // The exit handler: aborts every registered group and leaks a reference to it.
  static void abort_all() {
    std::fflush(nullptr);  // what the program printed reaches its pipes whatever happens next
    auto& r = instance();
    std::lock_guard<std::mutex> lock(r.mutex_);
    for (auto& weak : r.entries_)
      if (auto entry = weak.lock()) {
        try {
          entry->group->abort();
        } catch (...) {  // exiting anyway
        }
        (void)c10::intrusive_ptr<Group>(entry->group).release();  // never destroyed during exit
      }
    r.entries_.clear();
  }

 private:
  struct Entry {
    c10::intrusive_ptr<Group> group;
  };
  std::mutex mutex_;
  std::vector<std::weak_ptr<Entry>> entries_;  // alive while their group's owner holds the handle
};

}  // namespace xlr8::compat
