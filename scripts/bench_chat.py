"""Chat turns: the 10th turn of a conversation with a ~2K-token history, ``mlxkv chat``'s engine against
``mlx_lm.generate`` given the same whole history, and a resumed session's first turn against a live one.

The conversation: a system message, then ``--turns - 1`` turns, each a scripted user message of about
``--message-tokens`` tokens (200) answered by the model (greedy, ``--answer-tokens``: 16), all through
:class:`mlxkv.chat.ChatSession` — the library path the REPL drives (long messages and short answers build the
history with little decoding; the timed turn does not care which side of the history its tokens came from). The
last message has ``--last-message-tokens`` (40). The history is then saved (``/save``'s file)
and the last turn is timed, ``--rounds`` times, three ways (median reported):

- live: the same session answers the last message (the cache holds the history; the turn prefills only the new
  message). Each round restores the conversation before the last turn and sends a new last message (numbered by
  round), so the turn diff trims the cache back to the history and nothing of an earlier round is reused;
- resumed: a new session loads the saved file (its load time is reported apart), then answers;
- mlx-lm: ``mlx_lm.generate.stream_generate`` on the whole rendered conversation (a new prompt cache each time,
  as a stateless ``mlx_lm.generate`` call is).

Time to first token is from the call to the first generated token (template rendering and prefill included).
The three answers are compared (greedy: they should be equal). Model and BLAS as the other benchmarks
(bench_common): SmolLM2-135M-Instruct, the GGUF dequantized to float32 on both sides, OpenBLAS when installed.

    python scripts/bench_chat.py                          # 10 turns, ~2K tokens of history, 3 rounds
    python scripts/bench_chat.py --model demo --rounds 1  # a quick look with the embedded demo model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import (  # noqa: E402
    add_model_args,
    bench_model,
    describe,
    ensure_openblas,
    load_peer_model,
    print_header,
)

print = partial(print, flush=True)  # noqa: A001  (progress shows when the output goes to a file)

TOPICS = ("the water cycle", "how a compiler works", "the history of the printing press", "photosynthesis",
          "how vaccines train the immune system", "the rules of chess", "plate tectonics", "how a bank works",
          "the causes of the seasons", "how a refrigerator moves heat", "the life of a star", "how bread rises")
FILLER = ("Please answer in plain words, with an example a student would remember, and say which part people "
          "most often get wrong and why. ")


def user_message(i: int, tokenizer, target: int) -> str:
    """A scripted user message of about ``target`` tokens on the i-th topic."""
    text = f"Question {i + 1}: explain {TOPICS[i % len(TOPICS)]}. "
    while len(tokenizer.encode(text)) < target:
        text += FILLER
    return text


def first_token_seconds(stream) -> tuple[float, str]:
    """Consume ``stream`` (text pieces); return (seconds to the first piece, the whole text)."""
    start = time.perf_counter()
    first, pieces = None, []
    for piece in stream:
        if first is None:
            first = time.perf_counter() - start
        pieces.append(piece)
    return (first if first is not None else time.perf_counter() - start), "".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, "hidden 576, 30 layers")
    parser.add_argument("--turns", type=int, default=10, help="turns of the conversation; the last is timed")
    parser.add_argument("--message-tokens", type=int, default=200, help="tokens of each history user message")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens of each history answer")
    parser.add_argument("--last-message-tokens", type=int, default=40, help="tokens of the timed last message")
    parser.add_argument("--last-tokens", type=int, default=8, help="tokens of the timed last answer")
    parser.add_argument("--rounds", type=int, default=3, help="timed repetitions of the last turn")
    args = parser.parse_args()
    blas = ensure_openblas()
    loaded, folder = bench_model(parser, args, hidden=576, layers=30)
    if loaded.tokenizer is None:
        parser.error("this benchmark needs a model with a tokenizer and chat template (not 'random')")
    print_header(blas, describe(loaded), folder)

    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlxkv.chat import ChatSession, fingerprint_of, fit_conversation, load_session, save_session
    from mlxkv.engine.sampling import SamplingParams

    tok = loaded.tokenizer
    limit = loaded.config.get("max_position_embeddings")

    def new_session() -> ChatSession:
        return ChatSession(loaded.model, tok, system="You are a helpful teacher.", model_limit=limit)

    live = new_session()
    history = SamplingParams(max_tokens=args.answer_tokens)
    start = time.perf_counter()
    for i in range(args.turns - 1):
        "".join(live.turn(user_message(i, tok, args.message_tokens), history))
    print(f"history: {args.turns - 1} turns, {live.context_tokens} tokens cached "
          f"(built in {time.perf_counter() - start:.1f} s)")
    before_last = [dict(m) for m in live.messages]
    folder_tmp = tempfile.TemporaryDirectory(prefix="mlxkv-bench-chat-")
    fingerprint = fingerprint_of(loaded)
    save_session(live, folder_tmp.name, "history", fingerprint)
    peer = load_peer_model(folder, loaded.model)
    greedy = make_sampler(temp=0.0)
    last = SamplingParams(max_tokens=args.last_tokens)

    times: dict[str, list[float]] = {"live": [], "resumed": [], "mlx-lm": []}
    prefilled: dict[str, int] = {}
    loads, same = [], True
    for r in range(args.rounds):
        # A new last message each round (as a user's would be), so no round finds the previous one's in the cache.
        message = f"(round {r + 1}) " + user_message(args.turns - 1, tok, args.last_message_tokens)
        kept, prompt, dropped = fit_conversation([*before_last, {"role": "user", "content": message}], live.render,
                                                 live.limit or 1 << 62, last.max_tokens)
        if r == 0:
            print(f"last turn: {len(prompt)} prompt tokens in all ({dropped} turns dropped to fit the context), "
                  f"{args.last_tokens} answer tokens")
        answers = {}
        live.messages = [dict(m) for m in before_last]
        t, answers["live"] = first_token_seconds(live.turn(message, last))
        assert live.last.prompt_tokens == len(prompt)
        times["live"].append(t)
        prefilled["live"] = live.last.prefill_tokens
        resumed = new_session()
        start = time.perf_counter()
        load_session(resumed, folder_tmp.name, "history", fingerprint)
        loads.append(time.perf_counter() - start)
        t, answers["resumed"] = first_token_seconds(resumed.turn(message, last))
        times["resumed"].append(t)
        prefilled["resumed"] = resumed.last.prefill_tokens
        del resumed
        stream = (x.text for x in stream_generate(peer, tok, prompt=prompt, max_tokens=args.last_tokens,
                                                  sampler=greedy))
        t, answers["mlx-lm"] = first_token_seconds(stream)
        times["mlx-lm"].append(t)
        prefilled["mlx-lm"] = len(prompt)
        if len(set(answers.values())) > 1:
            same = False
            print(f"round {r + 1}: the answers differ: {answers}")

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'path':<10}{'prefilled':>10}{'TTFT s (median)':>18}   all rounds")
    for k in times:
        print(f"{k:<10}{prefilled[k]:>10}{med[k]:>18.3f}   {', '.join(f'{t:.3f}' for t in times[k])}")
    print(f"session file load: {statistics.median(loads):.3f} s (median)")
    print(f"mlx-lm / live TTFT: {med['mlx-lm'] / med['live']:.1f}x; resumed / live: {med['resumed'] / med['live']:.2f}")
    print(f"same greedy answer on all three paths, every round: {'yes' if same else 'NO'}")
    folder_tmp.cleanup()


if __name__ == "__main__":
    main()
