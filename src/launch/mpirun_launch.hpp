#pragma once
// `xlr8 launch` with mpirun_config (mpirun_hostfile), as `accelerate launch` does it: one mpirun, started
// on this machine, starts every rank on the hosts of the file; the ranks read mpirun's variables
// (OMPI_COMM_WORLD_RANK...) and get xlr8's settings and the rendezvous address from the launcher.
#include <map>
#include <string>
#include <vector>

#include "xlr8/launcher.hpp"

namespace xlr8::launcher {

// Refuses what cannot go with mpirun (a machine rank other than 0, restarts, per-rank log files) and a
// host file that cannot be read, naming the key, the value and the fix. Throws ConfigError.
void check_mpirun_launch(const LaunchOptions& options);

struct MpirunCommand {
  std::vector<std::string> argv;            // mpirun, its options, the program and its arguments
  std::map<std::string, std::string> env;   // what the ranks need on top of the launcher's environment
};
// Open MPI spells the options --hostfile/--npernode and forwards only the variables named with -x;
// MPICH, Intel MPI and MVAPICH spell them -f/-ppn and forward the whole environment.
MpirunCommand mpirun_command(const LaunchOptions& options, const std::string& mpirun, bool open_mpi, int port);

// Runs the job through mpirun (or mpiexec) and returns its exit code (128 + signal when killed).
int launch_through_mpirun(const LaunchOptions& options);

}  // namespace xlr8::launcher
