"""--algorithm randopt: RandOpt (Neural Thickets) and its consolidation, beside ES and GRPO."""
