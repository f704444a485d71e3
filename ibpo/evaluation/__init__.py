"""Evaluating a model or an adapter on a benchmark: the benchmarks and their graders
(benchmarks), sampling, resuming and scoring (evaluate), the scripts' command line (cli)."""
