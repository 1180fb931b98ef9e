"""The turn loop of `ggrun run`, as llama-completion runs it: the prompt is evaluated (and echoed), the
model answers, and in the interactive modes each line of input is one more turn whose tokens follow
the cached ones, so that the history is never evaluated again.

Three modes, as in llama.cpp: completion (the text continues the prompt, ` [end of text]` when the
model ends it), conversation (`-cnv`: turns go through the chat template and `> ` asks for the next
one; `-st` answers once) and plain interactive (`-i`: input is appended as text, between --in-prefix
and --in-suffix). In the interactive modes Ctrl-C ends the reply and the prompt comes back; anywhere
else, and at the prompt, it ends the run (core.errors.Interrupted, raised after the text so far).
Text goes to stdout; the per-turn figures and notices go to stderr.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator, TextIO

from ggrun.cli.interrupt import Interrupt
from ggrun.cli.run_settings import RunSettings, process_escapes
from ggrun.core.backends.cpu import set_threads
from ggrun.core.errors import BadInput, Interrupted, RuntimeFailure
from ggrun.core.llm.generate import (STOP_CONTEXT_FULL, STOP_EOG, STOP_INTERRUPTED, Generation, GenerationStats,
                                     ReversePrompts, common_prefix, keep_for_shift)
from ggrun.core.llm.sampling import Sampler
from ggrun.core.llm.session import Session
from ggrun.loaders.chat import ChatTemplate
from ggrun.loaders.tokenizer import StreamDecoder

DEFAULT_PROMPT = "The three most useful things to know about the ocean are"


class Conversation:
    """One run of `ggrun run` on a session: call run() once; `gen.totals` has the figures afterwards."""

    def __init__(self, session: Session, settings: RunSettings, template: ChatTemplate | None,
                 conversation: bool, out: TextIO | None = None, inp: TextIO | None = None,
                 err: TextIO | None = None) -> None:
        self.session = session
        self.s = settings
        self.tok = session.model.tokenizer
        self.conversation = conversation
        self.chat = template if conversation and settings.use_chat_template else None
        self.out = out or sys.stdout
        self.inp = inp or sys.stdin
        self.err = err or sys.stderr
        sampling = settings.sampling
        if settings.ignore_eos:  # llama.cpp: --ignore-eos is a logit bias of -inf on every end-of-generation token
            sampling = replace(sampling, logit_bias=sampling.logit_bias + tuple((t, float("-inf"))
                                                                               for t in sorted(self.tok.eog_ids)))
        for tid, _ in sampling.logit_bias:
            if not 0 <= tid < self.tok.n_vocab:
                raise BadInput(f"--logit-bias: token id {tid} is outside the vocabulary of {self.tok.n_vocab} tokens")
        self.gen = Generation(session, Sampler(sampling, session.n_ctx), settings.context_shift)
        self.messages: list[dict] = []
        self.text = ""  # what the sequence's tokens spell, control tokens included: a turn adds what follows it
        self.pending: list[int] = []  # tokens that close a cut reply, evaluated with the next turn
        self.prompt_st = GenerationStats()  # the evaluation before the reply to come
        self.dec = StreamDecoder(self.tok, special=settings.special)  # stdout's text outside conversation mode
        self.written = False  # any text on stdout yet (then the run ends its line)
        self.interactive = False

    # ---- the run --------------------------------------------------------------------------------------

    def run(self, prompt: str | None, system: str | None) -> None:
        """Evaluate the prompt (-p or -f; with -sys in a conversation), answer it, and in the interactive
        modes take turns until the end of input."""
        s = self.s
        if self.chat is not None:
            if system:
                self.messages.append({"role": "system", "content": system})
            if prompt:
                self.messages.append({"role": "user", "content": prompt})
            self.text = self.chat.render(self.messages, add_generation_prompt=bool(prompt)) if self.messages else ""
            answer_first = bool(prompt)
        else:
            self.text = prompt if prompt is not None else ("" if self.conversation or s.interactive
                                                           or s.interactive_first else DEFAULT_PROMPT)
            answer_first = not (s.interactive_first or (self.conversation and not prompt))
        self.interactive = (self.conversation and not (s.single_turn and answer_first)) or s.interactive \
            or s.interactive_first
        tokens = self.tok.tokenize(self.text, add_special=True, parse_special=True)
        if answer_first and not tokens:
            raise BadInput("the prompt is empty (give -p TEXT or -f FILE)")
        if len(tokens) > self.session.n_ctx:
            raise BadInput(f"the prompt is {len(tokens)} tokens, longer than the context (-c {self.session.n_ctx})")
        add_bos = bool(tokens) and tokens[0] == self.tok.bos_id and self.tok.add_bos
        self.gen.n_keep = keep_for_shift(s.n_keep, tokens, add_bos)
        if s.verbose_prompt and tokens:
            self._print_tokens(tokens)
        self._print_header()
        if tokens and not self._turn(tokens, answer=answer_first, shown=lambda: self._show_prompt(tokens, prompt)):
            return
        if self.interactive:
            self._take_turns()

    def _take_turns(self) -> None:
        while True:
            line = self._read_line()
            if line is None:
                return
            if self.conversation and line.strip() in ("/exit", "/clear"):
                if line.strip() == "/exit":
                    return
                self._clear()
                continue
            if not line and self.conversation:
                continue
            tokens = self._turn_tokens(line)
            if len(tokens) > self.session.n_ctx:
                self._note(f"context full: this turn needs {len(tokens)} tokens, more than the context "
                           f"(-c {self.session.n_ctx}); start again with a larger -c, or use --context-shift")
                return
            if self.s.verbose_prompt:
                self._print_tokens(tokens[common_prefix(self.gen.tokens, tokens):])
            if not self._turn(tokens):
                return
            if self.s.single_turn:
                return

    # ---- turns ----------------------------------------------------------------------------------------

    def _turn_tokens(self, line: str) -> list[int]:
        """The whole sequence once `line` is added: the cached tokens, what closes the last reply, and the
        turn's own tokens (the chat template's text after what the sequence spells; a template that renders
        the history differently from what the sequence holds gets a whole new rendering, of which only the
        part after the common prefix is evaluated). An empty line in plain interactive mode adds nothing:
        generation goes on. With --context-shift, old tokens make room for the new ones first."""
        if self.s.escape:
            line = process_escapes(line)
        if self.chat is None:
            new = self.tok.tokenize(self.s.in_prefix, add_special=False, parse_special=True) \
                + self.tok.tokenize(line, add_special=False, parse_special=False) \
                + self.tok.tokenize(self.s.in_suffix, add_special=False, parse_special=True) if line else []
        else:
            self.messages.append({"role": "user", "content": line})
            full = self.chat.render(self.messages, add_generation_prompt=True)
            added, self.text = full[len(self.text):] if full.startswith(self.text) else None, full
            if added is None:
                self.pending = []
                return self.tok.tokenize(full, add_special=True, parse_special=True)
            new = self.tok.tokenize(added, add_special=False, parse_special=True)
        new, self.pending = self.pending + new, []
        if self.s.context_shift:
            shifted = self.gen.make_room(len(new))
            if shifted.n_shifts:
                self._note(f"context shifted, {shifted.n_discarded} tokens discarded (--keep {self.gen.n_keep})")
        return self.gen.tokens + new

    def _clear(self) -> None:
        """/clear: forget the conversation but its system prompt."""
        self.messages = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        self.text = self.chat.render(self.messages, add_generation_prompt=False) if self.chat and self.messages else ""
        self.gen.reset()
        self.pending = []
        tokens = self.tok.tokenize(self.text, add_special=True, parse_special=True)
        self._note("chat history cleared")
        if tokens:
            self._turn(tokens, answer=False)

    def _turn(self, tokens: list[int], answer: bool = True, shown: Callable[[], None] | None = None) -> bool:
        """Evaluate `tokens`, then echo them (`shown`: as llama-completion, once they are evaluated) and,
        with `answer`, generate the reply, in one armed stretch: a Ctrl-C during the prompt's last
        micro-batch still stops what follows. False when the run must end here."""
        with self._interruptible() as stop:
            if not self._evaluate(tokens, stop):
                return True
            if shown is not None:
                shown()
            return self._reply(stop) if answer else True

    def _evaluate(self, tokens: list[int], stop: Interrupt) -> bool:
        """Make the sequence `tokens` (only what the cache lacks is computed); False when Ctrl-C came first
        in an interactive mode (the prompt comes back). Non-interactive, Ctrl-C ends the run."""
        if self.s.threads_batch is not None and self.s.threads_batch != self.s.threads:
            set_threads(self.s.threads_batch)
        self.prompt_st = self.gen.set_tokens(tokens)
        if self.prompt_st.stop_reason != STOP_INTERRUPTED and not stop.requested:
            return True
        self._end_line()
        if not self.interactive:
            raise Interrupted()
        return False

    def _reply(self, stop: Interrupt) -> bool:
        """Generate the answer and stream it; False when the run must end here (the context is full)."""
        if self.s.threads_batch is not None and self.s.threads_batch != self.s.threads:
            set_threads(self.s.threads)
        dec = StreamDecoder(self.tok, special=self.s.special) if self.conversation else self.dec
        pieces: list[str] = []
        reverse = ReversePrompts(self.tok, self.s.reverse_prompts, self.interactive) if self.s.reverse_prompts else None

        def emit(tid: int) -> None:
            piece = dec.feed(tid)
            pieces.append(piece)
            self._write(piece)

        try:
            out, st = self.gen.generate(self.s.n_predict, emit, stop=reverse)
        except RuntimeFailure:
            self.out.write(dec.flush() + ("\n" if "".join(pieces) else ""))
            self.out.flush()
            raise
        pieces.append(dec.flush())
        self._write(pieces[-1])
        interrupted = st.stop_reason == STOP_INTERRUPTED or stop.requested
        self._after_reply(out, st, "".join(pieces), interrupted)
        if st.stop_reason == STOP_CONTEXT_FULL:
            self._context_full(st)
            return False
        if interrupted and not self.interactive:
            raise Interrupted()
        return True

    def _after_reply(self, out: list[int], st: GenerationStats, reply: str, interrupted: bool) -> None:
        """End the reply's line as llama-completion does, and keep the conversation's record of it."""
        if st.n_shifts:
            self._note(f"context shifted {st.n_shifts} time{'s' if st.n_shifts > 1 else ''}, "
                       f"{st.n_discarded} tokens discarded (--keep {self.gen.n_keep})")
        if not self.interactive:
            self.out.write(" [end of text]\n" if st.stop_reason == STOP_EOG else "\n" if self.written else "")
            self.out.flush()
            return
        if self.conversation or st.stop_reason in (STOP_EOG, STOP_INTERRUPTED):  # -i: input goes on the text's line
            self.out.write("\n")
            self.out.flush()
        if self.conversation or self.s.verbose:
            self._turn_figures(st)
        if self.chat is not None:
            self.messages.append({"role": "assistant", "content": reply})
            said = out + ([self.gen.tokens[-1]] if st.stop_reason == STOP_EOG else [])
            self.text += b"".join(self.tok.token_to_piece(t) for t in said).decode("utf-8", "replace")
            if st.stop_reason != STOP_EOG:  # a cut reply is closed, as llama.cpp does after Ctrl-C
                closing = self.tok.eot_id if self.tok.eot_id is not None else self.tok.eos_id
                if closing is not None:
                    self.pending = [closing]
                    self.text += self.tok.token_to_piece(closing).decode("utf-8", "replace")
        elif st.stop_reason == STOP_EOG and self.s.reverse_prompts:  # llama.cpp hands over with the first reverse prompt
            first = self.s.reverse_prompts[0]
            self.pending = self.tok.tokenize(first, add_special=False, parse_special=True)
            self.out.write(first)
            self.out.flush()

    def _context_full(self, st: GenerationStats) -> None:
        why = " (--keep leaves nothing to discard)" if self.s.context_shift else \
            "; --context-shift keeps going (discarding old tokens), or give a larger -c"
        self._note(f"context full: generation stopped after {st.n_sampled} tokens at the end of the context "
                   f"(-c {self.session.n_ctx}){why}")

    # ---- input and output -----------------------------------------------------------------------------

    def _read_line(self) -> str | None:
        """One turn of input (lines ending in a backslash go on to the next line); None at end of input.
        Ctrl-C here ends the run. From a terminal the terminal echoes it; otherwise it is echoed."""
        marker = "> " if self.conversation else self.s.in_prefix
        if self.conversation and self.written:
            self.out.write("\n")
        lines: list[str] = []
        while True:
            try:
                line = self._read_one(marker if not lines else "")
            except KeyboardInterrupt:
                self._end_line()
                raise Interrupted() from None
            if line is None:
                self._end_line()
                return "\n".join(lines) if lines else None
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            if self.s.in_suffix and self.chat is None:
                self.out.write(self.s.in_suffix)
                self.out.flush()
            return "\n".join(lines)

    def _read_one(self, marker: str) -> str | None:
        self.out.write(marker)
        self.out.flush()
        if self.inp.isatty() and self.inp is sys.stdin:  # the terminal's line editing; it echoes the line
            try:
                return input()  # input(marker) would write the marker to stderr
            except EOFError:
                return None
        line = self.inp.readline()
        if not line:
            return None
        line = line[:-1] if line.endswith("\n") else line
        if self.s.display_prompt:
            self.out.write(line + "\n")
        self.out.flush()
        return line

    def _show_prompt(self, tokens: list[int], prompt: str | None) -> None:
        if not self.s.display_prompt:
            return
        if self.conversation:
            if prompt:
                self._write(f"> {prompt}\n")
        else:
            self._write("".join(self.dec.feed(t) for t in tokens))

    def _print_header(self) -> None:
        """llama-completion's lines before generating: the seed (to repeat a run), the run's shape, and
        in the interactive modes what the keys do."""
        p = self.session.params
        print(f"ggrun: sampler seed: {self.gen.sampler.seed}", file=self.err)
        print(f"ggrun: generate: n_ctx = {p.n_ctx}, n_batch = {p.n_batch}, n_predict = {self.s.n_predict}, "
              f"n_keep = {self.gen.n_keep}", file=self.err)
        if self.interactive and self.inp.isatty():
            print("ggrun: == running in interactive mode ==\n"
                  " - Ctrl-C stops a reply; Ctrl-C at the prompt or Ctrl-D ends the run.\n"
                  " - End a line with '\\' to go on to another line." +
                  ("\n - /clear forgets the conversation, /exit ends it." if self.conversation else ""), file=self.err)
        self.err.flush()

    def _print_tokens(self, tokens: list[int]) -> None:
        """--verbose-prompt: each token and its text, as llama.cpp prints them."""
        print(f"ggrun: number of tokens in prompt = {len(tokens)}", file=self.err)
        for t in tokens:
            piece = self.tok.token_to_piece(t).decode("utf-8", "replace")
            print(f"{t:6d} -> '{piece}'", file=self.err)
        self.err.flush()

    def _turn_figures(self, st: GenerationStats) -> None:
        """One line per reply, like llama-cli's: what the turn evaluated (the cache held the rest) and how fast."""
        p = self.prompt_st
        prompt_tps = p.n_prompt / p.prompt_s if p.prompt_s > 0 else 0.0
        gen_tps = st.n_eval / st.eval_s if st.eval_s > 0 else 0.0
        print(f"[ Prompt: {p.n_prompt} new tokens, {p.n_reused} cached, {prompt_tps:.1f} t/s | "
              f"Generation: {st.n_sampled - (st.stop_reason == STOP_EOG)} tokens, "
              f"{gen_tps:.1f} t/s ]", file=self.err)
        self.err.flush()
        self.prompt_st = GenerationStats()

    def _note(self, text: str) -> None:
        self.out.flush()
        print(f"ggrun: {text}", file=self.err)
        self.err.flush()

    def _write(self, text: str) -> None:
        if text:
            self.written = True
            self.out.write(text)
            self.out.flush()

    def _end_line(self) -> None:
        """The text so far gets its newline (Ctrl-C, end of input)."""
        tail = self.dec.flush()
        if tail or self.written:
            self.out.write(tail + "\n")
            self.out.flush()

    @contextmanager
    def _interruptible(self) -> Iterator[Interrupt]:
        """Ctrl-C as a polled request while the session computes (cli.interrupt); the session stops
        polling afterwards, so that a request never outlives its stretch."""
        with Interrupt() as stop:
            stop.watch(self.session)
            try:
                yield stop
            finally:
                self.session.interrupt = None
