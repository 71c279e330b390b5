"""Launchers that start the SPMD program on many processes (torchrun and SLURM live in launch/*.sh)."""
