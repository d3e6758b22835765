"""Reward functions for OpenRLHF's ``--reward.remote_url`` (pass the path of the module file, e.g.
``d3s_openrlhf/rewards/math_reward.py``; OpenRLHF loads it by path, so each file is self-contained)."""
