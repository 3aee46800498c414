"""``mlxkv chat``: talk to a model in the terminal; the KV cache persists across turns (:mod:`mlxkv.chat`).

Thin: parse options, load the model, then a read-answer loop (prompt_toolkit line editing and history on a
terminal, plain lines from a pipe) whose ``/commands`` call the library. Answers go to standard output; the
banner, the commands' replies, markers and errors to standard error, so a piped chat's output is the answers.
MLX is imported inside the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from mlxkv import rules
from mlxkv.cli import shared_options as options
from mlxkv.cli.interrupt import StopOnCtrlC
from mlxkv.cli.options import (
    KV_PANEL,
    SAMPLING_PANEL,
    overflow_config,
    sampling_defaults,
    with_revision,
)
from mlxkv.cli.validate import (add_extra_eos, check_draft_model, check_folder_option, refuse_unused,
                                refuse_useless_dequantize, unused_sampling)

HELP = """commands:
  /help            this list
  /reset           start a new conversation (the system message stays)
  /system TEXT     set the system message (/system alone removes it)
  /save NAME       save the conversation and its KV cache as session NAME
  /load NAME       continue saved session NAME
  /sessions        list the saved sessions
  /stats           context and KV cache size, the last turn's prefill and decode figures
  /history         the conversation so far (shown on --resume too)
  /undo            drop the last message and its answer
  /retry           answer the last message again (with --temp above 0, a new draw)
  /image FILE      attach an image to your next message (a vision-language model; pip install "mlxkv[vision]")
  /set             show the sampling settings; /set NAME VALUE changes one (temp, top-p, top-k, min-p,
                   max-tokens, repetition-penalty, seed; stop TEXT, or stop none)
  /exit, /quit     leave (Ctrl-D too); Ctrl-C stops an answer, or its prefill
  \"\"\"              on a line of its own (or starting a message): a message of several lines, ended by \"\"\"
                   (Esc then Enter also inserts a new line at a terminal)"""

#: Chat's own defaults and help where they differ from ``generate``'s: a chat answer is longer than a completion
#: test, and its KV cache is dense (one conversation) and capped by dropping whole turns.
CHAT_MAX_TOKENS = typer.Option(512, "--max-tokens", "-n", callback=options.MAX_TOKENS.callback,
                               rich_help_panel=SAMPLING_PANEL,
                               help="Most tokens per answer (an answer cut there is marked); the context's end "
                                    "cuts one too.")
CHAT_MAX_KV_SIZE = typer.Option(None, "--max-kv-size", callback=options.MAX_KV_SIZE.callback, metavar="TOKENS",
                                rich_help_panel=KV_PANEL,
                                help=f"Most tokens of context ({rules.MAX_KV_SIZE.notation}); the earliest turns "
                                     "are dropped past it (default: the model's context length).")
CHAT_KV_OVERFLOW = typer.Option("preempt", "--kv-overflow", callback=options.KV_OVERFLOW.callback,
                                metavar="[preempt|window|h2o|offload]", rich_help_panel=KV_PANEL,
                                help="Past --kv-overflow-budget tokens: preempt (no cap), window (sinks + recent), "
                                     "h2o (+ most-attended tokens), offload (h2o, evicted rows to host memory and "
                                     "back). h2o and offload caches cannot be saved with /save.")


def chat(
    ctx: typer.Context,
    model: Optional[str] = options.MODEL,
    revision: Optional[str] = options.REVISION,
    dequantize: bool = options.DEQUANTIZE,
    adapter_path: Optional[str] = options.ADAPTER_PATH,
    system: Optional[str] = options.SYSTEM,
    max_tokens: int = CHAT_MAX_TOKENS,
    temp: float = options.TEMP,
    top_p: float = options.TOP_P,
    top_k: int = options.TOP_K,
    min_p: float = options.MIN_P,
    seed: Optional[int] = options.SEED,
    stop: Optional[list[str]] = options.STOP,
    repetition_penalty: Optional[float] = options.REPETITION_PENALTY,
    chat_template_kwargs: Optional[str] = options.CHAT_TEMPLATE_KWARGS,
    extra_eos_token: Optional[list[str]] = options.EXTRA_EOS_TOKEN,
    chat_template: Optional[str] = options.CHAT_TEMPLATE,
    max_kv_size: Optional[int] = CHAT_MAX_KV_SIZE,
    kv_bits: Optional[int] = options.KV_BITS,
    kv_group_size: int = options.KV_GROUP_SIZE,
    kv_overflow: str = CHAT_KV_OVERFLOW,
    kv_overflow_budget: Optional[int] = options.KV_OVERFLOW_BUDGET,
    kv_overflow_sinks: Optional[int] = options.KV_OVERFLOW_SINKS,
    kv_overflow_recent: Optional[int] = options.KV_OVERFLOW_RECENT,
    prompt_lookup: bool = options.PROMPT_LOOKUP,
    num_draft_tokens: int = options.NUM_DRAFT_TOKENS,
    ngram_size: int = options.NGRAM_SIZE,
    draft_model: Optional[str] = options.DRAFT_MODEL,
    resume: Optional[str] = typer.Option(None, "--resume", metavar="NAME", rich_help_panel="Sessions",
                                         help="Continue saved session NAME."),
    sessions_dir: Optional[str] = typer.Option(None, "--sessions-dir", metavar="DIR", rich_help_panel="Sessions",
                                               callback=check_folder_option,
                                               help="Folder of saved sessions (default: MLXKV_SESSIONS_DIR, "
                                                    "else ~/.cache/mlxkv/sessions)."),
    verbose: bool = options.VERBOSE,
) -> None:
    """Chat with a model in the terminal; each turn prefills only the new message (/help lists the commands)."""
    refuse_unused(ctx, [*unused_sampling(temp), ("kv_group_size", "--kv-group-size", kv_bits is not None),
                        ("num_draft_tokens", "--num-draft-tokens", prompt_lookup or bool(draft_model)),
                        ("ngram_size", "--ngram-size", prompt_lookup)])
    if draft_model and prompt_lookup:
        raise typer.BadParameter("choose one drafting mode: --draft-model or --prompt-lookup, not both",
                                 param_hint="--draft-model")
    drafting = "--draft-model" if draft_model else "--prompt-lookup" if prompt_lookup else None
    model = with_revision(model, revision)
    overflow = overflow_config(kv_overflow, kv_overflow_budget, kv_overflow_sinks, kv_overflow_recent)
    sampling = sampling_defaults(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens,
                                 repetition_penalty=repetition_penalty, chat_template_kwargs=chat_template_kwargs)
    if overflow.enabled and max_kv_size is not None:
        raise typer.BadParameter("--max-kv-size and --kv-overflow both cap the context: use --kv-overflow-budget",
                                 param_hint="--max-kv-size")
    if kv_bits is not None and overflow.policy in ("h2o", "offload"):
        raise typer.BadParameter(f"--kv-overflow {overflow.policy} keeps full-precision K/V", param_hint="--kv-bits")
    if drafting and overflow.enabled:
        raise typer.BadParameter("speculative decoding cannot run with --kv-overflow: pages an overflow policy "
                                 "evicts cannot be rewound", param_hint=drafting)
    from mlxkv import env
    from mlxkv.chat.paths import saved_session_path

    try:  # a bad flag, a bad session name or a missing session fails before MLX and the model load
        folder = sessions_dir or env.flags().sessions_dir
        if resume is not None:
            saved_session_path(folder, resume)
        if draft_model:
            check_draft_model(draft_model)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1)
    from rich.console import Console

    from mlxkv.chat import ChatSession, fingerprint_of, load_session
    from mlxkv.cli.models import remember_gguf
    from mlxkv.engine.direct import refusal_of_speculation
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.speculation import Speculation
    from mlxkv.models import ModelLoadError, load

    console = Console(highlight=False, stderr=True)
    try:
        params = SamplingParams(max_tokens=sampling.max_tokens, temp=sampling.temp, top_p=sampling.top_p,
                                top_k=sampling.top_k, min_p=sampling.min_p, seed=seed, stop=tuple(stop or ()),
                                repetition_penalty=sampling.repetition_penalty)
        refusal = refusal_of_speculation(params, flag=drafting) if drafting else None
        if refusal is not None:
            raise ValueError(refusal)
        loaded = load(model, dequantize=dequantize, chat_template=chat_template, adapter_path=adapter_path)
        remember_gguf(loaded)
        refuse_useless_dequantize(loaded, dequantize)
        add_extra_eos(loaded.tokenizer, extra_eos_token)
        speculation = None
        if drafting:
            limits = [n for n in (max_kv_size, loaded.config.get("max_position_embeddings")) if n]
            draft = _draft_rows(loaded, draft_model, dequantize, num_draft_tokens, min(limits, default=None))
            speculation = Speculation(num_draft_tokens=num_draft_tokens, ngram_size=ngram_size, draft=draft)
        session = ChatSession(loaded.model, loaded.tokenizer, system=system, max_kv_size=max_kv_size,
                              model_limit=loaded.config.get("max_position_embeddings"), kv_bits=kv_bits,
                              kv_group_size=kv_group_size, overflow=overflow,
                              template_kwargs=sampling.chat_template_kwargs, speculation=speculation)
        shown = f"{loaded.name} with adapter {adapter_path}" if adapter_path is not None else loaded.name
        repl = _Repl(console, session, params, folder, fingerprint_of(loaded), shown, loaded=loaded)
        if resume is not None:
            load_session(session, folder, resume, repl.fingerprint)
            if system is not None:
                session.set_system(system)
            console.print(f"resumed session {resume}: {len(session.messages)} messages, "
                          f"{session.context_tokens} tokens cached", markup=False, soft_wrap=True)
            repl.history()
    except (ModelLoadError, ValueError, RuntimeError, OSError) as exc:
        if verbose:
            import traceback

            traceback.print_exc()
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1)
    console.print(f"mlxkv chat with {shown}: /help lists the commands, Ctrl-D leaves.", markup=False,
                  soft_wrap=True)
    repl.run(_line_reader(folder), verbose)


def _draft_rows(loaded: Any, draft_model: str | None, dequantize: bool, num_draft_tokens: int,
                context: int | None) -> Any:
    """The draft model's rows for the conversation (None without ``--draft-model``): its paged pool holds the
    conversation's ``context`` tokens (the model's context, or ``--max-kv-size``), and keeps what earlier turns
    committed as cached blocks, so a later turn's draft catches up from its prefix hit.

    Raises:
        ValueError: a draft with another vocabulary, or layers it cannot rewind.
        mlxkv.models.ModelLoadError: the draft cannot be loaded (named as the draft).
    """
    if not draft_model:
        return None
    from mlxkv.config import RunConfig, SpeculativeConfig
    from mlxkv.engine.build import draft_model_rows, load_draft_model
    from mlxkv.models import ModelLoadError

    run = RunConfig(dequantize=dequantize,
                    speculative=SpeculativeConfig(draft_model=draft_model, num_draft_tokens=num_draft_tokens))
    try:
        draft = load_draft_model(run, loaded.model)
    except ModelLoadError as exc:
        raise ModelLoadError(f"--draft-model {draft_model}: {exc}") from None
    return draft_model_rows(draft.model, run, target_tokens=(context or 4096) + num_draft_tokens, max_sequences=1)


def _line_reader(folder: str) -> Callable[[], str]:
    """A function returning the next input line (``EOFError`` at the end, ``KeyboardInterrupt`` on Ctrl-C):
    prompt_toolkit with a history file on a terminal, plain lines from a pipe."""
    if not sys.stdin.isatty():
        def read_pipe(continued: bool = False) -> str:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line.rstrip("\n")

        return read_pipe
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    history_file = Path(folder).expanduser() / ".history"
    try:
        history_file.parent.mkdir(parents=True, exist_ok=True)
        history: Any = FileHistory(str(history_file))
    except OSError:  # an unwritable folder costs the history, not the chat
        history = InMemoryHistory()
    prompt = PromptSession(history=history)
    return lambda continued=False: prompt.prompt("... " if continued else ">>> ")


#: Starts and ends a message of several lines (as in ollama).
MULTILINE = '"""'


