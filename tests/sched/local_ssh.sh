#!/bin/sh
# An ssh stand-in for OpenMPI's rsh launcher (--mca plm_rsh_agent): drops the options and the host and
# runs the command on this machine, so `mpirun --host localhost,127.0.0.2` starts a real two-"node" job
# (OpenMPI sets OMPI_MCA_orte_num_nodes=2) without any network or second machine.
while [ $# -gt 0 ]; do
  case "$1" in
    -*) shift ;;
    *) shift; break ;;
  esac
done
exec sh -c "$*"
