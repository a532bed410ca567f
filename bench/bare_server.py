"""The baseline for bench_startup: a bare MCPServer with one tool, over stdio."""
from mcp.server.mcpserver import MCPServer

server = MCPServer(name="bare")


@server.tool()
def ping(x: int) -> int:
    """Echo."""
    return x


if __name__ == "__main__":
    server.run("stdio")
