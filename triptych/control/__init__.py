"""The control plane: head <-> worker messages, the backends a head drives (in process or disaggregated), routing,
the instance registry and the metrics the head exposes."""
