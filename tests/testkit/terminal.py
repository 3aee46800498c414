"""A real terminal for interactive commands: a command in a detached tmux session on a private socket, driven
by ``send-keys`` and read by ``capture-pane``, as a person at a keyboard would use it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

TMUX = shutil.which("tmux")
EXIT_MARK = "[exited "
PROMPT = ">>>"  # the input prompt as captured (trailing blank dropped)


class Terminal:
    """``python -m mlxkv ARGS`` in a 200x50 tmux window; ``close()`` ends the tmux server of this terminal only.

    Args:
        args: the mlxkv command line after ``mlxkv``.
        env: extra environment variables.
        cwd: the working folder (the repository root, so the checkout's code runs).
    """

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path):
        assert TMUX is not None, "tmux is not installed"
        self.socket = f"mlxkv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "mlxkv", *args])
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # The shell says how the command ended and keeps the pane open for the last capture.
        script = f"cd {shlex.quote(str(cwd))} && env {exports} {command}; echo '{EXIT_MARK}'$?']'; sleep 600"
        self._tmux("new-session", "-d", "-s", "chat", "-x", "200", "-y", "50", script)

    def _tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def screen(self) -> str:
        """Everything the pane shows and scrolled past, wrapped lines joined, trailing blanks dropped."""
        text = self._tmux("capture-pane", "-p", "-J", "-S", "-2000", "-t", "chat")
        return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")

    def type(self, text: str) -> None:
        """Type ``text`` and press Enter."""
        self._tmux("send-keys", "-t", "chat", "-l", text)
        self._tmux("send-keys", "-t", "chat", "Enter")

    def paste(self, text: str) -> None:
        """Paste ``text`` as a terminal pastes (bracketed paste: one event for the application, not a key each)."""
        self._tmux("set-buffer", "-b", "paste", text)
        self._tmux("paste-buffer", "-p", "-d", "-b", "paste", "-t", "chat")

    def key(self, name: str) -> None:
        """Press a key (tmux names: ``C-c``, ``C-d``, ``Up``)."""
        self._tmux("send-keys", "-t", "chat", name)

    def wait_for(self, pattern: str, timeout: float = 60, count: int = 1) -> str:
        """Wait until the regex ``pattern`` appears ``count`` times on the screen; returns the screen."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if len(re.findall(pattern, screen, re.MULTILINE)) >= count:
                return screen
            if EXIT_MARK in screen or time.monotonic() > deadline:
                raise AssertionError(f"waited for {pattern!r} x{count}; the terminal shows:\n{screen}")
            time.sleep(0.1)

    def at_prompt(self, after: int = 0) -> list[str] | None:
        """The screen's lines when the command waits at an empty input prompt (``>>>``) on a line past ``after``."""
        lines = self.screen().splitlines()
        return lines if len(lines) > after and lines[-1] == PROMPT else None

    def send(self, line: str, timeout: float = 60) -> str:
        """Type ``line`` at the prompt and wait for the next prompt; returns what the command printed for it."""
        lines = self.screen().splitlines()
        start = len(lines) - 1  # the prompt line the text is typed on
        assert lines and lines[-1] == PROMPT, f"not at a prompt:\n{self.screen()}"
        self.type(line)
        deadline = time.monotonic() + timeout
        while (now := self.at_prompt(start + 1)) is None:
            if EXIT_MARK in self.screen() or time.monotonic() > deadline:
                raise AssertionError(f"no prompt after {line!r}; the terminal shows:\n{self.screen()}")
            time.sleep(0.1)
        assert now[start] == f"{PROMPT} {line}".rstrip(), now[start]
        return "\n".join(now[start + 1:-1])

    def exit_status(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(re.escape(EXIT_MARK) + r"(\d+)\]", self.screen())
            if found:
                return int(found.group(1))
            time.sleep(0.1)
        raise AssertionError(f"the command did not exit; the terminal shows:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True)
