"""``mlxkv top``: a running server's KV cache live in the terminal (requests, block pool map, hit rate, tier, tok/s).

Reads the same public routes as the built-in page (``/v1/cache/stats`` and ``/v1/cache/blocks``), with the API key
like any client. ``--once --json`` prints one snapshot as JSON and exits (for scripts and pipes).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import urllib.parse
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from mlxkv.cli.cache import _get_json, _ReadError
from mlxkv.cli.options import FLAG
from mlxkv.cli.validate import check_utf8

#: Glyph and style of each block state (mlxkv/kv/blocks/block_map.py).
GLYPHS = {"f": ("·", "grey50"), "c": ("▪", None), "u": ("█", "dark_orange"), "s": ("█", None)}
TENANT_STYLES = ("green", "cyan", "magenta", "yellow", "blue", "bright_green", "bright_cyan", "bright_magenta")
OTHERS_STYLE = "grey62"
#: Rows of glyphs the pool map may take; a larger pool shows each glyph as several blocks (the busiest state).
MAP_ROWS = 4


class Snapshot:
    """One reading of a server: its stats, its block map and the tok/s since the previous reading."""

    def __init__(self, url: str, api_key: str | None, cache_salt: str | None, model: str | None = None):
        self.base = url.rstrip("/")
        self.api_key = api_key
        self.model = {"model": model} if model else {}  # a server with several models describes the one named
        params = {**self.model, **({"cache_salt": cache_salt} if cache_salt else {})}
        self.query = "?" + urllib.parse.urlencode(params) if params else ""
        self.previous: tuple[float, dict] | None = None

    def read(self) -> dict[str, Any]:
        """The server's figures now (raises _ReadError, one line, when the server cannot be read)."""
        stats = self._get("/v1/cache/stats" + ("?" + urllib.parse.urlencode(self.model) if self.model else ""))
        blocks = self._get("/v1/cache/blocks" + self.query)
        now = time.monotonic()
        tps = None
        if self.previous is not None and now > self.previous[0]:
            made = stats.get("generation_tokens_total", 0) - self.previous[1].get("generation_tokens_total", 0)
            tps = max(0, made) / (now - self.previous[0])
        self.previous = (now, stats)
        return summary(stats, blocks, tps)

    def _get(self, path: str) -> dict:
        url = self.base + path
        body = _get_json(url, self.api_key)
        if not isinstance(body, dict):
            raise _ReadError(f"{url} returned {type(body).__name__}, expected a JSON object")
        return body


def summary(stats: dict, blocks: dict, tps: float | None) -> dict[str, Any]:
    """What ``top`` shows, as JSON (``--once --json``)."""
    kv = stats.get("kv_blocks") or {}
    prefix = stats.get("prefix_cache") or {}
    tier = stats.get("tier") or {}
    secondary = tier.get("secondary") if isinstance(tier.get("secondary"), dict) else None
    states = blocks.get("states", "") if blocks.get("paged") else ""
    return {
        "requests": {"running": stats.get("running", 0), "prefilling": stats.get("prefilling", 0),
                     "waiting": stats.get("waiting", 0), "preempted": stats.get("preempted", 0)},
        "prefix_cache": {"enabled": prefix.get("enabled", False), "hit_rate": prefix.get("hit_rate", 0.0),
                         "queries": prefix.get("queries", 0), "hits": prefix.get("hits", 0)},
        "pool": {"paged": bool(blocks.get("paged")), "block_size": blocks.get("block_size"),
                 "total": len(states), "free": states.count("f"), "cached": states.count("c"),
                 "in_use": states.count("u"), "shared": states.count("s"),
                 "view": blocks.get("view"), "tenants": blocks.get("tenants", []),
                 "states": states, "owners": blocks.get("owners", [])},
        "tree": blocks.get("tree", {"nodes": [], "truncated": 0}),
        "tier": {"enabled": bool(tier.get("enabled")),
                 "blocks": secondary.get("blocks", 0) if secondary else 0,
                 "hits": secondary.get("hits", 0) if secondary else 0,
                 "hit_rate": secondary.get("hit_rate", 0.0) if secondary else 0.0},
        "overflow": {"dropped_blocks": kv.get("overflow_dropped", 0),
                     "restored_blocks": kv.get("overflow_restored", 0)},
        "state_snapshots": stats.get("state_snapshots"),
        "evictions": stats.get("evictions", 0),
        "preemptions": stats.get("preemptions", 0),
        "generation_tokens_total": stats.get("generation_tokens_total", 0),
        "tokens_per_second": tps,
    }


