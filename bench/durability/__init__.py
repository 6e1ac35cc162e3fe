"""Crashes and restarts: SIGKILL under load, then the invariants (`crash`); recovery time of the directory
and index for N pages (`restart`)."""
