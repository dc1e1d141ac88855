"""Past one machine: where a head's workers run and how many of them.

- ``config``: ``ClusterConfig`` (local processes or Ray actors, per-role resources) and
  ``AutoscaleConfig`` (which pools grow and shrink, and when). No Ray import.
- ``autoscale``: the scaling policy (a pure function) and the ``Autoscaler`` that applies it to a
  running head through any ``supervisor.WorkerPool`` (drain, then stop; never drop a request).
- ``placement``: Ray actor options and placement-group bundles from the resources of a role.
- ``ray_backend``: ``RayWorkers``, the ``WorkerPool`` whose workers are Ray actors (imports Ray).

Ray places and supervises; it never carries a control message or a tensor: the workers it starts
register with the head over the same authenticated control plane and move tensors peer to peer as
local ones do.
"""