def render(snap: dict, url: str, width: int, live: bool = False) -> Group:
    """The view of one snapshot (rich renderables; ``live``: with the key that quits)."""
    r, p, pool, tier = snap["requests"], snap["prefix_cache"], snap["pool"], snap["tier"]
    head = Table.grid(padding=(0, 3))
    for _ in range(6):
        head.add_column()
    tps = snap["tokens_per_second"]
    head.add_row(f"running [b]{r['running']}[/b] (+{r['prefilling']} prefilling)", f"waiting [b]{r['waiting']}[/b]",
                 f"preempted [b]{r['preempted']}[/b]",
                 f"hit rate [b]{100 * p['hit_rate']:.1f}%[/b]" if p["enabled"] else "prefix cache off",
                 f"tok/s [b]{'–' if tps is None else f'{tps:.1f}'}[/b]",
                 f"tier [b]{tier['blocks']}[/b] blocks, {tier['hits']} hits" if tier["enabled"] else "tier none")
    parts: list = [head]
    if pool["paged"]:
        parts.append(Text(f"pool: {pool['total']} blocks of {pool['block_size']} tokens — {pool['free']} free, "
                          f"{pool['cached']} cached, {pool['in_use']} in use, {pool['shared']} in use and shared; "
                          f"evictions {snap['evictions']}, preemptions {snap['preemptions']}"))
        extra = []
        if snap["overflow"]["dropped_blocks"] or snap["overflow"]["restored_blocks"]:
            extra.append(f"overflow: {snap['overflow']['dropped_blocks']} blocks dropped, "
                         f"{snap['overflow']['restored_blocks']} restored")
        snaps = snap["state_snapshots"] or {}
        if snaps.get("enabled"):
            extra.append(f"state snapshots {snaps.get('count', 0)} ({snaps.get('hits', 0)} hits)")
        if extra:
            parts.append(Text("; ".join(extra)))
        parts.append(pool_map(pool, max(10, width - 4)))
        legend = Text("· free  ", style="grey50") + Text("█ in use  ", style="dark_orange")
        for i, tenant in enumerate(pool["tenants"]):
            legend += Text(f"▪ {tenant['label']}{' (you)' if tenant['own'] else ''}  ", style=_tenant_style(pool, i))
        parts.append(legend)
    else:
        parts.append(Text("dense KV backend: no block pool (serve with --kv-backend paged)"))
    return Group(Panel(Group(*parts), title=f"mlxkv top — {url}", subtitle="q quits" if live else None))


def pool_map(pool: dict, width: int) -> Text:
    """The blocks as rows of glyphs; with more blocks than fit, each glyph stands for a run of blocks and shows
    the busiest state among them (shared > in use > cached > free)."""
    states, owners = pool["states"], pool["owners"]
    cells = max(1, min(len(states), width * MAP_ROWS))
    per = -(-len(states) // cells) if states else 1
    text = Text()
    rank = "fcus"
    for cell in range(-(-len(states) // per) if states else 0):
        run = range(cell * per, min(len(states), (cell + 1) * per))
        i = max(run, key=lambda j: rank.index(states[j]))
        glyph, style = GLYPHS[states[i]]
        text.append(glyph, style=style or _tenant_style(pool, owners[i]))
        if (cell + 1) % width == 0:
            text.append("\n")
    return text


def _tenant_style(pool: dict, owner: int) -> str:
    tenants = pool["tenants"]
    if not 0 <= owner < len(tenants) or tenants[owner]["label"] == "others":
        return OTHERS_STYLE
    return TENANT_STYLES[owner % len(TENANT_STYLES)]


@contextmanager
def _keys() -> Iterator[Any]:
    """A reader of single key presses from the terminal (cbreak mode), or one that never has any without one."""
    if not sys.stdin.isatty():
        yield lambda timeout: (time.sleep(timeout), "")[1]
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 32).decode(errors="replace") if ready else ""

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def top(url: str = typer.Option("http://127.0.0.1:8080", "--url", callback=check_utf8,
                                 help="Base URL of a running mlxkv server."),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MLXKV_API_KEY", callback=check_utf8,
                                              help="Bearer token."),
        cache_salt: Optional[str] = typer.Option(None, "--cache-salt", callback=check_utf8,
                                                 help="Your prompts' cache salt: your blocks are shown as yours."),
        interval: float = typer.Option(1.0, "--interval", min=0.1, max=60.0, help="Seconds between readings."),
        once: bool = typer.Option(False, "--once", metavar=FLAG, help="Print one reading and exit."),
        as_json: bool = typer.Option(False, "--json", metavar=FLAG,
                                     help="With --once: print the reading as JSON."),
        model: Optional[str] = typer.Option(None, "--model", "-m", callback=check_utf8,
                                            help="On a server with several models: the one to show (default: "
                                                 "its first).")) -> None:
    """A running server's KV cache live: requests, the block pool map, hit rate, tier and tok/s (q quits)."""
    if as_json and not once:
        _fail("--json prints one reading: use it with --once")
    if cache_salt is not None and not 1 <= len(cache_salt) <= 256:
        _fail("--cache-salt must be 1 to 256 characters")
    reader = Snapshot(url, api_key, cache_salt, model)
    try:
        reader.read()  # the first reading gives the counters tok/s is measured from
        if once:
            time.sleep(min(interval, 0.5))
            snap = reader.read()
            if as_json:
                typer.echo(json.dumps(snap))
            else:
                Console().print(render(snap, url, Console().width))
            return
        _live(reader, url, interval)
    except _ReadError as exc:
        _fail(f"cannot read {url}: {exc}")
    except KeyboardInterrupt:
        return


def _live(reader: Snapshot, url: str, interval: float) -> None:
    console = Console()
    with _keys() as key, Live(console=console, auto_refresh=False, screen=False, transient=False) as live:
        while True:
            live.update(render(reader.read(), url, console.width, live=True), refresh=True)
            deadline = time.monotonic() + interval
            while (left := deadline - time.monotonic()) > 0:
                pressed = key(left)
                if "q" in pressed.lower():
                    return
