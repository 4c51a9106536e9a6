"""Every command line README.md shows, run through the installed ``ds4d`` script as an operator types it.

``ds4d serve`` runs a live daemon on the embedded model; ``ds4d console`` runs in a pseudo-terminal of
120x40 against that daemon and against a replay file, and quits on ``q`` as an operator quits it.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from ds4d.registry import KINDS
from tests.daemon import REPO

DS4D = Path(sys.executable).parent / "ds4d"
README = REPO / "README.md"
REPLAY = REPO / "tests" / "tui" / "data" / "healthy.jsonl"
API_KEY = "sk-test-cli"
COMMANDS = ["serve", "config", "doctor", "calibrate", "plugins", "console", "bench", "make-tiny"]
BENCH_KINDS = ["embedded", "model", "parallel", "serve", "agent"]
PRINTED = ("ds4d listening on ", "ds4d ready on ")  # lines the daemon prints, shown in README.md as such
START_S = 180.0
# CSI sequences (cursor moves, styles), OSC and DCS strings, charset and keypad selections
ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1bP[^\x1b]*\x1b\\"
                     r"|\x1b[()][0-9A-Za-z]|\x1b[=>]")


def environment(**extra: str) -> dict[str, str]:
    """This environment without DS4D_* variables, reading the repository's etc/ds4d.toml."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DS4D_")}
    return {**env, "DS4D_CONFIG": str(REPO / "etc" / "ds4d.toml"), "PYTHONUNBUFFERED": "1", **extra}