class _Repl:
    """The read-answer loop and its commands over one :class:`mlxkv.chat.ChatSession`."""

    def __init__(self, console: Any, session: Any, params: Any, folder: str, fingerprint: str, model_name: str,
                 loaded: Any = None):
        self.console, self.session, self.params = console, session, params
        self.loaded = loaded  # the model (its folder and config: /image loads its vision tower)
        self.vision: Any = None
        self.folder, self.fingerprint, self.model_name = folder, fingerprint, model_name
        self.verbose = False
        self.commands: dict[str, Callable[[str], None]] = {
            "/help": lambda _: self.say(HELP), "/reset": self.reset, "/system": self.system, "/save": self.save,
            "/load": self.load, "/sessions": self.sessions, "/stats": self.stats, "/undo": self.undo,
            "/retry": self.retry, "/set": self.set, "/history": self.history, "/image": self.image,
        }

    def say(self, text: str, style: str | None = None) -> None:
        self.console.print(text, markup=False, style=style, soft_wrap=True)

    def run(self, read: Callable[..., str], verbose: bool) -> None:
        self.verbose = verbose
        while True:
            try:
                line = self.read_message(read)
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt clears the line
            except EOFError:
                self.console.print()
                return
            if not line.strip():
                continue
            if line.strip() in ("/exit", "/quit", "/bye"):
                return
            try:
                if line.startswith("/"):
                    name, _, arg = line.strip().partition(" ")
                    command = self.commands.get(name)
                    if command is None:
                        self.say(f"unknown command {name}: /help lists the commands", "yellow")
                    else:
                        command(arg.strip())
                else:
                    self.answer(line)
            except (ValueError, RuntimeError, OSError, NotImplementedError) as exc:
                # A refused command or a failed turn is one line; the conversation and the chat go on.
                if verbose:
                    self.console.print_exception()
                self.say(f"error: {' '.join(str(exc).split())}", "red")

    @staticmethod
    def read_message(read: Callable[..., str]) -> str:
        """The next message: one line, or the lines between a line starting with three double quotes and one
        ending with them (the quotes dropped)."""
        line = read().strip()
        if not line.startswith(MULTILINE):
            return line
        lines, rest = [], line[len(MULTILINE):]
        while not rest.rstrip().endswith(MULTILINE):
            lines.append(rest)
            rest = read(True)
        lines.append(rest.rstrip()[:-len(MULTILINE)])
        return "\n".join(lines).strip("\n")

    def answer(self, text: str) -> None:
        out = sys.stdout
        with StopOnCtrlC() as stopped:
            turn = self.session.turn(text, self.params, stop_requested=stopped)
            wrote = False
            try:
                for piece in turn:  # raw text: rich's rendering per token would cost more than the token
                    out.write(piece)
                    out.flush()
                    wrote = True
            finally:
                turn.close()
            if wrote:
                out.write("\n")
                out.flush()
        last = self.session.last
        if last.finish_reason == "interrupted":
            self.say("[stopped]" if wrote else "[stopped before the answer began: the message was not added]", "dim")
        elif last.finish_reason == "length":
            cut = (f"--max-tokens {self.params.max_tokens}" if last.generation_tokens >= self.params.max_tokens
                   else "the end of the context")
            self.say(f"[answer cut at {cut}]", "dim")
        if last.dropped_turns:
            self.say(f"[{last.dropped_turns} earliest turn(s) dropped to fit the context]", "dim")
        if self.verbose:
            self.say(f"[turn: {last.prompt_tokens} prompt tokens, {last.cached_tokens} cached, {last.prefill_tokens} "
                     f"prefilled | first token {last.prefill_seconds:.3f} s | {last.generation_tokens} generated in "
                     f"{last.generation_seconds:.3f} s ({last.decode_tps:.1f} tok/s){self._speculated(last)}]", "dim")

    def _speculated(self, last: Any) -> str:
        """The turn's speculation figures for its ``--verbose`` line (empty when chat does not speculate)."""
        if self.session.engine.speculation is None:
            return ""
        return (f" | speculative: acceptance {last.acceptance_rate:.1%} ({last.accepted_tokens} of "
                f"{last.drafted_tokens} proposed), {last.tokens_per_forward:.2f} tokens per forward")

    def history(self, _: str = "") -> None:
        """The conversation so far, one paragraph per message (dim: it is context, not a new answer)."""
        for message in self.session.messages:
            self.say(f"{message['role']}: {message['content']}", "dim")

    def undo(self, _: str) -> str:
        """Drop the last user message and what follows it; returns that message (the cache is trimmed back to
        the common prefix with the next turn's rendering, as for any edit of the history)."""
        users = [i for i, m in enumerate(self.session.messages) if m["role"] == "user"]
        if not users:
            raise ValueError("nothing to undo: the conversation has no message yet")
        text = self.session.messages[users[-1]]["content"]
        del self.session.messages[users[-1]:]
        self.say("dropped the last message and its answer")
        return text

    def retry(self, _: str) -> None:
        users = [m for m in self.session.messages if m["role"] == "user"]
        if not users:
            raise ValueError("nothing to retry: the conversation has no message yet")
        text, images = users[-1]["content"], self.session.images_of(users[-1])
        del self.session.messages[self.session.messages.index(users[-1]):]
        if images:  # the message again with its images: its text without their markers
            text = text[len(self.session.image_marker()) * len(images):]
            self.session.pending_images = [*images, *self.session.pending_images]
        self.answer(text)

    def image(self, path: str) -> None:
        """Attach the image in file ``path`` to the next message."""
        from mlxkv.vision.inputs import images_from_files
        from mlxkv.vision.prompt import prepare_images

        if not path:
            raise ValueError("/image FILE: name an image file")
        if self.loaded is None:
            raise ValueError("images need the model's folder")
        self.vision, found = images_from_files([path], self.loaded, vision=self.vision)  # the tower loads once
        encoder = self.vision.encoder
        self.session.attach_image(encoder, *prepare_images(encoder, found.decoded, found.uuids))
        self.say(f"image {path} attached to your next message", "dim")

    #: ``/set`` names -> SamplingParams fields and their parsers.
    SETTINGS = {"temp": ("temp", float), "top-p": ("top_p", float), "top-k": ("top_k", int),
                "min-p": ("min_p", float), "max-tokens": ("max_tokens", int),
                "repetition-penalty": ("repetition_penalty", float), "seed": ("seed", int)}

    def set(self, arg: str) -> None:
        import dataclasses

        from mlxkv.config import SamplingDefaults
        from mlxkv.engine.direct import refusal_of_speculation, speculation_flag

        p = self.params
        if not arg:
            stops = ", ".join(map(repr, p.stop)) or "none"
            self.say(f"temp {p.temp}, top-p {p.top_p}, top-k {p.top_k}, min-p {p.min_p}, max-tokens "
                     f"{p.max_tokens}, repetition-penalty {p.repetition_penalty or 'off'}, seed {p.seed or 'none'}, "
                     f"stop {stops}")
            return
        name, _, value = arg.partition(" ")
        if name == "stop" and value:  # the text as typed (spaces included); "none" clears
            self.params = dataclasses.replace(p, stop=() if value == "none" else (value,))
            self.say(f"stop set to {', '.join(map(repr, self.params.stop)) or 'none'}")
            return
        if name not in self.SETTINGS or not value.strip():
            raise ValueError(f"/set NAME VALUE, NAME one of {', '.join(self.SETTINGS)}, stop")
        field, parse = self.SETTINGS[name]
        try:
            parsed = parse(value.strip())
        except ValueError:
            raise ValueError(f"{name}: {value.strip()!r} is not a{'n integer' if parse is int else ' number'}") \
                from None
        changed = dataclasses.replace(p, **{field: parsed})
        if field != "seed":  # the rules the options apply (a seed is any integer)
            SamplingDefaults(temp=changed.temp, top_p=changed.top_p, top_k=changed.top_k, min_p=changed.min_p,
                             max_tokens=changed.max_tokens, repetition_penalty=changed.repetition_penalty)
        speculation = self.session.engine.speculation
        refusal = refusal_of_speculation(changed, flag=speculation_flag(speculation)) if speculation else None
        if refusal is not None:
            raise ValueError(f"/set {name}: {refusal}")
        greedy = changed.temp == 0
        if greedy and field in ("top_p", "top_k", "min_p", "seed"):
            raise ValueError(f"{name} has no effect at temp 0 (greedy decoding draws nothing at random): "
                             "/set temp first")
        self.params = changed
        self.say(f"{name} set to {parsed}")

    def reset(self, _: str) -> None:
        self.session.reset(self.session.system)
        self.say("new conversation")

    def system(self, text: str) -> None:
        self.session.set_system(text or None)
        self.say("system message set" if text else "system message removed")

    def save(self, name: str) -> None:
        from mlxkv.chat import save_session

        if self.session.holds_images:
            raise ValueError("a conversation holding images cannot be saved (sessions store text only): /reset first")

        path = save_session(self.session, self.folder, name, self.fingerprint, self.model_name)
        self.say(f"saved session {name} ({self.session.context_tokens} tokens) to {path}")

    def load(self, name: str) -> None:
        from mlxkv.chat import load_session

        load_session(self.session, self.folder, name, self.fingerprint)
        self.say(f"loaded session {name}: {len(self.session.messages)} messages, "
                 f"{self.session.context_tokens} tokens cached")

    def sessions(self, _: str) -> None:
        from mlxkv.chat import list_sessions

        names = list_sessions(self.folder)
        self.say(", ".join(names) if names else f"no saved sessions in {self.folder}")

    def stats(self, _: str) -> None:
        s, last = self.session, self.session.last
        limit = f" (limit {s.limit})" if s.limit else ""
        self.say(f"context: {s.context_tokens} tokens{limit}, KV cache {s.kv_bytes / 1e6:.2f} MB")
        self.say(f"last turn: {last.prompt_tokens} prompt tokens, {last.cached_tokens} cached, "
                 f"{last.prefill_tokens} prefilled ({last.prefill_tps:.1f} tok/s), "
                 f"{last.generation_tokens} generated ({last.decode_tps:.1f} tok/s)")
