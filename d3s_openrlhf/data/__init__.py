"""Data preparation: ``python -m d3s_openrlhf.data.prepare`` turns math datasets into OpenRLHF prompt JSONL."""
