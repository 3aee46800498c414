"""``mlxkv cache``: inspect and clear secondary-tier folders, and read a running server's cache stats.

Registered by the main app as ``app.add_typer(cache_app, name="cache")``. Thin: the library reads the files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from mlxkv.cli.errors import Command, Group
from mlxkv.cli.validate import check_utf8

cache_app = typer.Typer(cls=Group, name="cache", help="Inspect the KV cache: tier folders and a server's stats.",
                        no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _folder(path: Path) -> Path:
    if not path.exists():
        typer.echo(f"error: {path} does not exist yet: `mlxkv serve --kv-disk-cache {path}` creates it", err=True)
        raise typer.Exit(code=1)
    if not path.is_dir():
        typer.echo(f"error: {path} is a file, not a folder", err=True)
        raise typer.Exit(code=1)
    return path


def _listing(folder: Path):
    """The folder's verified entries; one warning line per file that is not listed (never fatal)."""
    from mlxkv.kv.tier.listing import list_folder
    from mlxkv.kv.tier.seal import SecretError, open_seal, secret_path

    try:
        seal = open_seal(folder, create=False)
    except SecretError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if seal is None:
        typer.echo(f"warning: no tier secret at {secret_path(folder)}: no file can be verified", err=True)
    listing = list_folder(folder, seal)
    for name, why in listing.bad:
        typer.echo(f"warning: skipping {name}: {why}", err=True)
    return listing


@cache_app.command("ls", cls=Command)
def ls(folder: Path = typer.Argument(..., metavar="FOLDER", help="A secondary-tier folder."),
       as_json: bool = typer.Option(False, "--json", help="One JSON object (chains and totals) instead of a table.")
       ) -> None:
    """List the cached chains in a tier folder: blocks, tokens, priority, bytes, model, age.

    Only files verified with the folder's secret are listed; each other file gets one warning line.
    """
    from rich.console import Console
    from rich.table import Table

    from mlxkv.kv.tier.listing import chains

    listing = _listing(_folder(folder))
    _distributed_note(folder, "ls")
    table = Table(title=f"KV tier {folder}")
    for col in ("chain", "group", "blocks", "tokens", "priority", "bytes", "model", "age"):
        text = col in ("chain", "model")
        table.add_column(col, justify="left" if text else "right", no_wrap=text)
    now = time.time()
    total_blocks = total_bytes = 0
    rows = []
    for chain in sorted(chains(listing.entries), key=lambda c: -max(e.header.created for e in c)):
        root = chain[0].header
        fp = root.fingerprint
        prios = sorted({e.header.priority for e in chain})
        nbytes = sum(e.size for e in chain)
        total_blocks += len(chain)
        total_bytes += nbytes
        rows.append({"chain": root.block_hash, "complete": all(e.complete for e in chain), "group": root.group_id,
                     "blocks": len(chain), "tokens": sum(e.header.block_size for e in chain),
                     "priorities": prios, "bytes": nbytes, "architecture": fp.architecture, "model": fp.digest,
                     "age_s": round(now - max(e.header.created for e in chain), 3)})
        table.add_row(
            root.block_hash[:12] + ("" if all(e.complete for e in chain) else " (truncated)"),
            str(root.group_id), str(len(chain)), str(sum(e.header.block_size for e in chain)),
            str(prios[0]) if len(prios) == 1 else f"{prios[0]}-{prios[-1]}", _fmt_bytes(nbytes),
            f"{fp.architecture} {fp.digest[:8]}", _fmt_age(now - max(e.header.created for e in chain)),
        )
    if as_json:
        typer.echo(json.dumps({"folder": str(folder), "chains": rows, "blocks": total_blocks, "bytes": total_bytes,
                               "unreadable": len(listing.bad), "duplicates": listing.duplicates}))
        return
    console = Console()
    console.print(table)
    notes = [f"{n} unreadable file(s)" for n in (len(listing.bad),) if n]
    notes += [f"{n} duplicate(s) not counted" for n in (listing.duplicates,) if n]
    console.print(f"{total_blocks} blocks, {_fmt_bytes(total_bytes)}" + "".join(f", {n}" for n in notes))


