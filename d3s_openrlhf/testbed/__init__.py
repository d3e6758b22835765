"""The toy testbed: a small model, tokenizer and task files built locally (no hub), the SFT warm start and RL runs
of the demo, the end-to-end tests and the benchmarks (``pipeline``), held-out evaluation (``evaluate``), the CPU
smoke runs of the launch scripts (``smoke``, with its toy inputs ``smoke_inputs`` and local Ray cluster
``ray_cluster``), the scan for a run's processes (``processes``) and the vLLM weight-sync check (``sync_check``).

It drives the CPU runtime (:mod:`d3s_openrlhf.cpu`) from outside; nothing in the runtime imports it.
"""
