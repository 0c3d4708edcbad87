// A worker for the launcher tests. Modes:
//   env DIR            write this rank's launch variables to DIR/rank<R>.env
//   exit CODE RANK DIR rank RANK exits with CODE after 0.3 s; the others write their pid to DIR and sleep
//   hang DIR           write pid to DIR/pid<R>, then sleep forever
//   hang-handling-int DIR   the same with a SIGINT handler that ignores it
//   fail-once CODE     rank 1 exits with CODE on the first attempt; everything succeeds on a restart
//   allreduce          rendezvous through ProcessState, all-reduce rank+1, print "sum=<S> world=<W>"
//   empty-objects N    N broadcast_object and N all_gather_object of empty payloads; rank 0 prints "objects <ms> ms"
//   print N            print N lines on stdout and stderr
//   in-place           on stderr: a CRLF line, then a line redrawn in place (frames after \r), then a
//                      plain line; rank 1 writes one stdout line while rank 0's frames are drawn
//   peer-dies          rank 1 exits (code 3) after joining; rank 0 all-reduces and prints the error it gets
//   leak-segment DIR   create a shared segment, write its name to DIR/segment<R>, then SIGKILL itself
//   matmul-mismatch uncaught|caught   rank 1 multiplies mismatched shapes inside a Linear (a c10::Error with
//                      its backtrace), uncaught or printed as "worker: error: <what()>"; the others sleep
//   affinity DIR       create the ProcessState, then write the CPUs this process may use and its intra-op
//                      thread count to DIR/affinity<R> ("0-1 2")
#include <fmt/format.h>
#include <torch/nn.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "os/cpu_affinity.hpp"
#include "os/shm_segment.hpp"
#include "xlr8/process_state.hpp"

