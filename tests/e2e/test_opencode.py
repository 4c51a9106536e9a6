"""OpenCode, the real CLI from npm, as a client of a live ds4d daemon.

Each scenario runs inside a loopback-only network namespace (``unshare -n`` with
``lo`` up), so nothing can leave the machine: this file re-runs itself there as a
driver that starts the daemon, waits for /health to say ok, puts a small recording proxy
between OpenCode and the daemon (to see every request's status and session), and
runs ``opencode run`` turns with a scratch HOME.  The test then checks the
driver's report: OpenCode exited 0 and printed the model's answer, every request
succeeded (the title request with its two consecutive user messages included),
the daemon logged one accounting line per request, and the second turn of the
session reused the first turn's prompt from the prefix cache.

Needs root (or unprivileged user namespaces), iproute2 and npm; OpenCode itself is
installed by install_opencode.sh into a cache directory.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = Path(__file__).with_name("install_opencode.sh")
OPENCODE_TIMEOUT_S = 300
OUTPUT_TOKENS = 48
"""limit.output of the OpenCode model entry: OpenCode's max_tokens (small, to keep CPU runs short)."""
ACCOUNTING = re.compile(r"ds4d\.requests: (\S+) prompt (\d+) tokens = (\d+) reused")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


# --------------------------------------------------------------------------- test side


def _netns_problem() -> str | None:
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux / iproute2)"
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True,
                           check=False)
    if probe.returncode != 0:
        return f"cannot make a loopback-only network namespace: {probe.stderr.strip() or probe.returncode}"
    return None


@pytest.fixture(scope="module")
def opencode_binary() -> str:
    problem = _netns_problem()
    if problem:
        pytest.skip(problem)
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed; OpenCode comes from the npm registry")
    install = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=600, check=False)
    if install.returncode != 0:
        pytest.fail(f"install_opencode.sh failed:\n{install.stderr[-3000:]}")
    return install.stdout.strip().splitlines()[-1]


def run_scenario(tmp_path: Path, binary: str, daemon_args: list[str], turns: list[list[str]]) -> dict:
    """Run the driver in a fresh network namespace; return its report."""
    spec = {"work_dir": str(tmp_path), "binary": binary, "daemon_args": daemon_args, "turns": turns,
            "timeout_s": OPENCODE_TIMEOUT_S, "output_tokens": OUTPUT_TOKENS}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    budget = 240 + OPENCODE_TIMEOUT_S * len(turns)
    subprocess.run(["unshare", "-n", sys.executable, str(Path(__file__).resolve()), str(spec_path)],
                   cwd=REPO, timeout=budget, check=False)
    report_path = tmp_path / "report.json"
    assert report_path.is_file(), "the driver wrote no report"
    return json.loads(report_path.read_text())


def describe(report: dict) -> str:
    """What to read when an assertion fails."""
    runs = "\n".join(f"--- opencode run {i}: rc={r['rc']}\nstdout: {r['stdout'][-1500:]}\nstderr: {r['stderr'][-3000:]}"
                     for i, r in enumerate(report.get("runs", [])))
    requests = "\n".join(json.dumps(r) for r in report.get("requests", []))
    return (f"driver error: {report.get('error')}\n{runs}\n--- requests\n{requests}\n"
            f"--- daemon log (tail)\n{report.get('daemon_log', '')[-4000:]}")


def check_session(report: dict) -> tuple[int, int]:
    """Assertions every scenario shares; returns the prompt tokens of the session's first agent
    request and the tokens its last agent request (the second turn) reused."""
    info = describe(report)
    assert report.get("error") is None, info
    assert len(report["runs"]) == 2 and all(r["rc"] == 0 for r in report["runs"]), info
    chats = [r for r in report["requests"] if r["path"] == "/v1/chat/completions"]
    assert chats, info
    failed = [r for r in report["requests"] if r["status"] is None or r["status"] >= 400]
    assert not failed, info
    titles = [r for r in chats if r["consecutive_user_messages"]]
    assert titles and all(r["status"] == 200 for r in titles), info
    accounting = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in ACCOUNTING.finditer(report["daemon_log"])}
    assert len(accounting) == len(chats), info
    assert all(r["response_id"] in accounting for r in chats), info
    agent = [r for r in chats if r["tools"]]
    assert len(agent) >= 2 and len({r["session"] for r in agent}) == 1, info  # one session, two turns
    first_prompt, _ = accounting[agent[0]["response_id"]]
    _, reused = accounting[agent[-1]["response_id"]]
    return first_prompt, reused


