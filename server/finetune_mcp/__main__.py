"""`python -m finetune_mcp` is the console script."""
from finetune_mcp.cli import main

raise SystemExit(main())
