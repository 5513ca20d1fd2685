"""What users run besides the four methods, the analyses of "Towards Understanding Self-play for LLM
Reasoning" among them (README, "Analyses"): evaluate.py, greedy accuracy and pass@k of a model, and
the pass@k curves of saved evaluations (RQ1); difficulty.py, the difficulty of Absolute Zero's
proposed tasks over training (RQ2); sparsity.py, update sparsity as released (RQ4); plot.py, a
run's curves."""
