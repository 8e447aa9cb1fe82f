"""Scoring a model: the run's validation windows (:mod:`launch.eval.validation`), models loaded to be scored
(:mod:`launch.eval.models`) and downstream tasks through lm-eval (:mod:`launch.eval.harness`).

The wing stands below the loop (which scores its model every ``run.eval_every`` steps) and above metrics,
config, models and data."""
