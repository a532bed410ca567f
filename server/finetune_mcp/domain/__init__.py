"""Server-side knowledge below the tools: the brief, recipes, memory, run state, progress, verdicts, train.py rendering."""
