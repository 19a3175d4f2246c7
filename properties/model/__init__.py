"""Model-level clauses: whole models given by `--model`, `--zoo`, or the zoo's own families."""