def test_opencode_on_the_embedded_model(tmp_path, opencode_binary):
    started = time.monotonic()
    report = run_scenario(tmp_path, opencode_binary, ["--threads", "2", "--max-num-seqs", "4",
                                                      "--kv-cache-tokens", "24576"],
                          [["Reply", "with", "one", "short", "sentence", "about", "cats."],
                           ["--continue", "Now", "one", "about", "dogs."]])
    first_prompt, reused = check_session(report)
    assert reused > first_prompt // 2, describe(report)  # the second turn re-sent the first turn's prompt
    for run in report["runs"]:
        assert ANSI.sub("", run["stdout"]).strip(), describe(report)  # the model's answer was printed
    print(f"opencode session on {report['model']['id']} took {time.monotonic() - started:.0f} s")


def _tiny_v4_problem(checkpoint: Path) -> str | None:
    """Why ds4d.models.deepseek_v4 cannot serve a tiny checkpoint here, or None."""
    probe = ("import sys\nfrom pathlib import Path\n"
             "from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint\n"
             "path = write_tiny_checkpoint(Path(sys.argv[1]), seed=0)\n"
             "model = load_model(path)\nmodel.allocate_cache(4, 1)\nprint(path)\n")
    try:
        done = subprocess.run([sys.executable, "-c", probe, str(checkpoint)], cwd=REPO, capture_output=True,
                              text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return "writing and loading a tiny checkpoint took over 300 s"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["failed"])[-1]
    return None


def test_opencode_on_a_tiny_deepseek_v4(tmp_path, opencode_binary):
    checkpoint = tmp_path / "tiny-v4"
    problem = _tiny_v4_problem(checkpoint)
    if problem:
        pytest.skip(f"ds4d.models.deepseek_v4 cannot load a tiny checkpoint yet: {problem}")
    report = run_scenario(tmp_path, opencode_binary, ["--model", str(checkpoint), "--threads", "2",
                                                      "--max-num-seqs", "4"],
                          [["--thinking", "Reply", "with", "one", "short", "sentence."],
                           ["--thinking", "--continue", "Once", "more."]])  # a random model mostly reasons
    first_prompt, reused = check_session(report)
    assert reused > first_prompt // 2, describe(report)
    for run in report["runs"]:
        assert ANSI.sub("", run["stdout"]).strip(), describe(report)  # the model's answer was printed


def test_opencode_on_a_tiny_deepseek_v41(tmp_path, opencode_binary):
    """The same session on a tiny V4.1 sized for the real vocabulary (no tokenizer.json: the
    daemon derives V4.1's from V4's), so OpenCode's prompts tokenise as on the release, in
    V4.1's chat format (``<｜System｜>``, spaced DSML tags)."""
    from ds4d.models.deepseek_v41.make_tiny import write_tiny

    checkpoint = write_tiny(tmp_path / "tiny-v41", seed=0, tokenizer="v4",
                            max_position_embeddings=32768)  # OpenCode's first prompt is about 7.5K tokens
    report = run_scenario(tmp_path, opencode_binary, ["--model", str(checkpoint), "--threads", "1",
                                                      "--max-num-seqs", "4", "--tool-markup-guard"],
                          [["--thinking", "Reply", "with", "one", "short", "sentence."],
                           ["--thinking", "--continue", "Once", "more."]])
    first_prompt, reused = check_session(report)
    assert reused > first_prompt // 2, describe(report)
    assert "tokenizer splits" not in report["daemon_log"], describe(report)  # <｜System｜> is one token
    assert "ASSUMED ids (unconfirmed): <｜System｜> = 128799" in report["daemon_log"], describe(report)
    for run in report["runs"]:
        assert ANSI.sub("", run["stdout"]).strip(), describe(report)  # the model's answer was printed
    print(f"tiny V4.1 session: first agent prompt {first_prompt} tokens, second turn reused {reused}")


