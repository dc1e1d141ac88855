"""A role worker: the process that registers with the head, its port, the role runners and the ranks of a
multi-rank instance."""
