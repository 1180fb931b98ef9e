"""Conversation mode driven as a person drives it: `ggrun run` on a pseudo-terminal (its controlling
terminal, so that typing Ctrl-C sends SIGINT through the terminal's line discipline). Two turns, the
second evaluating only its own tokens (the per-reply figures line says how many were new and how many
the cache held); Ctrl-C in the middle of a reply ends the reply and the prompt comes back; Ctrl-C at
the prompt ends the run with the timing block and exit 130; Ctrl-D ends it with exit 0."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import subprocess
import termios
import threading
import time

import pytest

from ggrun.loaders.synthetic import write_tiny_llama
from tests.cli.runner import ENTRY, REPO
from tests.cli.test_run_output import CHAT_TEMPLATE, EOT_ID, tiny_tokenizer

FIGURES = re.compile(r"^\[ Prompt: (\d+) new tokens, (\d+) cached, [\d.]+ t/s \| Generation: (\d+) tokens", re.M)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("pty") / "chat.gguf", n_vocab=EOT_ID + 2,
                            extra_metadata={"tokenizer.chat_template": CHAT_TEMPLATE})


class Terminal:
    """`ggrun run ARGS` with a pseudo-terminal as stdin, stdout and controlling terminal; stderr piped."""

    def __init__(self, *args: str) -> None:
        master, slave = pty.openpty()
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([*ENTRY, "run", *args], stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                                     cwd=REPO, env=env, start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.master = master
        self.out, self.err = bytearray(), bytearray()
        self._threads = [threading.Thread(target=self._pump, args=(master, self.out), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr.fileno(), self.err), daemon=True)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(fd: int, into: bytearray) -> None:
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:  # the terminal's other end closed
                return
            if not data:
                return
            into += data

    @property
    def stdout(self) -> str:
        return self.out.decode("utf-8", "replace").replace("\r\n", "\n")

    @property
    def stderr(self) -> str:
        return self.err.decode("utf-8", "replace")

    def wait_for(self, condition, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or self.proc.poll() is not None and not condition():
                raise AssertionError(f"gave up waiting\nstdout: {self.stdout!r}\nstderr: {self.stderr}")
            time.sleep(0.02)

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join(5)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


def test_two_turns_reuse_the_cache_and_ctrl_d_ends(chat_model):
    term = Terminal("-m", str(chat_model), "-n", "4", "--temp", "0", "--ignore-eos")
    try:
        term.wait_for(lambda: term.stdout.endswith("> ") and "Ctrl-C stops a reply" in term.stderr)  # help on a terminal
        term.type(b"hello\n")
        term.wait_for(lambda: len(FIGURES.findall(term.stderr)) == 1 and term.stdout.endswith("> "))
        term.type(b"world\n")
        term.wait_for(lambda: len(FIGURES.findall(term.stderr)) == 2 and term.stdout.endswith("> "))
        term.type(b"\x04")  # Ctrl-D: end of input
        assert term.finish() == 0, term.stderr
    finally:
        term.close()
    (new1, cached1, gen1), (new2, cached2, _) = [tuple(map(int, t)) for t in FIGURES.findall(term.stderr)]
    n_tokens = tiny_tokenizer(chat_model)
    assert (cached1, gen1) == (0, 4)
    turn2 = n_tokens("\n<|reserved_0|>user\nworld<|endoftext|>\n<|reserved_0|>assistant\n")
    assert new2 == 1 + 1 + turn2  # the reply's undecoded last token, the <|endoftext|> closing it, the turn
    assert cached2 == new1 + gen1 - 1  # all of turn 1 and its reply came from the cache
    assert "hello\n" in term.stdout and "world\n" in term.stdout  # the terminal echoed what was typed
    assert "total time" in term.stderr


def test_ctrl_c_ends_the_reply_then_ends_the_run_at_the_prompt(chat_model):
    """With no limit on a reply (-n -1, --ignore-eos, context shifts), only Ctrl-C ends it: the prompt
    comes back, twice; Ctrl-C at the prompt then ends the run: timing block, `interrupted`, exit 130."""
    term = Terminal("-m", str(chat_model), "-n", "-1", "--temp", "0", "--ignore-eos", "--context-shift", "-c", "64")
    try:
        for turn, text in enumerate((b"hello\n", b"again\n"), start=1):
            term.wait_for(lambda: term.stdout.endswith("> "))
            term.type(text)
            before = len(term.stdout)
            term.wait_for(lambda: len(term.stdout) > before + 40)  # the reply is streaming
            term.type(b"\x03")
            term.wait_for(lambda: len(FIGURES.findall(term.stderr)) == turn and term.stdout.endswith("> "))
            assert term.proc.poll() is None
        term.type(b"\x03")  # at the prompt
        code = term.finish()
    finally:
        term.close()
    assert code == 130, term.stderr
    assert term.stderr.splitlines()[-1] == "interrupted"
    assert "total time" in term.stderr and "Traceback" not in term.stderr
    generated = [int(g) for _, _, g in FIGURES.findall(term.stderr)]
    assert all(g > 10 for g in generated), generated
