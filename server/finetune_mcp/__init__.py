"""finetune-mcp: an MCP tool server that drives an LLM fine-tuning brief end to end.

This module imports nothing on purpose: job modules run in the *training* Python (possibly
another venv without pydantic or mcp) and import the package through it.
"""

__version__ = "0.1.0"
