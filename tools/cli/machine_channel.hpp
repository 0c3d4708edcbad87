#pragma once
// How the advise commands on several machines agree on what to launch: machine 0 decides and posts each
// decision to a TCPStore it serves at the job's main port + 1; the other machines read them in order. A
// launch spans every machine, so all of them must start the same candidate, in the same order, or none.
#include <fmt/format.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "compat/torch_compat.hpp"
#include "xlr8/error.hpp"

namespace xlr8::cli {

class MachineChannel {
 public:
  // `timeout`: the longest a follower waits for machine 0's next word.
  MachineChannel(const std::string& host, int port, int machine_rank, int machines, std::chrono::milliseconds timeout)
      : host_(host), port_(port), leader_(machine_rank == 0), machines_(machines), timeout_(timeout) {
    try {
      store_ = compat::make_tcp_store(host, port, leader_, machines, timeout);
    } catch (const std::exception& e) {
      throw Error(fmt::format("xlr8 advise: {} {}:{} (the machines' channel: --main_process_port + 1): {}",
                              leader_ ? "machine 0 cannot listen on" : "cannot reach machine 0 at", host, port,
                              text_of(e)));
    }
  }

  bool leader() const { return leader_; }
  // A name for the launch of the last word, the same on every machine: the rendezvous refuses a rank of another.
  std::string job_of_last() const { return fmt::format("xlr8-advise-{}-{}", port_, count_ - 1); }

  // Machine 0: the next decision ("run:<candidate>", "end:<winner or empty>", "error:<why>").
  void post(const std::string& word) {
    store_->set(fmt::format("advise/{}", count_++), std::vector<uint8_t>(word.begin(), word.end()));
  }

  // The others: machine 0's next decision, waited for at most the timeout.
  std::string next() {
    try {
      const auto bytes = store_->get(fmt::format("advise/{}", count_++));
      return {bytes.begin(), bytes.end()};
    } catch (const std::exception& e) {
      throw Error(fmt::format("xlr8 advise: machine 0 at {}:{} posted no decision within {} s ({}); its output says "
                              "why (it decides, the other machines follow)",
                              host_, port_, timeout_.count() / 1000, text_of(e)));
    }
  }

  // True once machine 0 has posted the word after the last one read: it has left the launch that word started.
  bool next_is_posted() { return store_->check({fmt::format("advise/{}", count_)}); }

  // Another machine could not take part in the launch of the last word (its launch failed, or its flags differ):
  // machine 0 stops that launch rather than wait for ranks that will not come.
  void report_failure(const std::string& why) {
    store_->set(fmt::format("advise/failed/{}", count_ - 1), std::vector<uint8_t>(why.begin(), why.end()));
  }
  std::optional<std::string> failure_of_last() {
    const std::string key = fmt::format("advise/failed/{}", count_ - 1);
    if (count_ == 0 || !store_->check({key})) return std::nullopt;
    const auto bytes = store_->get(key);
    return std::string(bytes.begin(), bytes.end());
  }

  // Machine 0, last: posts its final word and waits (a minute at most) until every other machine has read it,
  // as the store closes with this object.
  void end(const std::string& word) {
    post(word);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (store_->add("advise/ended", 0) < machines_ - 1 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  // The others, once they have read the final word.
  void acknowledge_end() { store_->add("advise/ended", 1); }

 private:
  static std::string text_of(const std::exception& e) {
    const std::string what = e.what();
    return what.substr(0, what.find('\n'));
  }

  std::string host_;
  int port_;
  bool leader_;
  int machines_;
  std::chrono::milliseconds timeout_;
  compat::StorePtr store_;
  int count_ = 0;
};

}  // namespace xlr8::cli
