"""What runs report: metrics.jsonl and progress lines, rounds.jsonl, model FLOPs utilization, plots."""