def _distributed_note(folder: Path, command: str) -> None:
    """What a folder of ``mlxkv serve --distributed`` holds: one rank's shard of each block, or (the folder passed
    as --kv-disk-cache) one subfolder per rank, which ``ls`` and ``clear`` take one at a time."""
    from mlxkv.kv.tier.fingerprint import parse_shard_name

    shard = parse_shard_name(folder.resolve().name)
    if shard is not None:
        rank, size, mode = shard
        typer.echo(f"{folder}: rank {rank} of {size} ({mode}-parallel): this rank's shard of each block "
                   f"({'its KV heads' if mode == 'tensor' else 'its layers'}); the other ranks' folders are beside it",
                   err=True)
        return
    ranks = sorted(p.name for p in folder.iterdir() if p.is_dir() and parse_shard_name(p.name))
    if ranks:
        typer.echo(f"{folder} holds the per-rank folders of --distributed launches ({', '.join(ranks)}): not listed "
                   f"here; pass one of them (mlxkv cache {command} {folder / ranks[0]})", err=True)


@cache_app.command("clear", cls=Command)
def clear(folder: Path = typer.Argument(..., metavar="FOLDER", help="A secondary-tier folder."),
          yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking.")) -> None:
    """Delete every tier block file in a folder (readable or not, of any model or format version) and leftover
    temp files; other files are left alone. Asks for confirmation unless --yes is given."""
    from mlxkv.kv.tier.disk_store import is_tier_file, is_tier_temp

    folder = _folder(folder)
    _distributed_note(folder, "clear")
    ours = [p for p in sorted(folder.iterdir()) if is_tier_temp(p) or is_tier_file(p)]
    if not ours:
        typer.echo(f"no tier files in {folder}")
        return
    if not yes and not typer.confirm(f"delete {len(ours)} file(s) in {folder}?"):
        typer.echo("nothing deleted")
        raise typer.Exit(code=1)
    removed = 0
    for p in ours:
        try:
            p.unlink()
            removed += 1
        except FileNotFoundError:
            pass  # removed meanwhile (a running server evicting it)
        except OSError as exc:
            typer.echo(f"warning: cannot remove {p.name}: {exc}", err=True)
    typer.echo(f"removed {removed} file(s) from {folder}")


class _ReadError(Exception):
    """Why a GET of a server's JSON failed, as one line."""


def _get_json(url: str, api_key: str | None, timeout: float = 10.0):
    """GET ``url`` and decode its JSON body (the standard library's urllib: nothing outside mlxkv's dependencies).

    Raises:
        _ReadError: not an http(s) URL, the server is unreachable, it answered a non-2xx status (the reason names
            the status and the error message of its JSON body, when it has one), or the body is not JSON.
    """
    import http.client
    import urllib.error
    import urllib.parse
    import urllib.request

    class NoRedirects(urllib.request.HTTPRedirectHandler):
        """A redirect is answered as the HTTP error it is, never followed: the token goes nowhere else."""

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            return None

    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise _ReadError("the URL must start with http:// or https://")
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if api_key:
        try:
            api_key.encode("latin-1")  # what an HTTP header can carry
        except UnicodeEncodeError:
            raise _ReadError("the API key is not text an HTTP header can carry (latin-1)") from None
        request.add_unredirected_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.build_opener(NoRedirects).open(request, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise _ReadError(f"HTTP {exc.code} {exc.reason}{_error_message(exc)}") from None
    except urllib.error.URLError as exc:
        raise _ReadError(str(exc.reason)) from None
    except (OSError, http.client.HTTPException) as exc:
        raise _ReadError(str(exc) or type(exc).__name__) from None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise _ReadError(f"not JSON: {exc}") from None


def _error_message(exc) -> str:
    """``": <message>"`` from an error response's JSON body (OpenAI's or Anthropic's shape), else ``""``."""
    try:
        error = json.loads(exc.read()).get("error")
    except (OSError, ValueError, AttributeError):
        return ""
    message = error.get("message") if isinstance(error, dict) else None
    return f": {' '.join(message.split())}" if isinstance(message, str) and message.strip() else ""


def _rate(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


@cache_app.command("stats", cls=Command)
def stats(url: str = typer.Option("http://127.0.0.1:8080", "--url",
                                  help="Base URL of a running mlxkv server (serve's default port)."),
          api_key: str = typer.Option(None, "--api-key", envvar="MLXKV_API_KEY", help="Bearer token."),
          as_json: bool = typer.Option(False, "--json", help="The server's JSON as it is, instead of tables."),
          model: str = typer.Option(None, "--model", "-m", callback=check_utf8,
                                    help="On a server with several models: the one to describe (default: its first).")
          ) -> None:
    """Hit rates per tier and blocks per priority from a running server's /v1/cache/stats."""
    from rich.console import Console
    from rich.table import Table

    import urllib.parse

    endpoint = url.rstrip("/") + "/v1/cache/stats" + ("?" + urllib.parse.urlencode({"model": model}) if model else "")
    try:
        snap = _get_json(endpoint, api_key)
    except _ReadError as exc:
        typer.echo(f"error: cannot read {endpoint}: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if not isinstance(snap, dict):
        typer.echo(f"error: {endpoint} returned {type(snap).__name__}, expected a JSON object", err=True)
        raise typer.Exit(code=1)
    if as_json:
        typer.echo(json.dumps(snap))
        return
    console = Console()
    blocks = snap.get("kv_blocks")
    if isinstance(blocks, dict) and blocks.get("paged") and "allocated" in blocks:
        how = "preallocated" if blocks.get("preallocated") else "grows as used"
        console.print(f"KV pool ({how}): {blocks['allocated']} of {blocks.get('total', '?')} blocks allocated "
                      f"({_fmt_bytes(blocks.get('allocated_bytes', 0))} of {_fmt_bytes(blocks.get('budget_bytes', 0))}"
                      f"), {blocks.get('used', 0)} in use, {blocks.get('cached', 0)} cached")
    tier = snap.get("tier")
    if not isinstance(tier, dict) or not isinstance(tier.get("secondary"), dict):
        console.print("the server reports no secondary tier")
    else:
        sec = tier.get("secondary", {})
        hits = Table(title="prefix hits per tier (blocks)")
        for col in ("tier", "hits", "rate", "blocks held", "bytes", "capacity"):
            hits.add_column(col, justify="left" if col == "tier" else "right")
        prompt = tier.get("prompt_blocks", 0)
        hits.add_row("primary", str(tier.get("primary_hit_blocks", 0)), _rate(tier.get("primary_hit_rate")),
                     "-", "-", "-")
        for name in ("memory", "disk"):
            store = sec.get(name)
            if isinstance(store, dict):
                n = sec.get(f"hits_{name}", 0)
                hits.add_row(name, str(n), _rate(n / prompt if prompt else 0.0), str(store.get("blocks", 0)),
                             _fmt_bytes(store.get("bytes", 0)), _fmt_bytes(store.get("capacity_bytes", 0)))
        console.print(hits)
        console.print(f"prompt blocks {prompt}; offloaded {sec.get('stored_memory', 0)} to memory, "
                      f"{sec.get('stored_disk', 0)} to disk; dropped {sec.get('dropped_low_priority', 0)} "
                      f"below priority {sec.get('min_priority', '?')}, {sec.get('dropped_no_room', 0)} for room, "
                      f"{(sec.get('drops') or {}).get('queue_full', 0)} for a full write queue")
        queue = sec.get("write_queue")
        if isinstance(queue, dict):
            console.print(f"write-behind queue: {queue.get('blocks', 0)} block(s), {_fmt_bytes(queue.get('bytes', 0))}")
        prios = Table(title="blocks per retention priority")
        cols = [("primary", snap.get("blocks_by_priority") or (snap.get("kv_blocks") or {}).get("cached_by_priority")
                 or {})]
        cols += [(n, sec[n].get("blocks_by_priority", {})) for n in ("memory", "disk") if isinstance(sec.get(n), dict)]
        prios.add_column("priority", justify="right")
        for name, _ in cols:
            prios.add_column(name, justify="right")
        keys = sorted({int(p) for _, d in cols for p in d})
        for p in keys:
            prios.add_row(str(p), *(str(d.get(str(p), d.get(p, 0))) for _, d in cols))
        console.print(prios)
