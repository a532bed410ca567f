"""One module per lifecycle phase: plain functions taking a PhaseContext; no MCP here."""
