"""benchkit/llamacpp.py: finding llama-server, skipping without it, and the
client against a stand-in server speaking its /health and /completion."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from benchkit import llamacpp

pytestmark = pytest.mark.unit

# A stand-in for llama-server: the flags the helper passes, an API key, /health,
# /completion unstreamed (timings) and streamed (one event a token, then stop).
FAKE_SERVER = textwrap.dedent(
    """\
    #!{python}
    import argparse, json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    p = argparse.ArgumentParser()
    for flag in ("-m", "--host", "--port", "--api-key", "-np", "-c", "-t", "-tb"):
        p.add_argument(flag)
    args = p.parse_args()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def send(self, code, body, kind="application/json"):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.send(200 if self.path == "/health" else 404, b"{{}}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.headers.get("Authorization") != "Bearer " + args.api_key:
                return self.send(401, b'{{"error": "no key"}}')
            n = body["n_predict"]
            if not body["stream"]:
                t = {{"predicted_per_second": 50.0 + n, "prompt_per_second": 900.0}}
                return self.send(200, json.dumps({{"timings": t}}).encode())
            events = [{{"tokens": [7], "stop": False}} for _ in range(n)]
            events.append({{"tokens": [], "stop": True, "tokens_predicted": n,
                            "tokens_evaluated": len(body["prompt"])}})
            text = "".join("data: " + json.dumps(e) + "\\n\\n" for e in events)
            self.send(200, text.encode(), "text/event-stream")

    ThreadingHTTPServer((args.host, int(args.port)), H).serve_forever()
    """
)


def executable(path: Path, text: str = "#!/bin/sh\n") -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_explicit_path_first_then_env_then_path(tmp_path, monkeypatch):
    explicit = executable(tmp_path / "mine")
    from_env = executable(tmp_path / "env-server")
    on_path = tmp_path / "bin"
    on_path.mkdir()
    executable(on_path / "llama-server")
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setenv(llamacpp.LLAMA_SERVER_ENV, str(from_env))
    assert llamacpp.find_llama_server(str(explicit)) == explicit
    assert llamacpp.find_llama_server() == from_env
    monkeypatch.delenv(llamacpp.LLAMA_SERVER_ENV)
    assert llamacpp.find_llama_server() == on_path / "llama-server"


def test_none_found_gives_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(llamacpp.LLAMA_SERVER_ENV, raising=False)
    assert llamacpp.find_llama_server() is None
    assert "--llama-server PATH" in llamacpp.skip_reason()
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("")
    assert llamacpp.find_llama_server(str(not_executable)) is None
    assert llamacpp.find_llama_server(str(tmp_path / "missing")) is None
    assert "not an executable file" in llamacpp.skip_reason(str(not_executable))


def test_command_listens_on_loopback_with_a_key():
    cmd = llamacpp.server_command(Path("ls"), Path("m.gguf"), 1234, "k", 16, 2, 512)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--api-key") + 1] == "k"
    assert cmd[cmd.index("-np") + 1] == "16"
    assert cmd[cmd.index("-c") + 1] == str(16 * 512)


@pytest.mark.skipif(os.name != "posix", reason="a shebang script stands in for the server")
def test_measures_a_server_and_stops_it(tmp_path):
    fake = executable(tmp_path / "llama-server", FAKE_SERVER.format(python=sys.executable))
    with llamacpp.llama_server(fake, tmp_path / "m.gguf", slots=4, start_timeout_s=120) as server:
        assert llamacpp.decode_tok_s(server, [1, 2, 3], 64) == 114.0
        assert llamacpp.prefill_tok_s(server, [1] * 8) == 900.0
        run = asyncio.run(llamacpp.parallel_run(server, [[1] * 5] * 4, 6))
        assert len(run.records) == 4
        assert all(sum(n for _, n in r.chunks) == 6 for r in run.records)
        assert all(r.final.completion_tokens == 6 for r in run.records)
        assert len(run.ttfts_ms()) == 4 and run.output_tok_s > 0
        unkeyed = llamacpp.LlamaServer(server.base_url, "wrong", 4)
        with pytest.raises(RuntimeError, match="failed 1 requests"):
            asyncio.run(llamacpp.parallel_run(unkeyed, [[1]], 2))
    with pytest.raises(httpx.HTTPError):  # stopped: nothing listens there any more
        llamacpp.timings(server, [1], 1)