def ds4d(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(DS4D), *args], check=False, capture_output=True, text=True, timeout=timeout,
                          env=env or environment())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Terminal:
    """A command on a pseudo-terminal of 120x40; :meth:`wait_for` reads the screen's text as drawn."""

    def __init__(self, *args: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.proc = subprocess.Popen([str(DS4D), *args], stdin=slave, stdout=slave, stderr=slave,
                                     env=environment(TERM="xterm-256color", COLUMNS="120", LINES="40"),
                                     start_new_session=True)
        os.close(slave)
        self.raw = b""

    @property
    def text(self) -> str:
        return ESCAPES.sub("", self.raw.decode(errors="replace"))

    def _read(self, seconds: float) -> bool:
        """Read what arrives within ``seconds``; False once the terminal is closed."""
        ready, _, _ = select.select([self.master], [], [], seconds)
        if ready:
            try:
                self.raw += os.read(self.master, 1 << 16)
            except OSError:  # the command exited and closed its side
                return False
        return True

    def wait_for(self, *texts: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(text in self.text for text in texts):
            if time.monotonic() > deadline or not self._read(0.2):
                missing = [text for text in texts if text not in self.text]
                raise AssertionError(f"not shown: {missing}\n{self.text[-3000:]}")

    def quit(self, timeout: float = 60.0) -> int:
        """Press q and return the exit status."""
        os.write(self.master, b"q")
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        return self.close()

    def close(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        returncode = self.proc.wait(30)
        os.close(self.master)
        return returncode


class Served:
    """``ds4d serve`` on a free 127.0.0.1 port with an API key, ready once /ready answers 200."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [str(DS4D), "serve", "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY,
                 "--threads", "2", "--max-context", "1024", "--max-num-seqs", "4", "--kv-cache-tokens", "8192"],
                stdout=log, stderr=subprocess.STDOUT, env=environment())

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def ready_status(self) -> int | None:
        request = urllib.request.Request(self.url + "/ready", headers={"Authorization": f"Bearer {API_KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return None

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while self.ready_status() != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ds4d serve exited with {self.proc.returncode}:\n{self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ds4d serve not ready after {START_S:.0f} s:\n{self.log}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One daemon for the module; the last test stops it with SIGTERM."""
    daemon = Served(tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        daemon.wait_ready()
        yield daemon
    finally:
        daemon.stop()


def readme_command_lines() -> list[str]:
    """Every `ds4d ...` code span of README.md that is a command line, once each."""
    spans = re.findall(r"`(ds4d [^`]+)`", README.read_text())
    return list(dict.fromkeys(span for span in spans if not span.startswith(PRINTED)))


def long_options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def declared_options(help_text: str) -> set[str]:
    """The long options a --help text declares (not the ones its descriptions mention)."""
    return set(re.findall(r"^  (?:-\w, )?(--[a-z][a-z0-9-]*)", help_text, re.M))


def test_the_readme_shows_commands():
    lines = readme_command_lines()
    assert {line.split()[1] for line in lines} == set(COMMANDS)


@pytest.mark.parametrize("line", readme_command_lines())
def test_every_flag_the_readme_shows_is_in_the_help(line):
    """`ds4d bench model [--profile] ...` in README.md: `ds4d bench model --help` lists --profile;
    `ds4d config [flags]`: `ds4d config --help` lists every flag of `ds4d serve --help`."""
    words = line.replace("\\|", "|").split()
    command = words[1]
    kinds = words[2].split("|") if command == "bench" and len(words) > 2 else [None]
    flags = long_options(line)
    if "[flags]" in words:
        flags |= declared_options(ds4d("serve", "--help").stdout) - {"--help"}
    for kind in kinds:
        path = [command] if kind is None else [command, kind]
        result = ds4d(*path, "--help")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: ds4d {' '.join(path)} "), result.stdout
        missing = flags - declared_options(result.stdout)
        assert not missing, f"{line}: {sorted(missing)} not in `ds4d {' '.join(path)} --help`"


def commands_table() -> list[str]:
    """The command lines of README.md's Commands table."""
    section = README.read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(ds4d [^`]+)` \|", section, re.M)


@pytest.mark.parametrize("line", [line for line in commands_table() if not line.startswith("ds4d bench ")])
def test_the_commands_table_shows_every_option(line):
    """A row with ``[flags]`` stands for the flags of `ds4d serve --help`; every other option is in the row."""
    command = line.split()[1]
    accepted = declared_options(ds4d(command, "--help").stdout) - {"--help"}
    if "[flags]" in line.split():
        accepted -= declared_options(ds4d("serve", "--help").stdout)
    missing = accepted - long_options(line)
    assert not missing, f"README.md's `{line}` lacks {sorted(missing)}"


def test_top_help_lists_the_commands_and_the_version():
    result = ds4d("--help")
    assert result.returncode == 0
    listed = re.search(r"\{([a-z,-]+)\}", result.stdout)
    assert listed and listed.group(1).split(",") == COMMANDS
    version = ds4d("--version")
    assert version.returncode == 0 and re.fullmatch(r"ds4d \S+\n", version.stdout)


def test_the_parser_imports_no_heavy_module():
    """`ds4d --help` stays fast: torch, Textual and aiohttp load only for the command that runs."""
    probe = ("import sys; from ds4d.cli import build_parser; build_parser(); "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'textual', 'aiohttp'}))")
    result = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("path", [[command] for command in COMMANDS] + [["bench", kind] for kind in BENCH_KINDS])
def test_help_of_every_command(path):
    result = ds4d(*path, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: ds4d {' '.join(path)} ")
    assert "-h, --help" in result.stdout


def test_bench_help_lists_every_kind_and_needs_one():
    result = ds4d("bench", "--help")
    assert all(re.search(rf"^\s+{kind}\s", result.stdout, re.M) for kind in BENCH_KINDS), result.stdout
    missing = ds4d("bench")
    assert missing.returncode == 2 and "KIND" in missing.stderr


def test_config_shows_each_value_and_its_source():
    result = ds4d("config", "--port", "8123", env=environment(DS4D_PREFILL_CHUNK="1024"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"# config file: {REPO / 'etc' / 'ds4d.toml'}")
    assert re.search(r"^port += 8123 +\(cli\)$", result.stdout, re.M)
    assert re.search(r"^prefill_chunk += 1024 +\(env\)$", result.stdout, re.M)
    assert re.search(r"^host += '127\.0\.0\.1' +\(default\)$", result.stdout, re.M)


def test_doctor_table_and_json_name_the_same_checks(tmp_path):
    """Each run's exit status follows its own failures (RAM and swap may change between the two runs)."""
    table = ds4d("doctor", "--cache-disk-dir", str(tmp_path), timeout=300)
    rows = re.findall(r"^(OK|WARN|FAIL|SKIP) +(\w+)", table.stdout, re.M)
    summary = re.search(r"^(\d+) ok, (\d+) warn, (\d+) fail, (\d+) skip$", table.stdout, re.M)
    assert rows and summary, table.stdout + table.stderr
    assert [int(count) for count in summary.groups()] == [
        sum(status == word for status, _ in rows) for word in ("OK", "WARN", "FAIL", "SKIP")]
    assert table.returncode == (1 if int(summary.group(3)) else 0)
    as_json = ds4d("doctor", "--cache-disk-dir", str(tmp_path), "--json", timeout=300)
    checks = json.loads(as_json.stdout)
    assert [check["name"] for check in checks] == [name for _, name in rows]
    assert as_json.returncode == (1 if any(check["status"] == "fail" for check in checks) else 0)
    cache_disk = next(check for check in checks if check["name"] == "cache_disk")
    assert cache_disk["status"] != "skip"  # --cache-disk-dir reached the checks


def test_plugins_lists_every_kind_with_the_built_ins():
    result = ds4d("plugins")
    assert result.returncode == 0, result.stderr
    headings = [line.split(":")[0] for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert headings == list(KINDS)
    for name in ("llama", "deepseek_v4", "chatml", "dsml", "fcfs", "ram", "disk"):
        assert re.search(rf"^  {name} +ds4d\.\S+:\w+  \(entry point\)$", result.stdout, re.M), name


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("make-tiny") / "v4"
    result = ds4d("make-tiny", "--family", "deepseek_v4", "--out", str(out), "--layers", "0,4", timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"to {out}: 2 layers, compress ratios [0, 4]" in result.stdout
    return out


def test_make_tiny_writes_an_official_format_checkpoint(tiny_checkpoint):
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["compress_ratios"][:2] == [0, 4]
    shards = sorted(tiny_checkpoint.glob("*.safetensors"))
    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    assert shards and {shard.name for shard in shards} == set(index["weight_map"].values())


def test_make_tiny_writes_a_deepseek_v41_checkpoint(tmp_path):
    out = tmp_path / "v41"
    result = ds4d("make-tiny", "--family", "deepseek_v41", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"DeepSeek-V4.1 checkpoint to {out}" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["text_config"]["engram_layer_ids"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {shard.name for shard in out.glob("*.safetensors")} == set(index["weight_map"].values())
    assert (out / "tokenizer.json").is_file()


def test_make_tiny_sizes_a_deepseek_v41_checkpoint_for_the_real_vocabulary(tmp_path):
    out = tmp_path / "v41"
    result = ds4d("make-tiny", "--family", "deepseek_v41", "--tokenizer", "v4", "--layers", "0,2,1",
                  "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["vocab_size"], text["engram_compressed_vocab_size"]) == (129280, 99092)
    assert not (out / "tokenizer.json").exists()  # the family derives it at load
    refused = ds4d("make-tiny", "--family", "deepseek_v4", "--tokenizer", "v4", "--out", str(tmp_path / "v4"))
    assert refused.returncode != 0 and "--tokenizer is for --family deepseek_v41" in refused.stderr


def test_make_tiny_knows_only_the_deepseek_families(tmp_path):
    result = ds4d("make-tiny", "--family", "llama", "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and "deepseek_v41" in result.stderr


def test_calibrate_writes_routing_counts(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The quick brown fox jumps over the lazy dog."}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "Hello there"}]}) + "\n")
    out = tmp_path / "counts.json"
    result = ds4d("calibrate", "--model", str(tiny_checkpoint), "--threads", "1", "--prompts", str(prompts),
                  "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("2 prompts, ") and f'expert_calibration = "{out}"' in result.stdout
    counts = json.loads(out.read_text())
    assert counts["prompts"] == 2
    assert len(counts["counts"]) == 2  # a row per layer: --layers 0,4


def test_console_replays_a_stats_log():
    terminal = Terminal("console", "--replay", str(REPLAY), "--interval", "0.5")
    try:
        terminal.wait_for(f"replay {REPLAY.name}", "GPU memory", "host RAM", "decode", "tok/s",
                          "chatcmpl-9f1c2ab4e07d")
    finally:
        returncode = terminal.quit()
    assert returncode == 0


def test_console_refuses_a_missing_replay_and_a_bad_interval(tmp_path):
    missing = ds4d("console", "--replay", str(tmp_path / "absent.jsonl"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    zero = ds4d("console", "--interval", "0")
    assert zero.returncode == 2 and "must be a positive number of seconds" in zero.stderr


def test_serve_answers_the_readme_client(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=16, messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens >= 1
    keyless = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):  # --api-key reached the daemon
        keyless.models.list()


def test_console_watches_the_live_daemon(served):
    terminal = Terminal("console", "--url", served.url, "--api-key", API_KEY, "--interval", "0.5")
    try:
        terminal.wait_for(f"live {served.url}", "● ready", "smollm2", "family=llama", "host RAM", "tok/s")
    finally:
        returncode = terminal.quit()
    assert returncode == 0


def test_console_without_the_key_says_so(served):
    terminal = Terminal("console", "--url", served.url, "--interval", "0.5")
    try:
        terminal.wait_for("HTTP 401", "check --api-key")
    finally:
        returncode = terminal.quit()
    assert returncode == 0


def test_serve_exits_cleanly_on_sigterm(served):
    """Last in the module: it stops the daemon the tests above share."""
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0
    log = served.log
    assert f"ds4d listening on {served.url}" in log and f"ds4d ready on {served.url}" in log
    assert "shutting down" in log and "INFO ds4d: stopped" in log
