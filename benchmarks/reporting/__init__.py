"""The pieces of ``benchmarks/report.py``, one concern each: ``stats`` (the statistics), ``study`` (the learning
study's analysis), ``claims`` (the papers' claims and their verdicts), ``study_doc`` (the study's plot and text),
``sections`` (the step-cost, selection, memory and forward sections and the summary)."""
