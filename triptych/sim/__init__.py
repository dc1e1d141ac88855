"""The head's scheduler simulated on a virtual clock: the real admission (``Admission``, the
deadline check, the fair queue), placement (``GenerationRouter``, dispatch policies), the
denoiser's step batching and preemption (``pick_batch``) and the autoscaler (``Autoscaler``),
driven by simulated workers whose stage times come from a measured cost model (``costs``).

Entry point: ``run.simulate``; the benchmark CLI is benchmarks/simulate.py.
"""
