"""The pieces of ``benchmarks/report.py``, one concern each: ``stats`` (the statistics every report uses: means over
seeds, bootstrap intervals), ``speed`` (the speed study's analysis and its section), ``sections`` (the step-cost,
selection, memory, forward, evaluation and LoRA-sync sections), ``gpu`` (the GPU measurements)."""