def test_opencode_on_a_tiny_deepseek_v4_gguf(tmp_path, opencode_binary):
    """The same session on a tiny DeepSeek-V4 GGUF file as llama.cpp's converter writes it (the BF16
    fixture of tests/fixtures/gguf_v4) grown to the real V4 vocabulary, so the daemon takes the V4
    tokenizer from the file's metadata and OpenCode's prompts tokenise as on the release."""
    from tests.unit.test_dsv4_gguf import FIXTURES, with_the_v4_vocabulary

    model = with_the_v4_vocabulary(FIXTURES / "bf16.gguf", tmp_path / "tiny-v4.gguf")
    report = run_scenario(tmp_path, opencode_binary, ["--model", str(model), "--threads", "2", "--max-num-seqs", "4"],
                          [["--thinking", "Reply", "with", "one", "short", "sentence."],
                           ["--thinking", "--continue", "Once", "more."]])
    first_prompt, reused = check_session(report)
    assert reused > first_prompt // 2, describe(report)
    assert "the vocabulary is DeepSeek-V4's: using the V4 tokenizer" in report["daemon_log"], describe(report)
    for run in report["runs"]:
        assert ANSI.sub("", run["stdout"]).strip(), describe(report)  # the model's answer was printed
    print(f"tiny V4 GGUF session: first agent prompt {first_prompt} tokens, second turn reused {reused}")


# --------------------------------------------------------------------------- driver (inside the namespace)


class RecordingProxy:
    """Forwards every request to the daemon unchanged and records what went through."""

    HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "accept-encoding"})

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.records: list[dict] = []

    async def handle(self, request):
        from aiohttp import ClientSession, ClientTimeout, web

        body = await request.read()
        record: dict = {"method": request.method, "path": request.path, "session": request.headers.get("x-session-id"),
                        "status": None, "tools": 0, "consecutive_user_messages": False, "response_id": None}
        self.records.append(record)
        try:
            payload = json.loads(body) if body else {}
            roles = [m.get("role") for m in payload.get("messages") or ()]
            record["tools"] = len(payload.get("tools") or ())
            record["consecutive_user_messages"] = any(a == b == "user" for a, b in itertools.pairwise(roles))
        except (ValueError, AttributeError):
            pass
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP_HEADERS}
        async with ClientSession(timeout=ClientTimeout(total=None)) as session, session.request(
                request.method, self.upstream + request.path_qs, data=body, headers=headers) as upstream:
            record["status"] = upstream.status
            response = web.StreamResponse(status=upstream.status, headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            head = b""
            try:
                async for chunk in upstream.content.iter_any():
                    if len(head) < 8192:
                        head += chunk
                        found = re.search(rb'"id":\s*"([^"]+)"', head)
                        record["response_id"] = found.group(1).decode() if found else None
                    if upstream.status >= 400:
                        record["error_body"] = head[:1000].decode(errors="replace")
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:
                record["client_closed"] = True
        return response


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _opencode_config(base_url: str, model: dict, output_tokens: int) -> dict:
    model_id = model["id"]
    return {
        "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
        "enabled_providers": ["local"], "model": f"local/{model_id}", "small_model": f"local/{model_id}",
        "provider": {"local": {
            "npm": "@ai-sdk/openai-compatible", "name": "ds4d",
            "options": {"baseURL": base_url, "apiKey": "sk-local-test"},
            "models": {model_id: {"name": model_id, "tool_call": True, "reasoning": False,
                                  "limit": {"context": model["max_model_len"], "output": output_tokens}}}}},
    }


def _opencode_env(home: Path, config: dict) -> dict[str, str]:
    """The environment of reference/opencode/env.sh, with a scratch HOME and TMPDIR (the binary unpacks a native
    library of about 5 MB into its temporary directory on each start and leaves it there)."""
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1",
           "TMPDIR": str(home / "tmp"), "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
           "NO_PROXY": "127.0.0.1,localhost", "npm_config_offline": "true",
           "OPENCODE_CONFIG_CONTENT": json.dumps(config)}
    for switch in ("AUTOUPDATE", "MODELS_FETCH", "LSP_DOWNLOAD", "SHARE", "DEFAULT_PLUGINS", "CLAUDE_CODE",
                   "EXTERNAL_SKILLS"):
        env[f"OPENCODE_DISABLE_{switch}"] = "1"
    return env


