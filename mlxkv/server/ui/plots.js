// Small time-series plots and the block map, drawn by hand on <canvas> (no library).
"use strict";

window.Plots = (() => {
  // A line over [time, value] points (null values leave a gap); the window is the last `span` seconds.
  function series(canvas, points, { span = 300, unit = "", digits = 1 } = {}) {
    const ctx = fit(canvas);
    const w = canvas.width, h = canvas.height, pad = 4;
    ctx.clearRect(0, 0, w, h);
    const now = Date.now() / 1000;
    const shown = points.filter(([t]) => t >= now - span);
    const values = shown.map(([, v]) => v).filter((v) => v !== null && isFinite(v));
    const top = Math.max(1e-9, ...values);
    ctx.strokeStyle = "#d2d2d7";
    ctx.beginPath(); ctx.moveTo(0, h - pad); ctx.lineTo(w, h - pad); ctx.stroke();
    ctx.strokeStyle = "#0a66c2"; ctx.lineWidth = 1.5 * (window.devicePixelRatio || 1);
    ctx.beginPath();
    let drawing = false;
    for (const [t, v] of shown) {
      if (v === null || !isFinite(v)) { drawing = false; continue; }
      const x = w * (1 - (now - t) / span), y = h - pad - (h - 2 * pad) * (v / top);
      if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      drawing = true;
    }
    ctx.stroke();
    ctx.fillStyle = "#6e6e73";
    ctx.font = `${11 * (window.devicePixelRatio || 1)}px system-ui, sans-serif`;
    const last = values.length ? values[values.length - 1] : null;
    ctx.fillText(`max ${top.toFixed(digits)}${unit}   now ${last === null ? "–" : last.toFixed(digits) + unit}`, 4, 12 * (window.devicePixelRatio || 1));
  }

  // One cell per block, row-major; colour(i) gives each block's fill. Returns the block under a point of the
  // canvas (CSS pixels), or -1.
  function blocks(canvas, count, colour) {
    const ctx = fit(canvas);
    const w = canvas.width;
    const cell = Math.max(3, Math.floor(Math.sqrt((w * 120 * (window.devicePixelRatio || 1)) / Math.max(1, count))));
    const perRow = Math.max(1, Math.floor(w / cell));
    const rows = Math.ceil(count / perRow);
    canvas.height = Math.max(cell, rows * cell);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    for (let i = 0; i < count; i++) {
      ctx.fillStyle = colour(i);
      ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - 1, cell - 1);
    }
    return (x, y) => {
      const scale = canvas.width / canvas.clientWidth;
      const col = Math.floor((x * scale) / cell), row = Math.floor((y * scale) / cell);
      const i = row * perRow + col;
      return col < perRow && i >= 0 && i < count ? i : -1;
    };
  }

  function fit(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(100, Math.round(canvas.clientWidth * ratio));
    if (canvas.width !== width) canvas.width = width;
    return canvas.getContext("2d");
  }

  return { series, blocks };
})();
