"""Over HTTP a request must arrive in time: a trickled head, or a trickled body after valid headers, is answered
408 and closed at its bound, with or without a token; whole requests and an open event stream are not cut."""

from __future__ import annotations

import socket
import subprocess
import time

import anyio
import httpx
import pytest

from conftest import free_port, server_command

TOKEN = "tok-train-0123456789abcdef"
HEAD_S, BODY_S = 2.0, 3.0
SLACK_S = 2.0  # the server's loop and a loaded box; the trickle alone would keep it open for ever


@pytest.fixture
def server(ws_root, tmp_path):
    port = free_port()
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"training-engineer: [{TOKEN}]\n")
    proc = subprocess.Popen(server_command() + ["serve", "--transport", "http", "--port", str(port), "--tokens-file", str(tokens),
                                                "--header-timeout", str(HEAD_S), "--body-timeout", str(BODY_S)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.err", "w"))
    for _ in range(300):
        try:
            httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=0.5)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield port
    proc.terminate()
    proc.wait(10)


def _trickle(port: int, first: bytes, drip: bytes, every: float = 0.25, give_up: float = 30.0) -> tuple[float, bytes]:
    """Send `first`, then one byte of `drip` every `every` seconds until the server closes; (seconds, what it sent)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(every)
    got = b""
    t0 = time.monotonic()
    try:
        s.sendall(first)
        i = 0
        while time.monotonic() - t0 < give_up:
            try:
                chunk = s.recv(65536)
                if not chunk:
                    return time.monotonic() - t0, got
                got += chunk
                continue
            except socket.timeout:
                pass
            if not drip:
                continue
            try:
                s.sendall(drip[i % len(drip):i % len(drip) + 1])
            except OSError:
                return time.monotonic() - t0, got
            i += 1
        return time.monotonic() - t0, got
    finally:
        s.close()


def test_a_trickled_request_head_is_cut_at_its_bound_without_a_token(server):
    secs, got = _trickle(server, b"POST /mcp HTTP/1.1\r\nHost: x\r\n", b"X-Slow: aaaaaaaaaaaaaaaa\r\n")
    print(f"trickled head: closed after {secs:.2f}s (bound {HEAD_S}s)")
    assert HEAD_S * 0.9 <= secs < HEAD_S + SLACK_S
    assert got.startswith(b"HTTP/1.1 408 ")
    # A connection that sends nothing at all is bound the same way.
    secs, got = _trickle(server, b"", b"")
    print(f"silent connection: closed after {secs:.2f}s")
    assert HEAD_S * 0.9 <= secs < HEAD_S + SLACK_S and got.startswith(b"HTTP/1.1 408 ")


def test_a_trickled_body_after_valid_headers_is_cut_at_its_bound(server):
    head = (f"POST /mcp HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            "Accept: application/json, text/event-stream\r\nContent-Length: 1000\r\n\r\n{").encode()
    secs, got = _trickle(server, head, b" ")
    print(f"trickled body with a token: closed after {secs:.2f}s (bound {BODY_S}s)")
    assert BODY_S * 0.9 <= secs < BODY_S + SLACK_S
    assert got.startswith(b"HTTP/1.1 408 ")
    # Without a token the 401 comes at once; the body it never read still cannot hold the connection.
    secs, got = _trickle(server, head.replace(f"Authorization: Bearer {TOKEN}\r\n".encode(), b""), b" ")
    print(f"trickled body without a token: closed after {secs:.2f}s")
    assert got.startswith(b"HTTP/1.1 401 ") and secs < max(HEAD_S, BODY_S) + SLACK_S


def test_whole_requests_and_an_open_event_stream_still_work(server):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    import httpx2

    url = f"http://127.0.0.1:{server}/mcp"

    async def main():
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as hc:
            async with streamable_http_client(url, http_client=hc) as (r, w, *_):
                async with ClientSession(r, w) as s:
                    await s.initialize()
                    first = {t.name for t in (await s.list_tools()).tools}
                    # Past both bounds on one session (its GET stream stays open): still answered.
                    await anyio.sleep(HEAD_S + BODY_S + 1)
                    again = await s.call_tool("compare_runs", {"experiment": "none-here"})
                    return first, again

    first, again = anyio.run(main)
    assert "prepare_dataset" in first
    assert again.is_error and "none-here has no runs to compare" in again.content[0].text
    # A whole request sent slowly but within the bounds is answered.
    body = b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}'
    head = (f"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", server), timeout=10)
    try:
        for part in (head[:10], head[10:], body[:5], body[5:]):
            s.sendall(part)
            time.sleep(0.3)
        assert s.recv(65536).startswith(b"HTTP/1.1 401 ")  # no token: refused, but answered
    finally:
        s.close()
