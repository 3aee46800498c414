"""scripts/check_kernels.py's Mac report, run on CPU with stand-in kernels (no Metal here): the report
lists each variant with compile, error and speed columns and flags a wrong kernel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx

from mlxkv.kernels import variants
from mlxkv.kernels.paged_attention_ref import REFERENCE

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_kernels.py"


def load_script():
    spec = importlib.util.spec_from_file_location("check_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Skewed:
    """The reference with its scores scaled: a wrong kernel."""

    def partials(self, *args, scale, **kwargs):
        return REFERENCE.partials(*args, scale=scale * 1.5, **kwargs)

    def merge(self, *args):
        return REFERENCE.merge(*args)


def run_report(monkeypatch, factory):
    chosen = [v for v in variants.emulation_classes() if v.call.template["T"] == mx.float32][:2]
    monkeypatch.setattr(variants, "emulation_classes", lambda: chosen)
    lines = []
    ok = load_script().metal_report(True, factory=factory, ctx=64, out=lines.append)
    return ok, lines, chosen


def before_mass(lines: list[str]) -> list[str]:
    """The report up to its attention-mass section."""
    return lines[: next(n for n, ln in enumerate(lines) if "attention-mass variants" in ln)]


def test_report_has_a_row_per_variant(monkeypatch):
    ok, lines, chosen = run_report(monkeypatch, lambda *key: REFERENCE)
    rows = [ln for ln in before_mass(lines) if ln.startswith("| float32")]
    assert ok and len(rows) == len(chosen) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "ok" and cells[2].endswith("ok") and all(float(c) > 0 for c in cells[3:6])
    assert any(ln.strip().startswith("cascade float16") and ln.endswith("ok") for ln in lines)


def test_report_flags_a_wrong_kernel_and_an_uncovered_one(monkeypatch):
    ok, lines, _ = run_report(monkeypatch, lambda *key: Skewed())
    assert not ok and sum("MISMATCH" in ln for ln in before_mass(lines)) == 3  # two variants and the cascade
    ok, lines, chosen = run_report(monkeypatch, lambda *key: None)
    mass_rows = len({v.call.template["D"] for v in chosen})  # the mass section: one per head_dim (--quick)
    assert not ok and sum("not covered" in ln for ln in lines) == 2 + mass_rows


class MassSkewed:
    """The reference with a wrong mass (its output is right)."""

    def partials(self, *args, **kwargs):
        return REFERENCE.partials(*args, **kwargs)

    def merge(self, *args):
        return REFERENCE.merge(*args)

    def mass(self, *args, **kwargs):
        return REFERENCE.mass(*args, **kwargs) * 1.01


def test_report_has_mass_rows_and_flags_a_wrong_mass(monkeypatch):
    ok, lines, chosen = run_report(monkeypatch, lambda *key: REFERENCE)
    at = len(before_mass(lines))
    rows = [ln for ln in lines[at:] if ln.startswith("| float32")]
    assert ok and len(rows) == len({v.call.template["D"] for v in chosen}) > 0
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1].endswith("ok") and all(float(c.rstrip("x")) > 0 for c in cells[2:5])
    ok, lines, _ = run_report(monkeypatch, lambda *key: MassSkewed())
    at = len(before_mass(lines))
    assert not ok and all("MISMATCH" not in ln for ln in lines[:at])
    assert sum("MISMATCH" in ln for ln in lines[at:]) == len(rows)


def test_report_has_quantized_rows_and_flags_a_wrong_quantized_kernel(monkeypatch):
    from mlxkv.kernels.quantized_paged_ref import ReferenceQuantizedPagedAttention

    class SkewedQuantized(ReferenceQuantizedPagedAttention):
        def partials(self, *args, scale, **kwargs):
            return super().partials(*args, scale=scale * 1.5, **kwargs)

    few = [v for v in variants.quantized_attention_variants()
           if v.call.template["D"] == 64 and v.call.template["BS"] == 16 and v.call.template["G"] == 1
           and v.call.inputs["context_lens"].shape[0] == 1][:2]
    monkeypatch.setattr(variants, "quantized_attention_variants", lambda: few)
    monkeypatch.setattr(variants, "emulation_classes", list)
    script = load_script()
    lines = []
    ok = script.metal_report(True, factory=lambda *key: REFERENCE, ctx=64, out=lines.append,
                             quantized_factory=lambda *key: ReferenceQuantizedPagedAttention(key[5], key[6]))
    rows = [ln for ln in before_mass(lines) if "bits=" in ln]
    assert ok and len(rows) == len(few) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "ok" and cells[2].endswith("ok") and all(float(c) > 0 for c in cells[3:5])
    lines = []
    ok = script.metal_report(True, factory=lambda *key: REFERENCE, ctx=64, out=lines.append,
                             quantized_factory=lambda *key: SkewedQuantized(key[5], key[6]))
    assert not ok and sum("MISMATCH" in ln for ln in before_mass(lines) if "bits=" in ln) == 2