namespace {
std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}
int rank() { return std::atoi(env("RANK").c_str()); }
// DIR/<name><R> holding `text`, written under another name and renamed: a test that sees the file must find all of
// it there, never an empty file of a rank stopped mid-write (the partial name does not start with <name>: tests
// count those files).
void write_whole(const std::string& dir, const std::string& name, const std::string& text) {
  const auto partial = fmt::format("{}/.{}{}.partial", dir, name, rank());
  std::ofstream(partial) << text << std::flush;
  std::filesystem::rename(partial, fmt::format("{}/{}{}", dir, name, rank()));
}
void write_pid(const std::string& dir) { write_whole(dir, "pid", std::to_string(getpid())); }
}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "env") {
    std::ofstream out(fmt::format("{}/rank{}.env", argv[2], rank()));
    for (auto name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS",
                      "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_FSDP", "FSDP_SHARDING_STRATEGY", "XLR8_LAUNCHED",
                      "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"})
      out << name << "=" << env(name) << "\n";
    return 0;
  }
  if (mode == "exit") {
    int code = std::atoi(argv[2]), failing = std::atoi(argv[3]);
    if (rank() == failing) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      fmt::print(stderr, "rank {} giving up with code {}\n", rank(), code);
      return code;
    }
    write_pid(argv[4]);
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  if (mode == "hang") {
    write_pid(argv[2]);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (mode == "hang-handling-int") {  // catches SIGINT and goes on, as a program with its own handler may
    signal(SIGINT, [](int) {});
    write_pid(argv[2]);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (mode == "fail-once") {
    if (env("TORCHELASTIC_RESTART_COUNT") == "0" && rank() == 1) return std::atoi(argv[2]);
    fmt::print("attempt {} ok\n", env("TORCHELASTIC_RESTART_COUNT"));
    return 0;
  }
  if (mode == "allreduce") {
    try {
      const auto& state = xlr8::ProcessState::instance();
      auto x = at::full({4}, state.rank() + 1.0);
      state.world().all_reduce(x);
      const auto& t = state.topology();
      fmt::print("sum={} world={} node={} rank={} local={}/{} nodes={} source={} at={}:{}\n", x[0].item<double>(),
                 state.world_size(), state.node_rank(), t.rank, t.local_rank, t.local_world_size, t.num_nodes, t.source,
                 t.master_addr, t.master_port);
      state.world().barrier();
    } catch (const std::exception& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      return 2;
    }
    return 0;
  }
  if (mode == "empty-objects") {
    const auto& state = xlr8::ProcessState::instance();
    const int n = argc > 2 ? std::atoi(argv[2]) : 10;
    state.world().barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      state.world().broadcast_object("", 0);
      state.world().all_gather_object("");
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (state.rank() == 0) fmt::print("objects {:.1f} ms\n", ms);
    return 0;
  }
  if (mode == "throw-uncaught") {  // an exception nobody catches, once the process state exists
    const auto& state = xlr8::ProcessState::instance();
    if (state.rank() == std::atoi(argv[2])) throw xlr8::ConfigError("bad value 7 for key 'lr_warmup': give 0 or more");
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  if (mode == "trace") {  // argv[2]: sleep | different | skip | skip-object — what rank 1 does at the third collective
    const auto& state = xlr8::ProcessState::instance();
    auto& world = state.world();
    const std::string how = argv[2];
    for (int i = 0; i < 2; ++i) {
      auto x = at::ones({4});
      world.all_reduce(x);
    }
    auto x = at::ones({4});
    if (state.rank() == 1 && how == "sleep") std::this_thread::sleep_for(std::chrono::seconds(120));
    if (how == "skip-object") {  // rank 1 skips a broadcast_object rooted on it (report() is made of these)
      if (state.rank() == 0) world.broadcast_object("", 1);
      world.all_reduce(x);
    } else if (state.rank() == 1 && how == "different") {
      world.broadcast(x, 0);
    } else if (state.rank() != 1 || how != "skip") {
      world.all_reduce(x);
    }
    world.barrier();
    return 0;
  }
  if (mode == "peer-dies") {
    const auto& state = xlr8::ProcessState::instance();
    if (state.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::_Exit(3);  // no goodbye to anyone: as a crash looks to the others
    }
    auto x = at::ones({1 << 20});
    auto start = std::chrono::steady_clock::now();
    try {
      state.world().all_reduce(x);
      fmt::print("all_reduce succeeded without rank 1\n");
      return 0;
    } catch (const std::exception& e) {
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print(stderr, "error after {:.1f} s: {}\n", s, e.what());
      return 2;
    }
  }
  if (mode == "leak-segment") {
    auto segment = xlr8::os::SharedSegment::create(xlr8::os::new_segment_name(), 4096);
    write_whole(argv[2], "segment", segment->name());  // the launcher may stop this rank once the other one died
    std::raise(SIGKILL);
  }
  if (mode == "matmul-mismatch") {
    if (rank() != 1)
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    torch::nn::Sequential model(torch::nn::Linear(4, 5), torch::nn::ReLU());
    auto forward = [&] { return model->forward(at::ones({2, 3})); };
    if (std::string(argv[2]) == "uncaught") forward();
    try {
      forward();
    } catch (const std::exception& e) {
      fmt::print(stderr, "worker: error: {}\n", e.what());
      return 1;
    }
    return 0;
  }
  if (mode == "affinity") {
    const auto& state = xlr8::ProcessState::instance();
    std::vector<int> cpus;
    for (const auto& c : xlr8::os::allowed_cpus()) cpus.push_back(c.id);
    std::ofstream(fmt::format("{}/affinity{}", argv[2], rank())) << xlr8::os::cpu_list_text(cpus) << " "
                                                                 << state.intra_op_threads() << std::flush;
    return 0;
  }
  if (mode == "in-place") {
    auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); };
    if (rank() == 1) {
      pause();
      fmt::print("between frames\n");
      std::fflush(stdout);
      return 0;
    }
    fmt::print(stderr, "windows line\r\n");
    for (int frame = 1; frame <= 3; ++frame) {
      fmt::print(stderr, "\rframe {}\x1b[K", frame);
      std::fflush(stderr);
      pause();
    }
    fmt::print(stderr, "\nafter\n");
    return 0;
  }
  if (mode == "print") {
    for (int i = 0; i < std::atoi(argv[2]); ++i) fmt::print("out {}\n", i), fmt::print(stderr, "err {}\n", i);
    return 0;
  }
  fmt::print(stderr, "unknown mode {}\n", mode);
  return 64;
}
