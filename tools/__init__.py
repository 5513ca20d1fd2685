"""What users run besides the four methods: evaluation with pass@k curves, update sparsity."""
