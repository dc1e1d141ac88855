"""A multi-rank denoiser instance: rank 0's view of its ranks, the follower process, the per-tick protocol, and
the in-process driver that runs one request on N local ranks."""