async def _wait_healthy(base: str, daemon, timeout_s: float = 240.0) -> dict:
    from aiohttp import ClientError, ClientSession

    deadline = time.monotonic() + timeout_s
    async with ClientSession() as session:
        while time.monotonic() < deadline:
            if daemon.returncode is not None:
                raise RuntimeError(f"the daemon exited with {daemon.returncode} during start")
            try:
                async with session.get(base + "/health") as health:
                    # 200 {"status": "loading"} while the model loads; "ok" once it serves
                    if health.status == 200 and (await health.json()).get("status") == "ok":
                        async with session.get(base + "/v1/models") as models:
                            return (await models.json())["data"][0]
            except ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the daemon was not healthy within {timeout_s:.0f} s")


async def _drive(spec: dict) -> dict:
    from aiohttp import web

    work = Path(spec["work_dir"])
    port = _free_port()
    report: dict = {"runs": [], "requests": [], "error": None, "model": None}
    log_path = work / "daemon.log"
    with log_path.open("wb") as log_file:
        daemon = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ds4d.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            *spec["daemon_args"], cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
            env={**os.environ, "DS4D_CONFIG": str(REPO / "etc" / "ds4d.toml"), "PYTHONUNBUFFERED": "1"})
    proxy = RecordingProxy(f"http://127.0.0.1:{port}")
    runner = web.AppRunner(_proxy_app(proxy), access_log=None)
    try:
        report["model"] = model = await _wait_healthy(f"http://127.0.0.1:{port}", daemon)
        await runner.setup()
        proxy_port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", proxy_port).start()
        config = _opencode_config(f"http://127.0.0.1:{proxy_port}/v1", model, spec["output_tokens"])
        home, project = work / "home", work / "project"
        project.mkdir(exist_ok=True)
        (project / "README.md").write_text("A scratch project for an OpenCode session.\n")
        env = _opencode_env(home, config)
        for words in spec["turns"]:
            started = time.monotonic()
            run = await asyncio.create_subprocess_exec(
                "timeout", str(spec["timeout_s"]), spec["binary"], "run", "--model", f"local/{model['id']}",
                "--print-logs", *words, cwd=project, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            stdout, stderr = await run.communicate()
            report["runs"].append({"rc": run.returncode, "stdout": stdout.decode(errors="replace"),
                                   "stderr": stderr.decode(errors="replace")[-20000:],
                                   "seconds": round(time.monotonic() - started, 1)})
            if run.returncode != 0:
                break
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        report["requests"] = proxy.records
        await runner.cleanup()
        if daemon.returncode is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(daemon.wait(), 40)
            except TimeoutError:
                daemon.kill()
                await daemon.wait()
        report["daemon_log"] = log_path.read_text(errors="replace")
    return report


def _proxy_app(proxy: RecordingProxy):
    from aiohttp import web

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    return app


if __name__ == "__main__":
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    spec_file = Path(sys.argv[1])
    result = asyncio.run(_drive(json.loads(spec_file.read_text())))
    (spec_file.parent / "report.json").write_text(json.dumps(result))
