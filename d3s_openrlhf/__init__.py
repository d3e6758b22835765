"""d3s-openrlhf."""
