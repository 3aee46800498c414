"""``mlxkv generate --logprobs N``: each generated token's log-probability and its most likely alternatives, on stderr
after the answer (stdout keeps the answer alone)."""

from __future__ import annotations

from typing import Any, Sequence

import typer


def print_logprobs(records: Sequence[Any], tokenizer: Any) -> None:
    """One line per token: its text, its log-probability, then ``text=logprob`` for each alternative (most likely
    first). ``records``: the chunks' :class:`~mlxkv.engine.output.TokenLogprob` (``None`` entries skipped)."""
    def shown(token: int) -> str:
        return repr(tokenizer.decode([token]))

    typer.echo("logprobs (token, log-probability, alternatives):", err=True)
    for record in records:
        if record is None:
            continue
        alternatives = "  ".join(f"{shown(t)}={lp:.4f}" for t, lp in record.top)
        typer.echo(f"{shown(record.token)}\t{record.logprob:.4f}" + (f"\t{alternatives}" if alternatives else ""),
                   err=True)
