"""Stdlib-only code both sides use: the server and the jobs in the training Python (which may lack pydantic and mcp)."""
