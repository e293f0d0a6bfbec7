"""The machine: GPUs, NCCL, disks, process identity."""
