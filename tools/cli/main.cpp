// xlr8-full: every command (launch, verify, advise, config, env, test, merge-weights, estimate-memory, plot,
// trace). `xlr8` itself (main_launcher.cpp) runs launch and trace without loading LibTorch and hands the
// others to this program.
#include "cli/cli_main.hpp"

int main(int argc, char** argv) {
  using namespace xlr8::cli;
  return run_cli(argc, argv,
                 {add_launch, add_verify, add_advise, add_config, add_env, add_test, add_merge_weights,
                  add_estimate_memory, add_plot, add_trace, add_selftest_worker});
}
