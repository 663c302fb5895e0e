"""ESConfig and its validation: config, its fields and variants, the rules they keep, TRL's names (trl_names)."""
